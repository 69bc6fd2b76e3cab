"""Every policy counts what happened (hfl.clock, hfl.node): under deadline and buffered nodes, as under
sync, each case ends in a run whose failures, empty rounds and simulated time are counted and reported,
or in a one-line refusal naming the cause: a bad clock value, a device failure, a run that trained nothing."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest

from hfl.device import client as device_client
from hfl.errors import ConfigError, user_error
from hfl.runtime.build import check_tree, federation_for, initial_model
from hfl.runtime.simulate import run
from tests.conftest import compose_cfg
from tests.test_clock import CLOCK, FEDAVG, final_model, model_size, rows

# 2 servers x 3 devices; every device: 20 steps of 0.1 s at speed 2 = 1 s of work; with the messages, a
# level-1 reply reaches the root about 10.6 s after it was sent (test_clock's hand-made sync round).
TIMED = [*FEDAVG, *CLOCK]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# ---------------------------------------------------------------- bad values
@pytest.mark.parametrize(("override", "key"), [
    ("clock.staleness.a=-1", "clock.staleness.a"),  # hinge: 1 / (a (s - b) + 1) divides by zero at s = b + 1
    ("clock.staleness.b=-2", "clock.staleness.b"),
    ("clock.staleness.a=inf", "clock.staleness.a"),
    ("clock.deadline=0", "clock.deadline"),
    ("clock.buffer=2.5", "clock.buffer"),
    ("clock.step_seconds=inf", "clock.step_seconds"),
    ("clock.latency=inf", "clock.latency"),
    ("clock.speed.mu=nan", "clock.speed.mu"),
    ("clock.shift.period=inf", "clock.shift.period"),
])
@pytest.mark.parametrize("policy", ["sync", "buffered"])
def test_an_out_of_range_clock_value_is_refused_naming_the_key_under_every_policy(override, key, policy):
    shift = ["clock.shift.kind=labels"] if key.startswith("clock.shift") else []
    cfg = compose_cfg(*FEDAVG, "clock.enabled=true", f"clock.policy={policy}",
                      "clock.staleness.function=hinge", *shift, override)
    with pytest.raises(ConfigError, match="^" + re.escape(key) + ": "):
        check_tree(cfg, federation_for(cfg).tree)


# ---------------------------------------------------------------- failures counted in every round
def test_a_round_that_merges_nothing_still_counts_its_failures_and_says_the_root_never_merged(tmp_path, caplog):
    """One of the 2 level-1 nodes fails every round (dropout_nodes: floor(0.5 x 2) = 1), the other's
    reply (~10.6 s away) misses the root's 1 s deadline: nothing is merged at the root, ever."""
    cfg = compose_cfg(*TIMED, "clock.policy=[deadline,sync]", "clock.deadline=1", "runtime.dropout_nodes=0.5",
                      "global_rounds=3")
    with caplog.at_level(logging.WARNING, logger="hfl.node.root"):
        run(cfg, tmp_path)
    lines = rows(tmp_path)
    assert [r["failures"] for r in lines] == [1, 1, 1] and [r["late_level1"] for r in lines] == [1, 1, 1]
    assert summary(tmp_path)["failures"] == 3
    assert summary(tmp_path)["never_merged"] == [0]  # the level-1 nodes did merge their devices' replies
    assert any("the root never merged a reply in 3 global rounds" in r.getMessage() for r in caplog.records)
    initial = initial_model(cfg, federation_for(cfg))
    for a, b in zip(final_model(tmp_path), initial, strict=True):
        np.testing.assert_array_equal(a, b)  # the GM is, as reported, untrained


def test_failures_of_a_late_subtree_count_at_the_level_they_happened(tmp_path):
    """Each server drops 1 of its 3 devices a round (runtime.dropout 0.34); the root's deadline drops
    every server's reply as late: the devices' failures still count, 2 servers x 1 device each round."""
    cfg = compose_cfg(*TIMED, "clock.policy=[deadline,sync]", "clock.deadline=1", "runtime.dropout=0.34",
                      "algorithm.min_fit_fraction=0.6", "global_rounds=2")
    run(cfg, tmp_path)
    lines = rows(tmp_path)
    assert [r["failures_level2"] for r in lines] == [2, 2] and [r["failures"] for r in lines] == [2, 2]
    assert summary(tmp_path)["failures"] == 4


# ---------------------------------------------------------------- time goes on
def test_late_next_with_every_child_busy_advances_time_to_the_next_arrival(tmp_path):
    """A 1 s deadline at the root, ~10.6 s level-1 calls, clock.late=next: after round 1 both level-1 nodes
    are busy; the root waits for their replies instead of stopping time, and merges them."""
    cfg = compose_cfg(*TIMED, "clock.policy=[deadline,sync]", "clock.deadline=1", "clock.late=next", "global_rounds=4")
    run(cfg, tmp_path)
    lines = rows(tmp_path)
    times = [r["sim_time"] for r in lines]
    assert all(b > a for a, b in zip(times, times[1:])), times
    assert times[0] == pytest.approx(1.0)  # round 1 closed at its deadline with both replies in flight
    # round 2 has no one to ask: it waits for the replies sent at 0, which arrive one sync round later
    mb = model_size(cfg)
    assert times[1] == pytest.approx(2 * (0.5 + mb / 1000) + 2 * (0.25 + mb / 2000) + 20 * 0.1 / 2.0)
    assert lines[1]["bytes_up_level0"] == 2 * mb  # and merges both
    assert "never_merged" not in summary(tmp_path)
    initial = initial_model(cfg, federation_for(cfg))
    assert any(not np.array_equal(a, b) for a, b in zip(final_model(tmp_path), initial, strict=True))


def test_a_run_in_which_no_level_ever_merges_is_refused_naming_the_deadline(tmp_path):
    """A 0.1 s deadline everywhere, shorter than any device's 1 s of work: nothing is ever merged."""
    cfg = compose_cfg(*TIMED, "clock.policy=deadline", "clock.deadline=0.1", "global_rounds=2")
    with pytest.raises(ConfigError, match=r"^clock\.deadline: no node at any level merged a reply in 2 global rounds"):
        run(cfg, tmp_path)
    assert summary(tmp_path)["never_merged"] == [0, 1]  # written before the refusal


# ---------------------------------------------------------------- the real cause of a device failure
@pytest.mark.parametrize("policy", [["clock.policy=buffered"], ["clock.policy=deadline", "clock.deadline=1"],
                                    ["clock.policy=deadline", "clock.deadline=1", "clock.late=next"]])
def test_a_device_failure_is_named_not_called_divergence_under_every_policy(tmp_path, monkeypatch, policy):
    def out_of_memory(self, parameters, config):  # noqa: ANN001, ANN202
        raise MemoryError("device out of memory")

    monkeypatch.setattr(device_client.DeviceClient, "fit", out_of_memory)
    cfg = compose_cfg(*TIMED, *policy, "runtime.batched=off", "global_rounds=2")
    with pytest.raises(RuntimeError) as raised:
        run(cfg, tmp_path)
    assert "MemoryError('device out of memory')" in str(raised.value)
    assert "2 failures" in str(raised.value)  # both level-1 nodes, each having lost all its devices
    assert "diverged" not in (user_error(raised.value, cfg) or "")
