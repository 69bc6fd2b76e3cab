"""B-HFL device: a node without children. It keeps its model W between calls, merges the
parent's model into it with its ``down`` optimiser (and residual ancestors' models with
``residual_down``), takes L minibatch SGD steps and keeps the result as W (its PM)."""

from __future__ import annotations

import json

from flwr.common import NDArrays, Scalar

from clients.base import DeviceClient
from clients.fedavg import sgd_step
from hfl.device import DeviceRuntime
from hfl.payload import unpack
from hfl.personal import fit_reply, local_steps
from hfl.training import to_ndarrays, to_tensors
from strategies.bhfl import merge_down


class BHFLClient(DeviceClient):
    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        dev = self.device
        received = unpack(parameters, config).parts
        kept = to_ndarrays(dev.personal) if dev.personal is not None and config["persistent"] else None
        # merge_down reads the device level's specs from this small algorithm view.
        alg = {"down": json.loads(str(config["down"])), "residual_down_opt": json.loads(str(config["residual_down"])),
               "levels": {}}
        state = dev.extra if config["persistent"] else {}
        theta, state = merge_down(alg, -1, kept, received, state)
        lr = float(config["alpha"])
        params, loss = local_steps(dev, to_tensors(theta), int(config["local_steps"]), lambda p, g: sgd_step(p, g, lr))
        dev.personal = params  # W, the device's persistent model (its PM)
        dev.extra = state if config["persistent"] else {}
        return fit_reply(dev, params, loss)


def make_client(device: DeviceRuntime) -> BHFLClient:
    return BHFLClient(device)
