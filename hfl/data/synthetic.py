"""Synthetic(alpha, beta): the FedProx recipe that pFedMe and PerMFL use (alpha = beta = 0.5).

For device k:
    u_k ~ N(0, alpha),  B_k ~ N(0, beta)            (alpha, beta are standard deviations,
    W_k ~ N(u_k, 1)  shape (C, d),  b_k ~ N(u_k, 1)  as in FedProx's ``np.random.normal``)
    v_k ~ N(B_k, 1)  shape (d,)
    x   ~ N(v_k, Sigma),  Sigma diagonal, Sigma_jj = j^-1.2
    y   = argmax(W_k x + b_k)
    n_k = (int(lognormal(size_mean, size_sigma)) + min_samples) * size_scale, capped at max_samples.

size_scale = 5 gives the PerMFL authors' devices (their generator multiplies FedProx's sizes by 5).

alpha controls how much the local models differ, beta how much the local inputs differ.
"""

from __future__ import annotations

import numpy as np

from hfl.seed import rng


def generate_device(
    seed: int,
    device_id: int,
    *,
    alpha: float,
    beta: float,
    num_features: int,
    num_classes: int,
    size_mean: float,
    size_sigma: float,
    min_samples: int,
    max_samples: int | None,
    size_scale: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``(x float32 (n, d), y int64 (n,))`` of one device.

    Each device has its own random stream, so device k's data does not depend on how
    many devices the federation has.
    """
    g = rng(seed, "synthetic", device_id)
    n = device_size(g, size_mean, size_sigma, min_samples, max_samples, size_scale)
    u = g.normal(0.0, alpha)
    shift = g.normal(0.0, beta)
    w = g.normal(u, 1.0, size=(num_classes, num_features))
    b = g.normal(u, 1.0, size=num_classes)
    v = g.normal(shift, 1.0, size=num_features)
    return labeled_samples(g, v, w, b, n)


def num_samples(seed: int, device_id: int, *, size_mean: float, size_sigma: float, min_samples: int,
                max_samples: int | None, size_scale: int = 1, **_: object) -> int:
    """How many samples ``generate_device`` gives device ``device_id``, without generating them:
    the size is the first draw of the device's stream (checks of a lazy federation read it)."""
    return device_size(rng(seed, "synthetic", device_id), size_mean, size_sigma, min_samples, max_samples, size_scale)


def device_size(g: np.random.Generator, size_mean: float, size_sigma: float, min_samples: int,
                max_samples: int | None, size_scale: int = 1) -> int:
    """(int(lognormal(size_mean, size_sigma)) + min_samples) * size_scale, capped at max_samples."""
    n = (int(g.lognormal(size_mean, size_sigma)) + min_samples) * size_scale
    return n if max_samples is None else min(n, max_samples)


def labeled_samples(g: np.random.Generator, mean: np.ndarray, w: np.ndarray, b: np.ndarray, n: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """n inputs x ~ N(mean, Sigma), Sigma_jj = j^-1.2, labelled y = argmax(W x + b)."""
    # Diagonal covariance: scale independent standard normals by sqrt(Sigma_jj). In place: the
    # same numbers as mean + z * std, without two temporaries as large as the samples.
    std = np.arange(1, len(mean) + 1, dtype=np.float64) ** -0.6
    x = g.standard_normal((n, len(mean)))
    x *= std
    x += mean
    y = np.argmax(x @ w.T + b, axis=1)
    return x.astype(np.float32), y.astype(np.int64)


def generate(num_devices: int, seed: int, **params) -> list[tuple[np.ndarray, np.ndarray]]:
    """One ``(x, y)`` pair per device; ``params`` as in :func:`generate_device`."""
    return [generate_device(seed, k, **params) for k in range(num_devices)]
