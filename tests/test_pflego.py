"""PFLEGO: the rules against autograd and the paper's eq. 4 by hand, the root's step on a tree
equal to the flat one, device sampling across the tree, local labels, the paper's evaluation
figure, and the config's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hfl.node.round_counters import RoundCounters
import pytest
import torch
import torch.nn.functional as F
from flwr.server.client_manager import SimpleClientManager
from flwr.common import GetPropertiesIns, GetPropertiesRes, ndarrays_to_parameters
from torch.func import functional_call

from hfl.rules.aggregate import mean_of, nbytes
from hfl.node.cohort import Cohort
from hfl.device.state import stored_device_states
from hfl.errors import ConfigError
from hfl.models import MLP
from hfl.data.labels import device_data, model_classes
from hfl.runtime.build import federation_for, initial_model
from hfl.rules.payload import Payload
from hfl.rules.fit_testing import fit_test_metrics
from hfl.node.root import RootStrategy
from hfl.tree.sampling import DeviceDraw, sample_devices
from hfl.runtime.simulate import run
from hfl.state.store import StateStore
from strategies import pflego
from tests.conftest import compose_cfg, rule_context

# 12 devices of synthetic data dealt round-robin, 2 classes each; tiny MLP body.
BASE = ["algorithm=pflego", "model=mlp", "model.hidden=8", "runtime=inprocess", "runtime.torch_threads=1",
        "dataset.partition=roundrobin", "dataset.classes_per_device=2", "dataset.max_samples=120",
        "dataset.batch_size=100000", "topology=tree", "global_rounds=3", "algorithm.local_steps=5",
        "algorithm.sample_fraction=0.25", "algorithm.server_lr=0.05"]


def cfg_of(*overrides: str) -> dict:
    return compose_cfg(*BASE, *overrides)


def final_body(run_dir: Path) -> list[np.ndarray]:
    with np.load(run_dir / "checkpoints" / "global_model.npz") as data:
        return [data[f"arr_{i}"] for i in range(sum(n.startswith("arr_") for n in data.files))]


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- rules
def test_head_gradient_is_autograds():
    g = torch.Generator().manual_seed(0)
    feats1 = pflego.with_bias(torch.randn(7, 4, generator=g))
    head = torch.rand(3, 5, generator=g).requires_grad_(True)
    y = torch.tensor([0, 2, 1, 1, 0, 2, 2])
    loss, grad = pflego.head_loss_and_grad(head.detach(), feats1, y)
    expected = F.cross_entropy(feats1 @ head.t(), y)
    (auto,) = torch.autograd.grad(expected, head)
    assert loss == pytest.approx(float(expected.detach()), rel=1e-6)
    torch.testing.assert_close(grad, auto, rtol=1e-5, atol=1e-7)
    assert feats1[:, -1].eq(1).all()  # the bias column


def test_device_round_is_autograd_on_the_whole_model():
    """tau-1 head steps then the joint gradient, against plain autograd through [body, head]."""
    torch.manual_seed(0)
    model = MLP((6,), 3, hidden=4)
    names = [n for n, _ in model.named_parameters()]
    theta = [p.detach().clone() for n, p in model.named_parameters() if n.startswith("body.")]
    x, y = torch.randn(9, 6), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 1])
    head0 = pflego.initial_head(3, 4, seed=1)
    tau, beta, head_lr = 4, 0.3, 0.7
    calls = []
    model.body.register_forward_hook(lambda *_: calls.append(1))

    body_names = [n.removeprefix("body.") for n in names if n.startswith("body.")]

    def body(params, inputs):  # noqa: ANN001, ANN202
        return functional_call(model.body, dict(zip(body_names, params, strict=True)), (inputs,))

    g_theta, g_head, head_new, _ = pflego.device_round(body, theta, head0, x, y, tau, beta, head_lr)
    assert len(calls) == 1  # one forward pass whatever tau is

    # By hand: tau-1 autograd head steps on fixed features, then autograd of the full model.
    head = head0.clone()
    for _ in range(tau - 1):
        w = head.clone().requires_grad_(True)
        full = dict(zip(names, [*theta, *pflego.split_head(w)], strict=True))
        (gw,) = torch.autograd.grad(F.nll_loss(functional_call(model, full, (x,)), y), w)
        head = head - beta * gw
    leaves = [t.clone().requires_grad_(True) for t in theta]
    w = head.clone().requires_grad_(True)
    full = dict(zip(names, [*leaves, *pflego.split_head(w)], strict=True))
    grads = torch.autograd.grad(F.nll_loss(functional_call(model, full, (x,)), y), [*leaves, w])
    for ours, auto in zip([*g_theta, g_head], grads, strict=True):
        torch.testing.assert_close(ours, auto, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head_new, head - head_lr * grads[-1], rtol=1e-5, atol=1e-6)


def test_root_sgd_step_is_eq4_by_hand():
    """theta <- theta - rho (I/r) sum_sampled (N_i / N_all) g_i, with I = 5, r = 2, N_all = 10."""
    theta = [np.array([1.0, 2.0], dtype=np.float32)]
    g1, g2 = [np.array([0.5, -1.0], dtype=np.float32)], [np.array([2.0, 4.0], dtype=np.float32)]
    rho, n1, n2 = 0.1, 3, 1
    mean = mean_of([g1, g2], [n1, n2])  # what the sampled devices' nodes compose into
    scale = pflego.gradient_step_scale(n1 + n2, total_examples=10, num_devices=5, num_sampled=2)
    new, _ = pflego.root_step({"optimizer": "sgd", "lr": rho}, theta, mean, scale, {})
    by_hand = 1.0 - 0.1 * 2.5 * (0.3 * 0.5 + 0.1 * 2.0), 2.0 - 0.1 * 2.5 * (0.3 * -1.0 + 0.1 * 4.0)
    np.testing.assert_allclose(new[0], by_hand, rtol=1e-6)


def test_root_adam_step_follows_torch_adam():
    spec = pflego.optimizer_spec({"server_optimizer": "adam", "server_lr": 0.01})
    theta, state = [np.array([1.0, -2.0, 0.5], dtype=np.float32)], {}
    ref = torch.nn.Parameter(torch.tensor(theta[0]))
    opt = torch.optim.Adam([ref], lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    for grad in ([0.3, -0.2, 1.0], [0.1, 0.4, -0.5], [-0.2, 0.1, 0.2]):
        g = [np.array(grad, dtype=np.float32)]
        theta, state = pflego.root_step(spec, theta, g, 1.0, state)
        ref.grad = torch.tensor(grad)
        opt.step()
        np.testing.assert_allclose(theta[0], ref.detach().numpy(), rtol=1e-5, atol=1e-7)


def test_pflego_accuracy_is_the_mean_of_the_last_ten_rounds():
    history = [0.1 * i for i in range(1, 13)]
    out = fit_test_metrics(history)
    assert out["pflego_accuracy"] == pytest.approx(sum(history[-10:]) / 10)
    assert out["pflego_round_accuracy"] == pytest.approx(1.2)
    assert fit_test_metrics([]) == {}
    assert fit_test_metrics([0.5, 0.7])["pflego_accuracy"] == pytest.approx(0.6)


# ---------------------------------------------------------------- sampling and labels
def test_device_draw_is_seeded_uniform_and_sized():
    draws = [sample_devices(100, 0.2, 0, t) for t in range(1, 201)]
    assert all(len(d) == 20 and len(set(d)) == 20 for d in draws)
    assert draws[0] == sample_devices(100, 0.2, 0, 1) and draws[0] != sample_devices(100, 0.2, 1, 1)
    counts = np.bincount(np.concatenate(draws), minlength=100)
    assert counts.min() > 20 and counts.max() < 65  # 40 expected per device; uniform, not a fixed subset


class _Proxy:
    def __init__(self, cid: str, path: str) -> None:
        self.cid, self.path, self.asked = cid, path, 0

    def get_properties(self, ins: GetPropertiesIns, timeout, group_id) -> GetPropertiesRes:  # noqa: ANN001
        self.asked += 1
        return GetPropertiesRes(status=None, properties={"path": self.path})


def test_root_calls_only_the_subtrees_holding_a_drawn_device(tmp_path):
    cfg = cfg_of("topology.fanout=[3,4]")
    fed = federation_for(cfg)
    initial = Payload("model", {"model": initial_model(cfg, fed)})
    strategy = RootStrategy(lambda state: pflego.SERVER(rule_context(pflego.SERVER, cfg["algorithm"], "", 2, initial, state, fed, cfg)),
                            StateStore(tmp_path), num_children=3, num_rounds=5,
                            device_sampling=DeviceDraw(12, 0.25, 0, {"0": frozenset(range(4)), "1": frozenset(range(4, 8)),
                                                                     "2": frozenset(range(8, 12))}))
    proxies = [_Proxy("77", "2"), _Proxy("12", "0"), _Proxy("5", "1")]
    manager = SimpleClientManager()
    for proxy in proxies:
        manager.register(proxy)
    seen_skip = False
    for rnd in range(1, 6):
        strategy.counts = RoundCounters()
        children = strategy._level1(manager, rnd)  # by path, in tree order
        assert [c.cid for c in children] == ["0", "1", "2"] and [c.proxy.path for c in children] == ["0", "1", "2"]
        drawn_set, extra = strategy._draw(rnd)
        asked = Cohort(strategy.selection, "", drawn=drawn_set, holds=strategy.device_sampling.holds).ask(str(rnd), children)
        drawn = sample_devices(12, 0.25, 0, rnd)
        assert extra == {"devices": ",".join(map(str, drawn))}
        assert {p.proxy.path for p in asked} == {str(d // 4) for d in drawn}
        seen_skip |= len(asked) < 3
    assert seen_skip  # some round left a subtree out
    assert all(p.asked == 1 for p in proxies)  # paths asked once, then cached


def test_local_labels_index_each_devices_classes():
    cfg = cfg_of("topology.fanout=[2,6]")
    fed = federation_for(cfg)
    assert model_classes(cfg["algorithm"]["local_labels"], fed) == 2
    for d in range(len(fed.devices)):
        local, orig = device_data(cfg, fed, d), fed.devices[d]
        classes = torch.tensor(fed.device_classes[d])
        assert set(local.y_train.tolist()) <= {0, 1}
        assert torch.equal(classes[local.y_train], orig.y_train) and torch.equal(classes[local.y_test], orig.y_test)


def test_a_shared_local_label_head_needs_one_k():
    cfg = compose_cfg("algorithm=fedavg", "algorithm.local_labels=true", "dataset.max_samples=120",
                      "topology.num_teams=2", "topology.devices_per_team=3")
    with pytest.raises(ConfigError, match="algorithm.local_labels"):
        model_classes(cfg["algorithm"]["local_labels"], federation_for(cfg))  # the natural synthetic split: devices own different class counts


@pytest.mark.parametrize("override, key", [
    ("algorithm.sampling=children", "algorithm.sampling"),
    ("algorithm.server_optimizer=rmsprop", "algorithm.server_optimizer"),
    ("algorithm.team_rounds=2", "algorithm.team_rounds"),
    ("algorithm.sample_fraction=[1,0.5]", "algorithm.sample_fraction"),
    ("model=mclr", "model.name"),
])
def test_bad_pflego_configs_are_refused(tmp_path, override, key):
    base = [o for o in BASE if not o.startswith("model")] if override.startswith("model=") else BASE
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        run(compose_cfg(*base, "topology.fanout=[2,6]", override), tmp_path)


# ---------------------------------------------------------------- end to end
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_tree_root_step_equals_flat(tmp_path, optimizer):
    """The same devices drawn, the same heads: one server over all 12, a 3x4 tree and a
    2x2x3 tree give the same bodies (N-weighted gradient means compose exactly)."""
    bodies, pms = [], []
    for i, fanout in enumerate(("[1,12]", "[3,4]", "[2,2,3]")):
        out = tmp_path / str(i)
        run(cfg_of(f"topology.fanout={fanout}", f"algorithm.server_optimizer={optimizer}"), out)
        bodies.append(final_body(out))
        pms.append(lines(out)[-1]["pm_accuracy"])
    moved = max(float(np.abs(a - b).max()) for a, b in zip(bodies[0], final_body_initial(tmp_path), strict=True))
    assert moved > 1e-3  # it trained
    for other in bodies[1:]:
        for a, b in zip(bodies[0], other, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert pms[0] == pytest.approx(pms[1], abs=1e-9) and pms[0] == pytest.approx(pms[2], abs=1e-9)


def final_body_initial(tmp_path: Path) -> list[np.ndarray]:
    from hfl.runtime.build import initial_model

    cfg = cfg_of("topology.fanout=[1,12]")
    full = initial_model(cfg, federation_for(cfg))
    return full[:-2]


def test_run_reports_pm_and_the_papers_figure_and_skips_undrawn_subtrees(tmp_path):
    out = tmp_path / "run"
    run(cfg_of("topology.fanout=[6,2]", "global_rounds=4", "eval_every=4"), out)
    last = lines(out)[-1]
    assert last["gm_accuracy"] is None and last["level1_accuracy"] is None  # no server model is a predictor
    assert 0 < last["pm_accuracy"] <= 1 and 0 < last["pflego_accuracy"] <= 1
    records = [json.loads(r) for r in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["global_round"] for r in records] == [1, 2, 3, 4] and all(len(r["devices"]) == 3 for r in records)
    drawn = set(records[-1]["devices"])
    tree = federation_for(cfg_of("topology.fanout=[6,2]")).tree
    holders = sum(bool(drawn & set(tree.devices_under(p))) for p in tree.children(""))
    assert holders < 6  # 3 devices drawn: some level-1 node was not called
    body_bytes = nbytes(ndarrays_to_parameters(final_body(out)).tensors)  # as sent, with npy headers
    # Round 4: the body to each level-1 node holding a drawn device (fit), then to all 6 (evaluation).
    assert last["bytes_down_global"] == pytest.approx((holders + 6) * body_bytes, abs=0)
    assert last["bytes_up_global"] == pytest.approx(holders * body_bytes, abs=0)
    ever = {d for r in records for d in r["devices"]}
    with_head = {d for d, state in stored_device_states(StateStore(out / "state")).items() if "extra_head" in state}
    assert with_head == ever  # a head is made and kept by the device's first round, never sent


@pytest.mark.parametrize("algorithm", ["fedper", "fedavg"])
def test_baselines_as_the_paper_runs_them(tmp_path, algorithm):
    """Local-label K-way heads, the same uniform device draw, and the paper's figure."""
    base = [o for o in BASE if not o.startswith(("algorithm", "model"))]
    cfg = compose_cfg(*base, f"algorithm={algorithm}", "model=mlp", "model.hidden=8", "topology.fanout=[3,4]",
                      "algorithm.local_labels=true", "algorithm.sampling=devices", "algorithm.sample_fraction=0.25",
                      "algorithm.fit_test=true", "algorithm.local_steps=5", "algorithm.team_rounds=1")
    run(cfg, tmp_path)
    last = lines(tmp_path)[-1]
    assert final_body(tmp_path)[-1].shape == (2,)  # the shared head's bias: K = 2 local classes, not 10
    assert 0 < last["pflego_accuracy"] <= 1
    assert 0 < last["pm_accuracy" if algorithm == "fedper" else "gm_accuracy"] <= 1
    records = [json.loads(r) for r in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["devices"] for r in records] == [sample_devices(12, 0.25, int(cfg["seed"]), t) for t in (1, 2, 3)]


def test_ray_simulation_equals_inprocess(tmp_path):
    """On Ray the root finds the level-1 nodes holding drawn devices through Flower's
    get_properties (node ids say nothing of the tree); the bodies and PMs equal in-process."""
    cfg = cfg_of("topology.fanout=[3,4]", "eval_every=3")
    ray_cfg = {**cfg, "runtime": compose_cfg("runtime=simulation")["runtime"]}
    ray = run(ray_cfg, tmp_path / "ray")
    inproc = run(cfg, tmp_path / "inprocess")
    for a, b in zip(final_body(tmp_path / "ray"), final_body(tmp_path / "inprocess"), strict=True):
        np.testing.assert_array_equal(a, b)
    assert ray["final"]["pm_accuracy"] == inproc["final"]["pm_accuracy"]
    assert lines(tmp_path / "ray")[-1]["bytes_up_global"] == lines(tmp_path / "inprocess")[-1]["bytes_up_global"]


def test_hfl_report_shows_the_papers_figure_beside_the_paper(tmp_path):
    from hfl.output import report

    run(cfg_of("topology.fanout=[3,4]", "global_rounds=2"), tmp_path / "run")
    paper = tmp_path / "paper.yaml"
    paper.write_text("synthetic/mlp:\n  pflego: {pflego: 98.43}\n")
    assert report.main([str(tmp_path / "run"), "--out", str(tmp_path / "rep"), "--paper", str(paper)]) == 0
    table = [line for line in (tmp_path / "rep" / "report.md").read_text().splitlines() if line.startswith("|")]
    header, row = [c.strip() for c in table[0].split("|")], [c.strip() for c in table[2].split("|")]
    ours = json.loads((tmp_path / "run" / "summary.json").read_text())["final"]["pflego_accuracy"]
    assert row[header.index("pflego final")] == f"{100 * ours:.2f}"
    assert row[header.index("paper pflego")] == "98.43"
