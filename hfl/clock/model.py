"""The simulated clock's figures: each device's compute speed and availability, each edge level's
latency and bandwidth, all drawn from the run's seed (or read from a trace), never from this
machine's timing. A device's work takes ``steps x step_seconds / speed``; a message over the
edge below level ``d`` takes ``latency[d] + bytes / bandwidth[d]``.

Draws are counter-based like sampling (hfl.tree.sampling): a device's speed depends on (seed,
device id) alone, and whether it is online on (seed, device id, period), so any process computes
the same figures for any device without walking the others (a million devices cost nothing until
one is asked about).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from hfl.errors import ConfigError
from hfl.seed import derive_seed

SPEEDS = ("constant", "lognormal")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose outputs look uniform."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seed: int, stream: str, ids: np.ndarray, counter: np.ndarray | int = 0) -> np.ndarray:
    """Uniforms in (0, 1), one per id (and counter), from (seed, stream, id, counter) alone."""
    base = np.uint64(derive_seed(seed, "clock", stream))
    with np.errstate(over="ignore"):
        key = _mix(base + np.asarray(ids, dtype=np.uint64) * _GOLDEN)
        key = _mix(key + (np.asarray(counter, dtype=np.uint64) + np.uint64(1)) * _GOLDEN)
    return ((key >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def is_per_level(value: Any) -> bool:
    """Whether a setting is a list, one entry per level (root first), rather than one value for all."""
    return isinstance(value, Sequence) and not isinstance(value, str)


def level_entry(value: Any, level: int, key: str) -> Any:
    """A setting's value at ``level``: the one value, or the list's entry for the level."""
    if not is_per_level(value):
        return value
    if level >= len(value):
        raise ConfigError(key, f"has {len(value)} entries; level {level} needs one")
    return value[level]


def per_level(value: float | Sequence[float], level: int, key: str) -> float:
    """A per-level number: one for every level, or a list (root's edges first)."""
    return float(level_entry(value, level, key))


@dataclass(frozen=True)
class Clock:
    """The simulated figures of a run (``clock`` in the config, ``Clock.from_config``)."""

    seed: int
    step_seconds: float = 0.05
    speed: str = "constant"  # constant | lognormal
    speed_value: float = 1.0
    mu: float = 0.0
    sigma: float = 1.0
    period: float = 600.0  # availability: a device is online or not for a whole period
    online: float = 1.0  # probability of being online in a period
    latency: float | tuple[float, ...] = 0.0
    bandwidth: float | tuple[float, ...] = math.inf
    trace: Mapping[int, float] = field(default_factory=dict)  # device id -> speed (replaces the draw)

    @classmethod
    def from_config(cls, clock: Mapping, seed: int) -> Clock:
        speed = dict(clock["speed"])  # an override may replace these dicts whole: their entries keep defaults
        availability = dict(clock["availability"])
        trace = read_trace(clock["trace"]) if clock.get("trace") else {}

        def level_values(key: str) -> float | tuple[float, ...]:
            value = clock.get(key)
            return tuple(float(v) for v in value) if is_per_level(value) else float(value)

        made = cls(int(seed), float(clock["step_seconds"]), str(speed.get("distribution", "constant")),
                   float(speed.get("value", 1.0)), float(speed.get("mu", 0.0)), float(speed.get("sigma", 1.0)),
                   float(availability.get("period", 600.0)), float(availability.get("online", 1.0)),
                   level_values("latency"), level_values("bandwidth"), trace)
        made.check()
        return made

    def check(self) -> None:
        if self.speed not in SPEEDS:
            raise ConfigError("clock.speed.distribution", f"unknown {self.speed!r}; known: {', '.join(SPEEDS)}")
        for key, value in (("clock.step_seconds", self.step_seconds), ("clock.speed.value", self.speed_value),
                           ("clock.availability.period", self.period)):
            if not (value > 0 and math.isfinite(value)):  # an infinite step or period stops simulated time
                raise ConfigError(key, f"must be a finite number > 0, got {value}")
        if not 0 < self.online <= 1:
            raise ConfigError("clock.availability.online", f"must be in (0, 1], got {self.online}")
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ConfigError("clock.speed.sigma", f"must be a finite number >= 0, got {self.sigma}")
        if not math.isfinite(self.mu):
            raise ConfigError("clock.speed.mu", f"must be a finite number, got {self.mu}")
        for key, values in (("clock.latency", self.latency), ("clock.bandwidth", self.bandwidth)):
            for v in values if isinstance(values, tuple) else (values,):
                if not v >= 0 or (key == "clock.bandwidth" and v == 0) or (key == "clock.latency" and v == math.inf):
                    raise ConfigError(key, f"must be {'> 0' if key == 'clock.bandwidth' else '>= 0'}, got {v}")

    def speeds(self, device_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Each device's speed (work per simulated second relative to speed 1)."""
        ids = np.asarray(device_ids, dtype=np.int64)
        if self.speed == "constant":
            out = np.full(len(ids), self.speed_value)
        else:  # lognormal: exp(mu + sigma z), z standard normal by Box-Muller from two uniforms
            u1, u2 = uniforms(self.seed, "speed", ids, 0), uniforms(self.seed, "speed", ids, 1)
            z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
            out = np.exp(self.mu + self.sigma * z)
        for i, d in enumerate(ids.tolist()):
            if d in self.trace:
                out[i] = self.trace[d]
        return out

    def work_seconds(self, device_id: int, steps: int) -> float:
        """How long ``steps`` minibatch steps take on the device."""
        return steps * self.step_seconds / float(self.speeds([device_id])[0])

    def online_at(self, device_ids: Sequence[int] | np.ndarray, t: float) -> np.ndarray:
        """Which devices are online at simulated time ``t``."""
        ids = np.asarray(device_ids, dtype=np.int64)
        if self.online >= 1:
            return np.ones(len(ids), dtype=bool)
        return uniforms(self.seed, "online", ids, int(t // self.period)) < self.online

    def offline_between(self, device_id: int, start: float, end: float) -> float | None:
        """The first moment in [start, end] the device is offline (a period it is off begins,
        or ``start`` itself), or None if it stays online."""
        if self.online >= 1:
            return None
        first, last = int(start // self.period), int(end // self.period)
        periods = np.arange(first, last + 1)
        on = uniforms(self.seed, "online", np.full(len(periods), device_id), periods) < self.online
        off = np.flatnonzero(~on)
        if not len(off):
            return None
        return max(start, float(periods[off[0]]) * self.period)

    def message_seconds(self, level: int, nbytes: int) -> float:
        """A message of ``nbytes`` over an edge between level ``level`` and level ``level + 1``."""
        latency = per_level(self.latency, level, "clock.latency")
        bandwidth = per_level(self.bandwidth, level, "clock.bandwidth")
        return latency + (nbytes / bandwidth if math.isfinite(bandwidth) else 0.0)


def read_trace(path: str | Path) -> dict[int, float]:
    """A trace file: CSV with a header naming ``device_id`` and ``speed`` columns."""
    rows: dict[int, float] = {}
    try:
        with open(path, newline="") as f:
            for number, row in enumerate(csv.DictReader(f), start=2):
                try:
                    device, speed = int(row["device_id"]), float(row["speed"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise ConfigError("clock.trace", f"{path}, line {number}: needs device_id and speed ({exc})") from None
                if not speed > 0:
                    raise ConfigError("clock.trace", f"{path}, line {number}: speed must be > 0, got {speed}")
                rows[device] = speed
    except OSError as exc:
        raise ConfigError("clock.trace", f"cannot read {path}: {exc.strerror}") from None
    return rows


def run_clock(cfg: Mapping) -> Clock | None:
    """The run's clock (``clock.enabled``), or None: rounds take no simulated time. Made once per
    process and configuration: every node a message builds asks for it (a trace file is read once)."""
    clock = cfg["clock"]
    if not clock["enabled"]:
        return None
    return _clock(json.dumps(clock, sort_keys=True), int(cfg["seed"]))


@lru_cache(maxsize=4)
def _clock(clock: str, seed: int) -> Clock:
    return Clock.from_config(json.loads(clock), seed)
