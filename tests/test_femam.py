"""FeMAM: the additive loss and frozen levels, grouping and weighted means, pruning decisions,
the schedule (rules by hand), and end to end: tree = flat, the team-level variant, FeSEM,
the per-client levels file and the config's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clients.femam import FemamClient
from hfl.device.state import DeviceRuntime
from hfl.errors import ConfigError
from hfl.models import MCLR
from hfl.rules.payload import pack
from hfl.runtime.simulate import run
from hfl.device.training import BatchSampler, LocalTrainer, to_ndarrays
from strategies import femam_rules as rules
from tests.conftest import compose_cfg

# 12 devices of nested-cluster synthetic data (2 then 4 clusters), MCLR, 4 levels: global,
# 2 clusters, 4 clusters, personal; 16 rounds.
BASE = ["algorithm=femam", "dataset=synthetic_multilevel", "dataset.clusters=[2,4]", "dataset.scales=[1.0,1.0,1.0,0.3]",
        "dataset.val_fraction=0.2", "model=mclr", "runtime=inprocess", "runtime.torch_threads=1", "topology=tree",
        "global_rounds=16", "algorithm.levels=[1,2,4,0]", "algorithm.rounds_per_level=[6,3,3,4]",
        "algorithm.prune_window=3", "dataset.batch_size=32", "algorithm.local_epochs=1", "algorithm.alpha=0.05"]


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- the additive model
def test_mean_of_log_softmax_outputs_has_the_cross_entropy_of_mean_logits():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(7, 5, generator=g) * 3 for _ in range(3)]
    y = torch.randint(0, 5, (7,), generator=g)
    ours = F.cross_entropy(rules.additive_output(None, torch.stack([torch.log_softmax(z, 1) for z in logits]).sum(0), 3), y)
    authors = F.cross_entropy(sum(logits) / 3, y)
    assert float(ours) == pytest.approx(float(authors), rel=1e-6)


def test_additive_loss_adds_the_prox_term_by_hand():
    out, frozen = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 2.0]])
    y = torch.tensor([0])
    params, anchor = [torch.tensor([1.0, 2.0])], [torch.tensor([0.0, 0.0])]
    mean = torch.tensor([[1.0, 1.0]])  # (out + frozen) / 2
    expected = float(F.cross_entropy(mean, y)) + 0.1 * (1 + 4)
    assert float(rules.additive_loss(frozen, out, 2, y, params, anchor, 0.1)) == pytest.approx(expected)


def make_device(n: int = 40, seed: int = 0) -> DeviceRuntime:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    trainer = LocalTrainer(MCLR((6,), 3))
    return DeviceRuntime(0, x[:30], y[:30], x[30:35], y[30:35], trainer, BatchSampler(30, 30, 1),
                         x_val=x[35:], y_val=y[35:])


def fit_config(parts: dict, **extra) -> dict:
    arrays, meta = pack("parts", parts)
    config = {"alpha": 0.5, "local_steps": 1, "local_epochs": 0, "prox": 0.01, "num_levels": 3, "prune": "paper",
              "femam_kind": rules.CLUSTER, **meta, **extra}
    return arrays, config


def test_only_the_newest_level_trains_on_the_additive_loss_and_frozen_levels_stay():
    dev = make_device()
    client = FemamClient(dev)
    g = torch.Generator().manual_seed(3)
    level1 = [torch.randn(3, 6, generator=g), torch.randn(3, generator=g)]
    start = [torch.randn(3, 6, generator=g), torch.randn(3, generator=g)]
    arrays, config = fit_config({"model": to_ndarrays(start), "freeze": to_ndarrays(level1)},
                                femam_level=2, femam_first=1, femam_keep=1)
    new, n, metrics = client.fit(arrays, config)
    # one full-batch step, by autograd on the additive loss with level 1 frozen
    leaves = [p.clone().requires_grad_(True) for p in start]
    frozen_out = torch.log_softmax(dev.x_train @ level1[0].T + level1[1], 1)
    out = torch.log_softmax(dev.x_train @ leaves[0].T + leaves[1], 1)
    loss = F.cross_entropy((frozen_out + out) / 2, dev.y_train) + 0.01 * sum(((p - s) ** 2).sum() for p, s in zip(leaves, start))
    grads = torch.autograd.grad(loss, leaves)
    for got, p, gr in zip(new, start, grads, strict=True):
        np.testing.assert_allclose(got, (p - 0.5 * gr).numpy(), atol=1e-6)
    assert n == 30 and metrics["val_n"] == 5
    assert metrics["train_loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    # the frozen level is kept as sent, and the validation loss is of the model it received
    np.testing.assert_array_equal(dev.extra["frozen0_0"], level1[0].numpy())
    assert dev.extra["kept"].tolist() == [1, -1, -1]
    val_mean = (torch.log_softmax(dev.x_val @ level1[0].T + level1[1], 1) + torch.log_softmax(dev.x_val @ start[0].T + start[1], 1)) / 2
    assert metrics["val_loss_sum"] == pytest.approx(float(F.cross_entropy(val_mean, dev.y_val, reduction="sum")), rel=1e-5)


def test_a_pruned_level_leaves_the_prediction_under_the_papers_rule_only():
    dev = make_device()
    client = FemamClient(dev)
    client.freeze(0, to_ndarrays([torch.ones(3, 6), torch.zeros(3)]), 1, 3)
    client.freeze(1, to_ndarrays([torch.zeros(3, 6), torch.ones(3)]), 0, 3)
    assert len(client.frozen_models(2, "paper")) == 1
    assert len(client.frozen_models(2, "code")) == 2
    assert rules.in_prediction([1, 0, -1], "paper") == [0] and rules.in_prediction([1, 0, -1], "code") == [0, 1]


# ---------------------------------------------------------------- grouping
def test_clustering_features_are_the_last_layer_over_its_absolute_sum():
    model = [np.ones((2, 2)), np.array([[1.0, -2.0], [3.0, 0.0]]), np.array([2.0, -6.0])]
    expected = np.array([1.0, -2.0, 3.0, 0.0, 2.0, -6.0]) / 2.0
    np.testing.assert_allclose(rules.clustering_features(model), expected)


def test_kmeans_recovers_separated_groups_seeded_and_caps_k():
    rng = np.random.default_rng(0)
    points = np.concatenate([rng.normal(c, 0.01, (5, 3)) for c in (0.0, 5.0, -5.0)])
    labels = rules.kmeans_labels(points, 3, seed=1)
    assert all(len(set(labels[i * 5:(i + 1) * 5])) == 1 for i in range(3)) and len(set(labels)) == 3
    assert np.array_equal(labels, rules.kmeans_labels(points, 3, seed=1))
    assert rules.kmeans_labels(points[:2], 5, seed=1).tolist() in ([0, 1], [1, 0])
    assert rules.kmeans_labels(points, 1, seed=1).tolist() == [0] * 15


def test_nearest_centre_and_weighted_group_means_by_hand():
    centres = {0: [np.array([0.0, 0.0])], 3: [np.array([10.0, 0.0])]}
    models = [[np.array([1.0, 0.0])], [np.array([9.0, 1.0])], [np.array([4.0, 0.0])]]
    labels = rules.nearest_labels(models, centres)
    assert labels.tolist() == [0, 3, 0]
    means = rules.group_means(models, [1, 5, 3], labels)
    np.testing.assert_allclose(means[0][0], (1 * np.array([1.0, 0.0]) + 3 * np.array([4.0, 0.0])) / 4)
    np.testing.assert_allclose(means[3][0], [9.0, 1.0])


# ---------------------------------------------------------------- schedule and pruning
def test_pruning_compares_the_last_window_with_the_last_kept_level():
    assert rules.keeps_level([5, 1, 1], [2, 2, 2], window=2)  # 1 < 2
    assert not rules.keeps_level([1, 3, 3], [2, 2, 2], window=2)  # 3 >= 2: epsilon = 0
    assert not rules.keeps_level([2, 2], [2, 2], window=5)  # equal is not lower
    assert rules.last_kept([1, 0, 1, -1], before=3) == 2 and rules.last_kept([1, 0, 0, -1], before=3) == 0


def test_fixed_and_convergence_schedules():
    fixed = rules.Schedule("fixed", (3, 2))
    assert not fixed.level_done(0, 2, []) and fixed.level_done(0, 3, []) and fixed.level_done(1, 2, [])
    conv = rules.Schedule("convergence", (1, 1), window=3, tol=0.01)
    assert not conv.level_done(0, 2, [1.0, 1.0])  # fewer rounds than the window
    assert not conv.level_done(0, 3, [1.0, 0.5, 0.2])
    assert conv.level_done(0, 4, [3.0, 0.501, 0.5, 0.499])


def test_level_kinds():
    kinds = [rules.level_kind(i, k, 3) for i, k in enumerate([1, 5, 5, 0])]
    assert kinds == [rules.GLOBAL, rules.CLUSTER, rules.TEAM, rules.PERSONAL]
    assert rules.level_kind(0, 5, None) == rules.CLUSTER  # FeSEM: no global level


# ---------------------------------------------------------------- end to end
@pytest.mark.slow
def test_tree_equals_flat_and_levels_are_recorded(tmp_path):
    """Devices' models relayed up and grouped at the root in device order: a 3x4 and a 2x2x3 tree
    give the flat run's PMs (level 1's composed means differ only in float summation order)."""
    runs = []
    for i, fanout in enumerate(("[1,12]", "[3,4]", "[2,2,3]")):
        run(compose_cfg(*BASE, f"topology.fanout={fanout}"), tmp_path / str(i))
        runs.append(lines(tmp_path / str(i)))
    flat = runs[0]
    assert [line["femam_level"] for line in flat] == [1] * 6 + [2] * 3 + [3] * 3 + [4] * 4
    assert flat[-1]["pm_accuracy"] > flat[5]["pm_accuracy"] + 0.05  # the levels added after level 1 help here
    for other in runs[1:]:
        for a, b in zip(flat, other, strict=True):
            assert a["pm_accuracy"] == b["pm_accuracy"] and a["pm_loss"] == pytest.approx(b["pm_loss"], abs=1e-6)
    levels = [json.loads((tmp_path / str(i) / "femam_levels.json").read_text()) for i in range(3)]
    assert levels[0] == levels[1] == levels[2]
    assert levels[0]["rounds"] == [6, 3, 3, 4] and len(levels[0]["kept"]) == 12
    assert all(row[0] == 1 and all(f in (0, 1) for f in row) for row in levels[0]["kept"].values())


@pytest.mark.slow
def test_team_level_groups_are_the_lowest_servers(tmp_path):
    """With team_level=2 the level-2 groups are the lowest servers: a 3x4 tree and the same teams
    under an extra level (3x1x4) give the same models; flat FeMAM's learned clusters differ."""
    common = [*BASE, "algorithm.team_level=2"]
    run(compose_cfg(*common, "topology.fanout=[3,4]"), tmp_path / "a")
    run(compose_cfg(*common, "topology.fanout=[3,1,4]"), tmp_path / "b")
    run(compose_cfg(*BASE, "topology.fanout=[3,4]"), tmp_path / "c")
    a, b, c = lines(tmp_path / "a"), lines(tmp_path / "b"), lines(tmp_path / "c")
    assert [x["pm_accuracy"] for x in a] == [x["pm_accuracy"] for x in b]
    assert [x["pm_accuracy"] for x in a][6:] != [x["pm_accuracy"] for x in c][6:]


@pytest.mark.slow
def test_fesem_groups_clients_and_has_no_global_model(tmp_path):
    base = [o for o in BASE if not o.startswith(("algorithm=", "algorithm.levels", "algorithm.rounds_per_level"))]
    cfg = compose_cfg(*base, "algorithm=fesem", "algorithm.levels=[4]", "topology.fanout=[3,4]", "global_rounds=6")
    run(cfg, tmp_path)
    out = lines(tmp_path)
    assert out[-1]["gm_accuracy"] is None and out[-1]["pm_accuracy"] > out[0]["pm_accuracy"]


@pytest.mark.parametrize("override,key", [
    ("algorithm.levels=[1,0,5]", "algorithm.levels"),
    ("algorithm.rounds_per_level=[1,2]", "algorithm.rounds_per_level"),
    ("algorithm.team_level=1", "algorithm.team_level"),
    ("algorithm.prune=sometimes", "algorithm.prune"),
    ("algorithm.team_rounds=2", "algorithm.team_rounds"),
    ("dataset.val_fraction=0.0", "dataset.val_fraction"),
])
def test_bad_femam_configs_are_refused(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        run(compose_cfg(*BASE, "topology.fanout=[3,4]", override), tmp_path)
