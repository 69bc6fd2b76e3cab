"""Any Hugging Face dataset as hfl data (``dataset.source: huggingface``), split among the devices
by Flower Datasets' partitioners or by hfl's own partitions.

A dataset comes from local files (``dataset.path``: a ``save_to_disk`` folder, parquet, arrow,
csv or json files, or a folder of images) or from the Hub by name (``dataset.hub``, for users
with network access). Its splits are pooled (``dataset.splits``, all by default), as hfl pools
MNIST's train and test; the columns hfl reads are named in ``dataset.columns``.

``dataset.partition: flower`` hands the pool to the partitioner ``dataset.partitioner`` names
(any class of ``flwr_datasets.partitioner``, with its keyword arguments): device ``d`` holds
exactly the rows of its partition ``d``, in the partitioner's order. A natural-id partitioner
makes one device per natural id, however many the data has; a group column
(``dataset.columns.group``) or ``GroupedNaturalIdPartitioner``'s groups make the level-1 nodes.
A partitioner per level: ``dataset.team_partitioner`` splits the pool among the level-1 nodes
and ``dataset.partitioner`` each node's rows among its devices.

``datasets`` and ``flwr_datasets`` are imported when a dataset of this source is loaded: the
other datasets never pay for them.
"""

from __future__ import annotations

import inspect
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hfl.errors import ConfigError, check_number
from hfl.tree import formation as topology

SOURCE = "huggingface"
ROW = "__hfl_row__"  # a pool row's index, added for the partitioner so its partitions name their rows
NATURAL = ("NaturalIdPartitioner", "GroupedNaturalIdPartitioner")  # devices from the data, not the topology
COLUMNS = ("image", "features", "text", "label", "natural_id", "group")
TEXT_ENCODINGS = ("hashing", "chars")
_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}


@dataclass
class Pool:
    """The pooled rows: the dataset the partitioner sees, and its inputs and labels as arrays."""

    dataset: Any  # datasets.Dataset, rows in the order of x and y, with the ROW column
    x: np.ndarray  # raw values, (n, *input_shape); hashed text: a scipy CSR matrix (n, features)
    y: np.ndarray  # int64 labels in 0..num_classes-1
    input_shape: tuple[int, ...]
    num_classes: int
    to_float: Callable[[np.ndarray], np.ndarray]  # raw values -> the model's float32 inputs


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _hub_hint(hub: str) -> str:
    folder = "data/" + hub.replace("/", "_")
    return (f"on a machine with network run: python -c \"import datasets; datasets.load_dataset('{hub}')"
            f".save_to_disk('{folder}')\", copy {folder}/ here and set dataset.path={folder} dataset.hub=null")


def load(cfg: Mapping) -> Any:
    """The ``datasets.Dataset`` or ``DatasetDict`` that ``dataset.path`` or ``dataset.hub`` names."""
    import datasets

    path, hub = cfg.get("path"), cfg.get("hub")
    if (path in (None, "")) == (hub in (None, "")):
        raise ConfigError("dataset.path", "give exactly one of dataset.path (local files) and dataset.hub "
                                          f"(a Hugging Face Hub name), got path={path!r} hub={hub!r}")
    if hub:
        try:
            return datasets.load_dataset(str(hub), name=cfg.get("subset"))
        except Exception as exc:  # offline, unknown name, gated: all one refusal naming the key
            raise ConfigError("dataset.hub", f"cannot load {hub!r} ({_one_line(exc)}); {_hub_hint(str(hub))}") from exc
    where = Path(str(path)).expanduser()
    if not where.exists():
        # Named absolute and with the host: on a deployment every host loads the dataset itself, a
        # relative path from its own working directory, so the submitter's folder may be no host's.
        relative = "" if where.is_absolute() else f" ({str(where)!r} from the working directory {Path.cwd()})"
        raise ConfigError("dataset.path", f"{where.absolute()} does not exist on {socket.gethostname()}{relative}: "
                                          "give a datasets save_to_disk folder, parquet/arrow/csv/json files or a "
                                          "folder of images that every process loading the data reaches (on a "
                                          "deployment: every host, best by an absolute path)")
    try:
        if where.is_dir() and any((where / f).exists() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
            return datasets.load_from_disk(str(where))
        files = [where] if where.is_file() else sorted(p for p in where.rglob("*") if p.suffix in _FILE_BUILDERS)
        builders = {_FILE_BUILDERS.get(p.suffix) for p in files}
        if where.is_dir() and not files:
            return datasets.load_dataset("imagefolder", data_dir=str(where))
        if len(builders) != 1 or None in builders:
            raise ConfigError("dataset.path", f"{where}: expected files of one kind ({', '.join(_FILE_BUILDERS)}), "
                                              f"found {sorted(p.suffix for p in files)[:5]}")
        return datasets.load_dataset(builders.pop(), data_files=[str(p) for p in files])
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError("dataset.path", f"cannot load {where} ({_one_line(exc)})") from exc


def _pooled(loaded: Any, splits: Sequence[str] | None) -> Any:
    """One Dataset: the splits asked for (all, in the order the dataset lists them, by default)."""
    import datasets

    if isinstance(loaded, datasets.Dataset):
        if splits:
            raise ConfigError("dataset.splits", f"the dataset has no splits (one table), got {list(splits)}; set null")
        return loaded
    names = list(loaded.keys())
    chosen = list(splits) if splits else names
    for s in chosen:
        if s not in names:
            raise ConfigError("dataset.splits", f"no split {s!r}; the dataset's splits: {', '.join(names)}")
    return datasets.concatenate_datasets([loaded[s] for s in chosen]) if len(chosen) > 1 else loaded[chosen[0]]


def column(cfg: Mapping, name: str) -> Any:
    """``dataset.columns.<name>`` (None when not given)."""
    columns = cfg.get("columns") or {}
    return columns.get(name)


def check_column(ds: Any, key: str, name: str) -> None:
    if name not in ds.column_names:
        shown = ", ".join(c for c in ds.column_names if c != ROW)
        raise ConfigError(key, f"no column {name!r} in the dataset; its columns: {shown}")


def _stack(values: Any, key: str) -> np.ndarray:
    """A column as one array (images of one size, vectors of one length)."""
    arr = np.asarray(values) if not isinstance(values, np.ndarray) else values
    if arr.dtype == object:
        try:
            arr = np.stack([np.asarray(v) for v in arr])
        except ValueError as exc:
            raise ConfigError(key, f"its rows differ in shape ({_one_line(exc)}); give inputs of one size") from exc
    if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise ConfigError(key, f"holds {arr.dtype} values; hfl reads numbers or images (a text column: dataset.columns.text)")
    return arr


def _values(ds: Any, table: Any, name: str) -> Any:
    """A column's values: a plain numeric Arrow column straight from Arrow (datasets' numpy format
    checks every value in Python: 2.8 s of a million-writer pool's 6.6 s start-up, 8 feature
    columns), any other (arrays, images, nulls) through the numpy format."""
    import pyarrow as pa

    col = ds.with_format("arrow")[name]
    if isinstance(col, pa.ChunkedArray) and col.null_count == 0 and (
            pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type)):
        return col.to_numpy()
    return table[name][:]


def _image_layout(x: np.ndarray, key: str) -> np.ndarray:
    """Images as (n, C, H, W): a grey (n, H, W) gets a channel, channels-last (n, H, W, C) is moved."""
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4:
        return x if x.shape[1] in (1, 3, 4) and x.shape[-1] not in (1, 3, 4) else np.moveaxis(x, -1, 1)
    raise ConfigError(key, f"images must be (H, W) or (H, W, C) arrays, got rows of shape {x.shape[1:]}")


def _sparse(x: Any) -> bool:
    return hasattr(x, "toarray") and hasattr(x, "tocsr")  # a scipy sparse matrix (hashed text)


def _scaler(cfg: Mapping, x: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """``dataset.scale`` and ``dataset.normalize``: ``(x / scale - mean) / std`` per channel
    (images) or for every feature, float32; ``per_feature``: every input value z-scored over the pool."""
    scale = float(check_number("dataset.scale", cfg.get("scale", 1.0), minimum=0.0, open_min=True))
    value = cfg.get("normalize")
    if _sparse(x):  # hashed text: rows made dense when a device is made (below), the pool stays sparse
        if value == "per_feature":
            xs = x.astype(np.float64) / scale
            mu = np.asarray(xs.mean(0)).ravel()
            sigma = np.sqrt(np.maximum(np.asarray(xs.multiply(xs).mean(0)).ravel() - mu ** 2, 0.0)) + 1e-3
            return lambda a: ((a.toarray() / scale - mu) / sigma).astype(np.float32)
        dense = _scaler(cfg, np.zeros((1, x.shape[1]), dtype=np.float32))  # [mean, std] or null: no statistics of x
        return lambda a: dense(a.toarray())
    if value == "per_feature":
        flat = x.reshape(len(x), -1).astype(np.float64) / scale
        mu, sigma = flat.mean(0), flat.std(0) + 1e-3  # the +1e-3 guards constant inputs (as hfl's vision data)
        return lambda a: ((a.reshape(len(a), -1) / scale - mu) / sigma).reshape(a.shape).astype(np.float32)
    channels = x.shape[1] if x.ndim == 4 else 1
    mean, std = np.zeros(channels), np.ones(channels)
    if value is not None:
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2:
            raise ConfigError("dataset.normalize", f"must be [mean, std], per_feature or null, got {value!r}")
        given = [np.asarray(v, dtype=np.float64).reshape(-1) for v in value]
        if any(v.size not in (1, channels) for v in given) or np.any(given[1] <= 0):
            raise ConfigError("dataset.normalize", f"mean/std must be a number or {channels} numbers, std > 0; got {value!r}")
        mean, std = (np.broadcast_to(v, (channels,)) for v in given)
    shape = (1, channels, 1, 1) if x.ndim == 4 else (1,)  # per channel of images, one value for features
    m, s = mean.astype(np.float32).reshape(shape), std.astype(np.float32).reshape(shape)

    def to_float(a: np.ndarray) -> np.ndarray:
        return ((a.astype(np.float32) / np.float32(scale) - m) / s).astype(np.float32)

    return to_float


def load_pool(cfg: Mapping) -> Pool:
    """The dataset ``cfg`` names, pooled, its columns checked and read into arrays."""
    import datasets

    ds = _pooled(load(cfg), cfg.get("splits"))
    for name in COLUMNS:
        given = column(cfg, name)
        for c in ([given] if isinstance(given, str) else given or []):
            check_column(ds, f"dataset.columns.{name}", c)
    label, image, features = column(cfg, "label"), column(cfg, "image"), column(cfg, "features")
    text = column(cfg, "text")
    if not label:
        raise ConfigError("dataset.columns.label", "is required: the column holding each row's class")
    if sum(c is not None for c in (image, features, text)) != 1:
        raise ConfigError("dataset.columns.image", "give exactly one of dataset.columns.image (an image or array "
                                                   "column), dataset.columns.features and dataset.columns.text; got "
                                                   f"{image!r}, {features!r} and {text!r}")
    if getattr(ds.features[label], "dtype", None) in ("string", "large_string"):
        ds = ds.class_encode_column(label)  # class names -> 0..C-1, sorted by name
    mode = cfg.get("image_mode")
    if image is not None and isinstance(ds.features[image], datasets.Image) and mode:
        ds = ds.cast_column(image, datasets.Image(mode=str(mode)))
    ds = ds.add_column(ROW, np.arange(len(ds), dtype=np.int64))

    table = ds.with_format("numpy")
    y = _stack(_values(ds, table, label), "dataset.columns.label")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ConfigError("dataset.columns.label", f"column {label!r} must hold one integer class per row, got {y.dtype} "
                                                   f"rows of shape {y.shape[1:]}")
    y = y.astype(np.int64)
    feature = ds.features[label]
    num_classes = cfg.get("num_classes")
    if num_classes is None:
        num_classes = feature.num_classes if isinstance(feature, datasets.ClassLabel) else int(y.max(initial=-1)) + 1
    num_classes = int(check_number("dataset.num_classes", num_classes, integer=True, minimum=2))
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ConfigError("dataset.num_classes", f"is {num_classes} but column {label!r} holds classes "
                                                 f"{int(y.min())}..{int(y.max())}")
    if image is not None:
        x = _image_layout(_stack(table[image][:], "dataset.columns.image"), "dataset.columns.image")
    elif text is not None:
        x = encode_text(ds.with_format("arrow")[text].to_pylist(), cfg["text"])
    else:
        cols = [features] if isinstance(features, str) else list(features)
        parts = [_stack(_values(ds, table, c), "dataset.columns.features").reshape(len(ds), -1) for c in cols]
        x = np.concatenate(parts, axis=1)
    x = x if _sparse(x) else np.ascontiguousarray(x)
    return Pool(ds, x, y, tuple(int(s) for s in x.shape[1:]), num_classes, _scaler(cfg, x))


def encode_text(texts: Sequence[Any], spec: Mapping) -> Any:
    """A text column as fixed-size numbers, as ``dataset.text.encoding`` says:

    - ``hashing`` (the default): a bag of words, scikit-learn's ``HashingVectorizer`` (lower case,
      words of letters and digits, counts in ``dataset.text.features`` buckets, 1024 by default):
      (n, features) counts as a sparse matrix, for models over feature vectors (mclr, mlp, dnn);
    - ``chars``: each text's last ``dataset.text.length`` characters (80 by default) as ids into
      the pool's characters in sorted order (1..V; 0 pads shorter texts on the left), as
      Shakespeare's next-character prediction reads its context. hfl has no model that embeds
      them (no LSTM): mlp / dnn read them as numbers.

    Both depend on the pool alone (no fitted state), so every process and host encodes alike."""
    encoding = spec["encoding"]
    if encoding not in TEXT_ENCODINGS:
        raise ConfigError("dataset.text.encoding", f"unknown text encoding {encoding!r}; known: {', '.join(TEXT_ENCODINGS)}")
    if any(t is not None and not isinstance(t, str) for t in texts[:100]):
        raise ConfigError("dataset.columns.text", f"holds {type(next(t for t in texts if not isinstance(t, str))).__name__}"
                                                  " values, not text")
    texts = ["" if t is None else t for t in texts]
    if encoding == "hashing":
        from sklearn.feature_extraction.text import HashingVectorizer

        size = int(check_number("dataset.text.features", spec["features"], integer=True, minimum=1))
        # Kept sparse (CSR): a device's rows are made dense when it is made; 1.6 million tweets in
        # 1,024 dense float32 buckets would be 6.5 GB in every process that loads the pool.
        return HashingVectorizer(n_features=size, alternate_sign=False, norm=None, token_pattern=r"(?u)\b\w+\b",
                                 dtype=np.float32).transform(texts).tocsr()
    length = int(check_number("dataset.text.length", spec["length"], integer=True, minimum=1))
    vocabulary = {c: i + 1 for i, c in enumerate(sorted(set().union(*map(set, texts))))}
    ids = np.zeros((len(texts), length), dtype=np.int64)
    for row, t in enumerate(texts):
        tail = t[-length:]
        if tail:
            ids[row, length - len(tail):] = [vocabulary[c] for c in tail]
    return ids


# ------------------------------------------------------------------ Flower Datasets' partitioners
def partitioner_class(name: Any, key: str = "dataset.partitioner.name") -> type:
    import flwr_datasets.partitioner as fp

    known = sorted(n for n in fp.__all__ if n != "Partitioner" and not n.startswith("Vertical"))
    if name not in known:
        raise ConfigError(key, f"unknown partitioner {name!r}; Flower Datasets' (flwr_datasets.partitioner): "
                               f"{', '.join(known)}")
    return getattr(fp, name)


def make_partitioner(cfg: Mapping, dataset: Any, num_devices: int | None, seed: int,
                     key: str = "dataset.partitioner") -> Any:
    """The partitioner ``key`` (``dataset.partitioner`` or ``dataset.team_partitioner``) names,
    over ``dataset`` (the pool, or a level-1 node's rows of it). Filled in when the partitioner
    takes them and ``kwargs`` does not give them: ``num_partitions`` (``num_devices``: the
    topology's), ``partition_by`` (the natural id column for natural-id partitioners, else the
    label column) and ``seed`` (the run's)."""
    spec = cfg.get(key.rpartition(".")[2]) or {}
    name = spec.get("name")
    cls = partitioner_class(name, f"{key}.name")
    kwargs = dict(spec.get("kwargs") or {})
    params = inspect.signature(cls).parameters
    for k in kwargs:
        if k not in params:
            raise ConfigError(f"{key}.kwargs.{k}", f"{name} takes no argument {k!r}; it takes: {', '.join(params)}")
    if "partition_by" in params and "partition_by" not in kwargs:
        by = column(cfg, "natural_id") if name in NATURAL else column(cfg, "label")
        if not by:
            raise ConfigError("dataset.columns.natural_id", f"{name} needs the natural id column (or "
                                                            f"{key}.kwargs.partition_by)")
        kwargs["partition_by"] = by
    if "partition_by" in kwargs:
        check_column(dataset, f"{key}.kwargs.partition_by", str(kwargs["partition_by"]))
    if "seed" in params and "seed" not in kwargs:
        kwargs["seed"] = int(seed)
    if "num_partitions" in params and "num_partitions" not in kwargs and num_devices is not None:
        kwargs["num_partitions"] = num_devices
    try:
        partitioner = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}.kwargs", f"{name}({kwargs}) refused: {_one_line(exc)}") from exc
    # Arrow format: a partitioner reading a whole column (np.array(dataset[column])) gets it at once;
    # in the default format datasets 4 hands it row by row (16 s for a million rows, 1 s this way).
    partitioner.dataset = dataset.with_format("arrow")
    return partitioner


def partition_rows(partitioner: Any, name: str, wanted: int | None, key: str = "dataset.partitioner",
                   what: str = "devices") -> list[np.ndarray]:
    """Each partition's pool rows (its ROW values), in the partitioner's order (``wanted``: the
    topology's count of ``what``)."""
    rows = len(partitioner.dataset)
    try:
        count = int(partitioner.num_partitions)
    except (ValueError, KeyError, IndexError, AssertionError) as exc:
        raise _refused(name, wanted, rows, exc, key, what) from exc
    if wanted is not None and count != wanted:
        raise ConfigError(key, f"{name} makes {count} partitions but the topology has {wanted} {what}; give it as "
                               "many or change the topology")
    try:
        first = _rows_of(partitioner, 0)
        # Most partitioners keep every partition's indices once one is loaded: read them at once
        # (a partition loaded through the API costs ~2 ms: 1,000 devices took 2.7 s to start, 5,000
        # 11 s). Their indices are positions in the dataset they split; partition 0 vouches for them.
        known = getattr(partitioner, "_partition_id_to_indices", None)
        if isinstance(known, Mapping) and len(known) == count:
            to_rows = np.asarray(partitioner.dataset.with_format("numpy")[ROW][:], dtype=np.int64)
            if np.array_equal(to_rows[np.asarray(known[0], dtype=np.int64)], first):
                return [first] + [to_rows[np.asarray(known[i], dtype=np.int64)] for i in range(1, count)]
        return [first] + [_rows_of(partitioner, i) for i in range(1, count)]
    except (ValueError, KeyError, IndexError, AssertionError) as exc:
        raise _refused(name, wanted, rows, exc, key, what) from exc


def _refused(name: str, wanted: int | None, rows: int, exc: BaseException, key: str, what: str) -> ConfigError:
    asked = f"{wanted} {what}" if wanted is not None else "its partitions"
    return ConfigError(key, f"{name} cannot make {asked} of the {rows} rows: {_one_line(exc)}")


def _rows_of(partitioner: Any, i: int) -> np.ndarray:
    """Partition i's pool rows, through the partitioner's public API."""
    return np.asarray(partitioner.load_partition(i).with_format("numpy")[ROW][:], dtype=np.int64)


@dataclass
class FlowerSplit:
    """What a Flower Datasets partitioner made: each device's pool rows and, where the data forms
    them (a group column, grouped natural ids), the level-1 nodes' devices."""

    parts: list[np.ndarray]
    teams: list[list[int]] | None
    natural_ids: list[Any] | None  # device d's natural id (natural-id partitions)


def flower_split(cfg: Mapping, pool: Pool, topology_cfg: Mapping, seed: int) -> FlowerSplit:
    """Devices (and level-1 nodes where the data forms them) from ``dataset.partitioner`` and
    ``dataset.team_partitioner``; the topology's device count is asked only of partitioners that
    do not make their own."""
    if (cfg.get("team_partitioner") or {}).get("name"):
        return _by_levels(cfg, pool, topology_cfg, seed)
    name = (cfg.get("partitioner") or {}).get("name")
    group = column(cfg, "group")
    if name not in NATURAL:
        partitioner_class(name)
        if group:
            raise ConfigError("dataset.columns.group", f"groups devices by natural id; it needs NaturalIdPartitioner "
                                                       f"or GroupedNaturalIdPartitioner, not {name}")
        wanted = topology.num_devices(topology_cfg)
        partitioner = make_partitioner(cfg, pool.dataset, wanted, seed)
        return FlowerSplit(partition_rows(partitioner, name, wanted), None, None)

    if name == "NaturalIdPartitioner":
        partitioner = make_partitioner(cfg, pool.dataset, None, seed)
        parts = partition_rows(partitioner, name, None)
        ids = [partitioner.partition_id_to_natural_id[i] for i in range(len(parts))]
        if not group:
            return FlowerSplit(parts, None, ids)
        teams = _group_teams(cfg, pool, parts, ids)
        check_topology(topology_cfg, teams, f"column {group!r} (dataset.columns.group)")
        return FlowerSplit(parts, teams, ids)

    # GroupedNaturalIdPartitioner: its groups are the level-1 nodes, their natural ids the devices
    grouped = make_partitioner(cfg, pool.dataset, None, seed)
    if group:
        raise ConfigError("dataset.columns.group", "GroupedNaturalIdPartitioner forms the groups itself; set "
                                                   "dataset.columns.group=null or use NaturalIdPartitioner")
    try:
        groups = [list(grouped.partition_id_to_natural_ids[g]) for g in range(grouped.num_partitions)]
    except (ValueError, KeyError) as exc:
        raise _refused(name, None, len(pool.y), exc, "dataset.partitioner", "devices") from exc
    by = grouped._partition_by  # noqa: SLF001 - the column it was given or we filled in
    natural = make_partitioner({**cfg, "partitioner": {"name": "NaturalIdPartitioner", "kwargs": {"partition_by": by}}},
                               pool.dataset, None, seed)
    parts = partition_rows(natural, "NaturalIdPartitioner", None)
    device_of = {natural.partition_id_to_natural_id[i]: i for i in range(len(parts))}
    kept = sorted(device_of[nid] for g in groups for nid in g)  # drop-reminder leaves some ids out
    renumber = {old: new for new, old in enumerate(kept)}
    teams = [sorted(renumber[device_of[nid]] for nid in g) for g in groups]
    check_topology(topology_cfg, teams, "GroupedNaturalIdPartitioner")
    return FlowerSplit([parts[i] for i in kept], teams, [natural.partition_id_to_natural_id[i] for i in kept])


def _by_levels(cfg: Mapping, pool: Pool, topology_cfg: Mapping, seed: int) -> FlowerSplit:
    """A partitioner per level: ``dataset.team_partitioner`` splits the pool among the level-1
    nodes (``topology.num_teams``, or one per natural id of a natural-id partitioner), then
    ``dataset.partitioner`` splits each node's rows among its ``topology.devices_per_team``
    devices (the same arguments and seed for every node). Device ids run node by node."""
    key = "dataset.team_partitioner"
    team_name = cfg["team_partitioner"]["name"]
    name = (cfg.get("partitioner") or {}).get("name")
    partitioner_class(team_name, f"{key}.name")
    if topology_cfg.get("formation") not in ("random", "sequential"):
        raise ConfigError("topology.formation", f"is {topology_cfg.get('formation')!r} but {key} forms the level-1 "
                                                "nodes; use topology=sequential with topology.num_teams and "
                                                "topology.devices_per_team")
    if name in NATURAL or column(cfg, "group"):
        raise ConfigError(key, f"splits the pool among level-1 nodes whose devices dataset.partitioner makes by count; "
                               f"{'dataset.columns.group' if column(cfg, 'group') else name} forms them itself "
                               f"(set {key}.name=null)")
    per_team = topology_cfg.get("devices_per_team")
    if per_team is None:
        raise ConfigError("topology.devices_per_team", f"{key} needs each level-1 node's device count here "
                                                       "(dataset.partitioner splits each node's rows into that many)")
    per_team = int(check_number("topology.devices_per_team", per_team, integer=True, minimum=1))
    wanted = None if team_name in NATURAL else topology_cfg.get("num_teams")
    if team_name not in NATURAL and wanted is None:
        raise ConfigError("topology.num_teams", f"{key} {team_name} needs the number of level-1 nodes here")
    team_rows = partition_rows(make_partitioner(cfg, pool.dataset, wanted, seed, key), team_name, wanted, key,
                               "level-1 nodes")
    parts: list[np.ndarray] = []
    teams: list[list[int]] = []
    for rows in team_rows:
        inner = make_partitioner(cfg, pool.dataset.select(rows), per_team, seed)  # keeps ROW: rows of the pool
        teams.append(list(range(len(parts), len(parts) + per_team)))
        parts.extend(partition_rows(inner, name, per_team))
    check_topology(topology_cfg, teams, key, per_team)
    return FlowerSplit(parts, teams, None)


def _group_teams(cfg: Mapping, pool: Pool, parts: list[np.ndarray], ids: list[Any]) -> list[list[int]]:
    """Level-1 nodes from the group column: the devices whose rows carry each group value (sorted)."""
    key, name = "dataset.columns.group", column(cfg, "group")
    values = np.asarray(pool.dataset.with_format("numpy")[name][:])
    # Whole-array work, not a loop per device: a million natural ids took 4.5 s more in np.unique per device.
    _, codes = np.unique(values, return_inverse=True)  # codes: group numbers in sorted group order
    lengths = np.fromiter((len(idx) for idx in parts), dtype=np.int64, count=len(parts))  # each >= 1: a natural id has rows
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = codes.reshape(-1)[np.concatenate(parts)] if parts else np.zeros(0, dtype=np.int64)
    low, high = np.minimum.reduceat(rows, starts), np.maximum.reduceat(rows, starts)
    mixed = np.flatnonzero(low != high)
    if len(mixed):
        d = int(mixed[0])
        found = np.unique(values[parts[d]])
        raise ConfigError(key, f"natural id {ids[d]!r} has rows in {len(found)} groups of column {name!r} "
                               f"({', '.join(map(str, found[:3]))}); a device must be in one group")
    by_group = np.argsort(low, kind="stable")  # devices in ascending order within each group
    _, counts = np.unique(low, return_counts=True)  # the groups some device holds, in sorted group order
    return [team.tolist() for team in np.split(by_group, np.cumsum(counts)[:-1])]


def check_topology(topology_cfg: Mapping, teams: list[list[int]], what: str, per_team: int | None = None) -> None:
    """The topology must leave the level-1 nodes to the data: formation random or sequential
    (their formation is then unused), ``num_teams`` null or the data's count, ``devices_per_team``
    null (``per_team``: the count a partitioner per level was given)."""
    formation = topology_cfg.get("formation")
    fix = (f"use topology=sequential topology.num_teams={len(teams)} "
           f"topology.devices_per_team={'null' if per_team is None else per_team}")
    if formation not in ("random", "sequential"):
        raise ConfigError("topology.formation", f"is {formation!r} but {what} forms the level-1 nodes; {fix}")
    num_teams = topology_cfg.get("num_teams")
    if num_teams is not None and num_teams != len(teams):
        raise ConfigError("topology.num_teams", f"is {num_teams} but {what} forms {len(teams)} level-1 nodes; {fix}")
    if per_team is None and topology_cfg.get("devices_per_team") is not None:
        raise ConfigError("topology.devices_per_team", f"must be null: {what} forms level-1 nodes of "
                                                       f"{min(map(len, teams))}..{max(map(len, teams))} devices; {fix}")
