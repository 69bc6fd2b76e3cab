"""Errors a user can cause end as one line naming the file or key and what to do, with no traceback
(runtime.verbose=true shows it), in hfl-simulate (hfl.errors.user_error) and hfl-report alike:
damaged dataset files, an output path that is a file or read-only, a full disk, a diverged run,
report paths that hold no runs. Each is caused for real, in a subprocess where the command is
what is tested."""

from __future__ import annotations

import gzip
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hfl.data import vision
from hfl.errors import ConfigError, user_error
from hfl.output import report
from hfl.runtime.simulate import run
from tests.conftest import SMALL, compose_cfg
from tests.test_resume import assert_same_run

ROOT = Path(__file__).resolve().parents[1]
MNIST_RAW = ROOT.parent / "shared" / "data" / "MNIST" / "raw"
BIN = Path(sys.executable).parent
CFG = [*SMALL, "runtime=inprocess", "global_rounds=2"]
MNIST = ["dataset=mnist", "topology.num_teams=2", "topology.devices_per_team=3", "runtime=inprocess", "global_rounds=1"]
IS_ROOT = os.geteuid() == 0


def command(program: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    script = BIN / program
    argv = [str(script)] if script.exists() else [sys.executable, "-m", f"hfl.{'runtime.simulate' if program == 'hfl-simulate' else 'output.report'}"]
    return subprocess.run([*argv, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess, program: str = "hfl-simulate") -> str:
    """The failed command's only line on stderr (no traceback anywhere)."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{program}: "), proc.stderr[-3000:]
    return lines[0]


def _mount(target: Path, options: str) -> None:
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody may write to: a read-only tmpfs as root (who may write anywhere else),
    else a folder without write permission."""
    path = tmp_path / "read-only"
    if IS_ROOT:
        _mount(path, "ro,size=64k")
        yield path
        subprocess.run(["umount", str(path)], check=True)
    else:
        path.mkdir()
        path.chmod(0o555)
        yield path
        path.chmod(0o755)


# ---------------------------------------------------------------- damaged dataset files
def _mnist_copy(tmp_path: Path, keep_gz: bool) -> Path:
    """A writable copy of the shared MNIST test split: the plain IDX files, or only the .gz ones."""
    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for source in MNIST_RAW.iterdir():
        if source.name.endswith(".gz") == keep_gz:
            shutil.copyfile(source, raw / source.name)
    return raw


DAMAGES = {
    # name: (keep the .gz files, the file damaged, how, what the message says)
    "truncated-idx": (False, "t10k-images-idx3-ubyte", lambda b: b[: len(b) // 2], "header says shape"),
    "garbled-idx-header": (False, "t10k-labels-idx1-ubyte", lambda b: b"\x12\x34" + b[2:], "not an unsigned-byte IDX"),
    "truncated-gz": (True, "t10k-images-idx3-ubyte.gz", lambda b: b[: len(b) // 3], "truncated gzip"),
    "not-gzip": (True, "t10k-labels-idx1-ubyte.gz", lambda b: b"garbage", "truncated gzip"),
    "gz-of-a-short-file": (True, "t10k-labels-idx1-ubyte.gz", lambda b: gzip.compress(gzip.decompress(b)[:-7]),
                           "header says shape"),
}


@pytest.mark.skipif(not MNIST_RAW.is_dir(), reason="shared MNIST test split absent")
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_mnist_file_is_named_with_what_to_do(tmp_path, damage):
    keep_gz, name, how, says = DAMAGES[damage]
    raw = _mnist_copy(tmp_path, keep_gz)
    (raw / name).write_bytes(how((raw / name).read_bytes()))
    with pytest.raises(ConfigError) as caught:
        vision.load("mnist", tmp_path / "data", download_missing=False)
    message = str(caught.value)
    assert caught.value.key == "dataset.root" and str(raw / name) in message and says in message
    assert "\n" not in message and "dataset.download=true" in message


@pytest.mark.skipif(not MNIST_RAW.is_dir(), reason="shared MNIST test split absent")
@pytest.mark.parametrize("damage", ["truncated-gz", "truncated-idx"])
def test_hfl_simulate_names_a_damaged_mnist_file_in_one_line(tmp_path, damage):
    keep_gz, name, how, _ = DAMAGES[damage]
    raw = _mnist_copy(tmp_path, keep_gz)
    (raw / name).write_bytes(how((raw / name).read_bytes()))
    line = one_line(command("hfl-simulate", *MNIST, f"dataset.root={tmp_path / 'data'}", f"hydra.run.dir={tmp_path / 'run'}"))
    assert line.startswith(f"hfl-simulate: dataset.root: {raw / name}: cannot be read")


def test_a_missing_dataset_is_one_line_too(tmp_path):
    line = one_line(command("hfl-simulate", *MNIST, f"dataset.root={tmp_path / 'nowhere'}", f"hydra.run.dir={tmp_path / 'run'}"))
    assert "no mnist split found" in line and "t10k-labels-idx1-ubyte" in line


# ---------------------------------------------------------------- where the run writes
@pytest.mark.parametrize("below", [False, True], ids=["the-file", "below-the-file"])
def test_an_output_path_that_is_a_file_is_named(tmp_path, below):
    (tmp_path / "taken").write_text("not a directory\n")
    run_dir = tmp_path / "taken" / "run" if below else tmp_path / "taken"
    line = one_line(command("hfl-simulate", *CFG, f"hydra.run.dir={run_dir}"))
    assert line.startswith(f"hfl-simulate: hydra.run.dir: {run_dir}: a file stands where a directory is needed")
    assert (tmp_path / "taken").read_text() == "not a directory\n"


@pytest.mark.parametrize("inside", [False, True], ids=["the-directory", "a-new-one-inside"])
def test_a_read_only_output_directory_is_named(read_only, inside):
    run_dir = read_only / "run" if inside else read_only
    line = one_line(command("hfl-simulate", *CFG, f"hydra.run.dir={run_dir}"))
    assert line.startswith(f"hfl-simulate: hydra.run.dir: {run_dir}")
    assert "give hydra.run.dir a directory you can write to" in line


@pytest.mark.skipif(not IS_ROOT, reason="a full disk is a small tmpfs, which only root may mount")
def test_a_full_disk_stops_the_run_in_one_line_and_it_resumes_once_there_is_room(tmp_path):
    disk = tmp_path / "disk"
    _mount(disk, "size=120k")  # room for the run's start and its first round, not its second
    try:
        run_dir = disk / "run"
        overrides = [*SMALL, "runtime=inprocess", "global_rounds=4"]
        line = one_line(command("hfl-simulate", *overrides, f"hydra.run.dir={run_dir}"))
        assert line.startswith(f"hfl-simulate: hydra.run.dir: {run_dir}: no space left on the device")
        resume = shlex.split(line.split("; then resume with: ", 1)[1])
        assert resume[-2:] == ["resume=true", f"hydra.run.dir={run_dir}"]
        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
        done = command("hfl-simulate", *resume[1:])
        assert done.returncode == 0, done.stderr[-3000:]
        run(compose_cfg(*overrides), tmp_path / "whole")
        assert_same_run(run_dir, tmp_path / "whole")
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# ---------------------------------------------------------------- a diverged run
def test_a_diverged_run_names_the_round_and_the_rates_to_lower(tmp_path):
    proc = command("hfl-simulate", *CFG, "algorithm.alpha=1e30", f"hydra.run.dir={tmp_path}")
    line = one_line(proc)
    assert line.startswith("hfl-simulate: global round 1: training diverged")
    assert "lower the learning rates (algorithm.alpha=1e+30, algorithm.eta=0.03, algorithm.beta=0.6)" in line
    assert "rejected the update" not in proc.stdout  # the nodes' warnings stay in the log file
    assert "rejected the update" in (tmp_path / "simulate.log").read_text()


@pytest.mark.slow
def test_a_diverged_run_on_ray_is_one_line_too(tmp_path):
    proc = command("hfl-simulate", *SMALL, "global_rounds=2", "algorithm.alpha=1e30", f"hydra.run.dir={tmp_path}")
    assert one_line(proc).startswith("hfl-simulate: global round 1: training diverged")
    assert "ERROR" not in proc.stdout  # Flower's errors (each team's traceback) went to the log file only


def test_runtime_verbose_shows_the_traceback_as_well(tmp_path):
    proc = command("hfl-simulate", *CFG, "algorithm.alpha=1e30", "runtime.verbose=true", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 1 and "Traceback" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("hfl-simulate: global round 1: training diverged")


def test_an_error_that_is_no_users_keeps_its_traceback():
    assert user_error(KeyError("a bug")) is None and user_error(RuntimeError("no model aggregated")) is None


# ---------------------------------------------------------------- hfl-report
@pytest.fixture(scope="module")
def a_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    run(compose_cfg(*CFG), run_dir)
    return run_dir


def _report_fails(*args: str) -> str:
    with pytest.raises(SystemExit) as caught:
        report.main(list(args))
    message = str(caught.value.code)
    assert message.startswith("hfl-report: ") and "\n" not in message
    return message


def test_hfl_report_names_a_path_without_runs(tmp_path):
    assert _report_fails(str(tmp_path / "nowhere")) == f"hfl-report: {tmp_path / 'nowhere'}: no such file or directory"
    (tmp_path / "empty").mkdir()
    assert "no runs found" in _report_fails(str(tmp_path / "empty"))
    line = one_line(command("hfl-report", str(tmp_path / "empty")), "hfl-report")  # as a user sees it
    assert line == f"hfl-report: {tmp_path / 'empty'}: no runs found (no summary.json at or below it)"


def test_hfl_report_names_an_out_path_it_cannot_write(tmp_path, a_run, read_only):
    (tmp_path / "taken").write_text("x")
    line = _report_fails(str(a_run), "--out", str(tmp_path / "taken"))
    assert line.startswith(f"hfl-report: --out: {tmp_path / 'taken'}: a file stands where a directory is needed")
    line = _report_fails(str(a_run), "--out", str(read_only / "report"))
    assert line.startswith(f"hfl-report: --out: {read_only / 'report'}") and "you can write to" in line


def test_hfl_report_skips_a_run_with_a_damaged_file_naming_it(tmp_path, capsys, a_run):
    damaged = tmp_path / "runs" / "damaged"
    shutil.copytree(a_run, damaged)
    shutil.copytree(a_run, tmp_path / "runs" / "good")
    (damaged / "metrics.jsonl").write_bytes(b"\x89\xff\x00 not text")
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    assert f"hfl-report: warning: {damaged / 'metrics.jsonl'}: not a text file (damaged?); skipped" in capsys.readouterr().err
