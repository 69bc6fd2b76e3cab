"""The baselines' update rules against hand-computed values, and their config checks.

Device rules are driven through the real clients on a stub trainer whose loss is the
quadratic f(w) = 0.5 * ||w - c||^2 (gradient w - c, Hessian I), so every step has a closed form.
"""

from __future__ import annotations

import math

import numpy as np

from hfl.node.round_counters import RoundCounters
import pytest
import torch
from flwr.common import (
    Code,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)

from clients.demlearn import DemLearnClient
from clients.ditto import DittoClient
from clients.fedprox import FedProxClient
from clients.fedrep import FedRepClient
from clients.l2gd import L2GDClient
from clients.local import LocalClient
from clients.perfedavg import PerFedAvgClient, hessian_vector_product, hf_direction
from clients.pfedbayes import (
    gaussian_kl,
    kl_grads,
    personal_step,
    prior_step,
    sample_weights,
)
from clients.pfedme import PFedMeClient
from hfl.config.checks import validate
from hfl.device.state import DeviceRuntime
from hfl.errors import ConfigError
from hfl.rules.personal import head_mask, masked_sgd_step, mix, splice
from hfl.device.training import BatchSampler
from strategies.demlearn import DemLearnServer
from strategies.l2gd import step_sizes
from strategies.pfedbayes import PFedBayesServer, bayesian_initial
from strategies.pfedme import PFedMeServer
from tests.conftest import compose_cfg, node_strategy, root_strategy
from tests.test_strategies import Proxy, _manager


class Quadratic:
    """Stub LocalTrainer: f(w) = 0.5 * sum ||w_i - c_i||^2 on every batch."""

    has_buffers = False  # no BatchNorm statistics (hfl.device.training.run_local_steps reads it)

    def __init__(self, centers, names=None) -> None:
        self.centers = [torch.tensor(c, dtype=torch.float32) for c in centers]
        self.names = names or [f"layer{i}.weight" for i in range(len(centers))]
        self.calls = 0

    def loss_and_grad(self, params, x, y):
        self.calls += 1
        grads = [p - c for p, c in zip(params, self.centers, strict=True)]
        return 0.5 * sum(float((g**2).sum()) for g in grads) * torch.ones(()), grads


def device(centers, names=None, personal=None) -> DeviceRuntime:
    x, y = torch.zeros(8, 1), torch.zeros(8, dtype=torch.int64)
    return DeviceRuntime(0, x, y, x, y, Quadratic(centers, names), BatchSampler(8, 4, seed=0), personal)


def arrays(*values) -> list[np.ndarray]:
    return [np.array(v, dtype=np.float32) for v in values]


def fit(client, sent, **config):
    model, n, metrics = client.fit(arrays(*sent), config)
    return [a.tolist() for a in model], n, metrics


def close(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, dtype=np.float64), want_array(w), rtol=1e-5, atol=1e-6)


def want_array(w) -> np.ndarray:
    return np.asarray(w.detach().numpy() if isinstance(w, torch.Tensor) else w, dtype=np.float64)


# ---- shared pieces -------------------------------------------------------------------------

def test_mix_splice_and_masked_step_by_hand():
    close(mix([np.array([2.0])], [np.array([10.0])], 0.25), [[4.0]])  # 0.75*2 + 0.25*10
    mask = [False, True]
    close(splice([1.0, 2.0], [3.0, 4.0], mask), [1.0, 4.0])
    close(masked_sgd_step([np.array([1.0]), np.array([1.0])], [np.array([2.0]), np.array([2.0])], 0.1, mask), [[1.0], [0.8]])


def test_head_mask_takes_the_last_layers():
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert head_mask(names, 1) == [False, False, True, True]
    assert head_mask(names, 2) == [True] * 4
    with pytest.raises(ValueError, match="head_layers"):
        head_mask(names, 3)


# ---- flat algorithms -----------------------------------------------------------------------

def test_local_trains_its_own_model_and_shares_nothing():
    dev = device([[1.0]], personal=[torch.tensor([5.0])])
    model, _, _ = fit(LocalClient(dev), [[100.0]], alpha=0.5, local_steps=1)
    assert model == [[100.0]]  # echoes what it was sent
    close(dev.personal, [[3.0]])  # 5 - 0.5 * (5 - 1), from its own model, not the 100 it received


def test_fedprox_two_steps_by_hand():
    # w0 = 4 (received), c = 0, alpha = 0.1, mu = 2:
    # w1 = 4 - 0.1*(4 + 2*0) = 3.6;  w2 = 3.6 - 0.1*(3.6 + 2*(3.6 - 4)) = 3.32
    model, _, _ = fit(FedProxClient(device([[0.0]])), [[4.0]], alpha=0.1, mu=2.0, local_steps=2)
    close(model, [[3.32]])


def test_ditto_global_and_personal_models_by_hand():
    dev = device([[0.0]], personal=[torch.tensor([10.0])])
    # w: 4 - 0.1*4 = 3.6 (sent back); v: 10 - 0.1*(10 + 0.5*(10 - 4)) = 8.7 (kept)
    model, _, _ = fit(DittoClient(dev), [[4.0]], alpha=0.1, lam=0.5, local_steps=1)
    close(model, [[3.6]])
    close(dev.personal, [[8.7]])


def test_pfedme_local_round_by_hand():
    dev = device([[0.0]])
    # theta starts at w = 4; K = 2 steps with plr = 0.1, lam = 1:
    # theta1 = 4 - 0.1*(4 + 0) = 3.6; theta2 = 3.6 - 0.1*(3.6 + (3.6 - 4)) = 3.28
    # w <- w - eta*lam*(w - theta) = 4 - 0.5*(4 - 3.28) = 3.64
    model, _, _ = fit(PFedMeClient(dev), [[4.0]], alpha=0.5, lam=1.0, personal_lr=0.1, inner_steps=2, local_steps=1)
    close(model, [[3.64]])
    close(dev.personal, [[3.28]])


def test_perfedavg_first_order_and_hessian_free_by_hand():
    # f = 0.5 (w - c)^2: w_tmp = w - a(w - c); FO: w - b(1 - a)(w - c); HF: w - b(1 - a)^2 (w - c)
    w, c, a, b = 3.0, 1.0, 0.5, 0.2
    fo = PerFedAvgClient(device([[c]])).meta_step([torch.tensor([w])], a, b, "fo", 1e-3)[0]
    hf_dev = device([[c]])
    hf = PerFedAvgClient(hf_dev).meta_step([torch.tensor([w])], a, b, "hf", 1e-3)[0]
    close(fo, [[w - b * (1 - a) * (w - c)]])  # 2.8
    close(hf, [[w - b * (1 - a) ** 2 * (w - c)]])  # 2.9
    assert hf_dev.trainer.calls == 4  # grad at w, at w_tmp, and two for the H v difference


def test_hessian_free_pieces_by_hand():
    close(hessian_vector_product([np.array([3.0])], [np.array([1.0])], 0.5), [[2.0]])  # (3 - 1) / (2*0.5)
    close(hf_direction([np.array([4.0])], [np.array([2.0])], 0.5), [[3.0]])  # 4 - 0.5*2


def test_perfedavg_pm_adapts_the_latest_global_model():
    dev = device([[1.0]])
    client = PerFedAvgClient(dev)
    client.fit(arrays([5.0]), {"alpha": 0.5, "beta": 0.1, "variant": "fo", "delta": 1e-3, "local_steps": 1})
    client.model_to_test(arrays([3.0]), {"model": "global"})  # the team tests GM before PM
    close(client.model_to_test([], {"model": "personal"}), [[2.0]])  # 3 - 0.5*(3 - 1)


def test_fedrep_trains_head_then_body_and_keeps_its_head():
    names = ["body.weight", "head.weight"]
    dev = device([[0.0], [0.0]], names, personal=[torch.tensor([50.0]), torch.tensor([8.0])])
    config = {"alpha": 0.5, "head_steps": 2, "local_steps": 1, "head_layers": 1}
    model, _, _ = fit(FedRepClient(dev), [[4.0], [100.0]], **config)
    # start = [received body 4, own head 8]; head: 8 -> 4 -> 2; body: 4 -> 2
    close(dev.personal, [[2.0], [2.0]])
    close(model, [[2.0], [100.0]])  # trained body, the head it received (its own stays home)


# ---- servers ---------------------------------------------------------------------------------

def _fit_res(value: float, n: int, **metrics) -> FitRes:
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays([value])), n, metrics)


def test_flat_pfedme_two_tiers_equal_one_weighted_mean_over_all_devices(tmp_path):
    alg = {"alpha": 0.1, "local_steps": 1, "lam": 15.0, "personal_lr": 0.01, "inner_steps": 5, "beta": 0.5,
           "weighted": True}
    x = arrays([2.0])
    devices = [[(1.0, 10), (4.0, 30)], [(10.0, 60)]]  # (device model, samples) per team
    team_models = []
    for t, team in enumerate(devices):
        strategy = node_strategy(PFedMeServer, x, alg)
        strategy.configure_fit(1, ndarrays_to_parameters(x), client_manager=_manager())
        results = [(Proxy(str(i)), _fit_res(v, n, device_id=i)) for i, (v, n) in enumerate(team)]
        params, _ = strategy.aggregate_fit(1, results, [])
        team_models.append((parameters_to_ndarrays(params)[0][0], sum(n for _, n in team)))
    server = root_strategy(PFedMeServer, x, alg, tmp_path, num_children=2, num_rounds=1)
    server.counts = RoundCounters()
    results = [(Proxy(f"t{t}"), _fit_res(v, n, level1_index=t)) for t, (v, n) in enumerate(team_models)]
    got = parameters_to_ndarrays(server.aggregate_fit(1, results, [])[0])[0]
    flat = (10 * 1.0 + 30 * 4.0 + 60 * 10.0) / 100  # 7.3
    np.testing.assert_allclose(got, [0.5 * 2.0 + 0.5 * flat], rtol=1e-6)  # x <- (1-beta) x + beta mean


def test_pfedme_team_sends_its_hyper_parameters():
    alg = {"alpha": 0.1, "local_steps": 3, "lam": 15.0, "personal_lr": 0.01, "inner_steps": 5, "weighted": True}
    config = node_strategy(PFedMeServer, arrays([0.0]), alg).fit_config
    assert {k: config[k] for k in ("lam", "personal_lr", "inner_steps", "local_steps", "alpha")} == {
        "lam": 15.0, "personal_lr": 0.01, "inner_steps": 5, "local_steps": 3, "alpha": 0.1}


def test_demlearn_team_specializes_between_rounds_and_sends_the_plain_mean_up():
    alg = {"alpha": 0.1, "local_steps": 1, "team_rounds": 2, "mu": 0.0, "mix": 0.6, "weighted": False}
    strategy = node_strategy(DemLearnServer, arrays([10.0]), alg)
    results = [(Proxy("a"), _fit_res(0.0, 1, device_id=0)), (Proxy("b"), _fit_res(4.0, 3, device_id=1))]
    for rnd, want in ((1, 0.4 * 2 + 0.6 * 10), (2, 2.0)):  # mean 2 (uniform); mixed with the parent 10
        strategy.configure_fit(rnd, ndarrays_to_parameters(arrays([1.0])), client_manager=_manager())
        params, _ = strategy.aggregate_fit(rnd, results, [])
        np.testing.assert_allclose(parameters_to_ndarrays(params)[0], [want], rtol=1e-6)


def test_demlearn_device_specializes_then_trains_with_prox_by_hand():
    dev = device([[0.0]], personal=[torch.tensor([2.0])])
    # c = 0.5*2 + 0.5*10 = 6; one step: 6 - 0.1*(6 + 1*(6 - 10)) = 5.8
    model, _, _ = fit(DemLearnClient(dev), [[10.0]], alpha=0.1, mu=1.0, mix=0.5, local_steps=1)
    close(model, [[5.8]])
    close(dev.personal, [[5.8]])


def test_l2gd_step_sizes_by_hand():
    # K = 2, L = 3: E = 2*(3 + 1) = 8 moves per global round
    sizes = step_sizes({"alpha": 0.1, "team_rounds": 2, "local_steps": 3, "lam_global": 0.5, "lam_team": 1.0})
    assert sizes == pytest.approx({"local_lr": 0.1 * 8 / 6, "global_pull": 0.4, "team_pull": 0.8})
    flat = step_sizes({"alpha": 0.03, "team_rounds": 1, "local_steps": 20, "lam_global": 1.0, "lam_team": 0.0})
    assert flat == pytest.approx({"local_lr": 0.0315, "global_pull": 0.63, "team_pull": 0.0})


def test_l2gd_device_pulls_toward_the_global_model_in_round_one_and_the_team_after():
    dev = device([[0.0]], personal=[torch.tensor([2.0])])
    client = L2GDClient(dev)
    config = {"global_pull": 0.5, "team_pull": 0.25, "local_lr": 0.1, "local_steps": 1}
    fit(client, [[10.0]], node_round=1, **config)  # (2 + 10)/2 = 6, then 6 - 0.6 = 5.4
    close(dev.personal, [[5.4]])
    fit(client, [[1.4]], node_round=2, **config)  # 0.75*5.4 + 0.25*1.4 = 4.4, then 4.4 - 0.44 = 3.96
    close(dev.personal, [[3.96]])


# ---- pFedBayes -------------------------------------------------------------------------------

RHO_ONE = math.log(math.e - 1)  # softplus(RHO_ONE) = 1


def test_gaussian_kl_by_hand_and_its_gradients_against_autograd():
    one = [torch.tensor([RHO_ONE])]
    assert gaussian_kl([torch.tensor([1.0])], one, [torch.tensor([0.0])], one) == pytest.approx(0.5)
    torch.manual_seed(0)
    leaves = [torch.randn(3, requires_grad=True) for _ in range(4)]
    mq, rq, mp, rp = leaves
    sq, sp = torch.nn.functional.softplus(rq), torch.nn.functional.softplus(rp)
    kl = (torch.log(sp / sq) + (sq**2 + (mq - mp) ** 2) / (2 * sp**2) - 0.5).sum()
    auto = torch.autograd.grad(kl, leaves)
    closed = kl_grads([mq.detach()], [rq.detach()], [mp.detach()], [rp.detach()])
    for a, c in zip(auto, closed, strict=True):
        torch.testing.assert_close(c[0], a)


def test_pfedbayes_softplus_within_4_ulps_of_float64_and_exact_at_the_edges():
    from clients.pfedbayes import softplus

    x = torch.cat([torch.linspace(-120.0, 100.0, 400_001),  # underflow, u = 1, the threshold, overflow
                   torch.tensor([0.0, -0.0, 19.9999, 20.0, 20.0001, -16.7, -87.3, -103.9, 88.7, 89.0, 1e30, -1e30])])
    reference, before = torch.nn.functional.softplus(x.double()), x.clone()
    got = softplus(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    normal = reference > torch.finfo(torch.float32).tiny
    ulps = ((got.double() - reference).abs() / reference)[normal] / 2.0**-24
    assert float(ulps.max()) <= 4.0
    assert float((got.double() - reference)[~normal].abs().max()) < 1e-44  # e^x itself, subnormal or 0
    assert torch.equal(got[x > 20], x[x > 20])  # x itself above the threshold, as PyTorch's
    edges = softplus(torch.tensor([float("inf"), float("-inf"), float("nan"), RHO_ONE]))
    assert edges[0] == float("inf") and edges[1] == 0.0 and edges[2].isnan()
    assert float(edges[3]) == pytest.approx(1.0, rel=3e-7)
    assert torch.equal(x, before)  # its input untouched (it works in place on its temporaries)


def test_pfedbayes_steps_by_hand():
    # sigma = 1 (rho = RHO_ONE, sigmoid = 1 - 1/e); grad_w = 2, eps = 0.5, kl grads 1 and 3, lr 0.1, weight 0.5
    mu, rho = personal_step([torch.tensor([1.0])], [torch.tensor([RHO_ONE])], [torch.tensor([2.0])],
                            [torch.tensor([0.5])], [torch.tensor([1.0])], [torch.tensor([3.0])], 0.1, 0.5)
    close(mu, [[1.0 - 0.1 * (2.0 + 0.5)]])
    close(rho, [[RHO_ONE - 0.1 * (2.0 * 0.5 * (1 - 1 / math.e) + 1.5)]])
    mu, rho = prior_step([torch.tensor([1.0])], [torch.tensor([0.0])], [torch.tensor([4.0])], [torch.tensor([-2.0])], 0.1, 0.5)
    close(mu + rho, [[0.8], [0.1]])
    close(sample_weights([torch.tensor([1.0])], [torch.tensor([RHO_ONE])], [torch.tensor([0.5])]), [[1.5]])


def test_pfedbayes_group_draws_each_devices_batches_and_noise_in_its_own_order():
    from clients.pfedbayes import BayesPlan, _draws

    def device(i: int) -> DeviceRuntime:
        return DeviceRuntime(i, torch.zeros(7, 3), torch.zeros(7, dtype=torch.long), None, None, None,
                             BatchSampler(7, 3, seed=i))

    shapes = [(2, 9), (2,)]  # a weight (vectorized normal draws) and a bias (fewer than 16: scalar draws)
    q = [torch.zeros(s) for s in shapes]
    plans = [BayesPlan(device(i), q, q, steps=4, personal_steps=2, personal_lr=0.1, lr=0.1, noise_scale=1.0,
                       kl_weight=0.1) for i in range(2)]
    noise = [torch.empty(4, 2, 2, *s) for s in shapes]
    rows = [_draws(p, d, noise) for d, p in enumerate(plans)]
    for d in range(2):  # what PFedBayesClient.fit draws: a batch, then randn per tensor per personal step
        sampler = BatchSampler(7, 3, seed=d)
        for s in range(4):
            assert torch.equal(rows[d][s], sampler.next())
            for k in range(2):
                for j, shape in enumerate(shapes):
                    assert torch.equal(noise[j][s, k, d], torch.randn(shape, generator=sampler.generator))


def test_pfedbayes_global_model_carries_means_and_rhos(tmp_path):
    initial = arrays([[1.0, 2.0]], [3.0])
    model = bayesian_initial(initial, -3.0)
    assert [a.shape for a in model] == [(1, 2), (1,), (1, 2), (1,)]
    np.testing.assert_array_equal(model[2], [[-3.0, -3.0]])
    strategy = root_strategy(PFedBayesServer, initial, {"rho_offset": -3.0, "beta": 1.0, "weighted": True}, tmp_path,
                             num_children=1, num_rounds=1)
    assert len(strategy.current) == 4
    np.testing.assert_array_equal(strategy.current[2], [[-3.0, -3.0]])


# ---- config checks ---------------------------------------------------------------------------

@pytest.mark.parametrize(("algorithm", "override", "key"), [
    ("fedprox", "algorithm.mu=-1", "algorithm.mu"),
    ("ditto", "algorithm.lam=-0.5", "algorithm.lam"),
    ("perfedavg", "algorithm.variant=so", "algorithm.variant"),
    ("perfedavg_hf", "algorithm.delta=0", "algorithm.delta"),
    ("pfedme", "algorithm.inner_steps=0", "algorithm.inner_steps"),
    ("pfedme", "algorithm.personal_lr=0", "algorithm.personal_lr"),
    ("fedper", "algorithm.head_layers=0", "algorithm.head_layers"),
    ("fedrep", "algorithm.head_steps=1.5", "algorithm.head_steps"),
    ("pfedbayes", "algorithm.personal_steps=0", "algorithm.personal_steps"),
    ("pfedbayes", "algorithm.zeta=-1", "algorithm.zeta"),
    ("l2gd", "algorithm.lam_team=0.5", "algorithm.lam_team"),  # no team tier with K = 1
    ("al2gd", "algorithm.lam_global=1.0", "algorithm.lam_global"),  # a global pull of 6.3 overshoots
    ("demlearn", "algorithm.mix=1.5", "algorithm.mix"),
])
def test_bad_hyper_parameters_are_refused_before_training(algorithm, override, key):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(f"algorithm={algorithm}", override))
    assert err.value.key == key


@pytest.mark.parametrize("algorithm", ["local", "fedprox", "perfedavg", "perfedavg_hf", "pfedme", "ditto", "fedper",
                                       "fedrep", "pfedbayes", "l2gd", "al2gd", "demlearn"])
def test_shipped_configs_are_valid(algorithm):
    validate(compose_cfg(f"algorithm={algorithm}"))
