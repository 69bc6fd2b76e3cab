"""Ctrl-C and SIGTERM on hfl-simulate (hfl.process.interrupts), for real: the run stops at once on
either runtime, dies of the signal (a shell's 130 / 143), leaves no process behind, prints one
line naming the round and the command that resumes it, and that command ends the run with the
same models and metrics as a run never interrupted."""

from __future__ import annotations

import ctypes
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfl.process.interrupts import resume_command
from hfl.runtime.simulate import run
from hfl.state.resume import read_checkpoint
from tests.conftest import compose_cfg
from tests.test_resume import BHFL, assert_same_run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "hfl-simulate"
GUARD_SECONDS = 30  # only a guard against hanging: measured 0.1 s in-process, about 2 s on Ray
ROUNDS = 24  # rounds take 0.04 s on Ray here: 8 ended before a signal sent at round 2 was handled
RUN = [*BHFL, f"global_rounds={ROUNDS}"]
LINE = re.compile(r"^hfl-simulate: interrupted in global round (\d+); resume with: (hfl-simulate .*)$")


def _command(args: list[str]) -> list[str]:
    return [str(SCRIPT), *args] if SCRIPT.exists() else [sys.executable, "-m", "hfl.runtime.simulate", *args]


def _start(args: list[str], out: Path) -> subprocess.Popen:
    # SIGINT as a terminal's Ctrl-C finds it: a test run in the background may have it ignored.
    return subprocess.Popen(_command(args), cwd=ROOT, stdout=(out / "stdout").open("wb"),
                            stderr=(out / "stderr").open("wb"), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _signal_a_thread(pid: int, sig: int) -> None:
    """``sig`` to the process's newest thread other than its main one: the kernel may hand a
    process's signal to any of its threads, and on Ray the main thread waits in a join that only
    a signal of its own interrupts (once, the handler ran only when the run had ended)."""
    threads = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert threads, "the run has no thread besides its main one"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, threads[-1], sig) != 0:
        raise OSError(ctypes.get_errno(), "tgkill")


def _gone(group: int, timeout: float) -> bool:
    """Whether every process of the run's process group (Ray's daemons and actors too) has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run never interrupted, in process: a Ray run of this config equals it bit for bit, so it
    is the reference for both runtimes (one Ray start fewer)."""
    out = tmp_path_factory.mktemp("whole")
    run(compose_cfg(*RUN, "runtime=inprocess"), out)
    return out


@pytest.mark.parametrize(("runtime", "sig"), [
    ("inprocess", signal.SIGINT),
    ("inprocess", signal.SIGTERM),
    pytest.param("simulation", signal.SIGINT, marks=pytest.mark.slow),
    pytest.param("simulation", signal.SIGTERM, marks=pytest.mark.slow),
], ids=["inprocess-sigint", "inprocess-sigterm", "ray-sigint", "ray-sigterm"])
def test_a_signal_stops_the_run_at_once_and_the_printed_command_resumes_it(tmp_path, whole, runtime, sig):
    run_dir, first, second = tmp_path / "run", tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    proc = _start([*RUN, f"runtime={runtime}", f"hydra.run.dir={run_dir}"], first)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None, (first / "stderr").read_text()
        assert time.monotonic() < deadline, "the run did not get to its first round"
        time.sleep(0.01)
    sent = time.monotonic()
    _signal_a_thread(proc.pid, sig)
    try:
        code = proc.wait(timeout=GUARD_SECONDS)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == -sig  # death by the signal: a shell shows 128 + signal, 130 and 143
    assert _gone(proc.pid, GUARD_SECONDS - (time.monotonic() - sent)), "processes of the run outlived it"
    err = (first / "stderr").read_text()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    found = LINE.match(err.strip())
    assert found, err
    done = read_checkpoint(run_dir).round
    assert int(found[1]) == done + 1 and done < ROUNDS  # stopped before the end
    command = shlex.split(found[2])
    assert command[-2:] == ["resume=true", f"hydra.run.dir={run_dir.resolve()}"]
    resumed = _start(command[1:], second)
    assert resumed.wait(timeout=600) == 0, (second / "stderr").read_text()[-3000:]
    assert f"after global round {done} of {ROUNDS}" in (second / "stdout").read_text()
    assert_same_run(run_dir, whole)


def test_the_resume_command_quotes_what_a_shell_would_expand_and_drops_resume_and_overwrite(tmp_path):
    line = resume_command(["topology.fanout=[2,2,3]", "overwrite=true", "resume=false", "+x=a b"], tmp_path)
    assert shlex.split(line) == ["hfl-simulate", "topology.fanout=[2,2,3]", "+x=a b", "resume=true",
                                 f"hydra.run.dir={tmp_path.resolve()}"]
    assert shlex.split(resume_command([], tmp_path, "other"))[:3] == ["hfl-simulate", "--config-name", "other"]
