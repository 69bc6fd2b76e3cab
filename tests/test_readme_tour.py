"""The README's commands are run, shortened, by the suite (issue 49, item 2): every ``hfl-simulate``
line of the README composes and passes the config checks (each value of a swept key), the tour's
sweep, ``hfl-report`` and the tour's trees run as processes (shortened), the loopback deployment
block runs as typed (-m deployment, slow), ``mkdocs serve`` serves the site, and ``make run``
installs the extras the tour uses. Run elsewhere: the demo (tests/test_multilevel.py, 6 rounds),
trackers in their UIs (tests/test_tracker_uis.py), the docs build (tests/test_docs.py),
``hfl-deploy simulate`` (tests/test_deployment.py), ``--help`` (tests/test_cli_help.py)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hfl.config.compose import compose_config

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def readme_commands(program: str) -> list[list[str]]:
    """The README's ``program`` command lines in its bash blocks, continuation lines joined, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line, comments=True) for line in lines if line.startswith(program + " ")]


def sweep_values(value: str) -> list[str]:
    """Hydra's comma sweep (``a,b,c``; commas inside brackets belong to a list)."""
    parts, depth, current = [], 0, ""
    for char in value:
        depth += 1 if char in "[{" else -1 if char in "]}" else 0
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def composable(argv: list[str]) -> list[list[str]]:
    """The override lists a command runs: one per value of each swept key (the others at their first)."""
    overrides = [arg for arg in argv[1:] if arg != "-m" and not arg.startswith("hydra.")]
    swept = {i: sweep_values(arg.split("=", 1)[1]) for i, arg in enumerate(overrides)
             if "=" in arg and len(sweep_values(arg.split("=", 1)[1])) > 1}
    first = [arg if i not in swept else f"{arg.split('=', 1)[0]}={swept[i][0]}" for i, arg in enumerate(overrides)]
    runs = [first]
    for i, values in swept.items():
        runs += [[*first[:i], f"{overrides[i].split('=', 1)[0]}={v}", *first[i + 1:]] for v in values[1:]]
    return runs


COMMANDS = readme_commands("hfl-simulate")


def test_the_readme_has_the_commands_this_file_checks():
    assert len(COMMANDS) >= 10  # the tour's and the configuration section's
    assert any("-m" in argv for argv in COMMANDS)


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(argv[1:])[:60] for argv in COMMANDS])
def test_every_readme_hfl_simulate_command_composes_and_passes_the_checks(argv):
    for overrides in composable(argv):
        cfg = compose_config(shlex.join(overrides), 0)  # raises ConfigError naming the key on a bad value
        assert cfg["algorithm"]["name"] and cfg["global_rounds"] >= 1


def test_the_tour_sweep_and_report_run_shortened(tmp_path):
    """Tour step 3 as typed, with 1 global round and 2 seeds: the sweep, then hfl-report on its folder."""
    (sweep,) = [argv for argv in COMMANDS if "-m" in argv and any(a.startswith("algorithm=") for a in argv)]
    argv = [a if not a.startswith("seed=") else "seed=0,1" for a in sweep[1:]]
    proc = subprocess.run([str(BIN / "hfl-simulate"), *argv, "global_rounds=1", f"hydra.sweep.dir={tmp_path}/multirun"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each job's round led by the job and the values it sweeps, as the README quotes one
    assert re.findall(r"^#([0-9]) (algorithm=[a-z]+,seed=[01]): round 1/1 ", proc.stdout, re.MULTILINE) == [
        (str(job), f"algorithm={algorithm},seed={seed}") for job, (algorithm, seed) in
        enumerate((a, s) for a in ("permfl", "fedavg", "pfedme") for s in (0, 1))]
    assert "`#7 algorithm=pfedme,seed=1: round 9/30 ...`" in (ROOT / "README.md").read_text()
    (report,) = readme_commands("hfl-report")
    proc = subprocess.run([str(BIN / "hfl-report"), f"{tmp_path}/multirun", *report[2:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("hfl-report: 6 run(s) in 1 dataset/model group(s): report/report.md")
    assert (tmp_path / "report" / "report.md").read_text().count("| 2 (0, 1) |") == 3  # 3 algorithms x 2 seeds


TREES = [argv for argv in COMMANDS if "topology=tree" in argv and "algorithm=bhfl" in argv and "resume=true" not in argv]


@pytest.mark.parametrize("argv", TREES, ids=[f"fanout {a[3].split('=')[1]}" for a in TREES])
def test_the_tour_trees_run_one_round(tmp_path, argv):
    """Tour step 2 as typed, 1 global round in process (30 rounds took 41 s on Ray)."""
    proc = subprocess.run([str(BIN / "hfl-simulate"), *argv[1:], "global_rounds=1", "runtime=inprocess",
                           f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "round 1/1" in proc.stdout and (tmp_path / "run" / "summary.json").is_file()


def readme_block(containing: str) -> str:
    """The README's bash block holding ``containing``."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
                if containing in b]
    return block


@pytest.mark.deployment
@pytest.mark.slow
def test_the_tours_loopback_deployment_runs_as_typed(tmp_path):
    """Tour step 4, the shell block as the README gives it (its ports, its sleep), in a scratch folder."""
    block = readme_block("hfl-deploy global").replace("/tmp/hfl-dep", str(tmp_path / "dep"))
    env = {**__import__("os").environ, "PATH": f"{BIN}:{__import__('os').environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", "set -m\n" + block + "\nwait"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert "finished:completed" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
    (run,) = (tmp_path / "dep" / "out").iterdir()
    assert "seed: 0" in (run / "report.md").read_text()
    # submit says the rounds as they end and the summary table (the run's folder is on this host)
    out = proc.stdout.splitlines()
    rounds = [line for line in out if re.match(r"round [1-5]/5  PM ", line)]
    assert [line[:9] for line in rounds] == [f"round {r}/5" for r in range(1, 6)], proc.stdout[-4000:]
    done = next(i for i, line in enumerate(out) if "finished:completed" in line)
    assert out.index(rounds[-1]) < done and out[done + 2].split()[0] == "model"
    assert [line.split()[0] for line in out[done + 3:done + 6]] == ["PM", "level1", "GM"]
    assert any(line.startswith("outputs: ") and "report.md" in line for line in out[done:])
    # a result that makes sense: the demo's 4 devices reach well above chance (10 classes) in 5 rounds
    final = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["gm_accuracy"] > 0.3 and final["pm_accuracy"] > 0.6, final
    # the roles said one line per process instead of their processes' logs
    assert "hfl-deploy: runner started" in proc.stdout and "Starting Flower SuperNode" not in proc.stdout


def test_mkdocs_serve_serves_the_site_on_loopback(tmp_path):
    """The README's last command, ``.venv/bin/mkdocs serve`` (on a free loopback port: its default 8000 may be taken)."""
    import urllib.request

    from hfl.deploy.loopback import free_ports
    from tests.test_tracker_uis import serving, wait_for

    mkdocs = BIN / "mkdocs"
    if not mkdocs.exists():
        pytest.skip(f"{mkdocs} is absent: make run installs the docs extra")
    assert "`.venv/bin/mkdocs serve` serves these pages" in (ROOT / "README.md").read_text()
    (port,) = free_ports(1)
    log = tmp_path / "mkdocs.log"
    with serving([str(mkdocs), "serve", "-a", f"127.0.0.1:{port}", "--no-livereload"], ROOT, log) as proc:
        page = wait_for("mkdocs serve", lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/runtimes.html",
                                                                        timeout=5).read(), proc, log)
    assert b"flwr run ." in page and b"<html" in page.lower()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_run_installs_the_tours_extras():
    # As a user's shell runs it: under CI's `make test` a nested make would print its directory lines.
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "--no-print-directory", "-n", "-B", "run", "ARGS=global_rounds=5"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    assert '-e ".[docs,track]"' in out  # tensorboard / mlflow / mkdocs serve, which the tour asks for
    assert out.strip().splitlines()[-1] == ".venv/bin/hfl-simulate experiment=demo global_rounds=5"
