"""Team formation: random, by_label, explicit, tree, and their validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hfl.data import build_federation
from hfl.errors import ConfigError
from hfl.tree.formation import device_count_key, form_teams, form_tree, num_devices

CONF = Path(__file__).parents[1] / "conf" / "topology"


def random_cfg(num_teams=4, devices_per_team=10):
    return {"formation": "random", "num_teams": num_teams, "devices_per_team": devices_per_team,
            "team_labels": None, "teams": None}


def test_random_teams_equal_sizes_cover_all_and_are_seeded():
    cfg = random_cfg()
    teams = form_teams(num_devices(cfg), cfg, seed=0)
    assert [len(t) for t in teams] == [10, 10, 10, 10]
    assert sorted(d for t in teams for d in t) == list(range(40))
    assert all(t == sorted(t) for t in teams)
    assert teams == form_teams(40, cfg, seed=0)
    assert teams != form_teams(40, cfg, seed=1)
    assert teams != [list(range(i, i + 10)) for i in range(0, 40, 10)]  # actually shuffled


def test_random_without_devices_per_team_balances_sizes():
    teams = form_teams(10, random_cfg(3, None), seed=0)
    assert sorted(len(t) for t in teams) == [3, 3, 4]
    assert sorted(d for t in teams for d in t) == list(range(10))


def test_random_errors_name_the_key():
    with pytest.raises(ConfigError) as err:
        form_teams(4, random_cfg(5, None), seed=0)
    assert err.value.key == "topology.num_teams" and "more teams (5) than devices (4)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        form_teams(30, random_cfg(4, 10), seed=0)
    assert err.value.key == "topology.devices_per_team"
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ConfigError) as err:
            num_devices(random_cfg(bad, 10))
        assert err.value.key == "topology.num_teams"
    with pytest.raises(ConfigError) as err:
        num_devices({"formation": "ring"})
    assert err.value.key == "topology.formation" and "unknown formation 'ring'" in str(err.value)


def test_by_label_teams_are_contiguous_blocks():
    cfg = {"formation": "by_label", "num_teams": 2, "devices_per_team": 3, "team_labels": [[0, 1], [2, 3]]}
    assert num_devices(cfg) == 6
    assert form_teams(6, cfg, seed=0) == [[0, 1, 2], [3, 4, 5]]
    for labels, text in (([[0, 1]], "1 entries"), (None, "list of label lists"), ([[0, 0], [1]], "repeats"),
                         ([[0], []], "non-empty")):
        with pytest.raises(ConfigError) as err:
            form_teams(6, {**cfg, "team_labels": labels}, seed=0)
        assert err.value.key == "topology.team_labels" and text in str(err.value)


@pytest.mark.parametrize("name", ["by_label_worst", "by_label_average"])
def test_by_label_devices_only_hold_their_team_labels(name):
    topo = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    data = {"name": "synthetic", "partition": "classes", "classes_per_device": 2, "min_per_class": 1,
            "min_samples": 100}
    fed = build_federation(data, topo, seed=0)
    assert fed.level1_devices == [list(range(10)), list(range(10, 20))]
    for t, team in enumerate(fed.level1_devices):
        for j, device in enumerate(team):
            d = fed.devices[device]
            held = set(d.y_train.tolist()) | set(d.y_test.tolist())
            labels = topo["team_labels"][t]
            assert held == {labels[j % len(labels)], labels[(j + 1) % len(labels)]}
            assert held <= set(labels)


def test_explicit_teams_and_validation():
    cfg = {"formation": "explicit", "teams": [[3, 0], [1, 2, 4]], "num_teams": None, "devices_per_team": None}
    assert num_devices(cfg) == 5
    assert form_teams(5, cfg, seed=0) == [[0, 3], [1, 2, 4]]
    cases = [
        ({"teams": [[0, 1], [1, 2]]}, "topology.teams", "device 1 is in team 0 and team 1"),
        ({"teams": [[0, 1], [3]]}, "topology.teams", "outside 0..2"),
        ({"teams": [[0, 1], []]}, "topology.teams", "non-empty"),
        ({"teams": [[0, "1"], [2]]}, "topology.teams", "non-integer"),
        ({"teams": None}, "topology.teams", "non-empty list"),
        ({"teams": [[0, 1], [2]], "num_teams": 3}, "topology.num_teams", "lists 2 teams"),
        ({"teams": [[0, 1], [2]], "devices_per_team": 2}, "topology.devices_per_team", "[2, 1]"),
    ]
    for override, key, text in cases:
        bad = {**cfg, **override}
        with pytest.raises(ConfigError) as err:
            form_teams(3, bad, seed=0)
        assert err.value.key == key and text in str(err.value), str(err.value)
    with pytest.raises(ConfigError) as err:  # an id missing: 4 devices but ids 0..2 listed
        form_teams(4, {**cfg, "teams": [[0, 1], [2]]}, seed=0)
    assert err.value.key == "topology.teams" and "[3]" in str(err.value)


def test_shipped_topology_configs():
    expected = {"random": 40, "by_label_worst": 20, "by_label_average": 20, "explicit": 10, "tree": 30}
    for name, n in expected.items():
        cfg = yaml.safe_load((CONF / f"{name}.yaml").read_text())
        assert num_devices(cfg) == n
        teams = form_teams(n, cfg, seed=0)
        assert sorted(d for t in teams for d in t) == list(range(n))
        tree = form_tree(n, cfg, seed=0)
        assert tree.level1_devices == teams and tree.num_devices == n
        assert tree.depth == (3 if name == "tree" else 2)


def test_form_tree_keeps_three_tier_teams():
    """Every 3-tier formation's tree is the depth-2 tree over exactly form_teams' teams."""
    cfgs = [random_cfg(), random_cfg(3, None),
            {"formation": "explicit", "teams": [[3, 0], [1, 2, 4]], "num_teams": None, "devices_per_team": None},
            {"formation": "by_label", "num_teams": 2, "devices_per_team": 3, "team_labels": [[0, 1], [2, 3]]}]
    for cfg in cfgs:
        n = num_devices(cfg) if cfg.get("devices_per_team") or cfg["formation"] == "explicit" else 10
        for seed in (0, 1):
            tree = form_tree(n, cfg, seed)
            assert tree.depth == 2 and tree.level1_devices == form_teams(n, cfg, seed)
            assert [tree.devices(p) for p in tree.nodes_at(1)] == form_teams(n, cfg, seed)


def test_tree_device_count_key():
    assert device_count_key({"formation": "tree", "fanout": [2, 5]}) == "topology.fanout"
    assert device_count_key({"formation": "tree", "nodes": [[0], [1]]}) == "topology.nodes"
    assert device_count_key(random_cfg()) == "topology.devices_per_team"
