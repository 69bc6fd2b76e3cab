"""The cost model behind the dual form's size groups (hfl.accel.mclr_dual.dual_buckets): times
single-thread ``run_dual_steps`` phases of D devices padded to n rows with minibatches W wide
(MNIST's 784 features, 10 classes, 20 steps, prox toward the start as PerMFL), fits

    seconds = S * (a*D*n*W + b*D*W + d) + c*D*n

(least squares on relative error), and prints the fitted constants in nanoseconds beside the ones
in hfl.accel.mclr_dual, each shape's measured and modelled times, and the preset's groups.

    .venv/bin/python benchmarks/dual_bucket_cost.py
"""

from __future__ import annotations

import numpy as np
import torch
from timing import median_seconds  # benchmarks/timing.py, beside this script

from hfl.accel import mclr_dual

CLASSES, FEATURES, STEPS = 10, 784, 20
SHAPES = [(2, 50, 50), (4, 100, 100), (10, 50, 50), (20, 30, 30), (5, 300, 124), (10, 300, 124), (3, 600, 124),
          (8, 600, 124), (20, 124, 124), (15, 200, 124), (1, 400, 124), (1, 100, 100), (6, 150, 124), (30, 60, 60)]
# the PerMFL MNIST MCLR preset's 40 training-set sizes (all 4 teams; experiment=permfl_mnist_mclr)
PRESET = [20, 22, 24, 27, 32, 37, 40, 46, 46, 50, 75, 75, 92, 104, 106, 109, 110, 124, 125, 144, 154, 154, 187,
          187, 192, 202, 234, 244, 250, 274, 278, 279, 289, 306, 325, 388, 458, 484, 574, 629]


def phase_seconds(devices: int, rows: int, width: int, repeats: int = 7) -> float:
    """Median seconds of one phase of ``devices`` devices of ``rows`` rows each."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, FEATURES, generator=g) * 0.3 for _ in range(devices)]
    theta = [(torch.randn(CLASSES, FEATURES, generator=g) * 0.01).expand(devices, -1, -1),
             (torch.randn(CLASSES, generator=g) * 0.1).expand(devices, -1)]
    local = torch.stack([torch.stack([torch.randperm(rows, generator=g)[:width] for _ in range(devices)])
                         for _ in range(STEPS)])
    weight = torch.full((STEPS, devices, width), 1.0 / width)
    labels = torch.randint(0, CLASSES, (STEPS, devices, width), generator=g)
    lr, lr_prox = torch.full((devices,), 0.01), torch.full((devices,), 0.005)
    data = mclr_dual.make_dual_data(xs, torch.device("cpu"))

    def phase() -> None:
        mclr_dual.run_dual_steps(data, theta, theta, local, weight, labels, lr, lr_prox, None, 1)

    return median_seconds(phase, repeats)


def main() -> int:
    torch.set_num_threads(1)  # as the runtimes' torch_threads
    measured = []
    for devices, rows, width in SHAPES:
        measured.append(phase_seconds(devices, rows, width))
    terms = np.array([[STEPS * d * n * w, STEPS * d * w, d * n, STEPS] for d, n, w in SHAPES], dtype=np.float64)
    seconds = np.array(measured)
    fit, *_ = np.linalg.lstsq(terms / seconds[:, None], np.ones(len(seconds)), rcond=None)
    print("D    n    W   measured ms  modelled ms")
    for (d, n, w), got, model in zip(SHAPES, seconds, terms @ fit, strict=True):
        print(f"{d:<4d} {n:<4d} {w:<4d} {1e3 * got:9.2f}  {1e3 * model:9.2f}")
    names = ["COST_PER_GRAM_ENTRY", "COST_PER_SAMPLE", "COST_PER_ROW", "COST_PER_STEP"]
    print("constant              fitted ns   hfl.accel.mclr_dual")
    for name, value in zip(names, fit * 1e9, strict=True):
        print(f"{name:21s} {value:10.3f}   {getattr(mclr_dual, name):10.3f}")
    groups = mclr_dual.dual_buckets(PRESET, 124, STEPS)
    print("MNIST preset's 40 devices in one phase, groups (devices x rows):",
          ", ".join(f"{len(g)}x{max(PRESET[i] for i in g)}" for g in groups))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
