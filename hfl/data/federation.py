"""build_federation: dataset + partition + tree formation -> per-device tensors (train, optional
validation, test), the tree and its level-1 nodes' devices, and the optional proxy pool
(``dataset.proxy_fraction``); proxy_data: a server's proxy samples.

Generated data split by its natural partition (every device its own generated samples) is made
device by device when asked for (``LazyDevices``): the driver and every Ray actor build the
federation, and 100,000 devices' data (~10 GiB of Synthetic) fit in none of them. A Hugging Face
dataset (``dataset.source: huggingface``, hfl/data/huggingface.py) is read once into raw arrays
and its devices (Flower Datasets' partitions or hfl's) made from their rows when asked for
(``PooledDevice``). Any other dataset or partition builds every device at once.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

import numpy as np
import torch

from hfl.tree import formation as topology
from hfl.data import huggingface, multilevel, synthetic, vision
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
from hfl.errors import ConfigError, check_number
from hfl.seed import derive_seed, rng
from hfl.tree.shape import Tree, from_teams

GENERATED = ("synthetic", "synthetic_multilevel")  # made from the seed, nothing on disk
# Generated data with partition=natural (and no proxy pool): devices made when asked for
# (``dataset.lazy``, default true; false builds them all up front, benchmarks/scale.py's reference).
LAZY_DEVICES = True
# Making a device costs ~1.5 ms (Synthetic); a lazy federation keeps the devices it made while
# their tensors fit this budget (per process, ``dataset.cache_mb``), so a federation that fits
# (3,500 Synthetic devices are ~365 MiB) is made once per process, as eagerly, and a larger one
# stays bounded (100,000 are ~10 GiB). 0: keep none but the last few.
LAZY_CACHE_BYTES = 512 * 2**20
LAZY_RECENT = 4  # the last devices asked for, kept whatever the budget (a node asks one twice in a row)
DATASETS = (*GENERATED, *vision.SPECS)
PARTITIONS = ("classes", "clusterwise", "dirichlet", "iid", "multilevel", "natural", "roundrobin")
FLOWER = "flower"  # dataset.source=huggingface: Flower Datasets' partitioner dataset.partitioner (hfl/data/huggingface.py)


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


def nbytes(data: DeviceData) -> int:
    return sum(t.nbytes for t in (data.x_train, data.y_train, data.x_val, data.y_val, data.x_test, data.y_test))


class LazyDevices(Sequence[DeviceData]):
    """A federation's devices, each made by ``make(i)`` when it is asked for. Kept: those made
    while their tensors fit ``cache_bytes`` (first come, never evicted: the passes of training and
    evaluation go over the devices in turn, which would leave an LRU cache smaller than them no
    hit at all), and the last ``recent`` asked for; so memory stays bounded however many devices
    there are. ``made`` counts the devices made (tests, inspection)."""

    def __init__(self, count: int, make: Callable[[int], DeviceData], cache_bytes: int | None = None,
                 recent: int = LAZY_RECENT) -> None:
        self._count, self._make = count, make
        self._budget = LAZY_CACHE_BYTES if cache_bytes is None else cache_bytes
        self._kept: dict[int, DeviceData] = {}
        self.kept_bytes = 0
        self._recent: OrderedDict[int, DeviceData] = OrderedDict()
        self._recent_size = recent
        self.made = 0

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> DeviceData: ...

    @overload
    def __getitem__(self, index: slice) -> list[DeviceData]: ...

    def __getitem__(self, index: int | slice) -> DeviceData | list[DeviceData]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        i = operator.index(index)
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(f"device {index} does not exist: the federation has {self._count} devices")
        data = self._kept.get(i)
        if data is not None:
            return data
        data = self._recent.get(i)
        if data is not None:
            self._recent.move_to_end(i)
            return data
        data = self._make(i)
        self.made += 1
        size = nbytes(data)
        if self.kept_bytes + size <= self._budget:
            self._kept[i] = data
            self.kept_bytes += size
        elif self._recent_size > 0:
            self._recent[i] = data
            while len(self._recent) > self._recent_size:
                self._recent.popitem(last=False)
        return data

    def __iter__(self) -> Iterator[DeviceData]:  # one device at a time: iterating holds no more than the cache
        for i in range(self._count):
            yield self[i]

    @property
    def make(self) -> Callable[[int], DeviceData]:
        return self._make


@dataclass
class Federation:
    dataset: str
    input_shape: tuple[int, ...]
    num_classes: int
    # devices[i].device_id == i: a list, or LazyDevices (each made when asked for; generated
    # data with partition=natural), which nothing should iterate in a normal run
    devices: Sequence[DeviceData]
    level1_devices: list[list[int]]  # level-1 node index -> its sorted device ids (== tree.level1_devices)
    tree: Tree  # the whole hierarchy
    proxy_x: torch.Tensor | None = None  # proxy pool (dataset.proxy_fraction > 0): float, like device data
    proxy_y: torch.Tensor | None = None  # int64; None when dataset.proxy_fraction is 0
    # The classes each device was dealt (sorted; `classes`, `roundrobin`, `clusterwise` and
    # `multilevel` partitions, else None); the proxy pool may have taken some of their samples,
    # the list is unchanged.
    device_classes: list[list[int]] | None = None
    # The true cluster structure: per device its cluster id at each cluster level, coarse to fine
    # (`clusterwise`: one level; `multilevel`: one per dataset.level_clusters entry;
    # synthetic_multilevel with the natural partition: one per dataset.clusters entry), else None.
    device_clusters: Sequence[list[int]] | None = field(default=None)


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
class DeviceSource(Protocol):
    """Generated data, device by device (each from its own random streams)."""

    min_samples: int  # no device has fewer samples

    def device(self, device_id: int) -> tuple[np.ndarray, np.ndarray]: ...

    def num_samples(self, device_id: int) -> int: ...


class SyntheticSource:
    """hfl.data.synthetic's devices (looked up at each call: tests count them)."""

    def __init__(self, seed: int, params: dict[str, Any]) -> None:
        self.seed, self.params = seed, params
        floor = int(params["min_samples"]) * int(params.get("size_scale", 1))  # int(lognormal) >= 0
        self.min_samples = floor if params["max_samples"] is None else min(floor, int(params["max_samples"]))

    def device(self, device_id: int) -> tuple[np.ndarray, np.ndarray]:
        return synthetic.generate_device(self.seed, device_id, **self.params)

    def num_samples(self, device_id: int) -> int:
        return synthetic.num_samples(self.seed, device_id, **self.params)


class MultilevelSource:
    """hfl.data.multilevel's devices."""

    def __init__(self, generator: multilevel.DeviceGenerator, min_samples: int, max_samples: int | None) -> None:
        self.generator = generator
        self.min_samples = min_samples if max_samples is None else min(min_samples, max_samples)

    def device(self, device_id: int) -> tuple[np.ndarray, np.ndarray]:
        return self.generator.device(device_id)

    def num_samples(self, device_id: int) -> int:
        return self.generator.num_samples(device_id)


def _synthetic_source(cfg: Mapping, num_devices: int, seed: int) -> tuple[DeviceSource, tuple[int, ...], int]:
    """The generator the dataset config describes (its values checked), the input shape and classes."""
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
        generator = multilevel.DeviceGenerator(num_devices, seed, clusters=clusters, scales=[float(v) for v in scales],
                                               beta=params.pop("beta"), **params)
        source: DeviceSource = MultilevelSource(generator, params["min_samples"], params["max_samples"])
    else:
        source = SyntheticSource(seed, params)
    return source, (params["num_features"],), params["num_classes"]


def _same(a: np.ndarray) -> np.ndarray:
    return a


def _pool(source: DeviceSource, num_devices: int):
    """Every device's generated samples in one pool, and each device's (natural) share of it."""
    data = [source.device(d) for d in range(num_devices)]
    bounds = np.cumsum([0] + [len(y) for _, y in data])
    natural = [np.arange(bounds[i], bounds[i + 1]) for i in range(num_devices)]
    x = np.concatenate([x for x, _ in data])
    y = np.concatenate([y for _, y in data])
    return x, y, natural, _same


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
        raise ConfigError("dataset.root", f"{name}: labels outside 0..{spec.num_classes - 1} in {root}; its label "
                                          "files are damaged or of another dataset")
    if per_feature:
        return x, y, spec.input_shape, spec.num_classes, None, vision.per_feature_standardizer(x)
    return x, y, spec.input_shape, spec.num_classes, None, lambda a: vision.to_float(a, mean, std)


# ---------------------------------------------------------------- building
def build_federation(dataset_cfg: Mapping, topology_cfg: Mapping, seed: int) -> Federation:
    """Load ``dataset_cfg``, split it among the devices of ``topology_cfg`` and form the tree.

    Deterministic in ``seed``: every random stream is derived from it via hfl.seed.
    """
    name = _get(dataset_cfg, "name")
    source = dataset_cfg.get("source")
    hf = source == huggingface.SOURCE  # any Hugging Face dataset, whatever its name
    if source is not None and not hf:
        raise ConfigError("dataset.source", f"unknown source {source!r}; known: {huggingface.SOURCE}")
    if not hf and name not in DATASETS:
        raise ConfigError("dataset.name", f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    partition = _choice(dataset_cfg, "partition", "natural" if name in GENERATED else "classes",
                        (*PARTITIONS, FLOWER) if hf else PARTITIONS, "partition")
    if partition == "natural" and name not in GENERATED:
        hint = "; natural ids as devices: partition=flower with partitioner.name=NaturalIdPartitioner" if hf else ""
        raise ConfigError("dataset.partition", f"'natural' exists only for synthetic data, not {name}{hint}")
    if hf and partition != FLOWER and huggingface.column(dataset_cfg, "group"):
        raise ConfigError("dataset.columns.group", f"makes level-1 nodes of natural ids: it needs partition=flower "
                                                   f"with NaturalIdPartitioner, not partition={partition}")
    pool = huggingface.load_pool(dataset_cfg) if hf else None
    split = None
    if pool is not None and partition == FLOWER:  # the partitioner may make the devices (natural ids) and teams
        split = huggingface.flower_split(dataset_cfg, pool, topology_cfg, seed)
        num_devices = len(split.parts)
    else:
        num_devices = topology.num_devices(topology_cfg)
    if split is not None and split.teams is not None:  # the level-1 nodes the data formed (checked against the topology)
        tree = from_teams(split.teams)
    else:
        tree = topology.form_tree(num_devices, topology_cfg, seed)
    level1 = tree.level1_devices
    by_label = topology_cfg.get("formation") == "by_label"

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

    lazy = False
    if name in GENERATED:
        source, input_shape, num_classes = _synthetic_source(dataset_cfg, num_devices, seed)
        # A device's natural share is its own generated data: nothing needs the pool.
        lazy = _lazy(dataset_cfg) and partition == "natural" and proxy_fraction == 0
        if not lazy:
            x, y, natural, to_float = _pool(source, num_devices)
    elif pool is not None:
        x, y, input_shape, num_classes, natural, to_float = pool.x, pool.y, pool.input_shape, pool.num_classes, None, pool.to_float
    else:
        x, y, input_shape, num_classes, natural, to_float = _load_vision(dataset_cfg, name)

    device_classes: list[list[int]] | None = None
    device_clusters: Sequence[list[int]] | None = None
    if partition == "natural":
        parts, too_small_key = (None if lazy else natural), "dataset.min_samples"
        if name == "synthetic_multilevel":  # the generator's nested blocks (hfl/data/multilevel.py)
            levels = [int(n) for n in _get(dataset_cfg, "clusters", [4])]
            device_clusters = multilevel.BlockPaths(num_devices, levels)  # each read when asked for
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
        device_classes = classes_of_devices(num_devices, num_classes, k, level1, labels)
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
    elif partition == FLOWER:
        parts, too_small_key = split.parts, "dataset.partitioner"
    elif partition == "iid":
        parts, too_small_key = partition_iid(y, num_devices, seed), topology.device_count_key(topology_cfg)
    else:
        parts = partition_dirichlet(y, num_devices, dirichlet_alpha, seed, min_size=min_samples_per_device)
        too_small_key = "dataset.dirichlet_alpha"

    if lazy:
        check_natural_sizes(source, num_devices, train_fraction, val_fraction, seed, name)
        devices: Sequence[DeviceData] = LazyDevices(num_devices, NaturalDevice(source, train_fraction, val_fraction, seed),
                                                    _cache_bytes(dataset_cfg))
        return Federation(name, tuple(input_shape), num_classes, devices, level1, tree, None, None, None, device_clusters)

    for d, idx in enumerate(parts):
        refuse_too_few(too_small_key, d, len(idx), name, partition)
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

    if pool is not None and _lazy(dataset_cfg):  # each device's tensors made when a node first asks for it
        for n in sorted({len(idx) for idx in parts}):  # the eager path's refusal, before any training
            if not _split_fits(n, train_fraction, val_fraction):
                d = next(d for d, idx in enumerate(parts) if len(idx) == n)
                split_train_val_test(parts[d], train_fraction, val_fraction, seed, d)  # raises, naming device d
        devices = LazyDevices(num_devices, PooledDevice(x, y, tuple(parts), train_fraction, val_fraction, seed, to_float),
                              _cache_bytes(dataset_cfg))
    else:
        devices = [split_device(d, x, y, idx, train_fraction, val_fraction, seed, to_float) for d, idx in enumerate(parts)]
    sorted_classes = None if device_classes is None else [sorted(cs) for cs in device_classes]
    return Federation(name, tuple(input_shape), num_classes, devices, level1, tree, proxy_x, proxy_y, sorted_classes,
                      device_clusters)


def _lazy(cfg: Mapping) -> bool:
    lazy = _get(cfg, "lazy", LAZY_DEVICES)
    if not isinstance(lazy, bool):
        raise ConfigError("dataset.lazy", f"must be true or false, got {lazy!r}")
    return lazy


def _cache_bytes(cfg: Mapping) -> int | None:
    cache = _get(cfg, "cache_mb", None)
    return None if cache is None else int(check_number("dataset.cache_mb", cache, minimum=0) * 2**20)


def split_device(d: int, x: np.ndarray, y: np.ndarray, idx: np.ndarray, train_fraction: float, val_fraction: float,
                 seed: int, to_float: Callable[[np.ndarray], np.ndarray]) -> DeviceData:
    """Device ``d``'s samples ``x[idx], y[idx]`` split into train/val/test with its own streams.
    The split's shuffle depends only on ``len(idx)``, so a device's data is the same taken from
    the pool (indices into it) or from its own generated samples (``arange(n)``)."""
    train, val, test = split_train_val_test(idx, train_fraction, val_fraction, seed, d)
    return DeviceData(
        device_id=d,
        x_train=torch.from_numpy(np.ascontiguousarray(to_float(x[train]))),
        y_train=torch.from_numpy(y[train]),
        x_test=torch.from_numpy(np.ascontiguousarray(to_float(x[test]))),
        y_test=torch.from_numpy(y[test]),
        x_val=torch.from_numpy(np.ascontiguousarray(to_float(x[val]))),
        y_val=torch.from_numpy(y[val]),
    )


@dataclass(frozen=True)
class NaturalDevice:
    """Makes device d of a lazy federation: its generated samples, split as the eager path splits them."""

    source: DeviceSource
    train_fraction: float
    val_fraction: float
    seed: int

    def __call__(self, d: int) -> DeviceData:
        x, y = self.source.device(d)
        return split_device(d, x, y, np.arange(len(y)), self.train_fraction, self.val_fraction, self.seed, _same)

    def sizes(self, d: int) -> tuple[int, int, int]:
        """Device d's train, validation and test sizes, from its size draw alone (nothing generated)."""
        return split_lengths(self.source.num_samples(d), self.train_fraction, self.val_fraction)


@dataclass(frozen=True)
class PooledDevice:
    """Makes device d of a lazy federation over a pool (a Hugging Face dataset's): its rows
    ``parts[d]``, split and made float as the eager path makes them."""

    x: np.ndarray
    y: np.ndarray
    parts: tuple[np.ndarray, ...]
    train_fraction: float
    val_fraction: float
    seed: int
    to_float: Callable[[np.ndarray], np.ndarray]

    def __call__(self, d: int) -> DeviceData:
        return split_device(d, self.x, self.y, self.parts[d], self.train_fraction, self.val_fraction, self.seed,
                            self.to_float)

    def sizes(self, d: int) -> tuple[int, int, int]:
        return split_lengths(len(self.parts[d]), self.train_fraction, self.val_fraction)


@functools.lru_cache(maxsize=4096)
def split_lengths(n: int, train_fraction: float, val_fraction: float) -> tuple[int, int, int]:
    """The train, validation and test sizes of a device of ``n`` samples (they depend on n alone)."""
    train, val, test = split_train_val_test(np.arange(n), train_fraction, val_fraction, 0, 0)
    return len(train), len(val), len(test)


def device_sizes(fed: Federation, d: int) -> tuple[int, int, int]:
    """Device d's train, validation and test sizes; a lazy device's from its size draw, without
    making it (PFLEGO's root sums every device's, a million of them on a lazy federation)."""
    devices = fed.devices
    if isinstance(devices, LazyDevices) and isinstance(devices.make, (NaturalDevice, PooledDevice)):
        return devices.make.sizes(d)
    data = devices[d]
    return len(data.y_train), len(data.y_val), len(data.y_test)


def devices_without_validation(fed: Federation) -> list[int]:
    """The devices with an empty validation split. A lazy federation's devices are split by
    ``split_train_val_test``, which gives every device one when ``val_fraction`` > 0 (else it
    refuses the run): nothing is generated to know it."""
    devices = fed.devices
    if isinstance(devices, LazyDevices) and isinstance(devices.make, (NaturalDevice, PooledDevice)):
        return [] if devices.make.val_fraction > 0 else list(range(len(devices)))
    return [d.device_id for d in devices if len(d.y_val) == 0]


def refuse_too_few(key: str, d: int, n: int, name: str, partition: str) -> None:
    """A device needs one train and one test sample at least."""
    if n < 2:
        raise ConfigError(key, f"device {d} gets {n} samples ({name}, {partition} partition); it needs at least 2")


def _split_fits(n: int, train_fraction: float, val_fraction: float) -> bool:
    """Whether a device of ``n`` samples keeps a training sample after its splits (it depends on n alone)."""
    try:
        split_train_val_test(np.arange(n), train_fraction, val_fraction, 0, 0)
    except ConfigError:
        return False
    return True


def check_natural_sizes(source: DeviceSource, num_devices: int, train_fraction: float, val_fraction: float,
                        seed: int, name: str) -> None:
    """The eager path's refusals of a natural partition, with its messages, generating nothing: a
    device with fewer than 2 samples, or one its validation split leaves no training sample. Both
    depend on a device's size alone and, once a size passes, every larger one passes (the train
    share and round(n_train x val_fraction) grow by at most one per sample), so a passing floor
    clears every device; else the sizes (first draws of the devices' streams) are checked."""
    if source.min_samples >= 2 and _split_fits(source.min_samples, train_fraction, val_fraction):
        return
    sizes = [source.num_samples(d) for d in range(num_devices)]
    for d, n in enumerate(sizes):
        refuse_too_few("dataset.min_samples", d, n, name, "natural")
    fits = {n: _split_fits(n, train_fraction, val_fraction) for n in set(sizes)}
    for d, n in enumerate(sizes):
        if not fits[n]:
            split_train_val_test(np.arange(n), train_fraction, val_fraction, seed, d)  # raises, naming device d
            raise AssertionError(f"device {d}: {n} samples should not fit dataset.val_fraction={val_fraction}")


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
