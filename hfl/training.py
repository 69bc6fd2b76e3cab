"""Lean local training shared by every device client: minibatch sampling, gradients, evaluation.

The hot loop avoids nn.Module/optimizer/DataLoader overhead (measured 2.5x slower for the
MCLR reference, see ../shared/notes/flower-and-environment.md): parameters are plain
tensors, gradients come from a closed form where the model has one, else from autograd
through ``torch.func.functional_call``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from hfl.errors import ConfigError
from hfl.models import FAST_GRADIENTS

Params = list[torch.Tensor]


def to_tensors(arrays: Sequence[np.ndarray]) -> Params:
    """Copy NumPy arrays (e.g. from a Flower message) into float32 tensors."""
    return [torch.tensor(np.asarray(a), dtype=torch.float32) for a in arrays]


def to_ndarrays(params: Sequence[torch.Tensor]) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in params]


class BatchSampler:
    """Cycles through shuffled epochs of a device's training set, one minibatch per call.

    Like the authors' code (an epoch iterator restarted on exhaustion): the last batch of an
    epoch may be short. Its state survives global rounds through ``state()``/``restore()``.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int) -> None:
        if num_samples < 1 or batch_size < 1:
            raise ValueError(f"need num_samples >= 1 and batch_size >= 1, got {num_samples}, {batch_size}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.perm = torch.empty(0, dtype=torch.int64)
        self.pos = 0

    def next(self) -> torch.Tensor:
        if self.pos >= len(self.perm):
            self.perm = torch.randperm(self.num_samples, generator=self.generator)
            self.pos = 0
        batch = self.perm[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return batch

    def state(self) -> dict[str, np.ndarray]:
        return {
            "perm": self.perm.numpy().copy(),
            "pos": np.array(self.pos),
            "generator": self.generator.get_state().numpy().copy(),
        }

    def restore(self, state: dict[str, np.ndarray]) -> None:
        self.perm = torch.from_numpy(np.array(state["perm"], dtype=np.int64))
        self.pos = int(state["pos"])
        self.generator.set_state(torch.from_numpy(np.array(state["generator"], dtype=np.uint8)))


class LocalTrainer:
    """Loss, gradient and evaluation of one model architecture over explicit parameters."""

    def __init__(self, model: nn.Module) -> None:
        if any(True for _ in model.buffers()):
            # Buffers (BatchNorm running statistics) would live in the one module every device
            # shares, updated in place and never sent, averaged or saved: refuse, do not train wrong.
            raise ConfigError("model.name", f"{type(model).__name__} keeps buffers (BatchNorm running statistics), "
                                            "which hfl's functional trainer does not carry yet; it can be built "
                                            "and inspected but not trained")
        self.model = model
        self.names = [name for name, _ in model.named_parameters()]
        self.fast_gradient = FAST_GRADIENTS.get(type(model))

    def initial_params(self) -> Params:
        return [p.detach().clone() for p in self.model.parameters()]

    def loss_and_grad(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Params]:
        if self.fast_gradient is not None:
            return self.fast_gradient(params, x, y)
        leaves = [p.detach().requires_grad_(True) for p in params]
        out = functional_call(self.model, dict(zip(self.names, leaves, strict=True)), (x,))
        loss = F.nll_loss(out, y)
        return loss.detach(), list(torch.autograd.grad(loss, leaves))

    @torch.no_grad()
    def evaluate(self, params: Params, x: torch.Tensor, y: torch.Tensor, chunk: int = 2048) -> tuple[float, int, int]:
        """Summed NLL loss, number correct and number of samples."""
        loss_sum, correct = 0.0, 0
        state = dict(zip(self.names, params, strict=True))
        for start in range(0, len(y), chunk):
            out = functional_call(self.model, state, (x[start : start + chunk],))
            target = y[start : start + chunk]
            loss_sum += float(F.nll_loss(out, target, reduction="sum"))
            correct += int((out.argmax(1) == target).sum())
        return loss_sum, correct, len(y)


def run_local_steps(
    trainer: LocalTrainer,
    start: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    sampler: BatchSampler,
    steps: int,
    update: Callable[[Params, Params], Params],
) -> tuple[Params, float]:
    """``steps`` minibatch updates ``params <- update(params, grad)``; returns params and mean loss."""
    params = [p.clone() for p in start]
    total = 0.0
    for _ in range(steps):
        idx = sampler.next()
        loss, grads = trainer.loss_and_grad(params, x.index_select(0, idx), y.index_select(0, idx))
        params = update(params, grads)
        total += float(loss)
    return params, total / max(steps, 1)
