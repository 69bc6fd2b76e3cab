"""FedAvg / HierFAVG device: L plain minibatch SGD steps from the model it receives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from flwr.common import NDArrays, Scalar

from clients.base import DeviceClient
from hfl.device import DeviceRuntime
from hfl.training import run_local_steps, to_ndarrays, to_tensors

T = TypeVar("T")


def sgd_step(params: Sequence[T], grad: Sequence[T], lr: float) -> list[T]:
    """params <- params - lr * grad."""
    return [p - lr * g for p, g in zip(params, grad, strict=True)]


class FedAvgClient(DeviceClient):
    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        dev = self.device
        lr = float(config["alpha"])
        params, loss = run_local_steps(
            dev.trainer, to_tensors(parameters), dev.x_train, dev.y_train, dev.sampler,
            int(config["local_steps"]), lambda p, g: sgd_step(p, g, lr),
        )
        dev.personal = params  # its last local model; FedAvg reports no PM from it
        return to_ndarrays(params), len(dev.y_train), {"device_id": dev.device_id, "train_loss": loss,
                                                       **self.fit_test(params, config)}


def make_client(device: DeviceRuntime) -> FedAvgClient:
    return FedAvgClient(device)
