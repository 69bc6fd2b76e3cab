"""A round costs what it touches, not the federation (issue 38): a lowest node makes the proxies
and devices of the children it asks only, its cids and holds are read when asked for, and a
tree from a fan-out skips the checks it passes by construction."""

from __future__ import annotations

import pytest

from hfl.node.inprocess import ChildProxies, InProcessClientProxy, LazyClientManager, ordered_children
from hfl.rules.payload import pack
from hfl.runtime.build import build_level1_node, federation_for, initial_model
from hfl.runtime.children import DeviceCids, DeviceHolds, SubtreeHolds
from hfl.tree.shape import Tree, from_fanout
from tests.conftest import compose_cfg, rule_context


def test_device_cids_sort_as_their_strings_and_name_only_the_nodes_devices():
    cids = DeviceCids([42, 7, 999_999])
    assert list(cids) == ["000007", "000042", "999999"] == sorted(cids) and cids[1] == "000042"
    assert cids[0:2] == ["000007", "000042"] and len(cids) == 3
    assert cids.device("000042") == 42 and "000042" in cids
    for wrong in ("000043", "42", "x", 42, "0000042"):
        assert wrong not in cids
        with pytest.raises(KeyError):
            cids.device(wrong)
    # Seven-digit ids do not sort as their cids: the strings are sorted instead.
    big = DeviceCids([5, 1_000_000, 100_001])
    assert list(big) == sorted(["000005", "1000000", "100001"]) == ["000005", "1000000", "100001"]
    assert big.device("1000000") == 1_000_000
    holds = DeviceHolds(cids)
    assert holds["000007"] == frozenset([7]) and holds.get("000008") is None and len(holds) == 3


def test_child_proxies_are_made_when_read_and_kept():
    made = []

    def make(cid: str) -> InProcessClientProxy:
        made.append(cid)
        return InProcessClientProxy(cid, lambda: None)

    children = ChildProxies(DeviceCids(range(1000)), make)
    manager = LazyClientManager(children)
    assert manager.num_available() == 1000 and ordered_children(manager) is children and made == []
    first = children[3]
    assert children[3] is first and children.get("000003") is first and children.get("x") is None
    assert made == ["000003"]
    assert [p.cid for p in children[10:12]] == ["000010", "000011"] and len(made) == 3
    assert len(manager.all()) == 1000 and len(made) == 1000  # all(): every proxy (a full evaluation)


def test_subtree_holds_are_computed_when_asked_for():
    tree = from_fanout([2, 2, 3], 0)
    holds = SubtreeHolds(tree, tree.children("0"))
    assert list(holds) == ["0.0", "0.1"] and holds._made == {}
    assert holds["0.1"] == frozenset(tree.devices_under("0.1")) and list(holds._made) == ["0.1"]
    with pytest.raises(KeyError):
        holds["1.0"]


@pytest.mark.parametrize("fanout", [[4, 10], [2, 3, 5], [3, 2, 2, 4], [1, 7]])
def test_a_fanout_tree_equals_the_checked_tree_of_its_nested_lists(fanout):
    fast = from_fanout(fanout, 3)
    checked = Tree(fast.nested)
    assert fast == checked and fast._levels == checked._levels and fast._index == checked._index
    assert all(type(d) is int for d in fast.devices(fast.nodes_at(fast.depth - 1)[0]))


def test_a_sampled_node_of_1000_devices_makes_the_proxies_and_devices_it_asks(tmp_path):
    cfg = compose_cfg("algorithm=fedavg", "topology=tree", "topology.fanout=[2,1000]", "runtime=inprocess",
                      "algorithm.sample_fraction=[1,0.01]", "eval_fraction=0.005", "algorithm.local_steps=2",
                      "runtime.torch_threads=1")
    cfg["runtime"]["state_dir"] = str(tmp_path / "state")
    fed = federation_for(cfg)
    made_before = fed.devices.made
    node = build_level1_node(cfg, 0, cfg["runtime"]["state_dir"])
    node.fit(initial_model(cfg, fed), {"global_round": 1, "round_path": "1"})
    assert len(node.children.children._made) == 10  # ceil(0.01 x 1000) proxies, not 1,000
    assert fed.devices.made - made_before == 10
    node = build_level1_node(cfg, 0, cfg["runtime"]["state_dir"])
    arrays, meta = pack("parts", {"gm": initial_model(cfg, fed)})
    _, n, metrics = node.evaluate(arrays, {**meta, "global_round": 1})
    assert len(node.children.children._made) == 5  # ceil(0.005 x 1000) tested
    assert len(metrics["gm_devices"]) > 0 and metrics["gm_n"] == n


def test_sizes_and_validation_of_a_lazy_federation_come_without_making_a_device():
    from hfl.data import build_federation
    from hfl.data.federation import device_sizes, devices_without_validation

    topology = {"formation": "tree", "fanout": [2, 20]}
    for val in (0.0, 0.2):
        dataset = {**compose_cfg("dataset.val_fraction=0")["dataset"], "val_fraction": val}
        lazy = build_federation(dataset, topology, 5)
        sizes = [device_sizes(lazy, d) for d in range(40)]
        assert lazy.devices.made == 0
        assert devices_without_validation(lazy) == ([] if val else list(range(40))) and lazy.devices.made == 0
        eager = build_federation({**dataset, "lazy": False}, topology, 5)
        assert sizes == [(len(d.y_train), len(d.y_val), len(d.y_test)) for d in eager.devices]
        assert devices_without_validation(eager) == devices_without_validation(lazy)


def test_pflego_sums_every_devices_training_samples_from_the_size_draws():
    from hfl.rules.payload import Payload
    from strategies.pflego import PflegoServer

    cfg = compose_cfg("algorithm=pflego", "dataset=synthetic", "dataset.partition=natural", "topology=tree",
                      "topology.fanout=[2,20]", "algorithm.server_optimizer=sgd")
    fed = federation_for(cfg)
    made = fed.devices.made
    root = PflegoServer(rule_context(PflegoServer, cfg["algorithm"], "", 2, Payload("model", {"model": []}), None, fed, cfg))
    total = root.total_examples
    assert fed.devices.made == made  # no device made for it
    assert total == sum(len(fed.devices[d].y_train) for d in range(40))


def test_a_lowest_node_finds_the_drawn_devices_it_holds_without_listing_its_children():
    holds = DeviceHolds(DeviceCids(range(0, 1000, 2)))  # devices 0, 2, ..., 998
    for drawn in (frozenset([4, 5, 998, 1000]), frozenset(range(3, 2000, 3))):  # from either side
        assert holds.holding(drawn) == [c for c in holds if holds[c] & drawn]
    big = DeviceHolds(DeviceCids([5, 100_001, 1_000_000]))
    assert big.holding(frozenset([5, 1_000_000, 7])) == ["000005", "1000000"] == [c for c in big if c != "100001"]


def test_multilevel_clusters_are_read_when_asked_for_and_equal_the_listed_ones():
    from hfl.data import build_federation
    from hfl.data.multilevel import BlockPaths, block_of

    dataset = compose_cfg("dataset=synthetic_multilevel", "dataset.clusters=[2,4]", "dataset.scales=[1,1,1,0.5]")["dataset"]
    fed = build_federation(dataset, {"formation": "tree", "fanout": [2, 25]}, 0)
    assert isinstance(fed.device_clusters, BlockPaths) and len(fed.device_clusters) == 50
    listed = [[block_of(d, 50, n) for n in (2, 4)] for d in range(50)]
    assert fed.device_clusters == listed and list(fed.device_clusters) == listed
    assert fed.device_clusters[-1] == [1, 3] and fed.device_clusters[10:12] == listed[10:12]
    with pytest.raises(IndexError):
        fed.device_clusters[50]
