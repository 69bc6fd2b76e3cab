"""L2GD/DemLearn's device round, shared: move the kept model toward the received one, then train
on f + (prox/2)||theta - received||^2 (prox 0: plain SGD)."""

from __future__ import annotations

from flwr.common import NDArrays, Scalar

from hfl.device.plan import FitPlan, Phase
from hfl.device.state import DeviceRuntime
from hfl.rules.personal import fit_reply, mix
from hfl.device.training import Params, to_tensors


def pull_then_train(dev: DeviceRuntime, parameters: NDArrays, pull: float, steps: int, lr: float,
                    prox: float = 0.0) -> FitPlan:
    """theta <- (1 - pull) theta + pull * received (theta = received the first time), then ``steps``
    prox-SGD steps toward the received model (PerMFL's device step). The result is kept as the
    device's model (its PM) and sent."""
    received = to_tensors(parameters)
    theta = received if dev.personal is None else mix(dev.personal, received, pull)

    def finish(models: list[Params], losses: list[float]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        dev.personal = models[0]
        return fit_reply(dev, models[0], losses[0])

    return FitPlan([Phase(theta, steps, lr, received, prox)], finish)
