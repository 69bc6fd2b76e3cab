"""pFedBayes servers: the exchanged model is [mu..., rho...]; the global distribution starts
at the run's initial weights as means with rho = rho_offset everywhere. Teams average their
devices' localized global distributions; the global server moves by beta toward the mean of
the team ones (pFedMe's server, which pFedBayes's code inherits)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING
import numpy as np
from flwr.common import NDArrays

from hfl.config.schema import AlgorithmConfig
from hfl.algorithm import model_from_state
from strategies.pfedme import PFedMeServer


def bayesian_initial(initial: NDArrays, rho_offset: float) -> NDArrays:
    """[mu = the initial weights..., rho = rho_offset in their shapes...]."""
    return [*initial, *[np.full_like(a, rho_offset) for a in initial]]


@dataclass
class PFedBayesConfig(AlgorithmConfig):
    """PFedBayes's keys (conf/algorithm/pfedbayes.yaml), registered as /schema/algorithm/pfedbayes from here."""

    personal_steps: int = MISSING
    personal_lr: float = MISSING
    zeta: float = MISSING
    rho_offset: float = MISSING
    noise_scale: float = MISSING
    beta: float = MISSING


class PFedBayesServer(PFedMeServer):
    schema = PFedBayesConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    keys = ("personal_lr", "zeta", "personal_steps", "noise_scale")

    def start(self) -> NDArrays:
        if self.ctx.is_root:  # the distribution the root stored, or the initial weights as means
            stored = model_from_state(self.ctx.state)
            return stored or bayesian_initial(self.ctx.payload.main, self.params.rho_offset)
        return super().start()


SERVER = PFedBayesServer
