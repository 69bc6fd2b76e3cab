"""Dataset shift in simulated time (``clock.shift``): each device's data drift phase by phase,
``period`` simulated seconds a phase, the same way for its training, validation and test splits
(a device is tested on the distribution it lives in now).

- ``labels``: the device holds ``memory`` samples of its stream (0: as many as its data has); in
  phase p a share ``dominance`` of them come from one of its classes, the p-th of a seeded order of
  its classes (cycling), the rest uniformly from all its data: label-distribution drift.
- ``permute``: the features (pixels) are permuted by a seeded permutation per phase (phase 0: none):
  permuted-MNIST blocks.
- ``rotate``: images are rotated by ``p x angle`` degrees: rotated-MNIST blocks.

Draws depend on (seed, device, phase, split) alone, like every other draw (hfl.seed).
"""

from __future__ import annotations

import math

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from hfl.data.federation import DeviceData
from hfl.errors import ConfigError
from hfl.seed import rng

SHIFTS = ("none", "labels", "permute", "rotate")


@dataclass(frozen=True)
class Shift:
    seed: int
    kind: str = "none"
    period: float = 60.0
    memory: int = 0
    dominance: float = 0.8
    angle: float = 30.0

    @classmethod
    def from_config(cls, shift: Mapping, seed: int) -> Shift:
        made = cls(int(seed), str(shift.get("kind", "none")), float(shift.get("period", 60.0)),
                   int(shift.get("memory", 0)), float(shift.get("dominance", 0.8)), float(shift.get("angle", 30.0)))
        if made.kind not in SHIFTS:
            raise ConfigError("clock.shift.kind", f"unknown {made.kind!r}; known: {', '.join(SHIFTS)}")
        if not (made.period > 0 and math.isfinite(made.period)):
            raise ConfigError("clock.shift.period", f"must be a finite number > 0, got {made.period}")
        if made.memory < 0:
            raise ConfigError("clock.shift.memory", f"must be >= 0, got {made.memory}")
        if not 0 <= made.dominance <= 1:
            raise ConfigError("clock.shift.dominance", f"must be in [0, 1], got {made.dominance}")
        if not math.isfinite(made.angle):
            raise ConfigError("clock.shift.angle", f"must be a finite number, got {made.angle}")
        return made

    def phase(self, t: float) -> int:
        return int(t // self.period)

    def apply(self, data: DeviceData, t: float) -> DeviceData:
        """The device's data as they are at simulated time ``t``."""
        p = self.phase(t)
        if self.kind == "none" or (p == 0 and self.kind != "labels"):
            return data
        splits = {}
        for name in ("train", "val", "test"):
            x, y = getattr(data, f"x_{name}"), getattr(data, f"y_{name}")
            splits[name] = self.split(data.device_id, x, y, p, name, data.y_train)
        return DeviceData(data.device_id, *splits["train"], *splits["test"], x_val=splits["val"][0],
                          y_val=splits["val"][1])

    def split(self, device: int, x: torch.Tensor, y: torch.Tensor, p: int, name: str,
              y_train: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not len(y):
            return x, y
        if self.kind == "permute":
            features = int(np.prod(x.shape[1:]))
            order = torch.from_numpy(rng(self.seed, "shift-permute", p).permutation(features))
            return x.reshape(len(x), -1)[:, order].reshape(x.shape).contiguous(), y
        if self.kind == "rotate":
            if x.dim() != 4:
                raise ConfigError("clock.shift.kind", f"rotate needs images (N, C, H, W); these data are {tuple(x.shape)}")
            from torchvision.transforms.v2.functional import rotate

            return rotate(x, self.angle * p).contiguous(), y
        # labels: the phase's dominant class among those the device trains on
        classes = np.unique(y_train.numpy())
        order = rng(self.seed, "shift-order", device).permutation(classes)
        dominant = int(order[p % len(order)])
        n = len(y) if name != "train" or not self.memory else self.memory
        draw = rng(self.seed, "shift-labels", device, p, name)
        of_dominant = np.flatnonzero(y.numpy() == dominant)
        k = round(self.dominance * n) if len(of_dominant) else 0
        index = np.concatenate([draw.choice(of_dominant, size=k), draw.choice(len(y), size=n - k)]) if k \
            else draw.choice(len(y), size=n)
        index = torch.from_numpy(np.sort(index))
        return x[index].contiguous(), y[index].contiguous()


def run_shift(cfg: Mapping) -> Shift | None:
    """The run's dataset shift, or None (no clock, or ``clock.shift.kind: none``)."""
    clock = cfg["clock"]
    shift = clock["shift"]
    if not clock["enabled"] or shift["kind"] == "none":
        return None
    return Shift.from_config(shift, int(cfg["seed"]))
