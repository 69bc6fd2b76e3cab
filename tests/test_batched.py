"""The batched device path (hfl.accel.batched) computes what the per-device path does: the same
minibatches from the same samplers, the same gradients, the same models within float tolerance,
for every algorithm that takes it (its device client's DeviceClient.batched)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hfl.device.client import DeviceClient
from hfl.accel import batched as batched_module
from hfl.accel import mclr_dual
from hfl.config.compose import CONF_DIR
from hfl.accel.batched import (
    ConcatenatedData,
    MAX_DISTINCT,
    batched_loss_and_grad,
    draw_batches,
    functional_batched_loss_and_grad,
    run_plans,
    stack,
)
from hfl.device.plan import FitPlan, Phase, run_plan
from hfl.accel import closed_forms
from hfl.accel import grouped_cnn
from hfl.accel.batched_eval import evaluate_models
from hfl.accel.closed_forms import closed_form
from hfl.config.checks import client_class, load_module
from hfl.device.state import DeviceRuntime, pack_states, unpack_states
from hfl.errors import ConfigError
from hfl.models import CNN, DNN, MCLR, MLP, mclr_loss_and_grad
from hfl.runtime.simulate import run
from hfl.device.training import BatchSampler, LocalTrainer, converted_once, to_tensors
from tests.conftest import SMALL, compose_cfg

ALGORITHMS = sorted(p.stem for p in (CONF_DIR / "algorithm").glob("*.yaml"))


def batched_flag(name: str) -> bool:
    return client_class(compose_cfg(f"algorithm={name}")["algorithm"]).batched


# ---------------------------------------------------------------- minibatches
@pytest.mark.parametrize("n", [50, 16, 9])
def test_sampler_take_is_next_called_steps_times(n):
    a, b = BatchSampler(n, 8, seed=3), BatchSampler(n, 8, seed=3)
    # crosses epoch ends (50 = 6 x 8 + 2: a short last batch; 16: none), several in one take
    for steps in (3, 1, 4, 5, 2, 9, 0, 23):
        got = a.take(steps)
        want = [b.next() for _ in range(steps)]
        assert got.shape == (steps, 8)
        assert [[i for i in g.tolist() if i >= 0] for g in got] == [w.tolist() for w in want]  # -1 pads short ones
        assert a.pos == b.pos and torch.equal(a.perm, b.perm)
        assert torch.equal(a.generator.get_state(), b.generator.get_state())
    c = BatchSampler(n, 8, seed=99)
    c.restore(a.state())  # mid-epoch: take goes on from the restored permutation and generator
    assert np.array_equal(c.take(7), a.take(7))


@pytest.mark.parametrize("n", [1, 5, 8])
def test_sampler_take_of_a_device_no_larger_than_its_batch_is_next_called_steps_times(n):
    a, b = BatchSampler(n, 8, seed=4), BatchSampler(n, 8, seed=4)
    for steps in (3, 1, 6):  # every call a whole new epoch
        got = a.take(steps)
        want = [b.next() for _ in range(steps)]
        assert got.shape == (steps, n)  # never wider than the device's data (a huge batch_size allocates nothing)
        assert [g[:n].tolist() for g in got] == [w.tolist() for w in want]
        assert a.pos == b.pos and torch.equal(a.perm, b.perm)
        assert torch.equal(a.generator.get_state(), b.generator.get_state())
    c = BatchSampler(n, 8, seed=99)
    c.restore(a.state())
    assert np.array_equal(c.take(4), a.take(4))


def _device(i: int, n: int, batch: int, dim: int = 6, classes: int = 3, model: torch.nn.Module | None = None) -> DeviceRuntime:
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(n, dim, generator=g), torch.randint(0, classes, (n,), generator=g)
    trainer = LocalTrainer(model if model is not None else MCLR((dim,), classes))
    return DeviceRuntime(i, x, y, x[:2], y[:2], trainer, BatchSampler(n, batch, seed=i))


def test_short_last_batches_are_padded_with_zero_weight():
    devices = [_device(0, 10, 4), _device(1, 13, 4)]  # epochs of 4+4+2 and 4+4+4+1 samples
    index, weight = draw_batches(devices, [0, 10], steps=4, batch_size=4)
    assert index.shape == weight.shape == (4, 2, 4)
    torch.testing.assert_close(weight.sum(2), torch.ones(4, 2))  # every device-step is a mean
    assert weight[2, 0].tolist() == [0.5, 0.5, 0.0, 0.0]  # device 0's third batch has 2 samples
    assert weight[3, 1].tolist() == [1.0, 0.0, 0.0, 0.0]  # device 1's fourth batch has 1
    assert int(index[:, 1].min()) >= 10 and int(index[:, 0].max()) < 10  # rows stay in each device's data


# ---------------------------------------------------------------- gradients
def _weights(batch: int, lengths: list[int]) -> torch.Tensor:
    w = torch.zeros(len(lengths), batch)
    for d, n in enumerate(lengths):
        w[d, :n] = 1.0 / n
    return w


@pytest.mark.parametrize(("model", "path"), [
    (MCLR((6,), 3), "closed"), (DNN((6,), 3, hidden=5), "closed"), (MLP((1, 2, 3), 3, hidden=5), "closed"),
    (DNN((6,), 3, hidden=5), "vmap"), (CNN((1, 6, 6), 3, hidden=4), "vmap"), (CNN((2, 7, 6), 3, hidden=4), "closed")],
    ids=["mclr-closed-form", "dnn-closed-form", "mlp-closed-form", "dnn-vmap", "cnn-vmap", "cnn-grouped"])
def test_stacked_gradients_equal_each_devices_own(model, path):
    torch.manual_seed(0)
    trainer = LocalTrainer(model)
    assert closed_form(model) is not None  # every built-in batched model has a hand-written form
    cnn_input = (1, 6, 6) if path == "vmap" else (2, 7, 6)  # the grouped form on a non-square, 2-channel input
    shape = {CNN: cnn_input, MLP: (1, 2, 3)}.get(type(model), (6,))
    lengths, batch = [5, 3, 5], 5
    params = [[p + 0.1 * torch.randn_like(p) for p in trainer.initial_params()] for _ in lengths]
    x, y = torch.randn(len(lengths), batch, *shape), torch.randint(0, 3, (len(lengths), batch))
    if isinstance(model, DNN | MLP):  # some hidden units at exactly 0: ReLU's derivative there is 0
        params[0][1][:2] = 0.0
        params[0][0][:2] = 0.0
    stepper = batched_loss_and_grad(trainer) if path == "closed" else functional_batched_loss_and_grad(trainer)
    loss, grads = stepper([torch.stack(t) for t in zip(*params)], x, y, _weights(batch, lengths))
    for d, n in enumerate(lengths):
        want_loss, want = trainer.loss_and_grad(params[d], x[d, :n], y[d, :n])
        torch.testing.assert_close(loss[d], want_loss, rtol=1e-5, atol=1e-6)
        for g, w in zip(grads, want, strict=True):
            torch.testing.assert_close(g[d], w, rtol=1e-5, atol=1e-6)
    if isinstance(model, MCLR):  # the closed form against autograd, padding included
        w_d, y_d = torch.stack([params[1][0]]), y[1, :3]
        assert torch.allclose(mclr_loss_and_grad([w_d[0], params[1][1]], x[1, :3], y_d)[0],
                              -F.log_softmax(x[1, :3] @ w_d[0].t() + params[1][1], 1).gather(1, y_d[:, None]).mean())


@pytest.mark.parametrize("kind", ["one-model", "one-tensor", "two-teams", "late-difference", "all-own", "not-contiguous"])
def test_stack_sends_distinct_models_once_and_equals_a_plain_stack(kind):
    torch.manual_seed(3)
    a, b = [torch.randn(4, 5), torch.randn(5)], [torch.randn(4, 5), torch.randn(5)]
    late = [a[0].clone(), a[1].clone()]
    late[0][3, 4] += 1.0  # equal in its leading values, different further on
    models = {"one-model": [a, [t.clone() for t in a], a],
              "one-tensor": [a, a, list(a)],
              "two-teams": [a, b, [t.clone() for t in a], b, a],
              "late-difference": [a, late, a],
              "all-own": [[torch.randn(4, 5), torch.randn(5)] for _ in range(MAX_DISTINCT + 2)],
              "not-contiguous": [a, [a[0].t().contiguous().t(), a[1]], b]}[kind]
    got = stack(models, torch.device("cpu"))
    for i, t in enumerate(got):
        assert torch.equal(t, torch.stack([m[i] for m in models]))
    # on the CPU alike is the same tensor, never compared: one tensor is a broadcast view (stride
    # 0 along devices), no copies; equal values in other tensors are copied (as cheap as comparing)
    assert (got[0].stride(0) == 0) == (kind == "one-tensor")
    # what is sent to another device: each distinct model once, unless there are too many to check
    distinct, which = batched_module._distinct([m[0] for m in models])
    assert len(distinct) == {"one-model": 1, "one-tensor": 1, "two-teams": 2, "late-difference": 2,
                             "all-own": len(models), "not-contiguous": 2}[kind]
    if kind == "two-teams":
        assert which == [0, 1, 0, 1, 0]
    objects, which = batched_module._distinct([m[0] for m in models], by_value=False)
    assert len(objects) == len({id(m[0]) for m in models}) and all(objects[j] is m[0] for j, m in zip(which, models))


def test_converted_once_gives_the_same_tensors_for_the_same_arrays_only_inside():
    arrays, other = [np.ones((2, 3)), np.zeros(3)], [np.ones((2, 3)), np.zeros(3)]
    memo: dict = {}
    with converted_once(memo):
        first, again, different = to_tensors(arrays), to_tensors(arrays), to_tensors(other)
    with converted_once(memo):  # the same memo: still the same tensors
        later = to_tensors(arrays)
    assert all(a is b for a, b in zip(first, again, strict=True)) and first is not again
    assert all(a is b for a, b in zip(first, later, strict=True))
    assert not any(a is b for a, b in zip(first, different, strict=True))
    outside = to_tensors(arrays)
    assert not any(a is b for a, b in zip(first, outside, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, outside, strict=True))
    # the stacked starts of devices sent one model: one tensor broadcast, no comparison needed
    assert stack([first, later], torch.device("cpu"))[0].stride(0) == 0


# ---------------------------------------------------------------- evaluation
@pytest.mark.parametrize("model", [MCLR((6,), 3), DNN((6,), 3, hidden=5)], ids=["mclr", "dnn-vmap"])
@pytest.mark.parametrize("shared", [True, False], ids=["one-model", "own-models"])
def test_batched_evaluation_equals_each_devices_own(model, shared):
    torch.manual_seed(1)
    trainer = LocalTrainer(model)
    sizes = [7, 0, 31, 2, 12]  # an empty test split too
    xs = [torch.randn(n, 6) for n in sizes]
    ys = [torch.randint(0, 3, (n,)) for n in sizes]
    base = trainer.initial_params()
    models = [base if shared else [p + 0.3 * torch.randn_like(p) for p in base] for _ in sizes]
    got = evaluate_models(trainer, models, xs, ys, torch.device("cpu"), max_elements=40 * 6)  # several chunks
    for (loss, correct, n), m, x, y in zip(got, models, xs, ys, strict=True):
        want_loss, want_correct, want_n = trainer.evaluate(m, x, y)
        assert (correct, n) == (want_correct, want_n)
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-5)
    assert evaluate_models(trainer, models[:2], [xs[1]] * 2, [ys[1]] * 2, torch.device("cpu")) == [(0.0, 0, 0)] * 2


def test_a_long_test_set_is_not_the_padding_of_the_short_ones(monkeypatch):
    from hfl.accel import batched_eval

    torch.manual_seed(2)
    trainer = LocalTrainer(MCLR((6,), 3))
    sizes = [40, 3000, 25, 60]  # Synthetic's heavy tail: one set far longer than its team mates'
    xs = [torch.randn(n, 6) for n in sizes]
    ys = [torch.randint(0, 3, (n,)) for n in sizes]
    models = [[p + 0.3 * torch.randn_like(p) for p in trainer.initial_params()] for _ in sizes]
    assert batched_eval._chunks(sizes, 6, 2**23, split=True) == [[2, 0, 3], [1]]
    assert batched_eval._chunks(sizes, 6, 2**23, split=False) == [[2, 0, 3, 1]]  # a GPU: one chunk
    padded = []
    real = batched_eval.batched_log_probs(trainer)
    monkeypatch.setattr(batched_eval, "batched_log_probs",
                        lambda t: lambda params, x: padded.append(x.shape[0] * x.shape[1]) or real(params, x))
    got = evaluate_models(trainer, models, xs, ys, torch.device("cpu"))
    assert sum(padded) == 3 * 60 + 3000  # not 4 x 3000
    for (loss, correct, n), m, x, y in zip(got, models, xs, ys, strict=True):
        want_loss, want_correct, want_n = trainer.evaluate(m, x, y)
        assert (correct, n) == (want_correct, want_n)
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-5)


def test_the_sent_model_is_converted_once_for_the_devices_that_test_it_as_sent(monkeypatch):
    from clients.fedavg import FedAvgClient
    from clients.pfedbayes import PFedBayesClient
    from flwr.common import ndarrays_to_parameters

    from hfl.accel import batched_eval

    dev = _device(0, 5, 4)
    assert FedAvgClient(dev).tests_sent_model({"model": "global"})
    assert not FedAvgClient(dev).tests_sent_model({"model": "personal"})
    assert not PFedBayesClient(dev).tests_sent_model({"model": "global"})  # its own model_to_test: the means
    devices = [_device(i, 4 + i, 4) for i in range(3)]
    clients = {f"{i:06d}": FedAvgClient(d) for i, d in enumerate(devices)}
    proxies = {cid: type("Proxy", (), {"cid": cid})() for cid in clients}
    manager = type("Manager", (), {"all": lambda self: proxies})()
    seen = []
    real = batched_eval.evaluate_models
    monkeypatch.setattr(batched_eval, "evaluate_models", lambda trainer, models, *a, **k: seen.append(models) or real(trainer, models, *a, **k))
    model = [p.numpy() for p in devices[0].trainer.initial_params()]
    replies, _ = batched_eval.BatchedEvaluate(clients, proxies, torch.device("cpu"))(
        manager, ndarrays_to_parameters(model), {"model": "global"})
    assert len(seen) == 1 and all(m is seen[0][0] for m in seen[0])  # converted once, shared
    for (_, res), d in zip(replies, devices, strict=True):
        loss, correct, n = d.trainer.evaluate([torch.from_numpy(a) for a in model], d.x_test, d.y_test)
        assert (res.num_examples, res.metrics["correct"]) == (n, correct)
        assert res.loss == pytest.approx(loss / n, rel=1e-5)


# ---------------------------------------------------------------- plans
def _plans(devices: list[DeviceRuntime]) -> list[FitPlan]:
    plans = []
    for d in devices:
        start = [p + 0.01 * d.device_id for p in d.trainer.initial_params()]
        anchor = [p * 0.5 for p in start] if d.device_id % 2 else None
        plans.append(FitPlan([Phase(start, 7, 0.1 + 0.05 * d.device_id, anchor, 0.3), Phase(start, 3, 0.2)],
                             lambda models, losses: ([m.numpy() for m in models[0] + models[1]], 1, {"loss": losses[0]})))
    return plans


def _assert_same_replies(got: list, want: list, one: list[DeviceRuntime], many: list[DeviceRuntime]) -> None:
    """Batched replies equal per-device ones and the samplers end alike."""
    for (g_arrays, _, g_metrics), (w_arrays, _, w_metrics) in zip(got, want, strict=True):
        for g, w in zip(g_arrays, w_arrays, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        assert g_metrics["loss"] == pytest.approx(w_metrics["loss"], rel=1e-5)
    for a, b in zip(one, many, strict=True):
        assert a.sampler.pos == b.sampler.pos and torch.equal(a.sampler.perm, b.sampler.perm)


def test_batched_plans_equal_per_device_plans_and_leave_samplers_alike():
    torch.manual_seed(0)
    model = DNN((6,), 3, hidden=5)
    one = [_device(i, n, 4, model=model) for i, n in enumerate([9, 17, 4])]
    many = [_device(i, n, 4, model=model) for i, n in enumerate([9, 17, 4])]
    want = [run_plan(d, p) for d, p in zip(one, _plans(one), strict=True)]
    got = run_plans(many, _plans(many), ConcatenatedData(many, torch.device("cpu")))
    _assert_same_replies(got, want, one, many)


@pytest.mark.parametrize("dim", [6, 40], ids=["primal", "dual"])  # 40 features > every device's samples: dual form
def test_an_anchor_without_pull_is_stepped_as_no_anchor(monkeypatch, dim):
    """AL2GD's phases carry the received model as an anchor with prox 0: the batched path drops
    it (no anchor logits, no coefficient updates) and gets exactly the plain SGD models."""
    def plans(devices: list[DeviceRuntime], anchored: bool) -> list[FitPlan]:
        out = []
        for d in devices:
            start = [p + 0.01 * d.device_id for p in d.trainer.initial_params()]
            anchor = [p * 0.5 for p in start] if anchored else None
            out.append(FitPlan([Phase(start, 6, 0.1, anchor, 0.0)], lambda models, losses: ([m.numpy() for m in models[0]], 1, {})))
        return out

    anchors_seen = []

    def dual_steps(data, theta, anchor, *args):  # noqa: ANN001, ANN202
        anchors_seen.append(anchor)
        return mclr_dual.run_dual_steps(data, theta, anchor, *args)

    monkeypatch.setattr(batched_module, "run_dual_steps", dual_steps)
    results = []
    for anchored in (True, False):
        torch.manual_seed(0)  # the same initial models
        devices = [_device(i, n, 4, dim=dim) for i, n in enumerate([9, 17, 4])]
        results.append(run_plans(devices, plans(devices, anchored), ConcatenatedData(devices, torch.device("cpu"))))
    for (with_anchor, _, _), (without, _, _) in zip(*results, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(with_anchor, without, strict=True))
    assert anchors_seen == ([None, None] if dim == 40 else [])  # the dual form was never handed the anchor


@pytest.mark.parametrize("model", [MCLR((6,), 3), DNN((6,), 3, hidden=5)], ids=["mclr", "dnn"])
def test_width_buckets_equal_per_device_plans(monkeypatch, model):
    """Devices smaller than the batch size are padded only to the group's widest draw, and on the
    CPU a group splits by width (here forced: no fixed cost per bucket)."""
    monkeypatch.setattr(mclr_dual, "BUCKET_OVERHEAD_ROWS", 0)
    sizes = [2, 3, 17, 30, 5]  # batch 8: widths 2, 3, 8, 8, 5
    data_ = ConcatenatedData([_device(i, n, 8, model=model) for i, n in enumerate(sizes)], torch.device("cpu"))
    devices = [_device(i, n, 8, model=model) for i, n in enumerate(sizes)]
    assert batched_module.phase_buckets(data_, devices, batched_loss_and_grad(devices[0].trainer), 2) == [[0], [1], [4], [2, 3]]
    one = [_device(i, n, 8, model=model) for i, n in enumerate(sizes)]
    want = [run_plan(d, p) for d, p in zip(one, _plans(one), strict=True)]
    got = run_plans(devices, _plans(devices), ConcatenatedData(devices, torch.device("cpu")))
    _assert_same_replies(got, want, one, devices)


def test_batch_width_pads_small_devices_only_to_the_widest_draw():
    devices = [_device(0, 3, 8), _device(1, 5, 8)]
    assert batched_module.batch_width(devices) == 5
    index, weight = draw_batches(devices, [0, 3], steps=2, batch_size=batched_module.batch_width(devices))
    assert index.shape == (2, 2, 5)
    torch.testing.assert_close(weight[:, 0], torch.tensor([[1 / 3] * 3 + [0.0, 0.0]] * 2))  # every step: all 3
    torch.testing.assert_close(weight[:, 1], torch.full((2, 5), 0.2))
    assert sorted(index[0, 0, :3].tolist()) == [0, 1, 2] and sorted(index[1, 1].tolist()) == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("block_steps", [1, 3, 7])
def test_phase_steps_come_in_blocks_equal_to_one_step_at_a_time(monkeypatch, block_steps):
    from hfl.accel.closed_forms import nll_targets

    devices = [_device(i, 6 + i, 4, dim=5) for i in range(3)]
    data = ConcatenatedData(devices, torch.device("cpu"))
    index, weight = draw_batches(devices, [data.offset[d.device_id] for d in devices], steps=7, batch_size=4)
    labels, lr = data.y[index], torch.tensor([0.1, 0.2, 0.3])
    step_bytes = index[0].numel() * (5 + 2 * 3 + 1) * 4  # inputs and targets of 3 classes
    monkeypatch.setattr(batched_module, "GATHER_BYTES", block_steps * step_bytes)
    got = list(batched_module.phase_steps(data, index, labels, weight, lr, classes=3))
    assert len(got) == 7
    for s, (x, target) in enumerate(got):
        torch.testing.assert_close(x, batched_module.minibatch(data, index[s])[0], rtol=0, atol=0)
        for a, b in zip(target, nll_targets(labels[s:s + 1], weight[s:s + 1], 3, lr)[0], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    plain = list(batched_module.phase_steps(data, index, labels, weight, lr, classes=None))
    assert [t for _, t in plain] == [None] * 7 and all(torch.equal(x, g) for (x, _), (g, _) in zip(plain, got, strict=True))


def test_concatenated_data_is_kept_while_its_parts_live():
    cpu = torch.device("cpu")
    a, b = torch.arange(3.0), torch.arange(3.0, 5.0)
    first = batched_module.concatenated([a, b], cpu)
    assert torch.equal(first, torch.arange(5.0))
    assert batched_module.concatenated([a, b], cpu) is first  # the same parts: made once
    assert batched_module.concatenated([b, a], cpu) is not first
    c = torch.arange(3.0, 5.0) + 10  # another tensor with b's shape: another concatenation
    assert torch.equal(batched_module.concatenated([a, c], cpu), torch.tensor([0.0, 1, 2, 13, 14]))
    del b, first
    for i in range(50):  # new tensors, some may reuse a freed id: never a stale concatenation
        d = torch.full((2,), float(i))
        assert torch.equal(batched_module.concatenated([a, d], cpu), torch.tensor([0.0, 1, 2, i, i]))
    del d
    kept = [parts for parts, _, _ in batched_module._KEPT.values()]
    assert all(ref() is not None for refs in kept for ref in refs)  # entries die with their parts
    assert batched_module._KEPT_BYTES[0] == sum(size for _, _, size in batched_module._KEPT.values())
    assert all(size == out.nbytes for _, out, size in batched_module._KEPT.values() if isinstance(out, torch.Tensor))


def test_dual_data_is_kept_across_nodes_of_the_same_devices():
    devices = [_device(i, 5 + i, 4, dim=12) for i in range(3)]  # fewer samples than features: dual
    cpu = torch.device("cpu")
    first = ConcatenatedData(devices, cpu).dual(devices)
    assert first is not None and first.x.shape == (3, 7, 12)
    assert ConcatenatedData(devices, cpu).dual(devices) is first  # a node rebuilt for the next message
    assert ConcatenatedData(devices[:2], cpu).dual(devices[:2]) is not first


def test_concatenated_data_keeps_the_most_recent_within_its_budget(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(batched_module, "CONCAT_CACHE_BYTES", 2 * 4 * 1000)  # two of the entries below
    parts = [[torch.full((500,), float(i)), torch.full((500,), float(i))] for i in range(4)]
    made = [batched_module.concatenated(p, cpu) for p in parts]
    assert batched_module.concatenated(parts[3], cpu) is made[3]  # recent: kept
    again = batched_module.concatenated(parts[0], cpu)
    assert again is not made[0] and torch.equal(again, made[0])  # evicted: made again
    assert batched_module._KEPT_BYTES[0] <= 2 * 4 * 1000


# ---------------------------------------------------------------- device state in one file
def test_packed_device_states_round_trip_with_ragged_and_missing_fields():
    states = {
        4: {"sampler_perm": np.arange(7), "sampler_pos": np.array(3), "num_personal": np.array(2),
            "personal_0": np.ones((2, 3), np.float32), "personal_1": np.zeros(2, np.float32)},
        1: {"sampler_perm": np.arange(2), "sampler_pos": np.array(0), "num_personal": np.array(0)},
        9: {"sampler_perm": np.arange(0), "sampler_pos": np.array(5), "num_personal": np.array(2),
            "personal_0": np.full((4, 3), 2.0, np.float32), "personal_1": np.ones(4, np.float32),
            "extra_head": np.array([[1.5]])},
    }
    for i in states:  # a field every device has in one shape (unpacked with one reshape)
        states[i]["sampler_generator"] = np.arange(5, dtype=np.uint8) + i
    back = unpack_states(pack_states(states))
    assert sorted(back) == [1, 4, 9]
    for i, arrays in states.items():
        assert sorted(back[i]) == sorted(arrays)
        for name, value in arrays.items():
            np.testing.assert_array_equal(back[i][name], value)
            assert back[i][name].dtype == value.dtype and back[i][name].shape == value.shape
    with pytest.raises(ValueError, match="differs in rank"):
        pack_states({0: {"a": np.zeros(2)}, 1: {"a": np.zeros((2, 2))}})


# ---------------------------------------------------------------- which algorithms, and the switch
@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithm_batched_flag_matches_its_client(name):
    cfg = compose_cfg(f"algorithm={name}")
    module = load_module(cfg["algorithm"], "client")
    found = getattr(module, module.make_client.__annotations__["return"])
    assert issubclass(found, DeviceClient) and client_class(cfg["algorithm"]) is found
    plans = found.fit_plan is not DeviceClient.fit_plan and found.__name__ != "FedRepClient"
    assert found.batched == plans


def test_batched_on_is_refused_for_an_algorithm_without_the_path():
    with pytest.raises(ConfigError, match="runtime.batched"):
        run(compose_cfg(*SMALL, "algorithm=fedrep", "runtime=inprocess", "runtime.batched=on"), "/tmp/never-created")


# ---------------------------------------------------------------- whole runs: batched = per-device
# Overrides that give each algorithm something to batch: a hidden layer where it splits heads.
# Per-FedAvg and pFedBayes: the DNN here, MCLR in tests/test_regression.py (batched by default there).
EXTRA = {"fedper": ["model=dnn"], "perfedavg": ["model=dnn"], "pfedbayes": ["model=dnn"], "bhfl": ["topology=tree", "topology.fanout=[2,2,3]", "algorithm.sample_fraction=[1,0.5,0.67]"]}
BATCHED = [a for a in ALGORITHMS if batched_flag(a)]  # composed: perfedavg_hf inherits perfedavg's


def _run(tmp: Path, name: str, mode: str, extra: list[str]) -> Path:
    out = tmp / mode
    run(compose_cfg(*SMALL, f"algorithm={name}", "runtime=inprocess", f"runtime.batched={mode}", "dataset.batch_size=20",
                    *EXTRA.get(name, []), *extra), out)
    return out


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", BATCHED)
def test_batched_run_equals_per_device_run(tmp_path, monkeypatch, name):
    # a dropped device among batched ones
    extra = ["runtime.dropout=0.34", "algorithm.min_fit_fraction=0.6"] if name == "permfl" else []
    stepped: list[int] = []  # devices per batched call: proof the batched path ran

    def counted(devices, plans, data):  # noqa: ANN001, ANN202
        stepped.append(len(devices))
        return run_plans(devices, plans, data)

    monkeypatch.setattr(batched_module, "run_plans", counted)
    off = _run(tmp_path, name, "off", extra)
    assert not stepped
    on = _run(tmp_path, name, "on", extra)
    assert stepped and max(stepped) >= 2
    assert_same_run(on, off)


def assert_same_run(on: Path, off: Path) -> None:
    """Two runs' final global models agree within float tolerance and every metrics row matches."""
    with np.load(on / "checkpoints" / "global_model.npz") as a, np.load(off / "checkpoints" / "global_model.npz") as b:
        assert a.files == b.files
        for key in a.files:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-5, err_msg=key)
    for got, want in zip(_rows(on), _rows(off), strict=True):
        for key, value in want.items():
            if value is None or isinstance(value, str):
                assert got[key] == value, key
            elif key.endswith("_accuracy"):
                assert got[key] == pytest.approx(value, abs=1e-3), key  # at most a borderline sample flips
            elif key.endswith("_loss"):
                assert got[key] == pytest.approx(value, rel=1e-3), key
            elif key.startswith(("failures", "device_failures", "bytes_")):
                assert got[key] == value, key


# ---------------------------------------------------------------- the GPU path (skipped without one)
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch")
REAL_MNIST = Path(__file__).parents[1] / ".." / "shared" / "data"


def _on_cuda(monkeypatch) -> list[str]:  # noqa: ANN001
    """Records the compute device of every batched call: proof the GPU did the stepping."""
    seen: list[str] = []

    def recorded(devices, plans, data):  # noqa: ANN001, ANN202
        seen.append(data.device.type)
        return run_plans(devices, plans, data)

    monkeypatch.setattr(batched_module, "run_plans", recorded)
    return seen


@GPU
@pytest.mark.parametrize("name", BATCHED)
def test_batched_on_the_gpu_equals_per_device_on_the_cpu(tmp_path, monkeypatch, name):
    seen = _on_cuda(monkeypatch)
    off = _run(tmp_path, name, "off", ["runtime.device=cpu"])
    assert not seen
    on = _run(tmp_path, name, "on", ["runtime.device=cuda"])
    assert seen and set(seen) == {"cuda"}
    assert_same_run(on, off)


@GPU
def test_dual_form_on_the_gpu_equals_per_device_on_the_cpu(tmp_path, monkeypatch):
    dual: list[str] = []
    real = batched_module.run_dual_steps

    def counted(data, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        dual.append(data.gram.device.type)
        return real(data, *args, **kwargs)

    monkeypatch.setattr(batched_module, "run_dual_steps", counted)
    extra = ["dataset.num_features=300"]  # at most 225 samples a device: the dual form pays
    off = _run(tmp_path, "permfl", "off", [*extra, "runtime.device=cpu"])
    on = _run(tmp_path, "permfl", "on", [*extra, "runtime.device=cuda"])
    assert dual and set(dual) == {"cuda"}
    assert_same_run(on, off)


@pytest.mark.skipif(not (REAL_MNIST / "MNIST" / "raw").is_dir(), reason="shared MNIST test split absent")
def test_mnist_cnn_batched_equals_per_device_on_the_cpu(tmp_path, monkeypatch):
    # the grouped-convolution form (hfl.accel.grouped_cnn) through a whole PerMFL run, forced on the CPU
    stepped: list[int] = []
    real = grouped_cnn.cnn_batched_loss_and_grad

    def counted(params, *args):  # noqa: ANN001, ANN002, ANN202
        stepped.append(len(params[0]))
        return real(params, *args)

    monkeypatch.setattr(closed_forms, "cnn_batched_loss_and_grad", counted)
    runs = {}
    for mode in ("off", "on"):
        runs[mode] = tmp_path / mode
        run(compose_cfg("experiment=table1_mnist_cnn", "algorithm=permfl", f"dataset.root={REAL_MNIST}",
                        "topology.num_teams=2", "topology.devices_per_team=2", "global_rounds=2",
                        "eval_every=2", "algorithm.team_rounds=2", "algorithm.local_steps=3", "runtime=inprocess",
                        f"runtime.batched={mode}", "runtime.device=cpu"), runs[mode])
        assert bool(stepped) == (mode == "on")
    assert set(stepped) == {4}  # both teams' devices in each step (hfl.node.lockstep)
    assert_same_run(runs["on"], runs["off"])


@GPU
@pytest.mark.skipif(not (REAL_MNIST / "MNIST" / "raw").is_dir(), reason="shared MNIST test split absent")
def test_mnist_cnn_on_the_gpu_equals_per_device_on_the_cpu(tmp_path, monkeypatch):
    # the CNN's grouped convolutions (hfl.accel.grouped_cnn); TF32 off so the GPU's convolutions round as the CPU's
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    seen = _on_cuda(monkeypatch)
    runs = {}
    for mode, device in (("off", "cpu"), ("on", "cuda")):
        runs[mode] = tmp_path / mode
        run(compose_cfg("experiment=table1_mnist_cnn", "algorithm=permfl", f"dataset.root={REAL_MNIST}",
                        "topology.num_teams=2", "topology.devices_per_team=2",
                        "global_rounds=2", "algorithm.team_rounds=2", "algorithm.local_steps=3", "runtime=inprocess",
                        f"runtime.batched={mode}", f"runtime.device={device}"), runs[mode])
    assert seen and set(seen) == {"cuda"}
    assert_same_run(runs["on"], runs["off"])


@GPU
def test_ray_team_actors_share_the_gpu(tmp_path):
    """The default Ray simulation with two team actors on half a GPU each: the same models as
    the per-device path in process on the CPU (a team actor that could not see the GPU fails
    at its first batched step)."""
    off = _run(tmp_path, "permfl", "off", ["runtime.device=cpu"])
    on = tmp_path / "ray"
    run(compose_cfg(*SMALL, "algorithm=permfl", "runtime=simulation", "runtime.batched=on", "dataset.batch_size=20",
                    "runtime.device=cuda", "runtime.num_gpus_per_team=0.5"), on)
    assert_same_run(on, off)


def test_runtime_device_cuda_is_refused_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="runtime.device"):
        run(compose_cfg(*SMALL, "runtime=inprocess", "runtime.device=cuda"), tmp_path)


def test_auto_batches_where_it_pays():
    from hfl.accel.batched import batching_pays
    from hfl.models import MLP

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert batching_pays(MCLR((784,), 10), cpu)  # closed form, even at MNIST's size
    assert batching_pays(DNN((60,), 10), cpu)  # 1,430 parameters: Python overhead dominates
    assert not batching_pays(CNN((1, 28, 28), 10), cpu)  # vmap'd convolutions: slower on the CPU
    assert not batching_pays(MLP((784,), 10), cpu)
    assert batching_pays(CNN((1, 28, 28), 10), gpu)


@pytest.mark.parametrize("dim", [40, 6], ids=["dual", "primal"])
def test_group_threads_step_groups_at_once_with_the_same_models(monkeypatch, dim):
    """runtime.batched_threads=2: two of a phase's size groups step at the same time (a barrier
    only two concurrent groups pass), and every model, loss and sampler equals one group at a
    time, bit for bit, then the per-device path within float tolerance."""
    monkeypatch.setattr(mclr_dual, "COST_PER_STEP", 0.0)  # free splits: every size its own group
    monkeypatch.setattr(mclr_dual, "BUCKET_OVERHEAD_ROWS", 0)
    sizes = [9, 30, 3, 17, 5]  # batch 8: widths 8, 8, 3, 8, 5 (the primal groups split by width)
    real = batched_module._step_together
    met = threading.Barrier(2, timeout=20)
    threads, calls = set(), []

    def together(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        threads.add(threading.get_ident())
        calls.append(1)
        if len(calls) <= 2:  # the first two groups
            met.wait()  # raises BrokenBarrierError unless the other is stepping meanwhile
        return real(*args, **kwargs)

    results = []
    for count in (1, 2):
        batched_module.set_group_threads(count)
        try:
            if count == 2:
                monkeypatch.setattr(batched_module, "_step_together", together)
            torch.manual_seed(0)  # the same initial models
            devices = [_device(i, n, 8, dim=dim) for i, n in enumerate(sizes)]
            results.append((devices, run_plans(devices, _plans(devices), ConcatenatedData(devices, torch.device("cpu")))))
        finally:
            batched_module.set_group_threads(1)
    assert len(threads) == 2 and not met.broken  # both threads stepped groups at once
    (one_at_a_time, first), (at_once, second) = results
    for (a_arrays, _, a_metrics), (b_arrays, _, b_metrics) in zip(first, second, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(a_arrays, b_arrays, strict=True))
        assert a_metrics["loss"] == b_metrics["loss"]
    torch.manual_seed(0)
    one = [_device(i, n, 8, dim=dim) for i, n in enumerate(sizes)]
    want = [run_plan(d, p) for d, p in zip(one, _plans(one), strict=True)]
    _assert_same_replies(second, want, one, at_once)
    assert all(a.sampler.pos == b.sampler.pos for a, b in zip(one_at_a_time, at_once, strict=True))


def test_group_threads_refuse_less_than_one():
    with pytest.raises(ValueError, match="at least 1"):
        batched_module.set_group_threads(0)


def test_a_runtime_sets_torch_threads_and_group_threads_together():
    before = torch.get_num_threads()
    try:
        batched_module.use_runtime_threads({"torch_threads": 1, "batched_threads": 3})
        assert (torch.get_num_threads(), batched_module._GroupThreads.count) == (1, 3)
        batched_module.use_runtime_threads({"torch_threads": 1})  # a hand-written runtime without the key
        assert batched_module._GroupThreads.count == 1
    finally:
        batched_module.set_group_threads(1)
        torch.set_num_threads(before)
