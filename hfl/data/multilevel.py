"""Synthetic data with multi-level structure: every device's true model is the sum of a global
part, one part per cluster level it belongs to, and its own part, so that what a team (or a
region) shares exists in data we make ourselves.

For device d, with clusters ``C_1 | C_2 | ... | C_L`` per level (nested, coarse to fine, each
dividing the next) and scales ``s_0, s_1..s_L, s_dev``:

    [W_d, b_d] = s_0 G + sum_l s_l A_{l, c_l(d)} + s_dev D_d,   every matrix ~ N(0, 1), shape (C, f+1)
    x ~ N(v_d, Sigma),  v_d ~ N(0, beta) per feature,  Sigma_jj = j^-1.2 (the Synthetic recipe)
    y = argmax(W_d x + b_d)

``c_l(d)`` is the contiguous id block ``round(c n / C_l) <= d < round((c+1) n / C_l)``, the teams
of ``topology.formation=sequential``: with ``clusters: [4]`` and 4 sequential teams, each team's
devices share their cluster's part.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hfl.data.synthetic import device_size, labeled_samples
from hfl.errors import ConfigError
from hfl.seed import rng


def block_of(device: int, num_devices: int, num_blocks: int) -> int:
    """The contiguous block of ``num_blocks`` (sizes differ by at most one) holding ``device``."""
    return next(c for c in range(num_blocks) if device < round((c + 1) * num_devices / num_blocks))


def check_clusters(clusters: Sequence[int], num_devices: int) -> list[int]:
    counts = [int(c) for c in clusters]
    if any(isinstance(c, bool) or c < 1 for c in clusters):
        raise ConfigError("dataset.clusters", f"must be positive integers, got {list(clusters)!r}")
    for coarse, fine in zip(counts, counts[1:]):
        if fine % coarse:
            raise ConfigError("dataset.clusters", f"levels must nest: {fine} clusters do not split {coarse} evenly")
    if counts and counts[-1] > num_devices:
        raise ConfigError("dataset.clusters", f"{counts[-1]} clusters but only {num_devices} devices")
    return counts


def true_models(num_devices: int, seed: int, clusters: Sequence[int], scales: Sequence[float],
                shape: tuple[int, int]) -> list[np.ndarray]:
    """Every device's [W_d, b_d]: the global part, its clusters' parts and its own part."""
    model = scales[0] * rng(seed, "multilevel", "global").standard_normal(shape)
    parts = [[scales[1 + level] * rng(seed, "multilevel", level, c).standard_normal(shape) for c in range(count)]
             for level, count in enumerate(clusters)]
    return [model + sum(parts[level][block_of(d, num_devices, count)] for level, count in enumerate(clusters))
            + scales[-1] * rng(seed, "multilevel", "device", d).standard_normal(shape) for d in range(num_devices)]


def generate(
    num_devices: int,
    seed: int,
    *,
    clusters: Sequence[int],
    scales: Sequence[float],
    beta: float,
    num_features: int,
    num_classes: int,
    size_mean: float,
    size_sigma: float,
    min_samples: int,
    max_samples: int | None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One ``(x float32 (n, f), y int64 (n,))`` pair per device."""
    counts = check_clusters(clusters, num_devices)
    if len(scales) != len(counts) + 2:
        raise ConfigError("dataset.scales", f"needs {len(counts) + 2} entries (global, one per cluster level, "
                                            f"device), got {len(scales)}")
    models = true_models(num_devices, seed, counts, scales, (num_classes, num_features + 1))
    out = []
    for d, w in enumerate(models):
        g = rng(seed, "multilevel", "samples", d)
        n = device_size(g, size_mean, size_sigma, min_samples, max_samples)
        out.append(labeled_samples(g, g.normal(0.0, beta, size=num_features), w[:, :-1], w[:, -1], n))
    return out
