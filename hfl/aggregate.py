"""Pure helpers every strategy shares: validating updates and (weighted) means."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Arrays = list[np.ndarray]


def update_problem(update: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> str | None:
    """Why ``update`` cannot be aggregated with models shaped like ``reference``, or None."""
    if len(update) != len(reference):
        return f"{len(update)} tensors, expected {len(reference)}"
    for i, (u, r) in enumerate(zip(update, reference, strict=True)):
        if u.shape != r.shape:
            return f"tensor {i} has shape {u.shape}, expected {r.shape}"
        if not np.all(np.isfinite(u)):
            return f"tensor {i} has NaN or Inf values"
    return None


def mean_of(models: Sequence[Arrays], weights: Sequence[float] | None = None) -> Arrays:
    """Mean of models, uniform or weighted (weights need not be normalised)."""
    if not models:
        raise ValueError("cannot average zero models")
    if weights is None:
        weights = [1.0] * len(models)
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {total}")
    return [
        sum(w * m[i] for w, m in zip(weights, models, strict=True)) / total  # type: ignore[misc]
        for i in range(len(models[0]))
    ]


def nbytes(tensors: Sequence[bytes]) -> int:
    """Bytes of a Flower ``Parameters.tensors`` payload."""
    return sum(len(t) for t in tensors)
