"""FedPer servers: FedAvg's weighted means (of the bodies; heads come back unchanged)."""

from dataclasses import dataclass

from omegaconf import MISSING

from strategies.fedavg import FedAvgConfig
from strategies.fedavg import FedAvgServer


@dataclass
class FedPerConfig(FedAvgConfig):
    """FedPer's keys (conf/algorithm/fedper.yaml), registered as /schema/algorithm/fedper from here."""

    head_layers: int = MISSING


class FedPerServer(FedAvgServer):
    schema = FedPerConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    personalized = True  # PM = [shared body, own head]
    global_model = False  # the servers hold no usable head
    keys = ("head_layers",)


SERVER = FedPerServer
