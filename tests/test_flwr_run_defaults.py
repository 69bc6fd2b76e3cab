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
