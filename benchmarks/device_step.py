"""One device's local training of the MNIST CNN on the CPU (issue 50): milliseconds per step of
20-step fits at batch 10 from 75 samples (the peer workload's ``mnist_cnn`` device), one torch
thread, for

- ``plain``: an ``nn.Module`` with ``torch.optim.SGD`` (``zero_grad``, ``backward``, ``step``), the loop
  pfl-research and Flower's clients run;
- ``hfl-plain-layers``: hfl's per-device path with the plain max-pool layers, the update evaluated
  out of place and glibc's default heap (hfl's step before issue 50);
- ``hfl``: hfl's per-device path (``hfl.device.plan.run_plan``'s ``run_local_steps``).

Each variant runs in fresh processes, ``alone`` (one process) and ``pair`` (two at once, as two Ray
actors on two cores), the variants interleaved ``--repeats`` times; printed: medians over repeats
of each process's median step, and with ``--profile`` the top operators of hfl's step
(torch.profiler), which is where its time goes.

    .venv/bin/python benchmarks/device_step.py                # ~2 min on 2 cores
    .venv/bin/python benchmarks/device_step.py --repeats 5 --profile
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("plain", "hfl-plain-layers", "hfl")
STEPS, BATCH, SAMPLES, LR = 20, 10, 75, 0.05


def child(variant: str, fits: int, profile: bool) -> None:
    sys.path.insert(0, str(REPO))
    import torch
    import torch.nn.functional as F

    from hfl.device import training
    from hfl.device.plan import prox_update
    from hfl.models import CNN
    from hfl.device.allocator import keep_freed_memory

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.rand(SAMPLES, 1, 28, 28), torch.randint(0, 10, (SAMPLES,))
    if variant == "plain":
        model = CNN((1, 28, 28), 10)
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        def fit(seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            order = torch.cat([torch.randperm(SAMPLES, generator=g) for _ in range(3)])
            for i in range(STEPS):
                idx = order[i * BATCH:(i + 1) * BATCH]
                opt.zero_grad()
                F.nll_loss(model(x[idx]), y[idx]).backward()
                opt.step()
    else:
        if variant == "hfl":
            keep_freed_memory()
            update = lambda: prox_update(LR, 0.0, None)  # noqa: E731
        else:
            training.fast_cpu_layers = lambda model: model  # the plain pools
            update = lambda: (lambda p, g: [t - LR * gr for t, gr in zip(p, g, strict=True)])  # noqa: E731
        trainer = training.LocalTrainer(CNN((1, 28, 28), 10))
        start = trainer.initial_params()

        def fit(seed: int) -> None:
            training.run_local_steps(trainer, start, x, y, training.BatchSampler(SAMPLES, BATCH, seed), STEPS, update())

    for seed in range(3):
        fit(seed)  # warm-up
    times = []
    for seed in range(fits):
        begin = time.perf_counter()
        fit(seed)
        times.append((time.perf_counter() - begin) / STEPS)
    print(f"{statistics.median(times) * 1e3:.3f}")
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for seed in range(5):
                fit(seed)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), file=sys.stderr)


def run(variant: str, processes: int, fits: int) -> list[float]:
    procs = [subprocess.Popen([sys.executable, __file__, "--child", variant, "--fits", str(fits)],
                              stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    return [float(p.communicate()[0].split()[0]) for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fits", type=int, default=15, help="20-step fits timed per process")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.fits, args.profile)
        return
    alone: dict[str, list[float]] = {v: [] for v in VARIANTS}
    pair: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for v in VARIANTS:
            alone[v] += run(v, 1, args.fits)
            pair[v] += run(v, 2, args.fits)
    print(f"MNIST CNN, {STEPS} steps at batch {BATCH}, 1 thread; ms per step, median of {args.repeats} repeats")
    print(f"{'variant':<18} {'alone':>7} {'pair':>7} {'pair/alone':>11} {'vs plain alone':>15}")
    base = statistics.median(alone["plain"])
    for v in VARIANTS:
        a, p = statistics.median(alone[v]), statistics.median(pair[v])
        print(f"{v:<18} {a:7.2f} {p:7.2f} {p / a:11.2f} {a / base:15.2f}")
    if args.profile:
        subprocess.run([sys.executable, __file__, "--child", "hfl", "--fits", "3", "--profile"], check=True)


if __name__ == "__main__":
    main()
