"""``hfl-simulate --help`` and Hydra's completion, run as a user runs them (the installed script, a
process, its exit status): hfl's own page (conf/hydra/help/hfl.yaml) with every group a user picks
from conf/ and none of the schema's, overrides and examples that compose, and Tab completion
answered without the imports of a run (hfl/runtime/cli.py). Times are printed, never asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hfl.config.compose import CONF_DIR
from hfl.runtime import cli
from tests.conftest import compose_cfg

ROOT = Path(__file__).resolve().parents[1]
GROUPS = sorted(path.name for path in CONF_DIR.iterdir() if path.is_dir() and path.name not in ("schema", "hydra"))


def hfl_simulate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed ``hfl-simulate`` (else the same entry point through the interpreter) with ``args``."""
    script = Path(sys.executable).parent / "hfl-simulate"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "hfl.runtime.cli"]
    start = time.monotonic()
    proc = subprocess.run([*command, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
                          env={**os.environ, **(env or {})})
    print(f"hfl-simulate {' '.join(args)}: exit {proc.returncode} in {time.monotonic() - start:.2f} s, "
          f"{len(proc.stdout.splitlines())} lines")
    return proc


def section(page: str, title: str) -> list[str]:
    """The lines of the page's section whose heading starts with ``title`` (up to the next blank line)."""
    lines = page.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start + 1:end]


def test_help_is_hfls_page_with_the_groups_users_pick_and_overrides_that_compose():
    proc = hfl_simulate("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = proc.stdout
    assert page.startswith("hfl-simulate: run a hierarchical, personalized federated learning experiment")
    assert "powered by Hydra" not in page and "schema" not in page
    assert "$" not in page.replace('"$(', "")  # every ${...} and $VAR of the template filled in
    assert len(page.splitlines()) < 60
    # Every group of conf/ a user picks, each with all its options, the default starred.
    listed = {}
    for line in section(page, "Config groups"):
        if not line.startswith("   "):  # a group's first line; wrapped options are indented further
            group, *options = line.split()
            listed[group] = options
        else:
            listed[group] += line.split()
    assert sorted(listed) == GROUPS
    defaults = {key: value for entry in yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]
                if isinstance(entry, dict) for key, value in entry.items()}
    for group, options in listed.items():
        assert sorted(o.rstrip("*") for o in options) == sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")), group
        starred = [o.rstrip("*") for o in options if o.endswith("*")]
        assert starred == ([defaults[group]] if defaults[group] else []), group  # experiment: none by default
    # The overrides and examples it shows compose (the first value of a sweep's list; Hydra's own keys aside).
    shown = [token for line in section(page, "Common overrides") + section(page, "Examples")
             for token in line.split() if re.fullmatch(r"[a-z_.]+=[^\s|]+", token) and not token.startswith("hydra.")]
    assert len(shown) >= 15
    for token in shown:
        key, value = token.split("=", 1)
        compose_cfg(f"{key}={value.split(',')[0]}")  # raises on an unknown key, option or bad value
    for line in ("hfl-simulate --cfg job", "hfl-simulate --info defaults", "hfl-simulate --hydra-help",
                 'eval "$(hfl-simulate -sc install=bash)"', "hfl-simulate -m "):
        assert line in page, line


def test_help_stars_the_options_chosen_on_the_command_line():
    proc = hfl_simulate("algorithm=bhfl", "logger=mlflow", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    groups = {line.split()[0]: line.split()[1] for line in section(proc.stdout, "Config groups") if line[2] != " "}
    assert groups["algorithm"] == "bhfl*" and groups["logger"] == "mlflow*" and groups["model"] == "mclr*"


def test_a_bad_override_with_help_is_one_line_naming_the_key():
    proc = hfl_simulate("global_rounds=abc", "--help")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == "hfl-simulate: global_rounds: must be an integer, got 'abc'"


def test_hydras_completion_and_help_work_through_hfl_simulate():
    line = "hfl-simulate algorithm="
    proc = hfl_simulate("-sc", "query=bash", env={"COMP_LINE": line, "COMP_POINT": str(len(line))})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"algorithm=bhfl", "algorithm=permfl", "algorithm=fedavg"} <= set(proc.stdout.split())
    line = "hfl-simulate algorithm.team_"
    proc = hfl_simulate("-sc", "query=bash", env={"COMP_LINE": line, "COMP_POINT": str(len(line))})
    assert proc.stdout.split() == ["algorithm.team_rounds="]
    proc = hfl_simulate("-sc", "install=bash")
    assert proc.returncode == 0 and "complete -o nospace -o default -F hydra_bash_completion" in proc.stdout
    assert proc.stdout.rstrip().endswith("hfl-simulate")
    proc = hfl_simulate("--hydra-help")
    assert proc.returncode == 0 and "--shell-completion" in proc.stdout


@pytest.mark.parametrize(("argv", "expected"), [
    (["--help"], True), (["-h"], True), (["algorithm=bhfl", "--hydra-help"], True), (["-sc", "query=bash"], True),
    (["--shell-completion", "install=bash"], True), (["--cfg", "job"], False), (["--info"], False),
    (["global_rounds=3"], False), (["-m", "seed=0,1"], False),
])
def test_only_print_only_flags_skip_the_run_path(argv, expected):  # noqa: ANN001
    assert cli.prints_only(argv) is expected


def test_config_groups_lists_conf_groups_with_the_chosen_option_first():
    text = cli.config_groups({"algorithm": "pflego", "logger": "none"})
    lines = {line.split()[0]: line for line in text.splitlines() if not line.startswith("   ")}
    assert sorted(lines) == GROUPS
    assert lines["algorithm"].split()[1] == "pflego*" and lines["logger"].split()[1:] == ["none*", "mlflow", "tensorboard"]
    assert "needs" not in text and "schema" not in text
    assert max(len(line) for line in text.splitlines()) <= cli.WIDTH
