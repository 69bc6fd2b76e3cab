"""FedPer device (Arivazhagan et al., 2019): a shared body and a personal head.

The device trains [received body, own head] for L SGD steps, keeps the result (its PM) and
sends back the trained body with the head it received, so its head never leaves it; the
servers' means of the heads are therefore the untouched initial head, which no device uses.
The head is the last ``head_layers`` layers; with MCLR (one layer) there is no body and
FedPer is Local.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.common import NDArrays, Scalar

from clients.base import DeviceClient
from clients.fedavg import sgd_step
from hfl.device import DeviceRuntime
from hfl.personal import check_keys, fit_reply, head_mask, local_steps, splice
from hfl.training import Params, to_tensors


def check_config(alg: Mapping[str, Any]) -> None:
    check_keys(alg, head_layers={"integer": True, "minimum": 1})


class HeadClient(DeviceClient):
    """A device whose personal model is [shared body, own head]."""

    def train(self, start: Params, mask: list[bool], config: dict[str, Scalar]) -> tuple[Params, float]:
        lr = float(config["alpha"])
        return local_steps(self.device, start, int(config["local_steps"]), lambda p, g: sgd_step(p, g, lr))

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        dev = self.device
        received = to_tensors(parameters)
        mask = head_mask(dev.trainer.names, int(config["head_layers"]))
        start = splice(received, dev.personal, mask) if dev.personal is not None else received
        dev.personal, loss = self.train(start, mask, config)
        arrays, n, metrics = fit_reply(dev, splice(dev.personal, received, mask), loss)
        return arrays, n, {**metrics, **self.fit_test(dev.personal, config)}


def make_client(device: DeviceRuntime) -> HeadClient:
    return HeadClient(device)
