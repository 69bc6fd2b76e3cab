"""Experiment tracking (hfl/output/tracking.py, the ``logger`` group): what TensorBoard's event files
and MLflow's store hold is read back and compared with metrics.jsonl, row by row and field by field;
a logger that cannot start stops the run before training naming the key; one that fails mid-run
warns once and leaves the run alone; ``logger=none`` imports neither library."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from hfl.config import schema
from hfl.errors import ConfigError
from hfl.output import tracking
from hfl.config.compose import CONF_DIR
from hfl.runtime.simulate import run
from tests.conftest import SMALL, compose_cfg
from tests.test_resume import Killed, _killed_at

ROOT = Path(__file__).resolve().parents[1]
TINY = [*SMALL, "runtime=inprocess", "global_rounds=2"]
TIMING_KEYS = ("seconds", "compute_seconds")  # metrics.jsonl's wall-clock figures
TIMING = ("time/seconds", "time/compute_seconds")  # their tracker names


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def hfl_simulate() -> list[str]:
    script = Path(sys.executable).parent / "hfl-simulate"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hfl.runtime.simulate"]


# ---------------------------------------------------------------- the config group


def test_the_default_is_none_and_every_option_extends_its_schema():
    assert compose_cfg()["logger"] == {"name": "none"}
    schema.register()
    for path in sorted((CONF_DIR / "logger").glob("*.yaml")):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            node = compose("config", overrides=[f"logger={path.stem}"]).logger
        node_type = OmegaConf.get_type(node)
        assert issubclass(node_type, schema.LoggerConfig), path.name
        assert sorted(f.name for f in dataclasses.fields(node_type)) == sorted(node) == sorted(tracking.KEYS[path.stem])
        file = yaml.safe_load(path.read_text())
        file.pop("defaults")
        assert OmegaConf.to_container(node) == file
    assert sorted(p.stem for p in (CONF_DIR / "logger").glob("*.yaml")) == sorted(tracking.LOGGERS)


def test_tensorboard_tags_group_each_figure_by_level_once():
    assert {key: tracking.tracker_tag(key) for key in (
        "pm_accuracy", "gm_loss", "level2_accuracy_min", "pm_client_mean_accuracy", "gm_client_mean_accuracy_ci_low",
        "level1_eval_devices", "fit_test_accuracy", "bytes_down_level0", "failures_level2", "late_level1", "seconds",
        "failures", "evaluation_failures", "sim_time", "per.a")} == {
        "pm_accuracy": "accuracy/pm", "gm_loss": "loss/gm", "level2_accuracy_min": "accuracy_min/level2",
        "pm_client_mean_accuracy": "client_mean_accuracy/pm",
        "gm_client_mean_accuracy_ci_low": "client_mean_accuracy_ci_low/gm", "level1_eval_devices": "eval_devices/level1",
        "fit_test_accuracy": "accuracy/fit_test", "bytes_down_level0": "bytes_down/level0",
        "failures_level2": "failures/level2", "late_level1": "late/level1", "seconds": "time/seconds",
        "failures": "failures/all", "evaluation_failures": "failures/evaluation", "sim_time": "time/sim_time",
        "per.a": "other/per.a"}
    row = {"round": 1, "level1_accuracy": 0.5, "team_accuracy": 0.5, "pm_client_mean_accuracy": 0.7,
           "client_mean_accuracy": 0.7, "bytes_up_global": 3, "bytes_up_level0": 3, "bytes_up_team": 9,
           "bytes_up_level1": 4, "bytes_up_level2": 5, "team_loss": None}
    assert tracking.tracker_scalars(row) == {"accuracy/level1": 0.5, "client_mean_accuracy/pm": 0.7,
                                                 "bytes_up/level0": 3, "bytes_up/level1": 4, "bytes_up/level2": 5}
    # a key whose twin the row lacks is kept, under its level's name
    assert tracking.tracker_scalars({"round": 1, "team_accuracy": 0.5, "bytes_up_global": 1, "bytes_up_team": 2}) == {
        "accuracy/level1": 0.5, "bytes_up/level0": 1, "other/bytes_up_team": 2}


def test_a_sweep_job_is_named_by_the_keys_its_command_line_sweeps():
    argv = ["-m", "seed=0,1,2", "runtime=inprocess", "algorithm=permfl,bhfl", "+x=range(2)", "hydra.sweep.dir=out"]
    job = ["seed=1", "runtime=inprocess", "algorithm=bhfl", "+x=0", "hydra.sweep.dir=out"]
    assert tracking.swept_overrides(job, argv) == ["seed=1", "algorithm=bhfl", "+x=0"]
    assert tracking.swept_overrides(["seed=1"], ["-m", "seed=1"]) == []  # nothing swept: the job number names it
    assert tracking.run_label(Path("/out/12-00-00/3")) == "12-00-00/3"  # not a running -m job


def test_numeric_fields_and_params_flatten():
    row = {"round": 3, "pm_accuracy": 0.5, "gm_accuracy": None, "ok": True, "note": "x", "bytes_up_global": 7,
           "per": {"a": 1.5}, "hist": [1, 2]}
    assert tracking.numeric_fields(row) == {"pm_accuracy": 0.5, "bytes_up_global": 7, "per.a": 1.5}
    assert tracking.param_values({"a": {"b": 1, "c": None, "d": [2, 3], "e": "s", "f": True}}) == {
        "a.b": "1", "a.c": "null", "a.d": "[2, 3]", "a.e": "s", "a.f": "true"}


# ---------------------------------------------------------------- refused before training


@pytest.mark.parametrize(("overrides", "key"), [
    (["logger.name=wandb"], "logger.name"),
    (["+logger.colour=red"], "logger.colour"),  # added past the schema: not a key of logger=none
    (["logger=tensorboard", "+logger.tracking_uri=sqlite:///x.db"], "logger.tracking_uri"),
    (["logger.name=mlflow"], "logger.name"),  # a logger is picked with logger=..., which brings its keys
])
def test_an_unknown_logger_or_key_stops_the_run_before_training(tmp_path, overrides, key):
    with pytest.raises(ConfigError) as caught:
        run(compose_cfg(*TINY, *overrides), tmp_path)
    assert caught.value.key == key
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "state").exists()


def test_a_key_no_logger_has_is_refused_while_composing():
    with pytest.raises(ConfigCompositionException) as caught:
        compose_cfg("logger=mlflow", "logger.colour=red")
    assert schema.config_error(caught.value).key == "logger.colour"


@pytest.mark.parametrize(("logger", "module"), [("tensorboard", "torch.utils.tensorboard"), ("mlflow", "mlflow")])
def test_a_missing_library_stops_the_run_before_training(tmp_path, monkeypatch, logger, module):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    with pytest.raises(ConfigError, match=r"^logger\.name: logger=\w+ needs ") as caught:
        run(compose_cfg(*TINY, f"logger={logger}"), tmp_path)
    assert caught.value.key == "logger.name" and "\n" not in str(caught.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_bad_tracking_uri_or_log_dir_stops_the_run_before_training(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for i, (overrides, key) in enumerate([
        (["logger=mlflow", "logger.tracking_uri=bogus://nowhere"], "logger.tracking_uri"),
        (["logger=mlflow", f"logger.tracking_uri=sqlite:///{blocker}/x.db"], "logger.tracking_uri"),
        (["logger=tensorboard", f"logger.log_dir={blocker}/tb"], "logger.log_dir"),
    ]):
        run_dir = tmp_path / f"run{i}"
        with pytest.raises(ConfigError) as caught:
            run(compose_cfg(*TINY, *overrides), run_dir)
        assert caught.value.key == key and "\n" not in str(caught.value), overrides
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "state").exists()


# ---------------------------------------------------------------- TensorBoard


def read_events(log_dir: Path):  # noqa: ANN201
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "images": 0})
    events.Reload()
    return events


def scalars(events, tag: str) -> list[tuple[int, float]]:  # noqa: ANN001
    from tensorboard.util import tensor_util

    return [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in events.Tensors(tag)]


def as_float32(value: float) -> float:
    """What a TensorBoard scalar holds of a metrics.jsonl value (hfl writes 32-bit scalars)."""
    return float(np.float32(value))


def expected_scalars(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard tag -> [(round, value as float32)] of these metrics.jsonl rows."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for tag, value in tracking.tracker_scalars(row).items():
            expected.setdefault(tag, []).append((row["round"], as_float32(value)))
    return expected


def test_tensorboard_holds_every_number_of_every_row_at_its_round(tmp_path):
    pytest.importorskip("tensorboard")
    run(compose_cfg(*TINY, "logger=tensorboard"), tmp_path)
    rows = metrics_rows(tmp_path)
    assert [row["round"] for row in rows] == [1, 2]
    events = read_events(tmp_path / "tensorboard")
    expected = expected_scalars(rows)
    assert len(expected) > 25 and {"accuracy/pm", "loss/gm", "accuracy/level1", "bytes_up/level0", "failures/all",
                                   "time/seconds"} <= set(expected)
    # Every number of a row is a tag's, or repeats one that is (the same value: nothing is lost).
    for row in rows:
        numbers = tracking.numeric_fields(row)
        for key, value in numbers.items():
            if not tracking.repeats(key, numbers):
                continue
            twin = {"client_mean_accuracy": "pm_client_mean_accuracy"}.get(key) or key.replace("team_", "level1_")
            twin = twin.replace("_global", "_level0").replace("bytes_down_team", "bytes_down_level1") \
                .replace("bytes_up_team", "bytes_up_level1")  # a 2-level tree: the team's edges are level 1's
            assert value == numbers[twin], key
    assert not [tag for tag in expected if "team" in tag or "global" in tag]
    for tag, points in expected.items():
        assert scalars(events, tag) == points, tag
    tags = events.Tags()
    assert sorted(tags["tensors"]) == sorted([*expected, "config/text_summary", "report/text_summary"])
    assert {"config/text_summary", "report/text_summary"} <= set(tags["tensors"])
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert yaml.safe_load(config.strip("`").removeprefix("yaml\n"))["logger"] == {"name": "tensorboard", "log_dir": None}
    assert sorted(tags["images"]) == ["accuracy", "loss"]
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    hparams = {key: getattr(value, value.WhichOneof("kind")) for key, value in start.hparams.items()}
    assert hparams["seed"] == 0 and hparams["algorithm.name"] == "permfl"
    assert hparams["algorithm.prox_slip"] == 0  # torch writes booleans as numbers
    assert hparams["dataset.max_samples"] == 300 and hparams["dataset.root"] == "null"


def test_a_tracker_failing_mid_run_warns_once_and_leaves_the_run_alone(tmp_path, monkeypatch, caplog):
    pytest.importorskip("tensorboard")
    original = tracking.TensorBoardTracker.log_round
    calls = []

    def log_round(self, row):  # noqa: ANN001, ANN202
        calls.append(row["round"])
        if row["round"] >= 2:
            raise OSError("disk full")
        original(self, row)

    monkeypatch.setattr(tracking.TensorBoardTracker, "log_round", log_round)
    cfg = compose_cfg(*TINY, "global_rounds=4", "logger=tensorboard")
    with caplog.at_level(logging.WARNING, logger="hfl"):
        summary = run(cfg, tmp_path / "tracked")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "logger=tensorboard failed at global round 2" in warnings[0]
    assert "disk full" in warnings[0]
    assert calls == [1, 2]  # dropped after its failure
    assert summary["rounds"] == 4 and [row["round"] for row in metrics_rows(tmp_path / "tracked")] == [1, 2, 3, 4]
    assert scalars(read_events(tmp_path / "tracked" / "tensorboard"), "accuracy/pm")[0][0] == 1
    # the same rows as a run without any logger (but for the wall clock)
    run(compose_cfg(*TINY, "global_rounds=4"), tmp_path / "plain")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]  # noqa: E731
    assert strip(metrics_rows(tmp_path / "tracked")) == strip(metrics_rows(tmp_path / "plain"))


def test_a_resumed_run_goes_on_in_the_same_tensorboard_folder_each_round_once(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    cfg = compose_cfg(*TINY, "global_rounds=3", "logger=tensorboard")
    with monkeypatch.context() as patch:
        _killed_at(patch, "checkpoint", 2)
        with pytest.raises(Killed):
            run(cfg, tmp_path)
    assert [step for step, _ in scalars(read_events(tmp_path / "tensorboard"), "accuracy/pm")] == [1, 2]
    run({**cfg, "resume": True}, tmp_path)
    events = read_events(tmp_path / "tensorboard")
    for tag, want in expected_scalars(metrics_rows(tmp_path)).items():
        got = scalars(events, tag)
        assert [step for step, _ in got] == [1, 2, 3], tag  # each round once
        if tag.startswith("time/"):  # round 2 ran twice: its first seconds stay
            got, want = [got[0], got[2]], [want[0], want[2]]
        assert got == want, tag
    assert len(events.Tensors("config/text_summary")) == 1 and len(events.Images("loss")) == 1
    run({**cfg, "overwrite": True}, tmp_path)  # a new run in the same directory starts afresh, as metrics.jsonl does
    assert [step for step, _ in scalars(read_events(tmp_path / "tensorboard"), "time/seconds")] == [1, 2, 3]


# ---------------------------------------------------------------- MLflow


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory):  # noqa: ANN001, ANN201
    """One SQLite store for the module (creating one runs MLflow's migrations: seconds)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    uri = f"sqlite:///{path}"
    MlflowClient(tracking_uri=uri).search_experiments()
    return uri


def assert_run_holds(client, run_id: str, run_dir: Path, skip_timing_of: tuple[int, ...] = ()) -> None:  # noqa: ANN001
    """The MLflow run holds every figure of every metrics.jsonl row, named as TensorBoard names it, once."""
    rows = metrics_rows(run_dir)
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for tag, value in tracking.tracker_scalars(row).items():
            expected.setdefault(tag, []).append((row["round"], float(value)))
    assert len(expected) > 25 and {"accuracy/pm", "accuracy/level1", "bytes_up/level0", "time/seconds"} <= set(expected)
    assert sorted(client.get_run(run_id).data.metrics) == sorted(expected)  # no team_*, *_global beside them
    for key, want in expected.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert [step for step, _ in history] == [step for step, _ in want], key  # each round once
        if key in TIMING:
            history = [h for h in history if h[0] not in skip_timing_of]
            want = [w for w in want if w[0] not in skip_timing_of]
        assert history == want, key


def test_a_multirun_makes_one_mlflow_run_per_job_with_its_params_and_every_row(tmp_path, mlflow_db):
    from mlflow.tracking import MlflowClient

    sweep = tmp_path / "multirun"
    proc = subprocess.run([*hfl_simulate(), "-m", *TINY, "seed=0,1,2", "logger=mlflow",
                           f"logger.tracking_uri={mlflow_db}", "logger.experiment_name=sweep",
                           f"hydra.sweep.dir={sweep}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=mlflow_db)
    experiment = client.get_experiment_by_name("sweep")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 3
    by_dir = {Path(r.data.tags["hfl.run_dir"]): r for r in runs}
    assert sorted(by_dir) == [(sweep / str(job)).resolve() for job in range(3)]
    for job, (run_dir, mlrun) in enumerate(sorted(by_dir.items())):
        assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == f"multirun/seed={job}"  # what the job sweeps
        job_cfg = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), resolve=True)
        assert mlrun.data.params == tracking.param_values(job_cfg)
        assert mlrun.data.params["seed"] == str(job) and mlrun.data.params["logger.name"] == "mlflow"
        assert_run_holds(client, mlrun.info.run_id, run_dir)
        artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id)}
        assert {"accuracy.png", "loss.png", "report.md", "summary.json", "config.json"} <= artifacts
        assert json.loads((run_dir / tracking.STATE).read_text())["run_id"] == mlrun.info.run_id
    assert (Path(mlflow_db.removeprefix("sqlite:///")).parent / "mlartifacts").is_dir()  # not ./mlruns
    assert not (tmp_path / "mlruns").exists()


def test_a_resumed_run_goes_on_in_the_same_mlflow_run(tmp_path, monkeypatch, mlflow_db):
    from mlflow.tracking import MlflowClient

    cfg = compose_cfg(*TINY, "global_rounds=3", "logger=mlflow", f"logger.tracking_uri={mlflow_db}",
                      "logger.experiment_name=resume")
    with monkeypatch.context() as patch:
        _killed_at(patch, "checkpoint", 2)
        with pytest.raises(Killed):
            run(cfg, tmp_path)
    client = MlflowClient(tracking_uri=mlflow_db)
    run_id = json.loads((tmp_path / tracking.STATE).read_text())["run_id"]
    assert client.get_run(run_id).info.status == "FAILED"  # ended when the run was stopped
    run({**cfg, "resume": True, "logger": {**cfg["logger"], "run_name": "ignored: it goes on"}}, tmp_path)
    experiment = client.get_experiment_by_name("resume")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert_run_holds(client, run_id, tmp_path, skip_timing_of=(2,))  # round 2 ran twice: its first seconds stay


# ---------------------------------------------------------------- logger=none


def test_logger_none_imports_neither_library(tmp_path):
    code = ("import sys; from tests.conftest import compose_cfg, SMALL; from hfl.runtime.simulate import run; "
            f"run(compose_cfg(*SMALL, 'runtime=inprocess', 'global_rounds=1'), {str(tmp_path)!r}); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlflow', 'tensorboard', 'tensorboardX') "
            "or m.startswith('torch.utils.tensorboard')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "summary.json").exists() and not (tmp_path / tracking.STATE).exists()
