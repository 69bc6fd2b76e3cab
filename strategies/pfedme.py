"""pFedMe servers: teams take the weighted mean of their devices' local models; the global
server moves by beta toward the weighted mean of the team models,
x <- (1 - beta) x + beta * mean(w). With K = 1 this is pFedMe's server over all devices."""

from __future__ import annotations

from flwr.common import NDArrays

from hfl.algorithm import Replies
from hfl.rules.personal import mix
from strategies.fedavg import FedAvgServer


class PFedMeServer(FedAvgServer):
    personalized = True  # PM = theta
    any_depth = False  # three tiers only
    keys = ("lam", "personal_lr", "inner_steps")

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        mean = super().aggregate(model, replies)
        return mix(model, mean, float(self.alg["beta"])) if self.ctx.is_root else mean


SERVER = PFedMeServer
