"""MCLR's batched phase stepped in the span of each device's own data (the dual form).

Every term of a prox-SGD phase on MCLR is linear in the weights except the data gradient, and
that gradient, ``g^T x_batch``, lies in the row space of the device's training data ``X``. So
throughout a phase the weight matrix is

    W = u * W0 + v * A0 + M @ X         (and the anchor: ua * W0 + va * A0 + Ma @ X)

with ``W0``/``A0`` the phase's start and anchor, scalars ``u, v`` per device and coefficients
``M`` of shape ``[C, n]``. A step's logits then need ``X_b W^T = u X_b W0^T + v X_b A0^T + K_b M^T``
with the Gram matrix ``K = X X^T`` (made once per device and kept; the bias is the weight of a
constant feature 1, so ``K`` holds ``X X^T + 1`` and the bias needs no steps of its own), and its gradient is
``M[:, batch] -= lr * g``: ``C * B * n`` multiply-adds per step instead of ``2 * C * B * F``. It
pays when a device has fewer training samples than features (MNIST's 784 pixels, a few hundred
images per device): ``dual_pays``. The weights are rebuilt once at the end of the phase.

The same models as the primal step (hfl.accel.batched.run_phase) in exact arithmetic; in floats they
agree to rounding (tests/test_mclr_dual.py). The Gram matrix is summed in float64.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hfl.accel.closed_forms import nll_target_block
from hfl.device.scripted import scripted


@dataclass
class DualData:
    """A group of devices' training inputs, zero-padded to ``[D, n, F]``, and their Gram
    matrices ``X X^T + 1`` ``[D, n, n]`` (``device_gram``; padding rows and columns are zero:
    they never move a logit)."""

    x: torch.Tensor
    gram: torch.Tensor

    @property
    def rows(self) -> int:
        return self.x.shape[1]


def dual_pays(sizes: list[int], num_features: int) -> bool:
    """The dual step costs ``C*B*n`` per device step, the primal ``2*C*B*F``; the dual also
    rebuilds the weights once per phase (``C*n*F``): worth it when ``n < F``."""
    return max(sizes) < num_features


# A primal step's fixed cost in padded rows of work, for size_buckets (measured for the dual
# form, where it was first used: a phase of 10 MNIST devices padded to 629 rows took 24.9 ms,
# split 8 + 2 (3,858 rows) 14.7 ms, one padded to 306 (3,060) 13.5 ms).
BUCKET_OVERHEAD_ROWS = 1024


# What a dual-form phase of D devices padded to n training rows costs, minibatches W wide, S
# steps: S * (a*D*n*W + b*D*W + d) + c*D*n. In nanoseconds, fitted (least squares on relative
# error, within 8 % over 14 shapes) to single-thread run_dual_steps timings on this repository's
# 2-core CPU: .venv/bin/python benchmarks/dual_bucket_cost.py
COST_PER_GRAM_ENTRY = 0.385   # a: a step's product with (and gather of) the Gram rows
COST_PER_SAMPLE = 35.2        # b: a step's softmax, gradient and loss per minibatch sample
COST_PER_ROW = 1614.0         # c: a phase's set-up per padded row (W0 X^T, rebuilding M X)
COST_PER_STEP = 23_700.0      # d: a step's fixed cost (its ~10 tensor operations), per group


def phase_cost(devices: int | np.ndarray, rows: float, width: float, steps: int) -> float | np.ndarray:
    """The modelled nanoseconds of one group's dual-form phase (``COST_PER_*``)."""
    return (steps * (COST_PER_GRAM_ENTRY * devices * rows * width + COST_PER_SAMPLE * devices * width + COST_PER_STEP)
            + COST_PER_ROW * devices * rows)


def dual_buckets(sizes: Sequence[int], batch_size: int, steps: int) -> list[list[int]]:
    """Positions of ``sizes`` (training rows) grouped to step together in the dual form, each
    group padded to its largest device (rows) and widest minibatch (``min(rows, batch_size)``):
    the partition of the sorted sizes into runs with the least modelled cost (``phase_cost``),
    found exactly by dynamic programming over the runs' ends."""
    costs = (COST_PER_GRAM_ENTRY, COST_PER_SAMPLE, COST_PER_ROW, COST_PER_STEP)
    return [list(group) for group in _dual_buckets(tuple(sizes), batch_size, steps, costs)]


@functools.lru_cache(maxsize=256)  # a node asks for the same devices' split every phase
def _dual_buckets(sizes: tuple[int, ...], batch_size: int, steps: int,
                  costs: tuple[float, float, float, float]) -> tuple[tuple[int, ...], ...]:
    """``costs``: the ``COST_PER_*`` constants ``phase_cost`` reads (part of the cache's key)."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    rows = np.array([sizes[i] for i in order], dtype=np.float64)
    best = np.zeros(len(rows) + 1)  # best[j]: the cheapest split of the j smallest
    start = np.zeros(len(rows) + 1, dtype=np.int64)
    for j in range(1, len(rows) + 1):  # the last run is rows i..j-1, for every i at once
        total = best[:j] + phase_cost(j - np.arange(j), rows[j - 1], min(rows[j - 1], batch_size), steps)
        start[j] = int(np.argmin(total))
        best[j] = total[start[j]]
    groups, end = [], len(rows)
    while end:
        groups.append(tuple(order[start[end]:end]))
        end = int(start[end])
    return tuple(reversed(groups))


def size_buckets(sizes: Sequence[int]) -> list[list[int]]:
    """Positions of ``sizes`` grouped to step together: every device is padded to its group's
    largest, so one very large device makes the others pay for its rows. Sorted by size, a group
    is split in two where that saves more padded rows than ``BUCKET_OVERHEAD_ROWS``, recursively.
    (The primal step's groups by minibatch width; the dual form's are ``dual_buckets``.)"""

    def split(members: list[int]) -> list[list[int]]:
        n = [sizes[i] for i in members]
        best, at = len(n) * n[-1], None
        for i in range(1, len(n)):
            cost = i * n[i - 1] + (len(n) - i) * n[-1] + BUCKET_OVERHEAD_ROWS
            if cost < best:
                best, at = cost, i
        return [members] if at is None else split(members[:at]) + split(members[at:])

    return split(sorted(range(len(sizes)), key=lambda i: sizes[i]))


# id(x_train) -> its Gram matrix per compute device. Nodes (and their batched data) are rebuilt
# for each message; the devices' data tensors live on (the federation, or its lazy cache), so the
# Gram matrices are kept with them and dropped when they are.
_GRAMS: dict[tuple[int, str], torch.Tensor] = {}


def device_gram(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``X X^T + 1`` of one device's training inputs (summed in float64): the Gram matrix of its
    rows with a constant feature 1 appended, the bias's. Kept while ``x`` lives."""
    key = (id(x), str(device))
    if key not in _GRAMS:
        wide = x.flatten(1).to(device, torch.float64)
        _GRAMS[key] = (wide @ wide.T + 1.0).to(x.dtype)
        weakref.finalize(x, _GRAMS.pop, key, None)
    return _GRAMS[key]


def make_dual_data(xs: Sequence[torch.Tensor], device: torch.device) -> DualData:
    """The dual-form data of a group of devices from their training inputs (any trailing shape)."""
    n = max(len(x) for x in xs)
    features = xs[0][0].numel()
    padded = torch.zeros(len(xs), n, features, dtype=xs[0].dtype, device=device)
    gram = torch.zeros(len(xs), n, n, dtype=xs[0].dtype, device=device)
    for d, x in enumerate(xs):
        padded[d, :len(x)] = x.flatten(1).to(device)
        gram[d, :len(x), :len(x)] = device_gram(x, device)
    return DualData(padded, gram)


def _mix(keep: torch.Tensor, a: torch.Tensor, toward: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """keep * a + toward * b with per-device ``[D]`` factors."""
    shape = [-1] + [1] * (a.dim() - 1)
    return keep.view(shape) * a + toward.view(shape) * b


@scripted
def _step_loop(gram: torch.Tensor, flat: torch.Tensor, scatter_at: torch.Tensor, base0: torch.Tensor,
               base_a: torch.Tensor, neg: torch.Tensor, minus_lr_weight: torch.Tensor, minus_lr_neg: torch.Tensor,
               coef: torch.Tensor, u: torch.Tensor, v: torch.Tensor, ua: torch.Tensor, va: torch.Tensor,
               acoef: torch.Tensor, keep: torch.Tensor, lr_prox: torch.Tensor, pull: torch.Tensor, inner_steps: int,
               anchored: bool, fixed_start: bool, pulled: bool,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``run_dual_steps``' steps, every per-step tensor stacked ``[steps, ...]``: the coefficients
    ``M``, ``u, v``, the anchor's ``ua, va, Ma`` and the loss's terms (``logp * neg``, summed by
    the caller); ``minus_lr_*``: ``NLLTargets``' ``lr_weight, lr_neg`` negated. Unanchored:
    ``base_a, ua, va, acoef, keep, lr_prox`` unread; unpulled: ``pull``."""
    steps, devices, classes, batch = scatter_at.shape
    n = gram.shape[1]
    keep3 = keep.view(-1, 1, 1)
    # the summed loss's terms, logp * -w * onehot(y), reduced once at the end
    loss_terms = torch.zeros(devices, classes, batch, dtype=coef.dtype, device=coef.device)
    k_buffer = torch.empty(devices * batch, n, dtype=gram.dtype, device=gram.device)
    # each step's slices taken at once (one operation, not one a step each)
    flats, scatters, bases0, bases_a = flat.unbind(0), scatter_at.unbind(0), base0.unbind(0), base_a.unbind(0)
    negs, lr_weights, lr_negs = neg.unbind(0), minus_lr_weight.unbind(0), minus_lr_neg.unbind(0)
    for s in range(steps):
        # [D, n, B]; into one buffer: a fresh one a step cost more than the copy (measured)
        k_batch = torch.index_select(gram, 0, flats[s], out=k_buffer).view(devices, batch, n).transpose(1, 2)
        for inner in range(inner_steps):
            if not anchored or fixed_start:  # u = 1, v = 0 throughout
                logits = torch.baddbmm(bases0[s], coef, k_batch)
            else:
                logits = torch.baddbmm(torch.mul(bases0[s], u.view(-1, 1, 1)), coef, k_batch)
                logits = torch.addcmul(logits, v.view(-1, 1, 1), bases_a[s])
            logp = torch.log_softmax(logits, dim=1)
            if inner == inner_steps - 1:  # the loss of a minibatch's last inner step, as one by one
                loss_terms.addcmul_(logp, negs[s])
            # -lr * the gradient wrt the logits (negated targets: exactly the negated sum)
            grad = torch.addcmul(lr_negs[s], logp.exp_(), lr_weights[s])
            if anchored:
                if not fixed_start:
                    u, v = _mix(keep, u, lr_prox, ua), _mix(keep, v, lr_prox, va)
                if pulled:
                    coef = _mix(keep, coef, lr_prox, acoef)
                else:
                    coef = coef.mul_(keep3)
            coef.scatter_add_(2, scatters[s], grad)
        if pulled:
            stay = 1.0 - pull
            ua, va, acoef = _mix(stay, ua, pull, u), _mix(stay, va, pull, v), _mix(stay, acoef, pull, coef)
    return coef, u, v, ua, va, acoef, loss_terms


def run_dual_steps(data: DualData, theta: list[torch.Tensor], anchor: list[torch.Tensor] | None,
                   local: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, lr: torch.Tensor,
                   lr_prox: torch.Tensor | None, pull: torch.Tensor | None, inner_steps: int,
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, torch.Tensor]:
    """``steps`` minibatches (``local``: each device's row indices ``[steps, D, B]`` into its own
    data; ``weight``: ``[steps, D, B]``, 0 on padding; ``y``: labels ``[steps, D, B]``), each with
    ``inner_steps`` steps of ``t <- t - lr*grad - lr_prox*(t - anchor)`` (no prox term without an
    anchor); with ``pull`` the anchor then moves ``a <- (1-pull) a + pull t``. Returns the final
    ``[weight, bias]``, the moved anchor (with ``pull``) and each device's summed loss.

    The bias is the weight of a constant feature 1 (the Gram matrices hold ``X X^T + 1``), so it
    follows the coefficients: ``b = u * b0 + v * a0_bias + M.sum(-1)``, never stepped on its own."""
    steps, devices, _ = local.shape
    w0, b0 = theta
    n = data.rows
    gram = data.gram.reshape(devices * n, n)
    flat = (local + torch.arange(devices, device=local.device).view(1, -1, 1) * n).reshape(steps, -1)
    scatter_at = local.unsqueeze(2).expand(-1, -1, w0.shape[1], -1)  # [D, C, B] a step
    # Every step's logit offsets from the start (and the anchor) at once: [D, C, B] a step.
    base0 = _batch_logits(data.x, w0, b0, local)
    one = torch.ones(devices, dtype=w0.dtype, device=w0.device)
    u, v = one, torch.zeros_like(one)
    coef = torch.zeros(devices, w0.shape[1], n, dtype=w0.dtype, device=w0.device)
    start_anchor = False
    if anchor is not None:
        a0, ab0 = anchor
        # PerMFL, FedProx...: the anchor is the start (one product, not two)
        start_anchor = (a0 is w0 or torch.equal(a0, w0)) and (ab0 is b0 or torch.equal(ab0, b0))
        base_a = base0 if start_anchor else _batch_logits(data.x, a0, ab0, local)
        ua, va, acoef = torch.zeros_like(one), one, torch.zeros_like(coef)
        keep = 1.0 - lr_prox
    # A fixed anchor that is the start: u <- keep*u and v <- keep*v + lr_prox keep u + v = 1, so
    # the logits' offset is base0 itself and u, v need no updates.
    fixed_start = start_anchor and pull is None
    if anchor is None:  # placeholders the loop never reads (TorchScript wants tensors)
        base_a, ua, va, acoef, keep, lr_prox = base0, one, u, coef, one, u
    # the rates negated: the targets' lr terms come negated, exactly (the loop adds -lr * gradient)
    neg, minus_lr_weight, minus_lr_neg = nll_target_block(y, weight, w0.shape[1], lr.neg())
    coef, u, v, ua, va, acoef, loss_terms = _step_loop(
        gram, flat, scatter_at, base0, base_a, neg, minus_lr_weight, minus_lr_neg, coef, u, v, ua, va, acoef, keep, lr_prox,
        pull if pull is not None else one, inner_steps, anchor is not None, fixed_start, pull is not None)
    out = _rebuild(data.x, w0, b0, a0 if anchor is not None and not fixed_start else None,
                   ab0 if anchor is not None else None, u, v, coef)
    moved = _rebuild(data.x, w0, b0, a0, ab0, ua, va, acoef) if pull is not None else None
    return out, moved, loss_terms.sum((1, 2))


def _batch_logits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``W X^T + b`` for every device's rows (``[D, C, n]``: ``W @ X^T`` runs ~2x faster than
    ``X @ W^T`` for few classes), gathered at each step's rows: ``[steps, D, C, B]``."""
    steps, devices, batch = local.shape
    all_rows = torch.baddbmm(b.unsqueeze(2), w, x.transpose(1, 2))
    at = local.permute(1, 0, 2).reshape(devices, 1, -1).expand(-1, w.shape[1], -1)
    return all_rows.gather(2, at).view(devices, w.shape[1], steps, batch).permute(2, 0, 1, 3)


def _rebuild(x: torch.Tensor, w0: torch.Tensor, b0: torch.Tensor, a0: torch.Tensor | None, ab0: torch.Tensor | None,
             u: torch.Tensor, v: torch.Tensor, coef: torch.Tensor) -> list[torch.Tensor]:
    """``[u W0 + v A0 + M X, u b0 + v a0_bias + M 1]`` (without ``a0``: ``u W0 + M X``, ``u b0 + M 1``)."""
    weight = torch.baddbmm(u.view(-1, 1, 1) * w0, coef, x)
    bias = torch.addcmul(coef.sum(2), u.view(-1, 1), b0)
    if a0 is None:
        return [weight, bias]
    return [torch.addcmul(weight, v.view(-1, 1, 1), a0), torch.addcmul(bias, v.view(-1, 1), ab0)]
