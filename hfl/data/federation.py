"""build_federation: dataset + partition + tree formation -> per-device tensors (train, optional
validation, test), the tree and its teams, and the optional proxy pool
(``dataset.proxy_fraction``); proxy_data: a server's proxy samples."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hfl import topology
from hfl.data import multilevel, synthetic, vision
from hfl.data.partition import (
    classes_of_devices,
    clusterwise_clusters,
    deal_cluster_classes,
    multilevel_structure,
    partition_among_owners,
    partition_by_classes,
    partition_dirichlet,
    partition_iid,
    partition_roundrobin,
    path_classes,
    roundrobin_classes,
    split_train_test,
    split_train_val_test,
)
from hfl.config import check_number
from hfl.errors import ConfigError
from hfl.seed import derive_seed, rng
from hfl.tree import Tree

GENERATED = ("synthetic", "synthetic_multilevel")  # made from the seed, nothing on disk
DATASETS = (*GENERATED, *vision.SPECS)
PARTITIONS = ("classes", "clusterwise", "dirichlet", "iid", "multilevel", "natural", "roundrobin")


def validation_or_empty(x_train: torch.Tensor, y_train: torch.Tensor, x_val: torch.Tensor | None,
                        y_val: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation split, or empty tensors shaped and typed like the training split's."""
    if x_val is None:
        x_val = x_train.new_empty((0, *x_train.shape[1:]))
    if y_val is None:
        y_val = y_train.new_empty((0,))
    return x_val, y_val


@dataclass
class DeviceData:
    device_id: int
    x_train: torch.Tensor  # float32, (n_train, *input_shape), contiguous
    y_train: torch.Tensor  # int64, (n_train,)
    x_test: torch.Tensor
    y_test: torch.Tensor
    # Validation split (dataset.val_fraction of the training part); None -> empty, shaped
    # (0, *input_shape) like x_train, with x_train's / y_train's dtypes.
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.x_val, self.y_val = validation_or_empty(self.x_train, self.y_train, self.x_val, self.y_val)


@dataclass
class Federation:
    dataset: str
    input_shape: tuple[int, ...]
    num_classes: int
    devices: list[DeviceData]  # devices[i].device_id == i
    teams: list[list[int]]  # team index -> sorted device ids (== tree.teams)
    tree: Tree  # the whole hierarchy; teams are its level-1 nodes
    proxy_x: torch.Tensor | None = None  # proxy pool (dataset.proxy_fraction > 0): float, like device data
    proxy_y: torch.Tensor | None = None  # int64; None when dataset.proxy_fraction is 0
    # The classes each device was dealt (sorted; `classes`, `roundrobin`, `clusterwise` and
    # `multilevel` partitions, else None); the proxy pool may have taken some of their samples,
    # the list is unchanged.
    device_classes: list[list[int]] | None = None
    # The true cluster structure: per device its cluster id at each cluster level, coarse to fine
    # (`clusterwise`: one level; `multilevel`: one per dataset.level_clusters entry;
    # synthetic_multilevel with the natural partition: one per dataset.clusters entry), else None.
    device_clusters: list[list[int]] | None = field(default=None)


# ---------------------------------------------------------------- config reading
_MISSING = object()


def _get(cfg: Mapping, key: str, default: Any = _MISSING) -> Any:
    if key in cfg:
        return cfg[key]
    if default is _MISSING:
        raise ConfigError(f"dataset.{key}", "is required")
    return default


def _int(cfg: Mapping, key: str, default: Any, lo: int, hi: int | None = None, nullable: bool = False) -> int | None:
    value = _get(cfg, key, default)
    if value is None and nullable:
        return None
    return check_number(f"dataset.{key}", value, integer=True, minimum=lo, maximum=math.inf if hi is None else hi)


def _float(cfg: Mapping, key: str, default: Any, lo: float, hi: float | None = None, open_lo: bool = False) -> float:
    """A number in [lo, hi) (or (lo, hi) with ``open_lo``); hi=None means no upper bound."""
    value = _get(cfg, key, default)
    upper = math.inf if hi is None else hi
    return float(check_number(f"dataset.{key}", value, minimum=lo, maximum=upper, open_min=open_lo, open_max=hi is not None))


def _normalize(cfg: Mapping, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """``dataset.normalize = [mean, std]``, each a number or one value per channel; null = none
    (``per_feature`` is handled by the caller)."""
    value = _get(cfg, "normalize", [0.5, 0.5])
    if value is None:
        return np.zeros(channels), np.ones(channels)
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2:
        raise ConfigError("dataset.normalize", f"must be [mean, std], got {value!r}")
    out = []
    for part in value:
        arr = np.asarray(part, dtype=np.float64).reshape(-1)
        if arr.size not in (1, channels) or not np.all(np.isfinite(arr)):
            raise ConfigError("dataset.normalize", f"mean/std must be a number or {channels} numbers, got {part!r}")
        out.append(np.broadcast_to(arr, (channels,)).copy())
    if np.any(out[1] <= 0):
        raise ConfigError("dataset.normalize", f"std must be > 0, got {value[1]!r}")
    return out[0], out[1]


def _choice(cfg: Mapping, key: str, default: Any, known: tuple[str, ...], what: str) -> str:
    value = _get(cfg, key, default)
    if value not in known:
        raise ConfigError(f"dataset.{key}", f"unknown {what} {value!r}; known: {', '.join(known)}")
    return value


# ---------------------------------------------------------------- loading
def _load_synthetic(cfg: Mapping, num_devices: int, seed: int):
    params = dict(
        alpha=_float(cfg, "alpha", 0.5, 0.0),
        beta=_float(cfg, "beta", 0.5, 0.0),
        num_features=_int(cfg, "num_features", 60, 1),
        num_classes=_int(cfg, "num_classes", 10, 2),
        size_mean=_float(cfg, "size_mean", 4.0, -np.inf),
        size_sigma=_float(cfg, "size_sigma", 2.0, 0.0),
        min_samples=_int(cfg, "min_samples", 50, 0),
        max_samples=_int(cfg, "max_samples", None, 2, nullable=True),
    )
    if cfg.get("name") == "synthetic":
        params["size_scale"] = _int(cfg, "size_scale", 1, 1)
    if cfg.get("name") == "synthetic_multilevel":
        del params["alpha"]  # the model's structure comes from the scales instead
        clusters = _get(cfg, "clusters", [4])
        scales = _get(cfg, "scales", [1.0, 1.0, 0.5])
        if not isinstance(clusters, Sequence) or isinstance(clusters, str):
            raise ConfigError("dataset.clusters", f"must be a list of cluster counts per level, got {clusters!r}")
        if not isinstance(scales, Sequence) or isinstance(scales, str):
            raise ConfigError("dataset.scales", f"must be a list of standard deviations, got {scales!r}")
        for i, value in enumerate(scales):
            if not math.isfinite(check_number(f"dataset.scales[{i}]", value, minimum=0.0)):
                raise ConfigError(f"dataset.scales[{i}]", f"must be finite, got {value}")
        for i, value in enumerate(clusters):
            check_number(f"dataset.clusters[{i}]", value, integer=True, minimum=1)
        data = multilevel.generate(num_devices, seed, clusters=clusters, scales=[float(v) for v in scales],
                                   beta=params.pop("beta"), **params)
    else:
        data = synthetic.generate(num_devices, seed, **params)
    bounds = np.cumsum([0] + [len(y) for _, y in data])
    natural = [np.arange(bounds[i], bounds[i + 1]) for i in range(num_devices)]
    x = np.concatenate([x for x, _ in data])
    y = np.concatenate([y for _, y in data])
    return x, y, (params["num_features"],), params["num_classes"], natural, lambda a: a


def _load_vision(cfg: Mapping, name: str):
    spec = vision.SPECS[name]
    root = _get(cfg, "root", None)
    if root is None or root == "":
        raise ConfigError(
            "dataset.root",
            f"is required for {name}: the folder holding '{spec.folder}/' (or set dataset.download=true)",
        )
    download = _get(cfg, "download", False)
    if not isinstance(download, bool):
        raise ConfigError("dataset.download", f"must be true or false, got {download!r}")
    per_feature = _get(cfg, "normalize", None) == "per_feature"
    if not per_feature:
        mean, std = _normalize(cfg, spec.input_shape[0])
    x, y = vision.load(name, root, download)
    if y.size and (y.min() < 0 or y.max() >= spec.num_classes):
        raise ValueError(f"{name}: labels outside 0..{spec.num_classes - 1} in {root}")
    if per_feature:
        return x, y, spec.input_shape, spec.num_classes, None, vision.per_feature_standardizer(x)
    return x, y, spec.input_shape, spec.num_classes, None, lambda a: vision.to_float(a, mean, std)


# ---------------------------------------------------------------- building
def build_federation(dataset_cfg: Mapping, topology_cfg: Mapping, seed: int) -> Federation:
    """Load ``dataset_cfg``, split it among the devices of ``topology_cfg`` and form the teams.

    Deterministic in ``seed``: every random stream is derived from it via hfl.seed.
    """
    name = _get(dataset_cfg, "name")
    if name not in DATASETS:
        raise ConfigError("dataset.name", f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    num_devices = topology.num_devices(topology_cfg)
    tree = topology.form_tree(num_devices, topology_cfg, seed)
    teams = tree.teams
    by_label = topology_cfg.get("formation") == "by_label"

    partition = _choice(dataset_cfg, "partition", "natural" if name in GENERATED else "classes", PARTITIONS, "partition")
    if partition == "natural" and name not in GENERATED:
        raise ConfigError("dataset.partition", f"'natural' exists only for synthetic data, not {name}")
    if by_label and partition != "classes":
        raise ConfigError(
            "topology.formation", f"'by_label' gives teams label sets and needs dataset.partition=classes, got {partition!r}"
        )
    train_fraction = _float(dataset_cfg, "train_fraction", 0.75, 0.0, 1.0, open_lo=True)
    val_fraction = _float(dataset_cfg, "val_fraction", 0.0, 0.0, 1.0)
    min_samples_per_device = _int(dataset_cfg, "min_samples_per_device", 2, 2)
    size_sigma = _float(dataset_cfg, "size_sigma", 2.0, 0.0)
    min_per_class = _int(dataset_cfg, "min_per_class", 10, 0)
    dirichlet_alpha = _float(dataset_cfg, "dirichlet_alpha", 0.5, 0.0, open_lo=True)
    proxy_fraction = _float(dataset_cfg, "proxy_fraction", 0.0, 0.0, 1.0)

    if name in GENERATED:
        x, y, input_shape, num_classes, natural, to_float = _load_synthetic(dataset_cfg, num_devices, seed)
    else:
        x, y, input_shape, num_classes, natural, to_float = _load_vision(dataset_cfg, name)

    device_classes: list[list[int]] | None = None
    device_clusters: list[list[int]] | None = None
    if partition == "natural":
        parts, too_small_key = natural, "dataset.min_samples"
        if name == "synthetic_multilevel":  # the generator's nested blocks (hfl/data/multilevel.py)
            levels = [int(n) for n in _get(dataset_cfg, "clusters", [4])]
            device_clusters = [[multilevel.block_of(d, num_devices, n) for n in levels] for d in range(num_devices)]
    elif partition == "classes":
        k = _int(dataset_cfg, "classes_per_device", 2, 1, num_classes)
        labels = topology.team_labels(topology_cfg) if by_label else None
        for t, team in enumerate(labels or []):
            if max(team) >= num_classes:
                raise ConfigError("topology.team_labels", f"team {t} has label {max(team)}; {name} has classes 0..{num_classes - 1}")
            if k > len(team):
                raise ConfigError(
                    "dataset.classes_per_device", f"is {k} but team {t} has only {len(team)} labels in topology.team_labels"
                )
        device_classes = classes_of_devices(num_devices, num_classes, k, teams, labels)
        parts = partition_by_classes(y, device_classes, min_per_class, size_sigma, seed)
        too_small_key = "dataset.min_per_class"
    elif partition == "roundrobin":
        k = _int(dataset_cfg, "classes_per_device", 2, 1, num_classes)
        device_classes = roundrobin_classes(num_devices, num_classes, k, seed)
        parts = partition_roundrobin(y, device_classes, seed)
        too_small_key = topology.device_count_key(topology_cfg)  # too many owners share a class
    elif partition == "clusterwise":  # FeMAM's cluster-wise (c, K)
        num_clusters = _int(dataset_cfg, "num_clusters", 5, 1)
        cluster_classes = _int(dataset_cfg, "cluster_classes", min(3, num_classes), 1, num_classes)
        clusters = clusterwise_clusters(num_devices, num_clusters, seed)
        dealt = deal_cluster_classes(num_clusters, cluster_classes, num_classes, seed)
        device_classes = [dealt[k] for k in clusters]
        device_clusters = [[k] for k in clusters]
        parts = partition_among_owners(y, device_classes, seed)
        too_small_key = topology.device_count_key(topology_cfg)  # too many owners share a class
    elif partition == "multilevel":  # FeMAM's multi-level [a, b, c]
        level_classes = _get(dataset_cfg, "level_classes", None)
        device_clusters, level_sets = multilevel_structure(
            num_devices, num_classes, _get(dataset_cfg, "level_clusters", [2, 4]), seed,
            level_classes,
        )
        device_classes = path_classes(device_clusters, level_sets)
        parts = partition_among_owners(y, device_classes, seed)
        too_small_key = topology.device_count_key(topology_cfg)
    elif partition == "iid":
        parts, too_small_key = partition_iid(y, num_devices, seed), topology.device_count_key(topology_cfg)
    else:
        parts = partition_dirichlet(y, num_devices, dirichlet_alpha, seed, min_size=min_samples_per_device)
        too_small_key = "dataset.dirichlet_alpha"

    for d, idx in enumerate(parts):
        if len(idx) < 2:  # one train + one test sample at least
            raise ConfigError(
                too_small_key, f"device {d} gets {len(idx)} samples ({name}, {partition} partition); it needs at least 2"
            )
    proxy_x = proxy_y = None
    if proxy_fraction > 0:
        # A seeded IID slice of the pool that no device holds (taken out before the train/test split).
        proxy = np.sort(rng(seed, "proxy").choice(len(y), size=int(round(proxy_fraction * len(y))), replace=False))
        parts = [idx[~np.isin(idx, proxy)] for idx in parts]
        for d, idx in enumerate(parts):
            if len(idx) < 2:
                raise ConfigError(
                    "dataset.proxy_fraction",
                    f"is {proxy_fraction}: device {d} is left with {len(idx)} samples after the proxy pool is "
                    "taken out; it needs at least 2 (lower the fraction)",
                )
        proxy_x = torch.from_numpy(np.ascontiguousarray(to_float(x[proxy])))
        proxy_y = torch.from_numpy(y[proxy])

    devices = []
    for d, idx in enumerate(parts):
        train, val, test = split_train_val_test(idx, train_fraction, val_fraction, seed, d)
        devices.append(
            DeviceData(
                device_id=d,
                x_train=torch.from_numpy(np.ascontiguousarray(to_float(x[train]))),
                y_train=torch.from_numpy(y[train]),
                x_test=torch.from_numpy(np.ascontiguousarray(to_float(x[test]))),
                y_test=torch.from_numpy(y[test]),
                x_val=torch.from_numpy(np.ascontiguousarray(to_float(x[val]))),
                y_val=torch.from_numpy(y[val]),
            )
        )
    sorted_classes = None if device_classes is None else [sorted(cs) for cs in device_classes]
    return Federation(name, tuple(input_shape), num_classes, devices, teams, tree, proxy_x, proxy_y, sorted_classes,
                      device_clusters)


def proxy_data(fed: Federation, path: str, size: int, seed: int, train_fraction: float = 0.75) -> DeviceData:
    """The proxy samples of the server at ``path`` (device_id -1): ``size`` samples drawn without
    replacement from the federation's proxy pool with ``rng(seed, "proxy", path)`` (servers may
    overlap), split into train/test like a device's data."""
    fed.tree.children(path)  # KeyError for a path that is no server of the tree
    pool = 0 if fed.proxy_y is None else len(fed.proxy_y)
    if pool == 0:
        raise ValueError("the federation has no proxy pool: set dataset.proxy_fraction > 0")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not 2 <= size <= pool:
        raise ValueError(
            f"proxy size for server {path!r} must be an integer in [2, {pool}] (the pool size), got {size!r}"
        )
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
    idx = rng(seed, "proxy", path).choice(pool, size=int(size), replace=False)
    train, test = split_train_test(idx, train_fraction, derive_seed(seed, "proxy", path), -1)
    train_t, test_t = torch.from_numpy(train), torch.from_numpy(test)
    return DeviceData(
        device_id=-1,
        x_train=fed.proxy_x[train_t].contiguous(),
        y_train=fed.proxy_y[train_t],
        x_test=fed.proxy_x[test_t].contiguous(),
        y_test=fed.proxy_y[test_t],
    )
