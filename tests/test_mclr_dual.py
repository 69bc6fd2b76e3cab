"""MCLR's dual-form batched step (hfl.accel.mclr_dual) computes the per-device path's models: plain
SGD, prox toward an anchor, inner steps with a moving anchor (pFedMe), short last batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hfl.accel import batched as batched_module
from hfl.accel import mclr_dual
from hfl.accel.batched import ConcatenatedData, run_plans
from hfl.device.plan import FitPlan, Phase, run_plan
from hfl.device.state import DeviceRuntime
from hfl.accel.mclr_dual import dual_buckets, dual_pays, make_dual_data, phase_cost, size_buckets
from hfl.models import MCLR
from hfl.runtime.simulate import run
from hfl.device.training import BatchSampler, LocalTrainer
from tests.conftest import SMALL, compose_cfg
from tests.test_batched import assert_same_run

DIM, CLASSES = 20, 4
SIZES = [9, 17, 4, 12]  # fewer samples than features: the dual form pays


def _devices() -> list[DeviceRuntime]:
    out = []
    for i, n in enumerate(SIZES):
        g = torch.Generator().manual_seed(10 + i)
        x, y = torch.randn(n, DIM, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
        trainer = LocalTrainer(MCLR((DIM,), CLASSES))
        out.append(DeviceRuntime(i, x, y, x[:2], y[:2], trainer, BatchSampler(n, 5, seed=i)))
    return out


def _start(d: DeviceRuntime) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(d.device_id)
    return [0.2 * torch.randn(p.shape, generator=g) for p in d.trainer.initial_params()]


def _finish(models, losses):  # noqa: ANN001, ANN202
    return [m.numpy() for phase in models for m in phase], 1, {"loss": sum(losses)}


def _prox_plans(devices: list[DeviceRuntime]) -> list[FitPlan]:
    plans = []
    for d in devices:
        start = _start(d)
        anchor = [0.5 * p + 0.1 for p in start] if d.device_id % 2 else None  # mixed: anchored or not
        plans.append(FitPlan([Phase(start, 7, 0.1 + 0.05 * d.device_id, anchor, 0.3), Phase(start, 3, 0.2)], _finish))
    return plans


def _pulled_plans(devices: list[DeviceRuntime]) -> list[FitPlan]:  # pFedMe's loop
    plans = []
    for d in devices:
        start = _start(d)
        plans.append(FitPlan([Phase([p.clone() for p in start], 6, 0.05, [p + 0.2 for p in start], 15.0,
                                    inner_steps=3, pull=0.1 * (1 + d.device_id))], _finish))
    return plans


@pytest.mark.parametrize("bucketed", [False, True], ids=["one-group", "size-buckets"])
@pytest.mark.parametrize("make_plans", [_prox_plans, _pulled_plans], ids=["prox-mixed", "inner-steps-pull"])
def test_dual_steps_equal_the_per_device_path(monkeypatch, make_plans, bucketed):
    if bucketed:  # free splits: sizes 4 | 9 | 12 | 17, each device its own group
        monkeypatch.setattr(mclr_dual, "COST_PER_STEP", 0.0)
    one, many = _devices(), _devices()
    want_plans, got_plans = make_plans(one), make_plans(many)
    want = [run_plan(d, p) for d, p in zip(one, want_plans, strict=True)]
    made = []
    real = batched_module.run_dual_steps

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        made.append(args[0].rows)
        return real(*args, **kwargs)

    monkeypatch.setattr(batched_module, "run_dual_steps", counted)
    got = run_plans(many, got_plans, ConcatenatedData(many, torch.device("cpu")))
    # the dual form ran, padded to the largest device of each group
    assert made and set(made) == (set(SIZES) if bucketed else {max(SIZES)})
    for (g_arrays, _, g_metrics), (w_arrays, _, w_metrics) in zip(got, want, strict=True):
        for g, w in zip(g_arrays, w_arrays, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        assert g_metrics["loss"] == pytest.approx(w_metrics["loss"], rel=1e-5)
    for a, b in zip(want_plans, got_plans, strict=True):  # pFedMe's moved anchor (its local model)
        for pa, pb in zip(a.phases, b.phases, strict=True):
            assert (pa.moved_anchor is None) == (pb.moved_anchor is None)
            for x, y in zip(pa.moved_anchor or [], pb.moved_anchor or [], strict=True):
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    for a, b in zip(one, many, strict=True):
        assert a.sampler.pos == b.sampler.pos and torch.equal(a.sampler.perm, b.sampler.perm)


def test_the_primal_step_runs_where_devices_have_more_samples_than_features(monkeypatch):
    many = _devices()
    data = ConcatenatedData(many, torch.device("cpu"))
    assert data.dual(many) is not None
    wide = [DeviceRuntime(d.device_id, torch.randn(30, 8), torch.randint(0, 3, (30,)), d.x_test, d.y_test,
                          LocalTrainer(MCLR((8,), 3)), BatchSampler(30, 5, seed=0)) for d in many]
    assert ConcatenatedData(wide, torch.device("cpu")).dual(wide) is None


def test_dual_pays_only_below_the_feature_count():
    assert dual_pays([100, 629, 20], 784)  # MNIST preset devices
    assert not dual_pays([100, 784], 784)
    assert not dual_pays([188, 17959], 60)  # Synthetic: thousands of samples, 60 features


def test_dual_data_is_the_padded_inputs_and_their_gram_matrices():
    x = torch.arange(2 * 3 * 2, dtype=torch.float32).view(6, 2, 1, 1) / 10  # 6 rows of shape [2, 1, 1]
    data = make_dual_data([x[:4], x[4:]], torch.device("cpu"))
    assert data.x.shape == (2, 4, 2) and data.rows == 4
    torch.testing.assert_close(data.x[1, :2], x[4:].flatten(1))
    assert torch.count_nonzero(data.x[1, 2:]) == 0  # padding
    for d, n in enumerate([4, 2]):
        rows = data.x[d, :n]
        torch.testing.assert_close(data.gram[d, :n, :n], rows @ rows.T + 1)  # the bias: a feature 1
    assert torch.count_nonzero(data.gram[1, 2:]) == 0 and torch.count_nonzero(data.gram[1, :, 2:]) == 0


# PerMFL (prox toward the start), Ditto (two phases, one plain), pFedMe (inner steps, moving
# anchor), FedAvg (plain SGD); 300 features and at most 225 training samples a device: dual form.
@pytest.mark.parametrize("name", ["permfl", "ditto", "pfedme", "fedavg"])
def test_dual_run_equals_per_device_run(tmp_path, monkeypatch, name):
    dual_calls: list[int] = []
    real = batched_module.run_dual_steps

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        dual_calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(batched_module, "run_dual_steps", counted)
    runs = {}
    for mode in ("off", "on"):
        runs[mode] = tmp_path / mode
        run(compose_cfg(*SMALL, f"algorithm={name}", "dataset.num_features=300", "runtime=inprocess",
                        f"runtime.batched={mode}", "dataset.batch_size=20"), runs[mode])
        assert bool(dual_calls) == (mode == "on")
    assert_same_run(runs["on"], runs["off"])


def test_scaled_nll_gradient_by_hand():
    from hfl.accel.closed_forms import nll_targets, scaled_nll_grad

    # two devices (lr 1 and 0.1), two classes, two samples: equal logits (p = 1/2 each), then logits
    # (ln 3, 0) (p = 3/4, 1/4); the second device's second sample is padding (weight 0)
    logits = torch.tensor([[[0.0, float(np.log(3.0))], [0.0, 0.0]]]).repeat(2, 1, 1)  # [D=2, C=2, B=2]
    y, w = torch.tensor([[[0, 1], [0, 1]]]), torch.tensor([[[0.5, 0.5], [1.0, 0.0]]])
    target = nll_targets(y, w, 2, torch.tensor([1.0, 0.1]))[0]
    g, loss = scaled_nll_grad(logits.clone(), target)
    first = torch.tensor([[0.5 * (0.5 - 1.0), 0.5 * 0.75], [0.5 * 0.5, 0.5 * (0.25 - 1.0)]])
    second = 0.1 * torch.tensor([[0.5 - 1.0, 0.0], [0.5, 0.0]])
    torch.testing.assert_close(g, torch.stack([first, second]))
    torch.testing.assert_close(loss, torch.tensor([0.5 * np.log(2.0) + 0.5 * np.log(4.0), np.log(2.0)],
                                                  dtype=torch.float32))


def test_size_buckets_split_where_padding_costs_more_than_a_group():
    # An MNIST preset team, sorted 27 ... 244, 325, 629: one group pads to 10 * 629 = 6,290 rows;
    # the cheapest split, 8 | 2, costs 8 * 244 + 2 * 629 + 1,024 = 4,234 (9 | 1: 4,578; 7 | 3:
    # 4,325); neither part splits again (5 | 3 of the eight: 5 * 124 + 3 * 244 + 1,024 > 8 * 244).
    assert size_buckets([629, 27, 37, 40, 92, 124, 154, 202, 244, 325]) == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 0]]
    assert size_buckets([22, 46, 75, 109, 187, 250, 274, 278, 279, 306]) == [list(range(10))]  # even enough
    assert size_buckets([5]) == [[0]]
    assert size_buckets([10, 3000, 12, 2900]) == [[0, 2], [3, 1]]  # 2*12 + 2*3000 + 1,024 < 4*3000


def test_dual_buckets_take_the_cheapest_runs_by_hand(monkeypatch):
    # cost = steps * (D * n * W + 100) with W = min(n, batch 1,000) = n: sizes 10, 10, 20 as one
    # group 3 * 400 + 100 = 1,300; 10, 10 | 20: (200 + 100) + (400 + 100) = 800; each alone 900
    for name, value in [("COST_PER_GRAM_ENTRY", 1.0), ("COST_PER_SAMPLE", 0.0), ("COST_PER_ROW", 0.0),
                        ("COST_PER_STEP", 100.0)]:
        monkeypatch.setattr(mclr_dual, name, value)
    assert dual_buckets([20, 10, 10], batch_size=1000, steps=1) == [[1, 2], [0]]
    assert phase_cost(2, 10, 10, 1) + phase_cost(1, 20, 20, 1) == 800
    # a fixed cost of 1,000 a group: one group (1,300 + 900) beats two (800 + 1,800)
    monkeypatch.setattr(mclr_dual, "COST_PER_STEP", 1000.0)
    assert dual_buckets([20, 10, 10], batch_size=1000, steps=1) == [[1, 2, 0]]
    # minibatches of 4: the width is min(rows, 4), and the set-up per padded row counts too
    monkeypatch.setattr(mclr_dual, "COST_PER_ROW", 3.0)
    assert phase_cost(2, 10, 4, 5) == 5 * (2 * 10 * 4 + 1000) + 3 * 2 * 10


def _partitions(n: int):
    """Every split of range(n) into consecutive runs."""
    if n == 0:
        yield []
        return
    for first in range(1, n + 1):
        for rest in _partitions(n - first):
            yield [list(range(first))] + [[first + i for i in run] for run in rest]


@pytest.mark.parametrize("seed", range(6))
def test_dual_buckets_are_the_cheapest_split_of_the_sorted_sizes(seed):
    """Against every split into runs of the sorted sizes (brute force), with the measured costs."""
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(5, 700, size=int(rng.integers(1, 9)))]
    batch, steps = int(rng.choice([16, 124])), int(rng.choice([2, 20]))
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])

    def cost(groups):
        return sum(phase_cost(len(g), max(sizes[i] for i in g), min(max(sizes[i] for i in g), batch), steps)
                   for g in groups)

    best = min(cost([[order[i] for i in run] for run in split]) for split in _partitions(len(sizes)))
    got = dual_buckets(sizes, batch, steps)
    assert sorted(i for g in got for i in g) == list(range(len(sizes)))
    assert cost(got) == pytest.approx(best, rel=1e-12)
