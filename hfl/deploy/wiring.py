"""Which role a Flower process plays, from its run config (``tier``) and node config (``role``).

Light to import: Flower starts a process per message, and a bridge's only relays.

Runs: ``tier="global"`` is the experiment's root run (``hfl-deploy submit``); ``tier="node"``
is a node server (``hfl.deploy.node_server``), one per inner node host and experiment.
SuperNodes: ``role="node"`` (or ``role="team"``, the level-1 node ``team-id``) is a node
host's bridge toward its parent; ``role="device"`` a device.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path

from flwr.client import Client, NumPyClient
from flwr.common import Context, NDArrays, Scalar

from hfl.deploy.bridge import NodeBridge, node_properties, submit_node_server
from hfl.deploy.control import ControlClient
from hfl.deploy.mailbox import Mailbox
from hfl.deploy.private import private_dir, private_umask
from hfl.output.paths import confined_name
from hfl.deploy.roles import DEFAULT_STATE_DIR
from hfl.state.store import atomic_write_bytes

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
    """What names an experiment on every host: the root run's key, passed down by node servers;
    one folder name (it names a folder in every host's work or state directory)."""
    return confined_name("state-key", context.run_config.get("state-key") or f"run-{context.run_id}")


def node_path(node: Mapping) -> str:
    """The inner node a bridge serves: ``path``, or ``team-id`` N (the level-1 node N)."""
    if node.get("path") not in (None, ""):
        return str(node["path"])
    if "team-id" in node:
        return str(int(node["team-id"]))
    raise ValueError("a node host's bridge SuperNode needs path (or team-id) in its node config")


def bridge_client(cfg: Mapping, context: Context) -> NodeBridge:
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
    return NodeBridge(path, Mailbox(work_dir / key), start, timeout)


class Deferred(NumPyClient):
    """A deployed SuperNode's client that says who it is from its node config alone and builds
    the real client (composing the config, loading data) only for any other message: Flower starts
    a ClientApp process per message, and a node server asks every new child who it is."""

    def __init__(self, properties: dict[str, Scalar], build: Callable[[], NumPyClient]) -> None:
        self.properties = properties
        self.build = build

    def get_properties(self, config: dict[str, Scalar]) -> dict[str, Scalar]:
        return self.build().get_properties(config) if config else dict(self.properties)

    def get_parameters(self, config: dict[str, Scalar]) -> NDArrays:
        return self.build().get_parameters(config)

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        return self.build().fit(parameters, config)

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        return self.build().evaluate(parameters, config)


def cached_config(folder: Path, overrides: str, compose: Callable[[], Mapping]) -> Mapping:
    """The experiment's configuration, composed once per host and experiment and then read back:
    Flower starts a process per message, and Hydra's compose costs about a second each time."""
    path = folder / f"config-{hashlib.sha1(overrides.encode()).hexdigest()[:12]}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    cfg = compose()
    private_dir(folder)
    atomic_write_bytes(path, json.dumps(cfg).encode())
    return cfg


def deployed_client(context: Context, config: Callable[[], Mapping]) -> Client:
    """A node host's bridge or a device; ``config()`` composes the experiment's configuration."""
    node = context.node_config
    role = node.get("role")
    check_role(tier_of(context), role)
    private_umask()  # this ClientApp process writes the node's or device's state: the owner's alone

    bridge = role in ("node", "team")
    folder = Path(str(node.get("work-dir") if bridge else node.get("state-dir") or DEFAULT_STATE_DIR)) / state_key(context)

    overrides = str(context.run_config.get("overrides", ""))

    def build_here() -> NumPyClient:
        cfg = cached_config(folder, overrides, config)
        if bridge:  # a bridge imports neither torch nor the engine: it only relays
            return bridge_client(cfg, context)
        from hfl.deploy.device import device_client

        return device_client(cfg, node, state_key(context))  # its torch threads and heap (device_client)

    def build() -> NumPyClient:
        if not bridge:  # a device whose worker is alive: relayed to it, neither torch nor the engine here
            from hfl.deploy.device_worker import DeviceRelay, worker_box

            box = worker_box(node)
            if box.server_alive(stale_after=5.0):
                return DeviceRelay(box, state_key(context), overrides, build_here)
        return build_here()

    if role in ("node", "team"):
        return Deferred(node_properties(node_path(node)), build).to_client()
    if "device-id" not in node:
        raise ValueError('a device SuperNode needs device-id in its node config (--node-config "role=\'device\' device-id=N")')
    return Deferred({"device_id": int(node["device-id"])}, build).to_client()
