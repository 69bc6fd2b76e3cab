"""Node-local, file-backed state keyed by name (device ids, team ids).

Flower ships ``context.state`` to the simulation actor and back on every message, and Ray
actors do not stick to nodes, so per-device models live here instead (DESIGN.md).

Versions, for resuming a killed run (hfl.state.resume): a store told the global round it computes
(``round``; a node sets it when its fit starts) tags what it saves with that round and keeps
the key's previous version — the newest one saved in an earlier round — under ``previous/``, and
the one before that under ``older/``: a run killed in round R+2 whose round-R+1 checkpoint is
damaged goes on from its round-R checkpoint, whose versions are still there.
``<root>/<key>.npz`` is always the newest version (what ``load`` reads). A run killed during
global round R+1 is resumed after ``rollback(R)``: every key goes back to its newest version
of round R or before, whatever round R+1 had already written; a version that cannot be read (a
torn write) counts as absent.

Durability: saves are not fsynced one by one (a round saves many small files). A checkpoint
commits a round (``commit``): every file written since the last commit is fsynced once, then the
folders, and only then is the checkpoint written; after a power cut the store holds at least
what its last checkpoint needs, and rollback discards whatever later rounds left.

Reads are served from memory while a file is unchanged (``_LoadCache``): a node's device table is
read by each of its messages, fit and evaluation, and written by its fits.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import zipfile
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROUND = "__round__"  # the tag saved inside each file; load() strips it
PREVIOUS = "previous"
OLDER = "older"  # the version before the previous one: what the checkpoint before the newest needs
TMP = re.compile(r"^\..*\.tmp\.npz$")
# What the load cache may hold, per process (least recently used files dropped beyond it).
LOAD_CACHE_BYTES = 128 * 2**20

Signature = tuple[int, int, int]
# What reading a torn, emptied or garbled .npz raises (np.load and zipfile; CRCs checked on read).
UNREADABLE = (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile)


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

    def _older(self, key: str) -> Path:
        return self.root / OLDER / f"{key}.npz"

    def _folders(self) -> tuple[Path, Path, Path]:
        """Where the versions are: the newest, the previous, the older."""
        return self.root, self.root / PREVIOUS, self.root / OLDER

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
            # The first save of this round: the version before it becomes the previous one, the
            # previous one the older one (an older one than that is dropped). Killed between the steps, the key has its
            # newest version as the current or the previous one, which rollback() restores.
            # The older one is removed first, not renamed over: ext4 flushes a file renamed over
            # another to disk then (auto_da_alloc), ~0.25 ms a save on this machine's ext4.
            (self.root / PREVIOUS).mkdir(exist_ok=True)
            previous = self._previous(key)
            if previous.exists():
                (self.root / OLDER).mkdir(exist_ok=True)
                older = self._older(key)
                older.unlink(missing_ok=True)
                os.replace(previous, older)
            os.replace(path, previous)
        _write(path, {**arrays, ROUND: np.array(self.round, dtype=np.int64)})

    def versions(self, key: str) -> list[tuple[int, Path]]:
        """The key's readable versions, (round, file), newest first; an untagged file counts as round 0."""
        found = [(rnd, p) for rnd, p in self._versions(key) if rnd is not None]
        return sorted(found, key=lambda v: -v[0])

    def _versions(self, key: str) -> list[tuple[int | None, Path]]:
        """(round, file) for each of the key's files; round None: unreadable (read whole, CRCs checked)."""
        out: list[tuple[int | None, Path]] = []
        for path in (self._path(key), self._previous(key), self._older(key)):
            try:
                arrays = read_npz(path)
            except UNREADABLE:
                out.append((None, path))
                continue
            if arrays is not None:
                out.append((_round_in(arrays), path))
        return out

    def keys(self) -> list[str]:
        """Every key with a file, current or previous."""
        keys: set[str] = set()
        for folder in self._folders():
            if folder.is_dir():
                keys.update(p.name[: -len(".npz")] for p in folder.iterdir()
                            if p.suffix == ".npz" and not TMP.match(p.name) and p.is_file())
        return sorted(keys)

    def plan(self, last_round: int) -> tuple[dict[str, tuple[int, Path]], list[Path]]:
        """What ``rollback(last_round)`` keeps, without touching anything: each key's newest
        readable version of that round or before, (round, file); and the unreadable files."""
        kept: dict[str, tuple[int, Path]] = {}
        damaged: list[Path] = []
        for key in self.keys():
            versions = self._versions(key)
            damaged += [p for rnd, p in versions if rnd is None]
            usable = sorted(((rnd, p) for rnd, p in versions if rnd is not None and rnd <= last_round),
                            key=lambda v: -v[0])
            if usable:
                kept[key] = usable[0]
        return kept, damaged

    def rollback(self, last_round: int) -> list[Path]:
        """Every key back to its newest readable version of ``last_round`` or earlier (a key with
        none is removed); half-written and unreadable files are removed. Returns the unreadable
        files it removed. Run it while no node is running."""
        for folder in self._folders():
            if folder.is_dir():
                for path in folder.iterdir():
                    if TMP.match(path.name):
                        path.unlink(missing_ok=True)
        kept, damaged = self.plan(last_round)
        for path in damaged:
            path.unlink(missing_ok=True)
        for key in self.keys():
            versions = [(rnd, path) for rnd, path in self._versions(key) if rnd is not None]
            for rnd, path in versions:
                if rnd > last_round:
                    path.unlink()
            # An older version stays where it is: an older checkpoint may still need it.
            chosen = kept.get(key, (None, None))[1]
            if chosen is not None and chosen != self._path(key):
                os.replace(chosen, self._path(key))
        self._sync_folders()
        return damaged

    def commit(self, since_ns: int = 0) -> tuple[dict[str, int], int]:
        """Make the store durable as it is now, for a checkpoint: fsync every file modified at or
        after ``since_ns`` (0: every file), then its folders (the renames). Returns each key's
        round (the checkpoint's manifest: what a resumption must find) and the newest modification
        time seen, the next commit's ``since_ns`` (the file system's own clock: files written on
        other Ray nodes compare alike; a file of the same clock tick is fsynced twice, no harm)."""
        manifest: dict[str, int] = {}
        changed: list[Path] = []
        newest = since_ns
        for folder in self._folders():
            if not folder.is_dir():
                continue
            for path in folder.iterdir():
                if path.suffix != ".npz" or TMP.match(path.name):
                    continue
                try:  # a straggling node (one its parent timed out) may be replacing it
                    mtime = path.stat().st_mtime_ns
                    if folder == self.root:
                        manifest[path.name[: -len(".npz")]] = _round_of(path)
                except FileNotFoundError:
                    continue
                if mtime >= since_ns:
                    changed.append(path)
                    newest = max(newest, mtime)
        _fsync_all(changed)
        self._sync_folders()
        return manifest, newest

    def _sync_folders(self) -> None:
        fsync_dir(self.root)
        for folder in (PREVIOUS, OLDER):
            if (self.root / folder).is_dir():
                fsync_dir(self.root / folder)

    def clear(self) -> None:
        """Remove every stored key (a fresh run in a directory that held another)."""
        for path in self.root.iterdir():
            if path.name in (PREVIOUS, OLDER) and path.is_dir():
                shutil.rmtree(path)
            elif path.suffix == ".npz" and path.is_file():
                path.unlink()


def version_of(path: Path) -> int:
    """The global round a stored file was saved in (0 when untagged)."""
    arrays = read_npz(path)
    if arrays is None:
        raise FileNotFoundError(path)
    return _round_in(arrays)


def _round_of(path: Path) -> int:
    """A stored file's round tag, reading only the tag (or the cached arrays)."""
    path_str = os.path.abspath(path)
    arrays = _CACHE.get(path_str, _signature(path_str))
    if arrays is not None:
        return _round_in(arrays)
    with np.load(path_str) as data:
        return int(data[ROUND]) if ROUND in data.files else 0


def _round_in(arrays: dict[str, np.ndarray]) -> int:
    """The round tag among a stored file's arrays (0 when untagged)."""
    return int(arrays[ROUND]) if ROUND in arrays else 0


def _fsync(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_all(paths: list[Path]) -> None:
    """fsync the files at once: ext4 commits its journal once for all of them, not once each (a
    round's 9 files, on this machine under load: 27-39 ms one by one, 5-6 ms at once)."""
    if len(paths) <= 1:
        for path in paths:
            _fsync(path)
        return
    with ThreadPoolExecutor(max_workers=min(16, len(paths))) as pool:
        list(pool.map(_fsync, paths))


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder: its renames and new entries survive a power cut."""
    _fsync(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, sync: bool = False,
                       keep: str | os.PathLike | None = None) -> None:
    """Write to a temporary file beside ``path``, then rename: a crash, or a reader polling for
    the file, never sees half of it. ``sync``: durable once it returns (the file fsynced before
    the rename, the folder after). ``keep``: the file it replaces is first renamed there."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    if keep is not None and path.exists():
        os.replace(path, keep)
    os.replace(tmp, path)
    if sync:
        fsync_dir(path.parent)


def atomic_savez(path: str | os.PathLike, *args: np.ndarray, **kwargs: np.ndarray) -> Signature:
    """``np.savez`` to a temporary file, then rename: a crash, or a reader polling for the
    file, never sees half of it. Returns the saved file's ``_signature``."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, *args, **kwargs)
    signature = _signature(str(tmp))  # a rename keeps inode and mtime: the saved file's
    os.replace(tmp, path)
    return signature
