"""The root of a deployment: the engine's root (``hfl.node.root.RootStrategy``, as in simulation)
driven by Flower's legacy ``Server`` over the level-1 node hosts' bridges, reached through
``hfl.deploy.grid`` (replies looked for from 20 ms on, every 0.25 s at most; Flower waits 3 s). When the rounds are done the
bridges are told to stop their node servers, which tell theirs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from flwr.app import Context
from flwr.server import Server, ServerConfig
from flwr.server.server import run_fl
from flwr.serverapp.grid import Grid

from hfl.deploy.grid import GridClientManager, tell_stop

def serve_root(grid: Grid, context: Context, cfg: Mapping, out: Path) -> None:
    from hfl.accel.batched import use_runtime_threads
    from hfl.output import tracking
    from hfl.runtime.apps import build_global_strategy
    from hfl.runtime.build import check_tree, federation_for

    check_tree(cfg, federation_for(cfg).tree)  # as hfl-simulate does (hfl-deploy submit did too)
    use_runtime_threads(cfg["runtime"])

    # The root's state lives with its outputs (compose_config points state_dir at a temporary folder).
    cfg = {**cfg, "runtime": {**cfg["runtime"], "state_dir": None}}
    tracker = tracking.begin(tracking.open_tracker(cfg.get("logger"), out), cfg)
    strategy = build_global_strategy(cfg, out, tracker=tracker)
    manager = GridClientManager(grid)
    try:
        run_fl(Server(client_manager=manager, strategy=strategy), ServerConfig(num_rounds=int(cfg["global_rounds"])))
    finally:
        tell_stop(grid, [proxy.node_id for proxy in manager.all().values()])
