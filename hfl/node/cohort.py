"""Who a node's rounds ask, written once for every node, the root included.

A round asks the children holding a device the root drew (``algorithm.sampling=devices``), or the
idle (and, for devices, online) children the node's clock picks (hfl.clock), or a seeded sample of
``fraction`` of them, or (``candidates``: power-of-choice) that many of a seeded draw of candidates,
those whose last reported training loss is highest; then a simulated fault (``runtime.dropout[_nodes]``, hfl.node.faults) fails
some of those asked. (An evaluation asks a seeded sample of ``eval_fraction`` of them on a stream of
its own: hfl.tree.sampling.evaluation_sample, at every node and the root.) Children are identified
by their cid: a child node's path, a device's id (the root's level-1 nodes are given their paths,
hfl.node.root.PathProxy), in the order given.

A node builds a ``Cohort`` at every call (the root's call: one global round) from its level's
``Selection`` and its stored state; the round loop (hfl.node.inprocess.run_fit_rounds) asks it
whom each round asks and shows it the replies the round merged; what it keeps between calls is
``state()``, saved with the node's own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from flwr.common import FitRes
from flwr.server.client_proxy import ClientProxy

from hfl.node.faults import drop
from hfl.seed import rng
from hfl.tree.sampling import sample_children, sample_size

if TYPE_CHECKING:
    from hfl.clock.timer import NodeTimer

PREFIX = "cohort:"  # a node's stored entries that are its cohort's (hfl.state.store), not its rule's
LOSSES = f"{PREFIX}losses"  # the children's last reported training losses, JSON


@dataclass(frozen=True)
class Selection:
    """How the nodes of one level pick the children of their rounds (the run's config, per level)."""

    fraction: float = 1.0  # algorithm.sample_fraction of the level: the share of its children a round asks
    dropout: float = 0.0  # runtime.dropout (lowest nodes) / dropout_nodes: of those asked, the share failing
    seed: int = 0  # the run's seed: every draw is keyed by it, the node's path and the round
    # algorithm.candidates of the level: the share of its children a round draws as candidates, of which
    # it asks the ``fraction`` whose last reported training loss is highest; 0: no loss-aware choice.
    candidates: float = 0.0


def holders(children: Sequence[ClientProxy], holds: Mapping[str, frozenset[int]], drawn: frozenset[int],
            path: str) -> list[ClientProxy]:
    """The children holding a drawn device (``holds``: child cid -> the devices under it; a lowest
    node's lazy holds name them without a proxy made for the others)."""
    holding = getattr(holds, "holding", None)  # a lowest node's lazy holds (hfl.runtime.children)
    if holding is not None and hasattr(children, "get"):
        asked = [children.get(cid) for cid in holding(drawn)]
    else:
        asked = [c for c in children if holds.get(c.cid, frozenset()) & drawn]
    if not asked:
        where = f"node {path!r}" if path else "the root"
        raise RuntimeError(f"{where} was called but holds none of the drawn devices")
    return asked


class Cohort:
    """Who the rounds of one call of the node at ``path`` ask, and the record of it (``rows``, for
    samples.jsonl) where the choice is not simply every child. ``drawn``/``holds``: the devices the
    root drew this global round and, per child, those under it; ``timer``: the node's clock."""

    def __init__(self, selection: Selection, path: str, *, timer: NodeTimer | None = None,
                 drawn: frozenset[int] | None = None, holds: Mapping[str, frozenset[int]] | None = None,
                 stored: Mapping[str, np.ndarray] | None = None) -> None:
        self.selection = selection
        self.path = path
        self.timer = timer
        self.drawn = drawn
        self.holds = holds or {}
        self.rows: list[dict] = []  # per round, whom it asked (and which of them a fault failed)
        # Sampled, faulty or clocked rounds are recorded; the root's draw of devices has its own row.
        self.recorded = selection.fraction < 1 or selection.dropout > 0 or timer is not None
        # child cid -> the training loss it last reported (loss-aware choice: ``candidates``)
        self.losses: dict[str, float] = json.loads(bytes(stored[LOSSES]).decode()) if stored and LOSSES in stored else {}

    def ask(self, key: str, children: Sequence[ClientProxy]) -> list[ClientProxy]:
        """The children round ``key`` (its round path) asks, those failing it behind a
        ``DroppedProxy`` (hfl.clock.dropped), in the given order."""
        selection = self.selection
        row: dict = {"node": self.path or "root", "round": key}
        if self.drawn is not None:
            asked = holders(children, self.holds, self.drawn, self.path)
        elif self.timer is not None:
            asked = self.timer.pick(children, selection.fraction, key)
        elif selection.candidates:
            asked = self._highest_losses(children, key, row)
        else:
            asked = sample_children(children, selection.fraction, selection.seed, self.path, key)
        failed: list[str] = []
        if selection.dropout > 0:
            asked, failed = drop(asked, [c.cid for c in asked], selection.dropout, selection.seed, self.path, key)
        if self.recorded:
            row["asked"] = [c.cid for c in asked]
            if selection.dropout > 0:
                row["dropped"] = failed
            self.rows.append(row)
        return list(asked)

    def _highest_losses(self, children: Sequence[ClientProxy], key: str, row: dict) -> list[ClientProxy]:
        """Power-of-choice (Cho et al., 2020, with the losses the children last reported: rpow-d): a
        seeded draw of ``candidates`` of the children, of which the ``fraction`` with the highest loss,
        a child not heard from yet first, ties in a seeded order; in the given order. ``row`` records
        the candidates and their losses (null: not heard from)."""
        selection = self.selection
        pool = sample_children(children, selection.candidates, selection.seed, self.path, key)
        k = sample_size(len(children), selection.fraction)
        ties = rng(selection.seed, "choice", self.path or "root", key).permutation(len(pool))
        ranked = sorted(range(len(pool)), key=lambda i: (-self.losses.get(pool[i].cid, math.inf), ties[i]))
        row["candidates"] = [c.cid for c in pool]
        row["losses"] = [self.losses.get(c.cid) for c in pool]
        return [pool[i] for i in sorted(ranked[:k])]

    def observe(self, key: str, merged: Sequence[tuple[ClientProxy, FitRes]]) -> None:
        """The replies round ``key`` merged (under a clock: those it closed with, maybe sent earlier):
        each child's training loss, kept for a loss-aware choice."""
        if not self.selection.candidates:
            return
        for proxy, res in merged:
            loss = reported_loss(res.metrics)
            if loss is not None:
                self.losses[proxy.cid] = loss

    def state(self) -> dict[str, np.ndarray]:
        """What the next call's cohort starts from (entries under ``PREFIX``), saved with the node's state."""
        if not self.selection.candidates:
            return {}
        return {LOSSES: np.frombuffer(json.dumps(self.losses, sort_keys=True).encode(), dtype=np.uint8)}


def reported_loss(metrics: Mapping[str, object]) -> float | None:
    """The training loss a child's reply reports: a device's mean loss over its local steps
    (``train_loss``), a node's mean over the devices its subtree trained in its call
    (hfl.node.inprocess.RoundsReport: ``train_loss_sum`` / ``train_loss_examples``); None if none or not finite."""
    if "train_loss" in metrics:
        loss = float(metrics["train_loss"])
    elif float(metrics.get("train_loss_examples", 0) or 0) > 0:
        loss = float(metrics["train_loss_sum"]) / float(metrics["train_loss_examples"])
    else:
        return None
    return loss if math.isfinite(loss) else None


def without_cohort(state: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
    """A stored node state less its cohort's entries (what the algorithm's rule reads)."""
    if not state:
        return state
    return {k: v for k, v in state.items() if not k.startswith(PREFIX)}
