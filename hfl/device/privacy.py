"""Clipping and Gaussian noise of a model update, the pieces of differential privacy a device
(local DP) and a node (central DP, hfl.rules.privacy) share. Pure functions on NumPy arrays; the
noise is drawn from a generator the caller seeds (hfl.seed), so runs are reproducible and every
runtime draws the same noise.

An update is ``model - reference`` (the reference: the model the node sent this round). A model
whose update is within the clipping norm is returned as it is, not recomputed as ``reference +
update``: float arithmetic would change its last bits, and clipping that does nothing must change
nothing (tests/test_privacy.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from flwr.common import NDArrays

# The fit config keys a lowest node sends its devices with local DP (hfl.node.privacy).
LOCAL_CLIP = "dp_local_clip"
LOCAL_NOISE = "dp_local_noise"
LOCAL_SEED = "dp_local_seed"


def update_norm(model: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """The L2 norm of ``model - reference`` over all its arrays flattened together (Flower's
    ``get_norm`` of the update), in float64."""
    total = 0.0
    for m, r in zip(model, reference, strict=True):
        d = np.asarray(m, dtype=np.float64) - np.asarray(r, dtype=np.float64)
        total += float(np.dot(d.ravel(), d.ravel()))
    return math.sqrt(total)


def clip_factor(norm: float, clip: float | None) -> float:
    """min(1, C / norm): the factor that brings an update of ``norm`` within ``clip`` (None: no clipping)."""
    if clip is None or math.isinf(clip) or norm <= clip:
        return 1.0
    return clip / norm


def clip_model(model: NDArrays, reference: NDArrays, clip: float | None) -> tuple[NDArrays, bool]:
    """``reference + min(1, C/||model - reference||) (model - reference)`` and whether it was
    clipped; an update within the norm leaves ``model`` itself (its exact bits)."""
    factor = clip_factor(update_norm(model, reference), clip)
    if factor >= 1.0:
        return model, False
    return [(r + factor * (np.asarray(m) - r)).astype(np.asarray(m).dtype, copy=False)
            for m, r in zip(model, reference, strict=True)], True


def gaussian_like(arrays: Sequence[np.ndarray], std: float, generator: np.random.Generator) -> NDArrays:
    """Independent N(0, std^2) noise shaped as ``arrays`` (in their dtypes), drawn array by array in order."""
    return [generator.normal(0.0, std, np.shape(a)).astype(np.asarray(a).dtype, copy=False) for a in arrays]


def add_noise(model: NDArrays, std: float, generator: np.random.Generator) -> NDArrays:
    """``model + N(0, std^2)``; ``std`` 0 returns ``model`` itself (no draw, no change of a bit)."""
    if std == 0:
        return model
    return [np.asarray(m) + z for m, z in zip(model, gaussian_like(model, std, generator), strict=True)]


def privatize_local(model: NDArrays, reference: NDArrays, clip: float, noise_multiplier: float,
                    generator: np.random.Generator) -> NDArrays:
    """Local DP: a device's reply with its update clipped to ``clip`` and N(0, (noise_multiplier x
    clip)^2) added to each coordinate, before it leaves the device (no server is trusted)."""
    clipped, _ = clip_model(model, reference, clip)
    return add_noise(clipped, noise_multiplier * clip, generator)
