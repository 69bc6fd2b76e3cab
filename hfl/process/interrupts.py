"""Ctrl-C (SIGINT) and SIGTERM in ``hfl-simulate``: the run stops at once, stays resumable, and
the user is told, in one line on stderr, the command that resumes it.

Stopping is done in the signal handler itself rather than by unwinding: an exception raised
in the driver leaves Flower's ServerApp thread and executor running (Ray runs waited 50+ s for
them) and in-process lockstep threads alive at interpreter exit (``terminate called without
an active exception``). The handler mutes the console, closes the tracker, stops the Ray
processes this run started (not ``ray.shutdown``: Ray ends the process with status 1 when one of
Flower's threads touches it after that) and then ends the process by the same signal (default
action), so a shell sees 130 or 143 and a script running hfl-simulate in a loop stops too. The run directory is left as a SIGKILL would
leave it, which a resumption handles (hfl.state.resume); the run lock is released by the
system. A second signal, or a clean-up longer than ``CLEANUP_SECONDS``, ends it at once.

Python runs a handler in the main thread only, and a signal the kernel hands to another thread
(Ray's and Flower's threads are most of the process's) does not wake a main thread blocked in a
join, as it is on Ray for the whole run: the handler then ran when the run ended. A watcher
thread, woken through ``signal.set_wakeup_fd``, sends the signal on to the main thread.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

log = logging.getLogger("hfl")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
CLEANUP_SECONDS = 10.0  # stopping Ray took about 2 s here; a hung stop must not hold the user up
NUDGE_SECONDS = 0.2  # an awake main thread runs the handler within microseconds
PROGRAM = "hfl-simulate"


def resume_command(overrides: Sequence[str], run_dir: str | os.PathLike, config_name: str = "config") -> str:
    """The shell command that goes on with the run in ``run_dir``: its overrides (quoted) with
    ``resume=true`` in place of any ``resume``/``overwrite`` (overwrite=true would restart it)."""
    head = [PROGRAM] + (["--config-name", config_name] if config_name != "config" else [])
    return shlex.join([*head, *_kept(overrides), "resume=true", f"hydra.run.dir={Path(run_dir).resolve()}"])


def _kept(overrides: Sequence[str]) -> list[str]:
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in ("resume", "overwrite")]


def interrupted_line(run_dir: Path, overrides: Sequence[str], rounds: object = None, config_name: str = "config") -> str:
    """``hfl-simulate: interrupted in global round N; resume with: <command>``, N the round a
    resumption starts with (or, before the run recorded its config, the command that starts it
    again). ``rounds``: the run's global_rounds, if it is a valid one."""
    from hfl.state.resume import CONFIG, read_checkpoint

    if not (run_dir / CONFIG).exists():
        return f"{PROGRAM}: interrupted before the run began; nothing to resume: start it again with " \
               f"{shlex.join([PROGRAM, *_kept(overrides)])}"
    try:
        checkpoint = read_checkpoint(run_dir)
        done = checkpoint.round if checkpoint is not None else 0
        where = f"in global round {done + 1}"
        if isinstance(rounds, int) and done >= rounds:
            where = f"after its last global round ({done}), before its report"
    except Exception:  # noqa: BLE001 - a damaged checkpoint is the resumption's to name
        where = "during the run"
    return f"{PROGRAM}: interrupted {where}; resume with: {resume_command(overrides, run_dir, config_name)}"


class _Stop:
    """The handler's state: what to say, what to close; ``stopping`` once a signal came."""

    def __init__(self, line: Callable[[], str], console: logging.Handler | None) -> None:
        self.line = line
        self.console = console
        self.cleanups: list[Callable[[], None]] = []
        self.stopping = False
        self.said: str | None = None
        self.previous: dict = {}  # the handlers before ours
        self.nudged = -float("inf")  # when the watcher last sent a signal on to the main thread

    def handle(self, signum: int, frame: FrameType | None) -> None:  # noqa: ARG002
        if self.stopping:
            if time.monotonic() - self.nudged < 2 * NUDGE_SECONDS:
                return  # the watcher's copy of the signal being handled
            self.die(signum)  # a second Ctrl-C: no more waiting
        self.stopping = True
        watchdog = threading.Timer(CLEANUP_SECONDS, self.die, (signum,))
        watchdog.daemon = True
        watchdog.start()
        try:
            self.mute()
            for cleanup in [*reversed(self.cleanups), shutdown_ray]:
                try:
                    cleanup()
                except BaseException as exc:  # noqa: BLE001 - Ray's shutdown may raise SystemExit
                    log.warning("hfl: clean-up after the interrupt failed: %r", exc, exc_info=True)
        finally:
            self.die(signum)

    def mute(self) -> None:
        """Nothing more on the console but our line: the progress bar goes (restoring the
        cursor), and the errors that threads losing Ray or their run would log stay in the file."""
        stop_progress = getattr(self.console, "stop_progress", None)
        if stop_progress is not None:
            stop_progress()
        if self.console is not None:
            self.console.setLevel(logging.CRITICAL + 1)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        # Ray's C++ core and dying threads may write to the descriptors directly.
        global _stderr
        _stderr = os.dup(2)
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        os.close(quiet)

    def die(self, signum: int) -> None:
        if self.said is None:
            # Read last: on Ray the ServerApp thread may checkpoint a round while Ray is stopped.
            try:
                self.said = self.line()
            except Exception as exc:  # noqa: BLE001 - the message must come out whatever
                self.said = f"{PROGRAM}: interrupted ({type(exc).__name__} while reading the run's checkpoint)"
            log.warning("%s (signal %s)", self.said, signal.Signals(signum).name)  # the log file's record
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001, S110
                pass
        try:
            os.write(_stderr if _stderr is not None else 2, (self.said + "\n").encode())
        except OSError:
            pass
        if threading.current_thread() is threading.main_thread():
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # the watchdog's thread (which cannot reset a handler), or a blocked signal

    def watch(self, reader: socket.socket) -> None:
        """The watcher thread: each SIGINT/SIGTERM the handler has not taken up within
        ``NUDGE_SECONDS`` is sent again, to the main thread (whose wait it interrupts)."""
        main = threading.main_thread().ident
        with reader:
            while received := reader.recv(64):  # b"" once stop_on_signals closed the writer
                for signum in set(received) & set(SIGNALS):
                    time.sleep(NUDGE_SECONDS)
                    if not self.stopping and main is not None:
                        self.nudged = time.monotonic()
                        signal.pthread_kill(main, signum)


_stderr: int | None = None  # stderr as it was before mute()
_current: _Stop | None = None


def hold_if_stopping() -> None:
    """Called before the run records a round: once a signal is stopping the process, Ray may have
    been stopped under that round (its calls failing), so a thread other than the main one waits
    here for the process to end rather than record it; the resumption runs the round again."""
    stop = _current
    if stop is not None and stop.stopping and threading.current_thread() is not threading.main_thread():
        threading.Event().wait()


def exit_interrupted(line: str, signum: int = signal.SIGINT) -> None:
    """Print ``line`` and end the process by ``signum`` (a Ctrl-C before ``stop_on_signals``
    was in place: while Hydra composes the config)."""
    stop = _Stop(lambda: line, None)
    stop.said = line  # not logged: no run, and maybe no log file yet
    stop.die(signum)


def shutdown_ray() -> None:
    """The Ray daemons this process started stopped (the raylet first, which ends its workers and
    agents); a cluster it joined is left alone (its actors die with their owner, this driver)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return
    hook = sys.modules.get("ray._private.auto_init_hook")
    if hook is not None and hasattr(hook, "enable_auto_connect"):
        hook.enable_auto_connect = False  # else Flower's threads' next ray.get starts a fresh Ray instance
    node = getattr(sys.modules.get("ray._private.worker"), "_global_node", None)
    if node is not None:
        node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)


@contextmanager
def stop_on_signals(line: Callable[[], str], console: logging.Handler | None = None) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM stop the process as the module says, printing
    ``line()``. A signal this process was started ignoring (a background job of a script) stays
    ignored, as Python does for SIGINT."""
    global _current
    stop = _Stop(line, console)
    previous = stop.previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    outer, _current = _current, stop
    _claim(stop, previous)
    watcher = _watch(stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _current = outer
        if watcher is not None:
            watcher()


def _watch(stop: _Stop) -> Callable[[], None] | None:
    """``stop``'s watcher started on a wakeup descriptor of its own; returns what ends it. None
    where something else already holds the process's wakeup descriptor (an event loop)."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    theirs = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if theirs != -1:
        signal.set_wakeup_fd(theirs)
        reader.close(), writer.close()
        return None
    threading.Thread(target=stop.watch, args=(reader,), name="hfl-signal-watcher", daemon=True).start()

    def end() -> None:
        signal.set_wakeup_fd(-1)
        writer.close()  # the watcher's recv returns b"" and it ends
    return end


def _claim(stop: _Stop, previous: dict) -> None:
    for sig in SIGNALS:
        if previous[sig] is not signal.SIG_IGN:
            signal.signal(sig, stop.handle)


@contextmanager
def kept_from_ray() -> Iterator[None]:
    """``ray.init`` (which Flower calls in this thread) sets a SIGTERM handler of its own, and its
    core worker a C-level one that prints a stack and aborts (exit 134): the block's
    ``ray.init`` gives them back to ``stop_on_signals`` when it returns."""
    import ray
    import ray._private.utils as ray_utils

    init, set_sigterm_handler = ray.init, ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None  # ray.init's sys.exit(15) would bypass ours

    def init_and_reclaim(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        try:
            started = init(*args, **kwargs)
            _watch_ray_session()
            return started
        finally:
            stop = _current
            if stop is not None and threading.current_thread() is threading.main_thread():
                _claim(stop, stop.previous)

    ray.init = init_and_reclaim
    try:
        yield
    finally:
        ray.init, ray_utils.set_sigterm_handler = init, set_sigterm_handler


def _watch_ray_session() -> None:
    """A watchdog (hfl.process.reaper) for the Ray instance this process has just started: should
    the driver be killed outright (SIGKILL, where no handler runs), it stops the processes Ray's
    own fate-sharing leaves behind. A cluster this process joined is not its to stop."""
    from hfl.process import reaper

    node = getattr(sys.modules.get("ray._private.worker"), "_global_node", None)
    processes = getattr(node, "all_processes", None) or {}  # empty when the driver joined a running cluster
    if not processes:
        return
    raylets = processes.get("raylet") or []
    raylet = getattr(getattr(raylets[0], "process", None), "pid", None) if raylets else None
    try:
        reaper.watch(node.get_session_dir_path(), raylet)
    except (OSError, AttributeError) as exc:  # Ray's private API moved, or no process to spare: the run goes on
        log.warning("hfl: no watchdog for Ray's processes (%r): a SIGKILL of this process may leave some running",
                    exc)


@contextmanager
def closing_on_interrupt(cleanup: Callable[[], None] | None) -> Iterator[None]:
    """``cleanup`` also runs when a signal stops the process within the block (a tracker's run
    ended, its buffered rows flushed)."""
    stop = _current
    if cleanup is None or stop is None:
        yield
        return
    stop.cleanups.append(cleanup)
    try:
        yield
    finally:
        if cleanup in stop.cleanups:
            stop.cleanups.remove(cleanup)
