"""PFLEGO's roundrobin partition: random k classes per device (all covered), samples dealt in turn."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hfl.data import build_federation
from hfl.data.partition import partition_roundrobin, roundrobin_classes
from hfl.errors import ConfigError

TOPO = {"formation": "random", "num_teams": 5, "devices_per_team": 2, "team_labels": None, "teams": None}  # 10 devices
SYNTH = {"name": "synthetic", "num_features": 60, "num_classes": 10, "min_samples": 50, "max_samples": 400,
         "partition": "roundrobin", "classes_per_device": 2}


def labels_with(per_class: list[int]) -> np.ndarray:
    labels = np.concatenate([np.full(n, c) for c, n in enumerate(per_class)])
    return np.random.default_rng(0).permutation(labels).astype(np.int64)


def check_classes(owned: list[list[int]], num_devices: int, num_classes: int, k: int) -> None:
    assert len(owned) == num_devices
    for cs in owned:
        assert len(cs) == k and len(set(cs)) == k and cs == sorted(cs)
        assert all(0 <= c < num_classes for c in cs)
    assert set().union(*map(set, owned)) == set(range(num_classes))  # every class owned


@pytest.mark.parametrize("devices,classes,k", [(100, 10, 2), (100, 10, 5), (100, 10, 10), (7, 20, 3), (1, 4, 4)])
def test_every_device_k_distinct_classes_and_every_class_owned(devices, classes, k):
    for seed in range(5):
        check_classes(roundrobin_classes(devices, classes, k, seed), devices, classes, k)


def test_fix_up_when_slots_barely_cover_the_classes():
    # devices * k == classes: the only valid result gives each class exactly one owner. A random
    # pick of 2 of 10 classes on each of 5 devices covers all 10 with probability ~2%, so over 20
    # seeds the fix-up must have run.
    for seed in range(20):
        owned = roundrobin_classes(5, 10, 2, seed)
        check_classes(owned, 5, 10, 2)
        assert sorted(c for cs in owned for c in cs) == list(range(10))
    owned = roundrobin_classes(4, 10, 3, 0)  # 12 slots for 10 classes
    check_classes(owned, 4, 10, 3)


def test_roundrobin_classes_seeded_and_random():
    a = roundrobin_classes(100, 10, 2, seed=3)
    assert a == roundrobin_classes(100, 10, 2, seed=3)
    assert a != roundrobin_classes(100, 10, 2, seed=4)
    assert len({tuple(cs) for cs in a}) > 10  # random pairs, not one pattern repeated


def test_too_few_slots_and_bad_k_name_the_key():
    with pytest.raises(ConfigError, match="dataset.classes_per_device.*cannot cover"):
        roundrobin_classes(4, 10, 2, seed=0)
    for k in (0, 11):
        with pytest.raises(ConfigError, match="dataset.classes_per_device"):
            roundrobin_classes(20, 10, k, seed=0)


def test_samples_dealt_evenly_to_owners_and_all_used():
    labels = labels_with([101, 57, 230, 3, 64, 90, 11, 45, 300, 77])
    owned = roundrobin_classes(12, 10, 3, seed=1)
    parts = partition_roundrobin(labels, owned, seed=1)
    everything = np.concatenate(parts)
    assert len(everything) == len(np.unique(everything))  # no index twice
    assert np.array_equal(np.sort(everything), np.arange(len(labels)))  # every class owned: all used
    for c in range(10):
        owners = [d for d, cs in enumerate(owned) if c in cs]
        counts = [int(np.sum(labels[parts[d]] == c)) for d in owners]
        assert sum(counts) == int(np.sum(labels == c))
        assert max(counts) - min(counts) <= 1
        assert counts == sorted(counts, reverse=True)  # dealt in device-id order: the first owners get the extras
    for d, idx in enumerate(parts):
        assert set(labels[idx].tolist()) <= set(owned[d])
        assert np.all(np.diff(idx) > 0)  # sorted


def test_unowned_classes_dropped_and_partition_seeded():
    labels = labels_with([40] * 6)
    owned = [[0, 1], [1, 2], [0, 2]]  # classes 3..5 unowned
    a = partition_roundrobin(labels, owned, seed=5)
    assert set(np.concatenate(a).tolist()) == set(np.flatnonzero(labels < 3).tolist())
    assert [Counter(labels[idx].tolist()) for idx in a] == [{0: 20, 1: 20}, {1: 20, 2: 20}, {0: 20, 2: 20}]
    b = partition_roundrobin(labels, owned, seed=5)
    c = partition_roundrobin(labels, owned, seed=6)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert any(not np.array_equal(x, y) for x, y in zip(a, c))


def test_build_federation_roundrobin_on_synthetic():
    fed = build_federation(SYNTH, TOPO, seed=2)
    check_classes(fed.device_classes, 10, 10, 2)
    for d, dev in zip(fed.devices, fed.device_classes):
        assert set(d.y_train.tolist()) | set(d.y_test.tolist()) <= set(dev)
    natural = build_federation({**SYNTH, "partition": "natural"}, TOPO, seed=2)
    assert natural.device_classes is None
    total = sum(len(d.y_train) + len(d.y_test) for d in natural.devices)
    assert sum(len(d.y_train) + len(d.y_test) for d in fed.devices) == total  # every class owned: nothing dropped
    again = build_federation(SYNTH, TOPO, seed=2)
    assert again.device_classes == fed.device_classes
    assert all(np.array_equal(a.y_train, b.y_train) for a, b in zip(fed.devices, again.devices))


def test_build_federation_device_classes_other_partitions_and_proxy():
    classes = build_federation({**SYNTH, "partition": "classes", "min_per_class": 0, "size_sigma": 0.0}, TOPO, seed=0)
    assert classes.device_classes == [sorted([u, (u + 1) % 10]) for u in range(10)]
    assert build_federation({**SYNTH, "partition": "iid"}, TOPO, seed=0).device_classes is None
    plain = build_federation(SYNTH, TOPO, seed=0)
    proxied = build_federation({**SYNTH, "proxy_fraction": 0.2}, TOPO, seed=0)
    assert proxied.device_classes == plain.device_classes  # the dealt classes, whatever the proxy took
    for d, dev in zip(proxied.devices, proxied.device_classes):
        assert set(d.y_train.tolist()) | set(d.y_test.tolist()) <= set(dev)


@pytest.mark.parametrize("k", [0, 11, 1.5, "two"])
def test_build_federation_bad_classes_per_device(k):
    with pytest.raises(ConfigError, match="dataset.classes_per_device"):
        build_federation({**SYNTH, "classes_per_device": k}, TOPO, seed=0)


def test_build_federation_too_few_devices_for_classes():
    with pytest.raises(ConfigError, match="dataset.classes_per_device"):
        build_federation(SYNTH, {**TOPO, "num_teams": 2}, seed=0)  # 4 devices x 2 < 10 classes
