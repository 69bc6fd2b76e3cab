"""What every device client shares: evaluation of a given or of its personal model."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from flwr.client import NumPyClient
from flwr.common import NDArrays, Scalar

from hfl.device.plan import FitPlan, run_plan
from hfl.device.privacy import LOCAL_CLIP, LOCAL_NOISE, LOCAL_SEED, privatize_local
from hfl.device.state import DeviceRuntime
from hfl.device.training import Params, to_ndarrays, to_tensors
from hfl.seed import rng

# A fit config's round of the node asking (1..K within its call; e.g. L2GD's pulls depend on it).
NODE_ROUND = "node_round"


# A reply's metrics say it was privatized (local DP), so that a fit built on another (super().fit, a
# plan's fit) is noised once.
LOCAL_DONE = "dp_local"


def privatize_reply(reply: tuple[NDArrays, int, dict[str, Scalar]], sent: NDArrays, config: dict[str, Scalar],
                    device_id: int) -> tuple[NDArrays, int, dict[str, Scalar]]:
    """Local DP (privacy.level=local, hfl.node.privacy): the device's reply with its update (reply -
    the model it was sent) clipped and noised, seeded by the run's seed, the device and the round,
    before it leaves the device; as it is without local DP in the config or if already done."""
    arrays, num_examples, metrics = reply
    if LOCAL_CLIP not in config or metrics.get(LOCAL_DONE):
        return reply
    if len(arrays) != len(sent) or any(np.shape(a) != np.shape(s) for a, s in zip(arrays, sent, strict=False)):
        raise ValueError(f"privacy.level=local: device {device_id}'s reply is not a model shaped as the one it was "
                         "sent, so it has no update to clip and noise")
    generator = rng(int(config[LOCAL_SEED]), "privacy-local", int(device_id), str(config.get("round_path", "")))
    private = privatize_local(list(arrays), list(sent), float(config[LOCAL_CLIP]), float(config[LOCAL_NOISE]),
                              generator)
    return private, num_examples, {**metrics, LOCAL_DONE: 1}


def _private_fit(fit: Callable) -> Callable:
    @functools.wraps(fit)
    def wrapped(self: DeviceClient, parameters: NDArrays, config: dict[str, Scalar]) -> Any:
        return privatize_reply(fit(self, parameters, config), parameters, config, self.device.device_id)

    wrapped.private = True  # type: ignore[attr-defined]
    return wrapped


def _private_plan(fit_plan: Callable) -> Callable:
    @functools.wraps(fit_plan)
    def wrapped(self: DeviceClient, parameters: NDArrays, config: dict[str, Scalar]) -> Any:
        plan = fit_plan(self, parameters, config)
        if plan is None or LOCAL_CLIP not in config:
            return plan
        if not isinstance(plan, FitPlan):  # a plan stepped with its group's (hfl.accel): the device's own fit instead
            return None
        finish = plan.finish
        # The per-device path and the batched one (hfl.accel.batched) both end in the plan's finish.
        plan.finish = lambda models, losses: privatize_reply(finish(models, losses), parameters, config,
                                                             self.device.device_id)
        return plan

    wrapped.private = True  # type: ignore[attr-defined]
    return wrapped


class DeviceClient(NumPyClient):
    """Base device. ``evaluate`` with config ``{"model": "personal"}`` tests the device's own
    model; any other config tests the parameters it was sent (the global model or a server level's).

    What the device is, read by the engine from the class (never a config key): ``batched``
    (its ``fit_plan`` lets a node step all its devices as one computation, hfl.accel.batched;
    ``runtime.batched`` picks between the paths) and ``bufferless`` (why it cannot carry a
    model's buffers, BatchNorm's running statistics: it steps models outside
    hfl.device.training.run_local_steps; empty: it can)."""

    batched: ClassVar[bool] = False
    bufferless: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every device's ``fit`` and ``fit_plan`` (where a class defines its own) reply with local DP
        when the config asks for it: the one path every client shares, whatever it overrides."""
        super().__init_subclass__(**kwargs)
        for name, wrap in (("fit", _private_fit), ("fit_plan", _private_plan)):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "private", False):
                setattr(cls, name, wrap(method))

    def __init__(self, device: DeviceRuntime) -> None:
        self.device = device

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan | None:
        """This fit as phases of (prox-)SGD steps and a reply (hfl.accel.batched), so that a node can step
        all its devices together; None where the algorithm's local work is not of that form."""
        return None

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        plan = self.fit_plan(parameters, config)
        if plan is None:
            raise NotImplementedError(f"{type(self).__name__} defines neither fit nor fit_plan")
        return privatize_reply(run_plan(self.device, plan), parameters, config, self.device.device_id)

    def get_parameters(self, config: dict[str, Scalar]) -> NDArrays:
        params = self.device.personal or self.device.trainer.initial_params()
        return to_ndarrays(params)

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        dev = self.device
        loss_sum, correct, n = dev.trainer.evaluate(self.model_to_test(parameters, config), dev.x_test, dev.y_test)
        return loss_sum / n, n, {"device_id": dev.device_id, "correct": correct}

    def fit_test(self, params: Params, config: dict[str, Scalar]) -> dict[str, Scalar]:
        """With ``fit_test`` in the config: the model it just trained, on its own test split
        (counters summed up the tree into the root's ``pflego_accuracy``, the PFLEGO paper's figure)."""
        if not config.get("fit_test"):
            return {}
        _, correct, tested = self.device.trainer.evaluate(params, self.device.x_test, self.device.y_test)
        return {"fit_test_correct": correct, "fit_test_samples": tested}

    def tests_sent_model(self, config: dict[str, Scalar]) -> bool:
        """Whether ``model_to_test`` is the sent model as it is (``to_tensors(parameters)``): then a
        node converts it once for all such devices (hfl.accel.batched_eval.BatchedEvaluate)."""
        return config.get("model") != "personal" and type(self).model_to_test is DeviceClient.model_to_test

    def model_to_test(self, parameters: NDArrays, config: dict[str, Scalar]) -> Params:
        """The model ``evaluate`` tests: the device's own for ``model=personal``, else the one sent.
        Algorithms whose exchanged or personal state is not a plain model override this."""
        dev = self.device
        if config.get("model") == "personal":
            if dev.personal is None:
                if config.get("fallback") and len(parameters):
                    # Never sampled yet (partial participation): it holds no model of its own, and
                    # its first call would start from its server's model, which is what it was sent.
                    return to_tensors(parameters)
                raise RuntimeError(f"device {dev.device_id} has no personalized model yet")
            return dev.personal
        return to_tensors(parameters)
