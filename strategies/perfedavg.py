"""Per-FedAvg servers: FedAvg's weighted means of the meta-models; the devices also get
beta, the variant (fo/hf) and delta."""

from dataclasses import dataclass

from omegaconf import MISSING

from hfl.config.schema import AlgorithmConfig
from strategies.fedavg import FedAvgServer


@dataclass
class PerFedAvgConfig(AlgorithmConfig):
    """Per-FedAvg, both variants."""

    beta: float = MISSING
    variant: str = MISSING  # fo | hf
    delta: float = MISSING


class PerFedAvgServer(FedAvgServer):
    schema = PerFedAvgConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    personalized = True  # PM = the global model after one alpha-step
    any_depth = False  # three tiers only
    keys = ("beta", "variant", "delta")

    @classmethod
    def device_evaluation_config(cls, params, depth):  # noqa: ANN001, ANN206 - ServerRule's signature
        # A device never trained yet (sampled out, dropped) adapts the model it would start from with alpha.
        return {"alpha": params.alpha}


SERVER = PerFedAvgServer
