"""pFedMe device (Dinh et al., NeurIPS 2020, Algorithm 1).

R local rounds (``local_steps``), each on one minibatch: the personal model theta solves
min f(theta) + (lam/2)||theta - w||^2 approximately with K (``inner_steps``) gradient steps of
size ``personal_lr``, then the local model moves toward it: w <- w - alpha * lam * (w - theta).
theta starts at the received global model and is kept as the device's PM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.common import NDArrays, Scalar

from hfl.device.client import DeviceClient
from hfl.device.plan import FitPlan, Phase
from hfl.device.state import DeviceRuntime
from hfl.rules.personal import check_keys, fit_reply
from hfl.device.training import Params, to_tensors


def check_config(alg: Mapping[str, Any]) -> None:
    check_keys(alg, lam={"minimum": 0}, personal_lr={"minimum": 0, "open_min": True},
               inner_steps={"integer": True, "minimum": 1}, beta={"minimum": 0, "open_min": True})


class PFedMeClient(DeviceClient):
    batched = True  # fit_plan: a node steps its devices together (hfl.accel.batched)
    bufferless = "takes its own inner gradient steps"

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan:
        dev = self.device
        lam, plr, eta = float(config["lam"]), float(config["personal_lr"]), float(config["alpha"])
        w = to_tensors(parameters)
        # On each minibatch: K steps theta <- theta - plr*(grad + lam*(theta - w)), then
        # w <- w - eta*lam*(w - theta) (the phase's pull).
        phase = Phase(w, int(config["local_steps"]), plr, w, lam, inner_steps=int(config["inner_steps"]), pull=eta * lam)

        def finish(models: list[Params], losses: list[float]) -> tuple[NDArrays, int, dict[str, Scalar]]:
            dev.personal = models[0]
            return fit_reply(dev, phase.moved_anchor, losses[0])

        return FitPlan([phase], finish)


def make_client(device: DeviceRuntime) -> PFedMeClient:
    return PFedMeClient(device)
