"""End to end: Flower's Simulation Runtime (Ray) against a direct computation of PerMFL."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clients.permfl import device_step
from hfl.rules.aggregate import mean_of
from hfl.models import build_model
from hfl.runtime.build import build_level1_node, federation_for, initial_model
from hfl.seed import derive_seed
from hfl.runtime.simulate import run
from hfl.device.state import stored_device_states
from hfl.state.store import StateStore
from hfl.device.training import (
    BatchSampler,
    LocalTrainer,
    run_local_steps,
    to_ndarrays,
    to_tensors,
)
from strategies.permfl import global_update, team_update


def direct_permfl(cfg: dict) -> tuple[list[np.ndarray], dict[int, list[np.ndarray]]]:
    """PerMFL's three loops written out plainly, with no Flower in between."""
    fed = federation_for(cfg)
    alg = cfg["algorithm"]
    trainer = LocalTrainer(build_model(cfg["model"], fed.input_shape, fed.num_classes))
    samplers = {
        d.device_id: BatchSampler(len(d.y_train), cfg["dataset"]["batch_size"], derive_seed(cfg["seed"], "batches", d.device_id))
        for d in fed.devices
    }
    x = initial_model(cfg, fed)
    personal: dict[int, list[np.ndarray]] = {}
    for _ in range(cfg["global_rounds"]):
        team_models = []
        for team in fed.level1_devices:
            w = x
            for _ in range(alg["team_rounds"]):
                thetas = []
                for device_id in team:
                    dev = fed.devices[device_id]
                    anchor = to_tensors(w)
                    theta, _ = run_local_steps(
                        trainer, anchor, dev.x_train, dev.y_train, samplers[device_id], alg["local_steps"],
                        lambda th, g, a=anchor: device_step(th, g, a, alg["alpha"], alg["lam"]),
                    )
                    personal[device_id] = to_ndarrays(theta)
                    thetas.append(personal[device_id])
                w = team_update(w, x, mean_of(thetas), alg["eta"], alg["lam"], alg["gamma"])
            team_models.append(w)
        x = global_update(x, mean_of(team_models), alg["beta"], alg["gamma"])
    return x, personal


def checkpoint(run_dir) -> list[np.ndarray]:
    with np.load(run_dir / "checkpoints" / "global_model.npz") as data:
        return [data[f"arr_{i}"] for i in range(len(data.files) - 1)]


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    from tests.conftest import SMALL, compose_cfg

    cfg = compose_cfg(*SMALL, "runtime=simulation")
    run_dir = tmp_path_factory.mktemp("ray_run")
    summary = run(cfg, run_dir)
    return cfg, run_dir, summary


def test_ray_simulation_learns(ray_run):
    cfg, run_dir, summary = ray_run
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2, 3]
    assert summary["rounds"] == 3 and summary["algorithm"] == "permfl"
    chance = 1 / 10
    assert summary["final"]["pm_accuracy"] > 3 * chance
    assert summary["best"]["pm_accuracy"] >= summary["final"]["pm_accuracy"]
    assert lines[-1]["gm_loss"] < lines[0]["gm_loss"]  # the global model improves
    for line in lines:
        assert line["bytes_down_global"] > 0 and line["bytes_up_team"] > 0
        assert line["pm_accuracy_min"] <= line["pm_accuracy_median"] <= line["pm_accuracy_max"]
        assert line["seconds"] > 0


def test_ray_simulation_equals_direct_computation(ray_run):
    cfg, run_dir, _ = ray_run
    x_direct, personal_direct = direct_permfl(cfg)
    for got, want in zip(checkpoint(run_dir), x_direct):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Personalized models persisted on the team nodes across global rounds: the direct loop
    # keeps each device's sampler running, so a reset between rounds would not match.
    states = stored_device_states(StateStore(run_dir / "state"))
    for device_id, want in personal_direct.items():
        state = states[device_id]
        for i, arr in enumerate(want):
            np.testing.assert_allclose(state[f"personal_{i}"], arr, rtol=1e-5, atol=1e-6)


def test_inprocess_runtime_matches_ray(ray_run, tmp_path):
    from tests.conftest import SMALL, compose_cfg

    cfg, run_dir, summary = ray_run
    inproc = run(compose_cfg(*SMALL, "runtime=inprocess", "runtime.torch_threads=1"), tmp_path)
    for a, b in zip(checkpoint(run_dir), checkpoint(tmp_path)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert inproc["final"] == pytest.approx(summary["final"])


def test_device_state_survives_a_fresh_node(small_cfg, tmp_path):
    """Flower builds a new client per message; the device's theta and minibatch position
    must come back from the node store, and PM must test that theta."""
    cfg = small_cfg()
    fed = federation_for(cfg)
    x = initial_model(cfg, fed)
    node = build_level1_node(cfg, 0, tmp_path)
    node.fit(x, {})
    fresh = build_level1_node(cfg, 0, tmp_path)
    first = fresh.children.all()["%06d" % fed.level1_devices[0][0]].client.numpy_client.device  # type: ignore[attr-defined]
    assert first.personal is not None and first.sampler.pos > 0
    direct_loss, direct_correct, n = first.trainer.evaluate(first.personal, first.x_test, first.y_test)
    _, _, metrics = fresh.evaluate(x, {})
    per_device = {d: (c, k) for d, c, k in json.loads(metrics["pm_devices"])}
    assert per_device[first.device_id] == (direct_correct, n)
    assert metrics["level1_n"] == metrics["gm_n"] == sum(len(fed.devices[d].y_test) for d in fed.level1_devices[0])


def test_fedavg_and_hierfavg_run_on_the_tree(small_cfg, tmp_path):
    for name in ("fedavg", "hierfavg"):
        summary = run(small_cfg(f"algorithm={name}", "runtime=inprocess", "algorithm.alpha=0.05"), tmp_path / name)
        assert summary["final"]["pm_accuracy"] is None  # no personalized model
        assert summary["final"]["gm_accuracy"] > 0.1


def _kill_device(node, device_id: int) -> None:
    proxy = node.children.all()["%06d" % device_id]
    numpy_client = proxy.client.numpy_client  # type: ignore[attr-defined]

    def dead(parameters, config):
        raise ConnectionError(f"device {device_id} is gone")

    numpy_client.fit = dead
    numpy_client.fit_plan = dead  # the batched path (hfl.accel.batched) asks for a plan instead


def test_dead_device_is_counted_and_the_team_round_goes_on(small_cfg, tmp_path):
    cfg = small_cfg("algorithm.min_fit_fraction=0.5")
    fed = federation_for(cfg)
    x = initial_model(cfg, fed)
    node = build_level1_node(cfg, 0, tmp_path)
    _kill_device(node, fed.level1_devices[0][0])
    model, _, metrics = node.fit(x, {})
    assert metrics["device_failures"] == cfg["algorithm"]["team_rounds"]  # once per team round
    assert all(np.all(np.isfinite(a)) for a in model)
    assert any(not np.array_equal(a, b) for a, b in zip(model, x))  # the others still trained


def test_team_round_without_enough_devices_fails_instead_of_returning_a_stale_model(small_cfg, tmp_path):
    cfg = small_cfg("algorithm.min_fit_fraction=1.0")
    fed = federation_for(cfg)
    node = build_level1_node(cfg, 0, tmp_path)
    _kill_device(node, fed.level1_devices[0][1])
    with pytest.raises(RuntimeError, match="no model aggregated from 2 results .0 rejected") as raised:
        node.fit(initial_model(cfg, fed), {})
    # the cause, not only a count: what the run's summary line shows when every device fails
    assert f"first failure: ConnectionError('device {fed.level1_devices[0][1]} is gone')" in str(raised.value)


def test_diverging_devices_are_rejected_and_the_run_stops_loudly(small_cfg, tmp_path):
    """NaN updates are never averaged into a model: every team rejects them, so the global
    server has nothing to aggregate and the run fails instead of reporting the old model."""
    cfg = small_cfg("algorithm.alpha=1e30", "runtime=inprocess")
    with pytest.raises(RuntimeError, match=r"^root: round 1: no model aggregated from 0 results .* 2 failures"):
        run(cfg, tmp_path)
    fed = federation_for(cfg)
    with pytest.raises(RuntimeError, match=r"rejected as NaN"):
        build_level1_node(cfg, 0, tmp_path / "t").fit(initial_model(cfg, fed), {})
