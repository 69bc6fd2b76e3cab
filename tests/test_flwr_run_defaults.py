"""``flwr run .`` on Flower's defaults (issue 49, item 7): 2 simulated SuperNodes against a tree of 4
level-1 nodes stop at the ServerApp's start in one line naming hfl-deploy simulate (the root waited
runtime.team_wait_seconds and failed with a traceback: 92.8 s, against 24.9 s now)."""

from __future__ import annotations

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
