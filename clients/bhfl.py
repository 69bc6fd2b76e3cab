"""B-HFL device: a node without children. It keeps its model W between calls, merges the
parent's model into it with its ``down`` optimiser (and residual ancestors' models with
``residual_down``), takes L minibatch SGD steps and keeps the result as W (its PM)."""

from __future__ import annotations

import json

from flwr.common import NDArrays, Scalar

from hfl.device.client import DeviceClient
from hfl.accel.batched import FitPlan, Phase
from hfl.device.state import DeviceRuntime
from hfl.node.payload import unpack
from hfl.rules.personal import fit_reply
from hfl.device.training import Params, to_ndarrays, to_tensors
from strategies.bhfl import merge_down


class BHFLClient(DeviceClient):
    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan:
        dev = self.device
        received = unpack(parameters, config).parts
        kept = to_ndarrays(dev.personal) if dev.personal is not None and config["persistent"] else None
        # merge_down reads the device level's specs from this small algorithm view.
        alg = {"down": json.loads(str(config["down"])), "residual_down_opt": json.loads(str(config["residual_down"])),
               "levels": {}}
        state = dev.extra if config["persistent"] else {}
        theta, state = merge_down(alg, -1, kept, received, state)

        def finish(models: list[Params], losses: list[float]) -> tuple[NDArrays, int, dict[str, Scalar]]:
            dev.personal = models[0]  # W, the device's persistent model (its PM)
            dev.extra = state if config["persistent"] else {}
            return fit_reply(dev, models[0], losses[0])

        return FitPlan([Phase(to_tensors(theta), int(config["local_steps"]), float(config["alpha"]))], finish)


def make_client(device: DeviceRuntime) -> BHFLClient:
    return BHFLClient(device)
