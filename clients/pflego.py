"""PFLEGO device: keeps its head W_i (K_i x (M+1)) and sends the body's exact gradient.

``fit`` receives theta, runs ``strategies.pflego.device_round`` (tau - 1 head steps on cached
features, then the joint gradient, then the head step with rho I/r), keeps W_i, and replies
with g_theta (payload ``gradient``) and N_i. With ``fit_test`` it also tests [theta, new W_i]
on its own test split: the paper's evaluation point, after the head update and before the
root's step.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.common import NDArrays, Scalar
from torch.func import functional_call

from hfl.device.client import DeviceClient
from hfl.device.state import DeviceRuntime
from hfl.rules.payload import pack
from hfl.seed import derive_seed
from hfl.device.training import Params, to_ndarrays, to_tensors
from strategies.pflego import device_round, initial_head, split_head


class PflegoClient(DeviceClient):
    bufferless = "sends the body's gradient, and running statistics have none"  # per-device path only (batched false)

    def __init__(self, device: DeviceRuntime) -> None:
        super().__init__(device)
        model = device.trainer.model
        self.body_module = model.body
        self.body_names = [name.removeprefix("body.") for name in device.trainer.names if name.startswith("body.")]
        self.feature_dim = int(model.feature_dim)

    def body(self, theta: Params, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.body_module, dict(zip(self.body_names, theta, strict=True)), (x,))

    def head(self) -> torch.Tensor:
        """W_i: kept, or U[0, 1) seeded by (run seed, device) before its first round."""
        dev = self.device
        if "head" in dev.extra:
            return torch.from_numpy(np.asarray(dev.extra["head"], dtype=np.float32).copy())
        k = len(dev.classes) if dev.classes is not None else int(dev.y_train.max()) + 1
        return initial_head(k, self.feature_dim, derive_seed(dev.seed, "head", dev.device_id))

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        dev = self.device
        theta = to_tensors(parameters)
        g_theta, _, head, loss = device_round(
            self.body, theta, self.head(), dev.x_train, dev.y_train,
            tau=int(config["local_steps"]), client_lr=float(config["alpha"]), head_lr=float(config["head_lr"]),
        )
        dev.extra["head"] = head.numpy()
        arrays, meta = pack("gradient", to_ndarrays(g_theta))
        return arrays, len(dev.y_train), {**meta, "device_id": dev.device_id, "train_loss": loss,
                                          **self.fit_test(theta + split_head(head), config)}

    def model_to_test(self, parameters: NDArrays, config: dict[str, Scalar]) -> Params:
        """The PM: the body it is sent (the root's theta) completed by its own head."""
        return to_tensors(parameters) + split_head(self.head())


def make_client(device: DeviceRuntime) -> PflegoClient:
    return PflegoClient(device)
