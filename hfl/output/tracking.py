"""Experiment tracking: the ``logger`` config group (conf/logger/), ``none`` (the default),
``tensorboard`` or ``mlflow``.

A tracker run per hfl run (per Hydra job under ``-m``) gets the run's config (flattened, as
parameters), every numeric field of every metrics.jsonl row at step = its global round, named
alike in both trackers: grouped as ``<stat>/<level>`` with the levels named as the console and the
reports name them (pm, level1, ..., gm), each figure once (``tracker_tag``, ``repeats``), and at the end the run's accuracy.png, loss.png and report.md. The backends
import their libraries only when chosen: ``logger=none`` needs neither.

Before training (``hfl.runtime.simulate.run``): ``open_tracker`` imports the backend's library
and opens its store, ``begin`` starts the tracker run; either failure stops the run with a
ConfigError naming the key (``logger.name`` for a missing library, ``logger.tracking_uri`` for
an MLflow store that cannot be opened, ...). While the run trains, the recorder
(hfl.output.recorder) hands each metrics.jsonl row to the tracker after writing it; a tracker
that fails then is logged once, as a warning, and dropped for the rest of the run
(``Guarded``): metrics.jsonl and the run never depend on it.

A resumed run (``resume=true``) goes on in the same tracker run: MLflow's run id is kept in
the run directory (``tracker.json``), and the rows the run had before it stopped are logged
again where that run lacks them (all of them in a new tracker run, when the old one cannot be
found); TensorBoard appends to the same folder the rows it lacks. Either shows each round
once: a round the killed run logged after its last checkpoint is run again, and keeps the
values first logged (the same, but for its wall-clock seconds). A new run (``resume=false``)
in a run directory that had one starts a new MLflow run, and empties the TensorBoard folder
of its events, as it does metrics.jsonl.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from hfl.errors import ConfigError
from hfl.state.resume import flatten

log = logging.getLogger("hfl")

LOGGERS = ("none", "tensorboard", "mlflow")
STATE = "tracker.json"  # in the run directory: the MLflow run a resumed run goes on with
ARTIFACTS = ("accuracy.png", "loss.png", "report.md", "summary.json")


class Tracker(Protocol):
    """A backend. ``start``, ``log_round`` and ``finish`` raise whatever their library raises
    (``begin`` and ``Guarded`` decide what that means for the run); ``close`` ends a tracker run
    that did not reach ``finish`` (the run failed or was stopped)."""

    name: str
    key: str  # the config key a failure to start is blamed on

    def start(self, cfg: Mapping, done: Sequence[Mapping]) -> None: ...

    def log_round(self, row: Mapping) -> None: ...

    def finish(self, run_dir: Path) -> None: ...

    def close(self) -> None: ...


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0].strip() if text else type(exc).__name__
    return first if len(first) <= 300 else first[:297] + "..."


def swept_overrides(job_overrides: Sequence[str], command_line: Sequence[str]) -> list[str]:
    """The job's overrides of the keys its ``-m`` command line sweeps (``seed=0,1,2``,
    ``algorithm=permfl,bhfl``, ``range(3)``, ``glob(*)``): what tells the job from its siblings;
    [] where nothing is swept or the command line is not Hydra's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    try:
        swept = {o.get_key_element() for o in parser.parse_overrides(
            [arg for arg in command_line if "=" in arg and not arg.startswith("-")]) if o.is_sweep_override()}
        parsed = parser.parse_overrides(list(job_overrides))
    except Exception:  # noqa: BLE001 - a label is never worth failing a run for
        return []
    return [text for text, o in zip(job_overrides, parsed, strict=True) if o.get_key_element() in swept]


def _sweep_job_label(run_dir: Path) -> str | None:
    """``k=v,...`` of the swept keys where ``run_dir`` is the running ``-m`` job's directory."""
    import sys

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    job = HydraConfig.get()
    if job.mode != RunMode.MULTIRUN or Path(job.runtime.output_dir).resolve() != run_dir:
        return None
    # The basic launcher runs the jobs in this process: sys.argv is the sweep's command line.
    return ",".join(swept_overrides(list(job.overrides.task), sys.argv[1:])) or None


def run_label(run_dir: Path) -> str:
    """A run's name in a tracker: ``<date>/<time>`` (its directory's last two parts) for a single
    run; ``<sweep time>/<what the job sweeps>`` (``12-00-00/seed=1``, ``.../algorithm=bhfl,seed=1``)
    for a job of ``-m``, ``<sweep time>/<job number>`` where it sweeps nothing."""
    run_dir = Path(run_dir).resolve()
    return f"{run_dir.parent.name}/{_sweep_job_label(run_dir) or run_dir.name}"


def numeric_fields(row: Mapping) -> dict[str, float]:
    """Every number of a metrics.jsonl row (nested mappings as ``a.b``), but its ``round``
    (the step) and booleans; nulls, strings and lists are left out."""
    return {key: value for key, value in flatten(row).items()
            if key != "round" and isinstance(value, int | float) and not isinstance(value, bool)}


def param_values(cfg: Mapping) -> dict[str, str]:
    """The config flattened (``algorithm.eta``), each value as text: strings as they are, every
    other value as JSON (``0.05``, ``true``, ``null``, ``[2, 3]``)."""
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in flatten(cfg).items()}


# ------------------------------------------------------------------------- opening one
KEYS = {
    "none": {"name"},
    "tensorboard": {"name", "log_dir"},
    "mlflow": {"name", "tracking_uri", "experiment_name", "run_name", "artifact_location"},
}


def open_tracker(logger: Mapping | None, run_dir: str | Path) -> Tracker | None:
    """The ``logger`` config's backend with its library imported and its store open, or None for
    ``logger=none`` (or no ``logger`` at all); a ConfigError naming the key otherwise."""
    if logger is None:
        return None
    if not isinstance(logger, Mapping):
        raise ConfigError("logger", f"must be a logger's config (logger={'|'.join(LOGGERS)}), got {logger!r}")
    name = logger.get("name")
    if name not in LOGGERS:
        raise ConfigError("logger.name", f"unknown logger {name!r}; known: {', '.join(LOGGERS)}")
    extra = sorted(set(logger) - KEYS[name])
    if extra:
        known = ", ".join(sorted(KEYS[name]))
        raise ConfigError(f"logger.{extra[0]}", f"logger={name} has no such key (its keys: {known})")
    missing = sorted(KEYS[name] - set(logger))
    if missing:
        raise ConfigError("logger.name", f"logger.{missing[0]} is missing: pick a logger with logger={name} "
                                         "(the config group), not by setting logger.name")
    if name == "none":
        return None
    run_dir = Path(run_dir)
    return TensorBoardTracker(logger, run_dir) if name == "tensorboard" else MlflowTracker(logger, run_dir)


def begin(tracker: Tracker | None, cfg: Mapping, done: Sequence[Mapping] = ()) -> Guarded | None:
    """Start ``tracker``'s run (``done``: the rows a resumed run already has) and guard it for the
    run; a failure is a ConfigError naming the tracker's key (the run has not trained yet)."""
    if tracker is None:
        return None
    try:
        tracker.start(cfg, list(done))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the library raises, before training
        raise ConfigError(tracker.key, f"logger={tracker.name} could not start its run: {_one_line(exc)}") from exc
    return Guarded(tracker)


class Guarded:
    """A started tracker whose failures never reach the run: the first one is logged as a
    warning, once, and the tracker is dropped for the rest of the run (a store that failed
    would likely fail, or stall, every round again). Every method returns normally."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker: Tracker | None = tracker
        self.name = tracker.name
        self.finished = False

    def log_round(self, row: Mapping) -> None:
        self._call("log_round", row, f"at global round {row.get('round')}")

    def finish(self, run_dir: str | Path) -> None:
        if self._call("finish", Path(run_dir), "at the end of the run"):
            self.finished = True
            self.tracker = None

    def close(self) -> None:
        """End the tracker run if it did not finish (the run failed or was stopped)."""
        tracker, self.tracker = self.tracker, None
        if tracker is not None and not self.finished:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001
                log.debug("hfl: logger=%s could not close its run: %s", self.name, exc)

    def _call(self, method: str, arg: Any, when: str) -> bool:
        tracker = self.tracker
        if tracker is None:
            return False
        try:
            getattr(tracker, method)(arg)
            return True
        except Exception as exc:  # noqa: BLE001 - tracking never stops a run
            log.warning("hfl: logger=%s failed %s (%s: %s); tracking stops for the rest of this run (metrics.jsonl, "
                        "summary.json and the plots are written as ever)", self.name, when, type(exc).__name__,
                        _one_line(exc))
            self.close()
            return False


def guarded(tracker: Any) -> Guarded | None:
    """``tracker`` as a Guarded one (as it is if it already is one); None stays None."""
    if tracker is None or isinstance(tracker, Guarded):
        return tracker
    return Guarded(tracker)


# ------------------------------------------------------------------------- names
# A metrics.jsonl key <level>_<stat> (pm_accuracy, level1_loss_..., gm_accuracy_min) is the tag <stat>/<level>:
# TensorBoard groups tags by what precedes the "/", so each chart group compares the levels of one figure.
# Longest first: pm_client_mean_accuracy is client_mean_accuracy/pm, not accuracy/pm_client_mean.
EVAL_STATS = ("client_mean_accuracy_ci_low", "client_mean_accuracy_ci_high", "client_mean_accuracy",
              "accuracy_ci_low", "accuracy_ci_high", "accuracy_min", "accuracy_median", "accuracy_max",
              "eval_devices", "eval_samples", "accuracy", "loss")
PER_EDGE_LEVEL = re.compile(r"(bytes_down|bytes_up|failures|late|stale|merged_rounds|empty_rounds)_level([0-9]+)")
OWN_TAGS = {"seconds": "time/seconds", "compute_seconds": "time/compute_seconds", "sim_time": "time/sim_time",
            "failures": "failures/all", "evaluation_failures": "failures/evaluation"}


def repeats(key: str, present: Mapping[str, Any]) -> bool:
    """Whether metrics.jsonl's ``key`` repeats what other keys of the same row (``present``) say:
    ``team_*`` is ``level1_*`` (hfl.node.evaluation.pool_evaluations), ``client_mean_accuracy`` is
    ``pm_client_mean_accuracy``, ``bytes_*_global`` is ``bytes_*_level0`` and ``bytes_*_team`` the sum
    of ``bytes_*_level{d}``, d >= 1 (hfl.output.recorder.traffic). metrics.jsonl keeps them all (its
    readers use either name); a tracker's charts show each figure once."""
    if key.startswith("team_"):
        return "level1_" + key[len("team_"):] in present
    if key == "client_mean_accuracy":
        return "pm_client_mean_accuracy" in present
    for direction in ("bytes_down", "bytes_up"):
        if key == f"{direction}_global":
            return f"{direction}_level0" in present
        if key == f"{direction}_team":
            return any(PER_EDGE_LEVEL.fullmatch(k) and k.startswith(direction + "_") and not k.endswith("_level0")
                       for k in present)
    return False


def tracker_tag(key: str) -> str:
    """The tracker's name (TensorBoard tag, MLflow metric) of metrics.jsonl's ``key``: ``<stat>/<level>``
    for a model level's figure (``accuracy/pm``, ``loss/level1``, ``client_mean_accuracy/gm``; ``team_*``
    is level1's), ``<counter>/level<d>`` for a per-level counter (``bytes_down/level0``: sent by the
    servers at depth d; ``bytes_*_global`` is level0's), ``time/*`` and ``failures/*`` for the round's
    own (``time/seconds``, ``failures/all``), ``other/<key>`` for anything else."""
    if key in OWN_TAGS:
        return OWN_TAGS[key]
    if key.startswith("team_"):  # the 3-tier name of level 1 (hfl.node.evaluation.pool_evaluations)
        key = "level1_" + key[len("team_"):]
    if key in ("bytes_down_global", "bytes_up_global"):
        key = key.replace("_global", "_level0")
    edge = PER_EDGE_LEVEL.fullmatch(key)
    if edge:
        return f"{edge.group(1)}/level{edge.group(2)}"
    for stat in EVAL_STATS:
        level = key[:-len(stat) - 1]
        if key.endswith("_" + stat) and level:
            return f"{stat}/{level}"
    return f"other/{key}"


def tracker_scalars(row: Mapping) -> dict[str, float]:
    """A metrics.jsonl row's numbers by tracker name, each figure once (``repeats``)."""
    numbers = numeric_fields(row)
    return {tracker_tag(key): value for key, value in numbers.items() if not repeats(key, numbers)}


def last_step(paths: Sequence[Path], tags: Sequence[str]) -> int:
    """The last step of any of ``tags`` in these event files (0: none); a record cut short by a
    killed run ends its file."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = [event.step for path in paths for event in EventFileLoader(str(path)).Load()
             if any(value.tag in tags for value in event.summary.value)]
    return max(steps, default=0)


# The HParams dashboard lists these beside the config (the scalars of the same run).
HPARAM_METRICS = ("accuracy/pm", "accuracy/gm", "loss/pm", "loss/gm")
# The round's seconds, by which a resumed run finds the last round its tracker has ("seconds": before
# tags were grouped).
SECONDS_TAGS = ("time/seconds", "seconds")


# ------------------------------------------------------------------------- TensorBoard
class TensorBoardTracker:
    """Event files in ``logger.log_dir`` (null: ``<run dir>/tensorboard``; else
    ``<log_dir>/<run_label>``): every numeric field as a scalar at step = global round, tagged by
    ``tracker_tag`` and each figure once (``repeats``), the config as text (``config``) and
    hparams, and at the end the plots as images and report.md as text.

    Scalars are 32-bit floats: TensorBoard's default loader (the Rust data server, ``--load_fast``)
    drops double-precision scalar tensors without a word ("No scalar data was found"). A float32
    keeps 7 significant digits (integers exactly up to 2**24); metrics.jsonl has the exact values."""

    name = "tensorboard"
    key = "logger.log_dir"

    def __init__(self, logger: Mapping, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError("logger.name", "logger=tensorboard needs the tensorboard package "
                                             f"(pip install -e '.[track]', or pip install tensorboard): {_one_line(exc)}") from exc
        self._writer_class = SummaryWriter
        base = logger.get("log_dir")
        if base is not None and (not isinstance(base, str) or not base.strip()):
            raise ConfigError("logger.log_dir", f"must be null (<run dir>/tensorboard) or a folder, got {base!r}")
        self.log_dir = Path(base) / run_label(run_dir) if base else Path(run_dir) / "tensorboard"
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("logger.log_dir", f"cannot create {self.log_dir}: {_one_line(exc)}") from exc
        if not os.access(self.log_dir, os.W_OK | os.X_OK):
            raise ConfigError("logger.log_dir", f"{self.log_dir} is not writable here")
        self.writer = None
        self.step = 0  # the last round logged
        self.logged = 0  # rounds the folder already has (a resumed run's)

    def start(self, cfg: Mapping, done: Sequence[Mapping]) -> None:
        import yaml
        from torch.utils.tensorboard.summary import hparams

        existing = sorted(self.log_dir.glob("events.out.tfevents.*"))
        if existing and not cfg["resume"]:
            for path in existing:  # a new run in this folder starts it afresh, as it does metrics.jsonl
                path.unlink()
            existing = []
        # A resumed run appends to the folder: the rows its events lack (a round the killed run logged
        # after its last checkpoint runs again, and is logged once: the first time).
        self.logged = last_step(existing, SECONDS_TAGS)
        self.writer = self._writer_class(str(self.log_dir))
        if not existing:
            text = yaml.safe_dump(json.loads(json.dumps(cfg)), sort_keys=False)
            self.writer.add_text("config", "```yaml\n" + text + "```", 0)
            values = {key: value if isinstance(value, bool | int | float | str) else json.dumps(value)
                      for key, value in flatten(cfg).items()}  # numbers stay numbers: the dashboard sorts them
            for summary in hparams(values, dict.fromkeys(HPARAM_METRICS, 0.0)):
                self.writer.file_writer.add_summary(summary, 0)
        for row in done:
            self._scalars(row)
        self.writer.flush()

    def _scalars(self, row: Mapping) -> None:
        step = int(row["round"])
        if step <= self.logged:
            return
        self.step = step
        for tag, value in tracker_scalars(row).items():
            self.writer.add_scalar(tag, value, step, new_style=True)  # float32: see the class's note

    def log_round(self, row: Mapping) -> None:
        self._scalars(row)
        self.writer.flush()  # a killed run keeps what it logged

    def finish(self, run_dir: Path) -> None:
        from matplotlib import image

        for name in ARTIFACTS[:2]:
            path = run_dir / name
            if path.exists():
                self.writer.add_image(Path(name).stem, image.imread(path)[..., :3], self.step, dataformats="HWC")
        report = run_dir / "report.md"
        if report.exists():
            self.writer.add_text("report", report.read_text(), self.step)
        self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


# ------------------------------------------------------------------------------ MLflow
PARAMS_PER_BATCH = 100  # MLflow's limits per log_batch call
METRICS_PER_BATCH = 1000
PARAM_LENGTH = 6000


def _sqlite_folder(uri: str) -> Path | None:
    """The folder of a ``sqlite:///path`` database (relative paths: from the working
    directory); None for any other URI or an in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path).resolve().parent if path and path != ":memory:" else None


# How long an http(s) MLflow server has to answer hfl's first request. MLflow's own client retries an
# unreachable server with back-off for minutes (4.5 measured) without a word: one quick probe first.
REACH_TIMEOUT = 5.0


def check_reachable(uri: str, key: str = "logger.tracking_uri", timeout: float = REACH_TIMEOUT) -> None:
    """ConfigError naming ``key`` and ``uri`` unless the http(s) server at ``uri`` answers an HTTP
    request within ``timeout`` seconds (any HTTP status counts: MLflow answers its errors too).
    Other schemes (a database, a folder) are opened by MLflow itself, without network waits."""
    import urllib.error
    import urllib.request

    if urlparse(uri).scheme not in ("http", "https"):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            return
    except urllib.error.HTTPError:
        return  # it answered
    except (OSError, ValueError) as exc:  # refused, unknown host, no answer in time (socket.timeout), bad URL
        reason = getattr(exc, "reason", exc)
        raise ConfigError(key, f"the MLflow server {uri} cannot be reached ({_one_line(reason)}; waited up to {timeout:g} s): "
                               "start it, or name another tracking_uri (or logger=none)") from exc


class MlflowTracker:
    """A run in MLflow's store ``logger.tracking_uri`` (null: ``MLFLOW_TRACKING_URI``, else
    MLflow's default, ``sqlite:///mlflow.db`` in the working directory), in experiment
    ``logger.experiment_name``, named ``logger.run_name`` (null: ``run_label``): the config as
    parameters (and as the artifact config.json), every numeric field as a metric at step =
    global round (named by ``tracker_tag``, each figure once, as in TensorBoard), the run's directory and algorithm/dataset/model as tags, and at the end
    accuracy.png, loss.png, report.md and summary.json as artifacts. Uses MLflow's client
    alone (no global active run), so the jobs of one process never share a run."""

    name = "mlflow"
    key = "logger.tracking_uri"

    def __init__(self, logger: Mapping, run_dir: Path) -> None:
        try:
            import mlflow
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ConfigError("logger.name", "logger=mlflow needs MLflow: pip install -e '.[track]' (or pip install mlflow): "
                                             f"{_one_line(exc)}") from exc
        for key in ("tracking_uri", "run_name", "artifact_location"):
            value = logger.get(key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"logger.{key}", f"must be null or a non-empty string, got {value!r}")
        experiment = logger.get("experiment_name")
        if not isinstance(experiment, str) or not experiment.strip():
            raise ConfigError("logger.experiment_name", f"must be a non-empty string, got {experiment!r}")
        self.run_dir = Path(run_dir)
        self.uri = logger.get("tracking_uri") or mlflow.get_tracking_uri()
        self.run_name = logger.get("run_name") or run_label(self.run_dir)
        if urlparse(self.uri).scheme in ("", "file"):
            # MLflow 3 keeps its file store only for who asks for it: a file: URI (or a folder) is asking.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        check_reachable(self.uri)  # fail in one line, not after MLflow's minutes of silent retries
        try:
            self.client = MlflowClient(tracking_uri=self.uri)
            found = self.client.get_experiment_by_name(experiment)
        except Exception as exc:  # noqa: BLE001 - whatever the store raises
            raise ConfigError("logger.tracking_uri",
                              f"cannot open the MLflow store {self.uri!r}: {_one_line(exc)}") from exc
        if found is not None and found.lifecycle_stage != "active":
            raise ConfigError("logger.experiment_name", f"experiment {experiment!r} is deleted in {self.uri}: "
                                                        "restore it (mlflow experiments restore) or name another")
        if found is None:
            location = logger.get("artifact_location")
            if location is None and _sqlite_folder(self.uri) is not None:
                location = str(_sqlite_folder(self.uri) / "mlartifacts")  # not ./mlruns wherever hfl-simulate ran
            try:
                self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
            except Exception as exc:  # noqa: BLE001
                # Another job may have created it meanwhile (jobs of -m run in parallel with some launchers).
                found = self.client.get_experiment_by_name(experiment)
                if found is None:
                    raise ConfigError("logger.experiment_name", f"cannot create experiment {experiment!r} in "
                                                                f"{self.uri}: {_one_line(exc)}") from exc
        if found is not None:
            self.experiment_id = found.experiment_id
        self.experiment = experiment
        self.run_id: str | None = None
        self.logged = 0  # rounds the run already has (a resumed run's)

    def _resumable(self) -> str | None:
        """The id of the MLflow run this run directory's run had, if it is in this store."""
        path = self.run_dir / STATE
        try:
            state = json.loads(path.read_text())
            if state.get("logger") != "mlflow" or state.get("tracking_uri") != self.uri:
                return None
            run = self.client.get_run(state["run_id"])
        except Exception:  # noqa: BLE001 - no file, another store, a run deleted since
            return None
        return run.info.run_id if run.info.lifecycle_stage == "active" else None

    def start(self, cfg: Mapping, done: Sequence[Mapping]) -> None:
        from mlflow.entities import Param, RunTag

        resumed = self._resumable() if cfg["resume"] else None
        if resumed is not None:
            self.run_id = resumed
            logged = max((m.step for tag in SECONDS_TAGS for m in self.client.get_metric_history(resumed, tag)),
                         default=0)
            self.client.update_run(resumed, status="RUNNING")
            # A round the killed run logged after its last checkpoint runs again: its metrics are logged
            # once (the first time; a resumed run repeats them but for the wall-clock seconds).
            self.logged = logged
            log.info("hfl: logger=mlflow goes on with run %s (%s, experiment %s) after global round %d", resumed,
                     self.uri, self.experiment, logged)
        else:
            tags = {"hfl.run_dir": str(self.run_dir.resolve()),
                    **{key: str(cfg.get(key, {}).get("name")) for key in ("algorithm", "dataset", "model")}}
            run = self.client.create_run(self.experiment_id, run_name=self.run_name, tags=tags)
            self.run_id = run.info.run_id
            params = [Param(key, value[:PARAM_LENGTH]) for key, value in param_values(cfg).items()]
            for i in range(0, len(params), PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])
            self.client.log_dict(self.run_id, json.loads(json.dumps(cfg)), "config.json")
            if cfg["resume"]:
                self.client.log_batch(self.run_id, tags=[RunTag("hfl.resumed", "true")])
                log.info("hfl: logger=mlflow found no run of %s to go on with in %s: new run %s, with the %d "
                         "evaluated rounds it had", self.run_dir, self.uri, self.run_id, len(done))
            state = {"logger": "mlflow", "tracking_uri": self.uri, "experiment_id": self.experiment_id,
                     "run_id": self.run_id}
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / STATE).write_text(json.dumps(state, indent=1) + "\n")
        for row in done:
            self.log_round(row)

    def log_round(self, row: Mapping) -> None:
        from mlflow.entities import Metric

        step, stamp = int(row["round"]), int(time.time() * 1000)
        if step <= self.logged:
            return
        # NaN and infinities too: MLflow stores them (infinities as the largest doubles)
        metrics = [Metric(key, float(value), stamp, step) for key, value in tracker_scalars(row).items()]
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + METRICS_PER_BATCH])

    def finish(self, run_dir: Path) -> None:
        for name in ARTIFACTS:
            if (run_dir / name).exists():
                self.client.log_artifact(self.run_id, str(run_dir / name))
        self.client.set_terminated(self.run_id, "FINISHED")
        self.run_id = None

    def close(self) -> None:
        if self.run_id is not None:
            run_id, self.run_id = self.run_id, None
            self.client.set_terminated(run_id, "FAILED")
