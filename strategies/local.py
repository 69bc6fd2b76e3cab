"""Local: servers that keep the model they have (nothing is aggregated)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING
from flwr.common import NDArrays

from hfl.config.schema import HierFAVGConfig
from hfl.algorithm import Replies
from strategies.fedavg import FedAvgServer


@dataclass
class LocalConfig(HierFAVGConfig):
    """Local training: no keys of its own."""


class KeepServer(FedAvgServer):
    schema = LocalConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    merges_replies = False  # nothing is merged: a policy other than sync has nothing to act on
    personalized = True  # the device's own model is its PM
    global_model = False  # there is no global model to test

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        return model


SERVER = KeepServer
