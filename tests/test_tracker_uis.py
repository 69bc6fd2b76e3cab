"""The trackers as a user meets them (issue 49): the real ``tensorboard`` and ``mlflow ui`` binaries
of this environment, started on a loopback port as the docs say (no extra flags), serve what hfl
logged: runs, tags and every value read back over their HTTP APIs and compared with metrics.jsonl.
Each test skips, naming the reason, where its binary is absent."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from hfl.deploy.loopback import free_ports
from hfl.output import tracking
from hfl.runtime.simulate import run
from tests.conftest import compose_cfg
from tests.test_tracking import TINY, expected_scalars, metrics_rows

BIN = Path(sys.executable).parent
HOST = "127.0.0.1"  # never beyond loopback


def binary(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{path} is absent: install the track extra (pip install -e '.[track]' -c constraints.txt)")
    return path


def get(url: str, body: dict | None = None, timeout: float = 10.0) -> Any:
    """The JSON answer of a GET (or, with ``body``, a POST of JSON) to ``url``."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


@contextmanager
def serving(command: list[str], cwd: Path, log: Path) -> Iterator[subprocess.Popen]:
    """``command`` running in its own process group (a server may start workers), ended with that
    group whatever the test does."""
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def wait_for(what: str, probe: Callable[[], Any], proc: subprocess.Popen, log: Path, timeout: float = 90.0) -> Any:
    """``probe()``'s first truthy answer; fails naming ``what`` and the server's last words if the
    server exits or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what}: the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            answer = probe()
            if answer:
                return answer
        except (OSError, ValueError):  # not listening yet (refused, reset), or half-started
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: no answer in {timeout:g} s: {log.read_text()[-2000:]}")
        time.sleep(0.3)


# ---------------------------------------------------------------- TensorBoard


def assert_one_name_per_level(tags: Iterable[str]) -> None:
    """Levels named as the console and the reports name them (pm, level<d>, gm), never by the 3-tier words
    (team, global), and no figure under two names (team_* beside level1_*)."""
    tags = list(tags)
    assert not [tag for tag in tags if "team" in tag or "global" in tag], tags
    levels = {tag.split("/", 1)[1] for tag in tags if not tag.startswith(("time/", "other/", "failures/all",
                                                                         "failures/evaluation"))}
    assert levels and all(level in ("pm", "gm", "gm_proxy") or re.fullmatch(r"level[0-9]+", level)
                          for level in levels), levels
    assert {"pm", "level0", "level1", "gm"} <= levels


def test_tensorboard_default_invocation_shows_every_curve_of_a_sweep(tmp_path):
    tensorboard = binary("tensorboard")
    sweep = tmp_path / "multirun"
    for job, seed in enumerate((0, 1)):  # a -m sweep's folder: one run dir per job
        run(compose_cfg(*TINY, "logger=tensorboard", f"seed={seed}"), sweep / str(job))
    expected = {f"{job}/tensorboard": expected_scalars(metrics_rows(sweep / str(job))) for job in (0, 1)}
    (port,) = free_ports(1)
    base = f"http://{HOST}:{port}"
    log = tmp_path / "tensorboard.log"
    start = time.monotonic()
    # As the docs say: tensorboard --logdir multirun/ (its default loader, the Rust data server where installed).
    with serving([str(tensorboard), "--logdir", str(sweep), "--host", HOST, "--port", str(port)], tmp_path, log) as proc:
        def loaded() -> dict:
            tags = get(f"{base}/data/plugin/scalars/tags")
            return tags if set(tags) == set(expected) and all(tags.values()) else {}

        runs = wait_for("TensorBoard's runs", lambda: len(get(f"{base}/data/runs")) >= len(expected), proc, log)
        assert runs and sorted(get(f"{base}/data/runs")) == sorted(expected)
        # It lists a run once it has read its files: scalars it kept are there by now (a few s of slack).
        tags = wait_for("TensorBoard lists the runs but serves no scalars of some (its default loader drops "
                        "double-precision scalars)", loaded, proc, log, timeout=15)
        print(f"tensorboard: every run's tags served {time.monotonic() - start:.1f} s after start")
        for name, curves in expected.items():
            assert sorted(tags[name]) == sorted(curves), name
            assert {"accuracy/pm", "accuracy/gm", "accuracy/level1", "loss/pm", "bytes_up/level1",
                    "time/seconds"} <= set(curves)
            assert_one_name_per_level(tags[name])
            for tag, points in curves.items():
                query = urllib.parse.urlencode({"run": name, "tag": tag})
                served = [(step, value) for _, step, value in get(f"{base}/data/plugin/scalars/scalars?{query}")]
                assert served == points, (name, tag)  # float32, as hfl writes them
        # The HParams dashboard: each run's config beside its last values of tracking.HPARAM_METRICS.
        groups = get(f"{base}/data/plugin/hparams/session_groups", {
            "experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                                      "STATUS_RUNNING"], "colParams": [], "startIndex": 0,
            "sliceSize": 10})["sessionGroups"]
        assert sorted(group["name"] for group in groups) == sorted(expected)
        for group in groups:
            assert group["hparams"]["seed"] == float(group["name"][0])  # job 0 ran seed 0, job 1 seed 1
            last = {m["name"]["tag"]: (m["trainingStep"], m["value"]) for m in group["metricValues"]}
            assert last == {tag: expected[group["name"]][tag][-1] for tag in tracking.HPARAM_METRICS}, group["name"]
    if "fast data loading" not in log.read_text():
        print("tensorboard: the Rust data server is absent here; the Python loader served these")


# ---------------------------------------------------------------- MLflow


def test_mlflow_ui_serves_every_metric_of_a_run(tmp_path):
    mlflow = binary("mlflow")
    pytest.importorskip("flask", reason="mlflow-skinny has no server (mlflow ui needs mlflow): install the track "
                                        "extra (pip install -e '.[track]' -c constraints.txt)")
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # A run logged straight into the store, as the docs' sweep does; mlflow ui then serves that store.
    run(compose_cfg(*TINY, "logger=mlflow", f"logger.tracking_uri={db}", "logger.experiment_name=stored"),
        tmp_path / "stored")
    (port,) = free_ports(1)
    base = f"http://{HOST}:{port}"
    log = tmp_path / "mlflow.log"
    start = time.monotonic()
    with serving([str(mlflow), "ui", "--backend-store-uri", db, "--host", HOST, "--port", str(port), "--workers", "1"],
                 tmp_path, log) as proc:
        wait_for("mlflow ui's /health", lambda: urllib.request.urlopen(f"{base}/health", timeout=5).status == 200,
                 proc, log)
        print(f"mlflow ui: answering {time.monotonic() - start:.1f} s after start")
        with urllib.request.urlopen(f"{base}/", timeout=10) as page:
            assert page.status == 200 and b"<!doctype html>" in page.read(2000).lower()  # the UI itself, not only the API
        # A run logged through the server (logger.tracking_uri=http://...), artifacts proxied by it.
        run(compose_cfg(*TINY, "logger=mlflow", f"logger.tracking_uri={base}", "logger.experiment_name=served"),
            tmp_path / "served")
        for experiment in ("stored", "served"):
            run_dir = tmp_path / experiment
            found = get(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name={experiment}")["experiment"]
            runs = get(f"{base}/api/2.0/mlflow/runs/search", {"experiment_ids": [found["experiment_id"]]})["runs"]
            assert len(runs) == 1, experiment
            info, data = runs[0]["info"], runs[0]["data"]
            assert info["status"] == "FINISHED" and info["run_name"] == tracking.run_label(run_dir)
            params = {p["key"]: p["value"] for p in data["params"]}
            assert params["logger.experiment_name"] == experiment and params["algorithm.name"] == "permfl"
            rows = metrics_rows(run_dir)
            expected: dict[str, list[tuple[int, float]]] = {}
            for row in rows:
                for tag, value in tracking.tracker_scalars(row).items():
                    expected.setdefault(tag, []).append((row["round"], float(value)))
            # named as TensorBoard names them: one name per level, each figure once
            assert len(expected) > 25 and sorted(m["key"] for m in data["metrics"]) == sorted(expected), experiment
            assert_one_name_per_level(expected)
            for key, want in expected.items():
                query = urllib.parse.urlencode({"run_id": info["run_id"], "metric_key": key})
                history = get(f"{base}/api/2.0/mlflow/metrics/get-history?{query}")["metrics"]
                served = sorted((int(m["step"]), float(m["value"])) for m in history)
                assert served == want, (experiment, key)
            artifacts = get(f"{base}/api/2.0/mlflow/artifacts/list?run_id={info['run_id']}").get("files", [])
            assert {"accuracy.png", "report.md", "summary.json"} <= {a["path"] for a in artifacts}, experiment
