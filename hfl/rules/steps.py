"""Gradient steps the algorithms share, as pure functions over lists of arrays or tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def sgd_step(params: Sequence[T], grad: Sequence[T], lr: float) -> list[T]:
    """params <- params - lr * grad (hfl.device.plan.prox_update without an anchor computes the same)."""
    return [p - lr * g for p, g in zip(params, grad, strict=True)]
