"""Lean local training shared by every device client: minibatch sampling, gradients, evaluation.

The hot loop avoids nn.Module/optimizer/DataLoader overhead (measured 2.5x slower for the
MCLR reference, see ../shared/notes/flower-and-environment.md): parameters are plain
tensors, gradients come from a closed form where the model has one, else from autograd
through ``torch.func.functional_call``. A model's BatchNorm running statistics are plain
tensors of the same list (``LocalTrainer.buffer_mask``), updated by training forward passes.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from hfl.errors import ConfigError
from hfl.models import FAST_GRADIENTS
from hfl.device.cpu_kernels import fast_cpu_layers
from hfl.device.scripted import scripted

Params = list[torch.Tensor]


def to_tensors(arrays: Sequence[np.ndarray]) -> Params:
    """Copy NumPy arrays (e.g. from a Flower message) into float32 tensors. Inside
    ``converted_once``, the same ``arrays`` object gives the same tensors again."""
    memo = getattr(_CONVERTED, "memo", None)
    seen = memo.get(id(arrays)) if memo is not None else None
    if seen is not None and seen[0] is arrays:
        return list(seen[1])
    out = []
    for a in arrays:
        a = np.ascontiguousarray(a, dtype=np.float32)
        # from_numpy + clone: half the per-call cost of torch.tensor (a node converts every round
        # the same model for each of its devices); torch.tensor for read-only buffers
        out.append(torch.from_numpy(a).clone() if a.flags.writeable else torch.tensor(a))
    if memo is not None:
        memo[id(arrays)] = (arrays, out)  # the arrays kept alive: their id is not reused meanwhile
    return list(out)


_CONVERTED = threading.local()


@contextmanager
def converted_once(memo: dict | None = None) -> Iterator[None]:
    """Within it (in this thread), ``to_tensors`` converts each arrays object once (remembered in
    ``memo``, which may be passed again to a later block): the devices a node sends one model get
    the same tensors, which the batched path then sends to its device once (``hfl.accel.batched.stack``)
    instead of comparing and copying D models. The tensors are shared, so whoever holds them must
    not change them in place (the batched path and ``run_local_steps`` never do)."""
    outer = getattr(_CONVERTED, "memo", None)
    _CONVERTED.memo = {} if memo is None else memo
    try:
        yield
    finally:
        _CONVERTED.memo = outer


def to_ndarrays(params: Sequence[torch.Tensor]) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in params]


@scripted  # half the dispatch cost of a Python loop, and the GIL free for the other size groups
def _permutations(n: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` successive ``torch.randperm(n, generator=generator)``, a row each."""
    out = torch.empty(count, n, dtype=torch.int64)
    for i in range(count):
        torch.randperm(n, generator=generator, out=out[i])
    return out


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
        # The current epoch's order, in NumPy: the batched path slices it once per epoch crossed,
        # and NumPy slices small rows ~5x cheaper than torch (``perm`` is the same memory).
        self._order = np.empty(0, dtype=np.int64)
        self.pos = 0

    @property
    def perm(self) -> torch.Tensor:
        """The current epoch's permutation of the samples."""
        return torch.from_numpy(self._order)

    def _epoch(self) -> np.ndarray:
        """The current epoch's samples not yet drawn (a new shuffled epoch when none are left)."""
        if self.pos >= len(self._order):
            self._order = torch.randperm(self.num_samples, generator=self.generator).numpy()
            self.pos = 0
        return self._order[self.pos :]

    def next(self) -> torch.Tensor:
        batch = torch.from_numpy(self._epoch()[: self.batch_size])
        self.pos += self.batch_size
        return batch

    def take(self, steps: int) -> np.ndarray:
        """``steps`` calls of ``next()`` as one ``[steps, min(batch_size, num_samples)]`` block, a short batch (an
        epoch's last) padded with -1: the current epoch's rest, then every new epoch the calls
        reach drawn in one go (``_permutations``, the same draws as one ``randperm`` an epoch) and
        laid out a padded row of batches each (the batched path, hfl.accel.batched). The sampler ends
        where the ``steps`` calls leave it."""
        size, n = self.batch_size, self.num_samples
        # A batch never holds more than the device's samples (next() draws them all then), so the
        # block is at most n wide: a huge batch_size must not allocate steps x batch_size.
        width = min(size, n)
        out = np.full((steps, width), -1, dtype=np.int64)
        taken = 0
        if steps and self.pos < len(self._order):
            rest = self._order[self.pos :]
            taken = min(steps, -(-len(rest) // size))
            block = rest[: taken * size]
            out.reshape(-1)[: len(block)] = block
            self.pos += taken * size
        if taken < steps:
            per_epoch = -(-n // size)  # calls an epoch serves, its last maybe short
            epochs = -(-(steps - taken) // per_epoch)
            perms = _permutations(n, epochs, self.generator).numpy()
            laid = np.full((epochs, per_epoch * width), -1, dtype=np.int64)
            laid[:, :n] = perms
            out[taken:] = laid.reshape(epochs * per_epoch, width)[: steps - taken]
            self._order = perms[-1].copy()
            self.pos = (steps - taken - (epochs - 1) * per_epoch) * size
        return out

    def state(self) -> dict[str, np.ndarray]:
        return {
            "perm": self._order.copy(),
            "pos": np.array(self.pos),
            "generator": self.generator.get_state().numpy().copy(),
        }

    def restore(self, state: dict[str, np.ndarray]) -> None:
        self._order = np.array(state["perm"], dtype=np.int64)
        self.pos = int(state["pos"])
        self.generator.set_state(torch.from_numpy(np.array(state["generator"], dtype=np.uint8)))


class LocalTrainer:
    """Loss, gradient and evaluation of one model architecture over explicit tensors.

    The tensors (what ``initial_params`` returns, devices send and servers average) are the
    model's ``state_dict()`` entries in its order: every parameter and every floating-point
    buffer, i.e. BatchNorm's ``running_mean`` and ``running_var`` next to its weight and bias.
    Averaging these lists is therefore averaging state_dicts (what the FeMAM authors' FedAvg
    does). For a model without buffers the list is ``model.parameters()``, as before.
    ``buffer_mask`` marks the buffers: they get no gradient; in a training step BatchNorm uses
    batch statistics and its forward pass updates the running ones (PyTorch's momentum rule),
    and ``run_local_steps`` writes them over whatever the update rule made of those entries.
    Evaluation uses the running statistics and changes nothing.

    BatchNorm's integer ``num_batches_tracked`` is dropped: it is read only when momentum is
    None (a cumulative average, refused here), so it changes no output, and a mean of counters
    means nothing.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names, self.buffer_mask, self.dropped = state_layout(model)
        self.has_buffers = any(self.buffer_mask)
        self.fast_gradient = FAST_GRADIENTS.get(type(model))
        # One device's forward and backward passes run on its CPU kernels for small batches (the
        # same bits); ``model`` itself stays as built for the batched path's torch.func transforms.
        self.step_model = fast_cpu_layers(model)
        # BatchNorm's mode lives in the module: a copy in eval mode serves evaluation, so the
        # training module never switches modes (and stays safe to share between devices).
        self.eval_model = copy.deepcopy(self.step_model).eval() if self.has_buffers else self.step_model
        if self.has_buffers:
            model.train()
            self.step_model.train()

    def initial_params(self) -> Params:
        state = self.model.state_dict(keep_vars=True)
        return [state[name].detach().clone() for name in self.names]

    # ------------------------------------------------------------ forward passes
    def outputs(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        """The model's outputs at ``params``; BatchNorm normalises with the running statistics."""
        return functional_call(self.eval_model, dict(zip(self.names, params, strict=True)), (x,))

    def train_outputs(self, params: Params, x: torch.Tensor) -> tuple[torch.Tensor, Params]:
        """The outputs of a training step (BatchNorm on the batch's statistics) and the buffers'
        new values (the running statistics after this batch), in ``buffer_mask`` order.
        ``params`` is not modified: BatchNorm updates copies of its buffers in place."""
        state = dict(zip(self.names, params, strict=True))
        buffers = [name for name, is_buffer in zip(self.names, self.buffer_mask, strict=True) if is_buffer]
        state.update({name: state[name].clone() for name in buffers})
        # throwaway counters: the shared module's own must not count every device's batches
        state.update({name: torch.zeros((), dtype=torch.long) for name in self.dropped})
        out = functional_call(self.step_model, state, (x,))
        return out, [state[name] for name in buffers]

    def with_buffers(self, params: Params, buffers: Params) -> Params:
        """``params`` with its buffer entries replaced by ``buffers`` (in ``buffer_mask`` order)."""
        new = iter(buffers)
        out = [next(new) if is_buffer else p for p, is_buffer in zip(params, self.buffer_mask, strict=True)]
        if next(new, None) is not None:
            raise ValueError("more buffers than the model has")
        return out

    # ------------------------------------------------------------ training
    def loss_and_grad(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Params]:
        if self.has_buffers:
            # A caller stepping the model itself would leave BatchNorm's statistics where they
            # started (and evaluate with them): refuse rather than train wrong.
            raise ConfigError("model.name", f"{type(self.model).__name__} keeps BatchNorm running statistics, "
                                            "which only hfl.device.training.run_local_steps (and FeMAM's device) update; "
                                            "this algorithm steps models by itself: use a model without BatchNorm")
        if self.fast_gradient is not None:
            return self.fast_gradient(params, x, y)
        leaves = [p.detach().requires_grad_(True) for p in params]
        out = functional_call(self.step_model, dict(zip(self.names, leaves, strict=True)), (x,))
        loss = F.nll_loss(out, y)
        return loss.detach(), list(torch.autograd.grad(loss, leaves))

    def loss_grad_and_buffers(
        self, params: Params, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, Params, Params]:
        """Mean NLL of a training step, its gradient (zeros at buffer entries: they are not
        parameters) and the buffers' new values (``train_outputs``)."""
        leaves = [p if is_buffer else p.detach().requires_grad_(True)
                  for p, is_buffer in zip(params, self.buffer_mask, strict=True)]
        out, buffers = self.train_outputs(leaves, x)
        loss = F.nll_loss(out, y)
        trainable = [p for p, is_buffer in zip(leaves, self.buffer_mask, strict=True) if not is_buffer]
        grads = iter(torch.autograd.grad(loss, trainable))
        full = [torch.zeros_like(p) if is_buffer else next(grads)
                for p, is_buffer in zip(params, self.buffer_mask, strict=True)]
        return loss.detach(), full, buffers

    @torch.no_grad()
    def evaluate(self, params: Params, x: torch.Tensor, y: torch.Tensor, chunk: int = 2048) -> tuple[float, int, int]:
        """Summed NLL loss, number correct and number of samples (BatchNorm in eval mode)."""
        loss_sum, correct = 0.0, 0
        for start in range(0, len(y), chunk):
            out = self.outputs(params, x[start : start + chunk])
            target = y[start : start + chunk]
            loss_sum += float(F.nll_loss(out, target, reduction="sum"))
            correct += int((out.argmax(1) == target).sum())
        return loss_sum, correct, len(y)


def state_layout(model: nn.Module) -> tuple[list[str], list[bool], list[str]]:
    """The state_dict entries hfl carries (in state_dict order), which of them are buffers, and
    the buffers it drops (BatchNorm's ``num_batches_tracked``); refuses what it cannot carry."""
    parameters = {name for name, _ in model.named_parameters()}
    names, mask, dropped = [], [], []
    for name, value in model.state_dict(keep_vars=True).items():
        if name in parameters or value.is_floating_point():
            names.append(name)
            mask.append(name not in parameters)
        elif name.endswith("num_batches_tracked"):
            dropped.append(name)
        else:
            raise ConfigError("model.name", f"{type(model).__name__} keeps a non-float buffer {name!r} "
                                            "that hfl cannot carry")
    for name, module in model.named_modules():
        batchnorm = isinstance(module, nn.modules.batchnorm._BatchNorm)
        if batchnorm and module.track_running_stats and module.momentum is None:
            raise ConfigError("model.name", f"{type(model).__name__}.{name} is a BatchNorm with momentum=None "
                                            "(a cumulative average over num_batches_tracked, which hfl does not carry)")
    return names, mask, dropped


def run_local_steps(
    trainer: LocalTrainer,
    start: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    sampler: BatchSampler,
    steps: int,
    update: Callable[[Params, Params], Params],
) -> tuple[Params, float]:
    """``steps`` minibatch updates ``params <- update(params, grad)``; returns params and mean loss.
    ``update`` may change the list it is given in place: it is this loop's copy of ``start``.

    With buffers (``trainer.buffer_mask``), each step's buffer entries are then set to the
    running statistics BatchNorm computed in that step, whatever ``update`` made of them (a
    prox term or a mix would otherwise move them as if they were parameters)."""
    params = [p.clone() for p in start]
    total = 0.0
    for _ in range(steps):
        idx = sampler.next()
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)
        if trainer.has_buffers:
            loss, grads, buffers = trainer.loss_grad_and_buffers(params, xb, yb)
            params = trainer.with_buffers(update(params, grads), buffers)
        else:
            loss, grads = trainer.loss_and_grad(params, xb, yb)
            params = update(params, grads)
        total += float(loss)
    return params, total / max(steps, 1)
