"""What the peers share: reading the exported federation, the model, the device's epoch order,
and the one line of results each peer prints. Needs numpy and torch only (it runs in the peers'
own virtual environments, without hfl installed): the model is hfl's own class, imported from the
repository's ``hfl/models``, which needs torch alone.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for hfl/models
from hfl.models import build_model  # noqa: E402 - torch and hfl.errors only

RESULT_PREFIX = "PEER_RESULT "  # the driver finds the peer's results by this prefix on stdout


class Federation:
    """The exported federation (benchmarks/peers/peers_export.py): device d's rows of the concatenated
    arrays, as torch tensors sharing the arrays' memory (no copy per device)."""

    def __init__(self, path: str | Path, splits: Sequence[str] = ("train", "test")) -> None:
        with np.load(path) as f:
            self.meta = {k: f[k].item() for k in ("devices", "per_round", "local_steps", "batch_size", "seed",
                                                  "learning_rate", "num_classes")}
            self.init = [f[f"init_{i}"] for i in range(int(f["num_init"]))]
            self.input_shape = tuple(int(v) for v in f["input_shape"])
            self.model = str(f["model"])
            self.arrays = {}
            for split in splits:  # a process reads only the splits it needs (the server: test)
                self.arrays[split] = (torch.from_numpy(f[f"x_{split}"]), torch.from_numpy(f[f"y_{split}"]),
                                      f[f"{split}_offsets"])
        self.devices = int(self.meta["devices"])
        self.num_classes = int(self.meta["num_classes"])

    def device(self, d: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        x, y, offsets = self.arrays[split]
        return x[offsets[d]:offsets[d + 1]].view(-1, *self.input_shape), y[offsets[d]:offsets[d + 1]]

    def union(self, split: str = "test") -> tuple[torch.Tensor, torch.Tensor]:
        """Every device's ``split`` together (the central evaluator's data)."""
        x, y, _ = self.arrays[split]
        return x.view(-1, *self.input_shape), y

    def to(self, device: torch.device | str) -> None:
        """Move every split's samples to ``device`` (a GPU peer slices its batches there)."""
        self.arrays = {split: (x.to(device), y.to(device), offsets) for split, (x, y, offsets) in self.arrays.items()}

    def build_model(self) -> nn.Module:
        """The workload's model (hfl's class), with hfl's initial weights."""
        model = build_model({"name": self.model}, self.input_shape, self.num_classes)
        with torch.no_grad():
            for p, value in zip(model.parameters(), self.init, strict=True):
                p.copy_(torch.from_numpy(value))
        return model

    def size(self, d: int, split: str = "train") -> int:
        offsets = self.arrays[split][2]
        return int(offsets[d + 1] - offsets[d])


_CACHED: dict[tuple[str, tuple[str, ...]], Federation] = {}


def cached_federation(path: str | Path, splits: Sequence[str] = ("train",)) -> Federation:
    """The federation at ``path``, read once per process. It lives in this module, which worker
    processes import by name: a cache in a script's ``__main__`` would travel with each pickled
    client function and be read again for every client."""
    key = (str(path), tuple(splits))
    if key not in _CACHED:
        _CACHED[key] = Federation(path, splits)
    return _CACHED[key]


def epoch_batches(n: int, batch_size: int, count: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """``count`` minibatches of indices into a device's ``n`` samples: a fresh shuffle each epoch,
    consecutive slices of ``batch_size`` (the last of an epoch short), epochs repeated until
    ``count`` are drawn. hfl's devices draw the same way (hfl.device.training.BatchSampler),
    except that hfl keeps the position between rounds while the peers' clients, stateless, start
    a new epoch every round."""
    drawn = 0
    while drawn < count:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            if drawn == count:
                return
            yield order[start:start + batch_size]
            drawn += 1


def device_generator(seed: int, device: int, round_: int) -> torch.Generator:
    """A device's minibatch stream in one round, reproducible from the workload's seed."""
    return torch.Generator().manual_seed((seed * 1_000_003 + device) * 10_007 + round_)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Pooled accuracy and mean loss of ``model`` on ``(x, y)``."""
    with torch.no_grad():
        out = model(x)
        return float((out.argmax(1) == y).float().mean()), float(nn.functional.nll_loss(out, y))


def report(framework: str, round_seconds: Sequence[float], final_accuracy: float, **extra: object) -> None:
    """Print the peer's results as one JSON line for the driver (round_seconds: one per round)."""
    timed = list(round_seconds[1:-1]) or list(round_seconds)  # not round 1 (warm-up) nor the evaluated last
    print(RESULT_PREFIX + json.dumps({"framework": framework, "round_seconds": list(round_seconds),
                                      "seconds_per_round": statistics.median(timed),
                                      "accuracy": final_accuracy, **extra}), flush=True)
