"""One batched training step of PerMFL's MNIST CNN for D devices: ``torch.func.vmap`` over the
module (hfl.accel.batched.functional_batched_loss_and_grad) against the grouped-convolution form the
batched path uses (hfl.accel.grouped_cnn), medians of timed steps, and how far their gradients differ.

    .venv/bin/python benchmarks/cnn_step.py                       # the CPU, D = 4
    python3 benchmarks/cnn_step.py --device cuda --devices 10,40  # a GPU (benchmarks/device/)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hfl.accel.batched import functional_batched_loss_and_grad  # noqa: E402
from hfl.accel.grouped_cnn import cnn_batched_loss_and_grad  # noqa: E402
from hfl.models import CNN  # noqa: E402
from hfl.device.training import LocalTrainer  # noqa: E402


def timed(step, params, x, y, w, repeats: int, sync) -> float:  # noqa: ANN001
    """Median seconds of a step followed by its update, after one warm-up step."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        _, grads = step(params, x, y, w)
        params = [p - 0.01 * g for p, g in zip(params, grads, strict=True)]
        sync()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--devices", default="4", help="comma-separated D values")
    parser.add_argument("--batch", type=int, default=124, help="images a device step (PerMFL's 124)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = CNN((1, 28, 28), 10)
    vmapped = functional_batched_loss_and_grad(LocalTrainer(model))
    model.to(dev)
    print(f"PerMFL MNIST CNN, one batched step of D devices x {args.batch} images on {dev} "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"  {'D':>4} {'vmap ms':>9} {'grouped ms':>11} {'ratio':>6} {'max rel. grad diff':>19}")
    for d in (int(v) for v in args.devices.split(",")):
        params = [torch.stack([p.detach() + 0.01 * torch.randn_like(p) for _ in range(d)]) for p in model.parameters()]
        x = torch.randn(d, args.batch, 1, 28, 28, device=dev)
        y = torch.randint(0, 10, (d, args.batch), device=dev)
        w = torch.full((d, args.batch), 1.0 / args.batch, device=dev)
        tf32 = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False  # the comparison in full float32
        diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in
                   zip(cnn_batched_loss_and_grad(params, x, y, w)[1], vmapped(params, x, y, w)[1], strict=True))
        torch.backends.cudnn.allow_tf32 = tf32
        v = timed(vmapped, params, x, y, w, args.repeats, sync)
        g = timed(cnn_batched_loss_and_grad, params, x, y, w, args.repeats, sync)
        print(f"  {d:>4} {v * 1e3:9.2f} {g * 1e3:11.2f} {g / v:6.3f} {diff:19.1e}")


if __name__ == "__main__":
    main()
