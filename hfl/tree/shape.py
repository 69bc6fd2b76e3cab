"""The federation as a tree of any depth: root (global server) -> server levels -> devices.

Nodes are named by paths: the root is ``""``; its children are ``"0"``, ``"1"``, ...; their
children ``"0.0"``, ``"0.1"``, ... (``"0.2"`` is child 2 of child 0). The servers of the
lowest level hold devices (ints ``0..n-1``, each exactly once). Every device is at the same
depth, and depth >= 2 (root -> at least one server level -> devices); fan-outs may differ
between nodes.

Today's 3-tier federation (root -> teams -> devices) is the depth-2 tree ``from_teams(teams)``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hfl.errors import ConfigError
from hfl.seed import rng

ROOT = ""


def child_path(parent: str, index: int) -> str:
    """Path of child ``index`` of ``parent``: ``child_path("", 3) == "3"``, ``child_path("0", 2) == "0.2"``."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"a child index must be an integer >= 0, got {index!r}")
    return str(index) if parent == ROOT else f"{parent}.{index}"


def path_order(path: str) -> tuple[int, ...]:
    """A path (or round path, or device id) as numbers: '1.10' after '1.9', tree order."""
    return tuple(int(p) for p in str(path).split(".") if p.isdigit())


def level_of(path: str) -> int:
    """Edges from the root: ``"" -> 0``, ``"3" -> 1``, ``"0.2" -> 2``."""
    return 0 if path == ROOT else path.count(".") + 1


def parent_of(path: str) -> str:
    """Path of the parent: ``"0.2" -> "0"``, ``"3" -> ""``; ValueError for the root."""
    if path == ROOT:
        raise ValueError("the root has no parent")
    return path.rpartition(".")[0]


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (isinstance(value, Sequence) and not isinstance(value, (str, bytes)))


def _where(path: str) -> str:
    return "the root" if path == ROOT else f"server '{path}'"


def _normalize(nodes: Any, key: str) -> tuple:
    """``nodes`` checked (ConfigError naming ``key``) and turned into nested tuples, the devices
    of every lowest-level server sorted."""
    if not _is_list(nodes):
        raise ConfigError(key, f"must be a nested list of device ids, got {nodes!r}")
    seen: dict[int, str] = {}  # device -> path of its server
    depth: list[int] = []  # the device depth (edges from the root), set by the first server of devices

    def is_id(c: Any) -> bool:
        return isinstance(c, int) and not isinstance(c, bool)

    def walk(node: Any, path: str) -> tuple:
        if len(node) == 0:
            raise ConfigError(key, f"{_where(path)} is an empty list")
        items = list(node)
        for c in items:
            if not (is_id(c) or _is_list(c)):
                raise ConfigError(key, f"{_where(path)} has a non-integer device id {c!r}")
        if all(is_id(c) for c in items):  # a lowest-level server
            if not depth:
                depth.append(level_of(path) + 1)
            elif depth[0] != level_of(path) + 1:
                raise ConfigError(
                    key,
                    f"all devices must be at the same depth: the devices of {_where(path)} are at depth "
                    f"{level_of(path) + 1}, others at depth {depth[0]}",
                )
            for d in items:
                if d in seen:
                    raise ConfigError(key, f"device {d} appears twice: under {_where(seen[d])} and {_where(path)}")
                seen[d] = path
            return tuple(sorted(int(d) for d in items))
        if any(is_id(c) for c in items):
            raise ConfigError(
                key, f"all devices must be at the same depth: {_where(path)} mixes device ids and lists: {list(node)!r}"
            )
        return tuple(walk(c, child_path(path, i)) for i, c in enumerate(items))

    nested = walk(nodes, ROOT)
    if depth[0] < 2:
        raise ConfigError(
            key, f"needs depth >= 2 (root -> servers -> devices), got devices directly under the root: {nodes!r}"
        )
    n = len(seen)
    wrong = sorted(d for d in seen if not 0 <= d < n)
    if wrong:
        missing = sorted(set(range(n)) - set(seen))
        raise ConfigError(
            key, f"device ids must be 0..{n - 1} (each once); got {wrong} and none of {missing}"
        )
    return nested


@dataclass(frozen=True)
class Tree:
    """A balanced tree of servers over devices. ``nested``: nested tuples; the outer tuple is the
    root, a lowest-level server is a tuple of device ids. Lists are accepted and normalised
    (devices of a server sorted); an invalid tree raises ConfigError on key ``tree``."""

    nested: tuple
    _index: dict[str, tuple] = field(init=False, repr=False, compare=False, hash=False)
    _levels: list[list[str]] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nested", _normalize(self.nested, "tree"))
        self._build_index()

    @classmethod
    def _valid(cls, nested: tuple) -> Tree:
        """A tree of nested tuples that are valid by construction (``from_fanout``'s): the checks
        of ``_normalize`` walk every device in Python (1.5 s and a dict of every id at 1,000,000
        devices) and are skipped."""
        tree = object.__new__(cls)
        object.__setattr__(tree, "nested", nested)
        tree._build_index()
        return tree

    def _build_index(self) -> None:
        nested = self.nested
        index: dict[str, tuple] = {}
        levels: list[list[str]] = []
        frontier = [(ROOT, nested)]
        while frontier and not isinstance(frontier[0][1][0], int):
            levels.append([p for p, _ in frontier])
            index.update(frontier)
            frontier = [(child_path(p, i), c) for p, node in frontier for i, c in enumerate(node)]
        levels.append([p for p, _ in frontier])  # the lowest-level servers
        index.update(frontier)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_levels", levels)

    def _node(self, path: str) -> tuple:
        try:
            return self._index[path]
        except (KeyError, TypeError):
            raise KeyError(f"no server at path {path!r} in this tree (depth {self.depth})") from None

    @property
    def depth(self) -> int:
        """Edges from the root to a device: 3-tier (root, teams, devices) = 2."""
        return len(self._levels)

    def children(self, path: str) -> list[str]:
        """Child server paths of an inner node; [] for a lowest-level server."""
        node = self._node(path)
        return [] if self.is_lowest(path) else [child_path(path, i) for i in range(len(node))]

    def devices(self, path: str) -> list[int]:
        """Device ids directly under a lowest-level server ([] for higher nodes)."""
        node = self._node(path)
        return list(node) if self.is_lowest(path) else []

    def devices_under(self, path: str) -> list[int]:
        """All device ids of the subtree at ``path``, sorted."""
        self._node(path)
        prefix = path + "."
        return sorted(
            d for p in self._levels[-1] if path == ROOT or p == path or p.startswith(prefix) for d in self._index[p]
        )

    def nodes_at(self, level: int) -> list[str]:
        """Server paths at ``level`` (0 = root .. depth-1 = lowest servers), in order."""
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level < self.depth:
            raise ValueError(f"server levels are 0..{self.depth - 1}, got {level!r}")
        return list(self._levels[level])

    @property
    def inner_paths(self) -> list[str]:
        """Every server but the root, level by level (the hosts a deployment runs besides the root's)."""
        return [p for level in self._levels[1:] for p in level]

    def is_lowest(self, path: str) -> bool:
        """Whether the children of ``path`` are devices."""
        self._node(path)
        return level_of(path) == self.depth - 1

    @property
    def level1_devices(self) -> list[list[int]]:
        """``devices_under`` of every level-1 node, in order (a 3-tier run's teams)."""
        return [self.devices_under(p) for p in self._levels[1]]

    @property
    def num_devices(self) -> int:
        """How many devices the tree holds."""
        return sum(len(self._index[p]) for p in self._levels[-1])


def from_teams(teams: Sequence[Sequence[int]]) -> Tree:
    """The depth-2 tree: root over these teams (team ``t`` is server ``str(t)``)."""
    return Tree(tuple(tuple(int(d) for d in team) for team in teams))


def from_nested(nodes: Any, key: str = "topology.nodes") -> Tree:
    """A tree given as nested lists of device ids, checked (ConfigError naming ``key``): no
    empty list, integer ids ``0..n-1`` each once, every device at the same depth >= 2."""
    return Tree(_normalize(nodes, key))


# What forming a tree keeps per device at the least (measured: 42 bytes retained, 51 at the peak, for
# from_fanout([100, 100, 100])); the data of every device comes on top.
TREE_BYTES_PER_DEVICE = 48


def _memory_bytes() -> int | None:
    """This machine's physical memory, or None where the platform does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def _size(num_bytes: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if num_bytes < 1024 or unit == "PiB":
            return f"{num_bytes:,.0f} {unit}" if unit == "bytes" else f"{num_bytes:,.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def check_device_count(count: int, key: str) -> int:
    """``count`` devices, refused (ConfigError naming ``key`` and the count) when their tree alone
    would not fit this machine's memory: a typo like ``fanout=[100000,100000,100000]`` is then one
    line before anything is allocated, not an allocation error deep in numpy."""
    memory = _memory_bytes()
    need = count * TREE_BYTES_PER_DEVICE
    if memory is not None and need > memory:
        raise ConfigError(key, f"describes {count:,} devices: forming their tree alone would take about {_size(need)}, "
                               f"more than this machine's {_size(memory)} of memory")
    return count


def check_fanout(fanout: Any, key: str = "topology.fanout") -> list[int]:
    """``fanout`` as a list of ints >= 1 with at least 2 entries, describing no more devices than
    this machine can hold (ConfigError naming ``key``)."""
    if not _is_list(fanout):
        raise ConfigError(key, f"must be a list of children per node (root first), got {fanout!r}")
    if len(fanout) < 2:
        raise ConfigError(key, f"needs at least 2 entries: servers and devices per server, got {list(fanout)}")
    for f in fanout:
        if isinstance(f, bool) or not isinstance(f, int) or f < 1:
            raise ConfigError(key, f"entries must be integers >= 1, got {f!r} in {list(fanout)}")
    checked = [int(f) for f in fanout]
    check_device_count(math.prod(checked), key)
    return checked


def from_fanout(fanout: Sequence[int], seed: int) -> Tree:
    """A random (seeded) balanced tree: ``fanout[l]`` children per node at level ``l``; the
    last entry is devices per lowest-level server.

    Formed level by level: the lowest-level servers are consecutive blocks of
    ``rng(seed, "topology", "random").permutation(n)`` (so ``[k, m]`` gives exactly formation
    ``random``'s ``k`` teams of ``m``); the nodes of each level above are then assigned to
    parents at level ``l`` by ``rng(seed, "topology", "tree", l)`` (blocks of ``fanout[l]``,
    each block in the order of the level below); the root takes the level-1 nodes in order.
    """
    fanout = check_fanout(fanout)
    n = math.prod(fanout)
    order = rng(seed, "topology", "random").permutation(n)
    per = fanout[-1]
    # np.sort then tolist: the ints of a server sorted in C (the same tuples as sorted(int(d) ...)).
    groups: list[tuple] = [tuple(np.sort(order[b * per : (b + 1) * per]).tolist()) for b in range(n // per)]
    for level in range(len(fanout) - 2, 0, -1):  # parents at this level, lowest first; the root last
        f = fanout[level]
        perm = rng(seed, "topology", "tree", level).permutation(len(groups))
        groups = [tuple(groups[int(i)] for i in sorted(perm[b * f : (b + 1) * f])) for b in range(len(groups) // f)]
    # Every id 0..n-1 once (a permutation), sorted within its server, every server at one depth:
    # valid by construction (tests/test_scale.py checks it equals the checked tree).
    return Tree._valid(tuple(groups))
