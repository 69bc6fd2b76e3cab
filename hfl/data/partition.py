"""Splitting a pooled dataset among devices, and each device's data into train/test.

Every function returns, per device, an array of indices into the pooled dataset; no
index appears in two devices.
"""

from __future__ import annotations

import warnings

import numpy as np

from hfl.errors import ConfigError
from hfl.seed import derive_seed, rng


def classes_of_devices(
    num_devices: int,
    num_classes: int,
    classes_per_device: int,
    teams: list[list[int]] | None = None,
    team_labels: list[list[int]] | None = None,
) -> list[list[int]]:
    """Which classes each device holds (pFedMe/PerMFL ``classes`` partition).

    Without ``team_labels``, device u holds classes ``(u + i) % C`` for ``i < k``.
    With them (formation ``by_label``), the j-th device of team t holds
    ``team_labels[t][(j + i) % len]``: the team's labels are cycled through its devices.
    """
    if team_labels is None:
        return [[(u + i) % num_classes for i in range(classes_per_device)] for u in range(num_devices)]
    assert teams is not None and len(teams) == len(team_labels)
    out: list[list[int]] = [[] for _ in range(num_devices)]
    for team, labels in zip(teams, team_labels, strict=True):
        for j, device in enumerate(team):
            out[device] = [labels[(j + i) % len(labels)] for i in range(classes_per_device)]
    return out


def partition_by_classes(
    labels: np.ndarray,
    device_classes: list[list[int]],
    min_per_class: int,
    size_sigma: float,
    seed: int,
) -> list[np.ndarray]:
    """Give every device the samples of its classes, with power-law sizes.

    For each class, every device holding it first gets ``min_per_class`` samples; the
    rest of the class is split among those devices in proportion to lognormal(0, sigma)
    weights. All samples of a held class are used; classes nobody holds are dropped.
    """
    holders: dict[int, list[int]] = {}
    for device, classes in enumerate(device_classes):
        for c in classes:
            holders.setdefault(c, []).append(device)
    parts: list[list[np.ndarray]] = [[] for _ in device_classes]
    for c in sorted(holders):
        devices = holders[c]
        g = rng(seed, "partition", "classes", c)  # one stream per class: stable if other classes change
        idx = np.flatnonzero(labels == c)
        g.shuffle(idx)
        need = min_per_class * len(devices)
        if len(idx) < need:
            raise ConfigError(
                "dataset.min_per_class",
                f"class {c} has {len(idx)} samples but {len(devices)} devices hold it and each needs "
                f"{min_per_class}; lower dataset.min_per_class or use fewer devices",
            )
        weights = g.lognormal(0.0, size_sigma, size=len(devices))
        rest = len(idx) - need
        # Cumulative flooring splits `rest` exactly (no sample lost or duplicated).
        cuts = np.floor(np.cumsum(weights) / weights.sum() * rest).astype(np.int64)
        cuts[-1] = rest
        counts = np.diff(cuts, prepend=0) + min_per_class
        for device, chunk in zip(devices, np.split(idx, np.cumsum(counts)[:-1]), strict=True):
            parts[device].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts]


def roundrobin_classes(num_devices: int, num_classes: int, classes_per_device: int, seed: int) -> list[list[int]]:
    """Which classes each device holds (PFLEGO's ``roundrobin`` partition), sorted.

    Every device draws ``classes_per_device`` distinct classes at random; then each class
    nobody drew replaces, on a random device, a class that several devices drew, so that
    every class is owned and every device keeps exactly k distinct classes.
    """
    k = classes_per_device
    if not 1 <= k <= num_classes:
        raise ConfigError("dataset.classes_per_device", f"must be in 1..{num_classes}, got {k}")
    if num_devices * k < num_classes:
        raise ConfigError(
            "dataset.classes_per_device",
            f"{num_devices} devices x {k} classes each = {num_devices * k} slots cannot cover all "
            f"{num_classes} classes; raise it or use more devices",
        )
    g = rng(seed, "partition", "roundrobin", "pick")
    owned = [[int(c) for c in g.choice(num_classes, size=k, replace=False)] for _ in range(num_devices)]
    owners = np.bincount(np.concatenate(owned), minlength=num_classes)
    for c in np.flatnonzero(owners == 0):
        # devices*k >= classes, so while some class is unused another is drawn twice (pigeonhole):
        # the slot to give up always exists, and its old class keeps an owner.
        slots = [(d, i) for d, cs in enumerate(owned) for i, old in enumerate(cs) if owners[old] > 1]
        d, i = slots[int(g.integers(len(slots)))]
        owners[owned[d][i]] -= 1
        owned[d][i] = int(c)  # c is unused, so it is new to device d: the k classes stay distinct
        owners[c] += 1
    return [sorted(cs) for cs in owned]


def partition_roundrobin(labels: np.ndarray, device_classes: list[list[int]], seed: int) -> list[np.ndarray]:
    """Deal each class's shuffled samples one at a time over its owners in device-id order.

    Owners of a class get counts differing by at most one; every sample of an owned class is
    used, classes nobody owns are dropped.
    """
    holders: dict[int, list[int]] = {}
    for device, classes in enumerate(device_classes):
        for c in classes:
            holders.setdefault(int(c), []).append(device)
    parts: list[list[np.ndarray]] = [[] for _ in device_classes]
    for c in sorted(holders):
        devices = holders[c]
        idx = np.flatnonzero(labels == c)
        rng(seed, "partition", "roundrobin", "class", c).shuffle(idx)  # one stream per class
        for j, device in enumerate(devices):
            parts[device].append(idx[j :: len(devices)])
    return [np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts]


def partition_iid(labels: np.ndarray, num_devices: int, seed: int) -> list[np.ndarray]:
    """Equal-size random shards (flwr-datasets' IidPartitioner on a seeded shuffle)."""
    from datasets import Dataset
    from flwr_datasets.partitioner import IidPartitioner

    # IidPartitioner cuts contiguous shards, so shuffle first (with our seed).
    order = rng(seed, "partition", "iid").permutation(len(labels))
    partitioner = IidPartitioner(num_partitions=num_devices)
    partitioner.dataset = Dataset.from_dict({"label": labels[order], "index": order})
    return [_indices(partitioner, i) for i in range(num_devices)]


def partition_dirichlet(
    labels: np.ndarray, num_devices: int, alpha: float, seed: int, min_size: int = 2
) -> list[np.ndarray]:
    """Per-class Dirichlet(alpha) shares (flwr-datasets' DirichletPartitioner).

    ``min_size`` defaults to 2, the least a device needs for one train and one test
    sample; flwr-datasets redraws (up to 10 times) until every device has that many.
    """
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    partitioner = DirichletPartitioner(
        num_partitions=num_devices,
        partition_by="label",
        alpha=alpha,
        min_partition_size=min_size,
        self_balancing=False,
        shuffle=True,
        seed=derive_seed(seed, "partition", "dirichlet"),
    )
    partitioner.dataset = Dataset.from_dict({"label": labels, "index": np.arange(len(labels))})
    try:
        with warnings.catch_warnings():
            # flwr-datasets warns on every redraw; failure becomes the ConfigError below.
            warnings.filterwarnings("ignore", category=UserWarning, module="flwr_datasets")
            return [_indices(partitioner, i) for i in range(num_devices)]
    except ValueError as exc:  # raised after 10 draws that leave some device too small
        raise ConfigError(
            "dataset.dirichlet_alpha",
            f"alpha={alpha} over {num_devices} devices leaves some device with fewer than {min_size} "
            f"samples ({exc}); raise the alpha or use fewer devices",
        ) from exc


def _indices(partitioner, partition_id: int) -> np.ndarray:
    part = partitioner.load_partition(partition_id).with_format("numpy")
    return np.sort(np.asarray(part["index"], dtype=np.int64))


def split_train_test(indices: np.ndarray, train_fraction: float, seed: int, device_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle a device's indices and cut ``round(n * train_fraction)`` for training.

    The cut is clamped to leave at least one train and one test sample (needs n >= 2).
    """
    order = rng(seed, "split", device_id).permutation(indices)
    n = len(order)
    n_train = min(max(int(round(n * train_fraction)), 1), n - 1)
    return order[:n_train], order[n_train:]
