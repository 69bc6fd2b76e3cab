"""Dataset shift in simulated time (hfl.clock.shift) and B-HFL's asynchronous leaves (clients.bhfl):
class proportions and transforms by hand, and devices that keep training between requests."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from clients.bhfl import background_sessions
from hfl.clock.shift import Shift
from hfl.data.federation import DeviceData
from hfl.runtime.simulate import run
from hfl.state.store import StateStore
from hfl.device.state import unpack_states
from tests.conftest import compose_cfg


def device(n: int = 200, classes: int = 4) -> DeviceData:
    y = torch.arange(n) % classes  # every class n / classes times
    x = torch.arange(n * 9, dtype=torch.float32).reshape(n, 1, 3, 3)
    return DeviceData(7, x, y, x[:40].clone(), y[:40].clone())


def test_label_drift_holds_memory_samples_a_share_of_them_from_the_phase_class_cycling():
    shift = Shift(seed=1, kind="labels", period=10.0, memory=50, dominance=0.8)
    dominant = []
    for phase in range(5):
        data = shift.apply(device(), phase * 10.0 + 3.0)
        counts = torch.bincount(data.y_train, minlength=4)
        assert len(data.y_train) == 50 and len(data.y_test) == 40  # the memory; the test split keeps its size
        top = int(counts.argmax())
        # 40 drawn from the phase's class, 10 uniformly from all four: at least 40 of it
        assert counts[top] >= 40 and counts.sum() - counts[top] <= 10
        assert int(torch.bincount(data.y_test, minlength=4).argmax()) == top  # tested on the same drift
        dominant.append(top)
    assert sorted(dominant[:4]) == [0, 1, 2, 3] and dominant[4] == dominant[0]  # each class once, then again
    again = shift.apply(device(), 23.0)
    np.testing.assert_array_equal(again.y_train, shift.apply(device(), 29.9).y_train)  # a phase's draw is fixed


def test_permuted_and_rotated_blocks():
    data = device()
    permuted = Shift(seed=1, kind="permute", period=10.0)
    assert permuted.apply(data, 5.0) is data  # phase 0: as it is
    moved = permuted.apply(data, 15.0)
    assert not torch.equal(moved.x_train, data.x_train)
    # every sample's features are the same values in another order (the same order for every sample)
    torch.testing.assert_close(moved.x_train.reshape(200, -1).sort(dim=1).values, data.x_train.reshape(200, -1))
    order = moved.x_train.reshape(200, -1)[0].long()
    torch.testing.assert_close(moved.x_test.reshape(40, -1), data.x_test.reshape(40, -1)[:, order])
    rotated = Shift(seed=1, kind="rotate", period=10.0, angle=90.0).apply(data, 12.0)
    torch.testing.assert_close(rotated.x_train, torch.rot90(data.x_train, 1, dims=(2, 3)))


def test_background_sessions_by_hand():
    assert background_sessions(10.0, 35.0, 10.0, 5) == 2
    assert background_sessions(10.0, 95.0, 10.0, 5) == 5  # capped
    assert background_sessions(None, 95.0, 10.0, 5) == 0  # not trained yet: nothing to go on with
    assert background_sessions(10.0, 35.0, 0.0, 5) == 0


BHFL_SHIFT = ["algorithm=bhfl", "topology=tree", "topology.fanout=[2,5]", "algorithm.team_rounds=1",
              "algorithm.sample_fraction=[1,0.4]", "dataset.max_samples=200", "dataset.batch_size=32",
              "global_rounds=8", "clock.enabled=true", "clock.shift.kind=labels", "clock.shift.period=5",
              "clock.shift.memory=60", "runtime=inprocess", "runtime.torch_threads=1"]


def test_persistent_devices_train_between_requests_and_are_tested_as_they_are_then(tmp_path):
    run(compose_cfg(*BHFL_SHIFT), tmp_path / "sync")
    run(compose_cfg(*BHFL_SHIFT, "algorithm.background_every=2"), tmp_path / "async")
    stored = unpack_states(StateStore(tmp_path / "async" / "state").load("devices-0"))
    trained_at = {d: float(s["extra_trained_at"]) for d, s in stored.items() if "extra_trained_at" in s}
    assert trained_at and max(trained_at.values()) > 5.0  # sessions went on past the first phase
    pm = {name: [json.loads(line)["pm_accuracy"] for line in (tmp_path / name / "metrics.jsonl").open()]
          for name in ("sync", "async")}
    assert pm["async"][0] == pm["sync"][0]  # nothing to catch up before the first request
    # after the first shift, devices that kept training on their drifting data test better
    assert np.mean(pm["async"][3:]) > np.mean(pm["sync"][3:])


def test_background_training_needs_the_clock():
    from hfl.errors import ConfigError
    from hfl.runtime.build import check_tree, federation_for

    cfg = compose_cfg(*[o for o in BHFL_SHIFT if not o.startswith("clock.")], "algorithm.background_every=2")
    with pytest.raises(ConfigError, match="algorithm.background_every"):
        check_tree(cfg, federation_for(cfg).tree)
    cfg = compose_cfg(*BHFL_SHIFT, "clock.shift.kind=rotate")
    with pytest.raises(ConfigError, match="clock.shift.kind"):
        check_tree(cfg, federation_for(cfg).tree)




def test_asynchronous_proxy_training_adds_its_update_after_the_merge_times_the_factor(tmp_path):
    from hfl.rules.steps import sgd_step

    # the late update as the server merges it: theta + 0.5 x delta, a step of -0.5 along the delta
    out = sgd_step([np.array([1.0, 2.0], dtype=np.float32)], [np.array([0.5, -1.0], dtype=np.float32)], -0.5)
    np.testing.assert_allclose(out[0], [1.25, 1.5])
    assert out[0].dtype == np.float32
    proxy = ["algorithm=bhfl", "topology=tree", "topology.fanout=[2,3]", "dataset.proxy_fraction=0.2",
             "algorithm.proxy_samples=[40,20]", "dataset.max_samples=200", "dataset.batch_size=32",
             "global_rounds=2", "algorithm.team_rounds=1", "runtime=inprocess", "runtime.torch_threads=1"]
    run(compose_cfg(*proxy), tmp_path / "sync")
    run(compose_cfg(*proxy, "algorithm.proxy_async=true", "algorithm.proxy_staleness=0"), tmp_path / "zero")
    run(compose_cfg(*proxy, "algorithm.proxy_samples=null"), tmp_path / "none")
    run(compose_cfg(*proxy, "algorithm.proxy_async=true"), tmp_path / "async")
    model = {name: np.load(tmp_path / name / "checkpoints" / "global_model.npz")["arr_0"]
             for name in ("sync", "zero", "none", "async")}
    np.testing.assert_array_equal(model["zero"], model["none"])  # factor 0: as if no proxy training
    assert not np.array_equal(model["async"], model["sync"]) and not np.array_equal(model["async"], model["none"])
