"""The clock's settings checked before training, naming the key (hfl.config.checks calls these)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hfl.clock.model import Clock, is_per_level
from hfl.clock.policy import LevelPolicy
from hfl.clock.shift import run_shift
from hfl.errors import ConfigError


def check_clock(cfg: Mapping, depth: int, server: type, fed: Any) -> None:
    """Refuse a clock that cannot run: bad figures, a policy for a level the tree lacks, a policy
    other than sync for an algorithm whose node step is no weighted merge."""
    clock = cfg["clock"]
    if not clock["enabled"]:
        if float(cfg["algorithm"].get("background_every", 0.0) or 0.0) > 0:
            raise ConfigError("algorithm.background_every", "devices' own sessions run in simulated time: "
                                                            "set clock.enabled=true")
        return
    if cfg["runtime"].get("name") == "deployment":
        check_real_time(cfg)
    Clock.from_config(clock, int(cfg["seed"]))
    shift = run_shift(cfg)
    if shift is not None and shift.kind == "rotate" and len(fed.input_shape) != 3:
        raise ConfigError("clock.shift.kind", f"rotate needs images; {cfg['dataset']['name']} has inputs of shape "
                                              f"{tuple(fed.input_shape)}: use permute or labels")
    alg = cfg["algorithm"]
    for level in range(depth):
        policy = LevelPolicy.for_level(clock, level)
        if policy.kind == "sync":
            continue
        if not getattr(server, "merges_replies", False):
            raise ConfigError("clock.policy", f"{policy.kind} at level {level} merges replies that arrive late or "
                                              f"stale, which needs a node step that is a weighted merge (fedavg, "
                                              f"hierfavg, bhfl, the mean-based baselines); algorithm "
                                              f"{alg['name']!r} is not one: use sync")
        if alg.get("residual_down") or int(alg.get("residual_up_k", 0) or 0):
            raise ConfigError("clock.policy", f"{policy.kind} merges models as weighted deltas; B-HFL's residual "
                                              "edges send more than the model: use sync, or residual edges off")
        if policy.carries and alg["sampling"] == "devices":
            raise ConfigError("clock.policy", f"{policy.kind} keeps children busy across rounds, which "
                                              "algorithm.sampling=devices (the root's draw) does not allow")
    for key in ("policy", "deadline", "min_replies", "buffer", "concurrency", "latency", "bandwidth"):
        value = clock.get(key)
        if is_per_level(value):
            if len(value) != depth:
                raise ConfigError(f"clock.{key}", f"has {len(value)} entries; this tree of depth {depth} needs "
                                                  f"{depth} (levels 0..{depth - 1}, root first)")


def check_real_time(cfg: Mapping) -> None:
    """A deployment's clock is the wall clock (hfl.clock.realtime): its nodes' policies run on real
    arrivals; what only simulated time models (devices coming and going, drifting data, devices'
    own sessions) is refused naming its key. The speeds and links are the real ones: the
    settings that model them are not read."""
    clock = cfg["clock"]
    refused = [("clock.availability.online", float(clock["availability"]["online"]) < 1, "real devices come and go"),
               ("clock.shift.kind", str(clock["shift"]["kind"]) != "none", "real data drifts on its own"),
               ("clock.trace", bool(clock["trace"]), "real devices have their own speeds"),
               ("algorithm.background_every", float(cfg["algorithm"].get("background_every", 0.0) or 0.0) > 0,
                "devices' own sessions run in simulated time")]
    for key, set_, why in refused:
        if set_:
            raise ConfigError(key, f"a deployment runs on the wall clock ({why}): this setting is for "
                                   "runtime=simulation and runtime=inprocess")
