"""Ditto servers: FedAvg of the devices' global-model updates; the devices also get lam."""

from dataclasses import dataclass

from omegaconf import MISSING

from hfl.config.schema import HierFAVGConfig
from strategies.fedavg import FedAvgServer


@dataclass
class DittoConfig(HierFAVGConfig):
    """Ditto's keys (conf/algorithm/ditto.yaml), registered as /schema/algorithm/ditto from here."""

    lam: float = MISSING


class DittoServer(FedAvgServer):
    schema = DittoConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    personalized = True  # PM = v
    keys = ("lam",)


SERVER = DittoServer
