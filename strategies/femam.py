"""FeMAM (seeds/001) on the tree: the root owns the level schedule, the grouping and the pruning;
inner nodes relay; devices train the newest level of their additive model (clients.femam).

How a round's models travel (the rules are in strategies.femam_rules):
- **global level** (level 1, one group): every node returns the n-weighted mean of its children,
  which composes into the flat FedAvg mean (exact up to float summation order);
- **cluster levels** (K groups, re-clustered every round): a team cannot know a device's group
  before the root has clustered everyone, so each node relays its devices' models up unchanged
  (parts ``d<id>``) and the root clusters and averages them in device-id order, so any tree
  gives the flat run's models bit for bit; the root then sends all K group models and the
  assignment down, and the lowest node hands each device its group's model;
- **team level** (``algorithm.team_level``: one cluster level is the tree's lowest servers, fixed):
  each lowest server's mean over its devices is that group's model, kept in its own state;
  nothing is relayed;
- **personal level** (0 groups): each device trains and keeps its own model; only validation
  losses travel.
Every device also reports its validation loss (of the model it received) for the schedule and
the pruning. The first round of a new level also carries the finished level's final models
and keep decisions, which the devices freeze.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional  # noqa: UP035 - OmegaConf reads typing.List/Optional
import json
import logging
from collections.abc import Mapping

from omegaconf import MISSING
import numpy as np
from flwr.common import NDArrays, Scalar

from hfl.config.schema import HierFAVGConfig
from hfl.algorithm import Message, NodeContext, Replies, ServerRule
from hfl.rules.aggregate import mean_of
from hfl.data.federation import devices_without_validation
from hfl.errors import ConfigError
from hfl.rules.payload import pack
from hfl.rules.personal import check_keys
from hfl.seed import derive_seed
from strategies.femam_rules import (
    CLUSTER, GLOBAL, KIND_CODES, KINDS, PERSONAL, TEAM, Schedule, clustering_features, flat_model,
    group_means, keeps_level, kmeans_labels, last_kept, level_kind, nearest_labels,
)


log = logging.getLogger(__name__)
PRUNE = ("paper", "code", "none")
PRUNE_CODES = {name: i for i, name in enumerate(PRUNE)}
ASSIGN = ("kmeans", "nearest")
VAL_COLUMNS = 4  # device id, validation loss sum, validation samples, training samples


# ---------------------------------------------------------------- config
def kinds_of(alg: Mapping[str, Any]) -> list[str]:
    team = alg.get("team_level")
    return [level_kind(i, int(k), None if team is None else int(team)) for i, k in enumerate(alg["levels"])]


def check_config(alg: Mapping[str, Any]) -> None:
    levels = alg.get("levels")
    if not isinstance(levels, list | tuple) or not levels:
        raise ConfigError("algorithm.levels", f"must be a non-empty list of group counts, got {levels!r}")
    for k in levels:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError("algorithm.levels", f"entries are group counts >= 0 (0 = personal), got {k!r}")
    if 0 in levels[:-1]:
        raise ConfigError("algorithm.levels", "only the last level can be personal (0 groups)")
    team = alg.get("team_level")
    if team is not None and not (isinstance(team, int) and 2 <= team <= len(levels) and levels[team - 1] != 0):
        raise ConfigError("algorithm.team_level", f"must name a cluster level 2..{len(levels)} (1-based), got {team!r}")
    if alg.get("schedule") not in ("fixed", "convergence"):
        raise ConfigError("algorithm.schedule", f"unknown {alg.get('schedule')!r}; known: fixed, convergence")
    rounds = alg.get("rounds_per_level")
    if not isinstance(rounds, list | tuple) or len(rounds) != len(levels) or any(
            isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in rounds):
        raise ConfigError("algorithm.rounds_per_level", f"needs {len(levels)} integers >= 1 (one per level), got {rounds!r}")
    for key, known in (("prune", PRUNE), ("assign", ASSIGN)):
        if alg.get(key) not in known:
            raise ConfigError(f"algorithm.{key}", f"unknown {alg.get(key)!r}; known: {', '.join(known)}")
    check_keys(alg, prox={"minimum": 0}, converge_window={"integer": True, "minimum": 1},
               converge_tol={"minimum": 0}, prune_window={"integer": True, "minimum": 1},
               kmeans_n_init={"integer": True, "minimum": 1})
    if alg["local_epochs"] is not None:
        check_keys(alg, local_epochs={"integer": True, "minimum": 1})
    fixed = {"team_rounds": 1, "sampling": "children", "sample_fraction": 1.0, "weighted": True}
    for key, value in fixed.items():
        if alg.get(key, value) != value:
            raise ConfigError(f"algorithm.{key}", f"FeMAM needs {value!r} here (full participation, one round per "
                                                  f"call at every node), got {alg.get(key)!r}")
    if alg["level_rounds"] is not None and any(int(r) != 1 for r in alg["level_rounds"]):
        raise ConfigError("algorithm.level_rounds", "FeMAM runs one round per call at every node: every entry must be 1")


def check_federation(cfg: Mapping[str, Any], fed) -> None:  # noqa: ANN001 - hfl.data.Federation
    empty = devices_without_validation(fed)  # a lazy federation's without making its devices
    if empty:
        raise ConfigError("dataset.val_fraction", f"FeMAM's schedule and pruning need a validation split on every "
                                                  f"device; {len(empty)} have none (e.g. device {empty[0]}): set it > 0")


def schedule_of(alg: Mapping[str, Any]) -> Schedule:
    return Schedule(str(alg["schedule"]), tuple(int(r) for r in alg["rounds_per_level"]),
                    int(alg["converge_window"]), float(alg["converge_tol"]))


def info_array(level: int, kind: str, first: bool, prev_kind: str | None, prune: str) -> list[np.ndarray]:
    """[level (1-based), kind, first round of the level, kind of the level before (-1), prune mode]."""
    prev = KIND_CODES[prev_kind] if prev_kind else -1
    return [np.array([level + 1, KIND_CODES[kind], int(first), prev, PRUNE_CODES[prune]], dtype=np.int64)]


def parse_info(parts: Mapping[str, NDArrays], name: str = "info") -> dict[str, Any]:
    level, kind, first, prev, prune = (int(v) for v in parts[name][0])
    return {"level": level, "kind": KINDS[kind], "first": bool(first),
            "prev_kind": KINDS.get(prev), "prune": PRUNE[prune]}


def team_model(state: Mapping[str, np.ndarray] | None) -> NDArrays | None:
    """A lowest server's team-level model, kept in its state as team_0, team_1..."""
    if not state:
        return None
    names = sorted((k for k in state if k.startswith("team_")), key=lambda k: int(k[5:]))
    return [state[k] for k in names] or None


# ---------------------------------------------------------------- the root's schedule
def _groups_state(prefix: str, groups: Mapping[int, NDArrays]) -> dict[str, np.ndarray]:
    return {f"{prefix}.{k}.{i}": a for k, arrays in groups.items() for i, a in enumerate(arrays)}


def _groups_from(prefix: str, state: Mapping[str, np.ndarray]) -> dict[int, NDArrays]:
    found: dict[int, dict[int, np.ndarray]] = {}
    for key, value in state.items():
        if key.startswith(f"{prefix}."):
            k, i = key[len(prefix) + 1:].split(".")
            found.setdefault(int(k), {})[int(i)] = value
    return {k: [arrays[i] for i in sorted(arrays)] for k, arrays in sorted(found.items())}


class FemamRoot:
    """What the root keeps across global rounds: the level being trained, its groups and the
    assignment, the finished level's, every device's keep decisions and validation losses.
    ``state``/``restore`` write it to and read it from the root's stored state (hfl.node.root)."""

    def __init__(self, ctx: NodeContext, initial: NDArrays) -> None:
        p = self.params = ctx.params
        self.seed = ctx.run.seed
        self.num_rounds = ctx.run.global_rounds
        self.run_dir = ctx.run_dir
        self.kinds = kinds_of(vars(p))
        self.groups_per_level = [int(k) for k in p.levels]
        self.schedule = schedule_of(vars(p))
        self.prune = p.prune
        self.num_devices = len(ctx.fed.devices)
        n, levels = self.num_devices, len(self.kinds)
        self.level = 0
        self.groups: dict[int, NDArrays] = {0: initial}
        self.assign = np.zeros(n, dtype=np.int64)
        self.prev_groups: dict[int, NDArrays] = {}
        self.prev_assign = np.zeros(n, dtype=np.int64)
        self.kept = -np.ones((n, levels), dtype=np.int64)  # -1 not decided, 1 kept, 0 pruned
        self.val: list[list[list[float]]] = [[[] for _ in range(n)] for _ in range(levels)]
        self.mean_val: list[list[float]] = [[] for _ in range(levels)]
        self.level_rounds: list[int] = [0] * levels  # rounds each level has trained so far
        self.eval_view: dict[str, Any] = {}  # what this round's evaluation tests (set by aggregate)
        if ctx.state and "femam.level" in ctx.state:
            self.restore(ctx.state)

    def state(self) -> dict[str, np.ndarray]:
        out = {"femam.level": np.array(self.level), "femam.assign": self.assign, "femam.prev_assign": self.prev_assign,
               "femam.kept": self.kept, "femam.level_rounds": np.array(self.level_rounds, dtype=np.int64),
               **_groups_state("femam.groups", self.groups), **_groups_state("femam.prev_groups", self.prev_groups)}
        for level, per_device in enumerate(self.val):
            out[f"femam.val{level}.counts"] = np.array([len(v) for v in per_device], dtype=np.int64)
            out[f"femam.val{level}.values"] = np.array([x for v in per_device for x in v], dtype=np.float64)
            out[f"femam.mean_val{level}"] = np.array(self.mean_val[level], dtype=np.float64)
        return out

    def restore(self, state: Mapping[str, np.ndarray]) -> None:
        self.level = int(state["femam.level"])
        self.assign, self.prev_assign = np.array(state["femam.assign"]), np.array(state["femam.prev_assign"])
        self.kept = np.array(state["femam.kept"])
        self.level_rounds = [int(r) for r in state["femam.level_rounds"]]
        self.groups = _groups_from("femam.groups", state)
        self.prev_groups = _groups_from("femam.prev_groups", state)
        for level in range(len(self.kinds)):
            counts, values = state[f"femam.val{level}.counts"], state[f"femam.val{level}.values"].tolist()
            ends = np.cumsum(counts).tolist()
            self.val[level] = [values[end - int(c):end] for c, end in zip(counts, ends, strict=True)]
            self.mean_val[level] = state[f"femam.mean_val{level}"].tolist()

    @property
    def first(self) -> bool:
        """Whether the current level has not trained a round yet."""
        return self.level_rounds[self.level] == 0

    # -- messages
    def fit_message(self, model: NDArrays) -> Message:
        kind = self.kinds[self.level]
        prev_kind = self.kinds[self.level - 1] if self.level else None
        parts: dict[str, NDArrays] = {"model": model}
        if kind == CLUSTER:
            parts.update({f"g{k}": m for k, m in self.groups.items()})
            parts["assign"] = [self.assign]
        if self.first and self.level:
            if prev_kind == CLUSTER:
                parts.update({f"p{k}": m for k, m in self.prev_groups.items()})
                parts["prev_assign"] = [self.prev_assign]
            parts["keep"] = [self.kept[:, self.level - 1].copy()]
        parts["info"] = info_array(self.level, kind, self.first, prev_kind, self.prune)
        return pack("parts", parts)

    def evaluation_message(self, model: NDArrays) -> Message:
        view = self.eval_view or {"level": self.level, "groups": self.groups, "assign": self.assign, "decided": None}
        kind = self.kinds[view["level"]]
        parts: dict[str, NDArrays] = {"gm": model}
        if kind in (GLOBAL, CLUSTER):
            parts.update({f"ctx_g{k}": m for k, m in (view["groups"] if kind == CLUSTER else {0: model}).items()})
            parts["ctx_assign"] = [view["assign"] if kind == CLUSTER else np.zeros(self.num_devices, dtype=np.int64)]
        decided = view["decided"]
        parts["ctx_info"] = info_array(view["level"], kind, decided is not None, None, self.prune)
        parts["ctx_keep"] = [decided if decided is not None else np.ones(self.num_devices, dtype=np.int64)]
        return pack("parts", parts)

    # -- aggregation
    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        level, kind, rnd = self.level, self.kinds[self.level], replies.round
        rows = np.concatenate([u.parts["val"][0] for u in replies.updates if "val" in u.parts])
        rows = rows[np.argsort(rows[:, 0], kind="stable")]
        train_sizes = {int(r[0]): float(r[3]) for r in rows}
        losses = [float(r[1]) / float(r[2]) for r in rows]
        for r, loss in zip(rows, losses, strict=True):
            self.val[level][int(r[0])].append(loss)
        self.mean_val[level].append(float(np.mean(losses)))
        if len(rows) < self.num_devices:
            log.warning("femam round %d: %d of %d devices reported", rnd, len(rows), self.num_devices)
        new = model
        if kind == GLOBAL:
            new = replies.mean()
        elif kind == CLUSTER:
            relayed = {int(k[1:]): v for u in replies.updates for k, v in u.parts.items() if k.startswith("d") and k[1:].isdigit()}
            ids = sorted(relayed)
            self.regroup(rnd, ids, [relayed[i] for i in ids], [train_sizes[i] for i in ids])
        self.level_rounds[level] += 1
        last = level == len(self.kinds) - 1
        done = rnd >= self.num_rounds if last else \
            self.schedule.level_done(level, self.level_rounds[level], self.mean_val[level])
        self.eval_view = {"level": level, "groups": self.groups, "assign": self.assign.copy(), "decided": None}
        if done and self.kept[0, level] == -1:
            self.eval_view["decided"] = self.decide(level)
            self.write_levels()
            if not last:
                self.advance(new)
        return new

    def regroup(self, rnd: int, ids: list[int], models: list[NDArrays], weights: list[float]) -> None:
        k = self.groups_per_level[self.level]
        seed = derive_seed(self.seed, "femam-groups", rnd)
        if self.params.assign == "nearest" and not self.first:
            labels = nearest_labels(models, self.groups)  # FeSEM: nearest of last round's centres
        else:
            features = np.stack([clustering_features(m) if self.params.assign == "kmeans" else flat_model(m) for m in models])
            labels = kmeans_labels(features, k, seed, self.params.kmeans_n_init)
        previous = self.assign.copy()
        self.groups = group_means(models, weights, labels)
        self.assign = np.where(np.isin(previous, list(self.groups)), previous, min(self.groups))  # devices not heard from
        self.assign[ids] = labels

    def decide(self, level: int) -> np.ndarray:
        """Every device's keep decision for the level that just ended (level 1 is always kept)."""
        window = self.params.prune_window
        for device in range(self.num_devices):
            if level == 0 or self.prune == "none":
                keep = True
            else:
                reference = last_kept(self.kept[device], level)
                keep = keeps_level(self.val[level][device], self.val[reference][device], window)
            self.kept[device, level] = int(keep)
        log.info("femam: level %d ended after %d rounds; %d of %d devices keep it", level + 1,
                 self.level_rounds[level], int(self.kept[:, level].sum()), self.num_devices)
        return self.kept[:, level].copy()

    def advance(self, level1_model: NDArrays) -> None:
        """Start the next level: one group, a copy of the level-1 model."""
        self.prev_groups, self.prev_assign = self.groups, self.assign
        self.level += 1
        self.groups = {0: level1_model}
        self.assign = np.zeros(self.num_devices, dtype=np.int64)

    def write_levels(self) -> None:
        if self.run_dir is None:
            return
        record = {"levels": self.groups_per_level, "kinds": self.kinds, "rounds": self.level_rounds,
                  "prune": self.prune, "kept": {str(d): self.kept[d].tolist() for d in range(self.num_devices)}}
        (self.run_dir / "femam_levels.json").write_text(json.dumps(record, indent=1))

    def metrics(self) -> dict[str, float]:
        """The level this round trained (1-based) and the mean number of finished levels kept per client."""
        level = self.eval_view.get("level", self.level)
        kept = (self.kept == 1).sum(axis=1)
        return {"femam_level": float(level + 1), "femam_levels_kept_mean": float(kept.mean()) if len(kept) else 0.0}


# ---------------------------------------------------------------- the server
@dataclass
class FeMAMConfig(HierFAVGConfig):
    """FeMAM and FeSEM (strategies.femam)."""

    levels: List[int] = MISSING  # groups per level: 1 = global, K = clusters, 0 = personal (last only)
    team_level: Optional[int] = MISSING  # 1-based cluster level whose groups are the lowest servers (fixed)
    assign: str = MISSING  # kmeans | nearest
    schedule: str = MISSING  # fixed | convergence
    rounds_per_level: List[int] = MISSING
    converge_window: int = MISSING
    converge_tol: float = MISSING
    local_epochs: Optional[int] = MISSING
    prox: float = MISSING
    prune: str = MISSING  # paper | code | none
    prune_window: int = MISSING
    kmeans_n_init: int = MISSING
    level_rounds: Optional[List[int]] = MISSING


class FemamServer(ServerRule):
    """The root runs the schedule (FemamRoot). An inner node forwards the root's payload; the
    lowest node hands each device its own start model (and the model to freeze), then relays
    what the root needs: validation rows and, at cluster levels, every device's model."""

    schema = FeMAMConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    personalized = True  # PM = the mean of the client's kept levels' outputs
    level_models = False  # servers relay; their means are no predictors of their own
    any_depth = True  # the root clusters relayed device models: any tree gives the flat run's models

    @classmethod
    def has_global_model(cls, params: FeMAMConfig) -> bool:
        """GM = the level-1 model, where level 1 is one global group (FeMAM; not FeSEM's K centres)."""
        levels = params.levels
        return bool(levels) and level_kind(0, int(levels[0]), params.team_level) == GLOBAL

    check_config = staticmethod(check_config)  # the module's checks, above
    check_federation = staticmethod(check_federation)

    @classmethod
    def evaluation_context(cls, state: Mapping[str, np.ndarray] | None) -> dict[str, NDArrays]:
        """What a lowest server adds for its devices' PM: its team-level model, if it has one."""
        model = team_model(state)
        return {"ctx_node": model} if model is not None else {}

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        if ctx.is_root:
            self.root = FemamRoot(ctx, super().start())
            return
        self.parts = ctx.payload.parts
        self.info = parse_info(self.parts)
        self.team = team_model(ctx.state)
        self.mean: NDArrays | None = None
        self.replies: Replies | None = None

    def start(self) -> NDArrays:
        return super().start() if self.ctx.is_root else self.parts["model"]

    def fit_config(self) -> dict[str, Scalar]:
        p = self.params
        return {"alpha": p.alpha, "local_steps": p.local_steps, "prox": p.prox,
                "local_epochs": p.local_epochs or 0, "num_levels": len(p.levels),
                "femam_level": self.info["level"], "femam_kind": self.info["kind"],
                "femam_first": int(self.info["first"]), "prune": self.info["prune"]}

    def fit_message(self, rnd: int, model: NDArrays) -> Message:
        if self.ctx.is_root:
            return self.root.fit_message(model)
        return pack("parts", self.parts)  # forwarded as received; the lowest node: per device, below

    def child_message(self, rnd: int, message: Message, child: str) -> Message | None:
        if not self.ctx.is_lowest:
            return None
        device = int(child)
        parts = {"model": self.start_model(device)}
        extra: dict[str, Scalar] = {}
        if self.info["first"] and self.info["level"] > 1:
            parts["freeze"] = self.frozen_model(device)
            extra["femam_keep"] = int(self.parts["keep"][0][device])
        arrays, meta = pack("parts", parts)
        return arrays, {**meta, **extra}

    def start_model(self, device: int) -> NDArrays:
        kind, first = self.info["kind"], self.info["first"]
        if kind == CLUSTER:
            return self.parts[f"g{int(self.parts['assign'][0][device])}"]
        if kind == TEAM and not first:
            return self.team if self.team is not None else self.parts["model"]
        if kind == PERSONAL and not first:
            return []  # the device trains the model it keeps
        return self.parts["model"]  # the global model; a new level starts as its copy

    def frozen_model(self, device: int) -> NDArrays:
        """The device's final model of the level that just ended."""
        prev = self.info["prev_kind"]
        if prev == CLUSTER:
            return self.parts[f"p{int(self.parts['prev_assign'][0][device])}"]
        if prev == TEAM:
            if self.team is None:
                raise RuntimeError("the team level ended but this server holds no team model")
            return self.team
        return self.parts["model"]  # the global level: the root's model stopped moving when it ended

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        if self.ctx.is_root:
            return self.root.aggregate(model, replies)
        self.replies = replies
        self.mean = mean_of(replies.models, replies.weights)
        return self.mean

    def reply_parts(self) -> dict[str, NDArrays]:
        rows, relay = [], {}
        for update in self.replies.updates:
            if "device_id" in update.metrics:
                device = int(update.metrics["device_id"])
                rows.append([device, float(update.metrics["val_loss_sum"]), int(update.metrics["val_n"]),
                             update.num_examples])
                if self.info["kind"] == CLUSTER:
                    relay[f"d{device:06d}"] = update.model
            else:
                rows.extend(update.parts["val"][0].tolist())
                relay.update({k: v for k, v in update.parts.items() if k.startswith("d") and k[1:].isdigit()})
        return {"val": [np.asarray(rows, dtype=np.float64).reshape(-1, VAL_COLUMNS)], **relay}

    def state(self) -> dict[str, np.ndarray]:
        if self.ctx.is_root:
            return self.root.state()
        # A lowest server keeps its team-level model (the mean of its devices while that level trains).
        model = self.mean if self.ctx.is_lowest and self.info["kind"] == TEAM else self.team
        return {f"team_{i}": a for i, a in enumerate(model)} if model is not None else {}

    def evaluation_message(self, model: NDArrays) -> Message:
        return self.root.evaluation_message(model)

    def evaluation_metrics(self, model: NDArrays) -> dict[str, float]:
        return self.root.metrics()


SERVER = FemamServer
