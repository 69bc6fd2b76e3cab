"""Ray's processes of a run end with the run, even when its driver is killed with SIGKILL.

Ray kills its driver's direct children when the driver dies (gcs_server, raylet, dashboard, log
monitor: PR_SET_PDEATHSIG), but not the raylet's own children: measured with Ray 2.55, a SIGKILL of
hfl-simulate's driver left ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` running under
pid 1, minutes later, and Ray has no setting that ends them. ``watch`` starts this file as a small
watchdog (stdlib only, about 10 MB) beside a driver that started a local Ray instance: it polls
the driver and the raylet, and when either is gone (a SIGKILL, a crash, or simply the end of
the run) it stops every process of that Ray session (SIGTERM, then SIGKILL after
``GRACE_SECONDS``) and exits. A session's processes are those whose command line or open files
lie in its session directory (``<ray temp dir>/session_<date>_<driver pid>``; Ray renames its
workers' command lines, but they keep their logs there open): other Ray instances on the host,
even under the same temp dir, are left alone. Linux only (it reads /proc); elsewhere nothing
is started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_SECONDS = 0.5  # how soon a dead driver is noticed
GRACE_SECONDS = 5.0  # between SIGTERM and SIGKILL


def start_time(pid: int) -> str | None:
    """The process's start time (in clock ticks since boot), or None if it is gone: with the pid it
    names one process, so a pid the system hands out again is not taken for the driver."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def session_processes(session_dir: str, exclude: set[int]) -> list[int]:
    """Processes whose command line or open files lie under ``session_dir``, but for ``exclude``."""
    found = []
    prefix = session_dir.rstrip("/") + "/"
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if session_dir.encode() in f.read():
                    found.append(int(name))
                    continue
            for fd in os.listdir(f"/proc/{name}/fd"):
                try:
                    if os.readlink(f"/proc/{name}/fd/{fd}").startswith(prefix):
                        found.append(int(name))
                        break
                except OSError:
                    pass
        except OSError:  # gone meanwhile, or another user's
            pass
    return found


def stop_session(session_dir: str, driver: int) -> int:
    """Every process of the session but the driver (alive when Ray was shut down under it, and
    holding its own log there) stopped: SIGTERM, SIGKILL after GRACE_SECONDS; how many there were."""
    pids = session_processes(session_dir, {os.getpid(), driver})
    count = len(pids)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + GRACE_SECONDS
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = [pid for pid in pids if start_time(pid) is not None and not _zombie(pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return count


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _alive(pid: int, started: str | None) -> bool:
    now = start_time(pid)
    return now is not None and now == started and not _zombie(pid)


def run(driver: int, driver_started: str, raylet: int, raylet_started: str | None, session_dir: str) -> None:
    """Wait until the driver or the raylet is gone, then stop the session."""
    while _alive(driver, driver_started) and (raylet_started is None or _alive(raylet, raylet_started)):
        time.sleep(POLL_SECONDS)
    stop_session(session_dir, driver)


def watch(session_dir: str, raylet: int | None) -> subprocess.Popen | None:
    """Start the watchdog for this process (the driver) and its Ray session; None off Linux. It
    ignores SIGINT, SIGTERM and SIGHUP sent to the driver's whole process group (a Ctrl-C): it
    ends on its own once the driver is gone."""
    driver_started = start_time(os.getpid())
    if not sys.platform.startswith("linux") or driver_started is None:
        return None
    raylet_started = start_time(raylet) if raylet is not None else None
    args = [str(os.getpid()), driver_started, str(raylet or 0), raylet_started or "-", session_dir]
    # -I: the standard library alone (no site-packages, no PYTHONPATH), so it starts in milliseconds.
    return subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


def main(argv: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    driver, driver_started, raylet, raylet_started, session_dir = argv
    run(int(driver), driver_started, int(raylet), None if raylet_started == "-" else raylet_started, session_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
