"""What every device client shares: evaluation of a given or of its personal model."""

from __future__ import annotations

from typing import ClassVar

from flwr.client import NumPyClient
from flwr.common import NDArrays, Scalar

from hfl.device.plan import FitPlan, run_plan
from hfl.device.state import DeviceRuntime
from hfl.device.training import Params, to_ndarrays, to_tensors

# A fit config's round of the node asking (1..K within its call; e.g. L2GD's pulls depend on it).
NODE_ROUND = "node_round"


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
        return run_plan(self.device, plan)

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
