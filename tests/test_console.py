"""hfl-simulate's console: the per-round line, what reaches the console and what only the
log file, and the line budget of a whole run (a subprocess, as a user runs it)."""

from __future__ import annotations

import io
import re
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from hfl.output.console import ROUND, SHOW, STARTUP, ConsoleHandler, job_line, round_line
from hfl.output.report import load_run
from tests.conftest import SMALL

ROOT = Path(__file__).parents[1]


# ---------------------------------------------------------------- the round line


def test_round_line_three_tiers():
    line = {"round": 3, "pm_accuracy": 0.8187, "pm_loss": 0.6, "level1_accuracy": 0.2559, "team_accuracy": 0.2559,
            "gm_accuracy": 0.2507, "gm_loss": 2.10311, "pm_accuracy_min": 0.1, "seconds": 1.514, "failures": 0}
    assert round_line(line, 30) == "round  3/30  PM  81.87%  level1  25.59%  GM  25.07%  GM loss 2.1031  1.51s"


def test_round_line_deeper_levels_and_other_models_in_tree_order():
    line = {"round": 12, "gm_proxy_accuracy": 0.5, "pflego_accuracy": 0.9, "gm_accuracy": 0.6, "gm_loss": 1.0,
            "level2_accuracy": 0.7, "level1_accuracy": 0.65, "team_accuracy": 0.65, "pm_accuracy": 1.0,
            "seconds": 12.0}
    assert round_line(line, 100) == ("round  12/100  PM 100.00%  level1  65.00%  level2  70.00%  GM  60.00%  "
                                     "GM proxy  50.00%  pflego  90.00%  GM loss 1.0000  12.00s")


def test_round_line_leaves_out_models_an_algorithm_lacks():
    fedavg = {"round": 1, "pm_accuracy": None, "pm_loss": None, "gm_accuracy": 0.5, "gm_loss": 1.5, "seconds": 0.5}
    assert round_line(fedavg, 5) == "round 1/5  GM  50.00%  GM loss 1.5000  0.50s"
    pfedme = {"round": 5, "pm_accuracy": 0.9, "pm_loss": 0.25, "seconds": 0.5}  # no GM: the PM loss
    assert round_line(pfedme, 5) == "round 5/5  PM  90.00%  PM loss 0.2500  0.50s"


# ---------------------------------------------------------------- what the console shows


def shown(mode: str, *records: tuple[str, int, str, dict]) -> str:
    buffer = io.StringIO()
    handler = ConsoleHandler(mode, Console(file=buffer, force_terminal=False, width=200, soft_wrap=True))
    for name, level, message, extra in records:
        record = logging.LogRecord(name, level, __file__, 1, message, None, None)
        record.__dict__.update(extra)
        handler.handle(record)
    return buffer.getvalue()


RECORDS = [
    ("flwr", logging.INFO, "configure_fit: strategy sampled 4 clients", {}),
    ("flwr", logging.WARNING, "DEPRECATED FEATURE: run_simulation", {}),
    ("ray._private.worker", logging.INFO, "Started a local Ray instance.", {}),
    ("ray.actors", logging.WARNING, "(ClientAppActor pid=1) a warning in an actor", {}),
    ("hfl", logging.INFO, "hfl: permfl on synthetic/mclr", {SHOW: "run"}),
    ("hfl", logging.INFO, "round 1/2  PM  50.00%", {ROUND: 1, SHOW: "run"}),
    ("hfl", logging.INFO, "round 2/2 trained, not evaluated", {ROUND: 2}),
    ("hfl.node.inprocess", logging.INFO, "an hfl detail", {}),
    ("strategies.base", logging.WARNING, "a team's evaluation failed", {}),
    ("flwr", logging.ERROR, "An exception occurred", {}),
    ("hfl", logging.ERROR, "for the log file only", {SHOW: "file"}),
    ("hfl", logging.INFO, "#0 done", {SHOW: "multirun"}),
]


def test_a_run_shows_hfl_lines_warnings_and_errors_only():
    assert shown("run", *RECORDS).splitlines() == [
        "hfl: permfl on synthetic/mclr", "round 1/2  PM  50.00%",
        "WARNING: a team's evaluation failed", "ERROR: An exception occurred"]


def test_a_multirun_job_shows_its_rounds_line_warnings_and_errors_only():
    assert shown("multirun", *RECORDS).splitlines() == [
        "round 1/2  PM  50.00%", "WARNING: a team's evaluation failed", "ERROR: An exception occurred", "#0 done"]


def test_start_up_milestones_of_ray_and_flower_become_hfl_lines(caplog):
    """Attached as install() attaches it: Ray's and Flower's records of a phase give hfl's line (in the log
    file too), with the seconds since the start-up line before; a -m job's lines lead with its prefix."""
    buffer = io.StringIO()
    handler = ConsoleHandler("multirun", Console(file=buffer, force_terminal=False, width=200, soft_wrap=True))
    handler.prefix = "#1 seed=1: "
    root = logging.getLogger()
    root.addHandler(handler)
    from hfl.runtime.simulate import ray_output_to_log

    try:  # Ray's logger as a simulation sets it (Ray's own configuration, once imported, stops it propagating)
        with caplog.at_level(logging.DEBUG), ray_output_to_log():
            logging.getLogger("hfl").info("hfl: starting", extra={SHOW: "run", STARTUP: True})
            logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
            logging.getLogger("flwr").debug("Constructed ActorPool with: 3 actors")
            logging.getLogger("flwr").info("[ROUND 1]")
    finally:
        root.removeHandler(handler)
    lines = [re.sub(r"[0-9]+\.[0-9] s", "N s", line) for line in buffer.getvalue().splitlines()]
    assert lines == ["#1 seed=1: starting", "#1 seed=1: Ray started in N s",
                     "#1 seed=1: Ray's 3 actors ready in N s; round 1 first builds each level-1 node and its "
                     "devices in its actor"]
    assert "hfl: Ray started in" in caplog.text


def test_verbose_shows_everything_as_hydra_formats_it():
    lines = shown("verbose", *RECORDS).splitlines()
    assert len(lines) == len(RECORDS)
    assert lines[0].endswith("[flwr][INFO] - configure_fit: strategy sampled 4 clients")


def test_no_progress_bar_off_a_terminal():
    buffer = io.StringIO()
    handler = ConsoleHandler("run", Console(file=buffer, force_terminal=False))
    with handler.progress(3):
        assert handler._progress is None
    assert buffer.getvalue() == ""


def test_progress_bar_on_a_terminal_follows_the_rounds():
    buffer = io.StringIO()
    handler = ConsoleHandler("run", Console(file=buffer, force_terminal=True, width=100))
    with handler.progress(4):
        record = logging.LogRecord("hfl", logging.INFO, __file__, 1, "round 3/4", None, None)
        record.__dict__.update({ROUND: 3})
        handler.handle(record)
        task = handler._progress.tasks[0]
        assert (task.completed, task.total) == (3, 4)
    assert handler._progress is None and "round 3/4" not in buffer.getvalue()  # not evaluated: the bar alone


# ---------------------------------------------------------------- a whole run


def simulate(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hfl.runtime.simulate", *SMALL, *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def check_console(proc: subprocess.CompletedProcess, run_dir: Path, rounds: int) -> list[str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = (proc.stdout + proc.stderr).splitlines()
    assert len(console) <= rounds + 25, "\n".join(console)
    round_lines = [line for line in console if line.startswith("round ")]
    assert [line.split()[1] for line in round_lines] == [f"{r}/{rounds}" for r in range(1, rounds + 1)]
    for line in round_lines:
        assert "PM " in line and "level1 " in line and "GM " in line
    # Flower's own lines are in the log file, not on the console.
    log = (run_dir / "simulate.log").read_text()
    for noise in ("[ROUND 1]", "[flwr]"):
        assert noise in log and not any(noise in line for line in console), noise
    assert all(line in log for line in round_lines)
    # the summary: every level, the outputs named
    assert any(line.startswith("PM ") for line in console) and any(line.startswith("GM ") for line in console)
    assert any(line.startswith("outputs: ") and "report.md" in line and "accuracy.png" in line for line in console)
    return console


def test_inprocess_run_console_and_log_file(tmp_path):
    rounds = 3
    proc = simulate(tmp_path, "runtime=inprocess")
    check_console(proc, tmp_path, rounds)


@pytest.mark.slow
def test_ray_run_console_keeps_flower_and_ray_in_the_log_file(tmp_path):
    rounds = 2
    proc = simulate(tmp_path, "runtime=simulation", f"global_rounds={rounds}")
    console = check_console(proc, tmp_path, rounds)
    log = (tmp_path / "simulate.log").read_text()
    assert "DEPRECATED FEATURE" in log and "Started a local Ray instance" in log
    assert not any("pid=" in line for line in console), "\n".join(console)
    # The start-up's phases, between the header and round 1 (off a terminal nothing else moves meanwhile);
    # the only lines that name Ray, and in the log file too.
    first_round = next(i for i, line in enumerate(console) if line.startswith("round 1/"))
    startup = [line for line in console[:first_round] if line.startswith("hfl: ")][1:]
    assert [re.sub(r"[0-9]+(\.[0-9]+)?", "N", line) for line in startup] == [
        "hfl: starting Flower's simulation on a local Ray instance: N SuperNodes, one per level-N node",
        "hfl: Ray started in N s",
        "hfl: Ray's N actors ready in N s; round N first builds each level-N node and its devices in its actor"]
    assert [line for line in console if "Ray" in line] == startup[:3] and all(line in log for line in startup)


def test_multirun_prints_a_line_per_job(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hfl.runtime.simulate", "-m", *SMALL, "runtime=inprocess", "global_rounds=2",
                           "seed=0,1", f"hydra.sweep.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if "[HYDRA]" not in line]
    # each job: its start-up line, its rounds, led by the job and what it sweeps, then its one line
    expected = []
    for job in (0, 1):
        run = load_run(tmp_path / str(job))
        expected += [f"#{job} seed={job}: round 1 first builds each level-1 node and its devices, in this process",
                     *(f"#{job} seed={job}: {round_line(line, 2)}" for line in run.metrics), job_line(run, job)]
    assert ours == expected
    assert [line[:18] for line in ours if re.match(r"#[0-9] seed=[0-9]: round [0-9]/", line)] == [
        "#0 seed=0: round 1", "#0 seed=0: round 2", "#1 seed=1: round 1", "#1 seed=1: round 2"]
    assert all(f"-> {tmp_path / str(job)}" in ours[3 + 4 * job] for job in (0, 1))


# ---------------------------------------------------------------- one name per level


def test_a_four_tier_run_names_each_level_once_in_console_report_and_hfl_report(tmp_path):
    """A 4-tier B-HFL run as a user runs it (hfl-simulate, then hfl-report on its folder): every output
    names the levels alike (PM, level1, level2, GM; bytes per level0..2), never by the 3-tier words
    (team, global), which named level 1 of any tree and the root's edges before."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hfl.runtime.simulate", "runtime=inprocess", "algorithm=bhfl",
                           "topology=tree", "topology.fanout=[2,2,3]", "global_rounds=1", "dataset.max_samples=300",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout.splitlines()
    (line,) = [line for line in console if line.startswith("round ")]
    assert [word for word in line.split() if not word[0].isdigit()] == ["round", "PM", "level1", "level2", "GM",
                                                                          "GM", "loss"]
    table = console[console.index(next(line for line in console if line.startswith("model "))) + 1:]
    assert [row.split()[0] for row in table[:4]] == ["PM", "level1", "level2", "GM"]
    (traffic,) = [line for line in console if line.startswith("bytes down/up")]
    assert [part.split()[0] for part in traffic.split(": ", 1)[1].split(", ")] == ["level0", "level1", "level2"]
    markdown = (run_dir / "report.md").read_text()
    rows = [line.split("|")[1].strip() for line in markdown.splitlines() if line.startswith("| ")]
    assert rows == ["model", "PM", "level1", "level2", "GM", "level", "level0", "level1", "level2"]
    report = subprocess.run([sys.executable, "-m", "hfl.output.report", str(run_dir), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert report.returncode == 0, report.stderr
    header = next(line for line in (tmp_path / "out" / "report.md").read_text().splitlines()
                  if line.startswith("| algorithm"))
    assert "level1 final" in header and "level2 final" in header
    for text in (proc.stdout, report.stdout, header):  # "global round" is the root's round, not a level's name
        words = set(re.sub(r"global rounds?", "", text).replace("|", " ").replace(",", " ").split())
        assert not words & {"team", "global", "(team)", "(global)"}, text
