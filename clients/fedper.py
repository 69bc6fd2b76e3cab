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

from hfl.device.client import DeviceClient
from hfl.device.plan import FitPlan, Phase
from hfl.device.state import DeviceRuntime
from hfl.rules.personal import check_keys, fit_reply, head_mask, splice
from hfl.device.training import Params, to_tensors


def check_config(alg: Mapping[str, Any]) -> None:
    check_keys(alg, head_layers={"integer": True, "minimum": 1})


class HeadClient(DeviceClient):
    """A device whose personal model is [shared body, own head]: L plain SGD steps on the whole
    of [received body, own head]."""

    batched = True  # fit_plan: a node steps its devices together (hfl.accel.batched)

    def start(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[Params, Params, list[bool]]:
        """The received model, where training starts ([its body, the kept head]) and the head mask."""
        dev = self.device
        received = to_tensors(parameters)
        mask = head_mask(dev.trainer.names, int(config["head_layers"]))
        return received, splice(received, dev.personal, mask) if dev.personal is not None else received, mask

    def reply(self, trained: Params, loss: float, received: Params, mask: list[bool],
              config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        """Keeps ``trained``; sends its body with the received head."""
        dev = self.device
        dev.personal = trained
        arrays, n, metrics = fit_reply(dev, splice(trained, received, mask), loss)
        return arrays, n, {**metrics, **self.fit_test(trained, config)}

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan | None:
        received, start, mask = self.start(parameters, config)
        phase = Phase(start, int(config["local_steps"]), float(config["alpha"]))
        return FitPlan([phase], lambda models, losses: self.reply(models[0], losses[0], received, mask, config))


def make_client(device: DeviceRuntime) -> HeadClient:
    return HeadClient(device)
