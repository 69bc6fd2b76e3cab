"""B-HFL device: a node without children. It keeps its model W between calls, merges the
parent's model into it with its ``down`` optimiser (and residual ancestors' models with
``residual_down``), takes L minibatch SGD steps and keeps the result as W (its PM)."""

from __future__ import annotations

import json

import numpy as np
from flwr.common import NDArrays, Scalar

from hfl.device.client import DeviceClient
from hfl.device.plan import FitPlan, Phase, prox_update
from hfl.clock.timer import SIM_TIME
from hfl.device.state import DeviceRuntime
from hfl.rules.payload import unpack
from hfl.rules.personal import fit_reply
from hfl.device.training import Params, run_local_steps, to_ndarrays, to_tensors
from strategies.bhfl import merge_down


TRAINED_AT = "trained_at"  # extra state: the simulated time of its last own training session


def background_sessions(last: float | None, now: float, every: float, cap: int) -> int:
    """How many sessions of its own a persistent device trained between ``last`` and ``now``
    (one every ``every`` simulated seconds, at most ``cap``); none before its first call."""
    if last is None or every <= 0 or now <= last:
        return 0
    return min(cap, int((now - last) // every))


def catch_up(dev: DeviceRuntime, config: dict[str, Scalar]) -> None:
    """B-HFL's asynchronous leaves (algorithm.background_every, with the clock): a persistent
    device keeps training its model on its data between its parent's requests, ``local_steps``
    steps a session, one session every ``background_every`` simulated seconds. Done, in simulated
    time, when it is next asked (to train or to be tested), on the data it holds then."""
    every, now = float(config.get("background_every", 0.0) or 0.0), config.get(SIM_TIME)
    if every <= 0 or now is None or dev.personal is None:
        return
    last = float(dev.extra[TRAINED_AT]) if TRAINED_AT in dev.extra else None
    sessions = background_sessions(last, float(now), every, int(config.get("background_max", 0) or 0))
    if sessions:
        steps = sessions * int(config["local_steps"])
        dev.personal, _ = run_local_steps(dev.trainer, dev.personal, dev.x_train, dev.y_train, dev.sampler, steps,
                                          prox_update(float(config["alpha"]), 0.0, None))
        dev.extra = {**dev.extra, TRAINED_AT: np.array(last + sessions * every)}


class BHFLClient(DeviceClient):
    batched = True  # fit_plan: a node steps its devices together (hfl.accel.batched)

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan:
        dev = self.device
        received = unpack(parameters, config).parts
        if config["persistent"]:
            catch_up(dev, config)
        kept = to_ndarrays(dev.personal) if dev.personal is not None and config["persistent"] else None
        # merge_down reads the device level's specs from this small algorithm view.
        alg = {"down": json.loads(str(config["down"])), "residual_down_opt": json.loads(str(config["residual_down"])),
               "levels": {}}
        state = dev.extra if config["persistent"] else {}
        theta, state = merge_down(alg, -1, kept, received, state)

        def finish(models: list[Params], losses: list[float]) -> tuple[NDArrays, int, dict[str, Scalar]]:
            dev.personal = models[0]  # W, the device's persistent model (its PM)
            dev.extra = state if config["persistent"] else {}
            if config["persistent"] and SIM_TIME in config:  # its own sessions go on from here
                dev.extra = {**dev.extra, TRAINED_AT: np.array(float(config[SIM_TIME]))}
            return fit_reply(dev, models[0], losses[0])

        return FitPlan([Phase(to_tensors(theta), int(config["local_steps"]), float(config["alpha"]))], finish)


    def model_to_test(self, parameters: NDArrays, config: dict[str, Scalar]) -> Params:
        if config.get("model") == "personal":
            catch_up(self.device, config)  # tested as it is now, its own sessions included
        return super().model_to_test(parameters, config)


def make_client(device: DeviceRuntime) -> BHFLClient:
    return BHFLClient(device)
