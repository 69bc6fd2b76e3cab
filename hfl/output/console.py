"""What ``hfl-simulate`` prints: the start-up's phases (Ray's start, its actors ready), a line
per evaluated round, a progress bar while it runs (terminals only) and a summary table at the end;
under Hydra's ``-m`` each job's start-up and round lines led by the job's number and swept
overrides (``#1 seed=1: round 3/30 ...``), and one line when it ends.

Everything goes through :mod:`logging`, so the run's log file (Hydra's file handler) keeps
every record, Flower's and Ray's included, while :class:`ConsoleHandler` decides what the
console shows:

* records marked with ``extra={SHOW: mode}`` in that mode only ("run": a single run,
  "multirun": a job of ``-m``, "file": never), but for a run's round and start-up lines
  (``ROUND``, ``STARTUP``), which a job of ``-m`` shows too, after its ``prefix``;
* Ray's and Flower's start-up milestones (Ray started, its actors ready: ``MILESTONES``) as hfl's
  own start-up lines, so a run without a terminal is not silent until round 1;
* warnings and errors of hfl's own loggers (hfl, strategies, clients);
* errors of any other logger (a Flower crash must be seen); while ``errors_held`` is in force
  they and the nodes' warnings wait for the run to go on (shown before its next round line) or
  to end, and are left to the file when the run ends in an error that explains them (one line,
  not a page of tracebacks);
* with ``runtime.verbose=true``, everything, formatted as Hydra does.

A record with ``extra={ROUND: r}`` ends global round r and moves the progress bar.
"""

from __future__ import annotations

import io
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console, Group, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from hfl.output.report import CLIENT_MEAN, Level, Run, final_value, first_value, model_levels
from hfl.output.run_report import TRAFFIC_TEXT, human_bytes, level_results, run_title, traffic_rows

ROUND = "hfl_round"  # the global round a record ends
SHOW = "hfl_show"  # "run" | "multirun" | "file": where a record appears besides the log file
RENDER = "hfl_render"  # a rich renderable the console prints instead of the message
STARTUP = "hfl_startup"  # a start-up phase's line: shown by a run and by each job of -m
PROJECT_LOGGERS = ("hfl", "strategies", "clients")
MODES = ("run", "multirun", "verbose")
HYDRA_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
RUN_FILES = ("metrics.jsonl", "summary.json", "report.md", "accuracy.png", "loss.png")


# Other loggers' records that mark a start-up phase: (logger prefix, message pattern, hfl's line). Their
# wording is Ray's and Flower's: should it change, the line is not shown and nothing else changes.
# {0}...: the pattern's groups; {seconds}: since the start-up line before it.
MILESTONES = (
    ("ray", re.compile(r"Started a local Ray instance"), "Ray started in {seconds:.1f} s"),
    ("ray", re.compile(r"Connected to Ray cluster"), "joined the Ray cluster in {seconds:.1f} s"),
    ("flwr", re.compile(r"Constructed ActorPool with: (\d+) actors"),
     "Ray's {0} actors ready in {seconds:.1f} s; round 1 first builds each level-1 node and its devices in its actor"),
)


def milestone(record: logging.LogRecord, seconds: float) -> str | None:
    """hfl's start-up line for another logger's record that marks a phase (``seconds`` after the
    start-up line before it), or None."""
    for prefix, pattern, text in MILESTONES:
        if record.name.split(".")[0] == prefix:
            try:
                found = pattern.search(record.getMessage())
            except Exception:  # noqa: BLE001 - a malformed record is no milestone
                return None
            if found:
                return text.format(*found.groups(), seconds=seconds)
    return None


def short_label(level: Level) -> str:
    """PM, level1, level2, ..., GM, GM proxy, any other model by its name: the names report.md,
    hfl-report and the trackers use."""
    return level.name


def round_line(line: Mapping, num_rounds: int) -> str:
    """The console line of an evaluated round (a metrics.jsonl line): every model level's
    accuracy from the devices up, the GM loss (PM loss without a GM) and the round's seconds.

    ``round  3/30  PM  81.87%  level1  25.59%  GM  25.07%  GM loss 2.1031  1.51s``"""
    parts = [f"round {line['round']:>{len(str(num_rounds))}}/{num_rounds}"]
    for level in model_levels(key for key, value in line.items() if value is not None):
        accuracy = first_value(line, level.keys("accuracy"))
        if accuracy is not None:
            parts.append(f"{short_label(level)} {100 * accuracy:6.2f}%")
    for name, key in (("GM", "gm_loss"), ("PM", "pm_loss")):
        if first_value(line, (key,)) is not None:
            parts.append(f"{name} loss {line[key]:.4f}")
            break
    tested = [int(v) for k, v in line.items() if k.endswith("_eval_devices") and v is not None]
    if tested:  # a sampled evaluation (eval_fraction): the devices behind the figures
        parts.append(f"tested on {max(tested):,} devices")
    if line.get("dp_epsilon") is not None:  # differential privacy: the ε spent so far (hfl.node.privacy)
        parts.append(f"ε {float(line['dp_epsilon']):.3g}")
    parts.append(f"{float(line.get('seconds') or 0):.2f}s")
    return "  ".join(parts)


def plural(count: int, noun: str) -> str:
    """``1 global round``, ``2 global rounds``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def shown_path(path: Path) -> str:
    """Relative to the working directory when below it (outputs/...), else absolute."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f}%"


def client_mean_keys(level: Level) -> tuple[str, ...]:
    """The metric names of a level's client mean (its devices' accuracies, unweighted mean)."""
    return tuple(f"{prefix}_{CLIENT_MEAN}_accuracy" for prefix in level.prefixes)


def client_means(run: Run, level: Level) -> tuple[float | None, float | None]:
    """A level's client mean at the last evaluated round and at its best one."""
    keys = client_mean_keys(level)
    values = [value for line in run.metrics if (value := first_value(line, keys)) is not None]
    return final_value(run, keys), max(values, default=None)


def summary_renderable(run: Run, log_file: Path | None) -> RenderableType:
    """The end-of-run summary, a few lines: what ran and how fast, final and best accuracy
    per model level (and, where the run reports them, the levels' client means: the devices'
    accuracies averaged unweighted), bytes per level, where the outputs are."""
    summary = run.summary
    per_round = summary.get("seconds_per_round")
    title = (f"{run_title(run)}, {plural(summary.get('rounds') or 0, 'global round')}: "
             f"{'—' if per_round is None else f'{per_round:.2f}'} s per round (median after the first), "
             f"{summary.get('total_seconds', 0):.1f} s in all, {summary.get('failures', 0)} failures")
    table = Table(box=None, pad_edge=False, header_style="bold")
    results = level_results(run)
    means = [client_means(run, result.level) for result in results]
    shown_means = any(value is not None for pair in means for value in pair)
    columns = [("model", "left"), ("final", "right"), ("best", "right"), ("best round", "right")]
    columns += [("client mean final", "right"), ("client mean best", "right")] if shown_means else []
    for column, justify in columns:
        table.add_column(column, justify=justify)
    for result, (mean_final, mean_best) in zip(results, means, strict=True):
        cells = [short_label(result.level), _percent(result.final), _percent(result.best),
                 "—" if result.best_round is None else str(result.best_round)]
        table.add_row(*cells, *([_percent(mean_final), _percent(mean_best)] if shown_means else []))
    traffic = f"bytes down/up {TRAFFIC_TEXT}: " + ", ".join(
        f"{level} {human_bytes(down)} / {human_bytes(up)}" for level, down, up in traffic_rows(summary))
    files = [name for name in RUN_FILES if (run.path / name).exists()]
    if log_file is not None and log_file.exists():
        files.append(log_file.name)
    outputs = f"outputs: {shown_path(run.path)}/  " + " ".join(files)
    return Group(Text(title), table, Text(traffic), Text(outputs))


def job_line(run: Run, job: int) -> str:
    """The one line hfl prints for a multirun job, under Hydra's own "#<job> : <overrides>"
    line: final accuracies, speed and where the outputs are."""
    finals = "  ".join(f"{short_label(r.level)} {_percent(r.final)}" for r in level_results(run) if r.final is not None)
    per_round = run.summary.get("seconds_per_round") or 0.0
    return (f"#{job} done: {run.algorithm} on {run.dataset}/{run.model}, final {finals}  "
            f"{per_round:.2f} s/round  -> {shown_path(run.path)}")


def plain_text(renderable: RenderableType, width: int = 120) -> str:
    """A renderable as plain text, for the log file (long lines left whole)."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False, soft_wrap=True).print(renderable)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


class ConsoleHandler(logging.Handler):
    """Prints what the console should show (see the module's docstring) above a rich
    progress bar; the bar exists only on a terminal, so pipes and CI get the lines alone."""

    def __init__(self, mode: str = "run", console: Console | None = None) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        # No file given: rich writes to whatever sys.stdout is at the time (pytest swaps it).
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.setFormatter(logging.Formatter(HYDRA_FORMAT))
        self._progress: Progress | None = None
        self._task = None
        self._held: list[logging.LogRecord] | None = None  # other loggers' errors, while errors_held
        self.prefix = ""  # a -m job's "#<job> <swept overrides>: " before its round and start-up lines
        self.phase_started = time.monotonic()  # when the last start-up line was logged

    def shows(self, record: logging.LogRecord) -> bool:
        if self.mode == "verbose":
            return True
        show = getattr(record, SHOW, None)
        if self.mode == "multirun" and show in (None, "run") and self._progress_line(record):
            return True
        if show is not None:
            return show == self.mode
        if record.name.split(".")[0] in PROJECT_LOGGERS:
            return record.levelno >= logging.WARNING
        return record.levelno >= logging.ERROR

    def render(self, record: logging.LogRecord) -> RenderableType:
        renderable = getattr(record, RENDER, None)
        if renderable is not None:
            return renderable
        if self.mode == "verbose":
            return Text(self.format(record))
        text = record.getMessage()
        if self.mode == "multirun" and self._progress_line(record):
            text = self.prefix + text.removeprefix("hfl: ")
        if record.exc_info:
            text += "\n" + self.formatter.formatException(record.exc_info)
        if record.levelno < logging.WARNING:
            return Text(text)
        return Text(f"{record.levelname}: {text}", style="red" if record.levelno >= logging.ERROR else "yellow")

    @staticmethod
    def _progress_line(record: logging.LogRecord) -> bool:
        """A round line (evaluated: shown in a run) or a start-up line."""
        return getattr(record, STARTUP, False) or (getattr(record, ROUND, None) is not None
                                                    and getattr(record, SHOW, None) == "run")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if getattr(record, STARTUP, False):
                self.phase_started = time.monotonic()
            elif self.mode != "verbose" and (line := milestone(record, time.monotonic() - self.phase_started)):
                # logged as hfl's, so the log file has it too (this handler's lock is re-entrant)
                logging.getLogger("hfl").info("hfl: %s", line, extra={SHOW: "run", STARTUP: True})
            if self._held is not None and self._holds(record):
                self._held.append(record)
                return
            if getattr(record, ROUND, None) is not None:
                self._release()  # the run went on after them
                if self._progress is not None:
                    self._progress.update(self._task, completed=getattr(record, ROUND))
            if self.shows(record):
                self.console.print(self.render(record))
        except Exception:  # noqa: BLE001 - logging's convention: report, never raise
            self.handleError(record)

    @contextmanager
    def progress(self, total_rounds: int | None) -> Iterator[None]:
        """A live bar over the global rounds (elapsed time, ETA) while the block runs, on a
        terminal and outside multiruns; lines printed meanwhile appear above it."""
        if self.mode == "multirun" or not self.console.is_terminal:
            yield
            return
        columns = (TextColumn("round"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn())
        with Progress(*columns, console=self.console, transient=True, refresh_per_second=4) as bar:
            self._progress, self._task = bar, bar.add_task("rounds", total=total_rounds)
            try:
                yield
            finally:
                self._progress = self._task = None

    @contextmanager
    def errors_held(self, explained: Callable[[BaseException], bool]) -> Iterator[None]:
        """Other loggers' errors (Flower's, Ray's: a team's failure with its traceback) and the
        nodes' warnings wait while the block runs: shown at the next round line or when the block
        ends, but left to the log file when it ends in an exception that ``explained`` says its own
        message covers (a diverged run: every rejected update, then one line)."""
        self._held = []
        try:
            yield
        except BaseException as exc:
            if explained(exc):
                self._held = []
            raise
        finally:
            self._release()
            self._held = None

    def _holds(self, record: logging.LogRecord) -> bool:
        """What errors_held keeps back: other loggers' errors, and the nodes' warnings and errors
        (hfl.node.*: a rejected update, a short round), not hfl's own run-level lines."""
        if self.mode == "verbose" or getattr(record, SHOW, None) is not None or not self.shows(record):
            return False
        return record.name.split(".")[0] not in PROJECT_LOGGERS or "." in record.name

    def _release(self) -> None:
        with self.lock:  # Flower logs from its own threads
            held, self._held = self._held, None
            for record in held or ():
                self.emit(record)
            if held is not None:
                self._held = []

    def stop_progress(self) -> None:
        """Take the bar off the terminal now (the cursor shown again): the process is about to end
        without leaving ``progress``'s block (hfl.process.interrupts)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = self._task = None


def log_file() -> Path | None:
    """The root logger's log file (Hydra's ``<run dir>/<job name>.log``), if any."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return Path(handler.baseFilename)
    return None


def install(mode: str) -> ConsoleHandler:
    """Put a ConsoleHandler in place of the root logger's console handler (Hydra's) and of
    Flower's own; the log file keeps everything. Outside verbose mode, Python warnings
    (libraries' deprecations) become log records, so they go to the file only."""
    root = logging.getLogger()
    for logger in (root, logging.getLogger("flwr")):
        for handler in list(logger.handlers):
            to_console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            if to_console or isinstance(handler, ConsoleHandler):  # a second install replaces the first
                logger.removeHandler(handler)
    handler = ConsoleHandler(mode)
    root.addHandler(handler)
    logging.captureWarnings(mode != "verbose")
    return handler
