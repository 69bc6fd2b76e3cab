"""A Hydra sweep (``hfl-simulate -m ...``) that outlives its failed jobs.

Hydra's basic sweeper runs every job of a batch and then raises the first failed job's own
exception; hfl-simulate's one-line exit for an error the user can fix (a ``SystemExit``) would
even end the sweep at that job. Under ``-m`` the task raises ``JobFailed`` instead (an
Exception: Hydra records the job as FAILED and launches the next one), and the ``SweepFailures``
callback (registered in conf/config.yaml under ``hydra.callbacks``):

* prints one line per failed job on the console (its number, overrides and error; a bug's
  traceback goes to that job's log file) and appends it to ``<sweep dir>/failures.jsonl``;
* hands Hydra, in place of the job's exception, a ``SweepFailed``: a SystemExit, as every
  one-line error of hfl-simulate, whose line lists every failed job of the sweep (exit status 1).

A single run (no ``-m``) is left as it is: the callback only acts between on_multirun_start
and the end of that sweep.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from hfl.output import console

log = logging.getLogger("hfl")
FAILURES = "failures.jsonl"  # in the sweep directory, a line per failed job


class JobFailed(Exception):
    """A job of ``-m`` that stopped on an error the user can fix; the message is hfl-simulate's one line."""


class _Summary:
    """The sweep's last line, formed when Python prints it (at exit): every job has ended by then."""

    def __init__(self, tracker: SweepFailures) -> None:
        self.tracker = tracker

    def __str__(self) -> str:
        return self.tracker.summary()


class SweepFailed(SystemExit):
    """The sweep's outcome when some jobs failed. Hydra's sweeper raises it after the last job of its
    batch; a SystemExit passes Hydra's error report (which would add a traceback hint) and ends
    hfl-simulate with status 1, printing the line that lists every failed job."""

    def __init__(self, tracker: SweepFailures) -> None:
        super().__init__(_Summary(tracker))


def _error_line(exc: BaseException | None) -> str:
    """The one line for a failed job: hfl-simulate's own (JobFailed), else the exception's type and first line."""
    if isinstance(exc, JobFailed):
        return str(exc)
    if exc is None:
        return "failed without an exception"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0].strip()}" if text else type(exc).__name__


class SweepFailures(Callback):
    """Records each failed job of a sweep and lets the sweep go on (see the module's docstring)."""

    def __init__(self) -> None:
        self.failures: list[dict[str, Any]] | None = None  # None outside a sweep (a single run)
        self.jobs = 0
        self.path: Path | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.failures, self.jobs = [], 0
        self.path = Path(str(config.hydra.sweep.dir)) / FAILURES
        self.path.unlink(missing_ok=True)  # a sweep folder used again: only this sweep's failures

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if self.failures is None or self.path is None:
            return
        self.jobs += 1
        if job_return.status != JobStatus.FAILED:
            return
        # JobReturn.return_value re-raises a failed job's exception (and prints to stderr): read the field.
        exc = getattr(job_return, "_return_value", None)
        overrides = [str(o) for o in (job_return.overrides or [])]
        job_dir = str(config.hydra.runtime.output_dir)
        failure = {"job": int(config.hydra.job.num), "overrides": overrides, "error": _error_line(exc), "dir": job_dir}
        self.failures.append(failure)
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(failure) + "\n")
        where = console.log_file()
        if isinstance(exc, Exception) and not isinstance(exc, JobFailed):
            log.error("job #%d failed", failure["job"], exc_info=exc, extra={console.SHOW: "file"})  # a bug: its traceback
        log.error("#%d failed (%s): %s%s", failure["job"], " ".join(overrides), failure["error"],
                  f"; log: {where}" if where is not None else "", extra={console.SHOW: "multirun"})
        job_return.return_value = SweepFailed(self)  # what Hydra's sweeper raises once the batch has run

    def summary(self) -> str:
        """The sweep's last line: every failed job and where they are recorded."""
        failures = self.failures or []
        jobs = "; ".join(f"#{f['job']}: {f['error']}" for f in failures)  # their overrides: the lines above
        return (f"hfl-simulate: {len(failures)} of the {self.jobs} jobs run failed: {jobs}; "
                f"recorded in {self.path}")
