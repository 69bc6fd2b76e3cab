"""PerMFL team and global servers (full paper, Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from omegaconf import MISSING
from flwr.common import NDArrays, Scalar

from hfl.config.schema import AlgorithmConfig
from hfl.algorithm import Replies, ServerRule
from hfl.rules.personal import check_keys


T = TypeVar("T")


def team_update(w: Sequence[T], x: Sequence[T], theta_bar: Sequence[T], eta: float, lam: float, gamma: float) -> list[T]:
    """w <- (1 - eta*lam - eta*gamma) w + eta*gamma x + eta*lam theta_bar."""
    keep = 1.0 - eta * lam - eta * gamma
    return [keep * wi + eta * gamma * xi + eta * lam * ti for wi, xi, ti in zip(w, x, theta_bar, strict=True)]


def global_update(x: Sequence[T], w_bar: Sequence[T], beta: float, gamma: float) -> list[T]:
    """x <- (1 - beta*gamma) x + beta*gamma w_bar."""
    return [(1.0 - beta * gamma) * xi + beta * gamma * wi for xi, wi in zip(x, w_bar, strict=True)]


@dataclass
class PerMFLConfig(AlgorithmConfig):
    """PerMFL's keys (conf/algorithm/permfl.yaml), registered as /schema/algorithm/permfl from here."""

    eta: float = MISSING
    lam: float = MISSING
    gamma: float = MISSING
    beta: float = MISSING
    prox_slip: bool = MISSING


class PerMFLServer(ServerRule):
    """Algorithm 1: a team moves by ``team_update`` toward its devices' mean and its parent's
    model x; the root by ``global_update`` toward the teams' mean."""

    schema = PerMFLConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    personalized = True  # devices keep theta, their PM (three tiers only: any_depth stays false)

    @classmethod
    def check_config(cls, alg: Mapping[str, Any]) -> None:
        check_keys(alg, eta={"minimum": 0}, lam={"minimum": 0}, gamma={"minimum": 0}, beta={"minimum": 0})

    def fit_config(self) -> dict[str, Scalar]:
        p = self.params
        prox = p.local_steps if p.prox_slip else p.lam
        return {"alpha": p.alpha, "local_steps": p.local_steps, "prox_coefficient": prox}

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        p = self.params
        mean = replies.mean(bool(p.weighted))
        if self.ctx.is_root:
            return global_update(model, mean, p.beta, p.gamma)
        return team_update(model, self.ctx.payload.main, mean, p.eta, p.lam, p.gamma)


SERVER = PerMFLServer
