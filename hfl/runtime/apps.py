"""The Flower ServerApp (global server) and ClientApp (level-1 nodes).

``hfl-simulate`` builds them bound to a Hydra config (``make_server_app``/``make_client_app``);
``flwr run .`` reaches ``server_app`` and ``_flwr_client_fn`` through ``hfl.app`` (light to
import), which compose the same config from the run config's ``overrides`` string
(``hfl.config.compose``).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from flwr.client import Client, ClientApp
from flwr.common import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.client_manager import ClientManager, SimpleClientManager

from hfl.clock.model import run_clock
from hfl.clock.policy import LevelPolicy
from hfl.clock.realtime import Flights
from hfl.accel.batched import use_runtime_threads
from hfl.algorithm import NodeContext, RunSettings, ServerRule
from hfl.config.typed import algorithm_params
from hfl.config.checks import load_server
from hfl.config.compose import context_config
from hfl.runtime.build import (build_level1_node, eval_fraction, evaluation_sampled, federation_for, initial_model,
                               level_selection)
from hfl.rules.payload import Payload
from hfl.runtime.polling import PolledServerApp
from hfl.output import tracking
from hfl.output.recorder import Recorder
from hfl.state.resume import Checkpoint
from hfl.node.inprocess import FitMany
from hfl.node.root import RootServer, RootStrategy
from hfl.tree.sampling import DeviceDraw, EvaluationDraw
from hfl.state.store import StateStore

log = logging.getLogger("hfl")


def run_meta(cfg: Mapping) -> dict:
    """What summary.json says the run was."""
    return {"algorithm": cfg["algorithm"]["name"], "dataset": cfg["dataset"]["name"], "model": cfg["model"]["name"]}


def build_global_strategy(cfg: Mapping, run_dir: str | Path, flights: Flights | None = None) -> RootStrategy:
    """The root: the algorithm's server rule at level 0 as a Flower strategy, rebuilt from the
    state store at every global round (a resumed run's store is rolled back to its checkpoint's);
    ``root_server`` drives it. ``flights``: a deployed root's calls to its level-1 nodes, through
    which, under ``clock.enabled``, its policy runs on real arrivals (hfl.clock.realtime)."""
    fed = federation_for(cfg)
    alg = cfg["algorithm"]
    server = load_server(alg)
    initial = Payload("model", {"model": initial_model(cfg, fed)})
    params, run = algorithm_params(alg), RunSettings.of(cfg)  # the rule's typed settings (hfl.config.typed)

    def make_rule(state: dict | None) -> ServerRule:
        return server(NodeContext(params, run, "", fed.tree.depth, initial, state, fed, run_dir=Path(run_dir)))

    device_sampling = None
    if params.sampling == "devices":
        holds = {path: frozenset(fed.tree.devices_under(path)) for path in fed.tree.children("")}
        device_sampling = DeviceDraw(len(fed.devices), float(params.sample_fraction), int(cfg["seed"]), holds)
    strategy = RootStrategy(
        make_rule,
        StateStore(cfg["runtime"]["state_dir"] or Path(run_dir) / "state"),
        num_children=len(fed.tree.children("")),
        num_rounds=int(cfg["global_rounds"]),
        eval_every=int(cfg["eval_every"]),
        wait_seconds=float(cfg["runtime"]["team_wait_seconds"]),
        device_sampling=device_sampling,
        min_fit_fraction=params.min_fit_fraction,
        selection=level_selection(cfg, 0, lowest=False),  # runtime.dropout_nodes: it drops level-1 nodes too
        # eval_fraction: the root's share of the level-1 nodes; the intervals are drawn against every device
        evaluation=EvaluationDraw(eval_fraction(cfg, 0, fed.tree.depth), int(cfg["seed"]), fed.tree.num_devices)
        if evaluation_sampled(cfg) else None,
        clock=run_clock(cfg) if flights is None else None,  # simulated time (hfl.clock)
        policy=LevelPolicy.for_level(cfg["clock"], 0),
        seed=int(cfg["seed"]),
        flights=flights if cfg["clock"]["enabled"] else None,
    )
    return strategy


def root_server(cfg: Mapping, run_dir: str | Path, client_manager: ClientManager, start: Checkpoint | None = None,
                tracker: tracking.Guarded | None = None,
                fit_many: Callable[[int, float | None], FitMany] | None = None,
                flights: Flights | None = None) -> RootServer:
    """The root's round loop over ``client_manager``'s level-1 nodes (hfl.node.root.RootServer),
    after ``start``'s rounds for a resumed run, observed by the run's recorder (outputs,
    checkpoints; ``tracker``: the run's started tracker, hfl.output.tracking, fed by it)."""
    restore = None if start is None else {**start.recorder, "round": start.round}
    recorder = Recorder(run_dir, run_meta(cfg), int(cfg["global_rounds"]), restore=restore, tracker=tracker)
    return RootServer(client_manager=client_manager, strategy=build_global_strategy(cfg, run_dir, flights),
                      offset=start.round if start is not None else 0, fit_many=fit_many, observers=[recorder])


def rounds_left(cfg: Mapping, start: Checkpoint | None) -> int:
    """The global rounds Flower's loop runs: all of them, or those after the checkpoint's."""
    return int(cfg["global_rounds"]) - (start.round if start is not None else 0)


def level1_client(cfg: Mapping, context: Context) -> Client:
    use_runtime_threads(cfg["runtime"])
    index = int(context.node_config["partition-id"])
    node = build_level1_node(cfg, index, cfg["runtime"]["state_dir"])
    freeze_long_lived_objects()
    return node.to_client()


_frozen = False


def freeze_long_lived_objects() -> None:
    """Once per process, after its first node is built: move everything alive (imports, the
    config, the cached federation: ~300k objects) out of the cyclic garbage collector's sight
    (``gc.freeze``). Full collections rescan every tracked object; with the thousands of small
    objects a team round makes they cost ~0.12 s per 700-device team fit, 0 after the freeze."""
    global _frozen
    if not _frozen:
        gc.collect()
        gc.freeze()
        _frozen = True


def make_server_app(cfg: Mapping, run_dir: str | Path, start: Checkpoint | None = None,
                    tracker: tracking.Guarded | None = None) -> ServerApp:
    def server_fn(context: Context) -> ServerAppComponents:
        return ServerAppComponents(server=root_server(cfg, run_dir, SimpleClientManager(), start, tracker),
                                   config=ServerConfig(num_rounds=rounds_left(cfg, start)))

    return PolledServerApp(server_fn=server_fn, pull_interval=cfg["runtime"].get("poll_interval"))


def make_client_app(cfg: Mapping) -> ClientApp:
    return ClientApp(client_fn=lambda context: level1_client(cfg, context))


# ---- `flwr run .`: the config comes from the run config's Hydra overrides ----

def _output_dir(context: Context, deployed: bool = False) -> Path:
    """``output-dir``/``run-name`` (hfl-deploy submit names its runs, so that a resubmitted run
    finds its directory), or a folder named by the time; checked (hfl.output.paths.run_dir):
    deployed, an absolute output-dir."""
    from hfl.output.paths import run_dir

    out = run_dir(context.run_config, time.strftime("%Y-%m-%d_%H-%M-%S"), absolute=deployed)
    log.info("hfl: writing outputs to %s", out.resolve())
    return out


def _flwr_server_fn(context: Context) -> ServerAppComponents:
    cfg = context_config(context)
    out = _output_dir(context)
    tracker = tracking.begin(tracking.open_tracker(cfg.get("logger"), out), cfg)  # the logger group
    return ServerAppComponents(server=root_server(cfg, out, SimpleClientManager(), tracker=tracker),
                               config=ServerConfig(num_rounds=int(cfg["global_rounds"])))


# ``flwr run``'s simulation: Flower's legacy loop (hfl.app dispatches a deployment's root and node servers)
server_app = ServerApp(server_fn=_flwr_server_fn)
def _flwr_client_fn(context: Context) -> Client:
    """``flwr run``'s simulation: a level-1 node with its subtree (a deployment's bridges and
    devices are hfl.app's, which calls this for every other SuperNode)."""
    return level1_client(context_config(context), context)
