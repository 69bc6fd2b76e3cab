"""L2GD (Hanzely & Richtarik, 2020) and its multi-tier form AL2GD (Lyu, Hanzely & Kolar, 2022)
on the team tree: each device keeps its own model theta (its PM) and, every team round (the
lowest node's round, ``NODE_ROUND`` in its fit config),
first steps toward the model it received, then takes L plain SGD steps.

    team round 1 (the global model x arrives):   theta <- theta - global_pull * (theta - x)
    team rounds 2..K (the team mean arrives):    theta <- theta - team_pull * (theta - theta_bar)
    then L times:                                theta <- theta - local_lr * grad f(theta)

The team strategy derives the three step sizes (strategies.l2gd.step_sizes).
"""

from __future__ import annotations

from flwr.common import NDArrays, Scalar

from hfl.device.client import NODE_ROUND, DeviceClient
from clients.prox import pull_then_train
from hfl.device.plan import FitPlan
from hfl.device.state import DeviceRuntime


class L2GDClient(DeviceClient):
    batched = True  # fit_plan: a node steps its devices together (hfl.accel.batched)

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan:
        pull = config["global_pull"] if int(config[NODE_ROUND]) == 1 else config["team_pull"]
        return pull_then_train(self.device, parameters, float(pull), int(config["local_steps"]),
                               float(config["local_lr"]))


def make_client(device: DeviceRuntime) -> L2GDClient:
    return L2GDClient(device)
