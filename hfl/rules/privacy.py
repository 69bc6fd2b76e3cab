"""Differential privacy of a node's round (central DP) and its accounting, as pure functions.

Central DP at a node (McMahan et al. 2018, as Flower's ``DifferentialPrivacyServerSide*Clipping``
wrappers): every child's update (its model minus the model the node sent this round) is clipped
to norm C, and Gaussian noise of std ``noise_multiplier x C x max_i w_i / sum_i w_i`` is added to
their mean (``sigma C / n`` with equal weights, Flower's ``compute_stdv``; a weighted mean moves by
at most ``C max w / sum w`` when one child changes). Adaptive clipping (Andrew et al. 2021) moves C
toward a target quantile of the update norms from a noised count of unclipped updates, and
splits the noise between the count and the model (Flower's ``compute_adaptive_noise_params``).

The accountant is Opacus' RDP accountant for the subsampled Gaussian mechanism: ``q`` the share
of children a node samples per round, ``steps`` the rounds so far.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from flwr.common import NDArrays

from hfl.device.privacy import add_noise, clip_model, gaussian_like, update_norm


@dataclass(frozen=True)
class CentralOutcome:
    """A round's privatized replies: the models (each clipped, the same noise added to each, so
    that any mean of them is the noised mean) and what the round tells adaptive clipping."""

    models: list[NDArrays]
    clipped: int  # updates whose norm exceeded C
    std: float  # the noise's standard deviation


def noise_std(noise_multiplier: float, clip: float, weights: Sequence[float]) -> float:
    """``noise_multiplier x C x max(w) / sum(w)``: Flower's ``sigma C / n`` for equal weights."""
    if noise_multiplier == 0:
        return 0.0
    return noise_multiplier * clip * max(weights) / float(sum(weights))


def privatize_central(models: Sequence[NDArrays], weights: Sequence[float], reference: NDArrays,
                      clip: float | None, noise_multiplier: float,
                      generator: np.random.Generator) -> CentralOutcome:
    """Each model's update clipped to ``clip`` (None: not clipped), then one draw of noise (std
    ``noise_std``, shaped as the reference) added to every model: a weighted or plain mean of the
    result is the mean of the clipped models plus that noise. Noise 0 and no clipping return the
    models themselves."""
    clipped, count = [], 0
    for model in models:
        out, was = clip_model(model, reference, clip)
        clipped.append(out)
        count += was
    if noise_multiplier and clip is None:
        raise ValueError("noise needs a clipping norm (privacy.clip)")
    std = noise_std(noise_multiplier, clip, weights) if noise_multiplier else 0.0
    if std == 0:
        return CentralOutcome(clipped, count, 0.0)
    z = gaussian_like(reference, std, generator)
    return CentralOutcome([[np.asarray(m) + n for m, n in zip(model, z, strict=True)] for model in clipped],
                          count, std)


def count_unclipped(models: Sequence[NDArrays], reference: NDArrays, clip: float) -> int:
    """How many updates are within the norm ``clip`` (adaptive clipping's count)."""
    return sum(update_norm(m, reference) <= clip for m in models)


def adaptive_noise(noise_multiplier: float, children: int, count_stddev: float | None) -> tuple[float, float]:
    """(the count's noise std, the model's noise multiplier) that together give ``noise_multiplier``
    (Andrew et al. 2021, Thm 1: z_model = (z^-2 - (2 sigma_b)^-2)^-1/2), by Flower's
    ``compute_adaptive_noise_params``; ``count_stddev`` None: ``children / 20``."""
    try:  # Flower 1.42 keeps its DP helpers in flwr.supercore; earlier releases in flwr.common
        from flwr.supercore.differential_privacy import compute_adaptive_noise_params
    except ImportError:  # pragma: no cover - Flower 1.41
        from flwr.common.differential_privacy import compute_adaptive_noise_params

    return compute_adaptive_noise_params(noise_multiplier, children, count_stddev)


def next_clip(clip: float, unclipped: int, children: int, quantile: float, lr: float, count_std: float,
              generator: np.random.Generator) -> float:
    """Geometric update of C: ``C exp(-lr (b - quantile))``, b the share of unclipped updates with
    N(0, count_std^2) added to their count (Andrew et al. 2021, Alg. 1)."""
    noise = float(generator.normal(0.0, count_std)) if count_std > 0 else 0.0
    share = (unclipped + noise) / children
    return clip * math.exp(-lr * (share - quantile))


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε spent after ``steps`` subsampled Gaussian rounds (Opacus' RDP accountant); 0 before any
    step, inf without noise."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    return float(accountant.get_epsilon(delta))


def noise_for_epsilon(target_epsilon: float, sample_rate: float, steps: int, delta: float) -> float:
    """The smallest noise multiplier (within Opacus' tolerance, 0.01 in ε) whose ε after ``steps``
    rounds is at most ``target_epsilon``."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate,
                                      steps=steps, accountant="rdp"))


__all__ = ["CentralOutcome", "add_noise", "adaptive_noise", "clip_model", "count_unclipped", "epsilon",
           "next_clip", "noise_for_epsilon", "noise_std", "privatize_central", "update_norm"]
