"""A run directory is owned by one run (hfl.state.lock) and is never wiped without being asked:
a fresh run over a directory holding a run is refused naming ``overwrite`` (with the
``resume=true`` alternative) and leaves every file as it was; a second process on a directory in
use is refused naming ``hydra.run.dir``; a lock file left by a dead run is no lock."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hfl.errors import ConfigError
from hfl.runtime.simulate import run
from hfl.state.lock import LOCK, RunLock
from tests.conftest import SMALL, compose_cfg

ROOT = Path(__file__).resolve().parents[1]
CFG = [*SMALL, "runtime=inprocess", "global_rounds=2"]


def contents(run_dir: Path) -> dict[str, str]:
    """Every file under the run directory (but the lock file) with a hash of its bytes."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != LOCK.name}


def test_a_fresh_run_over_a_run_is_refused_and_touches_nothing(tmp_path):
    run(compose_cfg(*CFG), tmp_path)
    before = contents(tmp_path)
    assert any(name.startswith("state/") for name in before) and "metrics.jsonl" in before
    with pytest.raises(ConfigError) as refused:
        run(compose_cfg(*CFG, "algorithm.alpha=0.07"), tmp_path)
    assert refused.value.key == "overwrite" and "resume=true" in str(refused.value) and "2 of 2" in str(refused.value)
    assert contents(tmp_path) == before


def test_overwrite_true_starts_over_and_resume_true_is_unaffected(tmp_path):
    first = run(compose_cfg(*CFG), tmp_path)
    assert run(compose_cfg(*CFG, "resume=true"), tmp_path) == first  # a finished run is only reported
    again = run(compose_cfg(*CFG, "overwrite=true", "algorithm.alpha=0.07"), tmp_path)
    assert again["final"] != first["final"]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2]  # the old run's rows are gone, not appended to


def test_a_directory_in_use_is_refused_naming_it(tmp_path):
    with RunLock(tmp_path):  # as another hfl run holds it
        with pytest.raises(ConfigError) as refused:
            run(compose_cfg(*CFG), tmp_path)
    assert refused.value.key == "hydra.run.dir" and "in use by another hfl run (pid" in str(refused.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_lock_left_by_a_dead_run_is_no_lock(tmp_path):
    # a process that took the lock and died without releasing it (SIGKILL: the OS releases flocks)
    code = f"import os; from hfl.state.lock import RunLock; RunLock({str(tmp_path)!r}).__enter__(); os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    assert (tmp_path / LOCK).read_text().startswith("pid ")
    assert run(compose_cfg(*CFG), tmp_path)["rounds"] == 2


def test_resuming_a_run_killed_after_its_summary_draws_its_plots(tmp_path):
    run(compose_cfg(*CFG), tmp_path)
    for name in ("report.md", "accuracy.png", "loss.png"):
        (tmp_path / name).unlink()
    run(compose_cfg(*CFG, "resume=true"), tmp_path)
    assert all((tmp_path / name).stat().st_size > 0 for name in ("report.md", "accuracy.png", "loss.png"))
