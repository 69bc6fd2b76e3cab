"""Node optimisers for B-HFL: FedOpt (Reddi et al., "Adaptive Federated Optimization", ICLR 2021)
applied to a pseudo-gradient at every tree node.

Each node merges a *target* model into its own model ``params``: upward the target is the (weighted)
mean of its children's models, downward it is the parent's model. The pseudo-gradient is

    delta = target - params            (per tensor)

so ``params + lr * delta`` moves towards the target: sgd with ``lr=1`` (and no momentum) is FedAvg's
plain replacement, and ``lr<1`` is a partial merge. With ``t`` the number of merges including this one:

- replace: params <- target (copies); lr is ignored.
- sgd:     m <- momentum*m + delta;  params <- params + lr*m.
- adam:    m <- beta1*m + (1-beta1)*delta;  v <- beta2*v + (1-beta2)*delta^2;
           params <- params + eta_t * m / (sqrt(v) + tau),
           eta_t = lr * sqrt(1-beta2^t) / (1-beta1^t) if bias_correction else lr.
- yogi:    as adam, but v <- v - (1-beta2)*delta^2*sign(v - delta^2).
- adagrad: m as adam;  v <- v + delta^2;  params <- params + lr * m / (sqrt(v) + tau)  (never bias-corrected).

Moments start at 0, as in Flower's FedAdam. Note that Flower 1.41's FedAdam uses the bias-corrected
step and tau=1e-9 by default; our defaults are no bias correction (Reddi et al.'s Algorithm 2) and
tau=1e-3 (within the range Reddi et al. tuned over).

Everything here is pure numpy over lists of arrays. The state is a flat ``dict[str, np.ndarray]`` so
that it can be written with ``np.savez`` as-is: ``"step"`` (0-d int64) and, where the optimiser needs
them, ``"m_<i>"`` / ``"v_<i>"`` per tensor, created lazily on the first merge.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from hfl.errors import ConfigError, check_number

OPTIMIZERS = ("replace", "sgd", "adam", "yogi", "adagrad")

DEFAULTS: dict[str, object] = {
    "lr": 1.0,
    "momentum": 0.0,
    "beta1": 0.9,
    "beta2": 0.99,
    "tau": 1e-3,
    "bias_correction": False,
}

# field -> (check_number bounds); all are floats that must also be finite
_BOUNDS: dict[str, dict] = {
    "lr": {"minimum": 0.0, "open_min": True},
    "momentum": {"minimum": 0.0, "maximum": 1.0, "open_max": True},
    "beta1": {"minimum": 0.0, "maximum": 1.0, "open_max": True},
    "beta2": {"minimum": 0.0, "maximum": 1.0, "open_max": True},
    "tau": {"minimum": 0.0, "open_min": True},
}


def check_spec(key: str, spec: Mapping) -> dict:
    """``spec`` (e.g. ``{"optimizer": "adam", "lr": 0.01}``) merged over DEFAULTS, or a ConfigError
    naming the offending field as ``f"{key}.<field>"``."""
    if not isinstance(spec, Mapping):
        raise ConfigError(key, f"must be a mapping with an 'optimizer' field, got {spec!r}")
    for field in spec:
        if field != "optimizer" and field not in DEFAULTS:
            known = ", ".join(["optimizer", *DEFAULTS])
            raise ConfigError(f"{key}.{field}", f"unknown field; known: {known}")
    if "optimizer" not in spec:
        raise ConfigError(f"{key}.optimizer", f"missing; known: {', '.join(OPTIMIZERS)}")
    if spec["optimizer"] not in OPTIMIZERS:
        known = ", ".join(OPTIMIZERS)
        raise ConfigError(f"{key}.optimizer", f"unknown optimiser {spec['optimizer']!r}; known: {known}")
    merged = {**DEFAULTS, **spec}
    for field, bounds in _BOUNDS.items():
        value = check_number(f"{key}.{field}", merged[field], **bounds)
        # check_number lets NaN through (every comparison is False) and inf through an open maximum
        if not math.isfinite(value):
            raise ConfigError(f"{key}.{field}", f"must be finite, got {value}")
        merged[field] = float(value)
    if not isinstance(merged["bias_correction"], bool):
        raise ConfigError(f"{key}.bias_correction", f"must be true or false, got {merged['bias_correction']!r}")
    return merged


def init_state(params: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """The state before any merge. Moments are created lazily, so 'replace' state stays tiny;
    ``params`` is accepted so callers need not care which optimiser they hold."""
    return {"step": np.array(0, dtype=np.int64)}


def _moment(state: Mapping[str, np.ndarray], name: str, like: np.ndarray) -> np.ndarray:
    """Stored moment ``name`` (as ``like``'s dtype), or zeros on the first merge."""
    if name not in state:
        return np.zeros_like(like)
    value = np.asarray(state[name])
    if value.shape != like.shape:
        raise ValueError(f"state {name!r} has shape {value.shape}, expected {like.shape}")
    return value.astype(like.dtype, copy=False)


def apply(
    spec: Mapping,
    params: Sequence[np.ndarray],
    target: Sequence[np.ndarray],
    state: Mapping[str, np.ndarray],
) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """Merge ``target`` into ``params`` once; returns (new params, new state) and mutates nothing.
    ``spec`` should come from check_spec (missing fields fall back to DEFAULTS)."""
    if len(params) != len(target):
        raise ValueError(f"target has {len(target)} tensors, params have {len(params)}")
    for i, (p, g) in enumerate(zip(params, target, strict=True)):
        if np.shape(p) != np.shape(g):
            raise ValueError(f"target tensor {i} has shape {np.shape(g)}, params have {np.shape(p)}")
    spec = {**DEFAULTS, **spec}
    kind = spec["optimizer"]
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimiser {kind!r}")
    t = int(state.get("step", 0)) + 1
    new_state: dict[str, np.ndarray] = {"step": np.array(t, dtype=np.int64)}
    params = [np.asarray(p) for p in params]
    if kind == "replace":
        return [np.array(g, dtype=p.dtype, copy=True) for p, g in zip(params, target, strict=True)], new_state

    # Python floats (not numpy scalars) so float32 arrays stay float32 under NEP 50 promotion
    lr, momentum = float(spec["lr"]), float(spec["momentum"])
    beta1, beta2, tau = float(spec["beta1"]), float(spec["beta2"]), float(spec["tau"])
    eta = lr
    if kind in ("adam", "yogi") and spec["bias_correction"]:
        eta = lr * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)

    new_params: list[np.ndarray] = []
    for i, (p, g) in enumerate(zip(params, target, strict=True)):
        delta = np.asarray(g).astype(p.dtype, copy=False) - p  # a fresh array: safe to reuse
        if kind == "sgd":
            if momentum == 0.0 and f"m_{i}" not in state:
                m = delta  # plain (partial) FedAvg step: no moment worth storing
            else:
                m = momentum * _moment(state, f"m_{i}", p) + delta
                new_state[f"m_{i}"] = m
            new_params.append(p + lr * m)
            continue
        m = beta1 * _moment(state, f"m_{i}", p) + (1.0 - beta1) * delta
        v = _moment(state, f"v_{i}", p)
        d2 = delta * delta
        if kind == "adam":
            v = beta2 * v + (1.0 - beta2) * d2
        elif kind == "yogi":
            v = v - (1.0 - beta2) * d2 * np.sign(v - d2)
        else:  # adagrad
            v = v + d2
        new_state[f"m_{i}"], new_state[f"v_{i}"] = m, v
        new_params.append(p + eta * m / (np.sqrt(v) + tau))
    return new_params, new_state
