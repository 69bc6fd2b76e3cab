"""FedAvg on the tree: team FedAvg for K rounds, then FedAvg of the team models.

With K = 1 (``algorithm=fedavg``) the two sample-weighted means compose into flat FedAvg
over all devices; with K > 1 (``algorithm=hierfavg``) it is h-SGD / HierFAVG.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.common import NDArrays

from hfl.aggregate import mean_of
from strategies.base import GlobalStrategy, TeamStrategy


class FedAvgTeamStrategy(TeamStrategy):
    def __init__(self, parent: NDArrays, alg: Mapping[str, Any]) -> None:
        super().__init__(
            parent,
            {"alpha": alg["alpha"], "local_steps": alg["local_steps"], "fit_test": bool(alg.get("fit_test", False))},
            min_fit_fraction=alg.get("min_fit_fraction", 1.0),
        )
        self.weighted = bool(alg["weighted"])

    def aggregate(self, current: NDArrays, models: list[NDArrays], weights: list[int]) -> NDArrays:
        return mean_of(models, weights if self.weighted else None)


class FedAvgGlobalStrategy(GlobalStrategy):
    def __init__(self, initial: NDArrays, alg: Mapping[str, Any], **common: Any) -> None:
        super().__init__(initial, **common)
        self.weighted = bool(alg["weighted"])

    def aggregate(self, current: NDArrays, models: list[NDArrays], weights: list[int]) -> NDArrays:
        return mean_of(models, weights if self.weighted else None)


def build_team_strategy(alg: Mapping[str, Any], parent: NDArrays) -> FedAvgTeamStrategy:
    return FedAvgTeamStrategy(parent, alg)


def build_global_strategy(alg: Mapping[str, Any], initial: NDArrays, **common: Any) -> FedAvgGlobalStrategy:
    return FedAvgGlobalStrategy(initial, alg, **common)
