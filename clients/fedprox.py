"""FedProx device (Li et al., MLSys 2020): L minibatch steps on f + (mu/2)||w - w_received||^2."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.common import NDArrays, Scalar

from hfl.device.client import DeviceClient
from hfl.device.plan import FitPlan, Phase
from hfl.device.state import DeviceRuntime
from hfl.rules.personal import check_keys, fit_reply
from hfl.device.training import to_tensors


def check_config(alg: Mapping[str, Any]) -> None:
    check_keys(alg, mu={"minimum": 0})


class FedProxClient(DeviceClient):
    batched = True  # fit_plan: a node steps its devices together (hfl.accel.batched)

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan:
        received = to_tensors(parameters)
        phase = Phase(received, int(config["local_steps"]), float(config["alpha"]), received, float(config["mu"]))
        return FitPlan([phase], lambda models, losses: fit_reply(self.device, models[0], losses[0]))


def make_client(device: DeviceRuntime) -> FedProxClient:
    return FedProxClient(device)
