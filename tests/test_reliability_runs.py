"""Runs that went wrong on the simulation side end in one line, never a traceback, a stall or a
silent result (issue 46, item 6): a failed job of a sweep is recorded and the sweep goes on; a
topology or a batch size too large for the machine; an MLflow server nobody answers; a Ray
driver killed with SIGKILL (hfl.process.reaper stops what Ray leaves)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from hfl.device.training import BatchSampler
from hfl.errors import ConfigError
from hfl.output.tracking import check_reachable
from hfl.runtime.simulate import run
from hfl.tree.shape import from_fanout
from tests.conftest import SMALL, compose_cfg

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "hfl-simulate"
HUGE = 10**11  # devices per team, or a batch size: terabytes if anything allocated it


def _command(args: list[str]) -> list[str]:
    return [str(SCRIPT), *args] if SCRIPT.exists() else [sys.executable, "-m", "hfl.runtime.simulate", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- bad values, bad jobs
def test_a_sweep_records_each_failed_job_goes_on_and_ends_non_zero_listing_them(tmp_path):
    """Four jobs: a topology of 10^11 devices per team, an MLflow server nobody answers, both, and
    neither. The three bad ones fail in one line each (the topology before anything is allocated;
    the tracker at once, not after MLflow's minutes of retries), the good one runs."""
    pytest.importorskip("mlflow")
    uri = f"http://127.0.0.1:{_free_port()}"
    sweep = tmp_path / "sweep"
    started = time.monotonic()
    done = subprocess.run(
        _command(["-m", *SMALL, "global_rounds=1", "runtime=inprocess", f"topology.devices_per_team={HUGE},3",
                  "logger=mlflow,none", f"hydra.sweep.dir={sweep}"]),
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "MLFLOW_TRACKING_URI": uri})
    assert time.monotonic() - started < 120
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hfl-simulate: 3 of the 4 jobs run failed: #0: logger.tracking_uri: "), done.stderr
    assert str(sweep / "failures.jsonl") in last
    failures = [json.loads(line) for line in (sweep / "failures.jsonl").read_text().splitlines()]
    by_job = {f["job"]: f for f in failures}
    assert sorted(by_job) == [0, 1, 2]
    for job in (0, 2):  # logger=mlflow: the store is opened first
        assert by_job[job]["error"].startswith(f"logger.tracking_uri: the MLflow server {uri} cannot be reached")
    assert by_job[1]["error"].startswith(f"topology.devices_per_team: describes {HUGE * 2:,} devices")
    assert "memory" in by_job[1]["error"]
    for f in failures:  # and on the console, one line each
        assert f"#{f['job']} failed ({' '.join(f['overrides'])}): {f['error']}" in done.stdout + done.stderr
    assert json.loads((sweep / "3" / "summary.json").read_text())["rounds"] == 1  # the good job ran


def test_a_failure_that_is_no_user_error_is_recorded_with_its_type():
    """A bug's exception (Hydra marks the job FAILED) is recorded as ``Type: first line`` and
    replaced by the sweep's own exit; a single run (no on_multirun_start) is left to Hydra."""
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from hfl.runtime.sweep import SweepFailed, SweepFailures

    with tempfile.TemporaryDirectory() as folder:
        config = OmegaConf.create({"hydra": {"sweep": {"dir": folder}, "job": {"num": 4},
                                             "runtime": {"output_dir": f"{folder}/4"}}})
        single = SweepFailures()
        job = JobReturn(overrides=["seed=1"], status=JobStatus.FAILED, _return_value=KeyError("x"))
        single.on_job_end(config, job)
        assert isinstance(job._return_value, KeyError) and not Path(folder, "failures.jsonl").exists()

        sweep = SweepFailures()
        sweep.on_multirun_start(config)
        sweep.on_job_end(config, JobReturn(overrides=["seed=0"], status=JobStatus.COMPLETED, _return_value=0.5))
        sweep.on_job_end(config, job)
        assert isinstance(job._return_value, SweepFailed)
        assert json.loads(Path(folder, "failures.jsonl").read_text())["error"] == "KeyError: 'x'"
        assert str(job._return_value.code).startswith("hfl-simulate: 1 of the 2 jobs run failed: #4: KeyError")


def test_a_fanout_of_more_devices_than_memory_is_refused_naming_the_key_and_count():
    with pytest.raises(ConfigError, match=r"^topology.fanout: describes 1,000,000,000,000,000 devices: .* PiB"):
        from_fanout([100000, 100000, 100000], seed=0)


def test_a_batch_larger_than_the_data_allocates_nothing_and_both_paths_agree(tmp_path):
    """A batch_size past a device's samples draws them all each step, on the per-device path and
    the batched one alike (the batched one no longer lays out steps x batch_size)."""
    a, b = BatchSampler(7, HUGE, seed=3), BatchSampler(7, HUGE, seed=3)
    block = a.take(5)
    assert block.shape == (5, 7)
    assert [row.tolist() for row in block] == [b.next().tolist() for _ in range(5)]
    summaries = [run(compose_cfg(*SMALL, "global_rounds=1", "runtime=inprocess", f"runtime.batched={batched}",
                                 f"dataset.batch_size={HUGE}"), tmp_path / batched) for batched in ("on", "off")]
    rows = [json.loads((tmp_path / b / "metrics.jsonl").read_text().splitlines()[-1]) for b in ("on", "off")]
    np.testing.assert_allclose(rows[0]["pm_accuracy"], rows[1]["pm_accuracy"], atol=1e-6)
    assert summaries[0]["rounds"] == summaries[1]["rounds"] == 1


def test_an_mlflow_server_that_accepts_but_never_answers_is_refused_within_the_timeout():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # the kernel completes the handshake; nobody ever reads or answers
        uri = f"http://127.0.0.1:{server.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(ConfigError, match=rf"^logger.tracking_uri: the MLflow server {uri} cannot be reached"):
            check_reachable(uri, timeout=0.5)
        assert time.monotonic() - started < 5


# ---------------------------------------------------------------- a Ray driver killed outright
def _session_processes(temp_dir: str) -> list[str]:
    """Processes whose command line or open files lie under Ray's temp dir (Ray renames its
    workers' and agents' command lines; their logs stay open there)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            links = [os.readlink(f"/proc/{name}/fd/{fd}") for fd in os.listdir(f"/proc/{name}/fd")]
        except OSError:
            continue
        if temp_dir in cmdline or any(link.startswith(temp_dir + "/") for link in links):
            found.append(f"{name} {cmdline[:80]}")
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigkilled_ray_driver_leaves_no_process_of_its_ray_session(tmp_path):
    """Measured before the watchdog: ray::DashboardAgent and ray::RuntimeEnvAgent outlived a
    SIGKILLed driver for good (Ray's fate-sharing ends only the driver's own children)."""
    temp_dir = tempfile.mkdtemp(prefix="hflr", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    run_dir = tmp_path / "run"
    try:
        proc = subprocess.Popen(
            _command([*SMALL, "global_rounds=200", "runtime=simulation", f"runtime.ray_tmp_dir={temp_dir}",
                      f"hydra.run.dir={run_dir}"]),
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr").open("wb"), start_new_session=True)
        deadline = time.monotonic() + 240
        while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().count("\n")):
            assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not get to its first round"
            time.sleep(0.05)
        assert any("ClientAppActor" in p or "Agent" in p for p in _session_processes(temp_dir))
        proc.kill()
        proc.wait()
        deadline, left = time.monotonic() + 30, _session_processes(temp_dir)
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = _session_processes(temp_dir)
        assert not left, f"outlived the driver by 30 s: {left}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left, should the test fail
        except (ProcessLookupError, UnboundLocalError):
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)
