"""Scale on one machine (issue 11, item 3): devices exist only while they work. Generated data
with the natural partition is made device by device when asked for (hfl.data.federation's
LazyDevices), equal to the eager build; a lowest node builds only the devices a message asks
(hfl.runtime.build.NodeDevices); the driver and a node's construction generate no device data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hfl.runtime import build as node_module
from hfl.runtime.apps import build_global_strategy
from hfl.data import build_federation, federation, synthetic
from hfl.device.state import stored_device_states
from hfl.errors import ConfigError
from hfl.runtime.build import build_node, build_level1_node, check_tree, federation_for, initial_model
from hfl.runtime.simulate import run
from hfl.state.store import StateStore
from tests.conftest import compose_cfg

FIELDS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")
TOPO = {"formation": "random", "num_teams": 3, "devices_per_team": 7}


@pytest.fixture
def lazy(monkeypatch):
    """Set hfl.data.federation.LAZY_DEVICES; federation_for's cache is emptied around the test."""
    node_module._federation.cache_clear()

    def set_lazy(value: bool) -> None:
        monkeypatch.setattr(federation, "LAZY_DEVICES", value)
        node_module._federation.cache_clear()

    yield set_lazy
    node_module._federation.cache_clear()


def both(dataset: dict, topo: dict, seed: int, set_lazy) -> tuple[federation.Federation, federation.Federation]:
    set_lazy(True)
    lazy_fed = build_federation(dataset, topo, seed)
    set_lazy(False)
    eager_fed = build_federation(dataset, topo, seed)
    return lazy_fed, eager_fed


def assert_same_device(a: federation.DeviceData, b: federation.DeviceData) -> None:
    assert a.device_id == b.device_id
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


# ---------------------------------------------------------------- lazy data == eager data
@pytest.mark.parametrize("dataset", [
    {"name": "synthetic"},
    {"name": "synthetic", "val_fraction": 0.2, "size_scale": 2, "train_fraction": 0.6},
    {"name": "synthetic_multilevel", "clusters": [3], "scales": [1.0, 1.0, 0.5], "val_fraction": 0.1},
])
def test_lazy_devices_equal_the_eager_build(dataset, lazy):
    lazy_fed, eager_fed = both(dataset, TOPO, 4, lazy)
    assert isinstance(lazy_fed.devices, federation.LazyDevices) and isinstance(eager_fed.devices, list)
    assert lazy_fed.devices.made == 0  # building the federation made no device
    assert len(lazy_fed.devices) == len(eager_fed.devices) == 21
    for d in (0, 5, 20, -1):
        assert_same_device(lazy_fed.devices[d], eager_fed.devices[d])
    assert [x.device_id for x in lazy_fed.devices[3:6]] == [3, 4, 5]
    assert (lazy_fed.level1_devices, lazy_fed.input_shape, lazy_fed.num_classes, lazy_fed.device_clusters) == (
        eager_fed.level1_devices, eager_fed.input_shape, eager_fed.num_classes, eager_fed.device_clusters)
    assert lazy_fed.tree.level1_devices == eager_fed.tree.level1_devices and lazy_fed.device_classes is None
    with pytest.raises(IndexError):
        lazy_fed.devices[21]


def test_lazy_devices_keep_what_fits_their_budget(lazy, monkeypatch):
    lazy(True)
    fed = build_federation({"name": "synthetic"}, TOPO, 0)  # the default budget holds these 21 devices
    assert [d.device_id for d in fed.devices] == [d.device_id for d in fed.devices] == list(range(21))
    assert fed.devices.made == 21 and 0 < fed.devices.kept_bytes <= federation.LAZY_CACHE_BYTES

    monkeypatch.setattr(federation, "LAZY_CACHE_BYTES", 0)  # only the last few asked for
    fed = build_federation({"name": "synthetic"}, TOPO, 0)
    first = fed.devices[2]
    assert fed.devices[2] is first and fed.devices.made == 1  # asked again at once: kept, not made again
    ids = [d.device_id for d in fed.devices]  # iterating makes each device once (2 is still recent)
    assert ids == list(range(21)) and fed.devices.made == 21
    assert len(fed.devices._recent) == federation.LAZY_RECENT < 21 and fed.devices.kept_bytes == 0
    again = fed.devices[2]
    assert fed.devices.made == 22 and again is not first  # long forgotten: made again...
    assert_same_device(again, first)  # ...the same

    sizes = [federation.nbytes(d) for d in fed.devices[:3]]
    monkeypatch.setattr(federation, "LAZY_CACHE_BYTES", sum(sizes))  # room for the first three made
    fed = build_federation({"name": "synthetic"}, TOPO, 0)
    for _ in range(2):
        list(fed.devices)
    assert sorted(fed.devices._kept) == [0, 1, 2] and fed.devices.kept_bytes == sum(sizes)
    assert fed.devices.made == 21 + 18  # the second pass made all but the three kept again


def test_partitions_that_need_the_pool_stay_eager(lazy):
    lazy(True)
    for dataset in ({"name": "synthetic", "partition": "iid"}, {"name": "synthetic", "proxy_fraction": 0.1}):
        assert isinstance(build_federation(dataset, TOPO, 0).devices, list), dataset


@pytest.mark.parametrize("dataset", [
    {"name": "synthetic", "min_samples": 0, "size_mean": 0.0, "size_sigma": 1.0},  # devices of 0 or 1 samples
    {"name": "synthetic", "min_samples": 2, "size_mean": 0.0, "size_sigma": 1.5, "val_fraction": 0.6},  # val takes all
    {"name": "synthetic_multilevel", "min_samples": 2, "size_mean": 0.0, "size_sigma": 1.0, "val_fraction": 0.6},
])
def test_lazy_refusals_equal_the_eager_ones(dataset, lazy):
    errors = []
    for value in (True, False):
        lazy(value)
        with pytest.raises(ConfigError) as err:
            build_federation(dataset, TOPO, 1)
        errors.append((err.value.key, str(err.value)))
    assert errors[0] == errors[1], errors
    assert "device" in errors[0][1]


def test_split_refusal_is_monotone_in_the_device_size():
    """check_natural_sizes clears every device when the smallest possible size passes: the
    validation refusal, once a size passes it, never comes back for a larger size."""
    for train_fraction in (0.1, 0.5, 0.75, 0.9):
        for val_fraction in (0.0, 0.05, 0.3, 0.5, 0.77, 0.95):
            fits = [federation._split_fits(n, train_fraction, val_fraction) for n in range(2, 300)]
            first = fits.index(True)
            assert all(fits[first:]), (train_fraction, val_fraction)


def test_sizes_are_read_only_where_the_floor_does_not_clear_them(lazy, monkeypatch):
    calls = []
    real = synthetic.num_samples
    monkeypatch.setattr(synthetic, "num_samples", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    lazy(True)
    build_federation({"name": "synthetic"}, TOPO, 0)  # min_samples 50: every device has enough
    assert calls == []
    build_federation({"name": "synthetic", "min_samples": 1}, TOPO, 0)
    assert sorted(calls) == list(range(21))


# ---------------------------------------------------------------- nothing forces all devices
@pytest.fixture
def generated(monkeypatch) -> list[int]:
    """The device ids hfl.data.synthetic.generate_device is called for."""
    calls: list[int] = []
    real = synthetic.generate_device

    def counting(seed: int, device_id: int, **params):  # noqa: ANN202
        calls.append(device_id)
        if len(calls) > 100:  # fail fast where something makes every device of 100,000
            raise AssertionError(f"generate_device called for {len(calls)} devices")
        return real(seed, device_id, **params)

    monkeypatch.setattr(synthetic, "generate_device", counting)
    return calls


@pytest.mark.parametrize("sampling", [("algorithm.sample_fraction=[1,0.01]",),
                                      ("algorithm.sampling=devices", "algorithm.sample_fraction=0.01")])
def test_driver_and_a_new_team_node_generate_no_device_data(sampling, generated, lazy, tmp_path):
    """The 100,000-device federation of benchmarks/scale.py: the driver's checks, initial model
    and root strategy, and an actor's team node before its first message, generate nothing."""
    lazy(True)
    cfg = compose_cfg("algorithm=fedavg", "topology=tree", "topology.fanout=[100,1000]", *sampling,
                      "runtime=inprocess")
    fed = federation_for(cfg)
    check_tree(cfg, fed.tree)
    initial_model(cfg, fed)
    build_global_strategy(cfg, tmp_path / "run")
    node = build_level1_node(cfg, 7, tmp_path / "state")
    assert len(fed.devices) == 100_000 and node.spec.path == "7"
    assert generated == [] and fed.devices.made == 0


def test_evaluation_makes_the_nodes_devices_only(generated, lazy, tmp_path):
    lazy(True)
    cfg = compose_cfg("algorithm=fedavg", "topology=tree", "topology.fanout=[10,6]", "runtime=inprocess")
    tree = federation_for(cfg).tree
    model = initial_model(cfg, federation_for(cfg))
    _, n, metrics = build_node(cfg, "3", tmp_path).evaluate(model, {})
    assert sorted(generated) == tree.devices("3")  # each of its 6 devices once, no other device
    assert metrics["gm_n"] == n > 0


SAMPLED = ("algorithm=fedavg", "topology=tree", "topology.fanout=[2,20]", "algorithm.sample_fraction=[1,0.1]",
           "algorithm.team_rounds=2", "algorithm.local_steps=3", "dataset.max_samples=200", "runtime=inprocess")


@pytest.mark.parametrize("batched", ["on", "off"])
def test_a_node_builds_only_the_devices_it_samples(batched, lazy, monkeypatch, tmp_path):
    lazy(True)
    cfg = compose_cfg(*SAMPLED, f"runtime.batched={batched}")
    built: list[int] = []
    real = node_module.device_runtime
    monkeypatch.setattr(node_module, "device_runtime", lambda c, d, *a, **k: built.append(d) or real(c, d, *a, **k))
    model = initial_model(cfg, federation_for(cfg))
    asked_in: dict[int, set[int]] = {}
    for global_round in (1, 2):
        built.clear()
        _, _, metrics = build_node(cfg, "0", tmp_path).fit(model, {"global_round": global_round})
        asked = {int(cid) for record in json.loads(metrics["samples"]) for cid in record["asked"]}
        assert len(built) == len(set(built))  # each once per message, kept for the node's two rounds
        assert set(built) == asked and 2 <= len(asked) <= 4  # 2 of 20 per round, 2 rounds
        asked_in[global_round] = asked
    # Device state: the devices of both messages, the first's carried over untouched by the second.
    stored = stored_device_states(StateStore(tmp_path))
    assert set(stored) == asked_in[1] | asked_in[2]
    assert asked_in[1] != asked_in[2]


# ---------------------------------------------------------------- whole runs: lazy == eager
def run_files(run_dir: Path) -> tuple[list[dict], list[np.ndarray], dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # wall-clock fields
        row.pop("seconds"), row.pop("compute_seconds")
    with np.load(run_dir / "checkpoints" / "global_model.npz") as data:
        model = [data[k] for k in sorted((k for k in data.files if k.startswith("arr_")), key=lambda k: int(k[4:]))]
    return rows, model, stored_device_states(StateStore(run_dir / "state"))


@pytest.mark.parametrize("overrides", [
    (),  # PerMFL: personal models and samplers carried between messages
    ("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]", "algorithm.sample_fraction=[1,1,0.5]"),
])
def test_lazy_run_equals_the_eager_run(overrides, lazy, tmp_path):
    base = ("topology.num_teams=2", "topology.devices_per_team=4", "dataset.max_samples=200", "global_rounds=2",
            "algorithm.team_rounds=2", "algorithm.local_steps=3", "runtime=inprocess", *overrides)
    results = []
    for value in (True, False):
        node_module._federation.cache_clear()
        run_dir = tmp_path / f"lazy-{value}"
        cfg = (*base, f"dataset.lazy={str(value).lower()}")
        run(compose_cfg(*cfg), run_dir)
        assert isinstance(federation_for(compose_cfg(*cfg)).devices, federation.LazyDevices) == value
        results.append(run_files(run_dir))
    (rows_a, model_a, states_a), (rows_b, model_b, states_b) = results
    assert rows_a == rows_b and len(rows_a) == 2
    assert all(np.array_equal(a, b) for a, b in zip(model_a, model_b, strict=True))
    assert sorted(states_a) == sorted(states_b) and states_a
    for d, state in states_a.items():
        assert sorted(state) == sorted(states_b[d])
        assert all(np.array_equal(state[k], states_b[d][k]) for k in state), d


def test_dataset_lazy_and_cache_mb_are_config_keys(tmp_path):
    node_module._federation.cache_clear()
    eager = federation_for(compose_cfg("dataset.lazy=false"))
    lazy = federation_for(compose_cfg("dataset.cache_mb=0"))
    assert isinstance(eager.devices, list) and isinstance(lazy.devices, federation.LazyDevices)
    assert lazy.devices._budget == 0
    assert_same_device(lazy.devices[3], eager.devices[3])
    with pytest.raises(ConfigError, match="dataset.lazy"):
        build_federation({"name": "synthetic", "lazy": "yes"}, TOPO, 0)
    node_module._federation.cache_clear()
