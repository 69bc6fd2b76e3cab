"""pFedMe servers: teams take the weighted mean of their devices' local models; the global
server moves by beta toward the weighted mean of the team models,
x <- (1 - beta) x + beta * mean(w). With K = 1 this is pFedMe's server over all devices."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING
from flwr.common import NDArrays

from hfl.config.schema import AlgorithmConfig
from hfl.algorithm import Replies
from hfl.rules.personal import mix
from strategies.fedavg import FedAvgServer


@dataclass
class PFedMeConfig(AlgorithmConfig):
    """PFedMe's keys (conf/algorithm/pfedme.yaml), registered as /schema/algorithm/pfedme from here."""

    lam: float = MISSING
    beta: float = MISSING
    inner_steps: int = MISSING
    personal_lr: float = MISSING


class PFedMeServer(FedAvgServer):
    schema = PFedMeConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    personalized = True  # PM = theta
    any_depth = False  # three tiers only
    keys = ("lam", "personal_lr", "inner_steps")

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        mean = super().aggregate(model, replies)
        return mix(model, mean, self.params.beta) if self.ctx.is_root else mean


SERVER = PFedMeServer
