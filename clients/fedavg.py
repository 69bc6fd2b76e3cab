"""FedAvg / HierFAVG device: L plain minibatch SGD steps from the model it receives."""

from __future__ import annotations

from flwr.common import NDArrays, Scalar

from hfl.device.client import DeviceClient
from hfl.device.state import DeviceRuntime
from hfl.device.plan import FitPlan, Phase
from hfl.device.training import Params, to_ndarrays, to_tensors


class FedAvgClient(DeviceClient):
    batched = True  # fit_plan: a node steps its devices together (hfl.accel.batched)

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan:
        dev = self.device

        def finish(models: list[Params], losses: list[float]) -> tuple[NDArrays, int, dict[str, Scalar]]:
            # Its last local model is not kept: FedAvg has no PM, and a kept model is written with
            # the device's state every round (a CNN's 9 MB for every device ever sampled).
            return to_ndarrays(models[0]), len(dev.y_train), {"device_id": dev.device_id, "train_loss": losses[0],
                                                              **self.fit_test(models[0], config)}

        return FitPlan([Phase(to_tensors(parameters), int(config["local_steps"]), float(config["alpha"]))], finish)


def make_client(device: DeviceRuntime) -> FedAvgClient:
    return FedAvgClient(device)
