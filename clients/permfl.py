"""PerMFL device (Algorithm 1 of the full paper, device loop)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from flwr.common import NDArrays, Scalar

from clients.base import DeviceClient
from hfl.device import DeviceRuntime
from hfl.training import run_local_steps, to_ndarrays, to_tensors

T = TypeVar("T")


def device_step(theta: Sequence[T], grad: Sequence[T], anchor: Sequence[T], alpha: float, lam: float) -> list[T]:
    """theta <- theta - alpha * grad f(theta) - alpha * lam * (theta - w): one prox-SGD step toward w."""
    return [t - alpha * g - alpha * lam * (t - a) for t, g, a in zip(theta, grad, anchor, strict=True)]


class PerMFLClient(DeviceClient):
    """Starts from the team model w, takes L prox steps; its theta is the personalized model."""

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        dev = self.device
        anchor = to_tensors(parameters)
        alpha = float(config["alpha"])
        # prox_coefficient is lam, unless the authors' argument-order slip is reproduced (see conf).
        lam = float(config["prox_coefficient"])
        theta, loss = run_local_steps(
            dev.trainer, anchor, dev.x_train, dev.y_train, dev.sampler, int(config["local_steps"]),
            lambda th, g: device_step(th, g, anchor, alpha, lam),
        )
        dev.personal = theta
        return to_ndarrays(theta), len(dev.y_train), {"device_id": dev.device_id, "train_loss": loss}


def make_client(device: DeviceRuntime) -> PerMFLClient:
    return PerMFLClient(device)
