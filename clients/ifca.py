"""IFCA device (strategies.ifca): of the K cluster models it is sent, it trains the one with the
lowest loss on its training data (L SGD steps, FedAvg's local work) and reports which one; its
personal model is the cluster model it would pick. It keeps no state of its own."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flwr.common import NDArrays, Scalar

from hfl.device.plan import FitPlan, Phase
from hfl.device.client import DeviceClient
from hfl.device.state import DeviceRuntime
from hfl.device.training import LocalTrainer, Params, to_ndarrays, to_tensors
from hfl.rules.payload import unpack


def best_cluster(trainer: LocalTrainer, clusters: Sequence[NDArrays], x, y) -> int:  # noqa: ANN001 - tensors
    """The cluster whose model has the lowest mean loss on (x, y); ties go to the lowest index."""
    losses = [trainer.evaluate(to_tensors(model), x, y)[0] / max(len(y), 1) for model in clusters]
    return int(np.argmin(losses))


def clusters_in(parameters: NDArrays, config: dict[str, Scalar], prefix: str) -> list[NDArrays]:
    """The K cluster models of a parts payload: ``model``, ``c1``... (training), or ``ctx_c0``,
    ``ctx_c1``... (evaluation)."""
    parts = unpack(parameters, config).parts
    if prefix == "ctx_c":
        return [parts[f"ctx_c{k}"] for k in range(sum(1 for name in parts if name.startswith("ctx_c")))]
    return [parts["model"], *(parts[f"c{k}"] for k in range(1, 1 + sum(1 for n in parts if n[:1] == "c" and n[1:].isdigit())))]


class IfcaClient(DeviceClient):
    batched = True  # fit_plan: a node steps its devices together (hfl.accel.batched)

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan:
        dev = self.device
        clusters = clusters_in(parameters, config, "c")
        k = best_cluster(dev.trainer, clusters, dev.x_train, dev.y_train)

        def finish(models: list[Params], losses: list[float]) -> tuple[NDArrays, int, dict[str, Scalar]]:
            return to_ndarrays(models[0]), len(dev.y_train), {"device_id": dev.device_id, "cluster": k,
                                                              "train_loss": losses[0]}

        return FitPlan([Phase(to_tensors(clusters[k]), int(config["local_steps"]), float(config["alpha"]))], finish)

    def model_to_test(self, parameters: NDArrays, config: dict[str, Scalar]) -> Params:
        """Its personal model: the cluster model it would pick now."""
        if config.get("model") != "personal":
            return super().model_to_test(parameters, config)
        dev = self.device
        clusters = clusters_in(parameters, config, "ctx_c")
        return to_tensors(clusters[best_cluster(dev.trainer, clusters, dev.x_train, dev.y_train)])


def make_client(device: DeviceRuntime) -> IfcaClient:
    return IfcaClient(device)
