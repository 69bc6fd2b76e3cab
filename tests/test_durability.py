"""Damaged and missing run files (hfl.state.resume, hfl.state.store): a run killed at three points
has each kind of file truncated, emptied, garbled or deleted for real, then ``resume=true`` either
ends bit for bit as the run never interrupted or is refused in one line naming the file, touching
nothing. Unreadable versions count as absent; the newest checkpoint the store still matches is
gone on from; a state the run needs is never silently started from scratch."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from hfl.errors import ConfigError
from hfl.output import recorder as recorder_module
from hfl.runtime.simulate import run
from hfl.state import resume
from hfl.state.resume import CHECKPOINT, PREVIOUS_CHECKPOINT, Checkpoint, read_checkpoint, write_checkpoint
from hfl.state.store import OLDER, PREVIOUS, StateStore, atomic_write_bytes
from tests.conftest import compose_cfg
from tests.test_resume import PERMFL, Killed, _killed_at, assert_same_run
from tests.test_run_dir import contents

STATE = Path("state")
DEVICES = STATE / "devices-0.npz"  # team 0's devices, saved every round
DEVICES_PREVIOUS = STATE / PREVIOUS / "devices-0.npz"
DEVICES_OLDER = STATE / OLDER / "devices-0.npz"


# ---------------------------------------------------------------- damage, as a torn write or a power cut leaves it
def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(path: Path) -> None:
    path.write_bytes(b"")


def garble(path: Path) -> None:
    """64 bytes in the middle inverted: the size stays, the content does not."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def delete(path: Path) -> None:
    path.unlink()


DAMAGE = {"truncated": truncate, "emptied": empty, "garbled": garble, "deleted": delete}


# ---------------------------------------------------------------- the runs
def _killed_after_checkpoint(monkeypatch: pytest.MonkeyPatch, rnd: int) -> None:
    """Killed once round ``rnd``'s checkpoint is written, before the next round saves anything."""
    original = recorder_module.write_checkpoint

    def write_checkpoint(run_dir, checkpoint):  # noqa: ANN001, ANN202
        original(run_dir, checkpoint)
        if checkpoint.round == rnd:
            raise Killed

    monkeypatch.setattr(recorder_module, "write_checkpoint", write_checkpoint)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """PerMFL, 5 rounds, uninterrupted and killed: ``mid-round`` in round 4 once every node saved
    (checkpoints of rounds 3 and 2; the store's newest versions are round 4's, the previous
    ones round 3's); ``between`` right after round 3's checkpoint (newest versions round 3's,
    previous ones round 2's); ``first`` right after round 1's (no older checkpoint or version)."""
    base = tmp_path_factory.mktemp("runs")
    cfg = compose_cfg(*PERMFL, "runtime=inprocess")
    run(cfg, base / "whole")
    for name, kill in (("mid-round", lambda p: _killed_at(p, "fit", 4)),
                       ("between", lambda p: _killed_after_checkpoint(p, 3)),
                       ("first", lambda p: _killed_after_checkpoint(p, 1))):
        with pytest.MonkeyPatch.context() as patch:
            kill(patch)
            with pytest.raises(Killed):
                run(cfg, base / name)
    assert [read_checkpoint(base / name).round for name in ("mid-round", "between", "first")] == [3, 3, 1]
    return {"cfg": cfg, "base": base}


def _resumed(runs: dict, killed: str, tmp_path: Path, damage: dict[Path, str]) -> tuple[Path, ConfigError | None]:
    """A copy of the killed run, damaged, resumed: (its directory, the refusal or None)."""
    run_dir = tmp_path / killed
    shutil.copytree(runs["base"] / killed, run_dir)
    for path, how in damage.items():
        DAMAGE[how](run_dir / path)
    before = contents(run_dir)
    try:
        run({**runs["cfg"], "resume": True}, run_dir)
    except ConfigError as refusal:
        assert contents(run_dir) == before, "a refused resumption changed the run directory"
        return run_dir, refusal
    return run_dir, None


def _assert_refused(refusal: ConfigError | None, run_dir: Path, *named: Path) -> None:
    assert refusal is not None, "resumed, but the state it needs is damaged"
    message = str(refusal)
    assert refusal.key == "resume" and "\n" not in message and "overwrite=true" in message, message
    for path in named:
        assert str(run_dir / path) in message, (path, message)


def _assert_same(run_dir: Path, refusal: ConfigError | None, runs: dict) -> None:
    assert refusal is None, str(refusal)
    assert_same_run(run_dir, runs["base"] / "whole")


HOW = list(DAMAGE)
UNREADABLE = ["truncated", "emptied", "garbled"]


# ---------------------------------------------------------------- state versions
@pytest.mark.parametrize("how", HOW)
def test_a_damaged_version_of_the_round_in_progress_is_dropped(runs, tmp_path, how):
    run_dir, refusal = _resumed(runs, "mid-round", tmp_path, {DEVICES: how})  # round 4's: not needed
    _assert_same(run_dir, refusal, runs)


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_needed_version_mid_round_goes_back_to_the_older_checkpoint(runs, tmp_path, how, caplog):
    # Round 3's version is needed; round 2's, checkpoint 2's, is kept under older/ (round 4 wrote the newest).
    run_dir, refusal = _resumed(runs, "mid-round", tmp_path, {DEVICES_PREVIOUS: how})
    _assert_same(run_dir, refusal, runs)
    assert "resuming after round 2" in caplog.text


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_needed_version_whose_older_one_is_gone_too_is_refused_naming_it(runs, tmp_path, how):
    run_dir, refusal = _resumed(runs, "mid-round", tmp_path, {DEVICES_PREVIOUS: how, DEVICES_OLDER: "deleted"})
    _assert_refused(refusal, run_dir, DEVICES_PREVIOUS if how != "deleted" else DEVICES)


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_needed_version_goes_back_to_the_older_checkpoint_it_still_matches(runs, tmp_path, how, caplog):
    run_dir, refusal = _resumed(runs, "between", tmp_path, {DEVICES: how})  # round 3's; round 2's is there
    _assert_same(run_dir, refusal, runs)
    assert "resuming after round 2" in caplog.text and "devices-0.npz" in caplog.text


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_older_version_no_one_needs_is_dropped(runs, tmp_path, how):
    run_dir, refusal = _resumed(runs, "between", tmp_path, {DEVICES_PREVIOUS: how})
    _assert_same(run_dir, refusal, runs)


@pytest.mark.parametrize("how", HOW)
def test_a_needed_state_without_any_older_one_is_refused_not_started_from_scratch(runs, tmp_path, how):
    run_dir, refusal = _resumed(runs, "first", tmp_path, {DEVICES: how})
    _assert_refused(refusal, run_dir, DEVICES)


@pytest.mark.parametrize("killed", ["mid-round", "between"])
def test_a_state_deleted_with_all_its_versions_is_refused_naming_it(runs, tmp_path, killed):
    run_dir, refusal = _resumed(runs, killed, tmp_path, {DEVICES: "deleted", DEVICES_PREVIOUS: "deleted",
                                                         DEVICES_OLDER: "deleted"})
    _assert_refused(refusal, run_dir, DEVICES)


def test_a_damaged_root_state_goes_back_a_round(runs, tmp_path):
    run_dir, refusal = _resumed(runs, "between", tmp_path, {STATE / "node-root.npz": "garbled"})
    _assert_same(run_dir, refusal, runs)


# ---------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("how", HOW)
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(runs, tmp_path, how, caplog):
    run_dir, refusal = _resumed(runs, "between", tmp_path, {CHECKPOINT: how})
    _assert_same(run_dir, refusal, runs)
    if how != "deleted":
        assert f"checkpoint {run_dir / CHECKPOINT} is unreadable" in caplog.text


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_checkpoint_after_a_mid_round_kill_falls_back_to_the_previous_one(runs, tmp_path, how):
    # Killed in round 4: the store keeps round 2's versions (older/) that checkpoint 2 needs.
    run_dir, refusal = _resumed(runs, "mid-round", tmp_path, {CHECKPOINT: how})
    _assert_same(run_dir, refusal, runs)


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_checkpoint_whose_predecessor_the_store_no_longer_matches_is_refused(runs, tmp_path, how):
    run_dir, refusal = _resumed(runs, "mid-round", tmp_path, {CHECKPOINT: how, DEVICES_OLDER: "deleted"})
    _assert_refused(refusal, run_dir, CHECKPOINT)


@pytest.mark.parametrize("killed", ["mid-round", "between"])
@pytest.mark.parametrize("how", HOW)
def test_a_damaged_previous_checkpoint_is_not_needed(runs, tmp_path, killed, how):
    run_dir, refusal = _resumed(runs, killed, tmp_path, {PREVIOUS_CHECKPOINT: how})
    _assert_same(run_dir, refusal, runs)


@pytest.mark.parametrize("how", UNREADABLE)
def test_a_damaged_only_checkpoint_is_refused_naming_it(runs, tmp_path, how):
    run_dir, refusal = _resumed(runs, "first", tmp_path, {CHECKPOINT: how})
    _assert_refused(refusal, run_dir, CHECKPOINT)


def test_a_deleted_only_checkpoint_of_round_1_starts_the_run_over(runs, tmp_path):
    # Nothing of round 2 was saved: starting at round 1 again is the uninterrupted run.
    run_dir, refusal = _resumed(runs, "first", tmp_path, {CHECKPOINT: "deleted"})
    _assert_same(run_dir, refusal, runs)


@pytest.mark.parametrize("how", HOW)
def test_both_checkpoints_damaged_are_refused_naming_them(runs, tmp_path, how):
    run_dir, refusal = _resumed(runs, "mid-round", tmp_path, {CHECKPOINT: how, PREVIOUS_CHECKPOINT: how})
    _assert_refused(refusal, run_dir, CHECKPOINT)


def test_a_damaged_needed_version_and_previous_checkpoint_are_refused(runs, tmp_path):
    run_dir, refusal = _resumed(runs, "between", tmp_path, {DEVICES: "garbled", PREVIOUS_CHECKPOINT: "emptied"})
    _assert_refused(refusal, run_dir, DEVICES)


# ---------------------------------------------------------------- the pieces
def test_rollback_counts_unreadable_versions_as_absent_and_removes_them(tmp_path):
    store = StateStore(tmp_path)
    for rnd in (1, 2, 3):
        store.round = rnd
        store.save("k", {"x": np.array([rnd])})
    garble(tmp_path / "k.npz")  # round 3's
    assert store.versions("k") == [(2, tmp_path / PREVIOUS / "k.npz"), (1, tmp_path / OLDER / "k.npz")]
    kept, damaged = store.plan(3)
    assert kept == {"k": (2, tmp_path / PREVIOUS / "k.npz")} and damaged == [tmp_path / "k.npz"]
    assert store.rollback(3) == [tmp_path / "k.npz"]
    assert store.load("k") == {"x": np.array([2])} and not (tmp_path / PREVIOUS / "k.npz").exists()


def test_commit_fsyncs_what_changed_since_the_last_one_and_returns_each_key_round(tmp_path, monkeypatch):
    store = StateStore(tmp_path)
    for key, rnd in (("a", 1), ("b", 1), ("b", 2)):
        store.round = rnd
        store.save(key, {"x": np.array([rnd])})
    old = 1_000_000_000  # 1 s after the epoch: long before the last commit
    os.utime(tmp_path / "a.npz", ns=(old, old))
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name), real(fd)))
    manifest, newest = store.commit(since_ns=2 * old)
    assert manifest == {"a": 1, "b": 2} and newest == (tmp_path / "b.npz").stat().st_mtime_ns
    assert sorted(synced) == sorted([tmp_path.name, PREVIOUS, "b.npz", "b.npz"])  # b's two versions, the folders
    synced.clear()
    store.round = 3
    store.save("c", {"x": np.array([3])})
    assert store.commit(since_ns=newest)[0] == {"a": 1, "b": 2, "c": 3} and "c.npz" in synced and "a.npz" not in synced
    synced.clear()
    store.commit()  # 0: every file
    assert sorted(synced) == sorted([tmp_path.name, PREVIOUS, "a.npz", "b.npz", "b.npz", "c.npz"])


def test_a_checkpoint_keeps_the_one_before_and_reads_a_bare_pickle(tmp_path):
    for rnd in (1, 2):
        write_checkpoint(tmp_path, Checkpoint(rnd, {}))
    assert read_checkpoint(tmp_path).round == 2
    assert resume._load_checkpoint(tmp_path / PREVIOUS_CHECKPOINT).round == 1
    atomic_write_bytes(tmp_path / CHECKPOINT, pickle.dumps(Checkpoint(7, {})))  # written by an older hfl
    assert read_checkpoint(tmp_path) == Checkpoint(7, {}, None)


def test_a_fresh_run_drops_both_checkpoints_of_the_run_it_overwrites(tmp_path):
    for rnd in (1, 2):
        write_checkpoint(tmp_path, Checkpoint(rnd, {}))
    (tmp_path / resume.CONFIG).write_text("{}")
    assert resume.prepare({"resume": False, "overwrite": True, "runtime": {"state_dir": None}}, tmp_path) is None
    assert not (tmp_path / CHECKPOINT).exists() and not (tmp_path / PREVIOUS_CHECKPOINT).exists()


@pytest.fixture(autouse=True)
def _hfl_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hfl")
