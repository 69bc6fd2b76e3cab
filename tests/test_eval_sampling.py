"""Sampled evaluation (top-level ``eval_fraction``, issue 38): which devices are tested (seeded,
recorded in samples.jsonl), the figures and intervals reported from them, the config's checks,
and that the default (every device) is what evaluation always was."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hfl.device.training import LocalTrainer, to_tensors
from hfl.errors import ConfigError
from hfl.models import build_model
from hfl.output.console import round_line
from hfl.node.evaluation import accuracy_interval, pool_evaluations, target_report, DeviceScore
from hfl.runtime.build import eval_fraction, federation_for
from hfl.runtime.simulate import run
from hfl.tree.sampling import evaluation_sample, sample_children
from tests.conftest import SMALL, compose_cfg

TIMING = ("seconds", "compute_seconds")


def lines_of(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def results_of(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in lines_of(run_dir, "metrics.jsonl")]


def evaluated(run_dir: Path) -> list[dict]:
    return [r for r in lines_of(run_dir, "samples.jsonl") if "evaluated" in r]


# ---------------------------------------------------------------- the sample
def test_sample_size_is_the_ceiling_and_the_draw_is_seeded_by_node_and_round():
    children = list(range(10))
    first = evaluation_sample(children, 0.25, 0, "0", 1)
    assert first == [4, 5, 7]  # ceil(0.25 x 10) = 3, drawn from rng(0, "evaluate", "0", 1)
    assert evaluation_sample(children, 0.25, 0, "0", 1) == first  # the same seed, node and round: the same
    assert evaluation_sample(children, 0.25, 0, "0", 2) == [0, 4, 8]  # another round: another draw
    # a stream of its own: not the fit sample of the same node and round
    assert sample_children(children, 0.25, 0, "0", "1") == [3, 5, 6] != first
    assert evaluation_sample(children, 1.0, 0, "0", 1) == children
    assert evaluation_sample(children, 0.01, 0, "0", 1) in [[c] for c in children]  # at least one


def test_a_number_is_the_lowest_servers_fraction_a_list_is_per_level():
    assert [eval_fraction({"eval_fraction": 0.1}, level, 3) for level in range(3)] == [1.0, 1.0, 0.1]
    assert [eval_fraction({"eval_fraction": [0.5, 1, 0.25]}, level, 3) for level in range(3)] == [0.5, 1.0, 0.25]


# ---------------------------------------------------------------- the interval
def test_interval_of_the_pooled_accuracy_by_hand():
    # 3 devices of 30: p = 16/25 = 0.64; residuals c - p n = 1.6, -3.4, 1.8; s^2 = 17.36 / 2 = 8.68;
    # se = sqrt((1 - 3/30) x 8.68 / 3) / (25/3) = sqrt(2.604) / 8.3333 = 0.1936430
    low, high = accuracy_interval([(8, 10), (3, 10), (5, 5)], 30)
    assert low == pytest.approx(0.64 - 1.959964 * 0.1936430, abs=1e-6) and high == 1.0  # clipped
    # 2 devices of 100: p = 5/8; s^2 = (0.25 + 0.25) / 1; se = sqrt(0.98 x 0.5 / 2) / 4 = 0.1237437
    low, high = accuracy_interval([(2, 4), (3, 4)], 100)
    assert (low, high) == (pytest.approx(0.625 - 1.959964 * 0.1237437, abs=1e-6),
                           pytest.approx(0.625 + 1.959964 * 0.1237437, abs=1e-6))
    assert accuracy_interval([(2, 4), (3, 4)], 2) == (0.625, 0.625)  # every device: no sampling error
    assert accuracy_interval([(2, 4)], 100) is None  # one device: no spread to estimate
    assert accuracy_interval([(0, 0), (0, 0)], 100) is None


def test_pooled_figures_carry_devices_samples_and_interval_only_when_sampled():
    report = target_report("gm", [DeviceScore(0, 2, 4, 0.5), DeviceScore(7, 3, 4, 0.25)])
    full = pool_evaluations([report])
    assert full == pool_evaluations([report], population=2)  # every device tested: the line as it was
    assert not any("eval_" in k or "_ci_" in k for k in full)
    sampled = pool_evaluations([report], population=100)
    assert sampled["gm_accuracy"] == full["gm_accuracy"] == 0.625
    assert (sampled["gm_eval_devices"], sampled["gm_eval_samples"]) == (2, 8)
    assert sampled["gm_accuracy_ci_low"] == pytest.approx(0.625 - 1.959964 * 0.1237437, abs=1e-6)
    # the client mean (0.5 + 0.75) / 2 = 0.625; s^2 = 2 x 0.125^2 / 1; se = sqrt(0.98 x 0.03125 / 2) = 0.1237437
    assert sampled["gm_client_mean_accuracy"] == 0.625
    assert sampled["gm_client_mean_accuracy_ci_high"] == pytest.approx(0.625 + 1.959964 * 0.1237437, abs=1e-6)
    assert {k: v for k, v in sampled.items() if "eval_" not in k and "_ci_" not in k} == full
    line = {"round": 3, **sampled, "seconds": 1.0}
    assert round_line(line, 3) == "round 3/3  GM  62.50%  GM loss 0.3750  tested on 2 devices  1.00s"
    assert "tested" not in round_line({"round": 3, **full, "seconds": 1.0}, 3)


# ---------------------------------------------------------------- the config
BAD = [("eval_fraction=0", "eval_fraction"), ("eval_fraction=1.5", "eval_fraction"),
       ("eval_fraction=[1,0]", "eval_fraction[1]"), ("eval_fraction=[]", "eval_fraction"),
       ("eval_fraction=[1,1,0.5]", "eval_fraction")]  # 3 entries for a tree of depth 2


@pytest.mark.parametrize(("override", "key"), BAD)
def test_bad_eval_fraction_is_one_line_naming_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError) as caught:
        run(compose_cfg(*SMALL, "runtime=inprocess", override), tmp_path)
    assert caught.value.key == key and str(caught.value).startswith(f"{key}:")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "metrics.jsonl").exists()


# ---------------------------------------------------------------- runs
def test_fraction_one_is_the_full_evaluation_bit_for_bit(tmp_path):
    run(compose_cfg(*SMALL, "runtime=inprocess"), tmp_path / "default")
    run(compose_cfg(*SMALL, "runtime=inprocess", "eval_fraction=[1,1]"), tmp_path / "ones")
    assert results_of(tmp_path / "ones") == results_of(tmp_path / "default")  # every number, exactly
    assert (tmp_path / "ones" / "samples.jsonl").exists() is (tmp_path / "default" / "samples.jsonl").exists()
    assert evaluated(tmp_path / "ones") == []
    assert not any("eval_" in k or "_ci_" in k for row in results_of(tmp_path / "ones") for k in row)


def test_a_sampled_figure_is_the_pooled_accuracy_of_the_recorded_devices(tmp_path):
    cfg = compose_cfg(*SMALL, "runtime=inprocess", "algorithm=fedavg", "eval_fraction=0.5")
    run(cfg, tmp_path)
    rows, records = results_of(tmp_path), evaluated(tmp_path)
    fed = federation_for(cfg)
    last = [r for r in records if r["global_round"] == 3]
    assert [r["node"] for r in last] == ["0", "1"]
    devices = [int(cid) for r in last for cid in r["evaluated"]]
    for r in last:  # ceil(0.5 x 3) = 2 of each lowest server's 3 devices
        assert len(r["evaluated"]) == 2 and set(map(int, r["evaluated"])) <= set(fed.tree.devices(r["node"]))
    # the final GM tested directly on those devices' test splits
    trainer = LocalTrainer(build_model(cfg["model"], fed.input_shape, fed.num_classes))
    with np.load(tmp_path / "checkpoints" / "global_model.npz") as z:
        gm = to_tensors([z[f"arr_{i}"] for i in range(len([k for k in z.files if k.startswith("arr_")]))])
    correct = n = 0
    for d in devices:
        _, c, k = trainer.evaluate(gm, fed.devices[d].x_test, fed.devices[d].y_test)
        correct, n = correct + c, n + k
    final = rows[-1]
    assert final["gm_accuracy"] == correct / n
    assert (final["gm_eval_devices"], final["gm_eval_samples"]) == (4, n)
    assert final["gm_accuracy_ci_low"] <= final["gm_accuracy"] <= final["gm_accuracy_ci_high"]
    assert torch.is_tensor(gm[0])


def test_the_sample_is_the_seeds_and_the_root_samples_its_children_by_path(tmp_path):
    sampled = ("runtime=inprocess", "algorithm=fedavg", "eval_fraction=[0.5,0.6]")
    run(compose_cfg(*SMALL, *sampled), tmp_path / "a")
    run(compose_cfg(*SMALL, *sampled), tmp_path / "b")
    run(compose_cfg(*SMALL, *sampled, "seed=1"), tmp_path / "c")
    assert evaluated(tmp_path / "a") == evaluated(tmp_path / "b")
    assert results_of(tmp_path / "a") == results_of(tmp_path / "b")
    assert evaluated(tmp_path / "a") != evaluated(tmp_path / "c")
    for rnd in (1, 2, 3):
        records = [r for r in evaluated(tmp_path / "a") if r["global_round"] == rnd]
        root = [r for r in records if r["node"] == "root"]
        assert len(root) == 1 and len(root[0]["evaluated"]) == 1  # ceil(0.5 x 2) level-1 nodes
        below = [r for r in records if r["node"] != "root"]
        assert [r["node"] for r in below] == root[0]["evaluated"]  # only the asked node tests, 2 of its 3
        assert len(below[0]["evaluated"]) == math.ceil(0.6 * 3) == 2
    assert all(row["gm_eval_devices"] == 2 for row in results_of(tmp_path / "a"))


def test_depth_three_samples_at_every_level_and_ray_equals_inprocess(tmp_path):
    tree = ("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]", "algorithm.sample_fraction=[1,1,0.67]",
            "eval_fraction=[1,0.5,0.6]", "global_rounds=2")
    run(compose_cfg(*SMALL, *tree, "runtime=inprocess"), tmp_path / "inprocess")
    run(compose_cfg(*SMALL, *tree, "runtime=simulation"), tmp_path / "ray")
    records = evaluated(tmp_path / "inprocess")
    assert records == evaluated(tmp_path / "ray")
    for rnd in (1, 2):
        level1 = [r for r in records if r["global_round"] == rnd and r["node"].count(".") == 0]
        level2 = [r for r in records if r["global_round"] == rnd and r["node"].count(".") == 1]
        assert [len(r["evaluated"]) for r in level1] == [1, 1]
        assert [r["node"] for r in level2] == [c for r in level1 for c in r["evaluated"]]
        assert all(len(r["evaluated"]) == 2 for r in level2)
    local, ray = results_of(tmp_path / "inprocess"), results_of(tmp_path / "ray")
    for a, b in zip(ray, local, strict=True):
        assert a["gm_eval_devices"] == b["gm_eval_devices"] == 4
        for key in ("gm_accuracy", "pm_accuracy", "level2_accuracy", "gm_accuracy_ci_low"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key


def test_the_hooks_a_deployment_uses_get_the_sample_alone(tmp_path):
    """A deployment's node evaluates through evaluate_targets / evaluate_many over the manager the
    engine hands them (hfl.deploy.grid): the sampled children only, the record naming them."""
    from hfl.node.inprocess import evaluate_children
    from hfl.rules.payload import pack
    from hfl.runtime.build import build_level1_node, initial_model

    cfg = compose_cfg(*SMALL, "runtime=inprocess", "algorithm=fedavg", "topology.devices_per_team=10",
                      "eval_fraction=0.3")
    cfg["runtime"]["state_dir"] = str(tmp_path)
    asked = []

    def targets(manager, asks):  # noqa: ANN001, ANN202 - the EvaluateTargets hook
        asked.append(sorted(manager.all()))
        return [evaluate_children(manager, sent, ask) for sent, ask in asks]

    node = build_level1_node(cfg, 1, tmp_path)
    node.evaluate_targets = targets
    arrays, meta = pack("parts", {"gm": initial_model(cfg, federation_for(cfg))})
    _, _, metrics = node.evaluate(arrays, {**meta, "global_round": 4})
    record = json.loads(metrics["eval_samples"])
    assert record == [{"node": "1", "round": "4", "evaluated": asked[0]}] and len(asked) == 1
    assert len(asked[0]) == 3  # ceil(0.3 x 10)
    assert sorted(d for d, _, _ in json.loads(metrics["gm_devices"])) == [int(c) for c in asked[0]]
