"""Which role a Flower process plays, from its run config (``tier``) and node config (``role``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from flwr.client import Client
from flwr.common import Context
from flwr.server import ServerAppComponents, ServerConfig

from hfl.algorithm import NodeContext
from hfl.config.checks import load_server
from hfl.deploy.bridge import BridgeSettings, TeamBridge
from hfl.deploy.control import ControlClient
from hfl.deploy.device import device_client
from hfl.deploy.jobs import TeamJob, load_arrays
from hfl.deploy.team_run import TeamEvaluationRun, TeamFitRun
from hfl.runtime.build import federation_for
from hfl.node.payload import Payload
from hfl.node.strategy import NodeStrategy

TIERS = ("global", "team")
ROLES = ("team", "device")
PROJECT_DIR = Path(__file__).resolve().parents[2]


def tier_of(context: Context) -> str:
    tier = str(context.run_config.get("tier", "global"))
    if tier not in TIERS:
        raise ValueError(f"run config tier must be one of {TIERS}, got {tier!r}")
    return tier


def check_role(tier: str, role: object) -> None:
    """A device must hang under a team SuperLink, a bridge under the global one."""
    expected = {"global": ("team", None), "team": ("device",)}[tier]
    if role not in expected:
        where = "the global SuperLink" if tier == "global" else "a team SuperLink"
        raise ValueError(f"a SuperNode with role={role!r} received a {tier}-tier run: it is connected to {where}; "
                         f"nodes there must have role {' or '.join(repr(r) for r in expected if r)}")


def state_key(context: Context) -> str:
    """Devices keep state per global run; the bridge passes its key to every team run."""
    return str(context.run_config.get("state-key") or f"run-{context.run_id}")


def team_server_components(cfg: Mapping, context: Context) -> ServerAppComponents:
    job = TeamJob.load(str(context.run_config["job"]))
    alg, runtime = cfg["algorithm"], cfg["runtime"]
    if job.action == "fit":
        # The team host's node: the algorithm's rule at level 1 of a three-tier tree, from its
        # parent's model alone (hfl.config.checks refuses algorithms whose nodes need more there). A team
        # host need not hold the data, so its context has no federation.
        parent = Payload("model", {"model": load_arrays(job.parent)})
        rule = load_server(alg)(NodeContext(cfg, str(job.team_id), 2, parent, None, None))
        inner = NodeStrategy(rule, float(alg.get("min_fit_fraction", 1.0)))
        rounds = int(alg["team_rounds"])
        strategy = TeamFitRun(inner, job, rounds)
    else:
        rounds = 1
        strategy = TeamEvaluationRun(job, bool(alg.get("global_model", True)), bool(alg["personalized"]))
    timeout = runtime.get("team_round_timeout")
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds, round_timeout=timeout))


def bridge_client(cfg: Mapping, context: Context) -> Client:
    node = context.node_config
    for key in ("team-id", "team-superlink", "work-dir"):
        if key not in node:
            raise ValueError(f"a team bridge SuperNode needs {key} in its node config")
    team_id = int(node["team-id"])
    runtime = cfg["runtime"]
    if "num-devices" in node:  # the team host does not hold the data: trust the operator's count
        device_ids = None
        count = int(node["num-devices"])
    else:
        teams = federation_for(cfg).teams
        if not 0 <= team_id < len(teams):
            raise ValueError(f"team-id {team_id} does not exist: the topology has {len(teams)} teams")
        device_ids = [int(d) for d in teams[team_id]]
        count = len(device_ids)
    settings = BridgeSettings(
        team_id=team_id, device_ids=device_ids, num_devices=count,
        overrides=str(context.run_config.get("overrides", "")), state_key=state_key(context),
        work_dir=Path(str(node["work-dir"])), device_wait_seconds=float(runtime.get("device_wait_seconds", 30)),
        team_run_timeout=float(runtime.get("team_run_timeout", 3600)),
        global_model=bool(cfg["algorithm"].get("global_model", True)),
    )
    app_dir = Path(str(node.get("app-dir") or PROJECT_DIR))
    if not (app_dir / "pyproject.toml").exists():
        raise ValueError(f"app-dir {app_dir} holds no pyproject.toml; set app-dir in the bridge's node config")
    link = ControlClient(str(node["team-superlink"]), str(node.get("team-root-certificates", "")),
                    settings.work_dir / "flwr-home", app_dir)
    return TeamBridge(settings, link).to_client()


def deployed_client(cfg: Mapping, context: Context) -> Client:
    torch.set_num_threads(int(cfg["runtime"]["torch_threads"]))
    role = context.node_config.get("role")
    check_role(tier_of(context), role)
    if role == "team":
        return bridge_client(cfg, context)
    return device_client(cfg, context.node_config, state_key(context)).to_client()
