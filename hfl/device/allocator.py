"""glibc's malloc set for processes that train: model-sized tensors are freed and allocated again
every step, and by default glibc hands the larger ones back to the kernel (``mmap``/trim) each
time, so every step touches fresh zeroed pages. For hfl's MNIST CNN (a 9.4 MB gradient a step)
that was 370-670 page faults a step on one thread; with the heap kept (the thresholds below), 0-6
(``resource.getrusage`` around 200 steps of ``run_local_steps``). The cost: a process keeps up to
``TRIM_BYTES`` of freed memory for its next allocations instead of returning it.

Linux with glibc only; elsewhere (another C library, macOS) nothing changes. Environment
variables a user sets (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) win over these."""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_BYTES = 32 << 20   # glibc's largest: allocations below it come from the heap, not fresh mappings
TRIM_BYTES = 128 << 20  # free memory at the heap's top a process keeps


def keep_freed_memory() -> bool:
    """Keep freed memory in this process's heap (module docstring); whether glibc took it. Once a
    process: Flower's simulation builds a node's client for every message."""
    global _TOOK
    if _TOOK is None:
        _TOOK = _set_thresholds()
    return _TOOK


_TOOK: bool | None = None


def _set_thresholds() -> bool:
    if not sys.platform.startswith("linux") or any(k.startswith("MALLOC_") and k.endswith("THRESHOLD_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on (no lookup)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
