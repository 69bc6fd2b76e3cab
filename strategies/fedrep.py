"""FedRep servers: FedAvg's weighted means (of the bodies; heads come back unchanged)."""

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from hfl.config.schema import HierFAVGConfig
from strategies.fedavg import FedAvgServer


@dataclass
class FedRepConfig(HierFAVGConfig):
    """FedRep's keys (conf/algorithm/fedrep.yaml), registered as /schema/algorithm/fedrep from here."""

    head_steps: Any = MISSING  # an integer >= 1: checked by strategies.fedrep (tests pin its message)
    head_layers: int = MISSING


class FedRepServer(FedAvgServer):
    schema = FedRepConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    personalized = True  # PM = [shared body, own head]
    global_model = False  # PM only
    keys = ("head_layers", "head_steps")


SERVER = FedRepServer
