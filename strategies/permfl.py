"""PerMFL team and global servers (full paper, Algorithm 1)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from flwr.common import NDArrays

from hfl.aggregate import mean_of
from strategies.base import GlobalStrategy, TeamStrategy

T = TypeVar("T")


def team_update(w: Sequence[T], x: Sequence[T], theta_bar: Sequence[T], eta: float, lam: float, gamma: float) -> list[T]:
    """w <- (1 - eta*lam - eta*gamma) w + eta*gamma x + eta*lam theta_bar."""
    keep = 1.0 - eta * lam - eta * gamma
    return [keep * wi + eta * gamma * xi + eta * lam * ti for wi, xi, ti in zip(w, x, theta_bar, strict=True)]


def global_update(x: Sequence[T], w_bar: Sequence[T], beta: float, gamma: float) -> list[T]:
    """x <- (1 - beta*gamma) x + beta*gamma w_bar."""
    return [(1.0 - beta * gamma) * xi + beta * gamma * wi for xi, wi in zip(x, w_bar, strict=True)]


class PerMFLTeamStrategy(TeamStrategy):
    def __init__(self, parent: NDArrays, alg: Mapping[str, Any]) -> None:
        prox = alg["local_steps"] if alg.get("prox_slip") else alg["lam"]
        super().__init__(
            parent,
            {"alpha": alg["alpha"], "local_steps": alg["local_steps"], "prox_coefficient": prox},
            min_fit_fraction=alg.get("min_fit_fraction", 1.0),
        )
        self.alg = alg

    def aggregate(self, current: NDArrays, models: list[NDArrays], weights: list[int]) -> NDArrays:
        theta_bar = mean_of(models, weights if self.alg["weighted"] else None)
        return team_update(current, self.parent, theta_bar, self.alg["eta"], self.alg["lam"], self.alg["gamma"])


class PerMFLGlobalStrategy(GlobalStrategy):
    def __init__(self, initial: NDArrays, alg: Mapping[str, Any], **common: Any) -> None:
        super().__init__(initial, **common)
        self.alg = alg

    def aggregate(self, current: NDArrays, models: list[NDArrays], weights: list[int]) -> NDArrays:
        w_bar = mean_of(models, weights if self.alg["weighted"] else None)
        return global_update(current, w_bar, self.alg["beta"], self.alg["gamma"])


def build_team_strategy(alg: Mapping[str, Any], parent: NDArrays) -> PerMFLTeamStrategy:
    return PerMFLTeamStrategy(parent, alg)


def build_global_strategy(alg: Mapping[str, Any], initial: NDArrays, **common: Any) -> PerMFLGlobalStrategy:
    return PerMFLGlobalStrategy(initial, alg, **common)
