"""Run outputs: metrics.jsonl (one line per evaluated global round), summary.json,
checkpoints, a line per evaluated round for the console, and at the end the run's plots
and report.md; each row and, at the end, the plots and report.md go to the run's tracker too
(the ``logger`` group, hfl.output.tracking), which never affects them."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flwr.common import NDArrays

from hfl.output import run_report, tracking
from hfl.output.console import PROJECT_LOGGERS, ROUND, SHOW, round_line
from hfl.process import interrupts
from hfl.state.resume import Checkpoint, rows_up_to, write_checkpoint
from hfl.state.store import atomic_savez, atomic_write_bytes
from hfl.tree.shape import path_order

if TYPE_CHECKING:
    from hfl.node.root import RoundDone

log = logging.getLogger("hfl")

LEVEL = re.compile(r"level([0-9]+)_accuracy")
TRAFFIC_KEYS = ("bytes_down_global", "bytes_up_global", "bytes_down_team", "bytes_up_team")


def traffic(counters: dict) -> dict[str, int]:
    """Bytes moved per tier (global = root edges, team = every edge below level 1) and per
    edge level (``bytes_down_level{d}``: sent by the servers at depth d; level0 = global)."""
    out = {key: int(counters.get(key, 0)) for key in TRAFFIC_KEYS}
    out["bytes_down_level0"], out["bytes_up_level0"] = out["bytes_down_global"], out["bytes_up_global"]
    levels = sorted((k for k in counters if k.startswith(("bytes_down_level", "bytes_up_level")) and k[-1].isdigit()),
                    key=lambda k: (int(k.rsplit("level", 1)[1]), k))
    out.update({k: int(counters[k]) for k in levels if not k.endswith("level0")})
    return out


def accuracy_keys(lines: list[dict]) -> list[str]:
    """Every model's accuracy key in the lines (any ``*_accuracy``: an algorithm may evaluate
    a model of its own), PM, GM and team first and always there (null when absent), then
    the levels by depth, then the others by name."""
    found = {key for line in lines for key in line if key.endswith("_accuracy")}
    levels = sorted((k for k in found if LEVEL.fullmatch(k)), key=lambda k: int(LEVEL.fullmatch(k).group(1)))
    first = ["pm_accuracy", "gm_accuracy", "team_accuracy", *levels]
    return first + sorted(found - set(first))


def _rewrite(path: Path, lines: list[str]) -> None:
    atomic_write_bytes(path, "".join(line + "\n" for line in lines).encode())


class WarningsKept(logging.Handler):
    """The warnings the console shows (hfl's own loggers', WARNING and above), once each, for
    report.md: a run whose figures came with a warning says so where its figures are read."""

    LIMIT = 50

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] not in PROJECT_LOGGERS or getattr(record, SHOW, None) == "file":
            return
        try:
            text = " ".join(record.getMessage().split())
        except Exception:  # noqa: BLE001 - logging's convention: never raise
            return
        if text not in self.into and len(self.into) < self.LIMIT:
            self.into.append(text)


class Recorder:
    """``restore`` (a ``state()`` with its ``round``): go on with a run resumed after that round;
    metrics.jsonl and samples.jsonl are cut back to it (hfl.state.resume). ``tracker``: a started
    tracker (hfl.output.tracking.begin) that gets each row after it is written, and the plots
    and report.md once they are drawn; its failures are logged once and never raised here."""

    def __init__(self, run_dir: str | Path, meta: dict, num_rounds: int, restore: dict | None = None,
                 tracker: tracking.Guarded | None = None) -> None:
        self.tracker = tracking.guarded(tracker)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "checkpoints").mkdir(exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        self.meta = meta
        self.num_rounds = num_rounds
        self.round_seconds: list[float] = []
        self.lines: list[dict] = []
        self.totals = dict.fromkeys(TRAFFIC_KEYS, 0)
        self.failures = 0
        # samples.jsonl's rows so far, counted and hashed: the checkpoint records both (resume.check_samples)
        self.samples_rows, self.samples_hash = 0, hashlib.sha256()
        self.warnings: list[str] = []  # the console's warnings, for report.md (WarningsKept)
        root = logging.getLogger()
        for handler in [h for h in root.handlers if isinstance(h, WarningsKept)]:
            root.removeHandler(handler)  # left by a run of this process that ended in an error
        self._kept = WarningsKept(self.warnings)
        root.addHandler(self._kept)
        if restore is None:
            _rewrite(self.metrics_path, [])
            self.samples_path.unlink(missing_ok=True)
            return
        self.round_seconds = list(restore["round_seconds"])
        self.lines = [dict(line) for line in restore["lines"]]
        self.totals = dict(restore["totals"])
        self.failures = int(restore["failures"])
        self.warnings[:0] = restore.get("warnings", [])
        # The checkpoint's lines are the rows of its rounds, written as round_done writes them.
        _rewrite(self.metrics_path, [json.dumps(line) for line in self.lines])
        # Checked against the checkpoint before anything ran (hfl.state.resume.check_samples).
        samples = rows_up_to(self.samples_path, "global_round", int(restore["round"]))
        _rewrite(self.samples_path, samples)
        for line in samples:
            self._count_sample(line)

    def state(self) -> dict:
        """What a resumed run's recorder needs (hfl.state.resume)."""
        return {"round_seconds": list(self.round_seconds), "lines": [dict(line) for line in self.lines],
                "totals": dict(self.totals), "failures": self.failures,
                "warnings": list(self.warnings),
                "samples": {"rows": self.samples_rows, "sha256": self.samples_hash.hexdigest()}}

    def _count_sample(self, line: str) -> None:
        self.samples_rows += 1
        self.samples_hash.update(line.encode() + b"\n")  # as resume.samples_digest hashes the file's rows

    def observe(self, done: RoundDone) -> None:
        """A finished global round of the root's loop (hfl.node.root.RootServer), written down."""
        if done.never_merged:  # summary.json says so (the recorder writes its meta into it)
            self.meta["never_merged"] = done.never_merged
        self.round_done(done.round, done.seconds, done.counters, done.evaluation, done.model)

    def round_done(self, rnd: int, seconds: float, counters: dict, evaluation: dict | None, model: NDArrays,
                   checkpoint: bool = True) -> None:
        """Record global round ``rnd`` and (``checkpoint``) write the checkpoint a killed run
        resumes from, before the last round's summary and plots."""
        interrupts.hold_if_stopping()
        self.round_seconds.append(seconds)
        self.failures += int(counters.get("failures", 0))
        moved = traffic(counters)
        for key, value in moved.items():
            self.totals[key] = self.totals.get(key, 0) + value
        if counters.get("samples"):
            with self.samples_path.open("a") as f:
                records = [record for block in counters["samples"] for record in json.loads(block)]
                # Level-1 nodes answer in any order: write the records in tree order.
                for record in sorted(records, key=lambda r: (path_order(r["node"]), path_order(r["round"]))):
                    line = json.dumps({"global_round": rnd, **record})
                    f.write(line + "\n")
                    self._count_sample(line)
        if evaluation is not None:
            line = {"round": rnd, **evaluation, "seconds": seconds,
                    "compute_seconds": counters.get("compute_seconds", 0.0),
                    "failures": int(counters.get("failures", 0)),
                    "evaluation_failures": int(counters.get("evaluation_failures", 0)),
                    **{k: int(v) for k, v in counters.items() if k.startswith(("failures_level", "late_level",
                                                                                "stale_level", "dp_clipped_level"))},
                    **({"sim_time": counters["sim_time"]} if "sim_time" in counters else {}),
                    **({"dp_epsilon": counters["dp_epsilon"]} if "dp_epsilon" in counters else {}),
                    **moved}
            self.lines.append(line)
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(line) + "\n")
            if self.tracker is not None:
                self.tracker.log_round(line)
            atomic_savez(self.run_dir / "checkpoints" / "global_model.npz", *model, round=np.array(rnd))
            # The console shows this line (hfl.output.console); ROUND moves its progress bar.
            log.info("%s", round_line(line, self.num_rounds), extra={ROUND: rnd, SHOW: "run"})
        else:
            spent = f", ε {counters['dp_epsilon']:.3g}" if "dp_epsilon" in counters else ""  # privacy (hfl.node.privacy)
            log.info("round %d/%d trained, not evaluated%s, %.2fs", rnd, self.num_rounds, spent, seconds,
                     extra={ROUND: rnd})
        if checkpoint:
            write_checkpoint(self.run_dir, Checkpoint(rnd, self.state()))
        if rnd == self.num_rounds or counters.get("dp_budget_stop"):  # the last round, or the privacy budget's
            if counters.get("dp_budget_stop"):
                self.meta["stopped"] = f"privacy.target_epsilon reached after global round {rnd}"
            self.finish()

    def finish(self) -> dict:
        """summary.json, the plots and report.md, and the tracker's artifacts; the summary."""
        summary = self.write_summary()
        logging.getLogger().removeHandler(self._kept)
        self.draw()
        if self.tracker is not None:
            self.tracker.finish(self.run_dir)
        return summary

    def draw(self) -> None:
        """accuracy.png, loss.png and report.md in the run directory. The run has finished by
        now: a plotting failure costs the pictures, never the run."""
        try:
            run_report.write_run_report(self.run_dir, self.warnings)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - hfl.output.report fails with SystemExit too
            log.warning("could not draw the run's plots and report.md in %s: %s", self.run_dir, exc)

    def write_summary(self) -> dict:
        def best(key: str) -> float | None:
            values = [line[key] for line in self.lines if line.get(key) is not None]
            return max(values) if values else None

        last = self.lines[-1] if self.lines else {}
        keys = accuracy_keys(self.lines)
        later = self.round_seconds[1:] or self.round_seconds
        summary = {
            **self.meta,
            "rounds": len(self.round_seconds),
            "final": {key: last.get(key) for key in keys},
            "best": {key: best(key) for key in keys},
            "seconds_per_round": statistics.median(later) if later else None,
            "total_seconds": sum(self.round_seconds),
            "failures": self.failures,
            **{f"total_{key}": value for key, value in self.totals.items()},
        }
        atomic_write_bytes(self.run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
        return summary
