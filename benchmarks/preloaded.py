"""hfl-simulate runs forked from an interpreter that has already imported hfl, torch and Flower.

A sweep's runs are short (Table 1: 10-160 s each) and each used to spend ~3 s importing torch,
Flower and Hydra before its first round: ~4 minutes of a 78-run sweep. Here each run is still
its own process, with its own log, exit status and state, but is forked from multiprocessing's
forkserver, which imports ``PRELOAD`` once. Nothing is shared between runs but those imports: a
run configures logging, seeds and torch threads itself, as a fresh ``hfl-simulate`` does (test:
tests/test_sweep_runner.py, the same metrics either way).

The forkserver imports only modules: it never initializes CUDA or starts a thread, so a forked
run may use the GPU or Ray as a fresh process would.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Sequence
from pathlib import Path

# What a run imports before its first round (hfl.runtime.simulate pulls in torch, Flower, Hydra), and the
# plotting it does after its last.
PRELOAD = ["hfl.runtime.simulate", "hfl.output.run_report", "matplotlib.figure", "matplotlib.backends.backend_agg"]

_context: multiprocessing.context.BaseContext | None = None


def available() -> bool:
    """Whether this platform has a forkserver (Linux, macOS; not Windows)."""
    return "forkserver" in multiprocessing.get_all_start_methods()


def _forkserver() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def run_simulate(argv: Sequence[str], log: Path, cwd: Path) -> int:
    """``hfl-simulate argv[1:]`` (``argv[0]``: the program name it reports) in a process forked
    from the preloaded interpreter, in ``cwd``, its stdout and stderr appended to ``log``; returns
    its exit status (negative: killed by that signal, as ``subprocess`` reports it)."""
    process = _forkserver().Process(target=_simulate, args=(list(argv), str(log), str(cwd)), name="hfl-simulate")
    process.start()
    try:
        process.join()
    except BaseException:  # Ctrl-C in the sweep: do not leave the run behind
        process.terminate()
        process.join()
        raise
    assert process.exitcode is not None
    return process.exitcode


def _simulate(argv: list[str], log: str, cwd: str) -> None:
    """In the forked process: output to ``log`` (file descriptors, so that whatever holds
    sys.stdout/sys.stderr, Flower's log handler included, writes there too), then Hydra's main."""
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for fd in (1, 2):
        os.dup2(out, fd)
    os.close(out)
    os.chdir(cwd)
    sys.argv = argv
    from hfl.runtime.simulate import main

    main()
