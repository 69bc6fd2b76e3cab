"""hfl.device.scripted: the dual form's step loop run as TorchScript gives the same floats as the plain
Python function (every branch), the samplers' scripted permutations the same draws as randperm
called one by one, and a function TorchScript cannot take falls back to Python."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from hfl.accel import mclr_dual

from hfl.device import training
from hfl.device.scripted import Scripted, scripted

D, C, F, N, B, STEPS = 3, 4, 12, 7, 5, 6


def _dual_case(anchor: str, inner_steps: int, pulled: bool) -> tuple:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(D, N, F, generator=g)
    x[2, 5:] = 0.0  # a device with 5 rows, padded to 7
    gram = torch.bmm(x, x.transpose(1, 2)) + 1.0
    gram[2, 5:], gram[2, :, 5:] = 0.0, 0.0
    theta = [0.3 * torch.randn(D, C, F, generator=g), 0.3 * torch.randn(D, C, generator=g)]
    anchors = {"none": None, "start": theta, "other": [t + 0.1 for t in theta]}
    local = torch.randint(0, 5, (STEPS, D, B), generator=g)
    weight = torch.rand(STEPS, D, B, generator=g)
    weight[-1, :, 3:] = 0.0  # a short last batch
    y = torch.randint(0, C, (STEPS, D, B), generator=g)
    lr = torch.tensor([0.1, 0.05, 0.2])
    return (mclr_dual.DualData(x, gram), theta, anchors[anchor], local, weight, y, lr,
            torch.tensor([0.03, 0.01, 0.05]), torch.tensor([0.1, 0.2, 0.3]) if pulled else None, inner_steps)


@pytest.mark.parametrize(("anchor", "inner_steps", "pulled"),
                         [("none", 1, False), ("start", 1, False), ("other", 1, False), ("other", 3, True),
                          ("start", 2, True)])
def test_scripted_dual_steps_equal_the_python_loop(monkeypatch, anchor, inner_steps, pulled):
    assert isinstance(mclr_dual._step_loop.compiled(), torch.jit.ScriptFunction)  # the fast path is live
    got = mclr_dual.run_dual_steps(*_dual_case(anchor, inner_steps, pulled))
    monkeypatch.setattr(mclr_dual._step_loop, "_compiled", mclr_dual._step_loop.python)
    want = mclr_dual.run_dual_steps(*_dual_case(anchor, inner_steps, pulled))
    assert (got[1] is None) == (want[1] is None) == (not pulled)
    for a, b in zip([*got[0], *(got[1] or []), got[2]], [*want[0], *(want[1] or []), want[2]], strict=True):
        assert torch.equal(a, b)  # the same operations in the same order: the same floats
    assert not torch.equal(got[0][0], _dual_case(anchor, inner_steps, pulled)[1][0])  # it stepped


@pytest.mark.parametrize("n", [1, 2, 50])
def test_scripted_permutations_are_randperm_called_one_by_one(n):
    assert isinstance(training._permutations.compiled(), torch.jit.ScriptFunction)
    scripted_gen, plain_gen = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    got = training._permutations(n, 7, scripted_gen)
    want = torch.stack([torch.randperm(n, generator=plain_gen) for _ in range(7)])
    assert torch.equal(got, want)
    assert torch.equal(scripted_gen.get_state(), plain_gen.get_state())  # the stream goes on alike


def test_a_function_torchscript_cannot_take_runs_in_python(caplog):
    @scripted
    def total(x: torch.Tensor) -> torch.Tensor:  # NumPy inside: not TorchScript
        return torch.as_tensor(np.sum(x.numpy()) + 1.0)

    with caplog.at_level(logging.WARNING, logger="hfl.device.scripted"):
        out = total(torch.ones(2))
        assert float(total(torch.zeros(3))) == 1.0
    assert float(out) == 3.0
    assert total.compiled() is total.python
    assert sum("TorchScript unavailable for total" in r.message for r in caplog.records) == 1  # logged once


def test_no_torchscript_at_all_runs_in_python(monkeypatch):
    def gone(fn):  # noqa: ANN001, ANN202 - as a PyTorch without torch.jit.script
        raise AttributeError("module 'torch.jit' has no attribute 'script'")

    monkeypatch.setattr(torch.jit, "script", gone)
    want = mclr_dual.run_dual_steps(*_dual_case("start", 1, False))
    loop = Scripted(mclr_dual._step_loop.python)
    monkeypatch.setattr(mclr_dual, "_step_loop", loop)
    got = mclr_dual.run_dual_steps(*_dual_case("start", 1, False))
    assert loop.compiled() is loop.python
    for a, b in zip([*got[0], got[2]], [*want[0], want[2]], strict=True):
        assert torch.equal(a, b)
