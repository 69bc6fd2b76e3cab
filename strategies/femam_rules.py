"""FeMAM's rules (seeds/001; ../shared/notes/femam.md), pure functions with no Flower in them.

A client's predictor is the mean of the outputs of its kept levels (the authors' code:
``CE(sum_l logits_l / #levels)``). Our models return log-softmax outputs, which differ from
raw logits by one constant per sample; cross-entropy applies log-softmax to the mean again,
which removes that constant, so ``CE(mean of log-softmax outputs) = CE(mean of logits)``
(tested). Levels: index 0 with one group is the global model (FedAvg), a level with K >= 2
groups is re-clustered every round (K-means on the uploaded final-layer weights, or FeSEM's
nearest centre), a level with 0 groups is personal (one model per client, never averaged).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from flwr.common import NDArrays
from sklearn.cluster import KMeans

from hfl.rules.aggregate import mean_of

GLOBAL, CLUSTER, TEAM, PERSONAL = "global", "cluster", "team", "personal"
KIND_CODES = {GLOBAL: 0, CLUSTER: 1, TEAM: 2, PERSONAL: 3}
KINDS = {code: kind for kind, code in KIND_CODES.items()}


# ---------------------------------------------------------------- the additive model
def additive_output(frozen_sum: torch.Tensor | None, out: torch.Tensor, count: int) -> torch.Tensor:
    """The mean of ``count`` level outputs: the frozen levels' summed outputs plus the newest's."""
    total = out if frozen_sum is None else frozen_sum + out
    return total / count


def additive_loss(
    frozen_sum: torch.Tensor | None, out: torch.Tensor, count: int, y: torch.Tensor,
    params: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor], prox: float,
) -> torch.Tensor:
    """CE(mean of the level outputs) + prox * ||theta - theta_received||^2 (the code's 0.01 * ||.||^2,
    no 1/2) on the trainable level only."""
    loss = F.cross_entropy(additive_output(frozen_sum, out, count), y)
    if prox:
        loss = loss + prox * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))
    return loss


# ---------------------------------------------------------------- grouping
def level_kind(index: int, groups: int, team_level: int | None) -> str:
    """What level ``index`` (0-based) is: the 1-based ``team_level`` is the tree's lowest servers."""
    if team_level is not None and index == team_level - 1:
        return TEAM
    if groups == 0:
        return PERSONAL
    if index == 0 and groups == 1:
        return GLOBAL
    return CLUSTER


def clustering_features(model: NDArrays) -> np.ndarray:
    """The authors' feature: the final layer's weight and bias, flattened and divided by
    |sum of entries| (by 1 where that sum is 0)."""
    flat = np.concatenate([np.asarray(model[-2], dtype=np.float64).ravel(), np.asarray(model[-1], dtype=np.float64).ravel()])
    scale = abs(flat.sum())
    return flat / (scale if scale > 0 else 1.0)


def flat_model(model: NDArrays) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in model])


def kmeans_labels(features: np.ndarray, k: int, seed: int, n_init: int = 10) -> np.ndarray:
    """scikit-learn's K-means as the authors run it (init='random', ``n_init`` restarts),
    seeded; K is capped at the number of points; one group needs no clustering."""
    k = min(k, len(features))
    if k <= 1:
        return np.zeros(len(features), dtype=np.int64)
    km = KMeans(n_clusters=k, init="random", n_init=n_init, random_state=seed)
    return km.fit_predict(features).astype(np.int64)


def nearest_labels(models: Sequence[NDArrays], centres: Mapping[int, NDArrays]) -> np.ndarray:
    """FeSEM's E-step: each model to the centre nearest in parameter space (L2; ties to the lowest id)."""
    ids = sorted(centres)
    c = np.stack([flat_model(centres[k]) for k in ids])
    labels = [ids[int(np.argmin(((c - flat_model(m)) ** 2).sum(axis=1)))] for m in models]
    return np.asarray(labels, dtype=np.int64)


def group_means(models: Sequence[NDArrays], weights: Sequence[float], labels: np.ndarray) -> dict[int, NDArrays]:
    """The n_i-weighted mean of each group's members (groups numbered by their labels)."""
    out = {}
    for g in sorted(set(labels.tolist())):
        members = [i for i, lab in enumerate(labels) if lab == g]
        out[int(g)] = mean_of([models[i] for i in members], [weights[i] for i in members])
    return out


# ---------------------------------------------------------------- schedule and pruning
@dataclass(frozen=True)
class Schedule:
    mode: str  # "fixed" | "convergence"
    rounds: tuple[int, ...]  # fixed: rounds of each level (the last level runs on to the end)
    window: int = 50  # convergence: the last ``window`` rounds' mean validation losses
    tol: float = 0.01  # ... have a standard deviation below ``tol``

    def level_done(self, level: int, rounds_in_level: int, mean_val_losses: Sequence[float]) -> bool:
        """Whether level ``level`` (0-based) is finished after ``rounds_in_level`` rounds."""
        if self.mode == "fixed":
            return rounds_in_level >= self.rounds[level]
        if rounds_in_level < self.window:
            return False
        return float(np.std(mean_val_losses[-self.window:])) < self.tol


def keeps_level(level_losses: Sequence[float], reference_losses: Sequence[float], window: int = 50) -> bool:
    """The paper's pruning test (epsilon = 0): a client keeps a level iff its mean validation loss
    over the level's last ``window`` rounds is below that over the last level it kept."""
    if not level_losses:
        return False
    if not reference_losses:
        return True
    return float(np.mean(level_losses[-window:])) < float(np.mean(reference_losses[-window:]))


def last_kept(kept: Sequence[int], before: int) -> int:
    """The highest level below ``before`` the client kept (level 0 is always kept)."""
    for level in range(before - 1, -1, -1):
        if kept[level] == 1:
            return level
    return 0


def in_prediction(kept: Sequence[int], prune: str) -> list[int]:
    """The finished levels a client's predictor sums: kept ones (``paper``), or every finished one
    (``code``: the released code only books the decision; ``none``: no pruning)."""
    if prune == "paper":
        return [level for level, flag in enumerate(kept) if flag == 1]
    return [level for level, flag in enumerate(kept) if flag in (0, 1)]
