"""Small pieces the baseline algorithms share: model mixing, head/body splits, a device's
local loop and fit reply, and hyper-parameter checks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from flwr.common import NDArrays, Scalar

from hfl.device.state import DeviceRuntime
from hfl.errors import ConfigError, check_number
from hfl.device.training import Params, run_local_steps, to_ndarrays

T = TypeVar("T")


def mix(params: Sequence[T], target: Sequence[T], weight: float) -> list[T]:
    """(1 - weight) * params + weight * target: a step of size ``weight`` toward ``target``."""
    return [(1.0 - weight) * p + weight * t for p, t in zip(params, target, strict=True)]


def head_mask(names: Sequence[str], head_layers: int) -> list[bool]:
    """Which tensors belong to the last ``head_layers`` layers (a layer = the tensors sharing
    a module prefix, e.g. ``fc2.weight`` and ``fc2.bias``)."""
    modules = list(dict.fromkeys(name.rsplit(".", 1)[0] for name in names))
    if not 1 <= head_layers <= len(modules):
        raise ValueError(f"head_layers must be in [1, {len(modules)}] for this model, got {head_layers}")
    head = set(modules[len(modules) - head_layers:])
    return [name.rsplit(".", 1)[0] in head for name in names]


def splice(body: Sequence[T], head: Sequence[T], mask: Sequence[bool]) -> list[T]:
    """Tensors of ``head`` where ``mask`` is true, of ``body`` elsewhere."""
    return [h if m else b for b, h, m in zip(body, head, mask, strict=True)]


def masked_sgd_step(params: Sequence[T], grad: Sequence[T], lr: float, mask: Sequence[bool]) -> list[T]:
    """params <- params - lr * grad on the tensors where ``mask`` is true; the rest unchanged."""
    return [p - lr * g if m else p for p, g, m in zip(params, grad, mask, strict=True)]


def local_steps(dev: DeviceRuntime, start: Params, steps: int, update: Callable[[Params, Params], Params]) -> tuple[Params, float]:
    """``steps`` minibatch updates on the device's training data (hfl.device.training.run_local_steps)."""
    return run_local_steps(dev.trainer, start, dev.x_train, dev.y_train, dev.sampler, steps, update)


def fit_reply(dev: DeviceRuntime, params: Params, loss: float) -> tuple[NDArrays, int, dict[str, Scalar]]:
    """What a device's ``fit`` returns: the model it shares, its sample count, its id and loss."""
    return to_ndarrays(params), len(dev.y_train), {"device_id": dev.device_id, "train_loss": loss}


def check_keys(alg: Mapping[str, Any], **specs: Mapping[str, Any]) -> None:
    """``check_number`` on ``algorithm.<key>`` for every key, with the bounds given for it."""
    for key, bounds in specs.items():
        if key not in alg:
            raise ConfigError(f"algorithm.{key}", "missing")
        check_number(f"algorithm.{key}", alg[key], **bounds)
