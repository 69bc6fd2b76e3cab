"""The written protocol of an algorithm's servers: what a node of the tree (the root included)
does with its parent's message and with its children's replies.

An algorithm is three things (DESIGN.md): a server rule (a ``ServerRule`` subclass, named
``SERVER`` in its strategy module), a device client (``make_client`` in its client module) and
one config file (``conf/algorithm/<name>.yaml``, its hyper-parameters). What the algorithm *is* —
``any_depth``, ``personalized``, ``global_model``, ``level_models``, ``pm_base``, ``personal_heads``,
``reply_kind`` — are class attributes of its ``ServerRule``, read by the engine from the class.

The engine (hfl.node.strategy for inner nodes, hfl.node.root for the root) builds one rule per call of a
node — the root's one call is the whole run — from an explicit ``NodeContext``: the node's path
and level, the round path of the call, the parent's payload and the node's stored state. Every
round, the rule sees the accepted replies of its children (``Replies``: models, parts, weights,
metrics, the round), never a side channel. What it keeps between calls is ``state()``, saved
beside the node's model in the state store under ``node-<path>`` (``node-root`` for the root,
after every global round: a resumed run rebuilds the root's rule from it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np
from flwr.common import NDArrays, Scalar

from hfl.rules.aggregate import mean_of
from hfl.rules.payload import Payload
from hfl.tree.shape import level_of

# One message to the children: its arrays and the config entries that declare them (hfl.rules.payload.pack).
Message = tuple[NDArrays, dict[str, Scalar]]


class Update(NamedTuple):
    """One accepted reply of a child."""

    model: NDArrays  # the payload's main arrays
    num_examples: int
    metrics: Mapping[str, Scalar]
    parts: dict[str, NDArrays]  # every part of a ``parts`` payload (just the model otherwise)


@dataclass(frozen=True)
class Replies:
    """The accepted replies of one round of a node, in child order (device id or node path)."""

    round: int  # the node's round within its call (the root: the global round)
    round_path: str  # e.g. "3.2": round 2 of the node called in global round 3
    updates: Sequence[Update]

    @property
    def models(self) -> list[NDArrays]:
        return [u.model for u in self.updates]

    @property
    def weights(self) -> list[int]:
        return [u.num_examples for u in self.updates]

    def mean(self, weighted: bool = True) -> NDArrays:
        """The children's models averaged, by sample count if ``weighted``."""
        return mean_of(self.models, self.weights if weighted else None)


@dataclass(frozen=True)
class RunSettings:
    """What a rule reads of the run beyond its algorithm's keys."""

    seed: int
    global_rounds: int
    model: Mapping[str, Any]  # the model section, as hfl.models.build_model takes it
    batch_size: int  # dataset.batch_size: a server's own minibatches (B-HFL's proxy training)
    privacy: Mapping[str, Any] | None = None  # the privacy section: read by the engine (hfl.node.privacy), not rules

    @classmethod
    def of(cls, cfg: Mapping[str, Any]) -> RunSettings:
        return cls(int(cfg["seed"]), int(cfg["global_rounds"]), cfg["model"], int(cfg["dataset"]["batch_size"]),
                   cfg.get("privacy"))


@dataclass(frozen=True)
class NodeContext:
    """What a node's rule is built from, for one call (the root: for the run): the algorithm's
    own settings, typed by its schema (``ServerRule.schema``), and the node's place and inputs."""

    params: Any  # the algorithm's keys as its schema's dataclass (hfl.config.typed)
    run: RunSettings
    path: str  # "" for the root, "0", "0.1"...
    depth: int  # of the tree: devices sit at this level
    payload: Payload  # what the parent sent (the root: its initial model)
    state: dict[str, np.ndarray] | None  # what the node stored after its last call (or round, at the root)
    fed: Any  # hfl.data.Federation
    round_path: str = ""  # the round of the parent that called it ("" at the root)
    run_dir: Path | None = None  # the root's: where a rule may write files of its own

    @property
    def level(self) -> int:
        return level_of(self.path)

    @property
    def is_root(self) -> bool:
        return self.path == ""

    @property
    def is_lowest(self) -> bool:
        """Whether this node's children are devices."""
        return self.level == self.depth - 1


@dataclass(frozen=True)
class Nature:
    """What a node's rule is, as the engine's node reads it when its rule is not built (its
    evaluation): ``ServerRule.nature``."""

    personalized: bool  # devices keep a model of their own, tested as PM
    global_model: bool  # the root's model is a predictor the evaluation tests (GM)
    pm_base: str | None  # "gm": a device's PM is the root's model completed by its own part (PFLEGO)
    level_models: bool  # false: the servers' models are no predictors (gradient servers)
    evaluation_context: Callable[[Mapping[str, np.ndarray] | None], dict[str, NDArrays]]  # ctx_* parts for PMs
    device_evaluation_config: dict[str, Scalar]  # a lowest node's devices' config when they test their PM
    devices_change_when_tested: bool  # a lowest node saves its devices after evaluating (B-HFL's sessions)


def model_from_state(state: Mapping[str, np.ndarray] | None) -> NDArrays | None:
    """The node model kept in a stored state (``w_0``, ``w_1``…)."""
    if not state:
        return None
    names = sorted((k for k in state if k.startswith("w_") and k[2:].isdigit()), key=lambda k: int(k[2:]))
    return [state[k] for k in names] or None


def model_state(model: NDArrays) -> dict[str, np.ndarray]:
    """A node model as stored entries (``w_0``, ``w_1``…)."""
    return {f"w_{i}": a for i, a in enumerate(model)}


class ServerRule:
    """An algorithm's server at one node, for one call from its parent (the root: the run).

    A subclass implements ``aggregate``; every other hook has the default written here. The
    engine calls, for a call of ``T`` rounds: ``start`` once, then per round ``prepare``,
    ``fit_message`` (and ``child_message`` per child), ``aggregate``; then ``state`` (stored)
    and, at an inner node, ``reply_parts`` (sent up with the model, as ``reply_kind``). At the
    root, evaluation rounds also call ``evaluation_message`` and ``evaluation_metrics``.
    """

    # ---- what the algorithm is: its nature, read by the engine from the class (never a config key:
    # hfl.config.schema.NATURE_KEYS refuses algorithm.<name> in a config). A subclass overrides them.
    reply_kind: ClassVar[str] = "model"  # what an inner node's reply is: "model" or "gradient" (hfl.rules.payload)
    personalized: ClassVar[bool] = False  # devices keep a model of their own: PM is tested
    global_model: ClassVar[bool] = True  # the root's model is a predictor: GM is tested (see has_global_model)
    level_models: ClassVar[bool] = True  # servers keep models that predict (false: gradient relays, cluster sums)
    pm_base: ClassVar[str | None] = None  # "gm": a device's PM is the root's model completed by the device's own part
    any_depth: ClassVar[bool] = False  # defined on any tree (false: three tiers only, root / servers / devices)
    personal_heads: ClassVar[bool] = False  # heads stay on devices, each of its own size K_i (algorithm.local_labels)
    # Whether the node step is a weighted merge of the children's models, so that a stale reply can be
    # merged as a weighted delta (hfl.clock.policy): the deadline and buffered policies need it.
    merges_replies: ClassVar[bool] = False
    # The dataclass typing the algorithm's own keys (a subclass of hfl.config.schema.AlgorithmConfig
    # or of one of its subclasses there, every field MISSING): registered as /schema/algorithm/<name>
    # for the config file that names it in its defaults list. None: the file names a schema of hfl's.
    schema: ClassVar[type | None] = None

    @classmethod
    def has_global_model(cls, params: Any) -> bool:
        """Whether the root's model is a predictor the evaluation tests (GM): ``global_model``,
        unless the algorithm's own keys decide it (FeMAM's levels)."""
        return cls.global_model

    # ---- checks, before training (raise hfl.errors.ConfigError naming the key)
    @classmethod
    def check_config(cls, alg: Mapping[str, Any]) -> None:
        """The algorithm's own keys; nothing by default."""

    @classmethod
    def check_federation(cls, cfg: Mapping[str, Any], fed: Any) -> None:
        """What needs the built tree and data (e.g. a validation split, a body/head model)."""

    @classmethod
    def device_evaluation_config(cls, params: Any, depth: int) -> dict[str, Scalar]:
        """Config the lowest servers add when their devices test their own model (PM): what a
        device that changes its model when asked needs (B-HFL's own training sessions, with the
        clock; Per-FedAvg's adaptation step for a device never trained); none by default."""
        return {}

    @classmethod
    def devices_change_when_tested(cls, params: Any) -> bool:
        """Whether testing a device's own model changes its state (B-HFL's sessions caught up):
        then the lowest servers save their devices after evaluating."""
        return False

    @classmethod
    def evaluation_context(cls, state: Mapping[str, np.ndarray] | None) -> dict[str, NDArrays]:
        """Parts named ``ctx_*`` a lowest node adds, from its stored state, to what its devices
        complete their personal model from (e.g. FeMAM's team model); none by default."""
        return {}

    @classmethod
    def nature(cls, params: Any, depth: int, lowest: bool) -> Nature:
        """What a node of this algorithm is, for the engine's node (hfl.node.client.NodeClient): this
        class's attributes, and what its methods decide from the algorithm's keys (``lowest``: the
        node's children are devices)."""
        return Nature(personalized=cls.personalized, global_model=cls.has_global_model(params), pm_base=cls.pm_base,
                      level_models=cls.level_models, evaluation_context=cls.evaluation_context,
                      device_evaluation_config=cls.device_evaluation_config(params, depth) if lowest else {},
                      devices_change_when_tested=lowest and cls.devices_change_when_tested(params))

    # ---- one call
    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.params = ctx.params  # the algorithm's keys, typed (its ``schema``)

    def start(self) -> NDArrays:
        """The node's model when the call begins: the parent's; the root's is the one it stored
        (a resumed run) or its initial model."""
        if self.ctx.is_root:
            return model_from_state(self.ctx.state) or self.ctx.payload.main
        return self.ctx.payload.main

    def fit_config(self) -> dict[str, Scalar]:
        """Config sent with every training message below an inner node (devices read their
        hyper-parameters from it); the root sends none."""
        return {}

    def prepare(self, rnd: int, model: NDArrays) -> NDArrays:
        """The model a round starts from (e.g. after training on the node's proxy data)."""
        return model

    def fit_message(self, rnd: int, model: NDArrays) -> Message:
        """What every child is sent to train: the model, or a payload with more in it."""
        return model, {}

    def child_message(self, rnd: int, message: Message, child: str) -> Message | None:
        """A message of its own for ``child`` (a device id ``"000042"`` or a node path), or None
        for the round's common one."""
        return None

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        """The node's model after a round: the update rule."""
        raise NotImplementedError(f"{type(self).__name__} does not implement aggregate")

    def state(self) -> dict[str, np.ndarray]:
        """What the node keeps beside its model until its next call (optimiser moments,
        samplers, schedules); nothing by default."""
        return {}

    def reply_parts(self) -> dict[str, NDArrays]:
        """Parts an inner node sends up beside its model (e.g. residual updates); none by default."""
        return {}

    # ---- the root's evaluation rounds
    def evaluation_message(self, model: NDArrays) -> Message:
        """What the level-1 nodes are sent to evaluate: the root's model, as ``gm``."""
        return model, {}

    def evaluation_metrics(self, model: NDArrays) -> dict[str, float]:
        """Metrics the root computes itself (e.g. on its proxy data); none by default."""
        return {}
