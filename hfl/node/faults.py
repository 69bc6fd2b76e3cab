"""Simulated faults: ``runtime.dropout`` (devices) and ``runtime.dropout_nodes`` (inner nodes,
i.e. whole subtrees) fail the rounds they are asked in, as dead devices and hosts would.

Which children fail is drawn per round, seeded and counter-based like sampling (hfl.tree.sampling):
each child a node asks in a round gets a uniform score from (run seed, "dropout", node path,
round path, child id), and the ``floor(fraction x asked)`` children with the lowest scores fail.
The draw depends only on those keys, not on what ran before (reproducible, resumable, the same
in-process and on Ray), and the count is exact, so ``algorithm.min_fit_fraction <= 1 - fraction``
always leaves a node enough updates.

A dropped child is not told anything: the node calls it through ``DroppedProxy``
(hfl.clock.dropped), whose ``fit`` raises ``SimulatedFault``, so the ordinary failure paths run
(hfl.node.inprocess.run_fit_rounds, the round loop of every node and the root, counts a raising child as a failure;
the strategies' ``min_fit_fraction`` decides whether the round still aggregates). Evaluation is never dropped: every device is tested
every evaluated round, so accuracies stay comparable with a run without faults.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from flwr.server.client_proxy import ClientProxy

from hfl.clock.dropped import DroppedProxy
from hfl.seed import rng

KEYS = ("dropout", "dropout_nodes")  # runtime.<key>: devices, inner nodes


def dropout_fractions(runtime: Mapping) -> tuple[float, float]:
    """(devices, inner nodes): the runtime's dropout fractions (RuntimeConfig's keys, every runtime has them)."""
    return float(runtime["dropout"]), float(runtime["dropout_nodes"])


def dropout_count(asked: int, fraction: float) -> int:
    """floor(fraction x asked): how many of the children asked in a round fail."""
    if not 0 <= fraction < 1:
        raise ValueError(f"dropout fraction must be in [0, 1), got {fraction}")
    return math.floor(fraction * asked + 1e-9)


def dropped_children(cids: Sequence[str], fraction: float, seed: int, path: str, round_path: str) -> list[str]:
    """The children (by id, in the given order) that fail the round ``round_path`` of the node
    at ``path`` ("" = the root), among those it asked."""
    k = dropout_count(len(cids), fraction)
    if k == 0:
        return []
    scores = {cid: rng(seed, "dropout", path or "root", round_path, cid).random() for cid in cids}
    failed = set(sorted(cids, key=lambda cid: (scores[cid], cid))[:k])
    return [cid for cid in cids if cid in failed]


def drop(asked: list[ClientProxy], ids: Sequence[str], fraction: float, seed: int, path: str,
         round_path: str) -> tuple[list[ClientProxy], list[str]]:
    """``asked`` with the children that fail this round behind a ``DroppedProxy`` (same order),
    and the ids of those (``ids[i]`` names ``asked[i]`` in the draw: a cid, or at the root the
    level-1 node's path)."""
    failed = set(dropped_children(list(ids), fraction, seed, path, round_path))
    if not failed:
        return list(asked), []
    where = f"node {path}" if path else "the root"
    out = [DroppedProxy(proxy, f"{cid} dropped out of round {round_path} of {where} (simulated fault)")
           if cid in failed else proxy for proxy, cid in zip(asked, ids, strict=True)]
    return out, [cid for cid in ids if cid in failed]
