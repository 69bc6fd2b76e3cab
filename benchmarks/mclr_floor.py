"""The arithmetic floor of the PerMFL MNIST MCLR preset's global round on this CPU: FLOPs of the
batched dual-form path (hfl.accel.mclr_dual, with hfl.accel.mclr_dual.dual_buckets' padding) counted from the
preset's device sizes, and this core's rate on those products (single-thread ``torch.bmm`` on the
shapes of the preset's costliest bucket), against a 1024² SGEMM. Prints the seconds the arithmetic
alone would take, to set against ``benchmarks/speed.py``'s measured seconds per round.

    .venv/bin/python benchmarks/mclr_floor.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import MNIST_ROOT, config  # noqa: E402 - benchmarks/ is no package
from timing import median_seconds  # noqa: E402

from hfl.accel.mclr_dual import dual_buckets  # noqa: E402
from hfl.runtime.build import federation_for  # noqa: E402


def gflop_per_second(flops: float, fn: Callable[[], object], repeats: int = 30) -> float:
    """Median rate of ``fn`` over ``repeats`` calls (after a warm-up)."""
    return flops / median_seconds(fn, repeats, warmup=3) / 1e9


def main() -> int:
    torch.set_num_threads(1)  # as the runtimes' torch_threads
    cfg = config(["experiment=permfl_mnist_mclr", f"dataset.root={MNIST_ROOT}"])
    alg, fed = cfg["algorithm"], federation_for(cfg)
    k, steps, batch = int(alg["team_rounds"]), int(alg["local_steps"]), int(cfg["dataset"]["batch_size"])
    classes, features = fed.num_classes, fed.devices[0].x_train[0].numel()
    step_flops = setup_flops = primal_flops = 0.0
    costliest = (0, 0, 0)  # the bucket with the most step arithmetic: its shapes are timed
    for team in fed.level1_devices:
        sizes = [len(fed.devices[d].y_train) for d in team]
        for bucket in dual_buckets(sizes, batch, steps):
            n, devices = max(sizes[i] for i in bucket), len(bucket)
            costliest = max(costliest, (devices * n * n, n, devices))
            step_flops += 2 * k * steps * devices * classes * min(batch, n) * n  # [D,C,n] @ [D,n,B]
            setup_flops += 2 * k * devices * 2 * classes * n * features  # W0 X^T and M X, once a phase
        primal_flops += sum(2 * k * steps * 2 * classes * min(batch, n) * features for n in sizes)
    _, n, devices = costliest
    coef, rows = torch.randn(devices, classes, n), torch.randn(devices, n, min(batch, n))
    weights, x = torch.randn(devices, classes, features), torch.randn(devices, n, features)
    step_rate = gflop_per_second(2 * devices * classes * n * min(batch, n), lambda: torch.bmm(coef, rows))
    setup_rate = gflop_per_second(2 * devices * classes * n * features, lambda: torch.bmm(weights, x.transpose(1, 2)))
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    sgemm_rate = gflop_per_second(2 * 1024**3, lambda: a @ b, repeats=10)
    seconds = step_flops / 1e9 / step_rate + setup_flops / 1e9 / setup_rate
    print(f"PerMFL MNIST MCLR preset: {len(fed.level1_devices)} teams, {len(fed.devices)} devices, K = {k}, L = {steps}, "
          f"batch {batch}; per global round:")
    print(f"  dual-form steps   {step_flops / 1e9:6.2f} GFLOP  at {step_rate:5.1f} GFLOP/s (bmm, {devices} devices "
          f"x {n} rows)")
    print(f"  phase set-up      {setup_flops / 1e9:6.2f} GFLOP  at {setup_rate:5.1f} GFLOP/s (W0 X^T and M X)")
    print(f"  (primal steps     {primal_flops / 1e9:6.2f} GFLOP)")
    print(f"  1024^2 SGEMM peak {sgemm_rate:5.1f} GFLOP/s")
    print(f"  arithmetic alone: {seconds:.3f} s on one core, {seconds / 2:.3f} s on two")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
