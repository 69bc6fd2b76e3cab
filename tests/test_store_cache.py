"""The store's load cache (hfl.state.store): a file read back while unchanged comes from memory, and any
change to it — a save here, another process's write, a rollback — is read from the file."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from hfl.state import store as store_module
from hfl.state.store import StateStore, version_of


@pytest.fixture
def file_reads(monkeypatch):
    """How many times np.load opened a file."""
    count = {"n": 0}
    real = np.load

    def counting(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "load", counting)
    return count


def test_a_saved_key_is_read_back_from_memory_as_the_caller_own_copy(tmp_path, file_reads):
    store = StateStore(tmp_path, round=3)
    store.save("k", {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "ids": np.array([4, 7])})
    first = store.load("k")
    assert file_reads["n"] == 0
    np.testing.assert_array_equal(first["w"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert first["w"].dtype == np.float32 and set(first) == {"w", "ids"}
    first["w"][0, 0] = 99.0  # the caller's own: nothing stored changes
    assert store.load("k")["w"][0, 0] == 0.0
    assert version_of(tmp_path / "k.npz") == 3 and file_reads["n"] == 0
    # A fresh store over the same folder (a node rebuilt for its next message) shares the cache.
    assert StateStore(tmp_path).load("k")["ids"].tolist() == [4, 7] and file_reads["n"] == 0


def test_a_file_changed_by_another_writer_is_read_again(tmp_path, file_reads):
    store = StateStore(tmp_path)
    store.save("k", {"w": np.zeros(4)})
    assert store.load("k")["w"].tolist() == [0, 0, 0, 0]
    # Another process saves the key the same way (a new file renamed into place), same size.
    tmp = tmp_path / ".other.tmp.npz"
    np.savez(tmp, w=np.ones(4))
    os.replace(tmp, tmp_path / "k.npz")
    assert store.load("k")["w"].tolist() == [1, 1, 1, 1] and file_reads["n"] == 1
    assert store.load("k")["w"].tolist() == [1, 1, 1, 1] and file_reads["n"] == 1  # now cached
    # Written over in place (same inode), with other content of the same size: its time moved
    # (the pause: a file system may count modification times in ticks of a few milliseconds).
    np.savez(tmp, w=np.full(4, 2.0))
    time.sleep(0.05)
    (tmp_path / "k.npz").write_bytes(tmp.read_bytes())
    assert store.load("k")["w"].tolist() == [2, 2, 2, 2] and file_reads["n"] == 2
    (tmp_path / "k.npz").unlink()
    assert store.load("k") is None


def test_rollback_is_seen_through_the_cache(tmp_path):
    store = StateStore(tmp_path, round=1)
    store.save("k", {"w": np.array([1.0])})
    store.round = 2
    store.save("k", {"w": np.array([2.0])})
    assert store.load("k")["w"].tolist() == [2.0]
    store.rollback(1)
    assert store.load("k")["w"].tolist() == [1.0]
    store.clear()
    assert store.load("k") is None


def test_the_cache_is_bounded_least_recently_used_first(tmp_path, monkeypatch, file_reads):
    monkeypatch.setattr(store_module, "_CACHE", store_module._LoadCache(limit=3 * 800))
    store = StateStore(tmp_path)
    for key in "abcd":
        store.save(key, {"w": np.zeros(100)})  # 800 bytes each: three fit
    assert store.load("b") is not None and store.load("c") is not None and store.load("d") is not None
    assert file_reads["n"] == 0
    assert store.load("a") is not None and file_reads["n"] == 1  # dropped first, read from its file
    store.save("big", {"w": np.zeros(1000)})  # larger than the whole cache: never kept
    store.load("big")
    store.load("big")
    assert file_reads["n"] == 3


def test_a_pickled_object_array_is_not_cached_and_still_refused_on_load(tmp_path):
    store = StateStore(tmp_path)
    store.save("k", {"o": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(ValueError, match="allow_pickle"):
        store.load("k")
