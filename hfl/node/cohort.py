"""Who a node's round asks, written once for every node, the root included.

A round asks the children holding a device the root drew (``algorithm.sampling=devices``), or the
idle (and, for devices, online) children the node's clock picks (hfl.clock), or a seeded sample of
``fraction`` of them; then a simulated fault (``runtime.dropout[_nodes]``, hfl.node.faults) fails
some of those asked. (An evaluation asks a seeded sample of ``eval_fraction`` of them on a stream of
its own: hfl.tree.sampling.evaluation_sample, at every node and the root.) Children are identified by their cid: a child node's path, a device's id (the root's
level-1 nodes are given their paths, hfl.node.root.PathProxy), in the order given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from flwr.server.client_proxy import ClientProxy

from hfl.node.faults import drop
from hfl.tree.sampling import sample_children

if TYPE_CHECKING:
    from hfl.clock.timer import NodeTimer


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


def fit_cohort(children: Sequence[ClientProxy], *, path: str, seed: int, fraction: float, key: str,
               timer: NodeTimer | None = None, drawn: frozenset[int] | None = None,
               holds: Mapping[str, frozenset[int]] | None = None,
               dropout: float = 0.0) -> tuple[list[ClientProxy], list[str]]:
    """The children round ``key`` of the node at ``path`` asks, those failing it behind a
    ``DroppedProxy`` (same order), and the cids of those failing."""
    if drawn is not None:
        asked = holders(children, holds or {}, drawn, path)
    elif timer is not None:
        asked = timer.pick(children, fraction, key)
    else:
        asked = sample_children(children, fraction, seed, path, key)
    if dropout > 0:
        return drop(asked, [c.cid for c in asked], dropout, seed, path, key)
    return list(asked), []
