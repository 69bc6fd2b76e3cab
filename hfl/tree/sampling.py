"""Which children a node asks in a round: seeded and counter-based, so a sample depends only
on (seed, node path, round path) and not on what ran before it (resumable, order-free)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


def seeded_subset(children: Sequence[T], k: int, seed: int, stream: str, path: str, key: str | int) -> list[T]:
    """``k`` of ``children`` drawn from (seed, stream, node path, key), kept in their given order;
    all of them when ``k`` covers them."""
    if k >= len(children):
        return list(children)
    chosen = rng(seed, stream, path or "root", key).choice(len(children), size=k, replace=False)
    return [children[i] for i in sorted(int(c) for c in chosen)]


def sample_children(children: Sequence[T], fraction: float, seed: int, path: str, round_path: str) -> list[T]:
    """A seeded subset of ``children`` (kept in their given order); all of them at fraction 1."""
    return seeded_subset(children, sample_size(len(children), fraction), seed, "sample", path, round_path)


def evaluation_sample(children: Sequence[T], fraction: float, seed: int, path: str, global_round: int) -> list[T]:
    """The children a node asks to evaluate in ``global_round`` (top-level ``eval_fraction``):
    ceil(fraction x n), at least 1, kept in their given order; all of them at fraction 1. Its own
    stream ("evaluate"), so the sample does not depend on the rounds' fit samples and every model
    level is tested on the same devices."""
    return seeded_subset(children, sample_size(len(children), fraction), seed, "evaluate", path, global_round)


def sample_devices(num_devices: int, fraction: float, seed: int, global_round: int) -> list[int]:
    """``algorithm.sampling=devices``: ceil(fraction x I) of all I devices, uniformly across the
    tree, drawn by the root for one global round (sorted ids)."""
    k = sample_size(num_devices, fraction)
    chosen = rng(seed, "devices", global_round).choice(num_devices, size=k, replace=False)
    return sorted(int(c) for c in chosen)


def parse_devices(text: str) -> frozenset[int]:
    """The device ids a ``devices`` config entry names ("3,17,42")."""
    return frozenset(int(part) for part in str(text).split(",") if part)


@dataclass(frozen=True)
class DeviceDraw:
    """The root's per-round device draw for ``algorithm.sampling=devices``: which devices, and
    which level-1 subtrees (by path) hold them."""

    num_devices: int
    fraction: float
    seed: int
    holds: Mapping[str, frozenset[int]]  # level-1 path -> the devices under it

    def draw(self, global_round: int) -> list[int]:
        return sample_devices(self.num_devices, self.fraction, self.seed, global_round)


@dataclass(frozen=True)
class EvaluationDraw:
    """Sampled evaluation at the root (top-level ``eval_fraction``): the fraction of the level-1
    nodes it asks, its seed, and the federation's devices, which the reported intervals are
    drawn against (hfl.node.evaluation.accuracy_interval)."""

    fraction: float
    seed: int
    population: int

