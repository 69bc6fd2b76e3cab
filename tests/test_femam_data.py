"""FeMAM's data side: per-device validation splits, the cluster-wise (c, K) and multi-level
[a, b, c] partitions, the Dirichlet partition's minimum size, the ResNet-9 model, and their
config keys."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from hfl.data import build_federation
from hfl.data.multilevel import block_of
from hfl.data.partition import (
    clusterwise_clusters,
    deal_cluster_classes,
    multilevel_class_counts,
    multilevel_structure,
    partition_among_owners,
    partition_dirichlet,
    path_classes,
    split_train_test,
    split_train_val_test,
)
from hfl.device.state import DeviceRuntime
from hfl.errors import ConfigError
from hfl.models import build_model
from hfl.data.labels import device_data
from hfl.runtime.build import device_runtime
from hfl.state.store import StateStore
from hfl.device.training import BatchSampler, LocalTrainer
from tests.conftest import compose_cfg

ROOT = Path(__file__).parents[1]
REAL_DATA = ROOT / ".." / "shared" / "data"
SYNTH = {"name": "synthetic", "num_features": 60, "num_classes": 10, "min_samples": 50, "partition": "natural",
         "size_mean": 3.0, "size_sigma": 0.5, "max_samples": 200}
MULTI = {"name": "synthetic_multilevel", "num_features": 20, "num_classes": 10, "min_samples": 40,
         "size_mean": 3.0, "size_sigma": 0.5, "max_samples": 150, "clusters": [2, 4], "scales": [1.0, 1.0, 1.0, 0.5]}
RANDOM_4X10 = {"formation": "random", "num_teams": 4, "devices_per_team": 10, "team_labels": None, "teams": None}
RANDOM_5X10 = {**RANDOM_4X10, "num_teams": 5}


def balanced_labels(per_class: list[int], seed: int = 0) -> np.ndarray:
    labels = np.concatenate([np.full(n, c) for c, n in enumerate(per_class)])
    return np.random.default_rng(seed).permutation(labels).astype(np.int64)


def rows(*tensors: torch.Tensor) -> list[bytes]:
    return [row.numpy().tobytes() for t in tensors for row in t]


def same_devices(a, b, fields=("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")) -> bool:
    return len(a.devices) == len(b.devices) and all(
        torch.equal(getattr(da, f), getattr(db, f)) for da, db in zip(a.devices, b.devices, strict=True) for f in fields
    )


# ---------------------------------------------------------------- validation split
def test_val_split_sizes_disjoint_and_covering():
    idx = np.arange(1000, 1100)
    train, val, test = split_train_val_test(idx, 0.75, 0.2, seed=0, device_id=3)
    assert (len(train), len(val), len(test)) == (60, 15, 25)
    assert np.array_equal(np.sort(np.concatenate([train, val, test])), idx)  # disjoint and complete
    old_train, old_test = split_train_test(idx, 0.75, seed=0, device_id=3)
    assert np.array_equal(test, old_test)  # the test split does not move
    assert set(train) | set(val) == set(old_train)  # validation comes out of the training part
    assert np.array_equal(train, old_train[np.isin(old_train, train)])  # training keeps its order
    again = split_train_val_test(idx, 0.75, 0.2, seed=0, device_id=3)
    assert all(np.array_equal(a, b) for a, b in zip((train, val, test), again))
    assert not np.array_equal(val, split_train_val_test(idx, 0.75, 0.2, seed=1, device_id=3)[1])
    assert not np.array_equal(val, split_train_val_test(idx, 0.75, 0.2, seed=0, device_id=4)[1])


def test_val_split_zero_is_split_train_test_and_small_fractions_give_one_sample():
    idx = np.arange(37)
    train, val, test = split_train_val_test(idx, 0.75, 0.0, seed=5, device_id=1)
    old_train, old_test = split_train_test(idx, 0.75, seed=5, device_id=1)
    assert np.array_equal(train, old_train) and np.array_equal(test, old_test)
    assert len(val) == 0 and val.dtype == idx.dtype
    assert len(split_train_val_test(idx, 0.75, 0.001, seed=5, device_id=1)[1]) == 1  # > 0 -> at least one


def test_val_split_leaving_no_training_sample_names_the_key():
    with pytest.raises(ConfigError) as err:
        split_train_val_test(np.arange(2), 0.5, 0.5, seed=0, device_id=7)  # 1 train sample, 1 would go to val
    assert err.value.key == "dataset.val_fraction" and "device 7" in str(err.value)
    with pytest.raises(ConfigError) as err:  # also through the federation
        build_federation({**SYNTH, "val_fraction": 0.99}, RANDOM_4X10, seed=0)
    assert err.value.key == "dataset.val_fraction"


@pytest.mark.parametrize("value", [1.0, -0.1, "0.1", True])
def test_val_fraction_out_of_range_names_the_key(value):
    with pytest.raises(ConfigError) as err:
        build_federation({**SYNTH, "val_fraction": value}, RANDOM_4X10, seed=0)
    assert err.value.key == "dataset.val_fraction"


@pytest.mark.parametrize("partition", ["natural", "iid", "dirichlet", "classes", "roundrobin"])
def test_val_fraction_zero_changes_nothing(partition):
    dataset = {**SYNTH, "partition": partition, "min_per_class": 2}
    before = build_federation(dataset, RANDOM_4X10, seed=2)
    zero = build_federation({**dataset, "val_fraction": 0.0}, RANDOM_4X10, seed=2)
    assert same_devices(before, zero)
    for d in zero.devices:
        assert d.x_val.shape == (0, 60) and d.x_val.dtype == torch.float32
        assert d.y_val.shape == (0,) and d.y_val.dtype == torch.int64


@pytest.mark.parametrize(
    ("dataset", "partition"),
    [(SYNTH, p) for p in ("natural", "iid", "dirichlet", "classes", "roundrobin", "clusterwise", "multilevel")]
    + [(MULTI, "natural"), (MULTI, "clusterwise")],
)
def test_val_split_in_every_partition(dataset, partition):
    cfg = {**dataset, "partition": partition, "min_per_class": 2, "val_fraction": 0.1}
    fed = build_federation(cfg, RANDOM_4X10, seed=1)
    plain = build_federation({**cfg, "val_fraction": 0.0}, RANDOM_4X10, seed=1)
    for d, p in zip(fed.devices, plain.devices, strict=True):
        assert len(d.y_val) == max(1, round(0.1 * len(p.y_train))) == len(d.x_val)
        assert len(d.y_train) + len(d.y_val) == len(p.y_train)
        assert torch.equal(d.x_test, p.x_test) and torch.equal(d.y_test, p.y_test)
        train, val, test = rows(d.x_train), rows(d.x_val), rows(d.x_test)
        assert not set(val) & set(train) and not set(val) & set(test)
        assert sorted(train + val) == sorted(rows(p.x_train))
        assert d.x_val.is_contiguous() and d.x_val.dtype == torch.float32 and d.y_val.dtype == torch.int64


def test_device_data_defaults_and_node_plumbing(tmp_path):
    fed = build_federation({**SYNTH, "partition": "clusterwise", "cluster_classes": 3, "val_fraction": 0.2},
                           RANDOM_4X10, seed=0)
    data = fed.devices[0]
    from hfl.data import DeviceData

    bare = DeviceData(0, data.x_train, data.y_train, data.x_test, data.y_test)  # the old constructor still works
    assert bare.x_val.shape == (0, 60) and bare.y_val.shape == (0,) and bare.y_val.dtype == torch.int64
    local = device_data({"algorithm": {"local_labels": True}}, fed, 0)
    classes = torch.tensor(fed.device_classes[0])
    for split in ("y_train", "y_val", "y_test"):
        assert torch.equal(classes[getattr(local, split)], getattr(data, split)), split
    assert local.x_val is data.x_val
    assert device_data({"algorithm": {"local_labels": False}}, fed, 0) is data
    trainer = LocalTrainer(build_model({"name": "mclr"}, fed.input_shape, fed.num_classes))
    dev = device_runtime({"dataset": {"batch_size": 8}, "seed": 0}, 0, data, trainer, StateStore(tmp_path))
    assert torch.equal(dev.x_val, data.x_val) and torch.equal(dev.y_val, data.y_val) and len(dev.y_val) > 0
    old = DeviceRuntime(0, data.x_train, data.y_train, data.x_test, data.y_test, trainer, BatchSampler(4, 2, 0))
    assert old.x_val.shape == (0, 60) and old.y_val.dtype == torch.int64


# ---------------------------------------------------------------- cluster-wise (c, K)
@pytest.mark.parametrize(("clusters", "per_cluster", "num_classes"),
                         [(5, 3, 10), (5, 2, 10), (5, 10, 10), (3, 7, 10), (5, 30, 100), (5, 20, 100), (4, 50, 200)])
def test_cluster_classes_are_distinct_shared_only_when_needed_and_even(clusters, per_cluster, num_classes):
    for seed in range(5):
        dealt = deal_cluster_classes(clusters, per_cluster, num_classes, seed)
        assert len(dealt) == clusters
        assert all(len(set(cs)) == per_cluster == len(cs) and cs == sorted(cs) for cs in dealt)
        assert all(0 <= c < num_classes for cs in dealt for c in cs)
        uses = Counter(c for cs in dealt for c in cs)
        if clusters * per_cluster <= num_classes:  # enough classes: clusters are disjoint
            assert max(uses.values()) == 1
        else:  # K*c > C: every class is dealt, some to several clusters, evenly
            assert len(uses) == num_classes and max(uses.values()) >= 2
            assert max(uses.values()) - min(uses.values()) <= 1
        assert deal_cluster_classes(clusters, per_cluster, num_classes, seed) == dealt
    assert any(deal_cluster_classes(clusters, per_cluster, num_classes, s) != dealt for s in range(5, 10)) or \
        per_cluster == num_classes


def test_cluster_classes_refusals_name_the_key():
    for c in (0, 11):
        with pytest.raises(ConfigError) as err:
            deal_cluster_classes(5, c, 10, 0)
        assert err.value.key == "dataset.cluster_classes"


def test_clusterwise_cluster_sizes_unequal_at_least_two_contiguous_and_seeded():
    for seed in range(10):
        clusters = clusterwise_clusters(50, 5, seed)
        sizes = Counter(clusters)
        assert sorted(sizes) == [0, 1, 2, 3, 4] and sum(sizes.values()) == 50
        assert min(sizes.values()) >= 2
        assert len(set(sizes.values())) > 1  # unequal (Dirichlet(1) split: equal sizes are a ~1e-4 event)
        assert clusters == sorted(clusters)  # contiguous blocks of device ids
        assert clusterwise_clusters(50, 5, seed) == clusters
    assert clusterwise_clusters(50, 5, 0) != clusterwise_clusters(50, 5, 1)
    assert clusterwise_clusters(10, 5, 3) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # exactly 2 each when it must
    with pytest.raises(ConfigError) as err:
        clusterwise_clusters(9, 5, 0)
    assert err.value.key == "dataset.num_clusters"


def test_partition_among_owners_is_disjoint_complete_and_seeded_per_class():
    labels = balanced_labels([400] * 10)
    owned = [[0, 1], [1, 2], [1], [3], [3, 0]]  # classes 4..9 nobody owns
    parts = partition_among_owners(labels, owned, seed=0)
    everything = np.concatenate(parts)
    assert len(everything) == len(np.unique(everything))
    assert sorted(everything.tolist()) == np.flatnonzero(np.isin(labels, [0, 1, 2, 3])).tolist()
    for device, idx in enumerate(parts):
        counts = Counter(labels[idx].tolist())
        assert set(counts) == set(owned[device])
        # Dirichlet(10): every owner gets a real share (mean 1/owners, sd at most ~25% of it)
        for c, n in counts.items():
            owners = sum(c in cs for cs in owned)
            assert 0.25 * 400 / owners < n < 1.75 * 400 / owners
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition_among_owners(labels, owned, seed=0)))
    assert any(not np.array_equal(a, b) for a, b in zip(parts, partition_among_owners(labels, owned, seed=1)))
    # a class's split depends on its own stream only: changing class 3's owners leaves class 1 alone
    other = partition_among_owners(labels, [[0, 1], [1, 2], [1], [3], [0]], seed=0)
    for a, b in zip(parts, other):
        assert np.array_equal(a[labels[a] == 1], b[labels[b] == 1])


def test_clusterwise_federation_structure():
    fed = build_federation({**SYNTH, "partition": "clusterwise", "num_clusters": 5, "cluster_classes": 3},
                           RANDOM_5X10, seed=4)
    assert len(fed.devices) == 50 and all(len(path) == 1 for path in fed.device_clusters)
    by_cluster: dict[int, set] = {}
    for d, (path, classes) in enumerate(zip(fed.device_clusters, fed.device_classes, strict=True)):
        by_cluster.setdefault(path[0], set()).add(tuple(classes))
        data = fed.devices[d]
        held = set(data.y_train.tolist()) | set(data.y_test.tolist())
        assert held <= set(classes) and len(classes) == 3
    assert sorted(by_cluster) == [0, 1, 2, 3, 4] and all(len(v) == 1 for v in by_cluster.values())
    assert min(Counter(p[0] for p in fed.device_clusters).values()) >= 2
    assert len({c for v in by_cluster.values() for cs in v for c in cs}) == 10  # 5 x 3 > 10: all dealt, shared
    again = build_federation({**SYNTH, "partition": "clusterwise", "num_clusters": 5, "cluster_classes": 3},
                             RANDOM_5X10, seed=4)
    assert same_devices(fed, again) and again.device_clusters == fed.device_clusters
    with pytest.raises(ConfigError) as err:
        build_federation({**SYNTH, "partition": "clusterwise", "num_clusters": 21}, RANDOM_4X10, seed=0)
    assert err.value.key == "dataset.num_clusters"
    with pytest.raises(ConfigError) as err:
        build_federation({**SYNTH, "partition": "clusterwise", "cluster_classes": 11}, RANDOM_4X10, seed=0)
    assert err.value.key == "dataset.cluster_classes"


@pytest.mark.skipif(not (REAL_DATA / "MNIST" / "raw").is_dir(), reason="shared MNIST test split absent")
def test_clusterwise_on_real_mnist_with_validation():
    cfg = {"name": "mnist", "root": str(REAL_DATA), "partition": "clusterwise", "num_clusters": 5,
           "cluster_classes": 2, "val_fraction": 0.1, "train_fraction": 0.8}
    fed = build_federation(cfg, {**RANDOM_5X10, "num_teams": 2}, seed=0)
    assert len(fed.devices) == 20
    classes = sorted({c for cs in fed.device_classes for c in cs})
    assert classes == list(range(10))  # 5 x 2 = 10: disjoint, every class dealt once
    total = 0
    for d, cs in zip(fed.devices, fed.device_classes, strict=True):
        assert set(torch.cat([d.y_train, d.y_val, d.y_test]).tolist()) == set(cs)
        assert d.x_val.shape[1:] == (1, 28, 28) and len(d.y_val) >= 1
        total += len(d.y_train) + len(d.y_val) + len(d.y_test)
    assert total == 10_000  # every MNIST test image, each on one device


# ---------------------------------------------------------------- multi-level [a, b, c]
def test_multilevel_class_counts_rule():
    assert multilevel_class_counts(100, [3, 6, 11]) == [14, 6, 2]  # the paper's Table C.1
    for classes, levels in [(100, [2, 5, 9]), (10, [2, 4]), (62, [3, 6, 11]), (200, [9, 15, 22]), (10, [3]),
                            (100, [1, 2, 4, 8])]:
        counts = multilevel_class_counts(classes, levels)
        used = sum(m * n for m, n in zip(counts, levels))
        assert used <= classes and classes - used < min(levels)  # nothing left that a level could still take
        assert counts == sorted(counts, reverse=True)  # coarser levels hold more classes per cluster


@pytest.mark.parametrize(("num_devices", "num_classes", "levels"),
                         [(50, 100, [3, 6, 11]), (50, 100, [2, 5, 9]), (40, 10, [2, 4]), (24, 62, [3, 6, 12]),
                          (8, 10, [1, 4])])
def test_multilevel_nesting_disjoint_classes_and_paths(num_devices, num_classes, levels):
    clusters, classes = multilevel_structure(num_devices, num_classes, levels, seed=3)
    counts = multilevel_class_counts(num_classes, levels)
    assert len(clusters) == num_devices and all(len(p) == len(levels) for p in clusters)
    for level, n in enumerate(levels):
        assert sorted({p[level] for p in clusters}) == list(range(n))  # every cluster has devices
        assert len(classes[level]) == n and all(len(cs) == counts[level] for cs in classes[level])
    flat = [c for level in classes for cs in level for c in cs]
    assert len(flat) == len(set(flat))  # disjoint within and across levels
    # nesting: a finer cluster has one parent at every coarser level ...
    parent: dict[tuple[int, int], int] = {}
    for path in clusters:
        for level in range(1, len(levels)):
            assert parent.setdefault((level, path[level]), path[level - 1]) == path[level - 1]
    # ... the contiguous block of block_of (nested-divisible or not) ...
    for (level, k), up in parent.items():
        assert up == block_of(k, levels[level], levels[level - 1])
    # ... and the finest clusters are contiguous device blocks of >= 2 devices
    assert [p[-1] for p in clusters] == [block_of(d, num_devices, levels[-1]) for d in range(num_devices)]
    assert min(Counter(p[-1] for p in clusters).values()) >= 2
    union = path_classes(clusters, classes)
    for path, mine in zip(clusters, union, strict=True):
        assert mine == sorted(c for level, k in enumerate(path) for c in classes[level][k])
        assert len(mine) == sum(counts)
    assert multilevel_structure(num_devices, num_classes, levels, seed=3) == (clusters, classes)
    assert multilevel_structure(num_devices, num_classes, levels, seed=4)[1] != classes


def test_multilevel_explicit_level_classes_reproduce_table_c1():
    _, classes = multilevel_structure(50, 100, [2, 5, 9], seed=0, level_classes=[19, 7, 3])
    assert [len(level[0]) for level in classes] == [19, 7, 3]
    assert len({c for level in classes for cs in level for c in cs}) == 100


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"level_clusters": [4, 2]}, "dataset.level_clusters"),  # finer level with fewer clusters
        ({"level_clusters": [2, 21]}, "dataset.level_clusters"),  # 40 devices < 2 per finest cluster
        ({"level_clusters": [3, 6, 11]}, "dataset.level_clusters"),  # 10 classes cannot fill 20 clusters
        ({"level_clusters": []}, "dataset.level_clusters"),
        ({"level_clusters": [2, 0]}, "dataset.level_clusters"),
        ({"level_clusters": [2, 4], "level_classes": [3]}, "dataset.level_classes"),  # wrong length
        ({"level_clusters": [2, 4], "level_classes": [3, 2]}, "dataset.level_classes"),  # 14 > 10 classes
    ],
)
def test_multilevel_refusals_name_the_key(kwargs, key):
    with pytest.raises(ConfigError) as err:
        build_federation({**SYNTH, "partition": "multilevel", **kwargs}, RANDOM_4X10, seed=0)
    assert err.value.key == key


def test_multilevel_federation_records_the_structure():
    cfg = {**SYNTH, "partition": "multilevel", "level_clusters": [2, 4], "val_fraction": 0.1}
    fed = build_federation(cfg, RANDOM_4X10, seed=0)
    clusters, classes = multilevel_structure(40, 10, [2, 4], seed=0)
    assert fed.device_clusters == clusters and fed.device_classes == path_classes(clusters, classes)
    for d, cs in zip(fed.devices, fed.device_classes, strict=True):
        assert set(torch.cat([d.y_train, d.y_val, d.y_test]).tolist()) <= set(cs)
    assert build_federation({**SYNTH, "partition": "iid"}, RANDOM_4X10, seed=0).device_clusters is None


def test_synthetic_multilevel_natural_records_its_blocks():
    fed = build_federation({**MULTI, "partition": "natural"}, RANDOM_4X10, seed=0)
    assert fed.device_clusters == [[block_of(d, 40, 2), block_of(d, 40, 4)] for d in range(40)]


# ---------------------------------------------------------------- Dirichlet minimum size
def test_dirichlet_min_samples_per_device():
    # FeMAM's client-wise setting in small: alpha 0.1 over many classes, every device >= 100 samples
    labels = balanced_labels([60] * 100)
    plain = partition_dirichlet(labels, 30, alpha=0.1, seed=2)
    assert min(len(p) for p in plain) < 100  # the first draw is too small: the minimum forces redraws
    parts = partition_dirichlet(labels, 30, alpha=0.1, seed=2, min_size=100)
    assert min(len(p) for p in parts) >= 100
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(6000))
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition_dirichlet(labels, 30, 0.1, seed=2, min_size=100)))
    with pytest.raises(ConfigError) as err:  # 30 x 250 > 6000: no draw can succeed
        partition_dirichlet(labels, 30, alpha=0.1, seed=0, min_size=250)
    assert err.value.key == "dataset.min_samples_per_device"


def test_dirichlet_min_samples_default_changes_nothing():
    dataset = {**SYNTH, "partition": "dirichlet"}
    assert same_devices(build_federation(dataset, RANDOM_4X10, seed=1),
                        build_federation({**dataset, "min_samples_per_device": 2}, RANDOM_4X10, seed=1))
    fed = build_federation({**dataset, "min_samples_per_device": 30}, RANDOM_4X10, seed=1)
    assert min(len(d.y_train) + len(d.y_test) for d in fed.devices) >= 30
    with pytest.raises(ConfigError) as err:
        build_federation({**dataset, "min_samples_per_device": 1}, RANDOM_4X10, seed=1)
    assert err.value.key == "dataset.min_samples_per_device"


# ---------------------------------------------------------------- ResNet-9
def test_resnet9_shape_log_softmax_and_parameter_count():
    torch.manual_seed(0)
    model = build_model({"name": "resnet9"}, (3, 32, 32), 100)
    out = model(torch.randn(5, 3, 32, 32))
    assert out.shape == (5, 100)
    torch.testing.assert_close(out.exp().sum(1), torch.ones(5))  # log-probabilities, as the other models
    count = sum(p.numel() for p in model.parameters())
    # By hand: stem 216 + BN 16; blocks 1,184 + 3,680 + 14,528 + 57,728; head 6,500 = 83,852.
    # The notes' "~84k" is that figure rounded to thousands, so +-500 is the tolerance it allows.
    assert count == 83_852 and abs(count - 84_000) <= 500
    names = [n for n, _ in model.named_parameters()]
    assert names[-2:] == ["head.weight", "head.bias"]  # BodyHead: the head is last (FedRep/FedPer/FeMAM features)
    mnist = build_model({"name": "resnet9"}, (1, 28, 28), 10)  # adaptive pooling: 28x28 works too
    assert mnist(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    loss = torch.nn.functional.nll_loss(mnist(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in mnist.parameters())
    # trainable: its 24 BatchNorm running statistics travel with the parameters (tests/test_batchnorm.py)
    assert sum(LocalTrainer(mnist).buffer_mask) == 24


def test_resnet9_refuses_non_image_inputs():
    with pytest.raises(ConfigError) as err:
        build_model({"name": "resnet9"}, (60,), 10)
    assert err.value.key == "model.name" and "resnet9" in str(err.value)


# ---------------------------------------------------------------- config keys
def test_new_keys_compose_and_wrong_types_are_refused():
    from hydra.errors import ConfigCompositionException

    from hfl.config import schema

    cfg = compose_cfg("dataset.partition=clusterwise", "dataset.cluster_classes=3", "dataset.val_fraction=0.1",
                      "dataset.level_clusters=[3,6,11]", "dataset.level_classes=[14,6,2]", "model=resnet9",
                      "dataset=cifar10", "dataset.min_samples_per_device=100")
    assert cfg["dataset"]["cluster_classes"] == 3 and cfg["dataset"]["level_clusters"] == [3, 6, 11]
    assert cfg["model"] == {"name": "resnet9"}
    for name in ("synthetic", "synthetic_multilevel", "mnist", "fmnist", "emnist_digits", "emnist_byclass", "cifar10"):
        data = compose_cfg(f"dataset={name}")["dataset"]
        assert data["val_fraction"] == 0.0 and data["num_clusters"] == 5 and data["min_samples_per_device"] == 2
        assert data["level_classes"] is None
    for override, message in [
        ("dataset.cluster_classes=abc", "dataset.cluster_classes: must be an integer, got 'abc'"),
        ("dataset.val_fraction=lots", "dataset.val_fraction: must be a number, got 'lots'"),
        ("dataset.num_clusters=1.5", "dataset.num_clusters: must be an integer, got 1.5"),
        ("dataset.level_clusters=[2,x]", "dataset.level_clusters[1]: must be an integer, got 'x'"),
    ]:
        with pytest.raises(ConfigCompositionException) as caught:
            compose_cfg(override)
        assert str(schema.config_error(caught.value)) == message


def test_cli_cfg_job_with_clusterwise():
    job = subprocess.run([sys.executable, "-m", "hfl.runtime.simulate", "--cfg", "job", "dataset.partition=clusterwise",
                          "dataset.cluster_classes=3"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         check=True).stdout
    dataset = yaml.safe_load(job)["dataset"]
    assert dataset["partition"] == "clusterwise" and dataset["cluster_classes"] == 3
