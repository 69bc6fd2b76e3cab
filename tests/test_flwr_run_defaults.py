"""``flwr run .`` on Flower's defaults (issue 49, item 7): a bare ``flwr run .`` runs (the app's default
overrides fit Flower's 2 default SuperNodes); a federation whose SuperNodes do not match the level-1
nodes stops at the ServerApp's start in one line naming hfl-deploy simulate (the root waited
runtime.team_wait_seconds and failed with a traceback: 92.8 s, against 24.9 s now)."""

from __future__ import annotations

import json
import sys

import pytest

from hfl.app import check_federation
from tests.conftest import compose_cfg


class Grid:
    def __init__(self, nodes: int) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.nodes + 1))


def test_flowers_two_default_supernodes_against_four_teams_stop_in_one_line() -> None:
    cfg = compose_cfg()  # conf/config.yaml: 4 teams
    with pytest.raises(RuntimeError) as info:
        check_federation(Grid(2), cfg, "")
    message = str(info.value)
    assert "\n" not in message
    assert message == ("hfl: this federation has 2 SuperNodes and the experiment 4 level-1 nodes (one SuperNode each): "
                       "run `hfl-deploy simulate OVERRIDES`, which sizes the federation and stops its SuperLink, "
                       "or `flwr run . <connection> --federation-config num-supernodes=4`")
    with pytest.raises(RuntimeError, match=r"hfl-deploy simulate topology.num_teams=3`"):
        check_federation(Grid(2), compose_cfg("topology.num_teams=3"), "topology.num_teams=3")


def test_a_federation_of_the_right_size_goes_on() -> None:
    check_federation(Grid(2), compose_cfg("topology.num_teams=2"), "topology.num_teams=2")


def test_flowers_managed_superlink_is_found_among_the_ancestors(tmp_path) -> None:
    """The line names the pid of the SuperLink that `flwr run` started detached (it keeps running), found
    by its command line: flower-superlink logging to $FLWR_HOME/local-superlink/."""
    import subprocess
    import sys

    from hfl.app import managed_superlink

    log = f"{tmp_path}/local-superlink/superlink.log"
    code = "import time; time.sleep(30)"
    # argv[0] as Flower's console script has it; the program is this interpreter
    managed = subprocess.Popen([f"{tmp_path}/flower-superlink", "-c", code, "--log-file", log], executable=sys.executable)
    other = subprocess.Popen([sys.executable, "-c", code, "--log-file", "elsewhere.log"])
    try:
        assert managed_superlink(managed.pid) == managed.pid
        assert managed_superlink(other.pid) is None
    finally:
        managed.kill()
        other.kill()
        managed.wait()
        other.wait()


@pytest.mark.deployment
@pytest.mark.slow
def test_a_bare_flwr_run_works_on_flowers_defaults(tmp_path) -> None:
    """``flwr run . --stream`` as a Flower user types it (Flower's managed local SuperLink, its 2 default
    SuperNodes; the app's default run config: conf/config.yaml with topology.num_teams=2), in a private
    FLWR_HOME and on private ports. Flower's per-run environment build is turned off
    (FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1): it is Flower's, before any app code, and several GB."""
    import os
    import re
    import signal
    import subprocess
    import time
    from pathlib import Path

    from hfl.deploy.loopback import free_ports

    root = Path(__file__).resolve().parents[1]
    http, control = free_ports(2)
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home"), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http),
           "FLWR_LOCAL_CONTROL_API_PORT": str(control), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    # from a scratch folder: the managed SuperLink runs there, and the app's relative outputs/flwr with it
    proc = subprocess.run(["flwr", "run", str(root), "--stream"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    found = re.search(r"`kill (\d+)` stops it", proc.stdout + proc.stderr)
    try:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        assert "hfl: outputs in" in proc.stdout + proc.stderr and found, (proc.stdout + proc.stderr)[-4000:]
        (run,) = (tmp_path / "outputs" / "flwr").iterdir()
        summary = json.loads((run / "summary.json").read_text())
        assert summary["rounds"] == 30 and "seed: 0" in (run / "report.md").read_text()
    finally:
        if found:  # the line's command leaves nothing running
            os.kill(int(found.group(1)), signal.SIGTERM)
            for _ in range(100):
                if not Path(f"/proc/{found.group(1)}").exists():
                    break
                time.sleep(0.1)
    assert not Path(f"/proc/{found.group(1)}").exists()
