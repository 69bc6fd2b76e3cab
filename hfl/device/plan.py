"""A device's fit as data (``FitPlan``): one or more ``Phase``s of minibatch steps of
``theta <- theta - lr * grad f(theta) - lr * prox * (theta - anchor)`` (plain SGD without an
anchor) on its own sampler, and a ``finish`` that turns the trained models into its reply.
``run_plan`` is the per-device path; the batched accelerator (hfl.accel.batched) runs the
plans of all the devices a node asked as one computation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from flwr.common import NDArrays, Scalar

from hfl.device.state import DeviceRuntime
from hfl.device.training import Params, run_local_steps

FitReply = tuple[NDArrays, int, dict[str, Scalar]]


@dataclass
class Phase:
    """``steps`` minibatches from ``start``; on each, ``inner_steps`` steps (the prox-SGD step
    toward ``anchor`` where there is one). With ``pull``, the anchor then moves toward the model,
    ``anchor <- (1 - pull) anchor + pull theta`` (pFedMe's local model), and the runner leaves
    its final value in ``moved_anchor``. The loss of a minibatch is its last inner step's."""

    start: Params
    steps: int
    lr: float
    anchor: Params | None = None
    prox: float = 0.0
    inner_steps: int = 1
    pull: float | None = None
    moved_anchor: Params | None = None  # set by the runner when ``pull`` is given


@dataclass
class FitPlan:
    """A device's fit: its phases, run in order on its sampler, then ``finish(models, losses)``
    (the trained model and mean loss of each phase) gives its reply."""

    phases: list[Phase]
    finish: Callable[[list[Params], list[float]], FitReply]


def prox_update(lr: float, prox: float, anchor: Params | None) -> Callable[[Params, Params], Params]:
    """The per-device step ``t - lr*g - lr*prox*(t - anchor)`` (``t - lr*g`` without an anchor),
    made **in place** on the model and the gradient it is given, which its caller owns
    (``run_local_steps`` and ``run_inner_steps`` step clones, with fresh gradients). The same
    operations in the same order as the expression evaluated left to right (``lr*g``, ``t - lr*g``,
    ``(lr*prox)*(t - anchor)``, the difference), so the same bits, without the two to four new
    model-sized tensors a step the expression makes (allocating them was a third of a CNN's step
    on the CPU); ``(t - anchor)`` goes to a scratch tensor kept between steps."""
    scratch: dict[int, torch.Tensor] = {}  # lr * g of a gradient another entry reads
    toward: dict[int, torch.Tensor] = {}  # (lr*prox) * (t - anchor)

    def scaled(i: int, g: torch.Tensor, owned: bool) -> torch.Tensor:
        """``lr * g``, into ``g`` where nothing else reads it."""
        if owned:
            return g.mul_(lr)
        if i not in scratch:
            scratch[i] = torch.empty_like(g)
        return torch.mul(g, lr, out=scratch[i])

    if anchor is None:
        def sgd(p: Params, g: Params) -> Params:
            owned = overwritable(g)
            for i, (t, gr) in enumerate(zip(p, g, strict=True)):
                t.sub_(scaled(i, gr, owned[i]))
            return p

        return sgd
    pull = lr * prox  # a Python float, as in the expression

    def prox_sgd(p: Params, g: Params) -> Params:
        owned = overwritable(g)
        for i, (t, gr, a) in enumerate(zip(p, g, anchor, strict=True)):
            if i not in toward:
                toward[i] = torch.empty_like(t)
            to_anchor = torch.sub(t, a, out=toward[i]).mul_(pull)
            t.sub_(scaled(i, gr, owned[i])).sub_(to_anchor)
        return p

    return prox_sgd


def overwritable(grads: Params) -> list[bool]:
    """Which gradients an update may overwrite: dense ones held by no other entry (autograd may
    hand two parameters the same tensor, or a broadcast one, where writing would corrupt another)."""
    seen: dict[int, int] = {}
    for g in grads:
        seen[g.data_ptr()] = seen.get(g.data_ptr(), 0) + 1
    return [g.is_contiguous() and seen[g.data_ptr()] == 1 for g in grads]


def run_inner_steps(dev: DeviceRuntime, phase: Phase) -> tuple[Params, float]:
    """A phase with inner steps or a moving anchor, one device (pFedMe's loop, as it always ran)."""
    if phase.anchor is None:
        raise ValueError("a phase with inner steps or a pull needs an anchor")
    theta, anchor = [p.clone() for p in phase.start], [p.clone() for p in phase.anchor]
    losses = []
    for _ in range(phase.steps):
        idx = dev.sampler.next()
        x, y = dev.x_train.index_select(0, idx), dev.y_train.index_select(0, idx)
        update = prox_update(phase.lr, phase.prox, anchor)
        for _ in range(phase.inner_steps):
            loss, grad = dev.trainer.loss_and_grad(theta, x, y)
            theta = update(theta, grad)
        losses.append(float(loss))
        if phase.pull is not None:
            anchor = [(1.0 - phase.pull) * a + phase.pull * t for a, t in zip(anchor, theta, strict=True)]
    phase.moved_anchor = anchor if phase.pull is not None else None
    return theta, sum(losses) / max(len(losses), 1)


def run_plan(dev: DeviceRuntime, plan: FitPlan) -> FitReply:
    """The per-device path: each phase with ``run_local_steps`` on the device's own sampler."""
    models, losses = [], []
    for phase in plan.phases:
        if phase.inner_steps == 1 and phase.pull is None:
            params, loss = run_local_steps(dev.trainer, phase.start, dev.x_train, dev.y_train, dev.sampler,
                                           phase.steps, prox_update(phase.lr, phase.prox, phase.anchor))
        else:
            params, loss = run_inner_steps(dev, phase)
        models.append(params)
        losses.append(loss)
    return plan.finish(models, losses)
