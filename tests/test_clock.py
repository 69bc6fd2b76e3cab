"""Simulated time (hfl.clock): the clock's figures, the policies' arithmetic against hand-computed
values, and runs whose simulated times and models are checked by hand or against sync."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hfl.clock.model import Clock, read_trace
from hfl.clock.policy import InFlight, LevelPolicy, close_round, merged_model, staleness_weight
from hfl.errors import ConfigError
from hfl.rules.payload import npy_nbytes
from hfl.runtime.build import check_tree, federation_for, initial_model
from hfl.output.report import GM, curve, load_run
from hfl.runtime.simulate import run
from tests.conftest import compose_cfg

# FedAvg on 2 servers x 3 devices, 20 steps per device, in-process.
FEDAVG = ["algorithm=fedavg", "topology=tree", "topology.fanout=[2,3]", "dataset.max_samples=200",
          "dataset.batch_size=32", "algorithm.local_steps=20", "algorithm.alpha=0.05", "runtime=inprocess",
          "runtime.torch_threads=1"]
CLOCK = ["clock.enabled=true", "clock.step_seconds=0.1", "clock.speed.value=2.0", "clock.latency=[0.5,0.25]",
         "clock.bandwidth=[1000,2000]"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_model(run_dir: Path) -> list[np.ndarray]:
    with np.load(run_dir / "checkpoints" / "global_model.npz") as data:
        return [data[f"arr_{i}"] for i in range(sum(n.startswith("arr_") for n in data.files))]


def model_size(cfg: dict) -> int:
    """Bytes of the model every message carries (FedAvg: the model alone), as sent (.npy)."""
    return sum(npy_nbytes(a) for a in initial_model(cfg, federation_for(cfg)))


def entry(cid: str, arrival: float, version: int = 0, failed: bool = False) -> InFlight:
    return InFlight(cid, arrival, version, ConnectionError("gone") if failed else object())


# ---------------------------------------------------------------- pure arithmetic
def test_staleness_weights_against_hand_computed_values():
    assert staleness_weight(7, "constant") == 1.0
    assert staleness_weight(3, "polynomial", a=0.5) == pytest.approx(0.5)  # (1+3)^-0.5
    assert staleness_weight(0, "polynomial", a=0.5) == 1.0
    assert staleness_weight(4, "hinge", a=0.5, b=4) == 1.0
    assert staleness_weight(6, "hinge", a=0.5, b=4) == pytest.approx(0.5)  # 1 / (0.5 x 2 + 1)
    with pytest.raises(ValueError, match="unknown staleness"):
        staleness_weight(1, "exp")


def test_deadline_closes_at_the_deadline_or_the_mth_reply_and_drops_or_carries_the_late():
    pending = [entry("a", 1.0), entry("b", 2.0), entry("c", 5.0)]
    closed, kept = close_round(LevelPolicy("deadline", deadline=3.0), 0.0, pending, 0)
    assert closed.end == 3.0 and [e.cid for e in closed.merged] == ["a", "b"]
    assert [e.cid for e in closed.late] == ["c"] and kept == []
    closed, kept = close_round(LevelPolicy("deadline", deadline=3.0, min_replies=1), 0.0, pending, 0)
    assert closed.end == 1.0 and [e.cid for e in closed.merged] == ["a"] and len(closed.late) == 2
    closed, kept = close_round(LevelPolicy("deadline", deadline=3.0, late="next"), 0.0, pending, 0)
    assert closed.late == [] and [e.cid for e in kept] == ["c"]
    # everyone in before the deadline: the round closes at the last reply
    closed, _ = close_round(LevelPolicy("deadline", deadline=30.0), 0.0, pending, 0)
    assert closed.end == 5.0 and len(closed.merged) == 3


def test_buffered_closes_at_the_kth_arrival_and_keeps_the_rest_in_flight():
    pending = [entry("a", 3.0), entry("b", 1.0), entry("c", 2.0, failed=True), entry("d", 2.0)]
    closed, kept = close_round(LevelPolicy("buffered", buffer=2), 0.5, pending, 4)
    assert closed.end == 2.0
    assert [e.cid for e in closed.merged] == ["b", "d"] and [e.cid for e in closed.failed] == ["c"]
    assert [e.cid for e in kept] == ["a"]
    # a reply more than max_staleness merges old is dropped, not merged
    closed, _ = close_round(LevelPolicy("buffered", buffer=2, max_staleness=2), 0.0,
                            [entry("old", 1.0, version=1), entry("new", 1.5, version=4)], 4)
    assert [e.cid for e in closed.too_stale] == ["old"] and [e.cid for e in closed.merged] == ["new"]
    closed, _ = close_round(LevelPolicy("sync"), 0.0, [entry("a", 4.0), entry("b", 1.0)], 0)
    assert closed.end == 4.0 and len(closed.merged) == 2


def test_a_stale_reply_is_merged_as_the_current_model_plus_its_weighted_delta():
    current, reply, sent = [np.array([1.0, 2.0])], [np.array([3.0, 3.0])], [np.array([2.0, 1.0])]
    np.testing.assert_allclose(merged_model(current, reply, sent, 2, 0.5)[0], [1.5, 3.0])  # 1 + 0.5 (3-2), 2 + 0.5 (3-1)
    assert merged_model(current, reply, sent, 0, 1.0)[0] is reply[0]  # fresh: as it is


def test_clock_figures_depend_on_the_seed_and_device_alone(tmp_path):
    clock = Clock(seed=3, speed="lognormal", mu=0.5, sigma=1.0, online=0.3, period=10.0, step_seconds=0.1,
                  latency=(0.5, 0.25), bandwidth=(1000.0, 2000.0))
    ids = np.arange(20000)
    speeds = clock.speeds(ids)
    assert np.median(speeds) == pytest.approx(math.exp(0.5), rel=0.03)
    assert np.std(np.log(speeds)) == pytest.approx(1.0, rel=0.03)
    np.testing.assert_array_equal(clock.speeds([17, 5]), speeds[[17, 5]])  # one device's draw alone
    assert Clock(seed=4, speed="lognormal").speeds([17])[0] != Clock(seed=3, speed="lognormal").speeds([17])[0]
    assert clock.work_seconds(5, 20) == pytest.approx(20 * 0.1 / speeds[5])
    assert clock.message_seconds(1, 500) == pytest.approx(0.25 + 500 / 2000)
    online = clock.online_at(ids, 12.0)
    assert online.mean() == pytest.approx(0.3, abs=0.015)
    np.testing.assert_array_equal(online, clock.online_at(ids, 19.9))  # the same period
    assert not np.array_equal(online, clock.online_at(ids, 20.0))
    # offline_between: the start of the first period it is off, or None
    d = int(np.flatnonzero(online & ~clock.online_at(ids, 25.0))[0])  # on in [10, 20), off in [20, 30)
    assert clock.offline_between(d, 12.0, 15.0) is None and clock.offline_between(d, 12.0, 21.0) == 20.0
    trace = tmp_path / "trace.csv"
    trace.write_text("device_id,speed\n5,0.25\n")
    traced = Clock(seed=3, speed="lognormal", trace=read_trace(trace))
    assert traced.speeds([5, 6])[0] == 0.25 and traced.speeds([6])[0] == clock.speeds([6])[0] * math.exp(-0.5)
    trace.write_text("device_id,speed\n5,-1\n")
    with pytest.raises(ConfigError, match="clock.trace.*line 2"):
        read_trace(trace)


# ---------------------------------------------------------------- runs
def test_sync_round_times_on_a_hand_made_tree(tmp_path):
    """Every device: speed 2, 20 steps of 0.1 s = 1 s of work; each message latency + bytes / bandwidth."""
    cfg = compose_cfg(*FEDAVG, *CLOCK, "global_rounds=2")
    run(cfg, tmp_path)
    lines = rows(tmp_path)
    model_bytes = model_size(cfg)
    one_round = 2 * (0.5 + model_bytes / 1000) + 2 * (0.25 + model_bytes / 2000) + 20 * 0.1 / 2.0
    assert lines[0]["sim_time"] == pytest.approx(one_round)
    assert lines[1]["sim_time"] == pytest.approx(2 * one_round)
    # the run's plots and hfl-report's also draw accuracy against simulated time
    xs, values, _, _ = curve([load_run(tmp_path)], GM.keys("accuracy"), "sim_time")
    assert xs == [line["sim_time"] for line in lines] and values == [line["gm_accuracy"] for line in lines]
    assert (tmp_path / "accuracy_time.png").stat().st_size > 0


def test_a_clock_with_sync_nodes_trains_the_models_of_a_run_without_one(tmp_path):
    sampled = ["algorithm.sample_fraction=[1,0.67]", "global_rounds=3"]
    run(compose_cfg(*FEDAVG, *sampled), tmp_path / "plain")
    run(compose_cfg(*FEDAVG, *sampled, *CLOCK, "clock.speed.distribution=lognormal"), tmp_path / "clock")
    for a, b in zip(final_model(tmp_path / "clock"), final_model(tmp_path / "plain"), strict=True):
        np.testing.assert_array_equal(a, b)


def test_buffered_with_every_child_and_a_constant_weight_is_sync(tmp_path):
    common = [*FEDAVG, *CLOCK, "clock.speed.distribution=lognormal", "global_rounds=3"]
    run(compose_cfg(*common), tmp_path / "sync")
    run(compose_cfg(*common, "clock.policy=buffered", "clock.buffer=[2,3]"), tmp_path / "buffered")
    run(compose_cfg(*common, "clock.policy=deadline", "clock.deadline=1e9"), tmp_path / "deadline")
    for other in ("buffered", "deadline"):
        for a, b in zip(final_model(tmp_path / other), final_model(tmp_path / "sync"), strict=True):
            np.testing.assert_array_equal(a, b)
        assert [r["sim_time"] for r in rows(tmp_path / other)] == [r["sim_time"] for r in rows(tmp_path / "sync")]


def test_a_deadline_drops_a_slow_device_or_merges_it_stale_later(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("device_id,speed\n0,0.1\n")  # device 0: 20 s of work instead of 1 s
    slow = [*FEDAVG, *CLOCK, f"clock.trace={trace}", "clock.policy=[sync,deadline]", "clock.deadline=5",
            "global_rounds=5"]
    run(compose_cfg(*slow), tmp_path / "drop")
    lines = rows(tmp_path / "drop")
    model_bytes = model_size(compose_cfg(*slow))
    # the node holding device 0 closes at its deadline; the root waits for it
    assert lines[0]["sim_time"] == pytest.approx(2 * (0.5 + model_bytes / 1000) + 5.0)
    assert [r["late_level2"] for r in lines] == [1, 1, 1, 1, 1] and all(r["stale_level2"] == 0 for r in lines)
    run(compose_cfg(*slow, "clock.late=next"), tmp_path / "next")
    lines = rows(tmp_path / "next")
    # device 0's reply (sent in global round 1, ~20 s away) is merged, stale, in a later call of its node
    assert sum(r["stale_level2"] for r in lines) >= 1 and sum(r["late_level2"] for r in lines) == 0
    assert any(not np.array_equal(a, b) for a, b in zip(final_model(tmp_path / "next"), final_model(tmp_path / "drop")))


def test_devices_offline_are_not_asked_and_those_going_away_mid_round_fail(tmp_path):
    away = [*FEDAVG, *CLOCK, "clock.availability.online=0.5", "clock.availability.period=2.0",
            "algorithm.min_fit_fraction=0.01", "global_rounds=6", "topology.fanout=[2,8]"]
    run(compose_cfg(*away), tmp_path / "a")
    run(compose_cfg(*away), tmp_path / "b")
    lines = rows(tmp_path / "a")
    assert sum(r["failures"] for r in lines) > 0  # some went away mid-round
    asked = [len(json.loads(line)["asked"]) for line in (tmp_path / "a" / "samples.jsonl").read_text().splitlines()
             if json.loads(line)["node"] != "root"] if (tmp_path / "a" / "samples.jsonl").exists() else []
    assert asked and max(asked) < 8  # offline devices are not asked
    for a, b in zip(final_model(tmp_path / "a"), final_model(tmp_path / "b"), strict=True):
        np.testing.assert_array_equal(a, b)  # the same seed, the same run


@pytest.mark.parametrize(("overrides", "key"), [
    (["algorithm=permfl", "clock.policy=buffered"], "clock.policy"),
    (["algorithm=bhfl", "algorithm.residual_up_k=1", "clock.policy=buffered"], "clock.policy"),
    (["clock.policy=[sync,buffered,sync]"], "clock.policy"),
    (["clock.policy=later"], "clock.policy"),
    (["clock.latency=[0.1]"], "clock.latency"),
    (["clock.speed.distribution=uniform"], "clock.speed.distribution"),
    (["clock.availability.online=0"], "clock.availability.online"),
    (["clock.late=never", "clock.policy=deadline"], "clock.late"),
])
def test_bad_clock_settings_are_refused_naming_the_key(overrides, key):
    base = [o for o in FEDAVG if not o.startswith("algorithm=")] if any(o.startswith("algorithm=") for o in overrides) \
        else FEDAVG
    cfg = compose_cfg(*base, "clock.enabled=true", *overrides)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_tree(cfg, federation_for(cfg).tree)


# B-HFL on a depth-3 tree, buffered at every level with replies left in flight at the root and the
# nodes (their stored state carries them), lognormal speeds.
BUFFERED_BHFL = ["clock.enabled=true", "clock.speed.distribution=lognormal", "clock.policy=buffered",
                 "clock.buffer=[1,1,1]", "clock.staleness.function=polynomial"]


def test_a_buffered_run_killed_mid_round_resumes_as_never_killed(tmp_path, monkeypatch):
    from tests.test_resume import BHFL, assert_resumed_equals_whole

    assert_resumed_equals_whole(compose_cfg(*BHFL, *BUFFERED_BHFL, "runtime=inprocess"), tmp_path, monkeypatch, "fit", 5)
    assert sum(r["stale_level1"] + r["stale_level3"] for r in rows(tmp_path / "whole")) > 0  # carried replies merged


@pytest.mark.slow
def test_a_buffered_run_on_ray_equals_the_inprocess_one(tmp_path):
    from tests.test_resume import BHFL

    # In-process without batching siblings' steps together (each Ray SuperNode batches its own subtree
    # alone): bit for bit. The simulated times come from the seed and the messages' sizes alone.
    run(compose_cfg(*BHFL, *BUFFERED_BHFL, "runtime=inprocess", "global_rounds=4", "runtime.batch_siblings=false"),
        tmp_path / "inprocess")
    run(compose_cfg(*BHFL, *BUFFERED_BHFL, "runtime=simulation", "global_rounds=4"), tmp_path / "ray")
    for a, b in zip(final_model(tmp_path / "ray"), final_model(tmp_path / "inprocess"), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [r["sim_time"] for r in rows(tmp_path / "ray")] == [r["sim_time"] for r in rows(tmp_path / "inprocess")]


@pytest.mark.parametrize("algorithm", ["fedavg", "hierfavg", "bhfl", "fedprox", "fedper", "fedrep", "ditto", "l2gd", "demlearn",
                                       "fedavg_ft"])
def test_every_algorithm_that_merges_replies_runs_buffered(algorithm, tmp_path):
    """Stale replies are merged as deltas of whatever each algorithm's devices send (a body, a full model)."""
    cfg = compose_cfg(f"algorithm={algorithm}", "topology=tree", "topology.fanout=[2,4]", "dataset.max_samples=120",
                      "dataset.batch_size=32", "runtime=inprocess", "runtime.torch_threads=1", "global_rounds=3",
                      *([] if algorithm == "l2gd" else ["algorithm.team_rounds=2"]), *CLOCK, "clock.speed.distribution=lognormal",
                      "clock.policy=[sync,buffered]", "clock.buffer=2")
    run(cfg, tmp_path)
    lines = rows(tmp_path)
    assert len(lines) == 3 and sum(r.get("stale_level2", 0) for r in lines) > 0
    assert all(np.isfinite(a).all() for a in final_model(tmp_path))


def test_a_node_with_no_device_online_waits_for_the_next_period():
    from types import SimpleNamespace

    from hfl.clock.timer import NodeTimer

    ids = list(range(4))
    seed = next(s for s in range(1000) if not Clock(seed=s, online=0.2, period=10.0).online_at(ids, 0.0).any())
    clock = Clock(seed=seed, online=0.2, period=10.0)
    first = next(p for p in range(1, 1000) if clock.online_at(ids, p * 10.0).any())
    timer = NodeTimer(clock, LevelPolicy(), level=1, lowest=True, start=3.0, path="0", seed=seed)
    children = [SimpleNamespace(cid=f"{d:06d}") for d in ids]
    asked = timer.pick(children, 1.0, "1.1")
    assert timer.time == first * 10.0
    assert [c.cid for c in asked] == [f"{d:06d}" for d in ids if clock.online_at([d], first * 10.0)[0]]


def test_per_fedavg_tests_a_device_never_trained_on_the_model_it_would_start_from(tmp_path):
    """A dropped device has no model of its own yet: its PM adapts its server's model (it used to fail the run)."""
    run(compose_cfg("algorithm=perfedavg", "topology=tree", "topology.fanout=[2,4]", "dataset.max_samples=120",
                    "runtime=inprocess", "runtime.torch_threads=1", "global_rounds=1", "runtime.dropout=0.5",
                    "algorithm.min_fit_fraction=0.5"), tmp_path)
    assert rows(tmp_path)[0]["pm_accuracy"] > 0
