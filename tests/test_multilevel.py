"""The structured synthetic generator (devices share nested cluster-level models) and the
sequential team formation whose teams are its clusters."""

from __future__ import annotations

import numpy as np
import pytest

from hfl.data import build_federation
from hfl.data.multilevel import block_of, check_clusters, true_models
from hfl.errors import ConfigError
from hfl.tree.formation import form_teams
from tests.conftest import compose_cfg

SHAPE = (3, 5)


def test_blocks_are_contiguous_balanced_and_nested():
    blocks = [block_of(d, 10, 4) for d in range(10)]
    assert blocks == sorted(blocks) and set(blocks) == {0, 1, 2, 3}  # contiguous, every block used
    sizes = np.bincount(blocks)
    assert sizes.max() - sizes.min() <= 1
    fine, coarse = [block_of(d, 40, 8) for d in range(40)], [block_of(d, 40, 2) for d in range(40)]
    assert all(coarse[d] == fine[d] // 4 for d in range(40))


def test_teams_of_the_sequential_formation_are_the_clusters():
    teams = form_teams(10, {"formation": "sequential", "num_teams": 4, "devices_per_team": None}, seed=3)
    assert teams == [[d for d in range(10) if block_of(d, 10, 4) == t] for t in range(4)]


@pytest.mark.parametrize("scales, same", [([1, 0, 0], "all"), ([0, 1, 0], "cluster"), ([0, 0, 1], "none")])
def test_true_models_share_exactly_their_levels(scales, same):
    models = true_models(8, 0, [2], scales, SHAPE)
    for a in range(8):
        for b in range(a + 1, 8):
            shared = same == "all" or (same == "cluster" and block_of(a, 8, 2) == block_of(b, 8, 2))
            assert np.array_equal(models[a], models[b]) == shared


def test_nested_levels_add_up():
    both = true_models(8, 0, [2, 4], [0, 1, 1, 0], SHAPE)
    coarse = true_models(8, 0, [2, 4], [0, 1, 0, 0], SHAPE)
    fine = true_models(8, 0, [2, 4], [0, 0, 1, 0], SHAPE)
    for d in range(8):
        np.testing.assert_allclose(both[d], coarse[d] + fine[d])
    assert np.array_equal(fine[0], fine[1]) and not np.array_equal(fine[1], fine[2])  # 4 blocks of 2
    assert np.array_equal(coarse[0], coarse[3]) and not np.array_equal(coarse[3], coarse[4])  # 2 blocks of 4


@pytest.mark.parametrize("clusters", [[3, 4], [0], [20]])
def test_bad_cluster_levels_are_refused(clusters):
    with pytest.raises(ConfigError, match="dataset.clusters"):
        check_clusters(clusters, num_devices=10)


def test_federation_from_the_generator_is_seeded_and_labels_follow_the_models():
    cfg = compose_cfg("dataset=synthetic_multilevel", "topology=sequential")
    a = build_federation(cfg["dataset"], cfg["topology"], 0)
    b = build_federation(cfg["dataset"], cfg["topology"], 0)
    c = build_federation(cfg["dataset"], cfg["topology"], 1)
    assert len(a.devices) == 40 and a.level1_devices == [list(range(t * 10, t * 10 + 10)) for t in range(4)]
    assert all(np.array_equal(x.x_train, y.x_train) for x, y in zip(a.devices, b.devices, strict=True))
    assert not np.array_equal(a.devices[0].x_train, c.devices[0].x_train)
    ds = cfg["dataset"]
    models = true_models(40, 0, ds["clusters"], ds["scales"], (ds["num_classes"], ds["num_features"] + 1))
    dev = a.devices[7]
    x = np.concatenate([dev.x_train.numpy(), dev.x_test.numpy()])
    y = np.concatenate([dev.y_train.numpy(), dev.y_test.numpy()])
    w = models[7]
    np.testing.assert_array_equal(np.sort(np.argmax(x @ w[:, :-1].T + w[:, -1], axis=1)), np.sort(y))


def test_the_demo_shows_pm_above_team_above_gm_and_all_learning(tmp_path):
    """make run's experiment=demo, shortened to 6 in-process rounds."""
    import json

    from hfl.runtime.simulate import run

    run(compose_cfg("experiment=demo", "runtime=inprocess", "global_rounds=6"), tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        assert line["pm_accuracy"] > line["team_accuracy"] > line["gm_accuracy"]
    for key in ("pm_accuracy", "team_accuracy", "gm_accuracy"):
        assert lines[-1][key] > lines[0][key] + 0.01
    assert lines[-1]["gm_accuracy"] > 0.15 and lines[-1]["pm_accuracy"] > 0.5  # 10 classes: chance is 0.1
