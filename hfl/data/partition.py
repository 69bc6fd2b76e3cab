"""Splitting a pooled dataset among devices, and each device's data into train/test.

Every function returns, per device, an array of indices into the pooled dataset; no
index appears in two devices.
"""

from __future__ import annotations

import warnings

import numpy as np

from hfl.data.multilevel import block_of
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


def owners_of(device_classes: list[list[int]]) -> dict[int, list[int]]:
    """Class -> the devices owning it, in device-id order."""
    holders: dict[int, list[int]] = {}
    for device, classes in enumerate(device_classes):
        for c in classes:
            holders.setdefault(int(c), []).append(device)
    return holders


def partition_roundrobin(labels: np.ndarray, device_classes: list[list[int]], seed: int) -> list[np.ndarray]:
    """Deal each class's shuffled samples one at a time over its owners in device-id order.

    Owners of a class get counts differing by at most one; every sample of an owned class is
    used, classes nobody owns are dropped.
    """
    holders = owners_of(device_classes)
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

    ``min_size`` (``dataset.min_samples_per_device``) defaults to 2, the least a device needs
    for one train and one test sample (FeMAM's client-wise partition uses 100); flwr-datasets
    redraws from its seeded generator (11 draws at most) until every device has that many, and
    the last failure becomes a ConfigError.
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
    except ValueError as exc:  # raised after 11 draws that leave some device too small
        key = "dataset.dirichlet_alpha" if min_size <= 2 else "dataset.min_samples_per_device"
        raise ConfigError(
            key,
            f"alpha={alpha} over {num_devices} devices ({len(labels)} samples) leaves some device with fewer than "
            f"{min_size} samples after 11 seeded draws ({exc}); raise dataset.dirichlet_alpha, lower "
            f"dataset.min_samples_per_device or use fewer devices",
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


def split_train_val_test(
    indices: np.ndarray, train_fraction: float, val_fraction: float, seed: int, device_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``split_train_test``, then ``val_fraction`` of the training part carved off as validation.

    The validation part has ``round(n_train * val_fraction)`` samples but at least one when
    ``val_fraction > 0`` (every device then has a validation loss), drawn with the device's own
    stream ``rng(seed, "split", "val", device_id)``; the rest of the training part keeps its
    order. With ``val_fraction == 0`` train and test are exactly ``split_train_test``'s and the
    validation part is empty. A device left with no training sample is refused
    (``ConfigError`` naming ``dataset.val_fraction``).
    """
    train, test = split_train_test(indices, train_fraction, seed, device_id)
    if val_fraction <= 0:
        return train, train[:0], test
    n = len(train)
    n_val = max(int(round(n * val_fraction)), 1)
    if n - n_val < 1:
        raise ConfigError(
            "dataset.val_fraction",
            f"is {val_fraction}: device {device_id} has {n} training sample(s) before the validation split "
            f"and would keep none after it (a validation split takes at least 1); lower dataset.val_fraction, "
            f"raise dataset.train_fraction or give the devices more data",
        )
    order = rng(seed, "split", "val", device_id).permutation(n)
    return train[np.sort(order[n_val:])], train[np.sort(order[:n_val])], test


# ---------------------------------------------------------------- FeMAM's partitions
def partition_among_owners(
    labels: np.ndarray, device_classes: list[list[int]], seed: int, concentration: float = 10.0
) -> list[np.ndarray]:
    """Split each class's samples among the devices owning it by Dirichlet(concentration)
    proportions (FeMAM's cluster-wise and multi-level partitions use 10).

    One stream per class, ``rng(seed, "partition", "owners", c)`` (the class id seeds the
    proportions and the shuffle); counts are cut by cumulative flooring, so every sample of an
    owned class goes to exactly one owner. Classes nobody owns are dropped.
    """
    holders = owners_of(device_classes)
    parts: list[list[np.ndarray]] = [[] for _ in device_classes]
    for c in sorted(holders):
        devices = holders[c]
        g = rng(seed, "partition", "owners", c)
        idx = np.flatnonzero(labels == c)
        g.shuffle(idx)
        shares = g.dirichlet(np.full(len(devices), float(concentration)))
        cuts = np.floor(np.cumsum(shares) * len(idx)).astype(np.int64)
        cuts[-1] = len(idx)
        for device, chunk in zip(devices, np.split(idx, cuts[:-1]), strict=True):
            parts[device].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts]


def deal_cluster_classes(num_clusters: int, cluster_classes: int, num_classes: int, seed: int) -> list[list[int]]:
    """FeMAM's cluster-wise class dealing: each cluster takes ``cluster_classes`` distinct
    classes from a queue filled with a seeded permutation of the classes and refilled with a
    fresh one when exhausted; a cluster skips a queued class it already holds (which stays
    first in line for the next cluster). So clusters are disjoint while the classes last and
    share classes when ``num_clusters * cluster_classes > num_classes``. Sorted per cluster."""
    if not 1 <= cluster_classes <= num_classes:
        raise ConfigError("dataset.cluster_classes", f"must be in 1..{num_classes} (the dataset's classes), "
                                                     f"got {cluster_classes}")
    g = rng(seed, "partition", "clusterwise", "classes")
    queue: list[int] = []
    out: list[list[int]] = []
    for _ in range(num_clusters):
        chosen: list[int] = []
        while len(chosen) < cluster_classes:
            pick = next((i for i, c in enumerate(queue) if c not in chosen), None)
            if pick is None:  # a fresh permutation holds every class, so some class is new
                queue.extend(int(c) for c in g.permutation(num_classes))
                continue
            chosen.append(queue.pop(pick))
        out.append(sorted(chosen))
    return out


def clusterwise_clusters(num_devices: int, num_clusters: int, seed: int) -> list[int]:
    """Each device's cluster in FeMAM's cluster-wise partition: contiguous blocks of device ids
    of random, generally unequal sizes, at least 2 devices each (2 per cluster plus a
    multinomial share of the rest with Dirichlet(1) weights, i.e. uniformly random sizes)."""
    if num_clusters < 1:
        raise ConfigError("dataset.num_clusters", f"must be >= 1, got {num_clusters}")
    if num_devices < 2 * num_clusters:
        raise ConfigError("dataset.num_clusters", f"is {num_clusters}: every cluster needs at least 2 devices, "
                                                  f"the topology has {num_devices}; lower it or use more devices")
    g = rng(seed, "partition", "clusterwise", "sizes")
    sizes = 2 + g.multinomial(num_devices - 2 * num_clusters, g.dirichlet(np.ones(num_clusters)))
    return np.repeat(np.arange(num_clusters), sizes).tolist()


def multilevel_class_counts(num_classes: int, level_clusters: list[int]) -> list[int]:
    """Classes per cluster at each level of FeMAM's multi-level partition (our rule; the
    paper's Table C.1 gives hand-picked counts only).

    Level l of L (1 = coarsest) gets a share of the classes proportional to ``L + 2 - l``
    (coarser levels, shared by more clients, hold more classes: the paper's "more basic
    concepts are more commonly shared"; 4:3:2 for three levels). Each of its n_l clusters first
    gets ``floor(share / n_l)`` classes; then, while classes are left, the level whose share
    exceeds its dealt classes the most among those with n_l classes still to give gets one more
    class per cluster (largest remainder). 100 classes and [3, 6, 11] give 14 / 6 / 2 (all 100
    used); [2, 5, 9] gives 23 / 7 / 2 (99 used; the paper's table uses 19 / 7 / 3).
    """
    depth = len(level_clusters)
    weights = np.array([depth + 2 - level for level in range(1, depth + 1)], dtype=np.float64)
    shares = weights / weights.sum() * num_classes
    counts = [int(s // n) for s, n in zip(shares, level_clusters, strict=True)]
    left = num_classes - sum(m * n for m, n in zip(counts, level_clusters, strict=True))
    while True:
        fits = [lv for lv, n in enumerate(level_clusters) if n <= left]
        if not fits:
            return counts
        lv = max(fits, key=lambda i: (shares[i] - counts[i] * level_clusters[i], -i))
        counts[lv] += 1
        left -= level_clusters[lv]


def check_level_clusters(level_clusters, num_devices: int) -> list[int]:
    """``dataset.level_clusters``: a non-empty list of positive cluster counts, coarse to fine,
    non-decreasing (each finer cluster has one parent), at least 2 devices per finest cluster."""
    if isinstance(level_clusters, str | bytes) or not hasattr(level_clusters, "__len__") or not level_clusters:
        raise ConfigError("dataset.level_clusters", f"must be a non-empty list of cluster counts, got {level_clusters!r}")
    if any(isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1 for n in level_clusters):
        raise ConfigError("dataset.level_clusters", f"must be positive integers, got {list(level_clusters)!r}")
    counts = [int(n) for n in level_clusters]
    for coarse, fine in zip(counts, counts[1:]):
        if fine < coarse:
            raise ConfigError("dataset.level_clusters", f"levels go coarse to fine: {fine} clusters cannot nest "
                                                        f"under {coarse} (got {counts})")
    if num_devices < 2 * counts[-1]:
        raise ConfigError("dataset.level_clusters", f"the finest level has {counts[-1]} clusters and each needs at "
                                                    f"least 2 devices; the topology has {num_devices}")
    return counts


def multilevel_structure(
    num_devices: int, num_classes: int, level_clusters: list[int], seed: int, level_classes: list[int] | None = None
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """FeMAM's multi-level partition: nested clusters with disjoint class sets.

    Returns ``(device_clusters, cluster_classes)``: ``device_clusters[d][l]`` is device d's
    cluster at level l, ``cluster_classes[l][k]`` the classes of cluster k of level l.

    Nesting by contiguous blocks (``hfl.data.multilevel.block_of``): device d is in finest
    cluster ``block_of(d, num_devices, n_L)`` (sizes differ by at most one, >= 2 each) and
    cluster j of level l+1 lies in cluster ``block_of(j, n_{l+1}, n_l)`` of level l, whether
    or not n_l divides n_{l+1}. Classes: a seeded permutation is cut into consecutive blocks,
    level 1's clusters first, each cluster of level l taking ``level_classes[l]`` classes
    (default ``multilevel_class_counts``), so every class belongs to at most one cluster of
    one level; classes left over are used by nobody. A device's classes are the union along its
    path (see ``path_classes``).
    """
    counts = check_level_clusters(level_clusters, num_devices)
    if level_classes is None:
        per_cluster = multilevel_class_counts(num_classes, counts)
    else:
        if not isinstance(level_classes, list | tuple) or len(level_classes) != len(counts) or any(
            isinstance(m, bool) or not isinstance(m, int | np.integer) or m < 1 for m in level_classes
        ):
            raise ConfigError("dataset.level_classes", f"must be null or {len(counts)} positive integers (classes per "
                                                       f"cluster, one per level of dataset.level_clusters), "
                                                       f"got {level_classes!r}")
        per_cluster = [int(m) for m in level_classes]
    needed = sum(m * n for m, n in zip(per_cluster, counts, strict=True))
    if needed > num_classes or min(per_cluster) < 1:
        key = "dataset.level_clusters" if level_classes is None else "dataset.level_classes"
        raise ConfigError(key, f"clusters {counts} with {per_cluster} classes each need {needed} distinct classes and "
                               f"at least one per cluster; the dataset has {num_classes}")
    order = rng(seed, "partition", "multilevel", "classes").permutation(num_classes)
    cluster_classes: list[list[list[int]]] = []
    start = 0
    for m, n in zip(per_cluster, counts, strict=True):
        cluster_classes.append([sorted(int(c) for c in order[start + k * m : start + (k + 1) * m]) for k in range(n)])
        start += m * n
    device_clusters = []
    for d in range(num_devices):
        path = [block_of(d, num_devices, counts[-1])]
        for level in range(len(counts) - 1, 0, -1):
            path.insert(0, block_of(path[0], counts[level], counts[level - 1]))
        device_clusters.append(path)
    return device_clusters, cluster_classes


def path_classes(device_clusters: list[list[int]], cluster_classes: list[list[list[int]]]) -> list[list[int]]:
    """Each device's classes: the union of its clusters' classes along its path, sorted."""
    return [sorted({c for level, k in enumerate(path) for c in cluster_classes[level][k]}) for path in device_clusters]
