"""``hfl-deploy submit``: run an experiment on a deployment and see it through.

The root's ServerApp runs on the global host; if it is lost — its process killed, or the global
SuperLink killed and started again — the run is submitted again with ``resume=true`` and goes on
after its last completed global round (hfl.deploy.root_run). A run that failed by itself (the
ServerApp raised: a bad config, too few level-1 models) is not retried.

While it waits it prints the run's rounds and, at the end, its summary table, as hfl-simulate does
(``RoundsShown``), read from the run's directory where this host sees it (a loopback deployment, or
the global host's output folder shared here). The SuperLink does not carry them: Flower's run log
(``flwr log``) has Flower's logger's lines only, not hfl's. Elsewhere submit says where they are.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from hfl.deploy.control import FINISHED, ControlClient

log = logging.getLogger("hfl")
COMPLETED = "finished:completed"
RAISED = "ServerApp failed with exception"  # Flower's status details when the ServerApp raised
LOST = "lost"  # the SuperLink no longer knows the run (started again without its database)


def follow(link: ControlClient, run_id: int, deadline: float, reconnect_seconds: float, poll: float = 5.0,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> tuple[str, str]:
    """The run's final (status, details), ``LOST`` if the SuperLink forgot it; waits out a
    SuperLink that does not answer for up to ``reconnect_seconds`` at a time."""
    unreachable_since: float | None = None
    while True:
        try:
            status, details = link.run_info(run_id)
            unreachable_since = None
            if status.startswith(FINISHED):
                return status, details
        except LookupError:
            return LOST, f"the SuperLink does not know run {run_id}"
        except RuntimeError as exc:  # the SuperLink is down or restarting
            unreachable_since = clock() if unreachable_since is None else unreachable_since
            if clock() - unreachable_since > reconnect_seconds:
                raise RuntimeError(f"the SuperLink has not answered for {reconnect_seconds:.0f} s: {exc}") from exc
            log.warning("hfl-deploy: the SuperLink does not answer (%s); waiting for it", str(exc)[:200])
        if clock() > deadline:
            link.stop(run_id)
            raise TimeoutError(f"run {run_id} still running at the deadline; stopped it")
        sleep(poll)


class RoundsShown:
    """The rounds a deployed run has written to ``run_dir``/metrics.jsonl, each said once as
    hfl-simulate's round line (a resumed run's repeated rounds are not said again), and its summary
    table when it has completed: what the submitting host can see of it."""

    def __init__(self, run_dir: Path, num_rounds: int, say: Callable[[str], None]) -> None:
        self.run_dir, self.num_rounds, self.say = Path(run_dir), num_rounds, say
        self.last = 0  # the last round said
        self.seen = False  # the run's directory was seen here

    def poll(self) -> None:
        from hfl.output.console import round_line

        try:
            text = (self.run_dir / "metrics.jsonl").read_text()
        except (OSError, UnicodeDecodeError):
            return
        self.seen = True
        for raw in text.splitlines(keepends=True):
            if not raw.endswith("\n"):
                break  # a line being written: the next poll has it whole
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if isinstance(line, dict) and isinstance(line.get("round"), int) and line["round"] > self.last:
                self.last = line["round"]
                self.say(round_line(line, self.num_rounds))

    def wait(self, seconds: float) -> None:
        """``time.sleep(seconds)``, saying new rounds each second meanwhile."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            self.poll()

    def finish(self, status: str) -> None:
        from hfl.output.console import plain_text, summary_renderable
        from hfl.output.report import load_run

        self.poll()
        if not self.seen:
            self.say(f"hfl-deploy: {self.run_dir} is not on this host: the run's rounds, report.md and plots are "
                     "there on the global host")
        elif status == COMPLETED and (self.run_dir / "summary.json").exists():
            try:
                self.say(plain_text(summary_renderable(load_run(self.run_dir), None)))
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - hfl.output.report fails with SystemExit too
                self.say(f"hfl-deploy: could not read the run's summary in {self.run_dir}: {exc}")


def retriable(status: str, details: str) -> bool:
    """A run lost with its ServerApp (killed, expired, forgotten), not one that failed by itself."""
    return status == LOST or (status.startswith(FINISHED) and status != COMPLETED and "stopped" not in status
                              and RAISED not in details)


def see_through(link: ControlClient, run_config: dict, config_file, timeout: float, restarts: int,  # noqa: ANN001
                reconnect_seconds: float, poll: float = 5.0, say: Callable[[str], None] = print,
                rounds: RoundsShown | None = None) -> str:
    """Submit the run, follow it (saying its rounds as ``rounds`` sees them), submit it again with
    ``resume=true`` when it was lost (at most ``restarts`` times); the final status."""
    deadline = time.monotonic() + timeout
    for attempt in range(restarts + 1):
        config = dict(run_config)
        if attempt:
            kept = [o for o in shlex.split(config["overrides"]) if not o.startswith(("resume=", "overwrite="))]
            config["overrides"] = shlex.join([*kept, "resume=true"])
        run_id = _submit(link, config, config_file, deadline, reconnect_seconds)
        say(f"hfl-deploy: run {run_id} submitted{' again, resuming' if attempt else ''}; outputs on the global host "
            f"in {run_config['output-dir']}/{run_config['run-name']}")
        status, details = follow(link, run_id, deadline, reconnect_seconds, poll,
                                 sleep=rounds.wait if rounds is not None else time.sleep)
        if rounds is not None:
            rounds.poll()  # the last rounds before the status line
        say(f"hfl-deploy: run {run_id} {status}{f' ({details})' if details else ''}")
        if not retriable(status, details):
            break
    if rounds is not None:
        rounds.finish(status)
    return status


def _submit(link: ControlClient, config: dict, config_file, deadline: float, reconnect_seconds: float) -> int:  # noqa: ANN001
    """Submit, retrying while the SuperLink is away (it may be starting again)."""
    first = time.monotonic()
    while True:
        try:
            return link.submit(config, config_file)
        except RuntimeError as exc:
            if time.monotonic() - first > reconnect_seconds or time.monotonic() > deadline:
                raise
            log.warning("hfl-deploy: could not submit (%s); trying again", str(exc)[:200])
            time.sleep(2.0)
