"""Exact gradients of a weighted NLL for stacked per-device parameters, written out by hand for
the models that have a short closed form: MCLR and one-hidden-layer ReLU networks (PerMFL's
synthetic DNN, PFLEGO's MNIST MLP). The batched path (hfl.accel.batched) uses them instead of
``torch.func.vmap`` over autograd, which costs milliseconds of dispatch per step for models this
small. Layouts are transposed, ``[D, out, B]`` (``W @ x^T``): ~2x faster on the CPU when the
output side is a few classes. Tests: tests/test_batched.py compares each with autograd per device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from hfl.accel.grouped_cnn import cnn_batched_loss_and_grad
from hfl.models import CNN, DNN, MCLR, MLP

Params = list[torch.Tensor]


class NLLTargets(NamedTuple):
    """One step's labels as the NLL gradient uses them (``nll_targets``), for logits ``[D, C, B]``:
    ``neg = -w * onehot(y)`` ``[D, C, B]`` (the weighted NLL is ``sum(log_softmax * neg)``), and
    ``lr_weight = lr * w`` ``[D, 1, B]``, ``lr_neg = lr * neg``: the gradient comes out already
    multiplied by each device's learning rate, so a step needs no separate scaling."""

    neg: torch.Tensor
    lr_weight: torch.Tensor
    lr_neg: torch.Tensor


def nll_target_block(y: torch.Tensor, w: torch.Tensor, classes: int, lr: torch.Tensor) -> NLLTargets:
    """``NLLTargets`` of every step of a block at once, each field stacked ``[steps, ...]``: labels
    and per-sample weights ``[steps, D, B]`` (weight 0 on padding), learning rates ``[D]``."""
    neg = torch.zeros(*y.shape[:-1], classes, y.shape[-1], dtype=w.dtype, device=w.device)
    neg.scatter_(-2, y.unsqueeze(-2), w.neg().unsqueeze(-2))
    lr = lr.to(w.dtype).view(1, -1, 1, 1)
    return NLLTargets(neg, w.unsqueeze(-2) * lr, neg * lr)


def nll_targets(y: torch.Tensor, w: torch.Tensor, classes: int, lr: torch.Tensor) -> list[NLLTargets]:
    """``nll_target_block`` a step at a time. Made once per phase, not per step."""
    return [NLLTargets(*t) for t in zip(*(field.unbind(0) for field in nll_target_block(y, w, classes, lr)),
                                        strict=True)]


def scaled_nll_grad(logits: torch.Tensor, target: NLLTargets) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits ``[D, C, B]``: ``lr`` times the gradient of each device's weighted NLL
    ``-sum_b w_b log softmax(logits)[y_b]`` wrt the logits, ``lr * w * (softmax - onehot(y))``,
    and the loss ``[D]`` (unscaled)."""
    logp = torch.log_softmax(logits, dim=1)
    loss = (logp * target.neg).sum((1, 2))
    return torch.addcmul(target.lr_neg, logp.exp_(), target.lr_weight), loss


def mclr_scaled_step(params: Params, x: torch.Tensor, xt: torch.Tensor, target: NLLTargets) -> tuple[torch.Tensor, Params]:
    """MCLR's loss per device and ``lr`` times its gradient, for stacked parameters (``[D, C, F]``,
    ``[D, C]``), flat inputs ``x`` ``[D, B, F]`` and ``xt = x.transpose(1, 2)``."""
    weight, bias = params
    g, loss = scaled_nll_grad(torch.baddbmm(bias.unsqueeze(2), weight, xt), target)
    return loss, [torch.bmm(g, x), g.sum(2)]


def relu_net_scaled_step(params: Params, x: torch.Tensor, xt: torch.Tensor,
                         target: NLLTargets) -> tuple[torch.Tensor, Params]:
    """``log_softmax(W2 relu(W1 x + b1) + b2)``: the loss per device and ``lr`` times its gradient
    (backpropagation by hand; ReLU's derivative is 0 at 0, as autograd's)."""
    w1, b1, w2, b2 = params
    hidden = torch.relu(torch.baddbmm(b1.unsqueeze(2), w1, xt))  # [D, H, B]
    g, loss = scaled_nll_grad(torch.baddbmm(b2.unsqueeze(2), w2, hidden), target)  # [D, C, B]
    g_hidden = torch.bmm(w2.transpose(1, 2), g).mul_(hidden > 0)
    return loss, [torch.bmm(g_hidden, x), g_hidden.sum(2), torch.bmm(g, hidden.transpose(1, 2)), g.sum(2)]


def _unscaled(step: Callable, classes: Callable[[Params], int]) -> Callable:
    """The plain ``(params, x, y, w) -> (loss, gradient)`` of a scaled step (lr = 1)."""

    def loss_and_grad(params: Params, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, Params]:
        x = x.flatten(2)
        target = nll_targets(y.unsqueeze(0), w.unsqueeze(0), classes(params), torch.ones(len(y), device=w.device))[0]
        return step(params, x, x.transpose(1, 2), target)

    return loss_and_grad


# MCLR's weighted NLL per device and its gradient, for stacked parameters (``[D, C, F]``, ``[D, C]``),
# inputs ``[D, B, ...]``, labels and weights ``[D, B]``; and the one-hidden-layer ReLU net's.
mclr_batched_loss_and_grad = _unscaled(mclr_scaled_step, lambda p: p[1].shape[1])
relu_net_batched_loss_and_grad = _unscaled(relu_net_scaled_step, lambda p: p[3].shape[1])
# What the batched phase runner steps with (hfl.accel.batched): the scaled form of each.
SCALED_STEPS: dict[Callable, Callable] = {mclr_batched_loss_and_grad: mclr_scaled_step,
                                          relu_net_batched_loss_and_grad: relu_net_scaled_step}


def closed_form(model: nn.Module) -> Callable | None:
    """The hand-written batched loss-and-gradient of ``model``'s architecture, if it has one."""
    if type(model) is MCLR:
        return mclr_batched_loss_and_grad
    if type(model) is DNN or (type(model) is MLP and _flatten_linear_relu(model.body)):
        return relu_net_batched_loss_and_grad
    if type(model) is CNN:  # not a closed form: autograd through a hand-batched forward
        return cnn_batched_loss_and_grad
    return None


def _flatten_linear_relu(body: nn.Sequential) -> bool:
    return [type(m) for m in body] == [nn.Flatten, nn.Linear, nn.ReLU]
