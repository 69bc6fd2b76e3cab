"""The per-device path's faster CPU forms compute the same bits as the expressions and layers they
replace: max-pooling through the channels-last kernel (hfl.device.cpu_kernels) and the prox-SGD
update made in place (hfl.device.plan.prox_update)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from hfl.device import plan, training
from hfl.device.cpu_kernels import CpuMaxPool2d, fast_cpu_layers
from hfl.device.plan import prox_update
from hfl.device.training import BatchSampler, LocalTrainer, run_local_steps
from hfl.models import CNN
from hfl.runtime.simulate import run
from tests.conftest import SMALL, compose_cfg
from tests.regression.record import results

POOLS = [
    dict(kernel_size=2, stride=1),                       # hfl's MNIST CNN
    dict(kernel_size=2),                                 # stride = kernel
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=(2, 3), stride=(1, 2), dilation=2),
    dict(kernel_size=3, stride=2, ceil_mode=True),
]


def tied_batch(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """ReLU outputs on a coarse grid: many exact zeros and equal values, where a pool's tie rule
    decides which input gets the gradient."""
    g = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randint(-3, 4, shape, generator=g).float() / 2)


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("shape", [(10, 16, 27, 27), (1, 1, 9, 7), (3, 5, 8, 8)])
def test_pool_forward_and_gradient_are_bitwise_the_plain_layers(pool, shape):
    x = tied_batch(shape, seed=sum(shape))
    upstream = torch.randn(nn.MaxPool2d(**pool)(x).shape, generator=torch.Generator().manual_seed(1))
    results = []
    for layer in (nn.MaxPool2d(**pool), CpuMaxPool2d(**pool)):
        leaf = x.clone().requires_grad_(True)
        out = layer(leaf)
        (grad,) = torch.autograd.grad(out, leaf, upstream)
        results.append((out, grad))
    (out_a, grad_a), (out_b, grad_b) = results
    assert out_b.is_contiguous() and grad_b.is_contiguous()
    assert torch.equal(out_a, out_b)
    assert torch.equal(grad_a, grad_b)
    assert float(grad_a.abs().sum()) > 0  # the gradient reached the input


def test_pool_passes_nan_as_the_plain_layer():
    x = tied_batch((2, 3, 6, 6), seed=3)
    x[0, 1, 2, 3] = float("nan")
    want, got = nn.MaxPool2d(2, 1)(x), CpuMaxPool2d(2, 1)(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert int(torch.isnan(got).sum()) == 4  # every window holding the NaN


def test_pool_of_a_channels_last_or_3d_input_is_the_parents():
    x = tied_batch((2, 4, 6, 6), seed=4)
    assert torch.equal(CpuMaxPool2d(2, 1)(x.contiguous(memory_format=torch.channels_last)), F.max_pool2d(x, 2, 1))
    assert torch.equal(CpuMaxPool2d(2, 1)(x[0]), F.max_pool2d(x[0], 2, 1))


def test_a_second_derivative_is_refused_not_wrong():
    leaf = tied_batch((1, 2, 5, 5), seed=5).requires_grad_(True)
    (grad,) = torch.autograd.grad(CpuMaxPool2d(2, 1)(leaf).pow(2).sum(), leaf, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        grad.sum().backward()


def test_fast_cpu_layers_swaps_only_plain_pools_in_a_copy():
    model = CNN((1, 28, 28), 10)
    fast = fast_cpu_layers(model)
    assert fast is not model and type(fast) is CNN
    assert [type(m) for m in model.features] == [nn.Conv2d, nn.ReLU, nn.MaxPool2d] * 2  # the original is untouched
    assert [type(m).__name__ for m in fast.features if isinstance(m, nn.MaxPool2d)] == ["CpuMaxPool2d"] * 2
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fast.state_dict().values(), strict=True))
    no_pool = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    assert fast_cpu_layers(no_pool) is no_pool
    with_indices = nn.Sequential(nn.MaxPool2d(2, return_indices=True))
    assert fast_cpu_layers(with_indices) is with_indices


def test_the_trainers_cnn_gradient_is_the_plain_modules():
    torch.manual_seed(0)
    model = CNN((1, 28, 28), 10)
    trainer = LocalTrainer(model)
    params = trainer.initial_params()
    x, y = tied_batch((10, 1, 28, 28), seed=6), torch.randint(0, 10, (10,))
    loss, grads = trainer.loss_and_grad(params, x, y)
    leaves = [p.detach().requires_grad_(True) for p in params]
    ref_loss = F.nll_loss(functional_call(model, dict(zip(trainer.names, leaves, strict=True)), (x,)), y)
    ref_grads = torch.autograd.grad(ref_loss, leaves)
    assert torch.equal(loss, ref_loss.detach())
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def reference_update(lr: float, prox: float, anchor):
    """The expressions the per-device step always evaluated, out of place."""
    if anchor is None:
        return lambda p, g: [t - lr * gr for t, gr in zip(p, g, strict=True)]
    return lambda p, g: [t - lr * gr - lr * prox * (t - a) for t, gr, a in zip(p, g, anchor, strict=True)]


class SmallBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2, 1)
        self.fc = nn.Linear(4 * 6 * 6, 3)  # 9 -> 7 (conv) -> 6 (pool)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.fc(self.pool(torch.relu(self.bn(self.conv(x)))).flatten(1)), dim=1)


@pytest.mark.parametrize("make", [lambda: CNN((1, 9, 9), 10), SmallBN], ids=["cnn", "batchnorm"])
@pytest.mark.parametrize("prox", [None, 0.3])
def test_in_place_prox_update_is_bitwise_the_expression(make, prox):
    torch.manual_seed(1)
    trainer = LocalTrainer(make())
    start = trainer.initial_params()
    anchor = None if prox is None else [p + 0.01 * torch.randn_like(p) for p in start]
    x = tied_batch((30, 1, 9, 9), seed=7)
    y = torch.randint(0, 3, (30,))
    kept = [copy.deepcopy(start), copy.deepcopy(anchor)]
    runs = []
    for update in (reference_update(0.05, prox or 0.0, anchor), prox_update(0.05, prox or 0.0, anchor)):
        runs.append(run_local_steps(trainer, start, x, y, BatchSampler(30, 8, seed=2), 9, update))
    (want, want_loss), (got, got_loss) = runs
    assert got_loss == want_loss
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(got, start, strict=True))  # it trained
    assert all(torch.equal(a, b) for a, b in zip(start, kept[0], strict=True))  # the caller's start untouched
    if anchor is not None:
        assert all(torch.equal(a, b) for a, b in zip(anchor, kept[1], strict=True))


MNIST_ROOT = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.mark.skipif(not (MNIST_ROOT / "MNIST").exists(), reason="needs ../shared/data/MNIST")
@pytest.mark.parametrize("algorithm", ["fedprox", "pfedme"])
def test_a_cnn_run_is_bitwise_the_one_with_the_plain_layers_and_expressions(algorithm, tmp_path, monkeypatch):
    """A whole run on the per-device path (anchors, pFedMe's inner steps and pull, models shared
    between devices by ``converted_once``) ends with the same bits as with the plain pools and
    the out-of-place expressions."""
    cfg = compose_cfg(*SMALL[:2], "global_rounds=2", "algorithm.team_rounds=1", "algorithm.local_steps=3",
                      f"algorithm={algorithm}", "runtime=inprocess", "runtime.batched=off", "runtime.torch_threads=1",
                      "dataset=mnist", f"dataset.root={MNIST_ROOT}", "dataset.batch_size=10", "model=cnn",
                      "model.hidden=8", "seed=0")
    run(cfg, tmp_path / "fast")
    monkeypatch.setattr(plan, "prox_update", reference_update)
    monkeypatch.setattr(training, "fast_cpu_layers", lambda model: model)
    run(cfg, tmp_path / "plain")
    models = [results(tmp_path / name) for name in ("fast", "plain")]
    assert sorted(models[0]) == sorted(models[1])
    for name, want in models[1].items():
        np.testing.assert_array_equal(models[0][name], want, err_msg=name)


@pytest.mark.parametrize("prox", [0.0, 0.3])
def test_shared_or_broadcast_gradients_are_not_overwritten(prox):
    """Autograd may hand two parameters one tensor (or a broadcast one): the update then works in
    a scratch tensor, so each parameter still takes its own ``lr * g`` and the gradients stay."""
    shared = torch.randn(3, 4)
    broadcast = torch.randn(4).expand(3, 4)
    own = torch.randn(3, 4)
    grads = [shared, shared, broadcast, own]
    params = [torch.randn(3, 4) for _ in grads]
    anchor = [torch.randn(3, 4) for _ in grads] if prox else None
    want = reference_update(0.1, prox, anchor)(params, grads)
    kept = [g.clone() for g in grads[:3]]
    got = prox_update(0.1, prox, anchor)([p.clone() for p in params], grads)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads[:3], kept, strict=True))
    assert plan.overwritable(grads) == [False, False, False, True]
