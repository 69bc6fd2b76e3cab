"""Which children a node asks in a round: seeded and counter-based, so a sample depends only
on (seed, node path, round path) and not on what ran before it (resumable, order-free)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

from hfl.seed import rng

T = TypeVar("T")


def sample_size(num_children: int, fraction: float) -> int:
    """ceil(fraction x n), at least 1: the fraction is honoured as a lower bound."""
    if num_children < 1:
        raise ValueError("a node without children cannot sample")
    if not 0 < fraction <= 1:
        raise ValueError(f"sample fraction must be in (0, 1], got {fraction}")
    return min(num_children, max(1, math.ceil(fraction * num_children - 1e-9)))


def sample_children(children: Sequence[T], fraction: float, seed: int, path: str, round_path: str) -> list[T]:
    """A seeded subset of ``children`` (kept in their given order); all of them at fraction 1."""
    k = sample_size(len(children), fraction)
    if k == len(children):
        return list(children)
    chosen = rng(seed, "sample", path or "root", round_path).choice(len(children), size=k, replace=False)
    return [children[i] for i in sorted(int(c) for c in chosen)]
