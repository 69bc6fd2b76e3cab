"""Resuming a killed run (hfl.state.resume): it ends with the same models, node and device states,
metrics.jsonl and samples.jsonl (but for wall-clock fields) as the run never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hfl.output import recorder as recorder_module
from hfl.errors import ConfigError
from hfl.state.resume import CHECKPOINT, read_checkpoint
from hfl.runtime.simulate import run
from hfl.state.store import PREVIOUS, StateStore, version_of
from hfl.node.root import RootStrategy
from tests.conftest import SMALL, compose_cfg

ROOT = Path(__file__).resolve().parents[1]
TIMING = ("seconds", "compute_seconds")  # wall clock: the only fields a resumed run may change

# B-HFL on a depth-3 tree (2 x 2 servers x 3 devices): a root with Adam moments and its own store
# key, node models and moments, persistent devices, sampling at levels 1 and 2 (samples.jsonl),
# 8 rounds evaluated every other one.
BHFL = ["topology.num_teams=2", "topology.devices_per_team=3", "dataset.max_samples=200", "dataset.batch_size=32",
        "algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]", "algorithm.team_rounds=2",
        "algorithm.local_steps=3", "algorithm.alpha=0.05", "algorithm.up.optimizer=adam", "algorithm.up.lr=0.01",
        "algorithm.sample_fraction=[1,0.5,0.67]", "global_rounds=8", "eval_every=2", "runtime.torch_threads=1"]
# FeMAM: the root with the most attributes of its own (levels, groups, K-means seeded by round).
FEMAM = ["algorithm=femam", "dataset=synthetic_multilevel", "dataset.clusters=[2,4]", "dataset.scales=[1.0,1.0,1.0,0.3]",
         "dataset.val_fraction=0.2", "model=mclr", "topology=tree", "topology.fanout=[3,4]", "global_rounds=7",
         "algorithm.levels=[1,2,4,0]", "algorithm.rounds_per_level=[2,2,1,2]", "algorithm.prune_window=1",
         "dataset.batch_size=32", "algorithm.local_epochs=1", "algorithm.alpha=0.05", "runtime.torch_threads=1"]
# PFLEGO: devices drawn per round by the root, Adam at the root, personal heads on the devices.
PFLEGO = ["algorithm=pflego", "model=mlp", "model.hidden=8", "dataset.partition=roundrobin",
          "dataset.classes_per_device=2", "dataset.max_samples=120", "dataset.batch_size=100000", "topology=tree",
          "topology.fanout=[3,4]", "global_rounds=5", "algorithm.local_steps=3", "algorithm.sample_fraction=0.25",
          "algorithm.server_lr=0.05", "runtime.torch_threads=1"]
PERMFL = [*SMALL, "global_rounds=5", "eval_every=2"]
# Loss-aware choice at the root and at level 1: the losses each node chose by are kept in its stored state.
POWER_OF_CHOICE = ["algorithm=fedavg", "topology=tree", "topology.fanout=[4,4]", "dataset.max_samples=200",
                   "dataset.batch_size=32", "algorithm.local_steps=3", "global_rounds=5", "eval_every=2",
                   "algorithm.sample_fraction=[0.5,0.5]", "algorithm.candidates=[1,0.75]", "runtime.torch_threads=1"]


# ---------------------------------------------------------------- helpers
def rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    path = run_dir / name
    if not path.exists():
        return []
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in path.read_text().splitlines()]


def global_model(run_dir: Path) -> list[np.ndarray]:
    with np.load(run_dir / "checkpoints" / "global_model.npz") as data:
        return [data[f"arr_{i}"] for i in range(sum(n.startswith("arr_") for n in data.files))]


def store_contents(run_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    store = StateStore(run_dir / "state")
    return {p.stem: store.load(p.stem) for p in sorted((run_dir / "state").glob("[!.]*.npz"))}


def assert_same_run(got: Path, want: Path) -> None:
    """Bit for bit: the final global model, every node's and device's stored state, every
    metrics and samples row but their wall-clock fields, the summary's results."""
    for a, b in zip(global_model(got), global_model(want), strict=True):
        np.testing.assert_array_equal(a, b)
    a_state, b_state = store_contents(got), store_contents(want)
    assert sorted(a_state) == sorted(b_state)
    for key, arrays in b_state.items():
        assert sorted(a_state[key]) == sorted(arrays), key
        for name, value in arrays.items():
            np.testing.assert_array_equal(a_state[key][name], value, err_msg=f"{key}/{name}")
    assert rows(got) == rows(want)
    assert rows(got, "samples.jsonl") == rows(want, "samples.jsonl")
    a_sum, b_sum = (json.loads((d / "summary.json").read_text()) for d in (got, want))
    for key in ("rounds", "final", "best", "failures", "total_bytes_down_global", "total_bytes_up_team"):
        assert a_sum[key] == b_sum[key], key


class Killed(BaseException):
    """Stands for SIGKILL in the in-process tests: nothing catches it."""


# ---------------------------------------------------------------- (d) the versioned store
def test_store_keeps_the_newest_three_rounds_and_load_reads_the_newest(tmp_path):
    store = StateStore(tmp_path)
    for rnd in (1, 2, 3):
        store.round = rnd
        store.save("device-0", {"x": np.array([rnd])})
    store.save("device-0", {"x": np.array([33])})  # saved again in round 3: the previous one stays round 2
    assert [r for r, _ in store.versions("device-0")] == [3, 2, 1]  # the older one: checkpoint R-1's
    assert store.load("device-0") == {"x": np.array([33])}  # the tag is not part of the state
    assert version_of(tmp_path / PREVIOUS / "device-0.npz") == 2
    assert sorted(p.name for p in tmp_path.glob("*.npz")) == ["device-0.npz"]  # one file per key, as before


def test_store_rollback_restores_each_key_to_its_round(tmp_path):
    store = StateStore(tmp_path)
    saves = {"node-0": (1, 2, 3), "node-0.1": (1, 3), "device-5": (3,), "device-6": (1,), "device-7": (2, 3),
             "device-8": (1, 2)}
    for key, rounds in saves.items():
        for rnd in rounds:
            store.round = rnd
            store.save(key, {"x": np.array([rnd])})
    # killed while writing: a half-written file, a key caught between its steps (its round-2
    # version already moved aside, the round-3 one not written), and one whose older version was
    # removed before its round-2 one was moved aside
    (tmp_path / ".node-0.123.tmp.npz").write_bytes(b"partial")
    (tmp_path / "device-7.npz").unlink()
    (tmp_path / PREVIOUS / "device-8.npz").unlink()
    store.rollback(2)
    got = {key: store.load(key) for key in saves}
    assert got["node-0"]["x"][0] == 2 and got["node-0.1"]["x"][0] == 1 and got["device-6"]["x"][0] == 1
    assert got["device-5"] is None  # first saved in the round rolled back
    assert got["device-7"]["x"][0] == 2 and got["device-8"]["x"][0] == 2
    assert not list(tmp_path.glob(".*.tmp.npz"))
    store.round = 3  # the resumed round 3 saves again
    store.save("node-0", {"x": np.array([30])})
    assert [r for r, _ in store.versions("node-0")] == [3, 2, 1]  # round 1 stays under older/
    store.rollback(0)
    assert not list(tmp_path.rglob("*.npz"))


def test_untagged_store_keeps_one_version(tmp_path):
    store = StateStore(tmp_path)  # no round: as a deployed device's store
    store.save("device-1", {"x": np.array([1])})
    store.save("device-1", {"x": np.array([2])})
    assert store.load("device-1") == {"x": np.array([2])} and not (tmp_path / PREVIOUS).exists()


# ---------------------------------------------------------------- in-process: killed by an exception
def _killed_at(monkeypatch: pytest.MonkeyPatch, where: str, rnd: int) -> None:
    if where == "fit":  # every node of round rnd has saved its state, the root has not aggregated
        original = RootStrategy.aggregate_fit

        def aggregate_fit(self, server_round, results, failures):  # noqa: ANN001, ANN202
            if server_round == rnd:
                raise Killed
            return original(self, server_round, results, failures)

        monkeypatch.setattr(RootStrategy, "aggregate_fit", aggregate_fit)
    else:  # round rnd's metrics and samples rows are written, its checkpoint is not
        original = recorder_module.write_checkpoint

        def write_checkpoint(run_dir, checkpoint):  # noqa: ANN001, ANN202
            if checkpoint.round == rnd:
                raise Killed
            original(run_dir, checkpoint)

        monkeypatch.setattr(recorder_module, "write_checkpoint", write_checkpoint)


@pytest.mark.parametrize(("overrides", "where", "rnd"), [
    (PERMFL, "fit", 3),
    (PERMFL, "checkpoint", 4),
    ([*BHFL, "dataset.proxy_fraction=0.2", "algorithm.proxy_samples=[40,20,0]"], "fit", 5),
    (FEMAM, "fit", 4),
    (PFLEGO, "checkpoint", 3),
    (POWER_OF_CHOICE, "fit", 3),
], ids=["permfl-mid-round", "permfl-before-checkpoint", "bhfl-proxy", "femam", "pflego", "power-of-choice"])
def test_resumed_inprocess_run_equals_the_uninterrupted_one(tmp_path, monkeypatch, overrides, where, rnd):
    assert_resumed_equals_whole(compose_cfg(*overrides, "runtime=inprocess"), tmp_path, monkeypatch, where, rnd)


def assert_resumed_equals_whole(cfg: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str,
                                rnd: int) -> None:
    """``cfg`` run whole, and run again killed at ``where`` of global round ``rnd`` (its checkpoint
    then the round before) and resumed: the resumed run ends as the whole one (tmp_path/whole,
    tmp_path/resumed)."""
    run(cfg, tmp_path / "whole")
    with monkeypatch.context() as patch:
        _killed_at(patch, where, rnd)
        with pytest.raises(Killed):
            run(cfg, tmp_path / "resumed")
    assert read_checkpoint(tmp_path / "resumed").round == rnd - 1
    run({**cfg, "resume": True}, tmp_path / "resumed")
    assert_same_run(tmp_path / "resumed", tmp_path / "whole")


def test_resume_refuses_another_config_and_a_directory_without_a_run(tmp_path):
    cfg = compose_cfg(*SMALL, "runtime=inprocess", "global_rounds=2")
    with pytest.raises(ConfigError, match="holds no run to resume") as caught:
        run({**cfg, "resume": True}, tmp_path / "empty")
    assert caught.value.key == "resume"
    run(cfg, tmp_path / "done")
    other = {**cfg, "resume": True, "algorithm": {**cfg["algorithm"], "alpha": 0.07}, "seed": 3}
    with pytest.raises(ConfigError) as caught:
        run(other, tmp_path / "done")
    assert caught.value.key == "resume"
    assert "algorithm.alpha: 0.05 there, 0.07 here" in str(caught.value) and "seed: 0 there, 3 here" in str(caught.value)
    assert "global_rounds" not in str(caught.value)
    # A finished run is only reported, whatever runs it (verbosity, threads may differ).
    before = (tmp_path / "done" / "metrics.jsonl").read_text()
    runtime = {**cfg["runtime"], "verbose": True, "torch_threads": 2}
    summary = run({**cfg, "resume": True, "runtime": runtime}, tmp_path / "done")
    assert summary["rounds"] == 2 and (tmp_path / "done" / "metrics.jsonl").read_text() == before


# ---------------------------------------------------------------- hfl-simulate, SIGKILLed
def _start(overrides: list[str], run_dir: Path, log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "hfl.runtime.simulate", *overrides, f"hydra.run.dir={run_dir}"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _newer_state(run_dir: Path, after: int) -> bool:
    """Whether a node or device has saved a version of a round after ``after``."""
    for path in (run_dir / "state").glob("[!.]*.npz"):  # not the temporary files being written
        try:
            if version_of(path) > after:
                return True
        except (OSError, ValueError, EOFError):  # moved aside while we looked
            continue
    return False


def _kill_after(proc: subprocess.Popen, run_dir: Path, lines: int, timeout: float = 300) -> None:
    """SIGKILL the run's whole process group (Ray's daemons and actors too) once metrics.jsonl
    has ``lines`` rows and a node has saved its state of a later round: mid-round, some of the
    tree's state already written (or, should the round end first, a little later)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().count("\n") >= lines):
        assert proc.poll() is None, f"the run ended before it was killed: {proc.returncode}"
        assert time.monotonic() < deadline, "the run did not get far enough"
        time.sleep(0.01)
    last = json.loads(metrics.read_text().splitlines()[lines - 1])["round"]
    deadline = time.monotonic() + 5
    while not _newer_state(run_dir, last) and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for _ in range(500):  # until every process of the group is gone
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)


def _killed_and_resumed(tmp_path: Path, overrides: list[str]) -> Path:
    run_dir, log = tmp_path / "resumed", tmp_path / "hfl-simulate.out"
    proc = _start(overrides, run_dir, log)
    _kill_after(proc, run_dir, lines=1)
    killed_at = read_checkpoint(run_dir).round
    assert 1 <= killed_at < 8, killed_at  # 8 global rounds: killed before the end
    assert proc.returncode == -signal.SIGKILL
    resumed = _start([*overrides, "resume=true"], run_dir, log)
    assert resumed.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert "resuming the run in" in log.read_text() and f"after global round {killed_at} of 8" in log.read_text()
    return run_dir


def test_hfl_simulate_inprocess_killed_and_resumed(tmp_path):
    overrides = [*BHFL, "runtime=inprocess"]
    run_dir = _killed_and_resumed(tmp_path, overrides)
    run(compose_cfg(*overrides), tmp_path / "whole")
    assert_same_run(run_dir, tmp_path / "whole")


@pytest.mark.slow
def test_hfl_simulate_on_ray_killed_and_resumed(tmp_path):
    overrides = [*BHFL, "runtime=simulation"]
    run_dir = _killed_and_resumed(tmp_path, overrides)
    # The reference runs in process: a Ray run of this config equals it bit for bit (one Ray start fewer).
    run(compose_cfg(*BHFL, "runtime=inprocess"), tmp_path / "whole")
    assert_same_run(run_dir, tmp_path / "whole")
    assert (run_dir / CHECKPOINT).exists()


# ---------------------------------------------------------------- runtime.state_dir (shared by Ray nodes)
def _state_dir_set(cfg: dict, state_dir: Path | None) -> dict:
    """``cfg`` with runtime.state_dir (declared by the simulation runtime; the in-process runtime,
    used here to run without Ray, reads it alike)."""
    return {**cfg, "runtime": {**cfg["runtime"], "state_dir": None if state_dir is None else str(state_dir)}}


def _stored_at(root: Path) -> dict[str, dict[str, np.ndarray]]:
    store = StateStore(root)
    return {p.stem: store.load(p.stem) for p in sorted(root.glob("[!.]*.npz"))}


def test_a_run_keeps_its_state_in_a_folder_of_its_own_under_state_dir_and_resumes_from_it(tmp_path, monkeypatch):
    from hfl.state.resume import STATE_KEY

    cfg = compose_cfg(*PERMFL, "runtime=inprocess")
    run(cfg, tmp_path / "whole")
    shared = tmp_path / "nfs"
    on_shared = _state_dir_set(cfg, shared)
    run_dir = tmp_path / "a" / "run"
    with monkeypatch.context() as patch:
        _killed_at(patch, "fit", 3)
        with pytest.raises(Killed):
            run(on_shared, run_dir)
    key = (run_dir / STATE_KEY).read_text().strip()
    assert key.startswith("run-") and (shared / key).is_dir() and not (run_dir / "state").exists()
    # A second run of the same directory name on the same state_dir keeps to a folder of its own.
    run(on_shared, tmp_path / "b" / "run")
    other = (tmp_path / "b" / "run" / STATE_KEY).read_text().strip()
    assert other != key and sorted(p.name for p in shared.iterdir()) == sorted([key, other])
    assert rows(tmp_path / "b" / "run") == rows(tmp_path / "whole")
    # Refused, naming the key, before anything is touched: the state is not in the run
    # directory, and a state_dir without the run's folder (mounted elsewhere, or lost).
    for wrong in (None, tmp_path / "elsewhere"):
        with pytest.raises(ConfigError) as caught:
            run({**_state_dir_set(cfg, wrong), "resume": True}, run_dir)
        assert caught.value.key == "runtime.state_dir", wrong
    assert not (tmp_path / "elsewhere").exists()
    # Resumed where the shared directory is mounted now: the uninterrupted run's results.
    moved = tmp_path / "mnt" / "nfs"
    moved.parent.mkdir()
    shared.rename(moved)
    run({**_state_dir_set(cfg, moved), "resume": True}, run_dir)
    for a, b in zip(global_model(run_dir), global_model(tmp_path / "whole"), strict=True):
        np.testing.assert_array_equal(a, b)
    got, want = _stored_at(moved / key), _stored_at(tmp_path / "whole" / "state")
    assert sorted(got) == sorted(want) and want
    for name, arrays in want.items():
        for array, value in arrays.items():
            np.testing.assert_array_equal(got[name][array], value, err_msg=f"{name}/{array}")
    assert rows(run_dir) == rows(tmp_path / "whole")
    assert rows(run_dir, "samples.jsonl") == rows(tmp_path / "whole", "samples.jsonl")
