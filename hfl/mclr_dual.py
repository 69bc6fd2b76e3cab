"""MCLR's batched phase stepped in the span of each device's own data (the dual form).

Every term of a prox-SGD phase on MCLR is linear in the weights except the data gradient, and
that gradient, ``g^T x_batch``, lies in the row space of the device's training data ``X``. So
throughout a phase the weight matrix is

    W = u * W0 + v * A0 + M @ X         (and the anchor: ua * W0 + va * A0 + Ma @ X)

with ``W0``/``A0`` the phase's start and anchor, scalars ``u, v`` per device and coefficients
``M`` of shape ``[C, n]``. A step's logits then need ``X_b W^T = u X_b W0^T + v X_b A0^T + K_b M^T``
with the Gram matrix ``K = X X^T`` (made once per device and kept), and its gradient is
``M[:, batch] -= lr * g``: ``C * B * n`` multiply-adds per step instead of ``2 * C * B * F``. It
pays when a device has fewer training samples than features (MNIST's 784 pixels, a few hundred
images per device): ``dual_pays``. The weights are rebuilt once at the end of the phase.

The same models as the primal step (hfl.batched.run_phase) in exact arithmetic; in floats they
agree to rounding (tests/test_mclr_dual.py). The Gram matrix is summed in float64.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hfl.closed_forms import nll_targets, scaled_nll_grad


@dataclass
class DualData:
    """A group of devices' training inputs, zero-padded to ``[D, n, F]``, and their Gram
    matrices ``[D, n, n]`` (padding rows and columns are zero: they never move a logit)."""

    x: torch.Tensor
    gram: torch.Tensor

    @property
    def rows(self) -> int:
        return self.x.shape[1]


def dual_pays(sizes: list[int], num_features: int) -> bool:
    """The dual step costs ``C*B*n`` per device step, the primal ``2*C*B*F``; the dual also
    rebuilds the weights once per phase (``C*n*F``): worth it when ``n < F``."""
    return max(sizes) < num_features


# A dual step's fixed cost (its ~30 small ops) in padded Gram rows of work: measured on this
# CPU, a phase of 10 MNIST devices padded to 629 rows (6,290) took 24.9 ms, split 8 + 2 (3,858)
# 14.7 ms, one padded to 306 (3,060) 13.5 ms.
BUCKET_OVERHEAD_ROWS = 1024


def size_buckets(sizes: Sequence[int]) -> list[list[int]]:
    """Positions of ``sizes`` grouped to step together: every device is padded to its group's
    largest, so one very large device makes the others pay for its rows. Sorted by size, a group
    is split in two where that saves more padded rows than ``BUCKET_OVERHEAD_ROWS``, recursively."""

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
    """``X X^T`` of one device's training inputs (summed in float64), kept while ``x`` lives."""
    key = (id(x), str(device))
    if key not in _GRAMS:
        wide = x.flatten(1).to(device, torch.float64)
        _GRAMS[key] = (wide @ wide.T).to(x.dtype)
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
    shape = (-1, *([1] * (a.dim() - 1)))
    return keep.view(shape) * a + toward.view(shape) * b


def run_dual_steps(data: DualData, theta: list[torch.Tensor], anchor: list[torch.Tensor] | None,
                   local: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, lr: torch.Tensor,
                   lr_prox: torch.Tensor | None, pull: torch.Tensor | None, inner_steps: int,
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, torch.Tensor]:
    """``steps`` minibatches (``local``: each device's row indices ``[steps, D, B]`` into its own
    data; ``weight``: ``[steps, D, B]``, 0 on padding; ``y``: labels ``[steps, D, B]``), each with
    ``inner_steps`` steps of ``t <- t - lr*grad - lr_prox*(t - anchor)`` (no prox term without an
    anchor); with ``pull`` the anchor then moves ``a <- (1-pull) a + pull t``. Returns the final
    ``[weight, bias]``, the moved anchor (with ``pull``) and each device's summed loss."""
    steps, devices, batch = local.shape
    w0, bias = theta
    n = data.rows
    gram = data.gram.reshape(devices * n, n)
    flat = (local + torch.arange(devices, device=local.device).view(1, -1, 1) * n).reshape(steps, -1)
    # Every step's logit offsets from W0 (and A0) at once: [steps, D, C, B].
    base0 = _batch_logits(data.x, w0, local)
    one = torch.ones(devices, dtype=w0.dtype, device=w0.device)
    u, v = one, torch.zeros_like(one)
    coef = torch.zeros(devices, w0.shape[1], n, dtype=w0.dtype, device=w0.device)
    if anchor is not None:
        a0, abias = anchor
        # PerMFL, FedProx...: the anchor is the start (one product, not two)
        base_a = base0 if a0 is w0 or torch.equal(a0, w0) else _batch_logits(data.x, a0, local)
        ua, va, acoef = torch.zeros_like(one), one, torch.zeros_like(coef)
        keep = 1.0 - lr_prox
    # A fixed anchor that is the start: u <- keep*u and v <- keep*v + lr_prox keep u + v = 1, so
    # the logits' offset is base0 itself and u, v need no updates.
    start_anchor = anchor is not None and pull is None and base_a is base0
    targets = nll_targets(y, weight, w0.shape[1], lr)
    if anchor is not None:  # the bias: b <- keep * b + lr_prox * anchor - lr * g
        keep2, keep3, lrp2 = keep.view(-1, 1), keep.view(-1, 1, 1), lr_prox.view(-1, 1)
        toward = lrp2 * abias
    total = torch.zeros(devices, dtype=w0.dtype, device=w0.device)
    for s in range(steps):
        k_batch = gram.index_select(0, flat[s]).view(devices, batch, n).transpose(1, 2)  # [D, n, B]
        scatter_at = local[s].unsqueeze(1).expand(-1, w0.shape[1], -1)  # [D, C, B]
        for _ in range(inner_steps):
            logits = torch.baddbmm(bias.unsqueeze(2), coef, k_batch)
            if start_anchor:
                logits = logits + base0[s]
            else:
                logits = torch.addcmul(logits, u.view(-1, 1, 1), base0[s])
                if anchor is not None:
                    logits = torch.addcmul(logits, v.view(-1, 1, 1), base_a[s])
            g, loss = scaled_nll_grad(logits, targets[s])  # lr * the gradient wrt the logits
            if anchor is None:
                bias = bias - g.sum(2)
            else:
                bias = torch.addcmul(toward - g.sum(2), keep2, bias)
                if not start_anchor:
                    u, v = _mix(keep, u, lr_prox, ua), _mix(keep, v, lr_prox, va)
                coef = _mix(keep, coef, lr_prox, acoef) if pull is not None else keep3 * coef
            coef = coef.scatter_add(2, scatter_at, g.neg_())
        if pull is not None:
            stay = 1.0 - pull
            ua, va, acoef = _mix(stay, ua, pull, u), _mix(stay, va, pull, v), _mix(stay, acoef, pull, coef)
            abias = _mix(stay, abias, pull, bias)
            toward = lrp2 * abias
        total += loss
    weight_out = _rebuild(data.x, w0, anchor[0] if anchor is not None and not start_anchor else None, u, v, coef)
    moved = None
    if pull is not None:
        moved = [_rebuild(data.x, w0, anchor[0], ua, va, acoef), abias]
    return [weight_out, bias], moved, total


def _batch_logits(x: torch.Tensor, w: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``W X^T`` for every device's rows (``[D, C, n]``: ``W @ X^T`` runs ~2x faster than
    ``X @ W^T`` for few classes), gathered at every step's rows: ``[steps, D, C, B]``."""
    steps, devices, batch = local.shape
    all_rows = torch.bmm(w, x.transpose(1, 2))
    at = local.permute(1, 0, 2).reshape(devices, 1, -1).expand(-1, w.shape[1], -1)
    return all_rows.gather(2, at).view(devices, w.shape[1], steps, batch).permute(2, 0, 1, 3)


def _rebuild(x: torch.Tensor, w0: torch.Tensor, a0: torch.Tensor | None, u: torch.Tensor, v: torch.Tensor,
             coef: torch.Tensor) -> torch.Tensor:
    out = torch.baddbmm(u.view(-1, 1, 1) * w0, coef, x)
    return out if a0 is None else out + v.view(-1, 1, 1) * a0
