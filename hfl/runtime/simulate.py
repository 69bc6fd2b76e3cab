"""``hfl-simulate``: run a hierarchical FL experiment configured with Hydra."""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hfl.accel import batched

from hfl.output import console, run_report, tracking
from hfl.process import interrupts
from hfl.runtime import cli, sweep

from hfl.config import schema
from hfl.config.compose import CONF_DIR
from hfl.runtime.apps import (
    freeze_long_lived_objects,
    make_client_app,
    make_server_app,
    root_server,
    rounds_left,
    run_meta,
)
from hfl.config.checks import validate
from hfl.errors import ConfigError, out_of_space, user_error
from hfl.node.inprocess import InProcessClientProxy, client_manager_of, fit_in_lockstep
from hfl.runtime.build import build_level1_node, check_tree, federation_for, initial_model
from hfl.runtime.polling import simulation_polling
from hfl.output.recorder import Recorder
from hfl.output.report import load_run
from hfl.state.lock import RunLock
from hfl.state.resume import CONFIG as RECORDED_CONFIG, Checkpoint, prepare, state_dir
from hfl.state.store import atomic_write_bytes

log = logging.getLogger("hfl")
ray_actors = logging.getLogger("ray.actors")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def run_inprocess(cfg: Mapping, run_dir: Path, start: Checkpoint | None = None,
                  tracker: tracking.Guarded | None = None) -> None:
    """The root's round loop (hfl.node.root.RootServer) over the level-1 nodes in this process (no Ray): the same
    strategies and clients, used for tests and to measure the runtime's overhead. ``start``:
    go on after that checkpoint's round (hfl.state.resume); ``tracker``: the run's started
    tracker (hfl.output.tracking)."""
    batched.use_runtime_threads(cfg["runtime"])
    tree = federation_for(cfg).tree
    proxies = [
        InProcessClientProxy(f"{t:06d}", lambda t=t: build_level1_node(cfg, t, cfg["runtime"]["state_dir"]).to_client())
        for t in range(len(tree.children("")))
    ]
    manager = client_manager_of(proxies)
    # Only where some lowest node is small enough to be merged: else the parties would only keep
    # each other's nodes built (and glibc an allocation arena per thread: 3,500 devices in 5
    # teams peaked at 1.74 GiB against 1.5 one team at a time).
    smallest = min(len(tree.devices(path)) for path in tree.nodes_at(tree.depth - 1))
    lockstep = cfg["runtime"].get("batch_siblings", False) and smallest <= batched.MERGE_MAX_DEVICES
    server = root_server(cfg, run_dir, manager, start, tracker, fit_many=(
        lambda server_round, timeout: fit_in_lockstep(batched.run_plan_requests, server_round, timeout)) if lockstep else None)
    freeze_long_lived_objects()
    startup_line("round 1 first builds each level-1 node and its devices, in this process")
    server.set_max_workers(1)  # one level-1 node after the other (fit and evaluation rounds)
    server.fit(num_rounds=rounds_left(cfg, start), timeout=None)


def startup_line(text: str) -> None:
    """A start-up phase on the console (a run's and each -m job's) and in the log file: without a
    terminal (no progress bar) the seconds before round 1 are otherwise silent."""
    log.info("hfl: %s", text, extra={console.SHOW: "run", console.STARTUP: True})


def _actor_lines_to_log(data: dict, ignore_prefix: bool = False) -> None:
    """Ray's driver prints what its actors write ("(ClientAppActor pid=...) ..." lines) on its
    own stdout/stderr; this logs them instead (stderr lines as warnings)."""
    import ray._private.worker as ray_worker

    lines = data.get("lines", [])
    if data.get("pid") == "autoscaler":  # as Ray does: its events, not its periodic status dumps
        lines = getattr(ray_worker, "filter_autoscaler_events", list)(lines)
    name = data.get("actor_name") or data.get("task_name")
    prefix = f"({name} pid={data.get('pid')})" if name else f"({data.get('pid')})"
    level = logging.WARNING if data.get("is_err") else logging.INFO
    for line in lines:
        ray_actors.log(level, "%s %s", prefix, ANSI_ESCAPE.sub("", line))  # Flower colours its actors' lines


@contextmanager
def ray_output_to_log() -> Iterator[dict]:
    """Ray's own log lines and its actors' output go to the logging tree (the run's log file)
    rather than straight to the console; yields the ``ray.init`` arguments that keep Ray from
    configuring its logger again. Ray's actor printer is private: should it move, its lines
    stay on the console and nothing breaks."""
    import ray._private.worker as ray_worker

    ray_logger = logging.getLogger("ray")
    saved = list(ray_logger.handlers), ray_logger.propagate, ray_logger.level
    printer = getattr(ray_worker, "print_to_stdstream", None)
    ray_logger.handlers.clear()
    ray_logger.propagate, ray_logger.level = True, logging.INFO
    if printer is not None:
        ray_worker.print_to_stdstream = _actor_lines_to_log
    try:
        yield {"configure_logging": False}
    finally:
        ray_logger.handlers[:] = saved[0]
        ray_logger.propagate, ray_logger.level = saved[1:]
        if printer is not None:
            ray_worker.print_to_stdstream = printer


def ray_init_args(runtime: Mapping) -> dict:
    """The ``ray.init`` arguments of a simulation (Flower's ``backend_config["init_args"]``, which
    its Ray backend passes to ``ray.init`` as they are). ``runtime.ray_address`` null starts a
    fresh local Ray instance explicitly (``address="local"``): ``ray.init()`` without an address
    would join whatever ``RAY_ADDRESS`` or ``<temp dir>/ray_current_cluster`` names, even a
    cluster long dead (a run then waits minutes and dies). A value (``"auto"``, ``"host:6379"``,
    ``"ray://host:10001"``) joins that cluster. ``runtime.ray_tmp_dir`` is Ray's temp directory
    (where a fresh instance writes its session, and where ``"auto"`` looks for one). Nothing
    about resources: ``ray.init`` refuses ``num_cpus`` and the like when it joins a cluster;
    Flower's ``client_resources`` size the level-1 nodes' actors instead."""
    address = runtime.get("ray_address")
    args: dict = {"address": str(address) if address else "local", "include_dashboard": False}
    if runtime.get("ray_tmp_dir"):
        args["_temp_dir"] = str(runtime["ray_tmp_dir"])
    return args


def run_simulation(cfg: Mapping, run_dir: Path, start: Checkpoint | None = None,
                   tracker: tracking.Guarded | None = None) -> None:
    """Flower's Simulation Runtime (Ray): one SuperNode per level-1 node (``start`` and ``tracker`` as
    run_inprocess's; the ServerApp runs in this process, so the tracker is this one)."""
    from flwr.simulation import run_simulation as flwr_run_simulation

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    runtime = cfg["runtime"]
    verbose = bool(runtime["verbose"])
    init_args = ray_init_args(runtime)
    supernodes = len(federation_for(cfg).tree.children(""))
    where = ("a local Ray instance" if init_args["address"] == "local"
             else f"the Ray cluster at {init_args['address']}")
    startup_line(f"starting Flower's simulation on {where}: {supernodes} SuperNodes, one per level-1 node")
    # Ray's lines always reach the log file; runtime.verbose lets the console show them too
    # (hfl.output.console), and Flower's DEBUG lines, which the log file always has.
    with ray_output_to_log() as logging_args, simulation_polling(runtime.get("poll_interval")), interrupts.kept_from_ray():
        flwr_run_simulation(
            server_app=make_server_app(cfg, run_dir, start, tracker),
            client_app=make_client_app(cfg),
            num_supernodes=supernodes,
            backend_config={"client_resources": {"num_cpus": runtime["num_cpus_per_team"], "num_gpus": float(runtime.get("num_gpus_per_team", 0.0))},
                            "init_args": {**init_args, **logging_args}},
            verbose_logging=verbose,
        )


def cluster_state_warning(runtime: Mapping, state: Path) -> str | None:
    """A run joining an existing Ray cluster (``runtime.ray_address``) with its state in the
    run directory (``runtime.state_dir`` null): level-1 nodes on other Ray nodes read and write
    that path on their own filesystems, so unless it is shared their devices would silently
    start from scratch whenever Flower hands a level-1 node to an actor elsewhere."""
    address = str(runtime.get("ray_address") or "local").strip()
    if runtime["name"] != "simulation" or address == "local" or runtime["state_dir"]:
        return None
    return (f"runtime.ray_address={runtime['ray_address']} joins an existing Ray cluster, and runtime.state_dir is "
            f"null: nodes and devices keep their state in {state}, so the run directory must be on a filesystem "
            "every Ray node shares (else set runtime.state_dir to a directory every Ray node mounts)")


def run(cfg: Mapping, run_dir: str | Path, on_accepted: Callable[[], None] | None = None) -> dict:
    """Validate, build the federation (failing before training on bad input), run, and
    return the summary; raises if the run did not complete every round. With ``resume``
    true, go on with the run killed in ``run_dir`` after its last completed global round
    (hfl.state.resume); a finished run is only reported. ``on_accepted``: called once the run
    directory is this run's (locked, and neither the overwrite guard nor a resumption refused it),
    before anything is written there for the run: what a refused run must not write waits for it."""
    cfg = json.loads(json.dumps(cfg))  # a private, plain copy
    run_dir = Path(run_dir)
    validate(cfg)
    if cfg["runtime"]["name"] == "deployment":
        raise ConfigError("runtime.name", "deployment runs are submitted to a running global SuperLink "
                          "with `hfl-deploy submit` (see docs/runtimes.md, Deployment), not started by hfl-simulate")
    # Experiment tracking (the logger group, hfl.output.tracking): its library and store checked now.
    # It is not part of the run: the run's recorded config leaves it out (a run resumes under any logger).
    tracked = json.loads(json.dumps(cfg))  # what the tracker records: the config as given
    tracker = tracking.open_tracker(cfg.pop("logger", None), run_dir)
    fed = federation_for(cfg)
    check_tree(cfg, fed.tree)
    initial_model(cfg, fed)  # the model must fit the data (and the algorithm) before any process starts
    with RunLock(run_dir):  # one run at a time in a run directory (hfl.state.lock)
        return _run_locked(cfg, run_dir, fed, tracker, tracked, on_accepted)


def _run_locked(cfg: dict, run_dir: Path, fed, tracker, tracked: dict,  # noqa: ANN001
                on_accepted: Callable[[], None] | None = None) -> dict:
    """``run`` once the run directory is this process's."""
    start = prepare(cfg, run_dir)  # refuses a resumption of another config, or a fresh run over a run; rolls back
    if on_accepted is not None:
        on_accepted()
    rounds = int(cfg["global_rounds"])
    if start is not None and start.round >= rounds:
        log.info("hfl: the run in %s is complete (%d of %d global rounds); nothing to resume",
                 console.shown_path(run_dir), start.round, rounds, extra={console.SHOW: "run"})
        return finished_summary(cfg, run_dir, start, tracker, tracked)
    if cfg["resume"]:
        log.info("hfl: resuming the run in %s after global round %d of %d", console.shown_path(run_dir),
                 start.round if start is not None else 0, rounds, extra={console.SHOW: "run"})
    # <run dir>/state or the run's folder under runtime.state_dir; absolute, as Ray workers have cwds of their own
    state = state_dir(cfg, run_dir).resolve()
    warning = cluster_state_warning(cfg["runtime"], state)
    if warning:
        log.warning("hfl: %s", warning)
    cfg["runtime"]["state_dir"] = str(state)
    log.info("hfl: %s on %s/%s, a tree of depth %d with %d level-1 nodes and %d devices, %s -> %s",
             cfg["algorithm"]["name"], cfg["dataset"]["name"], cfg["model"]["name"], fed.tree.depth, len(fed.tree.children("")),
             len(fed.devices), console.plural(cfg["global_rounds"], "global round"), console.shown_path(run_dir),
             extra={console.SHOW: "run"})
    state.mkdir(parents=True, exist_ok=True)
    started = tracking.begin(tracker, tracked, start.recorder["lines"] if start is not None else ())
    try:
        with interrupts.closing_on_interrupt(started.close if started is not None else None):
            (run_inprocess if cfg["runtime"]["name"] == "inprocess" else run_simulation)(cfg, run_dir, start, started)
    finally:
        if started is not None:
            started.close()  # a tracker run the recorder did not finish: the run failed or was stopped
    summary = _read_summary(run_dir)
    if summary.get("rounds") != cfg["global_rounds"] and not summary.get("stopped"):  # stopped: privacy's budget
        raise RuntimeError(
            f"the run stopped after {summary.get('rounds', 0)} of {cfg['global_rounds']} global rounds; "
            "see the log above for the Flower error"
        )
    return summary


def _read_summary(run_dir: Path) -> dict:
    """summary.json, or {} when it is missing or unreadable (named in a warning): the caller
    writes it again from the checkpoint, or reports the run unfinished."""
    path = run_dir / "summary.json"
    if not path.exists():
        return {}
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("hfl: %s is unreadable (%s)", path, " ".join(str(exc).split()))
        return {}
    return summary if isinstance(summary, dict) else {}


# Refusals that leave the run directory to the run it was refused for: nothing of the refused
# run may reach it, its log lines and Hydra's .hydra/ files included.
REFUSALS = ("overwrite", "hydra.run.dir", "resume", "runtime.state_dir")


class HeldLog:
    """Hydra's log file held back: its records wait in memory until the run is accepted
    (``release(True)``), and are dropped when the run is refused (``release(False)``); a run
    refused for a directory appends nothing to the log of the run that owns it."""

    def __init__(self) -> None:
        root = logging.getLogger()
        self.file = next((h for h in root.handlers if isinstance(h, logging.FileHandler)), None)
        self.memory: logging.handlers.MemoryHandler | None = None
        if self.file is not None:
            self.memory = logging.handlers.MemoryHandler(10_000, logging.CRITICAL + 1, self.file, flushOnClose=False)
            self.memory.setLevel(self.file.level)
            root.removeHandler(self.file)
            root.addHandler(self.memory)

    def release(self, keep: bool) -> None:
        if self.memory is None:
            return
        root = logging.getLogger()
        root.removeHandler(self.memory)
        if keep:
            self.memory.flush()
        self.memory.buffer.clear()
        root.addHandler(self.file)
        self.memory = None


def write_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """``.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml``, as Hydra writes them, but once
    the run is accepted (``hydra.output_subdir`` is null in conf/config.yaml: Hydra would write them
    before any check, over the files of a finished run a refused one was refused for)."""
    hydra_cfg = HydraConfig.get()
    folder = run_dir / ".hydra"
    folder.mkdir(exist_ok=True)
    for name, value in (("config.yaml", cfg), ("hydra.yaml", OmegaConf.create({"hydra": hydra_cfg})),
                        ("overrides.yaml", hydra_cfg.overrides.task)):
        atomic_write_bytes(folder / name, OmegaConf.to_yaml(value).encode())


def finished_summary(cfg: Mapping, run_dir: Path, done: Checkpoint, tracker: tracking.Tracker | None = None,
                     tracked: Mapping | None = None) -> dict:
    """A finished run's summary; written again (with its plots, and the tracker's artifacts) if
    the run was killed after its last checkpoint and before them."""
    summary = _read_summary(run_dir)  # a damaged one is written again below, from the checkpoint
    if summary.get("rounds") == cfg["global_rounds"]:
        if not all((run_dir / name).exists() for name in ("report.md", "accuracy.png", "loss.png")):
            run_report.write_run_report(run_dir)  # killed after the summary, before its plots
        return summary
    started = tracking.begin(tracker, tracked or cfg, done.recorder["lines"])
    recorder = Recorder(run_dir, run_meta(cfg), int(cfg["global_rounds"]), restore={**done.recorder, "round": done.round},
                        tracker=started)
    try:
        return recorder.finish()
    finally:
        if started is not None:
            started.close()


def console_mode(cfg: DictConfig) -> str:
    """verbose (runtime.verbose=true: everything, as Flower and Ray print it), multirun
    (Hydra -m: one line per job) or run (a line per evaluated round, a bar, a table)."""
    if cfg.runtime.verbose:
        return "verbose"
    return "multirun" if HydraConfig.get().mode == RunMode.MULTIRUN else "run"


def report_run(run_dir: Path) -> None:
    """The summary table (a single run) or the job's line (multirun), on the console and in
    the log file."""
    run = load_run(run_dir)
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        line = console.job_line(run, hydra_cfg.job.num)
        log.info("%s", line, extra={console.SHOW: "multirun"})
    else:
        table = console.summary_renderable(run, console.log_file())
        log.info("%s", console.plain_text(table), extra={console.SHOW: "run", console.RENDER: table})


# Set by main() while Hydra composes, so that a composition error reaches main() rather than
# Hydra's own multi-line report; the job itself runs without it (see main).
FULL_ERROR = "HYDRA_FULL_ERROR"
_full_error_is_ours = False


def _composed() -> None:
    """The config is composed: Hydra reports any later error as it always does."""
    global _full_error_is_ours
    if _full_error_is_ours:
        os.environ.pop(FULL_ERROR, None)
        _full_error_is_ours = False


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def task(cfg: DictConfig) -> float | None:
    _composed()
    handler = console.install(console_mode(cfg))
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    rounds = cfg.get("global_rounds")  # not validated yet: a bad value is run()'s to report
    overrides, config_name = list(hydra_cfg.overrides.task), str(hydra_cfg.job.config_name)
    plain: dict | None = None
    held = HeldLog()
    if hydra_cfg.mode == RunMode.MULTIRUN:  # the job's lines say which job they are
        swept = ",".join(tracking.swept_overrides(overrides, sys.argv[1:]))
        handler.prefix = f"#{hydra_cfg.job.num}{f' {swept}' if swept else ''}: "

    def accepted() -> None:
        held.release(True)
        write_hydra_files(run_dir, cfg)

    try:
        schema.check_keys(cfg)  # a key nothing reads (+algorithm.alhpa=0.5): refused before anything
        plain = OmegaConf.to_container(cfg, resolve=True)
        with interrupts.stop_on_signals(lambda: interrupts.interrupted_line(run_dir, overrides, rounds, config_name), handler), \
                handler.progress(rounds if isinstance(rounds, int) and not isinstance(rounds, bool) else None), \
                handler.errors_held(lambda exc: user_error(exc, plain, run_dir) is not None):
            summary = run(plain, run_dir, accepted)
        report_run(run_dir)
    except Exception as exc:
        # An error the user can fix (a bad setting or data file, a full disk, an unwritable run
        # directory, a diverged run): one line, exit status 1; the traceback goes to the log file
        # (and to the console with runtime.verbose=true). Anything else is a bug: Hydra reports it.
        line = user_error(exc, plain, run_dir)
        if line is None:
            raise
        if out_of_space(exc) and (run_dir / RECORDED_CONFIG).exists():
            line += f"; then resume with: {interrupts.resume_command(overrides, run_dir, config_name)}"
        log.error("%s", line, exc_info=True, extra={console.SHOW: "file"})
        held.release(not (isinstance(exc, ConfigError) and exc.key in REFUSALS))  # a refusal's lines: dropped
        if hydra_cfg.mode == RunMode.MULTIRUN:  # recorded by hfl.runtime.sweep; the sweep goes on
            raise sweep.JobFailed(line) from None
        raise SystemExit(f"hfl-simulate: {line}") from None
    finally:
        held.release(True)  # a run stopped otherwise (Ctrl-C) keeps its lines
    best = summary["best"]
    return best.get("pm_accuracy") or best.get("gm_accuracy")


def main() -> None:
    """``hfl-simulate``: Hydra composes the config against the schema (hfl/config/schema.py) and runs
    ``task``. A value of the wrong type or an unknown key is refused while composing, before
    ``task`` starts: printed as one line naming the key, exit status 1, as ``run`` reports
    every other bad value (NaN and infinities included); Hydra's other composition errors (an
    unknown option) are printed as Hydra words them; a run directory Hydra cannot create (a file
    in the way, a read-only or full disk) is named in one line too. ``HYDRA_FULL_ERROR=1`` in the
    environment keeps Hydra's full report. Errors of the run itself: ``task`` (hfl.errors.user_error);
    Ctrl-C and SIGTERM: hfl.process.interrupts."""
    try:
        _main()
    except KeyboardInterrupt:  # before the run's own handler (interrupts.stop_on_signals) is in place
        interrupts.exit_interrupted(f"{interrupts.PROGRAM}: interrupted while no run was going on; nothing to resume")


def _main() -> None:
    global _full_error_is_ours
    schema.register()
    cli.register_resolvers()  # conf/hydra/help/hfl.yaml's (python -m hfl.runtime.simulate --help; --cfg hydra)
    logging.raiseExceptions = False  # a log file on a full disk: no '--- Logging error ---' traceback per record
    if os.environ.get(FULL_ERROR):
        task()
        return
    os.environ[FULL_ERROR], _full_error_is_ours = "1", True  # Hydra raises composition errors to us
    try:
        task()
    except Exception as exc:  # composition errors, and Hydra's creating the run directory and its log file
        error = schema.config_error(exc) or user_error(exc)
        if error is None and not isinstance(exc, CompactHydraException):
            raise
        raise SystemExit(f"hfl-simulate: {error or exc}") from None
    finally:
        _composed()


if __name__ == "__main__":
    main()
