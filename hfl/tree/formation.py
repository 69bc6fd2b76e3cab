"""Team formation: which devices belong to which team (the middle tier of the hierarchy).

Formations (``topology.formation``):

- ``random``: a seeded permutation of the device ids cut into ``num_teams`` equal teams
  (PerMFL's setting: 4 teams x 10 devices, teams drawn at random).
- ``by_label``: team ``t`` is the contiguous id block ``[t*dpt, (t+1)*dpt)``; the data
  layer gives its devices only the labels in ``team_labels[t]`` (PerMFL Table 2).
- ``sequential``: ``num_teams`` contiguous id blocks (sizes differ by at most one): the teams
  of the authors' code without shuffling, and the clusters of ``dataset=synthetic_multilevel``.
- ``explicit``: ``teams`` lists the device ids of every team.
- ``tree``: a tree of any depth (hfl.tree.shape): ``fanout`` (children per node at each depth, root
  first; the last entry is devices per lowest-level server), formed at random (seeded), or
  ``nodes``, nested lists of device ids. ``fanout: [k, m]`` gives exactly ``random``'s k teams of m.

``form_tree`` gives every formation as a hfl.tree.shape.Tree (the 3-tier ones as depth-2 trees);
``form_teams`` gives the level-1 groups (the teams).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hfl.errors import ConfigError, check_number
from hfl.seed import rng
from hfl.tree.shape import Tree, check_device_count, check_fanout, from_fanout, from_nested, from_teams

FORMATIONS = ("random", "sequential", "by_label", "explicit", "tree")


def _int(cfg: Mapping, key: str, *, minimum: int = 1, required: bool = True) -> int | None:
    """``topology.<key>`` as an int >= ``minimum`` (None allowed when not required)."""
    value = cfg.get(key)
    if value is None:
        if required:
            raise ConfigError(f"topology.{key}", "is required for formation " f"'{cfg.get('formation')}'")
        return None
    return check_number(f"topology.{key}", value, integer=True, minimum=minimum)


def _formation(cfg: Mapping) -> str:
    formation = cfg.get("formation")
    if formation not in FORMATIONS:
        raise ConfigError(
            "topology.formation", f"unknown formation {formation!r}; known: {', '.join(FORMATIONS)}"
        )
    return formation


def _explicit_teams(cfg: Mapping) -> list[list[int]]:
    """``topology.teams`` checked for shape and integer ids (coverage is checked later)."""
    teams = cfg.get("teams")
    if not isinstance(teams, Sequence) or isinstance(teams, str) or len(teams) == 0:
        raise ConfigError("topology.teams", f"formation 'explicit' needs a non-empty list of teams, got {teams!r}")
    out = []
    for t, team in enumerate(teams):
        if not isinstance(team, Sequence) or isinstance(team, str) or len(team) == 0:
            raise ConfigError("topology.teams", f"team {t} must be a non-empty list of device ids, got {team!r}")
        for d in team:
            if isinstance(d, bool) or not isinstance(d, int):
                raise ConfigError("topology.teams", f"team {t} has a non-integer device id {d!r}")
        out.append([int(d) for d in team])
    return out


def team_labels(cfg: Mapping) -> list[list[int]]:
    """``topology.team_labels`` for formation ``by_label``: one non-empty list of distinct ints per team."""
    num_teams = _int(cfg, "num_teams")
    labels = cfg.get("team_labels")
    if not isinstance(labels, Sequence) or isinstance(labels, str):
        raise ConfigError("topology.team_labels", f"formation 'by_label' needs a list of label lists, got {labels!r}")
    if len(labels) != num_teams:
        raise ConfigError(
            "topology.team_labels", f"has {len(labels)} entries but topology.num_teams is {num_teams}"
        )
    out = []
    for t, team in enumerate(labels):
        if not isinstance(team, Sequence) or isinstance(team, str) or len(team) == 0:
            raise ConfigError("topology.team_labels", f"team {t} needs a non-empty list of labels, got {team!r}")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in team):
            raise ConfigError("topology.team_labels", f"team {t} labels must be integers >= 0, got {list(team)}")
        if len(set(team)) != len(team):
            raise ConfigError("topology.team_labels", f"team {t} repeats a label: {list(team)}")
        out.append([int(c) for c in team])
    return out


def _tree_spec(cfg: Mapping) -> tuple[list[int] | None, Any]:
    """Formation ``tree``: (checked fanout, None) or (None, raw nodes); exactly one is given."""
    fanout, nodes = cfg.get("fanout"), cfg.get("nodes")
    if nodes is not None:
        if fanout is not None:
            raise ConfigError(
                "topology.nodes", "give either topology.fanout or topology.nodes, not both (set fanout: null)"
            )
        return None, nodes
    if fanout is None:
        raise ConfigError(
            "topology.fanout", "formation 'tree' needs a fanout (e.g. [2, 3, 5]) or topology.nodes (nested lists)"
        )
    return check_fanout(fanout, "topology.fanout"), None


def num_devices(topology_cfg: Mapping) -> int:
    """How many devices the topology describes (the federation is built with this many)."""
    formation = _formation(topology_cfg)
    if formation == "tree":
        fanout, nodes = _tree_spec(topology_cfg)
        return math.prod(fanout) if fanout is not None else from_nested(nodes, "topology.nodes").num_devices
    if formation == "explicit":
        return sum(len(team) for team in _explicit_teams(topology_cfg))
    return check_device_count(_int(topology_cfg, "num_teams") * _int(topology_cfg, "devices_per_team"),
                              "topology.devices_per_team")


def device_count_key(topology_cfg: Mapping) -> str:
    """The config key to blame when the device count is too large for the data."""
    formation = topology_cfg.get("formation")
    if formation == "tree":
        return "topology.nodes" if topology_cfg.get("nodes") is not None else "topology.fanout"
    return "topology.teams" if formation == "explicit" else "topology.devices_per_team"


def form_tree(num_devices: int, topology_cfg: Mapping, seed: int) -> Tree:
    """The federation's tree for any formation; the 3-tier ones give ``from_teams(form_teams(...))``."""
    if _formation(topology_cfg) != "tree":
        return from_teams(form_teams(num_devices, topology_cfg, seed))
    fanout, nodes = _tree_spec(topology_cfg)
    tree = from_fanout(fanout, seed) if fanout is not None else from_nested(nodes, "topology.nodes")
    if tree.num_devices != num_devices:
        raise ConfigError(
            device_count_key(topology_cfg), f"describes {tree.num_devices} devices but the federation has {num_devices}"
        )
    return tree


def form_teams(num_devices: int, topology_cfg: Mapping, seed: int) -> list[list[int]]:
    """Teams as sorted lists of device ids; every id in ``0..num_devices-1`` is in exactly one team.
    For formation ``tree``: the devices under each level-1 node."""
    formation = _formation(topology_cfg)
    if formation == "tree":
        return form_tree(num_devices, topology_cfg, seed).level1_devices
    if formation == "explicit":
        return _form_explicit(num_devices, topology_cfg)

    num_teams = _int(topology_cfg, "num_teams")
    per_team = _int(topology_cfg, "devices_per_team", required=formation == "by_label")
    if num_teams > num_devices:
        raise ConfigError("topology.num_teams", f"more teams ({num_teams}) than devices ({num_devices})")
    if per_team is not None and per_team * num_teams != num_devices:
        raise ConfigError(
            "topology.devices_per_team",
            f"num_teams x devices_per_team = {num_teams} x {per_team} = {num_teams * per_team}, "
            f"but the federation has {num_devices} devices",
        )
    if formation == "by_label":
        team_labels(topology_cfg)  # validate early; the data layer uses the labels
        return [list(range(t * per_team, (t + 1) * per_team)) for t in range(num_teams)]

    # random / sequential: sizes differ by at most one when devices_per_team is left null.
    order = (np.arange(num_devices) if formation == "sequential"
             else rng(seed, "topology", "random").permutation(num_devices))
    bounds = [round(t * num_devices / num_teams) for t in range(num_teams + 1)]
    return [sorted(int(d) for d in order[bounds[t] : bounds[t + 1]]) for t in range(num_teams)]


def _form_explicit(num_devices: int, cfg: Mapping[str, Any]) -> list[list[int]]:
    teams = _explicit_teams(cfg)
    seen: dict[int, int] = {}
    for t, team in enumerate(teams):
        for d in team:
            if not 0 <= d < num_devices:
                raise ConfigError("topology.teams", f"team {t} has device id {d}, outside 0..{num_devices - 1}")
            if d in seen:
                raise ConfigError("topology.teams", f"device {d} is in team {seen[d]} and team {t}")
            seen[d] = t
    missing = sorted(set(range(num_devices)) - set(seen))
    if missing:
        raise ConfigError("topology.teams", f"devices {missing} are in no team (ids must be 0..{num_devices - 1})")
    # num_teams / devices_per_team are optional here; when given they must agree.
    num_teams = _int(cfg, "num_teams", required=False)
    if num_teams is not None and num_teams != len(teams):
        raise ConfigError("topology.num_teams", f"is {num_teams} but topology.teams lists {len(teams)} teams")
    per_team = _int(cfg, "devices_per_team", required=False)
    if per_team is not None and any(len(team) != per_team for team in teams):
        raise ConfigError(
            "topology.devices_per_team",
            f"is {per_team} but team sizes are {[len(team) for team in teams]} (set it to null for uneven teams)",
        )
    return [sorted(team) for team in teams]
