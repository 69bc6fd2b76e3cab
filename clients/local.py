"""Local: every device trains its own model on its own data and never shares it."""

from __future__ import annotations

from flwr.common import NDArrays, Scalar

from hfl.device.client import DeviceClient
from hfl.device.plan import FitPlan, Phase
from hfl.device.state import DeviceRuntime
from hfl.device.training import Params, to_tensors


class LocalClient(DeviceClient):
    """L plain SGD steps on the device's own model (starting from the shared initial model
    the first time). It echoes the model it received: nothing of its own leaves the device."""

    batched = True  # fit_plan: a node steps its devices together (hfl.accel.batched)

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan:
        dev = self.device
        start = dev.personal if dev.personal is not None else to_tensors(parameters)

        def finish(models: list[Params], losses: list[float]) -> tuple[NDArrays, int, dict[str, Scalar]]:
            dev.personal = models[0]
            return parameters, len(dev.y_train), {"device_id": dev.device_id, "train_loss": losses[0]}

        return FitPlan([Phase(start, int(config["local_steps"]), float(config["alpha"]))], finish)


def make_client(device: DeviceRuntime) -> LocalClient:
    return LocalClient(device)
