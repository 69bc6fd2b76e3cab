"""L2GD / AL2GD servers on the team tree: teams and the global server take plain means of the
devices' models (theta_bar, then x); the team also sends the step sizes below.

L2GD is loopless: every iteration is, at random, a local gradient step or a communication
that pulls the models toward an average, each scaled by the inverse of its probability so
that in expectation every term of the gradient gets the step ``alpha``. On the tree the
events are scheduled instead: per global round a device makes E = K (L + 1) moves, K L local
steps, K - 1 pulls toward its team mean and one pull toward the global model. Scaling each
by the inverse of its frequency gives every term the same total ``alpha * E`` per round:

    local_lr    = alpha * E / (K L)
    global_pull = alpha * lam_global * E
    team_pull   = alpha * lam_team * E / (K - 1)

for the penalty (lam_global/2)||theta - x||^2 + (lam_team/2)||theta - theta_bar_team||^2, i.e.
Lyu et al.'s gamma_ij * alpha_j and gamma_ij * (1 - alpha_j) with their tau = 0 (the split in
which a device needs only the model it is sent). K = 1 and lam_team = 0 is flat L2GD.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from omegaconf import MISSING
from flwr.common import Scalar

from hfl.config.schema import AlgorithmConfig
from hfl.errors import ConfigError
from hfl.rules.personal import check_keys
from strategies.fedavg import FedAvgServer


def step_sizes(alg: Mapping[str, Any]) -> dict[str, float]:
    """local_lr, global_pull and team_pull for the algorithm's alpha, lambdas, K and L;
    ConfigError where a pull would overshoot (> 1) or a penalty would never be applied."""
    check_keys(alg, lam_global={"minimum": 0}, lam_team={"minimum": 0})
    k, steps, alpha = int(alg["team_rounds"]), int(alg["local_steps"]), float(alg["alpha"])
    if k == 1 and alg["lam_team"] > 0:
        raise ConfigError("algorithm.lam_team", "needs team_rounds > 1 (with one team round there is no team pull)")
    events = k * (steps + 1)
    sizes = {
        "local_lr": alpha * events / (k * steps),
        "global_pull": alpha * alg["lam_global"] * events,
        "team_pull": alpha * alg["lam_team"] * events / (k - 1) if k > 1 else 0.0,
    }
    for name, key in (("global_pull", "lam_global"), ("team_pull", "lam_team")):
        if sizes[name] > 1:
            raise ConfigError(f"algorithm.{key}", f"gives a {name.replace('_', ' ')} of {sizes[name]:.3g} > 1 "
                              "(the model would overshoot the mean); lower it or alpha")
    return sizes


@dataclass
class L2GDConfig(AlgorithmConfig):
    """L2GD and AL2GD."""

    lam_global: float = MISSING
    lam_team: float = MISSING


class L2GDServer(FedAvgServer):
    """FedAvg's means; the servers also send the devices the step sizes."""

    schema = L2GDConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    personalized = True  # PM = the device models
    any_depth = False  # three tiers only

    @classmethod
    def check_config(cls, alg: Mapping[str, Any]) -> None:
        step_sizes(alg)

    def fit_config(self) -> dict[str, Scalar]:
        return {**super().fit_config(), **step_sizes(vars(self.params))}


SERVER = L2GDServer
