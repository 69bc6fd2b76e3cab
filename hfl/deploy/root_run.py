"""The root of a deployment: the engine's root (``hfl.node.root.RootStrategy`` in its round loop,
``RootServer``, as in simulation) over the level-1 node hosts' bridges, reached through
``hfl.deploy.grid`` (replies looked for from 20 ms on, every 0.25 s at most; Flower waits 3 s). When the rounds are done the
bridges are told to stop their node servers, which tell theirs.

The run directory holds the root's state and checkpoints as hfl-simulate's does: a root run
submitted again with ``resume=true`` (``hfl-deploy submit`` does so when its run was lost: the
root's ServerApp or SuperLink killed) goes on after the last completed global round."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from flwr.app import Context
from flwr.server import ServerConfig
from flwr.server.server import run_fl
from flwr.serverapp.grid import Grid

from hfl.deploy.children import Children, ChildrenManager
from hfl.deploy.flights import GridFlights
from hfl.deploy.grid import tell_stop

log = logging.getLogger("hfl")


def serve_root(grid: Grid, context: Context, cfg: Mapping, out: Path) -> None:
    from hfl.accel.batched import use_runtime_threads
    from hfl.deploy.node_server import log_to
    from hfl.deploy.private import private_umask
    from hfl.output import tracking
    from hfl.runtime.apps import root_server, rounds_left
    from hfl.runtime.build import check_tree, federation_for
    from hfl.runtime.simulate import finished_summary
    from hfl.state.lock import RunLock
    from hfl.state.resume import prepare

    private_umask()  # the run's state, checkpoints and outputs: the owner's alone (this process is the root's own)
    log_to(out / "root.log")
    tree = federation_for(cfg).tree
    check_tree(cfg, tree)  # as hfl-simulate does (hfl-deploy submit did too)
    use_runtime_threads(cfg["runtime"])
    # The root's state lives with its outputs (compose_config points state_dir at a temporary folder).
    cfg = {**cfg, "runtime": {**cfg["runtime"], "state_dir": None}}
    # The level-1 nodes by path: one whose bridge is started again is found under its new node id.
    children = Children(grid, tree.children(""), devices=False,
                        wait_seconds=float(cfg["runtime"]["team_wait_seconds"]), timeout=None)
    try:
        with RunLock(out):
            start = prepare(cfg, out)  # a resumption: the newest checkpoint the stored state matches
            if start is not None:
                log.info("resuming the run in %s after global round %d", out, start.round)
            tracker = tracking.open_tracker(cfg.get("logger"), out)
            if start is not None and start.round >= int(cfg["global_rounds"]):
                finished_summary(cfg, out, start, tracker)
                return
            started = tracking.begin(tracker, cfg, start.recorder["lines"] if start is not None else ())
            # clock.enabled: the root's policy on its level-1 nodes' real arrivals (hfl.clock.realtime)
            flights = GridFlights(grid, children.relocate, children.rejoin_seconds)
            run_fl(root_server(cfg, out, ChildrenManager(children), start, started, flights=flights),
                   ServerConfig(num_rounds=rounds_left(cfg, start)))
    except Exception:
        log.exception("the root's run failed")
        raise
    finally:
        tell_stop(grid, list(children.nodes.values()))
