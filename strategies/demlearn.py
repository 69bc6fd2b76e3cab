"""DemLearn servers on the fixed team tree (the authors' option of a hierarchy built once,
TREE_UPDATE_PERIOD = number of rounds; teams are the topology's).

Generalization (bottom-up): a team's group model is the mean of its devices' models, the
global model the mean of the team models. Specialization (top-down): between team rounds the
team sends its devices (1 - mix) * team mean + mix * global model; after the last team round
the plain team mean goes up so that the global mean is built from the devices alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING
from flwr.common import NDArrays

from hfl.config.schema import AlgorithmConfig
from hfl.algorithm import Replies
from hfl.rules.personal import mix
from strategies.fedavg import FedAvgServer


@dataclass
class DemLearnConfig(AlgorithmConfig):
    """DemLearn's keys (conf/algorithm/demlearn.yaml), registered as /schema/algorithm/demlearn from here."""

    mu: float = MISSING
    mix: float = MISSING


class DemLearnServer(FedAvgServer):
    schema = DemLearnConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    personalized = True  # PM = the device models c
    any_depth = False  # the fixed team tree: three tiers
    keys = ("mu", "mix")

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        mean = super().aggregate(model, replies)
        if self.ctx.is_root or replies.round >= self.params.team_rounds:
            return mean
        return mix(mean, self.ctx.payload.main, self.params.mix)


SERVER = DemLearnServer
