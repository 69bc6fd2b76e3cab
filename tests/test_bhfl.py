"""B-HFL (strategies.bhfl): its pure rules against hand-computed values, and short end-to-end
runs of residual edges and proxy training on a depth-3 tree."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hfl.device.state import stored_device_states
from hfl.errors import ConfigError
from hfl.rules.nodeopt import DEFAULTS
from hfl.runtime.simulate import run
from hfl.state.store import StateStore
from strategies.bhfl import check_config, largest_updates, merge_down, merge_up, spec_for
from tests.conftest import SMALL, compose_cfg


def v(*values: float) -> list[np.ndarray]:
    """A one-tensor model."""
    return [np.array(values, dtype=np.float64)]


def close(actual: list[np.ndarray], expected: list[float]) -> None:
    assert len(actual) == 1
    np.testing.assert_allclose(actual[0], expected, rtol=1e-12, atol=1e-12)


SGD = {"optimizer": "sgd", "lr": 1.0}


# ---------------------------------------------------------------- spec_for
def test_spec_for_merges_the_level_over_the_base():
    alg = {"up": {"optimizer": "sgd", "lr": 1.0}, "down": {"optimizer": "replace"},
           "levels": {"1": {"up": {"lr": 0.5, "momentum": 0.9}}, 2: {"down": {"optimizer": "adam", "lr": 0.01}}}}
    assert spec_for(alg, 1, "up") == {**DEFAULTS, "optimizer": "sgd", "lr": 0.5, "momentum": 0.9}
    assert spec_for(alg, 0, "up") == {**DEFAULTS, "optimizer": "sgd", "lr": 1.0}  # no override at level 0
    assert spec_for(alg, 1, "down")["optimizer"] == "replace"  # level 1 overrides only up
    assert spec_for(alg, 2, "down") == {**DEFAULTS, "optimizer": "adam", "lr": 0.01}  # an int key works too
    assert spec_for({**alg, "levels": None}, 1, "up")["lr"] == 1.0


@pytest.mark.parametrize(("alg", "level", "direction", "key"), [
    ({"up": {"optimizer": "sgd", "lr": 1.0}, "levels": {"1": {"up": {"lr": -1}}}}, 1, "up", "algorithm.levels.1.up.lr"),
    ({"down": {"optimizer": "replace"}, "levels": {"3": {"down": {"optimizer": "adamw"}}}}, 3, "down",
     "algorithm.levels.3.down.optimizer"),
    ({"up": {"optimizer": "sgd", "lr": 0}, "levels": {}}, 0, "up", "algorithm.up.lr"),
    ({"down": {"optimizer": "sgd", "speed": 2}, "levels": {}}, 2, "down", "algorithm.down.speed"),
])
def test_spec_for_names_the_key_in_errors(alg, level, direction, key):
    with pytest.raises(ConfigError) as caught:
        spec_for(alg, level, direction)
    assert caught.value.key == key


# ---------------------------------------------------------------- merge_down
def down_alg(**down) -> dict:
    return {"down": down, "residual_down_opt": {"optimizer": "sgd", "lr": 0.1}, "levels": {}}


def test_merge_down_replace_and_sgd_half():
    theta, state = merge_down(down_alg(optimizer="replace"), 2, v(2.0), {"model": v(6.0)}, None)
    close(theta, [6.0])
    assert set(state) == {"down.step"} and int(state["down.step"]) == 1
    # sgd lr 0.5: 2 + 0.5 * (6 - 2) = 4
    theta, state = merge_down(down_alg(optimizer="sgd", lr=0.5), 2, v(2.0), {"model": v(6.0)}, None)
    close(theta, [4.0])
    # a second merge counts on from the stored state: 4 + 0.5 * (6 - 4) = 5, step 2
    theta, state = merge_down(down_alg(optimizer="sgd", lr=0.5), 2, theta, {"model": v(6.0)}, state)
    close(theta, [5.0])
    assert int(state["down.step"]) == 2


def test_merge_down_without_a_kept_model_starts_from_the_parent():
    parent = v(6.0, -1.0)
    theta, state = merge_down(down_alg(optimizer="sgd", lr=0.5), 1, None, {"model": parent}, None)
    np.testing.assert_array_equal(theta[0], [6.0, -1.0])
    assert state == {}
    theta[0][0] = 99.0  # a copy: the node may change it without touching the parent's
    assert parent[0][0] == 6.0


def test_merge_down_applies_residual_ancestors_after_the_parent():
    received = {"model": v(6.0), "res_down0": v(16.0)}
    # parent first: 2 + 0.5 * (6 - 2) = 4; then the root's model by residual sgd 0.1: 4 + 0.1 * (16 - 4) = 5.2
    # (the other order would give 2 + 0.1 * 14 = 3.4, then 3.4 + 0.5 * 2.6 = 4.7)
    theta, state = merge_down(down_alg(optimizer="sgd", lr=0.5), 2, v(2.0), received, None)
    close(theta, [5.2])
    assert set(state) == {"down.step", "res_down0.step"}
    # no kept model: start at the parent's 6, then 6 + 0.1 * (16 - 6) = 7; only the residual edge has a state
    theta, state = merge_down(down_alg(optimizer="sgd", lr=0.5), 2, None, received, None)
    close(theta, [7.0])
    assert set(state) == {"res_down0.step"}


def test_merge_down_residuals_go_in_level_order_each_with_its_own_state():
    received = {"res_down1": v(26.0), "model": v(6.0), "res_down0": v(16.0)}
    # 4 (parent), then res_down0: 4 + 0.1 * 12 = 5.2, then res_down1: 5.2 + 0.1 * (26 - 5.2) = 7.28
    # (res_down1 first would give 4 + 2.2 = 6.2, then 6.2 + 0.98 = 7.18)
    theta, state = merge_down(down_alg(optimizer="sgd", lr=0.5), 3, v(2.0), received, None)
    close(theta, [7.28])
    assert set(state) == {"down.step", "res_down0.step", "res_down1.step"}
    # momentum on the residual edge keeps a moment per edge: m = delta on the first merge
    alg = {**down_alg(optimizer="replace"), "residual_down_opt": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.5}}
    theta, state = merge_down(alg, 3, v(2.0), {"model": v(6.0), "res_down0": v(16.0)}, None)
    close(theta, [7.0])  # replace -> 6; 6 + 0.1 * (16 - 6) = 7
    np.testing.assert_allclose(state["res_down0.m_0"], [10.0])


# ---------------------------------------------------------------- merge_up
def up_alg(weighted: bool, **up) -> dict:
    return {"up": {"optimizer": "sgd", **up}, "weighted": weighted, "levels": {},
            "residual_up_opt": {"optimizer": "sgd", "lr": 0.1}}


MODELS, WEIGHTS = [v(2.0), v(8.0)], [1, 3]


@pytest.mark.parametrize(("weighted", "lr", "current", "expected"), [
    (True, 1.0, 0.0, 6.5),  # (1*2 + 3*8) / 4 = 26 / 4 = 6.5
    (False, 1.0, 0.0, 5.0),  # (2 + 8) / 2 = 5
    (True, 0.5, 0.0, 3.25),  # 0 + 0.5 * 6.5
    (False, 0.5, 0.0, 2.5),  # 0 + 0.5 * 5
    (False, 0.5, 4.0, 4.5),  # 4 + 0.5 * (5 - 4)
])
def test_merge_up_mean_then_sgd(weighted, lr, current, expected):
    theta, state = merge_up(up_alg(weighted, lr=lr), 1, v(current), MODELS, WEIGHTS, [], None)
    close(theta, [expected])
    assert set(state) == {"up.step"} and int(state["up.step"]) == 1


def test_merge_up_applies_residual_updates_after_the_mean():
    # up: 6.5 (weighted mean, sgd lr 1); residuals' plain mean (10 + 20) / 2 = 15;
    # 6.5 + 0.1 * (15 - 6.5) = 7.35
    theta, state = merge_up(up_alg(True, lr=1.0), 1, v(0.0), MODELS, WEIGHTS, [v(10.0), v(20.0)], None)
    close(theta, [7.35])
    assert int(state["up.step"]) == 1 and int(state["res_up.step"]) == 1
    # a round without residuals keeps the residual edge's state as it was
    theta, state2 = merge_up(up_alg(True, lr=1.0), 1, theta, MODELS, WEIGHTS, [], state)
    close(theta, [6.5])
    assert int(state2["up.step"]) == 2 and int(state2["res_up.step"]) == 1
    # and the next one with residuals counts on from it: 6.5 + 0.1 * (10 - 6.5) = 6.85
    theta, state3 = merge_up(up_alg(True, lr=1.0), 1, theta, MODELS, WEIGHTS, [v(10.0)], state2)
    close(theta, [6.85])
    assert int(state3["res_up.step"]) == 2


def test_merge_up_reads_the_level_override():
    alg = {**up_alg(False, lr=1.0), "levels": {"2": {"up": {"lr": 0.5}}}}
    close(merge_up(alg, 2, v(0.0), MODELS, WEIGHTS, [], None)[0], [2.5])  # 0.5 * 5
    close(merge_up(alg, 1, v(0.0), MODELS, WEIGHTS, [], None)[0], [5.0])  # base lr 1


# ---------------------------------------------------------------- largest_updates
def test_largest_updates_by_norm_largest_first_ties_in_order():
    current = [np.zeros(2)]
    models = [[np.array([1.0, 0.0])], [np.array([3.0, 4.0])], [np.array([0.0, 2.0])], [np.array([5.0, 0.0])]]
    # norms 1, 5, 2, 5: model 1 and 3 tie at 5 (1 comes first), then 2, then 0
    assert largest_updates(current, models, 1) == [1]
    assert largest_updates(current, models, 2) == [1, 3]
    assert largest_updates(current, models, 3) == [1, 3, 2]
    assert largest_updates(current, models, 10) == [1, 3, 2, 0]
    assert largest_updates(current, models, 0) == []


def test_largest_updates_measures_all_tensors_from_the_current_model():
    current = [np.array([1.0]), np.array([1.0, 1.0])]
    models = [
        [np.array([4.0]), np.array([1.0, 1.0])],  # sqrt(3^2) = 3
        [np.array([1.0]), np.array([3.0, 3.0])],  # sqrt(2^2 + 2^2) = 2.83
        [np.array([3.0]), np.array([3.0, 3.0])],  # sqrt(4 + 4 + 4) = 3.46
    ]
    assert largest_updates(current, models, 3) == [2, 0, 1]


# ---------------------------------------------------------------- check_config
@pytest.fixture(scope="module")
def bhfl_alg() -> dict:
    return compose_cfg("algorithm=bhfl")["algorithm"]


def test_check_config_accepts_the_defaults(bhfl_alg):
    check_config(bhfl_alg)
    check_config({**bhfl_alg, "levels": {"0": {"up": {"optimizer": "adam", "lr": 0.01}}}, "residual_up_k": 2,
                  "proxy_samples": [10, 0, 0]})


@pytest.mark.parametrize(("change", "key"), [
    ({"levels": {"x": {"up": {"lr": 0.5}}}}, "algorithm.levels"),
    ({"levels": {"1": {"up": {"lr": 0.5}, "side": {"lr": 0.5}}}}, "algorithm.levels.1"),
    ({"levels": {"1": {"down": {"lr": -0.5}}}}, "algorithm.levels.1.down.lr"),
    ({"levels": [1, 2]}, "algorithm.levels"),
    ({"residual_up_k": -1}, "algorithm.residual_up_k"),
    ({"residual_up_k": 1.5}, "algorithm.residual_up_k"),
    ({"residual_down": "yes"}, "algorithm.residual_down"),
    ({"proxy_samples": [-1]}, "algorithm.proxy_samples[0]"),
    ({"proxy_samples": []}, "algorithm.proxy_samples"),
    ({"proxy_samples": [10], "proxy_steps": 0}, "algorithm.proxy_steps"),
    ({"proxy_samples": [10], "proxy_lr": 0.0}, "algorithm.proxy_lr"),
    ({"residual_up_opt": {"optimizer": "sgd", "lr": -1}}, "algorithm.residual_up_opt.lr"),
    ({"residual_down_opt": {"optimizer": "rmsprop"}}, "algorithm.residual_down_opt.optimizer"),
])
def test_check_config_names_the_bad_key(bhfl_alg, change, key):
    with pytest.raises(ConfigError) as caught:
        check_config({**bhfl_alg, **change})
    assert caught.value.key == key


# ---------------------------------------------------------------- end to end (depth 3)
BASE = [*SMALL, "runtime=inprocess", "global_rounds=2", "algorithm.local_steps=3", "dataset.max_samples=200",
        "algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]"]
OPT = ["algorithm.up.optimizer=adam", "algorithm.up.lr=0.01", "algorithm.down.optimizer=sgd", "algorithm.down.lr=0.5"]


def global_model(run_dir: Path) -> list[np.ndarray]:
    with np.load(run_dir / "checkpoints" / "global_model.npz") as data:
        return [data[f"arr_{i}"] for i in range(len(data.files) - 1)]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done: dict[tuple, Path] = {}

    def get(*overrides: str) -> Path:
        if overrides not in done:
            run_dir = tmp_path_factory.mktemp("bhfl")
            run(compose_cfg(*BASE, *overrides), run_dir)
            done[overrides] = run_dir
        return done[overrides]

    return get


def test_residual_edges_change_the_model_and_keep_a_state_per_edge(runs):
    off = runs(*OPT)
    on = runs(*OPT, "algorithm.residual_down=true", "algorithm.residual_up_k=1")
    assert max_diff(global_model(on), global_model(off)) > 1e-5
    store = StateStore(on / "state")
    # a level-2 node got the root's model as a residual (beside its parent's)
    level2 = store.load("node-0.0")
    assert int(level2["res_down0.step"]) == 2  # one merge per call, one call per global round
    assert not any(k.startswith("res_up") for k in level2)  # devices forward no residual updates
    # a device got the root's and the level-1 node's models as residuals
    device = stored_device_states(store)[0]
    assert {"extra_res_down0.step", "extra_res_down1.step", "extra_down.step"} <= set(device)
    # the largest child update went straight to the grandparent: level 1 and the root merged residuals
    level1, root = store.load("node-0"), store.load("node-root")
    assert "res_up.step" in level1 and int(root["res_up.step"]) == 2
    assert not any(k.startswith("res_down") for k in level1)  # the root has no ancestors to forward
    # with the edges off, none of this state exists
    plain = StateStore(off / "state")
    for key in ("node-root", "node-0", "node-0.0"):
        assert not any(k.startswith(("res_", "extra_res_")) for k in plain.load(key)), key
    assert not any(k.startswith("extra_res_") for k in stored_device_states(plain)[0])


def test_proxy_training_runs_scores_the_root_and_changes_the_model(runs):
    without = runs("dataset.proxy_fraction=0.2")  # the same data split, no proxy training
    with_proxy = runs("dataset.proxy_fraction=0.2", "algorithm.proxy_samples=[40,20,0]")
    lines = [json.loads(line) for line in (with_proxy / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert 0 <= line["gm_proxy_accuracy"] <= 1 and line["gm_proxy_loss"] > 0
    plain = [json.loads(line) for line in (without / "metrics.jsonl").read_text().splitlines()]
    assert all("gm_proxy_accuracy" not in line for line in plain)
    assert max_diff(global_model(with_proxy), global_model(without)) > 1e-5
    # the servers with proxy data keep their proxy sampler; the lowest level (0 samples) has none
    store = StateStore(with_proxy / "state")
    assert any(k.startswith("proxy_sampler.") for k in store.load("node-root"))
    assert any(k.startswith("proxy_sampler.") for k in store.load("node-0"))
    assert not any(k.startswith("proxy_sampler.") for k in store.load("node-0.0"))


def test_proxy_samples_without_a_proxy_pool_fails_naming_proxy_fraction(tmp_path):
    # Today: a plain ValueError from hfl.data.proxy_data when the root strategy is built,
    # i.e. after the run has started (ConfigError would also pass: it is a ValueError).
    with pytest.raises(ValueError, match="proxy_fraction"):
        run(compose_cfg(*BASE, "algorithm.proxy_samples=[40,20,0]"), tmp_path)


@pytest.mark.parametrize("overrides", [
    ("algorithm.proxy_samples=[40,20,0]",),  # no pool at all: ValueError at the root
    ("algorithm.proxy_samples=[0,20,0]",),  # no pool, root without proxy: RuntimeError after level-1 failures
    ("dataset.proxy_fraction=0.2", "algorithm.proxy_samples=[4000,20,0]"),  # bigger than the pool
], ids=["no-pool", "no-pool-below-root", "too-big"])
def test_bad_proxy_samples_are_config_errors_before_training(tmp_path, overrides):
    with pytest.raises(ConfigError) as caught:
        run(compose_cfg(*BASE, *overrides), tmp_path)
    assert caught.value.key in ("algorithm.proxy_samples", "dataset.proxy_fraction")
    assert not (tmp_path / "metrics.jsonl").exists()
