"""Node-local, file-backed state keyed by name (device ids, team ids).

Flower ships ``context.state`` to the simulation actor and back on every message, and Ray
actors do not stick to nodes, so per-device models live here instead (DESIGN.md).

Versions, for resuming a killed run (hfl.state.resume): a store told the global round it computes
(``round``; a node sets it when its fit starts) tags what it saves with that round and keeps
the key's previous version — the newest one saved in an earlier round — under ``previous/``.
``<root>/<key>.npz`` is always the newest version (what ``load`` reads). A run killed during
global round R+1 is resumed after ``rollback(R)``: every key goes back to its newest version
of round R or before, whatever round R+1 had already written.

Reads are served from memory while a file is unchanged (``_LoadCache``): a node's device table is
read by each of its messages, fit and evaluation, and written by its fits.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

ROUND = "__round__"  # the tag saved inside each file; load() strips it
PREVIOUS = "previous"
TMP = re.compile(r"^\..*\.tmp\.npz$")
# What the load cache may hold, per process (least recently used files dropped beyond it).
LOAD_CACHE_BYTES = 128 * 2**20

Signature = tuple[int, int, int]


def _signature(path: str) -> Signature:
    """Inode, size and modification time. Every save writes a new file and renames it into
    place, so a file saved again, by any process, gets a new inode or a later time; only a save
    that reused the inode within the file system's time resolution (nanoseconds on ext4 here)
    and kept the size could look unchanged, and a node saves a key once per message."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


class _LoadCache:
    """Stored files' arrays by path, valid while the file's ``_signature`` is the one they were
    read or written with. The arrays are read-only: whoever loads them shares them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: OrderedDict[str, tuple[Signature, dict[str, np.ndarray], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # nodes of one process load and save from several threads

    def get(self, path: str, signature: Signature) -> dict[str, np.ndarray] | None:
        with self._lock:
            entry = self._entries.get(path)
            if entry is None or entry[0] != signature:
                return None
            self._entries.move_to_end(path)
            return entry[1]

    def drop(self, path: str) -> None:
        with self._lock:
            self._pop(path)

    def _pop(self, path: str) -> None:  # the lock held
        old = self._entries.pop(path, None)
        if old is not None:
            self._bytes -= old[2]

    def put(self, path: str, signature: Signature, arrays: dict[str, np.ndarray]) -> None:
        size = sum(a.nbytes for a in arrays.values())
        for a in arrays.values():
            a.flags.writeable = False
        with self._lock:
            self._pop(path)
            if size > self.limit:
                return
            self._entries[path] = (signature, arrays, size)
            self._bytes += size
            while self._bytes > self.limit:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped


_CACHE = _LoadCache(LOAD_CACHE_BYTES)


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray] | None:
    """Every array of a stored file (read-only, shared), or None if there is none: from memory
    while the file is the one last read or written here."""
    path = os.path.abspath(path)
    try:
        signature = _signature(path)  # before reading: a file replaced meanwhile is read again later
    except FileNotFoundError:
        return None
    arrays = _CACHE.get(path, signature)
    if arrays is None:
        with np.load(path) as data:
            arrays = {name: data[name] for name in data.files}
        _CACHE.put(path, signature, arrays)
    return arrays


def _write(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``atomic_savez``, and the arrays kept as the file's cached content (copies: the caller
    keeps its own)."""
    signature = atomic_savez(path, **arrays)
    path = os.path.abspath(path)
    values = [np.asanyarray(a) for a in arrays.values()]
    # No copy where none would be kept: np.load refuses pickled objects, and a file over the
    # cache's bound never enters it (a node's CNN device table can be hundreds of MiB).
    if any(a.dtype == object for a in values) or sum(a.nbytes for a in values) > _CACHE.limit:
        _CACHE.drop(path)
        return
    _CACHE.put(path, signature, {name: np.array(a, copy=True) for name, a in zip(arrays, values, strict=True)})


class StateStore:
    def __init__(self, root: str | os.PathLike, round: int | None = None) -> None:  # noqa: A002 - the global round
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.round = round  # the global round being computed: what save() tags versions with (None: untagged)

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.npz"

    def _previous(self, key: str) -> Path:
        return self.root / PREVIOUS / f"{key}.npz"

    def load(self, key: str) -> dict[str, np.ndarray] | None:
        """The key's newest arrays, or None: the caller's own (copies of the cached ones, as
        writable as a fresh read: whoever changes them in place changes nothing stored)."""
        arrays = read_npz(self._path(key))
        return None if arrays is None else {name: a.copy() for name, a in arrays.items() if name != ROUND}

    def save(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        path = self._path(key)
        if self.round is None:
            _write(path, arrays)
            return
        current = read_npz(path)  # one look at the file: whether it exists, and its round
        if current is not None and _round_in(current) != self.round:
            # The first save of this round: the version before it becomes the previous one (an
            # older previous version is dropped). Killed between the steps, the key has its
            # newest version as the current or the previous one, which rollback() restores.
            # The older one is removed first, not renamed over: ext4 flushes a file renamed over
            # another to disk then (auto_da_alloc), ~0.25 ms a save on this machine's ext4.
            (self.root / PREVIOUS).mkdir(exist_ok=True)
            previous = self._previous(key)
            previous.unlink(missing_ok=True)
            os.replace(path, previous)
        _write(path, {**arrays, ROUND: np.array(self.round, dtype=np.int64)})

    def versions(self, key: str) -> list[tuple[int, Path]]:
        """The key's stored versions, (round, file), newest first; an untagged file counts as round 0."""
        found = [(version_of(p), p) for p in (self._path(key), self._previous(key)) if p.exists()]
        return sorted(found, key=lambda v: -v[0])

    def rollback(self, last_round: int) -> None:
        """Every key back to its newest version of ``last_round`` or earlier (a key with none is
        removed); half-written files are removed. Run it while no node is running."""
        keys: set[str] = set()
        for folder in (self.root, self.root / PREVIOUS):
            if not folder.is_dir():
                continue
            for path in folder.iterdir():
                if TMP.match(path.name):
                    path.unlink(missing_ok=True)
                elif path.suffix == ".npz" and path.is_file():
                    keys.add(path.name[: -len(".npz")])
        for key in sorted(keys):
            kept = False
            for rnd, path in self.versions(key):  # newest first
                if rnd > last_round or kept:
                    if rnd > last_round:
                        path.unlink()
                    continue
                if path != self._path(key):
                    os.replace(path, self._path(key))
                kept = True

    def clear(self) -> None:
        """Remove every stored key (a fresh run in a directory that held another)."""
        for path in self.root.iterdir():
            if path.name == PREVIOUS and path.is_dir():
                shutil.rmtree(path)
            elif path.suffix == ".npz" and path.is_file():
                path.unlink()


def version_of(path: Path) -> int:
    """The global round a stored file was saved in (0 when untagged)."""
    arrays = read_npz(path)
    if arrays is None:
        raise FileNotFoundError(path)
    return _round_in(arrays)


def _round_in(arrays: dict[str, np.ndarray]) -> int:
    """The round tag among a stored file's arrays (0 when untagged)."""
    return int(arrays[ROUND]) if ROUND in arrays else 0


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file beside ``path``, then rename: a crash, or a reader polling for
    the file, never sees half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def atomic_savez(path: str | os.PathLike, *args: np.ndarray, **kwargs: np.ndarray) -> Signature:
    """``np.savez`` to a temporary file, then rename: a crash, or a reader polling for the
    file, never sees half of it. Returns the saved file's ``_signature``."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, *args, **kwargs)
    signature = _signature(str(tmp))  # a rename keeps inode and mtime: the saved file's
    os.replace(tmp, path)
    return signature
