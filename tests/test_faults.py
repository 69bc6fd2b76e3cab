"""Simulated faults (runtime.dropout, runtime.dropout_nodes; hfl/node/faults.py) through the real
failure paths of every level, and the explicit Ray start (runtime.ray_address). Tiny federations,
in-process but for the one Ray run."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from hfl.errors import ConfigError
from hfl.node.faults import dropout_count, dropped_children
from hfl.runtime.build import federation_for
from hfl.runtime.simulate import ray_init_args, run
from tests.conftest import SMALL, compose_cfg

TEAMS_3x10 = ("runtime=inprocess", "topology.num_teams=3", "topology.devices_per_team=10", "runtime.dropout=0.3")


def lines_of(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def cids(devices) -> list[str]:  # noqa: ANN001
    return [f"{d:06d}" for d in devices]


def test_the_draw_is_an_exact_seeded_fraction_per_child():
    ids = cids(range(10))
    first = dropped_children(ids, 0.3, 0, "1", "4.2")
    assert len(first) == 3 and first == sorted(first)  # floor(0.3 x 10), in the children's order
    assert first == dropped_children(ids, 0.3, 0, "1", "4.2")  # counter-based: the same keys, the same draw
    others = [dropped_children(ids, 0.3, *keys) for keys in ((1, "1", "4.2"), (0, "2", "4.2"), (0, "1", "4.3"))]
    assert all(len(o) == 3 for o in others) and any(o != first for o in others)
    assert dropout_count(3, 0.3) == 0 and dropout_count(90, 0.7) == 63 and dropped_children(ids, 0.0, 0, "", "1") == []
    with pytest.raises(ValueError):
        dropout_count(10, 1.0)


@pytest.mark.parametrize("algorithm", ["fedavg", "permfl"])
def test_a_run_survives_30_percent_device_loss_with_min_fit_fraction_0_7(algorithm, tmp_path):
    cfg = compose_cfg(*SMALL, *TEAMS_3x10, f"algorithm={algorithm}", "algorithm.min_fit_fraction=0.7")
    summary = run(cfg, tmp_path)
    assert summary["rounds"] == cfg["global_rounds"]
    tree, seed, k = federation_for(cfg).tree, cfg["seed"], cfg["algorithm"]["team_rounds"]
    records = {(r["node"], r["round"]): r for r in lines_of(tmp_path, "samples.jsonl")}
    for line in lines_of(tmp_path, "metrics.jsonl"):
        g = line["round"]
        want = {(team, f"{g}.{r}"): dropped_children(cids(tree.devices(team)), 0.3, seed, team, f"{g}.{r}")
                for team in tree.children("") for r in range(1, k + 1)}
        assert {key: records[key]["dropped"] for key in want} == want  # the devices the seeded draw names
        assert line["failures_level2"] == sum(map(len, want.values())) == 3 * k * 3  # 30 % of 10 asked, every round
        assert line["failures_level1"] == 0 and line["evaluation_failures"] == 0
        assert line["failures"] == line["failures_level1"] + line["failures_level2"]
        assert line["gm_accuracy"] is not None  # every device is still evaluated (evaluation is not dropped)


def test_the_same_dropout_with_min_fit_fraction_1_stops_the_run_naming_it(tmp_path):
    cfg = compose_cfg(*SMALL, *TEAMS_3x10, "algorithm=fedavg", "algorithm.min_fit_fraction=1.0")
    with pytest.raises(RuntimeError, match=r"root: round 1: no model aggregated.*node \d: round 1\.1: .*3 failures; "
                                           r"10 usable updates needed \(algorithm.min_fit_fraction\)"):
        run(cfg, tmp_path)


def test_the_root_holds_min_fit_fraction_over_dropped_subtrees(tmp_path):
    # 2 level-1 nodes, one dropped every round: enough at 0.5, too few at 1.0 (the root's own check)
    assert run(compose_cfg(*SMALL, "runtime=inprocess", "runtime.dropout_nodes=0.5", "algorithm.min_fit_fraction=0.5"),
               tmp_path / "half")["rounds"] == 3
    assert [line["failures_level1"] for line in lines_of(tmp_path / "half", "metrics.jsonl")] == [1, 1, 1]
    with pytest.raises(RuntimeError, match=r"root: round 1: no model aggregated from 1 results .*1 failures; 2 usable "
                                           r"updates needed \(algorithm.min_fit_fraction\).*dropped out of round 1 of the root"):
        run(compose_cfg(*SMALL, "runtime=inprocess", "runtime.dropout_nodes=0.5"), tmp_path / "all")


def test_bhfl_depth3_drops_devices_and_subtrees_and_counts_them_per_level(tmp_path):
    cfg = compose_cfg(*SMALL, "runtime=inprocess", "algorithm=bhfl", "topology=tree", "topology.fanout=[3,2,5]",
                      "runtime.dropout=0.2", "runtime.dropout_nodes=0.34", "algorithm.min_fit_fraction=0.6")
    run(cfg, tmp_path)
    tree, seed, k = federation_for(cfg).tree, cfg["seed"], cfg["algorithm"]["team_rounds"]
    for line in lines_of(tmp_path, "metrics.jsonl"):
        g = line["round"]
        dead = dropped_children(tree.children(""), 0.34, seed, "", str(g))  # the root drops 1 of its 3 subtrees
        assert len(dead) == 1 and line["failures_level1"] == 1
        assert line["failures_level2"] == 0  # floor(0.34 x 2) = 0 below level 1
        alive = [n for top in tree.children("") if top not in dead for n in tree.children(top)]
        drops = [dropped_children(cids(tree.devices(n)), 0.2, seed, n, f"{g}.1.{r}")
                 for n in alive for r in range(1, k + 1)]
        assert line["failures_level3"] == sum(map(len, drops)) == len(alive) * k  # 1 of 5 devices
        assert line["failures"] == line["failures_level1"] + line["failures_level2"] + line["failures_level3"]


def test_a_node_below_min_fit_fraction_fails_and_its_parent_counts_it(tmp_path):
    # Node 0.0 has 4 devices: 1 drops (floor(0.25 x 4)), 3 < ceil(0.8 x 4) = 4, so it fails every call;
    # the other lowest nodes have 3 devices (none drop). Node 0 gets 4 of its 5 children, enough.
    nodes = "[[[0,1,2,3],[4,5,6],[7,8,9],[10,11,12],[13,14,15]],[[16,17,18],[19,20,21]]]"
    cfg = compose_cfg(*SMALL, "runtime=inprocess", "algorithm=bhfl", "topology=tree", "topology.fanout=null",
                      f"topology.nodes={nodes}", "runtime.dropout=0.25", "algorithm.min_fit_fraction=0.8")
    run(cfg, tmp_path)
    for line in lines_of(tmp_path, "metrics.jsonl"):
        # the failed node is one failure at its level; its own dropped device dies with it (never reported)
        assert (line["failures_level1"], line["failures_level2"], line["failures_level3"]) == (0, 1, 0)
        assert line["failures"] == 1


@pytest.mark.parametrize("overrides, key", [
    (("runtime.dropout=1.0",), "runtime.dropout"),
    (("runtime.dropout_nodes=-0.1",), "runtime.dropout_nodes"),
    (("runtime=deployment", "runtime.dropout=0.1"), "runtime.dropout"),
    (("runtime.ray_address=' '",), "runtime.ray_address"),
])
def test_bad_fault_and_ray_keys_are_refused_naming_them(overrides, key, tmp_path):
    with pytest.raises(ConfigError) as caught:
        run(compose_cfg(*SMALL, *overrides), tmp_path)
    assert caught.value.key == key


def test_ray_starts_a_fresh_local_instance_unless_given_a_cluster():
    assert ray_init_args({"ray_address": None, "ray_tmp_dir": None}) == {"address": "local", "include_dashboard": False}
    assert ray_init_args({"ray_address": "auto", "ray_tmp_dir": "/tmp/r"}) == {
        "address": "auto", "include_dashboard": False, "_temp_dir": "/tmp/r"}
    assert ray_init_args({"ray_address": "ray://head:10001"})["address"] == "ray://head:10001"
    assert compose_cfg("runtime=simulation")["runtime"]["ray_address"] is None


def test_dropout_on_ray_equals_inprocess_and_a_stale_ray_session_is_ignored(tmp_path):
    """One Ray run (devices and level-1 nodes dropped) against the same run in-process. Its Ray
    temp dir holds a ray_current_cluster file naming a cluster that is gone: ray.init() without
    an address would try to join it; the run starts its own instance instead."""
    faults = ("runtime.dropout=0.34", "runtime.dropout_nodes=0.5", "algorithm.min_fit_fraction=0.5")
    ray_tmp = Path(tempfile.mkdtemp(prefix="hflray"))  # short: Ray's socket paths live under it
    try:
        (ray_tmp / "ray_current_cluster").write_text("127.0.0.1:9\n")
        cfg = compose_cfg(*SMALL, *faults, "runtime=simulation", f"runtime.ray_tmp_dir={ray_tmp}")
        on_ray = run(cfg, tmp_path / "ray")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    in_process = run(compose_cfg(*SMALL, *faults, "runtime=inprocess"), tmp_path / "inprocess")
    local_lines = lines_of(tmp_path / "inprocess", "metrics.jsonl")
    for a, b in zip(lines_of(tmp_path / "ray", "metrics.jsonl"), local_lines, strict=True):
        assert {k: v for k, v in a.items() if "fail" in k} == {k: v for k, v in b.items() if "fail" in k}
        assert a["failures_level1"] == 1 and a["failures_level2"] > 0
        assert a["pm_accuracy"] == pytest.approx(b["pm_accuracy"])
        assert a["gm_loss"] == pytest.approx(b["gm_loss"], rel=1e-5)
    assert lines_of(tmp_path / "ray", "samples.jsonl") == lines_of(tmp_path / "inprocess", "samples.jsonl")
    with np.load(tmp_path / "ray" / "checkpoints" / "global_model.npz") as x, \
            np.load(tmp_path / "inprocess" / "checkpoints" / "global_model.npz") as y:
        for name in x.files:
            np.testing.assert_allclose(x[name], y[name], rtol=1e-5, atol=1e-6)
    assert on_ray["failures"] == in_process["failures"]
