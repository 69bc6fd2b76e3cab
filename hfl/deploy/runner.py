"""A host's warm runner: one long-lived process that takes every ClientApp task of its SuperNode
and runs hfl's ClientApp in that process, so that a message costs its work and not a new Python.

Flower 1.42 starts a ``flwr-clientapp`` process per message (about 1.5 CPU-seconds of interpreter
start and imports before any work; ``../shared/notes/flower-and-environment.md``, "Deployment
latency"). A SuperNode started with ``--isolation process`` starts none: it serves its runtime API
on loopback and lets a process the operator runs take the tasks. This module is that process. It
follows ``flwr-clientapp``'s protocol with Flower's own functions (acquire a task, pull its input,
heartbeat, push the reply and the task's output) and keeps the loaded app per bundle hash, so the
bundle is installed and imported once per run rather than once per message.

What it trades away: every message of every run on the host runs in one process, the runner's,
with its imports and module state (a ClientApp that leaks memory or state leaks it across
messages); a task that crashes the process (a segfault, ``os._exit``) takes the runner down, and
the host answers nothing until it is started again (``hfl-deploy`` restarts the roles it started).
These functions are not Flower's public API, so the runner serves only the Flower versions it was
written against (``SUPPORTED``); on any other, ``hfl-deploy`` keeps Flower's own per-message
process (``runner_supported``, and ``--per-message`` forces it).

    python -m hfl.deploy.runner --runtime-api 127.0.0.1:9094
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("hfl")
SUPPORTED = ("1.42.",)
HOST_PROJECT = Path(__file__).resolve().parents[2]  # this host's hfl project (its hfl/, strategies/, conf/ ...)
BUNDLE_ONLY = ("pyproject.toml", "README.md")  # the app's metadata: Flower rewrites it into the bundle
POLL, MAX_POLL = 0.01, 0.1  # seconds between asks for a task: 10 ms after one, growing to 0.1 s idle
TASK_RETRY_SECONDS = 30.0  # how long one call of a task waits for its SuperNode (started again, busy) before giving the task up


def bundle_differs(bundle: Path, host: Path) -> str | None:
    """The first file of an installed app bundle whose bytes differ from the host project's same
    file (or that the host lacks); None when every file is the host's."""
    for path in sorted(p for p in Path(bundle).rglob("*") if p.is_file()):
        rel = path.relative_to(bundle)
        if rel.parts[0].startswith(".") or rel.name in BUNDLE_ONLY:
            continue
        mine = host / rel
        if not mine.is_file() or mine.read_bytes() != path.read_bytes():
            return str(rel)
    return None


def task_retries(max_time: float = TASK_RETRY_SECONDS) -> Any:
    """A retry policy for the runner's calls to its SuperNode: transport errors and 5xx retried for
    ``max_time`` seconds at most, a refused token (401/403: the SuperNode was started again and
    forgot the task) given up at once. Flower's own policy (``make_simple_http_retry_invoker``)
    retries forever and answers a 401 by sending SIGINT to its process, which is right for a
    one-task ``flwr-clientapp`` and would end the runner with every later task."""
    import httpx
    from flwr.supercore.retry.retry_invoker import RetryInvoker, exponential

    def give_up(exc: Exception) -> bool:
        return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code < 500

    return RetryInvoker(wait_gen_factory=lambda: exponential(base_delay=0.05, max_delay=1.0),
                        recoverable_exceptions=(httpx.TransportError, httpx.HTTPStatusError),
                        max_tries=None, max_time=max_time, should_giveup=give_up)


def runtime_client(address: str, component: str, retry_seconds: float, token: str | None = None) -> Any:
    """A client of the SuperNode's runtime API on loopback, as ``component`` (Flower's version check),
    with the task's ``token`` where it acts for one task."""
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors = [RuntimeVersionHttpInterceptor(component_name=component)]
    interceptors += [RuntimeTokenHttpInterceptor(token)] if token is not None else []
    return RuntimeHttpClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                                 interceptors=interceptors, retry_invoker=task_retries(retry_seconds))


def task_heartbeat(client: Any) -> Any:
    """The task's heartbeat to its SuperNode. Flower's (``make_task_heartbeat_fn_http``) sends SIGINT to
    its process when the SuperNode no longer knows the task; the runner's only stops beating for it."""
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest  # pylint: disable=no-name-in-module

    request = SendTaskHeartbeatRequest()

    def beat() -> bool:
        try:
            client.SendTaskHeartbeat(request)  # not known any more (success false): the task's calls fail on their own
        except httpx.HTTPError:
            return False
        return True

    return beat


def runner_supported() -> bool:
    """Whether this Flower is one the runner was written against, with the pieces it uses."""
    import flwr

    if not flwr.__version__.startswith(SUPPORTED):
        return False
    try:
        from flwr.supernode.runtime import run_clientapp

        return all(hasattr(run_clientapp, name) for name in ("pull_task_input", "push_message", "push_task_output"))
    except ImportError:
        return False


class Runner:
    """Takes the tasks of the SuperNode whose runtime API listens on ``address`` and runs them here."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.client = runtime_client(address, "SuperExec", MAX_POLL)
        self.apps: dict[str, Any] = {}  # bundle hash -> its loaded ClientApp
        self.tasks = 0

    def acquire(self) -> str | None:
        """A task's token, or None when the SuperNode has none."""
        from flwr.supercore.constant import TaskType
        from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=no-name-in-module

        res = self.client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        return res.token if res.HasField("task") and res.token else None

    def app_for(self, run: Any, fab: Any) -> Any:
        """The run's ClientApp, installed and loaded the first time its bundle is seen. hfl's
        modules are this process's (the runner is hfl), so a bundle whose files differ from this
        host's is refused rather than run with other code than it carries."""
        if fab.hash_str not in self.apps:
            from flwr.cli.install import install_from_fab
            from flwr.clientapp.utils import get_load_client_app_fn
            from flwr.common.config import get_project_dir

            install_from_fab(fab.content, skip_prompt=True)
            differs = bundle_differs(get_project_dir(run.fab_id, run.fab_version, fab.hash_str), HOST_PROJECT)
            if differs:
                raise RuntimeError(f"runner: the submitted app's {differs} differs from this host's "
                                   f"({HOST_PROJECT}); install the same hfl here, or start the host with "
                                   "hfl-deploy ... --per-message")
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            self.apps[fab.hash_str] = load(run.fab_id, run.fab_version, fab.hash_str)
        return self.apps[fab.hash_str]

    def run_task(self, token: str) -> None:
        """One task, as ``flwr-clientapp`` runs it: its message in, the app's reply (or the error) out."""
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.clientapp.client_app import LoadClientAppError
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore.heartbeat import HeartbeatSender
        from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

        client = runtime_client(self.address, "flwr-clientapp", TASK_RETRY_SECONDS, token)
        heartbeat = HeartbeatSender(task_heartbeat(client))
        heartbeat.start()
        message = reply = context = None
        status, details = SubStatus.FAILED, "ClientApp task failed"
        try:
            message, context, run, fab = pull_task_input(client)
            reply = self.app_for(run, fab)(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
        except Exception as exc:  # noqa: BLE001 - the app's failure goes back to the node as Flower's Error reply
            log.exception("runner: the ClientApp failed")
            code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(exc, LoadClientAppError) else \
                ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            details = f"{type(exc)}:<'{exc}'>"
            if message is not None:
                reply = Message(Error(code=code, reason=details), reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
                push_task_output(client, context, status, details)
            except Exception as exc:  # noqa: BLE001 - its SuperNode gone or started again: the task is lost there
                log.warning("runner: could not hand the task's reply to its SuperNode (%s: %s); the node asks again",
                            type(exc).__name__, exc)
            finally:
                heartbeat.stop()
                client.close()
        self.tasks += 1

    def serve(self, stop: threading.Event | None = None) -> None:
        """Take tasks until ``stop`` is set (or forever); a SuperNode not up yet is waited for."""
        stop = stop or threading.Event()
        wait, said = POLL, ""
        log.info("runner: taking the ClientApp tasks of the SuperNode at %s", self.address)
        while not stop.is_set():
            try:
                token = self.acquire()
            except Exception as exc:  # noqa: BLE001 - the SuperNode (re)starting: ask again, saying why once
                if str(exc) != said:
                    log.warning("runner: no task from %s: %s: %s", self.address, type(exc).__name__, exc)
                    said = str(exc)
                token = None
                wait = MAX_POLL
            if token is None:
                stop.wait(wait)
                wait = min(wait * 1.5, MAX_POLL)
                continue
            started = time.monotonic()
            try:
                self.run_task(token)
            except Exception as exc:  # noqa: BLE001 - one task's trouble (its SuperNode restarting) ends that task only
                log.warning("runner: a task failed before it ran (%s: %s)", type(exc).__name__, exc)
            wait = POLL
            log.info("runner: task %d done in %.2f s", self.tasks, time.monotonic() - started)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hfl.deploy.runner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runtime-api", required=True, help="the SuperNode's runtime API (host:port, on loopback)")
    args = p.parse_args(argv)
    from hfl.deploy.private import private_umask

    private_umask()  # what its tasks write (device state, mailboxes) is the owner's alone
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import faulthandler
    import signal

    faulthandler.enable()  # a crash in native code leaves its stack in the runner's log

    def stopped(signum: int, _frame: object) -> None:  # a runner ended by a signal says so in its log
        log.warning("runner: stopped by signal %s", signal.Signals(signum).name)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stopped)
    if not runner_supported():
        import flwr

        raise SystemExit(f"hfl.deploy.runner: Flower {flwr.__version__} is not one the runner was written for "
                         f"({', '.join(v + 'x' for v in SUPPORTED)}); run the SuperNode without --isolation process")
    from hfl.deploy.supernode import shorten_object_pulls

    shorten_object_pulls()  # a message's objects pulled without Flower's 1 s first retry (hfl.deploy.supernode)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll otherwise
    Runner(args.runtime_api).serve()


if __name__ == "__main__":
    main()
