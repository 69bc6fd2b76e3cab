"""Data layer: partitions, synthetic data, vision loaders, build_federation."""

from __future__ import annotations

import gzip
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from hfl.data import build_federation, synthetic, vision
from hfl.data.partition import (
    classes_of_devices,
    partition_by_classes,
    partition_dirichlet,
    partition_iid,
    split_train_test,
)
from hfl.errors import ConfigError, DatasetNotFoundError

REAL_DATA = Path(__file__).parents[1] / ".." / "shared" / "data"
RANDOM4 = {"formation": "random", "num_teams": 2, "devices_per_team": 2, "team_labels": None, "teams": None}
SYNTH = {"name": "synthetic", "num_features": 60, "num_classes": 10, "min_samples": 50, "partition": "natural"}


def balanced_labels(per_class: list[int]) -> np.ndarray:
    """Labels with per_class[c] samples of class c, interleaved (as a real dataset is)."""
    labels = np.concatenate([np.full(n, c) for c, n in enumerate(per_class)])
    return np.random.default_rng(0).permutation(labels).astype(np.int64)


# ---------------------------------------------------------------- classes partition
def test_classes_of_devices_follow_pfedme_rule():
    assert classes_of_devices(4, 10, 2) == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert classes_of_devices(12, 10, 3)[9] == [9, 0, 1]
    # by_label: the j-th device of team t cycles through team_labels[t]
    teams = [[0, 1, 2], [3, 4, 5]]
    got = classes_of_devices(6, 10, 2, teams, [[0, 1, 2, 3, 4], [7, 9]])
    assert got == [[0, 1], [1, 2], [2, 3], [7, 9], [9, 7], [7, 9]]


def test_classes_partition_gives_exactly_the_assigned_classes():
    labels = balanced_labels([300] * 10)
    assigned = classes_of_devices(20, 10, 2)
    parts = partition_by_classes(labels, assigned, min_per_class=10, size_sigma=2.0, seed=1)
    for device, idx in enumerate(parts):
        counts = Counter(labels[idx].tolist())
        assert set(counts) == set(assigned[device])
        assert min(counts.values()) >= 10  # the seed samples per class


def test_every_sample_of_used_classes_in_exactly_one_device():
    labels = balanced_labels([50, 60, 70, 80, 90, 100, 110, 120, 130, 140])
    # 5 devices x 1 class: classes 0..4 used, 5..9 unused
    parts = partition_by_classes(labels, classes_of_devices(5, 10, 1), 10, 2.0, seed=3)
    everything = np.concatenate(parts)
    assert len(everything) == len(np.unique(everything))  # disjoint
    assert set(everything.tolist()) == set(np.flatnonzero(labels < 5).tolist())
    # class c appears in two devices when k=2: still disjoint and covering
    parts = partition_by_classes(labels, classes_of_devices(10, 10, 2), 10, 2.0, seed=3)
    everything = np.concatenate(parts)
    assert np.array_equal(np.sort(everything), np.arange(len(labels)))


def test_classes_partition_is_seeded():
    labels = balanced_labels([400] * 10)
    assigned = classes_of_devices(40, 10, 2)
    a = partition_by_classes(labels, assigned, 10, 2.0, seed=7)
    b = partition_by_classes(labels, assigned, 10, 2.0, seed=7)
    c = partition_by_classes(labels, assigned, 10, 2.0, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert any(not np.array_equal(x, y) for x, y in zip(a, c))


def test_classes_partition_sizes_follow_power_law_and_sigma_zero_is_even():
    labels = balanced_labels([400] * 10)
    assigned = classes_of_devices(40, 10, 2)  # every class held by 8 devices
    sizes = np.array([len(p) for p in partition_by_classes(labels, assigned, 10, 2.0, seed=0)])
    assert sizes.min() >= 20 and sizes.max() > 5 * sizes.min()  # heavy-tailed
    assert sizes.sum() == 4000
    # sigma = 0: each class's 400 samples split 50 per holder, so every device has 100
    even = [len(p) for p in partition_by_classes(labels, assigned, 10, 0.0, seed=0)]
    assert even == [100] * 40


def test_classes_partition_too_few_samples_names_min_per_class():
    labels = balanced_labels([30] * 10)
    with pytest.raises(ConfigError) as err:
        partition_by_classes(labels, classes_of_devices(40, 10, 2), 10, 2.0, seed=0)  # 8 x 10 > 30
    assert err.value.key == "dataset.min_per_class"
    assert str(err.value).startswith("dataset.min_per_class:")


# ---------------------------------------------------------------- iid / dirichlet / split
def test_iid_partition_equal_disjoint_and_seeded():
    labels = balanced_labels([100] * 10)
    parts = partition_iid(labels, 7, seed=0)
    sizes = [len(p) for p in parts]
    assert sum(sizes) == 1000 and max(sizes) - min(sizes) <= 1
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(1000))
    assert all(np.array_equal(x, y) for x, y in zip(parts, partition_iid(labels, 7, seed=0)))
    assert any(not np.array_equal(x, y) for x, y in zip(parts, partition_iid(labels, 7, seed=1)))


def test_dirichlet_partition_disjoint_seeded_and_skewed():
    labels = balanced_labels([200] * 10)
    parts = partition_dirichlet(labels, 10, alpha=0.1, seed=0)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(2000))
    assert all(np.array_equal(x, y) for x, y in zip(parts, partition_dirichlet(labels, 10, 0.1, seed=0)))
    # small alpha: a device is dominated by few classes
    top_share = [Counter(labels[p].tolist()).most_common(1)[0][1] / len(p) for p in parts]
    assert np.mean(top_share) > 0.4


def test_dirichlet_impossible_names_alpha():
    labels = balanced_labels([2] * 10)
    with pytest.raises(ConfigError) as err:
        partition_dirichlet(labels, 10, alpha=0.01, seed=0, min_size=2)
    assert err.value.key == "dataset.dirichlet_alpha"


def test_split_train_test_fractions():
    idx = np.arange(100, 200)
    train, test = split_train_test(idx, 0.75, seed=0, device_id=3)
    assert (len(train), len(test)) == (75, 25)
    assert np.array_equal(np.sort(np.concatenate([train, test])), idx)
    assert len(split_train_test(np.arange(2), 0.99, 0, 0)[1]) == 1  # clamped: >= 1 test sample
    assert len(split_train_test(np.arange(2), 0.01, 0, 0)[0]) == 1  # and >= 1 train sample
    assert not np.array_equal(train, split_train_test(idx, 0.75, seed=0, device_id=4)[0])


# ---------------------------------------------------------------- synthetic
def test_synthetic_federation_shapes_labels_and_determinism():
    fed = build_federation(SYNTH, RANDOM4, seed=5)
    assert (fed.dataset, fed.input_shape, fed.num_classes) == ("synthetic", (60,), 10)
    assert [d.device_id for d in fed.devices] == [0, 1, 2, 3]
    for d in fed.devices:
        n = len(d.y_train) + len(d.y_test)
        assert n >= 50  # min_samples
        assert len(d.y_train) == round(0.75 * n)
        assert d.x_train.dtype == torch.float32 and d.x_train.shape == (len(d.y_train), 60)
        assert d.x_train.is_contiguous() and d.x_test.is_contiguous()
        assert d.y_train.dtype == torch.int64
        assert 0 <= int(d.y_train.min()) and int(d.y_train.max()) <= 9
    again = build_federation(SYNTH, RANDOM4, seed=5)
    other = build_federation(SYNTH, RANDOM4, seed=6)
    for a, b in zip(fed.devices, again.devices):
        assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert fed.level1_devices == again.level1_devices
    assert not torch.equal(fed.devices[0].x_test[:5], other.devices[0].x_test[:5])


def test_synthetic_sizes_are_power_law():
    params = dict(alpha=0.5, beta=0.5, num_features=60, num_classes=10, size_mean=4.0, size_sigma=2.0,
                  min_samples=50, max_samples=None)
    sizes = [len(y) for _, y in synthetic.generate(30, 0, **params)]
    assert min(sizes) >= 50 and max(sizes) > 5 * min(sizes)
    capped = [len(y) for _, y in synthetic.generate(30, 0, **{**params, "max_samples": 100})]
    assert max(capped) == 100 and capped == [min(s, 100) for s in sizes]


def test_synthetic_covariance_decays_as_j_to_minus_1_2():
    params = dict(alpha=0.5, beta=0.5, num_features=60, num_classes=10, size_mean=0.0, size_sigma=0.0,
                  min_samples=4000, max_samples=None)
    x, y = synthetic.generate_device(0, 0, **params)
    var = x.var(axis=0)
    assert var[0] == pytest.approx(1.0, rel=0.1)  # Sigma_11 = 1
    assert var[59] == pytest.approx(60**-1.2, rel=0.15)  # Sigma_60,60 ~ 0.0074
    assert var[:10].mean() > 5 * var[-10:].mean()


def test_synthetic_repartition_keeps_all_samples():
    pooled = build_federation(SYNTH, RANDOM4, seed=1)
    total = sum(len(d.y_train) + len(d.y_test) for d in pooled.devices)
    iid = build_federation({**SYNTH, "partition": "iid"}, RANDOM4, seed=1)
    sizes = [len(d.y_train) + len(d.y_test) for d in iid.devices]
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
    dirichlet = build_federation({**SYNTH, "partition": "dirichlet", "dirichlet_alpha": 0.5}, RANDOM4, seed=1)
    assert sum(len(d.y_train) + len(d.y_test) for d in dirichlet.devices) == total


# ---------------------------------------------------------------- vision files
def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    data = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    if gz:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def write_mnist(root: Path, split: str, labels: np.ndarray, gz: bool, folder: str = "MNIST", prefix: str = "") -> np.ndarray:
    """Images whose pixels all equal the sample's label * 20 (so values are checkable)."""
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    images = np.repeat((labels * 20).astype(np.uint8), 28 * 28).reshape(-1, 28, 28)
    write_idx(raw / f"{prefix}{split}-images-idx3-ubyte", images, gz)
    write_idx(raw / f"{prefix}{split}-labels-idx1-ubyte", labels, gz)
    return images


def test_idx_loader_pools_plain_train_and_gz_test(tmp_path):
    write_mnist(tmp_path, "train", balanced_labels([30] * 10), gz=False)
    write_mnist(tmp_path, "t10k", balanced_labels([20] * 10), gz=True)
    x, y = vision.load_from_disk("mnist", tmp_path)
    assert x.shape == (500, 1, 28, 28) and x.dtype == np.uint8
    assert np.bincount(y).tolist() == [50] * 10
    assert np.array_equal(x[:, 0, 5, 5], (y * 20).astype(np.uint8))

    cfg = {"name": "mnist", "root": str(tmp_path), "partition": "classes", "classes_per_device": 2,
           "min_per_class": 5, "normalize": [0.5, 0.5]}
    fed = build_federation(cfg, {**RANDOM4, "num_teams": 5}, seed=0)  # 10 devices cover all classes
    assert fed.input_shape == (1, 28, 28) and fed.num_classes == 10
    assert sum(len(d.y_train) + len(d.y_test) for d in fed.devices) == 500
    d = fed.devices[3]
    assert set(d.y_train.tolist()) | set(d.y_test.tolist()) == {3, 4}
    expected = ((d.y_train * 20).float() / 255 - 0.5) / 0.5  # normalize: (x/255 - mean) / std
    assert torch.allclose(d.x_train[:, 0, 0, 0], expected)


def test_idx_loader_uses_gz_only_and_test_only(tmp_path):
    write_mnist(tmp_path, "t10k", balanced_labels([4] * 10), gz=True)
    x, _ = vision.load_from_disk("mnist", tmp_path)
    assert x.shape == (40, 1, 28, 28)
    write_mnist(tmp_path, "train", balanced_labels([3] * 10), gz=False, folder="FashionMNIST")
    assert vision.load_from_disk("fmnist", tmp_path)[0].shape == (30, 1, 28, 28)


def test_emnist_images_are_transposed(tmp_path):
    raw = tmp_path / "EMNIST" / "raw"
    raw.mkdir(parents=True)
    stored = np.zeros((1, 28, 28), np.uint8)
    stored[0, 0, 7] = 255  # row 0, column 7 in the file's (column-major) layout
    write_idx(raw / "emnist-digits-test-images-idx3-ubyte", stored)
    write_idx(raw / "emnist-digits-test-labels-idx1-ubyte", np.array([3]))
    x, y = vision.load_from_disk("emnist_digits", tmp_path)
    assert x[0, 0, 7, 0] == 255 and x[0, 0, 0, 7] == 0 and y.tolist() == [3]


def test_cifar_pickles_and_per_channel_normalize(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    labels = balanced_labels([4] * 10)
    data = np.zeros((40, 3, 32, 32), np.uint8)
    data[:, 0], data[:, 1], data[:, 2] = 0, 51, 255  # red, green, blue planes
    with (folder / "test_batch").open("wb") as f:
        pickle.dump({"data": data.reshape(40, -1), "labels": labels.tolist()}, f)
    cfg = {"name": "cifar10", "root": str(tmp_path), "min_per_class": 1, "classes_per_device": 2,
           "normalize": [[0.0, 0.2, 0.5], [1.0, 0.1, 0.5]]}
    fed = build_federation(cfg, {**RANDOM4, "num_teams": 5}, seed=0)
    x = fed.devices[0].x_train
    assert fed.input_shape == (3, 32, 32) and x.shape[1:] == (3, 32, 32)
    assert torch.allclose(x[0, :, 0, 0], torch.tensor([0.0, (0.2 - 0.2) / 0.1, (1.0 - 0.5) / 0.5]))


def test_missing_root_lists_paths_and_suggests_download(tmp_path):
    with pytest.raises(DatasetNotFoundError) as err:
        build_federation({"name": "mnist", "root": str(tmp_path / "nowhere")}, RANDOM4, seed=0)
    message = str(err.value)
    assert str(tmp_path / "nowhere" / "MNIST" / "raw" / "train-images-idx3-ubyte") in message
    assert str(tmp_path / "nowhere" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte") in message
    assert "dataset.download=true" in message


@pytest.mark.skipif(not (REAL_DATA / "MNIST" / "raw").is_dir(), reason="shared MNIST test split absent")
def test_real_mnist_test_split():
    x, y = vision.load_from_disk("mnist", REAL_DATA)
    assert x.shape == (10000, 1, 28, 28) and np.bincount(y).sum() == 10000
    topo = {"formation": "random", "num_teams": 4, "devices_per_team": 10}
    fed = build_federation({"name": "mnist", "root": str(REAL_DATA)}, topo, seed=0)
    assert sum(len(d.y_train) + len(d.y_test) for d in fed.devices) == 10000
    assert fed.devices[0].x_train.shape[1:] == (1, 28, 28)
    assert -1.0 <= float(fed.devices[0].x_train.min()) and float(fed.devices[0].x_train.max()) <= 1.0


# ---------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    ("dataset", "key", "text"),
    [
        ({"name": "foo"}, "dataset.name", "unknown dataset 'foo'"),
        ({**SYNTH, "partition": "shards"}, "dataset.partition", "unknown partition 'shards'"),
        ({**SYNTH, "partition": "classes", "classes_per_device": 11}, "dataset.classes_per_device", "got 11"),
        ({**SYNTH, "train_fraction": 1.0}, "dataset.train_fraction", "got 1.0"),
        ({**SYNTH, "num_features": 0}, "dataset.num_features", "got 0"),
        ({**SYNTH, "min_samples": 0, "size_mean": -50.0, "size_sigma": 0.0}, "dataset.min_samples", "0 samples"),
        ({"name": "mnist", "partition": "natural"}, "dataset.partition", "only for synthetic"),
        ({"name": "mnist", "root": None}, "dataset.root", "download=true"),
        ({"name": "mnist", "root": "x", "normalize": [0.5, 0.0]}, "dataset.normalize", "std"),
        ({"name": "mnist", "root": "x", "download": "yes"}, "dataset.download", "true or false"),
    ],
)
def test_config_errors_name_the_key(dataset, key, text):
    with pytest.raises(ConfigError) as err:
        build_federation(dataset, RANDOM4, seed=0)
    assert err.value.key == key and str(err.value).startswith(key + ":")
    assert text in str(err.value)


def test_by_label_needs_classes_partition_and_known_labels():
    topo = {"formation": "by_label", "num_teams": 2, "devices_per_team": 2, "team_labels": [[0, 1], [2, 12]]}
    with pytest.raises(ConfigError) as err:
        build_federation(SYNTH, topo, seed=0)
    assert err.value.key == "topology.formation"
    with pytest.raises(ConfigError) as err:
        build_federation({**SYNTH, "partition": "classes"}, topo, seed=0)
    assert err.value.key == "topology.team_labels" and "label 12" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_federation({**SYNTH, "partition": "classes", "classes_per_device": 3},
                         {**topo, "team_labels": [[0, 1], [2, 3]]}, seed=0)
    assert err.value.key == "dataset.classes_per_device"


def test_download_path_pools_splits_and_fixes_layouts(monkeypatch, tmp_path):
    """download=true goes through torchvision's classes (stubbed here: no network in tests)."""
    import torchvision.datasets as tvd

    calls = []

    class FakeCifar:  # torchvision keeps CIFAR images HWC
        def __init__(self, root, train, download):
            calls.append((root, train, download))
            n = 30 if train else 10
            self.data = np.zeros((n, 32, 32, 3), np.uint8)
            self.data[..., 2] = 255
            self.targets = [i % 10 for i in range(n)]

    class FakeEmnist:  # and EMNIST images as stored (column-major)
        def __init__(self, root, split, train, download):
            assert split == "digits"
            self.data = np.zeros((20, 28, 28), np.uint8)
            self.data[:, 0, 7] = 255
            self.targets = np.arange(20) % 10

    monkeypatch.setattr(tvd, "CIFAR10", FakeCifar)
    monkeypatch.setattr(tvd, "EMNIST", FakeEmnist)
    x, y = vision.load("cifar10", tmp_path, download_missing=True)
    assert x.shape == (40, 3, 32, 32) and (x[:, 2] == 255).all() and (x[:, :2] == 0).all()
    assert calls == [(str(tmp_path), True, True), (str(tmp_path), False, True)]
    x, y = vision.load("emnist_digits", tmp_path, download_missing=True)
    assert x.shape == (40, 1, 28, 28) and (x[:, 0, 7, 0] == 255).all() and len(y) == 40


def test_per_feature_standardizer_is_fedprox_z_score():
    from hfl.data.vision import per_feature_standardizer

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(50, 1, 2, 2), dtype=np.uint8)
    images[:, 0, 0, 0] = 7  # a constant pixel (MNIST borders) must map to 0, not blow up
    out = per_feature_standardizer(images)(images)
    assert out.dtype == np.float32 and out.shape == images.shape
    flat = out.reshape(50, -1)
    np.testing.assert_allclose(flat[:, 0], 0.0)
    np.testing.assert_allclose(flat[:, 1:].mean(0), 0.0, atol=1e-5)
    sigma = images.reshape(50, -1)[:, 1:].astype(np.float64).std(0)
    np.testing.assert_allclose(flat[:, 1:].std(0), sigma / (sigma + 0.001), rtol=1e-5)
    # a device's slice uses the pooled statistics, not its own
    np.testing.assert_allclose(per_feature_standardizer(images)(images[:5]), out[:5])


# ---------------------------------------------------------------- trees and proxy data
SMALL_SYNTH = {**SYNTH, "size_mean": 1.0, "size_sigma": 0.5, "min_samples": 20, "max_samples": 60}
RANDOM_4X10 = {"formation": "random", "num_teams": 4, "devices_per_team": 10, "team_labels": None, "teams": None}
TREE_2X2X10 = {"formation": "tree", "fanout": [2, 2, 10], "nodes": None}


def rows(*tensors: torch.Tensor) -> list[bytes]:
    """Every sample (row) of the tensors as bytes, to compare samples across tensors."""
    return [row.numpy().tobytes() for t in tensors for row in t]


def assert_same_devices(a, b) -> None:
    assert len(a.devices) == len(b.devices)
    for da, db in zip(a.devices, b.devices, strict=True):
        assert da.device_id == db.device_id
        for field in ("x_train", "y_train", "x_test", "y_test"):
            assert torch.equal(getattr(da, field), getattr(db, field)), (da.device_id, field)


@pytest.mark.parametrize("partition", ["natural", "classes"])
def test_device_data_does_not_depend_on_the_tree_shape(partition):
    dataset = {**SMALL_SYNTH, "partition": partition, "min_per_class": 2}
    flat = build_federation(dataset, RANDOM_4X10, seed=3)
    deep = build_federation(dataset, TREE_2X2X10, seed=3)
    assert_same_devices(flat, deep)
    assert deep.tree.depth == 3 and flat.tree.depth == 2
    assert deep.level1_devices == deep.tree.level1_devices and flat.level1_devices == flat.tree.level1_devices
    assert len(deep.level1_devices) == 2 and [len(t) for t in deep.level1_devices] == [20, 20]
    # the lowest-level servers of [2, 2, 10] are the teams of random 4 x 10 (regrouped)
    assert sorted(deep.tree.devices(p) for p in deep.tree.nodes_at(2)) == sorted(flat.level1_devices)


def test_federation_tree_for_three_tier_topologies():
    fed = build_federation(SYNTH, RANDOM4, seed=0)
    assert fed.tree.depth == 2 and fed.tree.level1_devices == fed.level1_devices and fed.tree.num_devices == 4
    assert fed.proxy_x is None and fed.proxy_y is None


def test_proxy_fraction_zero_changes_nothing():
    for partition in ("natural", "iid"):
        dataset = {**SMALL_SYNTH, "partition": partition}
        before = build_federation(dataset, RANDOM4, seed=2)
        zero = build_federation({**dataset, "proxy_fraction": 0.0}, RANDOM4, seed=2)
        assert_same_devices(before, zero)
        assert zero.proxy_x is None and zero.proxy_y is None


def test_proxy_pool_is_sized_seeded_and_held_by_no_device():
    base = build_federation(SMALL_SYNTH, RANDOM_4X10, seed=1)
    pool_size = sum(len(d.y_train) + len(d.y_test) for d in base.devices)  # natural: the pool is all devices' data
    fed = build_federation({**SMALL_SYNTH, "proxy_fraction": 0.1}, RANDOM_4X10, seed=1)
    assert len(fed.proxy_y) == round(0.1 * pool_size) == len(fed.proxy_x)
    assert fed.proxy_x.dtype == torch.float32 and fed.proxy_x.shape[1:] == (60,) and fed.proxy_y.dtype == torch.int64
    proxy = rows(fed.proxy_x)
    held = rows(*(t for d in fed.devices for t in (d.x_train, d.x_test)))
    assert len(set(proxy)) == len(proxy) and not set(proxy) & set(held)  # disjoint from every device
    everything = rows(*(t for d in base.devices for t in (d.x_train, d.x_test)))
    assert sorted(proxy + held) == sorted(everything)  # nothing lost, nothing duplicated
    for d_base, d in zip(base.devices, fed.devices, strict=True):  # a device keeps a subset of its samples
        assert set(rows(d.x_train, d.x_test)) <= set(rows(d_base.x_train, d_base.x_test))
        n = len(d.y_train) + len(d.y_test)
        assert len(d.y_train) == round(0.75 * n)
    again = build_federation({**SMALL_SYNTH, "proxy_fraction": 0.1}, TREE_2X2X10, seed=1)  # not the tree shape
    assert torch.equal(again.proxy_x, fed.proxy_x) and torch.equal(again.proxy_y, fed.proxy_y)
    assert_same_devices(again, fed)
    other = build_federation({**SMALL_SYNTH, "proxy_fraction": 0.1}, RANDOM_4X10, seed=2)
    assert not torch.equal(other.proxy_x[:5], fed.proxy_x[:5])


def test_proxy_data_is_seeded_sized_and_split():
    from hfl.data import proxy_data

    fed = build_federation({**SMALL_SYNTH, "proxy_fraction": 0.2}, TREE_2X2X10, seed=0)
    pool = set(rows(fed.proxy_x))
    a = proxy_data(fed, "0.1", size=40, seed=0)
    assert a.device_id == -1
    assert (len(a.y_train), len(a.y_test)) == (30, 10)
    assert a.x_train.shape == (30, 60) and a.x_train.is_contiguous() and a.x_test.is_contiguous()
    samples = rows(a.x_train, a.x_test)
    assert len(set(samples)) == 40 and set(samples) <= pool  # without replacement, from the pool
    b = proxy_data(fed, "0.1", size=40, seed=0)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert set(rows(proxy_data(fed, "1", 40, seed=0).x_train)) != set(rows(a.x_train))  # per-server stream
    assert set(rows(proxy_data(fed, "0.1", 40, seed=1).x_train)) != set(rows(a.x_train))  # seeded
    root = proxy_data(fed, "", size=len(fed.proxy_y), seed=0, train_fraction=0.5)
    assert sorted(rows(root.x_train, root.x_test)) == sorted(pool) and len(root.y_train) == round(0.5 * len(pool))
    with pytest.raises(ValueError, match="pool"):
        proxy_data(fed, "0", size=len(fed.proxy_y) + 1, seed=0)
    with pytest.raises(KeyError, match="'0.5'"):
        proxy_data(fed, "0.5", size=4, seed=0)
    no_pool = build_federation(SMALL_SYNTH, TREE_2X2X10, seed=0)
    with pytest.raises(ValueError, match="proxy_fraction"):
        proxy_data(no_pool, "0", size=4, seed=0)


@pytest.mark.parametrize(("fraction", "text"), [(1.0, "got 1.0"), (-0.1, "got -0.1"), ("0.1", "a number"),
                                                (True, "a number"), (0.95, "device")])
def test_bad_proxy_fraction_names_the_key(fraction, text):
    with pytest.raises(ConfigError) as err:
        build_federation({**SMALL_SYNTH, "proxy_fraction": fraction}, RANDOM_4X10, seed=0)
    assert err.value.key == "dataset.proxy_fraction" and text in str(err.value), str(err.value)


def test_synthetic_size_scale_multiplies_every_devices_samples():
    """dataset.size_scale=5: the PerMFL authors' Synthetic devices, five times FedProx's."""
    from hfl.data.synthetic import generate_device

    params = dict(alpha=0.5, beta=0.5, num_features=60, num_classes=10, size_mean=4.0, size_sigma=2.0,
                  min_samples=50, max_samples=None)
    for device in range(5):
        one = generate_device(0, device, **params)
        five = generate_device(0, device, **params, size_scale=5)
        assert len(five[1]) == 5 * len(one[1])
