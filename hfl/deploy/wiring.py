"""Which role a Flower process plays, from its run config (``tier``) and node config (``role``).

Runs: ``tier="global"`` is the experiment's root run (``hfl-deploy submit``); ``tier="node"``
is a node server (``hfl.deploy.node_server``), one per inner node host and experiment.
SuperNodes: ``role="node"`` (or ``role="team"``, the level-1 node ``team-id``) is a node
host's bridge toward its parent; ``role="device"`` a device.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from flwr.client import Client
from flwr.common import Context

from hfl.deploy.bridge import NodeBridge, submit_node_server
from hfl.deploy.control import ControlClient
from hfl.deploy.device import device_client
from hfl.deploy.mailbox import Mailbox

TIERS = ("global", "node")
ROLES = ("node", "team", "device")
PROJECT_DIR = Path(__file__).resolve().parents[2]


def tier_of(context: Context) -> str:
    tier = str(context.run_config.get("tier", "global"))
    if tier not in TIERS:
        raise ValueError(f"run config tier must be one of {TIERS}, got {tier!r}")
    return tier


def check_role(tier: str, role: object) -> None:
    """A device hangs under a node host's SuperLink, never under the root's."""
    if tier == "global" and role not in ("node", "team", None):
        raise ValueError(f"a SuperNode with role={role!r} is connected to the global SuperLink; nodes there must be "
                         "node hosts' bridges (role 'node', or 'team' with a team-id)")
    if role not in (*ROLES, None):
        raise ValueError(f"unknown SuperNode role {role!r}; known: {', '.join(ROLES)}")


def state_key(context: Context) -> str:
    """What names an experiment on every host: the root run's key, passed down by node servers."""
    return str(context.run_config.get("state-key") or f"run-{context.run_id}")


def node_path(node: Mapping) -> str:
    """The inner node a bridge serves: ``path``, or ``team-id`` N (the level-1 node N)."""
    if node.get("path") not in (None, ""):
        return str(node["path"])
    if "team-id" in node:
        return str(int(node["team-id"]))
    raise ValueError("a node host's bridge SuperNode needs path (or team-id) in its node config")


def bridge_client(cfg: Mapping, context: Context) -> Client:
    node = context.node_config
    path = node_path(node)
    superlink = node.get("node-superlink") or node.get("team-superlink")
    if not superlink or "work-dir" not in node:
        raise ValueError("a node host's bridge SuperNode needs node-superlink and work-dir in its node config")
    ca = str(node.get("node-root-certificates", node.get("team-root-certificates", "")))
    app_dir = Path(str(node.get("app-dir") or PROJECT_DIR))
    if not (app_dir / "pyproject.toml").exists():
        raise ValueError(f"app-dir {app_dir} holds no pyproject.toml; set app-dir in the bridge's node config")
    work_dir = Path(str(node["work-dir"]))
    key = state_key(context)
    link = ControlClient(str(superlink), ca, work_dir / "flwr-home", app_dir)
    start = submit_node_server(link, path, str(context.run_config.get("overrides", "")), key, work_dir)
    timeout = float(cfg["runtime"].get("team_run_timeout", 3600))
    return NodeBridge(path, Mailbox(work_dir / key), start, timeout).to_client()


def deployed_client(cfg: Mapping, context: Context) -> Client:
    torch.set_num_threads(int(cfg["runtime"]["torch_threads"]))
    role = context.node_config.get("role")
    check_role(tier_of(context), role)
    if role in ("node", "team"):
        return bridge_client(cfg, context)
    return device_client(cfg, context.node_config, state_key(context)).to_client()
