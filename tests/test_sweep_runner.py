"""The sweep scripts' runner (benchmarks/reproduce_table1.py ``execute``): a run forked from the
preloaded interpreter (benchmarks/preloaded.py) gives the same run as a fresh hfl-simulate
process, and fails the same way."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SMALL = ["topology.num_teams=2", "topology.devices_per_team=3", "global_rounds=2", "algorithm=permfl",
         "algorithm.team_rounds=2", "algorithm.local_steps=3", "runtime=inprocess", "seed=3"]


@pytest.fixture(scope="module")
def runner():
    sys.path.insert(0, str(BENCHMARKS))  # its `import preloaded`, and the forkserver's
    spec = importlib.util.spec_from_file_location("reproduce_table1", BENCHMARKS / "reproduce_table1.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reproduce_table1"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    if not module.preloaded.available():
        pytest.skip("no forkserver on this platform")
    yield module
    sys.modules.pop("reproduce_table1", None)
    sys.path.remove(str(BENCHMARKS))


def job(runner, out: Path, overrides: list[str]):
    command = runner.tool("hfl-simulate", "hfl.runtime.simulate") + overrides + [f"hydra.run.dir={out / 'run'}"]
    return runner.Job("small", "permfl", 3, 2, out / "run", out / "run.log", command, overrides)


def metrics(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if "seconds" not in k} for line in lines]


def test_a_forked_run_is_the_same_run_as_a_fresh_process(runner, tmp_path, monkeypatch):
    done = {}
    for preloaded in (True, False):
        monkeypatch.setattr(runner, "PRELOADED", preloaded)
        done[preloaded] = runner.execute(job(runner, tmp_path / str(preloaded), SMALL))
    forked, fresh = done[True], done[False]
    assert forked.status == fresh.status == "ok", (forked.error, fresh.error)
    header = forked.log.read_text().splitlines()[0]
    assert header.endswith("(forked from a preloaded interpreter)")
    assert not fresh.log.read_text().splitlines()[0].endswith("interpreter)")
    # its output went to its log, the console's summary lines included
    assert "outputs:" in forked.log.read_text()
    assert len(metrics(forked.run_dir)) == 2
    assert metrics(forked.run_dir) == metrics(fresh.run_dir)
    assert forked.summary["final"] == fresh.summary["final"]


def test_a_forked_run_that_fails_reports_its_exit_status_and_error(runner, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "PRELOADED", True)
    failed = runner.execute(job(runner, tmp_path, [*SMALL, "algorithm.alpha=-1"]))
    assert failed.status == "failed"
    assert failed.error.startswith("exit status 1: ") and "alpha" in failed.error


def test_a_failed_runs_reason_reaches_the_device_failure_nested_in_it(runner, tmp_path):
    # a global round's error nests its node's, which nests the first device's: the cause is far in
    cause = "first failure: OutOfMemoryError('CUDA out of memory. Tried to allocate 1.17 GiB')"
    line = ("RuntimeError: global round 1: no level-1 model to aggregate (4 failures, 0 rejected); first failure: "
            "RuntimeError('node 0: round 1.1: no model aggregated from 0 results (0 rejected as NaN/Inf or "
            "misshaped), 10 failures; 10 usable updates needed (algorithm.min_fit_fraction); " + cause + "')")
    log = tmp_path / "run.log"
    log.write_text(f"round 1 starting\n{line}\nshutting down\n")
    assert cause in runner.last_error(log)


def test_parallel_runs_step_one_group_at_a_time_and_still_resume(runner, tmp_path):
    """--jobs 2: each run gets runtime.batched_threads=1 (two runs fill two cores), and a finished
    run recorded with it is the same job as one without (is_complete; it decides nothing computed)."""
    jobs = [job(runner, tmp_path / str(i), SMALL) for i in range(2)]
    runner.run_all(jobs, workers=2)
    assert [j.status for j in jobs] == ["ok", "ok"], [j.error for j in jobs]
    for j in jobs:
        assert j.command[-1] == "runtime.batched_threads=1"
        recorded = (j.run_dir / ".hydra" / "overrides.yaml").read_text()
        assert "runtime.batched_threads=1" in recorded
        assert runner.is_complete(job(runner, j.run_dir.parent, SMALL))  # the same overrides otherwise
        assert not runner.is_complete(job(runner, j.run_dir.parent, [*SMALL, "seed=4"]))
