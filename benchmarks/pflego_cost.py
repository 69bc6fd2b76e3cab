"""A device's cost per round: PFLEGO against FedPer at tau local steps (the paper's claim: O(1)
network passes per round for PFLEGO, O(tau) for FedPer).

Both run the device's ``fit`` of hfl's clients on the PFLEGO MNIST setting (MNIST test split,
100 devices, round-robin classes, MLP body 784 -> 200, full local batch, local labels). For
each it counts the body's forward passes (a forward hook) and the backward passes
(``torch.autograd.grad`` calls), and times ``fit`` (median over devices and repeats; one torch
thread). Neither device tests itself during fit here (fit_test off), so only training counts.

    .venv/bin/python benchmarks/pflego_cost.py                # tau = 50, 20 devices x 3 repeats
    .venv/bin/python benchmarks/pflego_cost.py --tau 10 --devices 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from clients import fedper, pflego  # noqa: E402
from hfl.config.compose import compose_config  # noqa: E402
from hfl.models import build_model  # noqa: E402
from hfl.data.labels import device_classes, device_data, model_classes  # noqa: E402
from hfl.runtime.build import device_runtime, federation_for, initial_model  # noqa: E402
from hfl.state.store import StateStore  # noqa: E402
from hfl.device.training import LocalTrainer  # noqa: E402
from reproduce_table1 import MNIST_ROOT  # noqa: E402


class Counter:
    """Body forward passes (and the samples they carried) and autograd backward passes."""

    def __init__(self, body: torch.nn.Module) -> None:
        self.forward = self.samples = self.backward = 0
        body.register_forward_hook(self._on_forward)
        self._grad = torch.autograd.grad

        def grad(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.backward += 1
            return self._grad(*args, **kwargs)

        torch.autograd.grad = grad

    def _on_forward(self, module, inputs, output) -> None:  # noqa: ANN001
        self.forward += 1
        self.samples += int(inputs[0].shape[0])

    def reset(self) -> None:
        self.forward = self.samples = self.backward = 0


def measure(name: str, make_client, params, config: dict, cfg: dict, devices: list[int], repeats: int) -> dict:  # noqa: ANN001
    fed = federation_for(cfg)
    trainer = LocalTrainer(build_model(cfg["model"], fed.input_shape, model_classes(cfg["algorithm"]["local_labels"], fed)))
    counter = Counter(trainer.model.body)
    store = StateStore(tempfile.mkdtemp(prefix="hfl-cost-"))
    seconds, per_fit = [], []
    for d in devices:
        dev = device_runtime(cfg, d, device_data(cfg, fed, d), trainer, store, device_classes(fed, d))
        client = make_client(dev)
        for _ in range(repeats):
            counter.reset()
            start = time.perf_counter()
            client.fit(params, config)
            seconds.append(time.perf_counter() - start)
            per_fit.append((counter.forward, counter.backward, counter.samples / len(dev.y_train)))
    torch.autograd.grad = counter._grad
    forwards, backwards, sample_passes = (statistics.median(v) for v in zip(*per_fit, strict=True))
    return {"name": name, "seconds": statistics.median(seconds), "forward": forwards, "backward": backwards,
            "data_passes": sample_passes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tau", type=int, default=50)
    parser.add_argument("--devices", type=int, default=20, help="devices timed (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mnist-root", default=str(MNIST_ROOT))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    common = (f"dataset=mnist dataset.root={args.mnist_root} dataset.partition=roundrobin dataset.classes_per_device=2 "
              "dataset.normalize=[0,1] dataset.batch_size=100000 model=mlp topology.num_teams=1 "
              "topology.devices_per_team=100 runtime=inprocess")
    pfl_cfg = compose_config(f"algorithm=pflego {common}", 0)
    per_cfg = compose_config(f"algorithm=fedper algorithm.local_labels=true {common}", 0)
    devices = list(range(args.devices))
    full = initial_model(per_cfg, federation_for(per_cfg))
    rows = [
        measure("pflego", pflego.make_client, full[:-2],
                {"alpha": 0.007, "local_steps": args.tau, "head_lr": 0.005, "seed": 0, "fit_test": False},
                pfl_cfg, devices, args.repeats),
        measure("fedper", fedper.make_client, full,
                {"alpha": 0.007, "local_steps": args.tau, "head_layers": 1, "fit_test": False},
                per_cfg, devices, args.repeats),
    ]
    print(f"device fit at tau = {args.tau}, MNIST MLP, full local batch; medians over {args.devices} devices "
          f"x {args.repeats} repeats, 1 torch thread")
    print(f"{'algorithm':<10} {'s/device':>10} {'forward':>8} {'backward':>9} {'data passes':>12}")
    for row in rows:
        print(f"{row['name']:<10} {row['seconds']:>10.4f} {row['forward']:>8.0f} {row['backward']:>9.0f} "
              f"{row['data_passes']:>12.1f}")
    print(f"FedPer / PFLEGO seconds per device: {rows[1]['seconds'] / rows[0]['seconds']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
