"""hfl.tree.shape: paths, the Tree structure, random (fanout) and explicit (nested) formation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hfl.errors import ConfigError
from hfl.tree.formation import FORMATIONS, form_teams, form_tree, num_devices
from hfl.tree.shape import ROOT, Tree, child_path, from_fanout, from_nested, from_teams, level_of, parent_of

CONF = Path(__file__).parents[1] / "conf" / "topology"


def tree_cfg(fanout=None, nodes=None):
    return {"formation": "tree", "fanout": fanout, "nodes": nodes, "num_teams": None, "devices_per_team": None,
            "team_labels": None, "teams": None}


# ---------------------------------------------------------------- paths
def test_paths_and_levels():
    assert ROOT == ""
    assert child_path(ROOT, 3) == "3" and child_path("0", 2) == "0.2" and child_path("1.0", 11) == "1.0.11"
    assert [level_of(p) for p in ("", "3", "0.2", "1.0.11")] == [0, 1, 2, 3]
    assert parent_of("0.2") == "0" and parent_of("3") == ROOT and parent_of("1.0.11") == "1.0"
    with pytest.raises(ValueError):
        parent_of(ROOT)
    with pytest.raises(ValueError):
        child_path("0", -1)
    for path in ("", "3", "0.2", "1.0.11"):  # round trip
        if path:
            assert child_path(parent_of(path), int(path.rpartition(".")[2])) == path


# ---------------------------------------------------------------- structure
def test_fanout_2_3_5_shape():
    tree = from_fanout([2, 3, 5], seed=0)
    assert tree.depth == 3 and tree.num_devices == 30
    assert tree.nodes_at(0) == [ROOT]
    assert tree.nodes_at(1) == ["0", "1"]
    assert tree.nodes_at(2) == ["0.0", "0.1", "0.2", "1.0", "1.1", "1.2"]
    assert tree.inner_paths == ["0", "1", "0.0", "0.1", "0.2", "1.0", "1.1", "1.2"]
    assert tree.children(ROOT) == ["0", "1"] and tree.children("1") == ["1.0", "1.1", "1.2"]
    for path in tree.nodes_at(2):
        assert tree.is_lowest(path) and tree.children(path) == []
        assert len(tree.devices(path)) == 5 and tree.devices(path) == sorted(tree.devices(path))
        assert tree.devices_under(path) == tree.devices(path)
    assert not tree.is_lowest(ROOT) and not tree.is_lowest("0")
    assert tree.devices(ROOT) == [] and tree.devices("0") == []
    every = [d for p in tree.nodes_at(2) for d in tree.devices(p)]
    assert sorted(every) == list(range(30))  # every device exactly once
    assert tree.devices_under(ROOT) == list(range(30))
    assert tree.devices_under("0") == sorted(d for p in ("0.0", "0.1", "0.2") for d in tree.devices(p))
    assert tree.level1_devices == [tree.devices_under("0"), tree.devices_under("1")]
    assert [len(t) for t in tree.level1_devices] == [15, 15]
    with pytest.raises(ValueError):
        tree.nodes_at(3)  # devices are not servers


def test_unknown_path_is_a_key_error_naming_it():
    tree = from_fanout([2, 3, 5], seed=0)
    for bad in ("2", "0.3", "0.0.0", "x"):
        for method in (tree.children, tree.devices, tree.devices_under, tree.is_lowest):
            with pytest.raises(KeyError, match=repr(bad).replace(".", r"\.")):
                method(bad)


def test_fanout_k_m_equals_random_formation_teams():
    for seed in (0, 1, 7):
        random = {"formation": "random", "num_teams": 4, "devices_per_team": 10, "team_labels": None, "teams": None}
        tree = from_fanout([4, 10], seed)
        assert tree.depth == 2
        assert tree.level1_devices == form_teams(40, random, seed)  # same teams, same order
        assert [tree.devices(p) for p in tree.nodes_at(1)] == form_teams(40, random, seed)
        assert form_tree(40, random, seed) == tree
        assert form_tree(40, tree_cfg([4, 10]), seed) == tree


def test_fanout_tree_is_seeded():
    a, b, c = from_fanout([2, 3, 5], 0), from_fanout([2, 3, 5], 0), from_fanout([2, 3, 5], 1)
    assert a == b and a.nested == b.nested
    assert a != c
    # the lowest-level groups are the random formation's 6 teams of 5, regrouped into 2 parents
    random6 = form_teams(30, {"formation": "random", "num_teams": 6, "devices_per_team": 5}, seed=0)
    assert sorted(a.devices(p) for p in a.nodes_at(2)) == sorted(random6)
    # the level-1 grouping is seeded too
    groupings = {tuple(map(tuple, from_fanout([2, 2, 3], s).level1_devices)) for s in range(10)}
    assert len(groupings) > 1


def test_regrouping_uses_the_level_permutation():
    """Above the lowest level, parents at level l take sorted blocks of rng(seed, 'topology', 'tree', l)."""
    from hfl.seed import rng

    seed = 3
    lowest = form_teams(12, {"formation": "random", "num_teams": 6, "devices_per_team": 2}, seed)
    perm = rng(seed, "topology", "tree", 1).permutation(6)
    expected = [[lowest[i] for i in sorted(perm[b * 3:(b + 1) * 3])] for b in range(2)]
    tree = from_fanout([2, 3, 2], seed)
    assert [[tree.devices(p) for p in tree.children(q)] for q in tree.nodes_at(1)] == expected


def test_deeper_fanout_and_fanout_of_one():
    tree = from_fanout([2, 1, 3, 2], seed=5)
    assert tree.depth == 4 and tree.num_devices == 12
    assert [len(tree.nodes_at(level)) for level in range(4)] == [1, 2, 2, 6]
    assert all(len(tree.devices(p)) == 2 for p in tree.nodes_at(3))
    assert sorted(d for p in tree.nodes_at(3) for d in tree.devices(p)) == list(range(12))
    assert from_fanout([1, 4], 0).level1_devices == [[0, 1, 2, 3]]


def test_from_teams_is_depth_two():
    tree = from_teams([[0, 3], [1, 2, 4]])
    assert tree.depth == 2 and tree.num_devices == 5
    assert tree.nodes_at(1) == ["0", "1"] and tree.is_lowest("1")
    assert tree.devices("0") == [0, 3] and tree.level1_devices == [[0, 3], [1, 2, 4]]
    assert tree.children(ROOT) == ["0", "1"]
    assert tree == Tree(((0, 3), (1, 2, 4)))


def test_explicit_nested_trees_including_uneven_fanout():
    tree = from_nested([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    assert tree.depth == 3 and tree.num_devices == 8
    assert tree.devices("1.0") == [4, 5] and tree.level1_devices == [[0, 1, 2, 3], [4, 5, 6, 7]]
    uneven = from_nested([[[5, 0], [2]], [[1, 4, 3]], [[6], [7], [8, 9]]])
    assert uneven.depth == 3 and uneven.num_devices == 10
    assert uneven.children("0") == ["0.0", "0.1"] and uneven.children("1") == ["1.0"]
    assert uneven.children("2") == ["2.0", "2.1", "2.2"]
    assert uneven.devices("0.0") == [0, 5]  # sorted within a server
    assert uneven.level1_devices == [[0, 2, 5], [1, 3, 4], [6, 7, 8, 9]]
    assert uneven.nodes_at(2) == ["0.0", "0.1", "1.0", "2.0", "2.1", "2.2"]
    assert from_nested([[0, 1], [2]]).depth == 2
    deep = from_nested([[[[0]], [[1, 2]]]])
    assert deep.depth == 4 and deep.devices("0.1.0") == [1, 2] and deep.nodes_at(1) == ["0"]


# ---------------------------------------------------------------- topology=tree
def test_topology_tree_num_devices_and_form_tree():
    assert "tree" in FORMATIONS
    cfg = yaml.safe_load((CONF / "tree.yaml").read_text())
    assert cfg["formation"] == "tree" and cfg["fanout"] == [2, 3, 5] and cfg["nodes"] is None
    assert num_devices(cfg) == 30
    tree = form_tree(30, cfg, seed=0)
    assert tree == from_fanout([2, 3, 5], 0)
    assert form_teams(30, cfg, seed=0) == tree.level1_devices
    nested = tree_cfg(nodes=[[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    assert num_devices(nested) == 8
    assert form_tree(8, nested, seed=0).devices("1.1") == [6, 7]
    with pytest.raises(ConfigError) as err:  # the federation was built for another count
        form_tree(9, nested, seed=0)
    assert err.value.key == "topology.nodes"
    # 3-tier formations: unchanged teams inside a depth-2 tree
    explicit = {"formation": "explicit", "teams": [[3, 0], [1, 2, 4]], "num_teams": None, "devices_per_team": None}
    assert form_tree(5, explicit, 0) == from_teams([[0, 3], [1, 2, 4]])
    by_label = {"formation": "by_label", "num_teams": 2, "devices_per_team": 3, "team_labels": [[0, 1], [2, 3]]}
    assert form_tree(6, by_label, 0).level1_devices == [[0, 1, 2], [3, 4, 5]] and form_tree(6, by_label, 0).depth == 2


@pytest.mark.parametrize(
    ("fanout", "text"),
    [
        (None, "needs a fanout"),
        (5, "must be a list"),
        ("2,3", "must be a list"),
        ([], "at least 2 entries"),
        ([10], "at least 2 entries: servers and devices per server"),
        ([2, 0], ">= 1"),
        ([2, -3], ">= 1"),
        ([2, 2.5], "integers"),
        ([True, 4], "integers"),
        ([2, "3"], "integers"),
    ],
)
def test_bad_fanout_names_the_key(fanout, text):
    with pytest.raises(ConfigError) as err:
        num_devices(tree_cfg(fanout))
    assert err.value.key == "topology.fanout" and str(err.value).startswith("topology.fanout:")
    assert text in str(err.value), str(err.value)
    if fanout is not None:
        with pytest.raises(ConfigError) as err:
            from_fanout(fanout, 0)
        assert err.value.key == "topology.fanout"


def test_fanout_and_nodes_together_is_an_error():
    with pytest.raises(ConfigError) as err:
        num_devices(tree_cfg([2, 2], [[0, 1], [2, 3]]))
    assert err.value.key == "topology.nodes" and "not both" in str(err.value)


@pytest.mark.parametrize(
    ("nodes", "text"),
    [
        ("0,1", "nested list"),
        (7, "nested list"),
        ({"a": [0]}, "nested list"),
        ([], "the root is an empty list"),
        ([[0, 1], []], "server '1' is an empty list"),
        ([[[0, 1], []], [[2]]], "server '0.1' is an empty list"),
        ([[0, "1"], [2]], "server '0' has a non-integer device id '1'"),
        ([[0, 1.0], [2]], "non-integer device id 1.0"),
        ([[0, True], [2]], "non-integer device id True"),
        ([[0, None], [2]], "non-integer device id None"),
        ([[0, 1], [1, 2]], "device 1 appears twice: under server '0' and server '1'"),
        ([[[0, 1], [2]], [[3], [2, 4]]], "device 2 appears twice: under server '0.1' and server '1.1'"),
        ([[0, 1], [3]], "ids must be 0..2"),
        ([[0, -1], [1]], "ids must be 0..2"),
        ([[[0, 1], [2]], [3, 4]], "same depth"),
        ([[[0, 1]], [[[2]]]], "same depth"),
        ([[0, 1], [[2]]], "same depth"),
        ([[0, [1]], [2]], "same depth"),
        ([0, 1, 2], "depth >= 2"),
    ],
)
def test_bad_nodes_name_the_key(nodes, text):
    with pytest.raises(ConfigError) as err:
        from_nested(nodes)
    assert err.value.key == "topology.nodes" and str(err.value).startswith("topology.nodes:")
    assert text in str(err.value), str(err.value)
    with pytest.raises(ConfigError) as err:  # and before training, via the topology config
        num_devices(tree_cfg(nodes=nodes))
    assert err.value.key == "topology.nodes"

