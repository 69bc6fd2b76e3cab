"""Local: servers that keep the model they have (nothing is aggregated)."""

from __future__ import annotations

from flwr.common import NDArrays

from hfl.algorithm import Replies
from strategies.fedavg import FedAvgServer


class KeepServer(FedAvgServer):
    merges_replies = False  # nothing is merged: a policy other than sync has nothing to act on
    personalized = True  # the device's own model is its PM
    global_model = False  # there is no global model to test

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        return model


SERVER = KeepServer
