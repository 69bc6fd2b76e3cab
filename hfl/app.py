"""Flower's entry points for ``flwr run`` and every deployment host (``pyproject.toml``,
``[tool.flwr.app.components]``), light to import.

Flower starts a new ClientApp process for every message a SuperNode receives, and it imports
this module first. A node host's bridge only relays the message to its node server
(``hfl.deploy.bridge``), so its path imports neither torch nor the engine (about 4 s a message
on 2 cores); everything else loads ``hfl.runtime.apps``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flwr.client import Client, ClientApp
from flwr.common import Context
from flwr.server import ServerApp


def _config(context: Context) -> dict:
    from hfl.config.compose import context_config

    return context_config(context)


def _client_fn(context: Context) -> Client:
    if context.node_config.get("role") is not None:  # a deployment's bridge or device
        from hfl.deploy.wiring import deployed_client

        return deployed_client(context, lambda: _config(context))
    from hfl.runtime.apps import _flwr_client_fn

    return _flwr_client_fn(context)


class _ServerApp(ServerApp):
    """``flwr run``'s ServerApp: in a deployment the root (hfl.deploy.root_run) or a node server
    (hfl.deploy.node_server), driven through the Grid directly; in simulation Flower's legacy loop
    (``hfl.runtime.apps.server_app``), imported when a run starts."""

    def __call__(self, grid: Any, context: Context) -> None:
        from hfl.deploy.wiring import tier_of

        cfg = _config(context)
        if cfg["runtime"]["name"] == "deployment":
            from hfl.deploy.supernode import shorten_object_pulls

            shorten_object_pulls()  # the children's replies pulled without Flower's 1 s first retry
        if tier_of(context) == "node":
            from hfl.deploy.node_server import serve_node

            serve_node(grid, context, cfg)
        elif cfg["runtime"]["name"] == "deployment":
            from hfl.deploy.root_run import serve_root
            from hfl.runtime.apps import _output_dir

            serve_root(grid, context, cfg, _output_dir(context, deployed=True))
        else:
            from hfl.runtime.apps import server_app

            check_federation(grid, cfg, str(context.run_config.get("overrides", "")))
            out = record_config(context, cfg)
            server_app(grid, context)
            said_where(out)


def check_federation(grid: Any, cfg: dict, overrides: str) -> None:
    """``flwr run .`` on Flower's defaults (2 simulated SuperNodes) against a tree of another number of
    level-1 nodes: stopped before anything is built, in one line naming the command that sizes the
    federation (the root would otherwise wait ``runtime.team_wait_seconds`` and fail with a traceback)."""
    from hfl.runtime.build import federation_for

    needed = len(federation_for(cfg).tree.children(""))
    have = len(list(grid.get_node_ids()))
    if have != needed:
        managed = managed_superlink()
        raise RuntimeError(
            f"hfl: this federation has {have} SuperNodes and the experiment {needed} level-1 nodes (one SuperNode "
            f"each): run `hfl-deploy simulate {overrides or 'OVERRIDES'}`, which sizes the federation and stops its "
            f"SuperLink, or `flwr run . <connection> --federation-config num-supernodes={needed}`"
            + (f"; Flower's local SuperLink keeps running (`kill {managed}` stops it)" if managed else ""))


def managed_superlink(pid: int | None = None) -> int | None:
    """The process id of the SuperLink that ``flwr run`` started for itself (detached, logging to
    ``$FLWR_HOME/local-superlink/``; Flower has no command to stop it) among this process's ancestors;
    None elsewhere (a SuperLink someone started, a system without /proc)."""
    import os

    pid = os.getppid() if pid is None else pid
    for _ in range(8):  # SuperLink -> SuperExec -> this app process, give or take a wrapper
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")  # noqa: SIM115 - a one-shot read
            parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])  # noqa: SIM115
        except (OSError, ValueError, IndexError):
            return None
        if any(arg.endswith(b"flower-superlink") for arg in argv[:2]) and \
                any(arg.endswith(b"local-superlink/superlink.log") for arg in argv):
            return pid
        if parent <= 1:
            return None
        pid = parent
    return None


def said_where(out: Path) -> None:
    """The stream's last line: where the outputs went and, on Flower's managed SuperLink, that it keeps
    running and how to stop it (Flower's logger: hfl's own lines do not reach ``flwr run --stream``)."""
    from logging import INFO

    from flwr.common.logger import log as flower_log

    managed = managed_superlink()
    flower_log(INFO, "hfl: outputs in %s%s", out.resolve(),
               f"; Flower's local SuperLink keeps running (`kill {managed}` stops it)" if managed else "")


def record_config(context: Context, cfg: dict) -> Path:
    """``flwr run``'s root records its config in its run directory, as hfl-simulate's and a deployment's
    root do: the run's report reads the seed and settings there (without it, report.md said ``seed: —``)."""
    import time

    from hfl.output.paths import run_dir
    from hfl.state.resume import record_config as record

    # the folder named once here, so that the server below writes into the same one
    name = str(context.run_config.get("run-name") or "") or time.strftime("%Y-%m-%d_%H-%M-%S")
    context.run_config = {**context.run_config, "run-name": name}
    out = run_dir(context.run_config, name, absolute=False)
    record(cfg, out)
    return out


def _secagg_mod(msg: Any, context: Context, call_next: Any) -> Any:
    """Flower's ``secaggplus_mod`` for SecAgg+'s stage messages (a lowest node server's secure aggregation,
    hfl.deploy.secagg); every other message (a bridge's, evaluation, a round without it) passes by untouched,
    where the bare mod would fail on a train message lacking its config record."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if msg.metadata.message_type != "train" or RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)
    from hfl.deploy.secagg import device_mod

    return device_mod(msg, context, call_next)


client_app = ClientApp(client_fn=_client_fn, mods=[_secagg_mod])
server_app = _ServerApp()
