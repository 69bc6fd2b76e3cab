"""Batched step loops as TorchScript (the dual form's, hfl.accel.mclr_dual; the closed forms' primal
loop gained nothing in whole runs, docs/performance.md): a scripted loop runs without holding Python's
GIL (so the size groups stepped on threads, ``runtime.batched_threads``, run in parallel instead
of taking turns at the interpreter) and dispatches each of its small tensor operations with less
overhead than Python. The same operations in the same order: the same floats as the plain
function (tests/test_scripted.py).

Run without TorchScript's graph optimisations (``torch.jit.optimized_execution(False)``, a
thread-local switch): no profiling runs and no fusion, on a GPU either, so exactly the operations
written, and a first call of milliseconds, not tens (measured: as fast afterwards on this CPU).

``torch.jit.script`` is deprecated in recent PyTorch (a FutureWarning) but kept; should it fail
or be gone, the plain Python function runs instead (logged once): slower, never different.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


class Scripted:
    """``fn`` compiled by ``torch.jit.script`` on first call (``python``: the plain function)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.python = fn
        self._compiled: Callable[..., Any] | None = None
        self._lock = threading.Lock()  # size-group threads may make the first call together

    def compiled(self) -> Callable[..., Any]:
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    self._compiled = self._script()
        return self._compiled

    def _script(self) -> Callable[..., Any]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the deprecation notice, see above
                return torch.jit.script(self.python)
        except Exception as error:  # noqa: BLE001 - any failure: run the plain function
            log.warning("TorchScript unavailable for %s (%s); running it in Python", self.python.__name__, error)
            return self.python

    def __call__(self, *args: Any) -> Any:
        compiled = self.compiled()
        with torch.jit.optimized_execution(False):
            return compiled(*args)


def scripted(fn: Callable[..., Any]) -> Scripted:
    """Decorator: ``fn`` run as TorchScript (see the module's docstring)."""
    return Scripted(fn)
