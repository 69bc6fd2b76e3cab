"""FedProx servers: FedAvg's weighted means; the devices also get mu."""

from dataclasses import dataclass

from omegaconf import MISSING

from hfl.config.schema import HierFAVGConfig
from strategies.fedavg import FedAvgServer


@dataclass
class FedProxConfig(HierFAVGConfig):
    """FedProx's keys (conf/algorithm/fedprox.yaml), registered as /schema/algorithm/fedprox from here."""

    mu: float = MISSING


class FedProxServer(FedAvgServer):
    schema = FedProxConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    keys = ("mu",)


SERVER = FedProxServer
