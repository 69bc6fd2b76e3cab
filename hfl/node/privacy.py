"""Differential privacy in the one driver every node runs (hfl.node.strategy.NodeStrategy): the
top-level ``privacy`` section says at which level of the tree (conf/config.yaml; docs/privacy.md).

- Central DP at level L: each node of level L (0 = the root) clips its children's updates and noises
  their mean (hfl.rules.privacy.privatize_central) before its rule sees them; with adaptive
  clipping its C is kept in its stored state (``privacy:clip``) from call to call, so a resumed
  run goes on with the same C.
- Local DP: the lowest servers tell their devices the clip and noise (fit config), and every device
  clips and noises its own reply before it leaves (hfl.device.client, hfl.device.privacy).

The accountant (``PrivacyPlan.epsilon``) is a function of the global round alone: the DP level's
rounds so far are ``round x`` its rounds per global round, its sampling rate is the share of
children its nodes ask. Nothing to carry over a resumption but the round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.common import Scalar

from hfl.algorithm import NodeContext, Update
from hfl.device.privacy import LOCAL_CLIP, LOCAL_NOISE, LOCAL_SEED
from hfl.errors import ConfigError
from hfl.rules import privacy as dp
from hfl.seed import rng

CLIP_KEY = "privacy:clip"  # adaptive clipping's current C, in a node's stored state
LOCAL = "local"
OFF = "off"


@dataclass(frozen=True)
class PrivacySettings:
    """The ``privacy`` section, typed (hfl.config.schema.PrivacyConfig; hfl.config.checks checks it)."""

    level: Any  # off | local | lowest | root | a node level (0: the root)
    clip: float | None  # C; None: no clipping
    adaptive: bool
    target_quantile: float
    clip_lr: float
    count_stddev: float | None
    noise_multiplier: float
    delta: float
    target_epsilon: float | None

    @classmethod
    def of(cls, section: Mapping[str, Any] | None) -> PrivacySettings | None:
        """None where the run has no privacy (no section: an older run; ``level: off``)."""
        if not section or str(section.get("level", OFF)).lower() in (OFF, "false", "none"):
            return None
        clip = section.get("clip")
        return cls(level=section["level"], clip=None if clip is None else float(clip),
                   adaptive=bool(section.get("adaptive", False)),
                   target_quantile=float(section.get("target_quantile", 0.5)),
                   clip_lr=float(section.get("clip_lr", 0.2)),
                   count_stddev=None if section.get("count_stddev") is None else float(section["count_stddev"]),
                   noise_multiplier=float(section.get("noise_multiplier", 0.0)),
                   delta=float(section.get("delta", 1e-5)),
                   target_epsilon=None if section.get("target_epsilon") is None else float(section["target_epsilon"]))

    def node_level(self, depth: int) -> int | None:
        """The level whose nodes apply central DP (0: the root; depth - 1: the lowest servers), None for local DP."""
        level = str(self.level).lower()
        if level == LOCAL:
            return None
        if level == "root":
            return 0
        if level == "lowest":
            return depth - 1
        return int(self.level)


@dataclass(frozen=True)
class PrivacyPlan:
    """What the accountant needs: the noise multiplier, the DP level's sampling rate and its rounds
    per global round, and δ."""

    noise_multiplier: float
    sample_rate: float
    steps_per_round: int
    delta: float
    target_epsilon: float | None = None

    def epsilon(self, global_round: int) -> float:
        """ε spent once ``global_round`` global rounds are done (Opacus' RDP accountant)."""
        return dp.epsilon(self.noise_multiplier, self.sample_rate, global_round * self.steps_per_round, self.delta)

    def over_budget(self, global_round: int) -> bool:
        """Whether ``global_round`` rounds would spend more than ``target_epsilon``."""
        return self.target_epsilon is not None and self.epsilon(global_round) > self.target_epsilon


def plan(settings: PrivacySettings, params: Any, depth: int) -> PrivacyPlan:
    """The accounting of a run (``params``: the algorithm's typed keys, hfl.config.typed). Central DP
    at level L: a device's subtree at L is one "user"; q is the share of children an L node asks
    (``sample_fraction`` of all devices with ``sampling=devices``, at the lowest level; 1 above it);
    steps per global round are the rounds of the levels 1..L multiplied. Local DP: every round of
    the lowest servers, with q = 1 (a server knows whom it asked: no amplification by sampling)."""
    level = settings.node_level(depth)
    last = depth - 1 if level is None else level
    steps = math.prod(params.rounds_at(lvl, depth) for lvl in range(1, last + 1))
    sigma = settings.noise_multiplier
    if level is None:
        q = 1.0
    elif params.sampling == "devices" and level == depth - 1:
        # The root draws the devices once per global round and every round of that global round asks the same
        # ones: one sampled event a global round, of `steps` Gaussian releases (noise sigma / sqrt(steps)).
        q, sigma, steps = float(params.sample_fraction), sigma / math.sqrt(steps), 1
    else:
        q = params.fraction_at(level)
    return PrivacyPlan(sigma, q, steps, settings.delta, settings.target_epsilon)


class NodePrivacy:
    """Central DP at one node for one call, or the fit config of a lowest node's devices (local DP)."""

    def __init__(self, settings: PrivacySettings, ctx: NodeContext) -> None:
        self.settings = settings
        self.ctx = ctx
        self.local = settings.node_level(ctx.depth) is None
        stored = (ctx.state or {}).get(CLIP_KEY)
        self.clip = float(np.asarray(stored).reshape(())) if settings.adaptive and stored is not None else settings.clip

    @classmethod
    def of(cls, ctx: NodeContext) -> NodePrivacy | None:
        """The node's privacy, if the run's ``privacy`` acts at its level (local DP: at the lowest servers)."""
        settings = PrivacySettings.of(getattr(ctx.run, "privacy", None))
        if settings is None:
            return None
        level = settings.node_level(ctx.depth)
        if level is not None and not 0 <= level < ctx.depth:
            raise ConfigError("privacy.level", f"{settings.level!r} is no server level of this tree: 0 (the root) to "
                                               f"{ctx.depth - 1} (the lowest servers)")
        if (ctx.is_lowest if level is None else ctx.level == level):
            return cls(settings, ctx)
        return None

    def device_config(self) -> dict[str, Scalar]:
        """Local DP: what the devices clip and noise their replies with (none with central DP)."""
        if not self.local:
            return {}
        s = self.settings
        return {LOCAL_CLIP: float(s.clip), LOCAL_NOISE: s.noise_multiplier, LOCAL_SEED: int(self.ctx.run.seed)}

    def privatize(self, updates: list[Update], reference: list[np.ndarray], round_path: str) -> tuple[list[Update], dict]:
        """The round's accepted updates, clipped and noised (central DP), and figures for the round's
        stats; adaptive clipping moves C for the node's next round."""
        if self.local or not updates:
            return updates, {}
        s = self.settings
        n = len(updates)
        multiplier, count_std = s.noise_multiplier, 0.0
        if s.adaptive:
            count_std, multiplier = dp.adaptive_noise(s.noise_multiplier, n, s.count_stddev)
        models = [u.model for u in updates]
        weights = [float(u.num_examples) for u in updates]
        seed = self.ctx.run.seed
        outcome = dp.privatize_central(models, weights, reference, self.clip, multiplier,
                                       rng(seed, "privacy", self.ctx.path, round_path))
        stats = {"dp_clipped": outcome.clipped, "dp_clip": float(self.clip) if self.clip is not None else -1.0}
        if s.adaptive:
            self.clip = dp.next_clip(self.clip, n - outcome.clipped, n, s.target_quantile, s.clip_lr, count_std,
                                     rng(seed, "privacy-count", self.ctx.path, round_path))
        out = []
        for update, model in zip(updates, outcome.models, strict=True):
            parts = {**update.parts, "model": model} if "model" in update.parts else update.parts
            out.append(Update(model, update.num_examples, update.metrics, parts))
        return out, stats

    def state(self) -> dict[str, np.ndarray]:
        """Adaptive clipping's C, stored beside the node's model (nothing otherwise)."""
        if self.settings.adaptive and not self.local:
            return {CLIP_KEY: np.asarray(self.clip, dtype=np.float64)}
        return {}
