"""Image datasets in torchvision's on-disk layout, train and test splits pooled.

The pFedMe/PerMFL authors pool the official train and test sets before splitting them
among devices, so we do too. Offline, whichever splits are on disk are used (plain or
.gz IDX files, CIFAR-10 python pickles); ``download=True`` goes through torchvision.
Images stay uint8 here; :func:`to_float` scales and normalizes a device's slice only,
which keeps memory at one float copy of the data actually used.
"""

from __future__ import annotations

from collections.abc import Callable

import gzip
import logging
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hfl.errors import ConfigError, DatasetNotFoundError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VisionSpec:
    folder: str  # torchvision's folder under root
    splits: tuple[tuple[str, tuple[str, ...]], ...]  # (split name, files relative to folder)
    num_classes: int
    input_shape: tuple[int, int, int]
    transposed: bool = False  # EMNIST stores images column-major


def _idx(prefix_train: str, prefix_test: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return (
        ("train", (f"raw/{prefix_train}-images-idx3-ubyte", f"raw/{prefix_train}-labels-idx1-ubyte")),
        ("test", (f"raw/{prefix_test}-images-idx3-ubyte", f"raw/{prefix_test}-labels-idx1-ubyte")),
    )


SPECS: dict[str, VisionSpec] = {
    "mnist": VisionSpec("MNIST", _idx("train", "t10k"), 10, (1, 28, 28)),
    "fmnist": VisionSpec("FashionMNIST", _idx("train", "t10k"), 10, (1, 28, 28)),
    "emnist_digits": VisionSpec(
        "EMNIST", _idx("emnist-digits-train", "emnist-digits-test"), 10, (1, 28, 28), transposed=True
    ),
    "emnist_byclass": VisionSpec(
        "EMNIST", _idx("emnist-byclass-train", "emnist-byclass-test"), 62, (1, 28, 28), transposed=True
    ),
    "cifar10": VisionSpec(
        "cifar-10-batches-py",
        (("train", tuple(f"data_batch_{i}" for i in range(1, 6))), ("test", ("test_batch",))),
        10,
        (3, 32, 32),
    ),
}


def parse_idx(data: bytes, source: str) -> np.ndarray:
    """An unsigned-byte IDX array (the MNIST file format) from its raw bytes."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{source}: not an unsigned-byte IDX file")
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(data) - header != int(np.prod(shape)):
        raise ValueError(f"{source}: header says shape {shape} but the file holds {len(data) - header} bytes")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _find(path: Path) -> Path | None:
    """``path`` itself, else its ``.gz`` sibling, else None."""
    if path.is_file():
        return path
    gz = path.with_name(path.name + ".gz")
    return gz if gz.is_file() else None


def _read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


def _damaged(path: Path, exc: BaseException) -> ConfigError:
    """A file of the dataset that cannot be read, named, with what to do."""
    why = str(exc).removeprefix(f"{path}: ") or type(exc).__name__
    if isinstance(exc, EOFError | zlib.error | gzip.BadGzipFile):
        why = f"a damaged or truncated gzip file ({why})"
    return ConfigError("dataset.root", f"{path}: cannot be read: {why}; replace it with an intact copy (or delete "
                                       "it and set dataset.download=true to fetch it again)")


def _read_idx(path: Path) -> np.ndarray:
    try:
        return parse_idx(_read_bytes(path), str(path))
    except (gzip.BadGzipFile, EOFError, zlib.error, ValueError) as exc:  # other OSErrors: hfl.errors.user_error
        raise _damaged(path, exc) from exc


def _read_idx_split(files: list[Path], transposed: bool) -> tuple[np.ndarray, np.ndarray]:
    images, labels = _read_idx(files[0]), _read_idx(files[1])
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ConfigError("dataset.root", f"{files[0]} / {files[1]}: images {images.shape} do not match labels "
                                          f"{labels.shape}; replace them with an intact pair")
    if transposed:
        images = images.transpose(0, 2, 1)
    return images[:, None, :, :], labels.astype(np.int64)


def _read_cifar_split(files: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for path in files:
        try:
            with path.open("rb") as f:
                entry = pickle.load(f, encoding="latin1")
            xs.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(entry["labels"], dtype=np.int64))
        except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise _damaged(path, exc) from exc
    return np.concatenate(xs), np.concatenate(ys)


def load_from_disk(name: str, root: Path) -> tuple[np.ndarray, np.ndarray]:
    """Pooled ``(images uint8 (N, C, H, W), labels int64 (N,))`` from the splits present."""
    spec = SPECS[name]
    base = root / spec.folder
    parts, tried = [], []
    for split, rel in spec.splits:
        wanted = [base / r for r in rel]
        found = [_find(p) for p in wanted]
        tried.extend(f"{p}{'' if name == 'cifar10' else ' (or .gz)'}" for p in wanted)
        if all(found):
            reader = _read_cifar_split if name == "cifar10" else lambda f: _read_idx_split(f, spec.transposed)
            parts.append(reader(found))
        elif any(found):
            missing = [str(p) for p, f in zip(wanted, found, strict=True) if f is None]
            log.warning("%s %s split is incomplete (missing %s); skipping it", name, split, ", ".join(missing))
    if not parts:
        raise DatasetNotFoundError(
            f"dataset.root: no {name} split found under {root}; looked for: "
            + ", ".join(tried)
            + "; point dataset.root at the folder that contains "
            f"'{spec.folder}/', or set dataset.download=true to fetch it with torchvision"
        )
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    return np.ascontiguousarray(x), y


def download(name: str, root: Path) -> tuple[np.ndarray, np.ndarray]:
    """Both splits through torchvision (downloading what is missing), pooled train + test."""
    from torchvision import datasets as tvd

    spec = SPECS[name]
    xs, ys = [], []
    for train in (True, False):
        if name == "mnist":
            ds = tvd.MNIST(str(root), train=train, download=True)
        elif name == "fmnist":
            ds = tvd.FashionMNIST(str(root), train=train, download=True)
        elif name.startswith("emnist_"):
            ds = tvd.EMNIST(str(root), split=name.removeprefix("emnist_"), train=train, download=True)
        else:
            ds = tvd.CIFAR10(str(root), train=train, download=True)
        x = np.asarray(ds.data, dtype=np.uint8)
        if name == "cifar10":
            x = x.transpose(0, 3, 1, 2)  # torchvision keeps HWC
        else:
            # torchvision's EMNIST returns the files' column-major images as they are.
            x = (x.transpose(0, 2, 1) if spec.transposed else x)[:, None]
        xs.append(x)
        ys.append(np.asarray(ds.targets, dtype=np.int64))
    return np.ascontiguousarray(np.concatenate(xs)), np.concatenate(ys)


def load(name: str, root: str | Path, download_missing: bool) -> tuple[np.ndarray, np.ndarray]:
    """Pooled uint8 images and int64 labels of ``name`` (a key of :data:`SPECS`)."""
    root = Path(root).expanduser().absolute()  # relative roots: against the working directory
    if not download_missing:
        return load_from_disk(name, root)
    try:
        return download(name, root)
    except (OSError, RuntimeError) as exc:  # offline (URLError is an OSError), or torchvision's failed md5 check
        if isinstance(exc, OSError) and getattr(exc, "filename", None):
            raise  # a file system error on the root: hfl.errors.user_error names the path
        raise ConfigError("dataset.download", f"could not fetch {name} into {root} ({' '.join(str(exc).split())}); "
                                              "put its files there by hand and set dataset.download=false") from exc


def to_float(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """``(x / 255 - mean) / std`` per channel, float32; mean/std have shape (C,)."""
    x = images.astype(np.float32) / np.float32(255.0)
    x -= mean.astype(np.float32)[:, None, None]
    x /= std.astype(np.float32)[:, None, None]
    return x


def per_feature_standardizer(images: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """FedProx/pFedMe's MNIST recipe: standardize every pixel over the pooled data set,
    ``(x - mu) / (sigma + 0.001)`` on raw 0..255 values (the +0.001 guards constant pixels)."""
    flat = images.reshape(len(images), -1).astype(np.float64)
    mu, sigma = flat.mean(0), flat.std(0) + 0.001

    def standardize(a: np.ndarray) -> np.ndarray:
        out = (a.reshape(len(a), -1).astype(np.float64) - mu) / sigma
        return out.reshape(a.shape).astype(np.float32)

    return standardize
