"""FedRep device (Collins et al., ICML 2021, Algorithm 1): like FedPer, but local training
first updates only the head (``head_steps`` SGD steps, body frozen), then only the body
(``local_steps`` steps, head frozen)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.common import NDArrays, Scalar

from clients.fedper import HeadClient
from clients.fedper import check_config as check_head
from hfl.device.state import DeviceRuntime
from hfl.rules.personal import check_keys, local_steps, masked_sgd_step


def check_config(alg: Mapping[str, Any]) -> None:
    check_head(alg)
    check_keys(alg, head_steps={"integer": True, "minimum": 1})


class FedRepClient(HeadClient):
    batched = False  # its two phases step different masks of the model: the per-device path

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> None:
        return None  # masked steps: the per-device path (FedRepClient.batched is false)

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        received, start, mask = self.start(parameters, config)
        dev, lr = self.device, float(config["alpha"])
        body = [not m for m in mask]
        params, _ = local_steps(dev, start, int(config["head_steps"]), lambda p, g: masked_sgd_step(p, g, lr, mask))
        params, loss = local_steps(dev, params, int(config["local_steps"]), lambda p, g: masked_sgd_step(p, g, lr, body))
        return self.reply(params, loss, received, mask, config)


def make_client(device: DeviceRuntime) -> FedRepClient:
    return FedRepClient(device)
