"""DemLearn device (Nguyen et al., "Self-organizing democratized learning", 2022; the authors'
DemLearn-P code) on the fixed team tree.

The model m a device receives is its parent group's model (the global model in team round 1,
its team's model afterwards). Top-down specialization: c <- (1 - mix) c + mix * m; then L
minibatch steps on f + (mu/2)||c - m||^2. c is the device's PM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.common import NDArrays, Scalar

from hfl.device.client import DeviceClient
from clients.prox import pull_then_train
from hfl.device.plan import FitPlan
from hfl.device.state import DeviceRuntime
from hfl.rules.personal import check_keys


def check_config(alg: Mapping[str, Any]) -> None:
    check_keys(alg, mu={"minimum": 0}, mix={"minimum": 0, "maximum": 1})


class DemLearnClient(DeviceClient):
    batched = True  # fit_plan: a node steps its devices together (hfl.accel.batched)

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan:
        return pull_then_train(self.device, parameters, float(config["mix"]), int(config["local_steps"]),
                               float(config["alpha"]), prox=float(config["mu"]))


def make_client(device: DeviceRuntime) -> DemLearnClient:
    return DemLearnClient(device)
