"""Ditto device (Li et al., ICML 2021, Algorithm 1).

Each round: L SGD steps on the received global model w (sent back, FedAvg'd), and L steps
on the persistent personal model v toward the received w:
``v <- v - lr * (grad f(v) + lam * (v - w_received))``.
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
    check_keys(alg, lam={"minimum": 0})


class DittoClient(DeviceClient):
    batched = True  # fit_plan: a node steps its devices together (hfl.accel.batched)

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan:
        dev = self.device
        received = to_tensors(parameters)
        lr, lam, steps = float(config["alpha"]), float(config["lam"]), int(config["local_steps"])
        v = dev.personal if dev.personal is not None else received
        # w's steps first, then v's, on the same sampler (the order the batches are drawn in).
        phases = [Phase(received, steps, lr), Phase(v, steps, lr, received, lam)]

        def finish(models: list[Params], losses: list[float]) -> tuple[NDArrays, int, dict[str, Scalar]]:
            dev.personal = models[1]
            return fit_reply(dev, models[0], losses[0])

        return FitPlan(phases, finish)


def make_client(device: DeviceRuntime) -> DittoClient:
    return DittoClient(device)
