"""PerMFL device (Algorithm 1 of the full paper, device loop)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from flwr.common import NDArrays, Scalar

from hfl.device.client import DeviceClient
from hfl.device.state import DeviceRuntime
from hfl.device.plan import FitPlan, Phase
from hfl.device.training import Params, to_ndarrays, to_tensors

T = TypeVar("T")


def device_step(theta: Sequence[T], grad: Sequence[T], anchor: Sequence[T], alpha: float, lam: float) -> list[T]:
    """theta <- theta - alpha * grad f(theta) - alpha * lam * (theta - w): one prox-SGD step toward w
    (hfl.device.plan.prox_update computes the same expression)."""
    return [t - alpha * g - alpha * lam * (t - a) for t, g, a in zip(theta, grad, anchor, strict=True)]


class PerMFLClient(DeviceClient):
    """Starts from the team model w, takes L prox steps; its theta is the personalized model."""

    batched = True  # fit_plan: a node steps its devices together (hfl.accel.batched)

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan:
        dev = self.device
        anchor = to_tensors(parameters)
        # prox_coefficient is lam, unless the authors' argument-order slip is reproduced (see conf).
        phase = Phase(anchor, int(config["local_steps"]), float(config["alpha"]), anchor, float(config["prox_coefficient"]))

        def finish(models: list[Params], losses: list[float]) -> tuple[NDArrays, int, dict[str, Scalar]]:
            dev.personal = models[0]
            return to_ndarrays(models[0]), len(dev.y_train), {"device_id": dev.device_id, "train_loss": losses[0]}

        return FitPlan([phase], finish)


def make_client(device: DeviceRuntime) -> PerMFLClient:
    return PerMFLClient(device)
