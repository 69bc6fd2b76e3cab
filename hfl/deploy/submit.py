"""``hfl-deploy submit``: run an experiment on a deployment and see it through.

The root's ServerApp runs on the global host; if it is lost — its process killed, or the global
SuperLink killed and started again — the run is submitted again with ``resume=true`` and goes on
after its last completed global round (hfl.deploy.root_run). A run that failed by itself (the
ServerApp raised: a bad config, too few level-1 models) is not retried.
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Callable

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


def retriable(status: str, details: str) -> bool:
    """A run lost with its ServerApp (killed, expired, forgotten), not one that failed by itself."""
    return status == LOST or (status.startswith(FINISHED) and status != COMPLETED and "stopped" not in status
                              and RAISED not in details)


def see_through(link: ControlClient, run_config: dict, config_file, timeout: float, restarts: int,  # noqa: ANN001
                reconnect_seconds: float, poll: float = 5.0, say: Callable[[str], None] = print) -> str:
    """Submit the run, follow it, submit it again with ``resume=true`` when it was lost (at most
    ``restarts`` times); the final status."""
    deadline = time.monotonic() + timeout
    for attempt in range(restarts + 1):
        config = dict(run_config)
        if attempt:
            kept = [o for o in shlex.split(config["overrides"]) if not o.startswith(("resume=", "overwrite="))]
            config["overrides"] = shlex.join([*kept, "resume=true"])
        run_id = _submit(link, config, config_file, deadline, reconnect_seconds)
        say(f"hfl-deploy: run {run_id} submitted{' again, resuming' if attempt else ''}; outputs on the global host "
            f"in {run_config['output-dir']}/{run_config['run-name']}")
        status, details = follow(link, run_id, deadline, reconnect_seconds, poll)
        say(f"hfl-deploy: run {run_id} {status}{f' ({details})' if details else ''}")
        if not retriable(status, details):
            return status
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
