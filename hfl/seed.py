"""One seed drives everything: derive independent, stable sub-seeds from it."""

from __future__ import annotations

import functools
import zlib

import numpy as np


@functools.lru_cache(maxsize=2**16)  # a node derives its devices' seeds every round: SeedSequence is slow
def derive_seed(seed: int, *keys: str | int) -> int:
    """A 32-bit seed derived from ``seed`` and a path of keys (stable across runs)."""
    words = [int(seed) & 0xFFFFFFFF]
    for key in keys:
        words.append(zlib.crc32(str(key).encode()) if isinstance(key, str) else int(key) & 0xFFFFFFFF)
    return int(np.random.SeedSequence(words).generate_state(1)[0])


def rng(seed: int, *keys: str | int) -> np.random.Generator:
    """A NumPy generator for the stream named by ``keys``."""
    return np.random.default_rng(derive_seed(seed, *keys))
