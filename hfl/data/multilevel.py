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


class BlockPaths(Sequence[list[int]]):
    """Every device's cluster at each level (``block_of`` per level, coarse to fine), computed
    when read: a federation of a million devices lists none of them at start-up."""

    def __init__(self, num_devices: int, levels: Sequence[int]) -> None:
        self.num_devices, self.levels = num_devices, [int(n) for n in levels]

    def __len__(self) -> int:
        return self.num_devices

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - an int or a slice, as Sequence's
        if isinstance(index, slice):
            return [self[d] for d in range(*index.indices(self.num_devices))]
        d = index + self.num_devices if index < 0 else index
        if not 0 <= d < self.num_devices:
            raise IndexError(f"device {index} does not exist: the federation has {self.num_devices} devices")
        return [block_of(d, self.num_devices, n) for n in self.levels]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockPaths):
            return (self.num_devices, self.levels) == (other.num_devices, other.levels)
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment] - mutable-sequence semantics, as the list it stands for


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


def shared_parts(seed: int, clusters: Sequence[int], scales: Sequence[float],
                 shape: tuple[int, int]) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """The global part and every cluster's part (what devices share), each scaled."""
    model = scales[0] * rng(seed, "multilevel", "global").standard_normal(shape)
    parts = [[scales[1 + level] * rng(seed, "multilevel", level, c).standard_normal(shape) for c in range(count)]
             for level, count in enumerate(clusters)]
    return model, parts


def device_model(device: int, num_devices: int, seed: int, clusters: Sequence[int], scales: Sequence[float],
                 shared: tuple[np.ndarray, list[list[np.ndarray]]]) -> np.ndarray:
    """Device ``device``'s [W_d, b_d]: the global part, its clusters' parts and its own part."""
    model, parts = shared
    return (model + sum(parts[level][block_of(device, num_devices, count)] for level, count in enumerate(clusters))
            + scales[-1] * rng(seed, "multilevel", "device", device).standard_normal(model.shape))


def true_models(num_devices: int, seed: int, clusters: Sequence[int], scales: Sequence[float],
                shape: tuple[int, int]) -> list[np.ndarray]:
    """Every device's [W_d, b_d]: the global part, its clusters' parts and its own part."""
    shared = shared_parts(seed, clusters, scales, shape)
    return [device_model(d, num_devices, seed, clusters, scales, shared) for d in range(num_devices)]


class DeviceGenerator:
    """Device by device: what devices share is drawn once, each device's own model and samples
    from its own streams, so device d's data is the same whether or not the others are made
    (a lazy federation makes a device only when it is asked for; hfl.data.federation)."""

    def __init__(self, num_devices: int, seed: int, *, clusters: Sequence[int], scales: Sequence[float], beta: float,
                 num_features: int, num_classes: int, size_mean: float, size_sigma: float, min_samples: int,
                 max_samples: int | None) -> None:
        self.clusters = check_clusters(clusters, num_devices)
        if len(scales) != len(self.clusters) + 2:
            raise ConfigError("dataset.scales", f"needs {len(self.clusters) + 2} entries (global, one per cluster "
                                                f"level, device), got {len(scales)}")
        self.num_devices, self.seed, self.scales, self.beta = num_devices, seed, list(scales), beta
        self.num_features = num_features
        self.sizes = (size_mean, size_sigma, min_samples, max_samples)
        self.shared = shared_parts(seed, self.clusters, self.scales, (num_classes, num_features + 1))

    def num_samples(self, device: int) -> int:
        """The device's sample count (the first draw of its samples stream), nothing generated."""
        return device_size(rng(self.seed, "multilevel", "samples", device), *self.sizes)

    def device(self, device: int) -> tuple[np.ndarray, np.ndarray]:
        """``(x float32 (n, f), y int64 (n,))`` of one device."""
        w = device_model(device, self.num_devices, self.seed, self.clusters, self.scales, self.shared)
        g = rng(self.seed, "multilevel", "samples", device)
        n = device_size(g, *self.sizes)
        return labeled_samples(g, g.normal(0.0, self.beta, size=self.num_features), w[:, :-1], w[:, -1], n)


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
    gen = DeviceGenerator(num_devices, seed, clusters=clusters, scales=scales, beta=beta, num_features=num_features,
                    num_classes=num_classes, size_mean=size_mean, size_sigma=size_sigma, min_samples=min_samples,
                    max_samples=max_samples)
    return [gen.device(d) for d in range(num_devices)]
