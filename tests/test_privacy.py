"""Differential privacy at a chosen level of the tree (hfl.node.privacy, hfl.rules.privacy,
hfl.device.privacy): clipping and noise against hand-computed values, the accountant against
Opacus' own computation, DP that does nothing equals the plain run bit for bit, central DP at the
lowest servers and at the root in process and on Ray, resumption, the budget, refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hfl.algorithm import NodeContext, RunSettings, Update
from hfl.config.checks import validate
from hfl.device.client import privatize_reply
from hfl.device.privacy import LOCAL_CLIP, LOCAL_NOISE, LOCAL_SEED, clip_model, privatize_local
from hfl.errors import ConfigError
from hfl.node.privacy import CLIP_KEY, NodePrivacy, PrivacySettings, plan
from hfl.rules import privacy as dp
from hfl.rules.payload import Payload
from hfl.runtime.simulate import run
from hfl.seed import derive_seed
from tests.conftest import SMALL, compose_cfg
from tests.test_resume import assert_resumed_equals_whole, global_model, rows

REF = [np.zeros((2,), dtype=np.float32), np.zeros((1,), dtype=np.float32)]


def arrays(*values: list[float]) -> list[np.ndarray]:
    return [np.asarray(v, dtype=np.float32) for v in values]


# ---------------------------------------------------------------- clipping and noise by hand
def test_an_update_over_the_norm_is_scaled_to_it_and_one_within_is_left_as_it_is():
    model = arrays([3.0, 0.0], [4.0])  # update norm 5
    clipped, was = clip_model(model, REF, 1.0)
    assert was
    np.testing.assert_allclose(np.concatenate(clipped), [0.6, 0.0, 0.8], rtol=1e-6)
    same, was = clip_model(model, REF, 5.0)
    assert not was and same is model  # no arithmetic at all: the same arrays, the same bits
    assert clip_model(model, REF, None)[0] is model


def test_central_noise_is_sigma_c_max_w_over_sum_w_and_the_same_draw_is_added_to_every_model():
    models = [arrays([3.0, 0.0], [4.0]), arrays([0.0, 0.3], [0.4])]  # norms 5 and 0.5
    outcome = dp.privatize_central(models, [1.0, 3.0], REF, 1.0, 2.0, np.random.default_rng(7))
    assert outcome.std == pytest.approx(2.0 * 1.0 * 3.0 / 4.0)
    assert outcome.clipped == 1
    g = np.random.default_rng(7)
    z = [g.normal(0.0, 1.5, (2,)).astype(np.float32), g.normal(0.0, 1.5, (1,)).astype(np.float32)]
    want = [[np.float32([0.6, 0.0]) + z[0], np.float32([0.8]) + z[1]], [np.float32([0.0, 0.3]) + z[0],
                                                                       np.float32([0.4]) + z[1]]]
    for got, expected in zip(outcome.models, want, strict=True):
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # Equal weights: Flower's sigma C / n.
    try:
        from flwr.supercore.differential_privacy import compute_stdv
    except ImportError:  # Flower 1.41
        from flwr.common.differential_privacy import compute_stdv
    assert dp.noise_std(1.3, 0.7, [5, 5, 5]) == pytest.approx(compute_stdv(1.3, 0.7, 3))


def test_the_adaptive_clip_follows_the_noised_unclipped_share():
    assert dp.next_clip(1.0, 3, 4, 0.5, 0.2, 0.0, np.random.default_rng(0)) == pytest.approx(math.exp(-0.2 * 0.25))
    g = np.random.default_rng(3)
    noise = np.random.default_rng(3).normal(0.0, 0.5)
    assert dp.next_clip(2.0, 1, 4, 0.5, 0.2, 0.5, g) == pytest.approx(2.0 * math.exp(-0.2 * ((1 + noise) / 4 - 0.5)))
    # Andrew et al.'s split of the noise between the count and the model: z^-2 = z_model^-2 + (2 sigma_b)^-2.
    count_std, z_model = dp.adaptive_noise(1.0, 40, None)
    assert count_std == 2.0 and z_model ** -2 + (2 * count_std) ** -2 == pytest.approx(1.0)


def node_privacy(path: str, depth: int, seed: int = 5, state=None, **section) -> NodePrivacy | None:  # noqa: ANN001
    privacy = {"level": "lowest", "clip": 1.0, "adaptive": False, "target_quantile": 0.5, "clip_lr": 0.2,
               "count_stddev": None, "noise_multiplier": 1.0, "delta": 1e-5, "target_epsilon": None, **section}
    ctx = NodeContext(params=None, run=RunSettings(seed, 3, {}, 32, privacy), path=path, depth=depth,
                      payload=Payload("model", {"model": REF}), state=state, fed=None, round_path="2")
    return NodePrivacy.of(ctx)


def test_a_node_noises_with_the_seed_of_its_path_and_round_and_only_at_its_level():
    assert node_privacy("0", 2) is not None and node_privacy("", 2) is None  # lowest = level 1 of a 3-tier tree
    assert node_privacy("", 2, level="root") is not None and node_privacy("0", 2, level="root") is None
    updates = [Update(arrays([3.0, 0.0], [4.0]), 10, {}, {}), Update(arrays([0.0, 0.3], [0.4]), 10, {}, {})]
    out, stats = node_privacy("0", 2).privatize(updates, REF, "2.1")
    want = dp.privatize_central([u.model for u in updates], [10, 10], REF, 1.0, 1.0,
                                np.random.default_rng(derive_seed(5, "privacy", "0", "2.1")))
    for got, expected in zip(out, want.models, strict=True):
        for a, b in zip(got.model, expected, strict=True):
            np.testing.assert_array_equal(a, b)
    assert stats == {"dp_clipped": 1, "dp_clip": 1.0}
    other, _ = node_privacy("1", 2).privatize(updates, REF, "2.1")  # another node draws other noise
    assert not np.array_equal(other[1].model[0], out[1].model[0])


def test_adaptive_clipping_keeps_its_clip_in_the_nodes_state():
    node = node_privacy("0", 2, adaptive=True, noise_multiplier=0.0)
    updates = [Update(arrays([3.0, 0.0], [4.0]), 1, {}, {})] * 3 + [Update(arrays([0.3, 0.0], [0.4]), 1, {}, {})]
    node.privatize(updates, REF, "2.1")
    assert node.state()[CLIP_KEY] == pytest.approx(math.exp(-0.2 * (0.25 - 0.5)))  # one of four unclipped
    again = node_privacy("0", 2, adaptive=True, noise_multiplier=0.0, state=node.state())
    assert again.clip == pytest.approx(math.exp(0.05))


def test_a_device_clips_and_noises_its_own_reply_with_local_dp():
    sent = arrays([1.0, 1.0], [1.0])
    trained = arrays([4.0, 1.0], [5.0])  # update (3, 0, 4): norm 5
    config = {LOCAL_CLIP: 1.0, LOCAL_NOISE: 0.5, LOCAL_SEED: 9, "round_path": "3.2"}
    got, n, metrics = privatize_reply((trained, 12, {"device_id": 4}), sent, config, 4)
    g = np.random.default_rng(derive_seed(9, "privacy-local", 4, "3.2"))
    want = [np.float32([1.6, 1.0]) + g.normal(0, 0.5, (2,)).astype(np.float32),
            np.float32([1.8]) + g.normal(0, 0.5, (1,)).astype(np.float32)]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert n == 12 and metrics["dp_local"] == 1
    assert privatize_reply((got, n, metrics), sent, config, 4)[0] is got  # privatized once, not twice
    assert privatize_reply((trained, 12, {}), sent, {}, 4)[0] is trained  # no local DP: untouched
    assert privatize_local(trained, sent, 10.0, 0.0, np.random.default_rng(0)) is trained


# ---------------------------------------------------------------- the accountant
@pytest.mark.parametrize(("q", "sigma", "steps"), [(1.0, 1.1, 10), (0.5, 1.5, 40), (0.1, 0.8, 300)])
def test_epsilon_is_opacus_rdp_reference_computation(q, sigma, steps):
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
    from opacus.accountants.rdp import RDPAccountant

    orders = RDPAccountant.DEFAULT_ALPHAS
    want, _ = get_privacy_spent(orders=orders, rdp=compute_rdp(q=q, noise_multiplier=sigma, steps=steps,
                                                               orders=orders), delta=1e-5)
    assert dp.epsilon(sigma, q, steps, 1e-5) == pytest.approx(want, rel=1e-12)
    assert dp.epsilon(sigma, q, 0, 1e-5) == 0.0 and dp.epsilon(0.0, q, steps, 1e-5) == math.inf


def test_the_noise_for_a_target_epsilon_spends_at_most_it():
    sigma = dp.noise_for_epsilon(4.0, 0.5, 20, 1e-5)
    assert 3.9 <= dp.epsilon(sigma, 0.5, 20, 1e-5) <= 4.0


def test_the_dp_levels_rounds_and_sampling_rate():
    cfg = compose_cfg(*SMALL, "algorithm.sample_fraction=[1,0.5]")
    from hfl.config.typed import algorithm_params
    params = algorithm_params(cfg["algorithm"])

    def settings(level):  # noqa: ANN001, ANN202
        return PrivacySettings.of({**cfg["privacy"], "level": level, "clip": 1.0, "noise_multiplier": 1.0})

    lowest, root, local = (plan(settings(x), params, 2) for x in ("lowest", "root", "local"))
    assert (lowest.sample_rate, lowest.steps_per_round) == (0.5, 2)  # team_rounds = 2 rounds a global round
    assert (root.sample_rate, root.steps_per_round) == (1.0, 1)
    assert (local.sample_rate, local.steps_per_round) == (1.0, 2)
    assert lowest.epsilon(3) == dp.epsilon(1.0, 0.5, 6, 1e-5)
    # sampling=devices: the root's draw holds for every team round of a global round, so a device's K = 2
    # releases in it are one sampled event of noise sigma / sqrt(K)
    drawn = algorithm_params({**cfg["algorithm"], "sampling": "devices", "sample_fraction": 0.25})
    per_draw = plan(settings("lowest"), drawn, 2)
    assert (per_draw.sample_rate, per_draw.steps_per_round) == (0.25, 1)
    assert per_draw.epsilon(3) == pytest.approx(dp.epsilon(1.0 / math.sqrt(2), 0.25, 3, 1e-5))
    assert per_draw.epsilon(3) > dp.epsilon(1.0, 0.25, 6, 1e-5)  # more than K independent draws would spend


# ---------------------------------------------------------------- end to end
def metrics(run_dir: Path) -> list[dict]:
    return rows(run_dir)


def assert_same_models(a: Path, b: Path) -> None:
    for x, y in zip(global_model(a), global_model(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("level", ["lowest", "root", "local"])
def test_dp_that_clips_nothing_and_adds_no_noise_is_the_plain_run_bit_for_bit(tmp_path, level):
    plain = tmp_path / "plain"
    run(compose_cfg(*SMALL, "runtime=inprocess"), plain)
    clip = "privacy.clip=1e9" if level == "local" else "privacy.clip=null"
    run(compose_cfg(*SMALL, "runtime=inprocess", f"privacy.level={level}", clip), tmp_path / "dp")
    assert_same_models(tmp_path / "dp", plain)
    got = metrics(tmp_path / "dp")
    assert [line.pop("dp_epsilon") for line in got] == [math.inf] * 3  # no noise: no privacy, said so
    assert got == metrics(plain)


DP_RUN = [*SMALL, "privacy.clip=0.5", "privacy.noise_multiplier=0.8"]


@pytest.mark.parametrize("level", ["lowest", "root", "local"])
def test_dp_on_ray_equals_in_process_and_changes_the_model(tmp_path, level):
    adaptive = ["privacy.adaptive=true", "privacy.count_stddev=1.0"] if level != "local" else []
    common = [*DP_RUN, f"privacy.level={level}", *adaptive]
    run(compose_cfg(*common, "runtime=inprocess"), tmp_path / "inprocess")
    run(compose_cfg(*common, "runtime=simulation"), tmp_path / "ray")
    assert_same_models(tmp_path / "ray", tmp_path / "inprocess")
    assert metrics(tmp_path / "ray") == metrics(tmp_path / "inprocess")
    run(compose_cfg(*SMALL, "runtime=inprocess"), tmp_path / "plain")
    assert not np.array_equal(global_model(tmp_path / "inprocess")[0], global_model(tmp_path / "plain")[0])
    epsilons = [line["dp_epsilon"] for line in metrics(tmp_path / "inprocess")]
    steps = 1 if level == "root" else 2  # team_rounds rounds a global round at the lowest servers and devices
    assert epsilons == [pytest.approx(dp.epsilon(0.8, 1.0, r * steps, 1e-5)) for r in (1, 2, 3)]
    if level == "lowest":  # how many device updates the lowest servers clipped, per round (12 at most)
        clipped = [line.get("dp_clipped_level2", 0) for line in metrics(tmp_path / "inprocess")]
        assert all(0 <= c <= 3 * 2 * 2 for c in clipped) and sum(clipped) > 0, clipped


def test_the_roots_clipped_updates_are_counted_under_level1() -> None:
    from hfl.node.inprocess import RoundsReport
    from hfl.node.round_counters import RoundCounters

    counts = RoundCounters()  # the root's rounds' stats, as its strategy returned them
    counts.fit(RoundsReport(metrics=[{"dp_clipped": 2, "aggregated": 2}, {"aggregated": 2}]), [], timed=False)
    assert counts.values["dp_clipped_level1"] == 2


def test_a_resumed_run_with_adaptive_clipping_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    cfg = compose_cfg(*DP_RUN, "global_rounds=5", "eval_every=2", "privacy.level=lowest", "privacy.adaptive=true",
                      "privacy.count_stddev=1.0", "runtime=inprocess")
    assert_resumed_equals_whole(cfg, tmp_path, monkeypatch, "fit", 3)
    clips = {key for key in (tmp_path / "whole" / "state").glob("node-0*.npz")}
    assert clips  # the lowest servers' stored C went through the resumption (compared above, key by key)


def test_the_budget_stops_the_run_after_the_last_round_within_it(tmp_path):
    budget = (dp.epsilon(0.8, 1.0, 4, 1e-5) + dp.epsilon(0.8, 1.0, 6, 1e-5)) / 2  # within 2 rounds, not 3
    run_dir = tmp_path / "run"
    run(compose_cfg(*DP_RUN, "runtime=inprocess", "privacy.level=lowest", f"privacy.target_epsilon={budget}",
                    "eval_every=5"), run_dir)
    lines = metrics(run_dir)
    assert [line["round"] for line in lines] == [2]  # the last round within the budget is evaluated
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2 and "privacy.target_epsilon" in summary["stopped"]
    report = (run_dir / "report.md").read_text()
    assert "differential privacy: central at level lowest" in report and "ε = " in report


# ---------------------------------------------------------------- refusals, one line naming the key
@pytest.mark.parametrize(("overrides", "key"), [
    (["privacy.level=lowest", "privacy.noise_multiplier=1.0"], "privacy.clip"),
    (["privacy.level=local"], "privacy.clip"),
    (["privacy.level=local", "privacy.clip=1.0", "privacy.adaptive=true"], "privacy.adaptive"),
    (["privacy.level=sideways"], "privacy.level"),
    (["privacy.level=lowest", "privacy.clip=1.0", "privacy.delta=0"], "privacy.delta"),
    (["privacy.level=lowest", "privacy.clip=1.0", "privacy.target_epsilon=4"], "privacy.target_epsilon"),
    (["privacy.level=lowest", "privacy.clip=1.0", "clock.enabled=true"], "clock.enabled"),
    (["privacy.level=root", "privacy.clip=1.0", "algorithm=fedavg", "algorithm.candidates=0.5"],
     "algorithm.candidates"),
    (["privacy.level=lowest", "privacy.clip=1.0", "algorithm=pflego"], "privacy.level"),
    (["privacy.level=lowest", "privacy.clip=1.0", "algorithm=femam"], "privacy.level"),
    (["privacy.level=lowest", "privacy.clip=1.0", "algorithm=ifca"], "privacy.level"),
    (["privacy.level=lowest", "privacy.clip=1.0", "algorithm=bhfl", "algorithm.residual_up_k=1"],
     "algorithm.residual_up_k"),
], ids=["noise-without-clip", "local-without-clip", "local-adaptive", "level", "delta", "budget-without-noise",
        "clock", "power-of-choice", "pflego", "femam", "ifca", "bhfl-residual"])
def test_refusals_name_the_key_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides))
    assert err.value.key == key and "\n" not in str(err.value)


def test_a_level_below_the_lowest_servers_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        run(compose_cfg(*SMALL, "runtime=inprocess", "privacy.level=3", "privacy.clip=1.0"), tmp_path / "run")
    assert err.value.key == "privacy.level" and "\n" not in str(err.value)


@pytest.mark.parametrize("override", ["privacy.clipp=1.0", "++privacy.clipp=1.0"])
def test_a_key_nothing_reads_is_refused(override):
    from hydra import compose, initialize_config_dir

    from hfl.config import schema
    from tests.conftest import CONF_DIR

    schema.register()
    with pytest.raises(ConfigError) as err:
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                schema.check_keys(compose("config", overrides=[override]))
        except ConfigError:
            raise
        except Exception as exc:  # Hydra's error for an override of a key the schema lacks
            raise schema.config_error(exc) or exc
    assert err.value.key == "privacy.clipp"


def test_local_dp_noises_every_device_alike_on_the_batched_and_the_per_device_path(tmp_path):
    common = [*SMALL, "runtime=inprocess", "privacy.level=local", "privacy.clip=0.5", "privacy.noise_multiplier=0.3"]
    run(compose_cfg(*common, "runtime.batched=on"), tmp_path / "batched")
    run(compose_cfg(*common, "runtime.batched=off"), tmp_path / "one-by-one")
    run(compose_cfg(*SMALL, "runtime=inprocess"), tmp_path / "plain")
    for a, b in zip(global_model(tmp_path / "batched"), global_model(tmp_path / "one-by-one"), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # the batched path's float tolerance
    assert not np.allclose(global_model(tmp_path / "batched")[0], global_model(tmp_path / "plain")[0], atol=1e-3)
    epsilons = [line["dp_epsilon"] for line in metrics(tmp_path / "batched")]
    assert epsilons == [pytest.approx(dp.epsilon(0.3, 1.0, 2 * r, 1e-5)) for r in (1, 2, 3)]  # q = 1, K rounds


def test_the_console_round_line_shows_the_epsilon_spent():
    from hfl.output.console import round_line

    assert "ε 3.99" in round_line({"round": 2, "pm_accuracy": 0.5, "dp_epsilon": 3.9912, "seconds": 1.0}, 3)
    assert "ε" not in round_line({"round": 2, "pm_accuracy": 0.5, "seconds": 1.0}, 3)
