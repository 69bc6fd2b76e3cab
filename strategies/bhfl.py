"""B-HFL (seeds/002, Algorithm 1): every node keeps a model and merges in both directions
with node optimisers (hfl.rules.nodeopt), on a tree of any depth.

One call of a node q at level d (EXECUTENODE):
1. theta_0 <- NODEOPT-down(W_q, parent's model)  [then each residual ancestor's model];
2. for t = 1..T_q: train theta on proxy data (if any), send it to a sample of the children,
   theta <- NODEOPT-up(theta, weighted mean of the children's models) [then the residual
   updates that grandchildren sent up];
3. W_q <- theta, kept with the optimiser states in the state store (node-<path>).
The root does the same with T_0 = global_rounds, its state kept under node-root.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, List, Optional  # noqa: UP035 - OmegaConf reads typing.List/Optional
import json
from collections.abc import Mapping, Sequence

from omegaconf import MISSING
import numpy as np
from flwr.common import NDArrays, Parameters, Scalar, parameters_to_ndarrays

from hfl.config.schema import HierFAVGConfig, NodeOptConfig
from hfl.rules.steps import sgd_step
from hfl.rules import nodeopt
from hfl.rules.aggregate import mean_of
from hfl.rules.personal import check_keys
from hfl.data import proxy_data
from hfl.errors import ConfigError, check_number_list
from hfl.models import build_model
from hfl.algorithm import Message, NodeContext, Replies, ServerRule, Update, model_from_state
from hfl.rules.payload import pack
from hfl.seed import derive_seed
from hfl.device.training import BatchSampler, LocalTrainer, run_local_steps, to_ndarrays, to_tensors


DIRECTIONS = ("up", "down")
RES_DOWN = "res_down"  # part names "res_down<level>": the model of the ancestor at that level
RES_UP = "res_up"  # part names "res_up<i>": a grandchild's update forwarded to its grandparent


# ---------------------------------------------------------------- rules (pure)
def spec_for(alg: Mapping[str, Any], level: int, direction: str) -> dict:
    """The checked optimiser spec of ``direction`` at ``level``: ``algorithm.<direction>`` with
    ``algorithm.levels.<level>.<direction>`` merged over it."""
    levels = alg.get("levels") or {}
    override = levels.get(str(level), levels.get(level)) or {}
    merged = {**alg[direction], **(override.get(direction) or {})}
    key = f"algorithm.levels.{level}.{direction}" if override.get(direction) else f"algorithm.{direction}"
    return nodeopt.check_spec(key, merged)


def sub_state(state: Mapping[str, np.ndarray] | None, prefix: str) -> dict[str, np.ndarray]:
    """The entries ``<prefix>.<name>`` of a stored state, as ``<name>``."""
    head = f"{prefix}."
    return {k[len(head):]: v for k, v in (state or {}).items() if k.startswith(head)}


def with_prefix(state: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}.{k}": v for k, v in state.items()}


def merge(spec: Mapping, model: NDArrays, target: NDArrays, state: Mapping[str, np.ndarray] | None
          ) -> tuple[NDArrays, dict[str, np.ndarray]]:
    """One node-optimiser merge of ``target`` into ``model`` (fresh state when there is none)."""
    return nodeopt.apply(spec, model, target, state or nodeopt.init_state(model))


def merge_down(alg: Mapping, level: int, kept: NDArrays | None, received: Mapping[str, NDArrays],
               state: Mapping[str, np.ndarray] | None) -> tuple[NDArrays, dict[str, np.ndarray]]:
    """theta_0 of a node (or device) at ``level``: its kept model merged with the parent's
    (``received["model"]``) by the level's ``down`` optimiser, then with each residual
    ancestor's model by ``residual_down_opt``. A node without a kept model starts from the
    parent's. Returns theta_0 and the new ``down``/``res_down*`` states."""
    parent = received["model"]
    if kept is None:
        theta, new_state = [np.array(a, copy=True) for a in parent], {}
    else:
        theta, down = merge(spec_for(alg, level, "down"), kept, parent, sub_state(state, "down"))
        new_state = with_prefix(down, "down")
    for name in sorted(n for n in received if n.startswith(RES_DOWN)):
        residual_spec = nodeopt.check_spec("algorithm.residual_down_opt", alg["residual_down_opt"])
        theta, edge = merge(residual_spec, theta, received[name], sub_state(state, name))
        new_state.update(with_prefix(edge, name))
    return theta, new_state


def largest_updates(current: NDArrays, models: Sequence[NDArrays], k: int) -> list[int]:
    """Indices of the ``k`` models farthest (L2 over all tensors) from ``current``, largest
    first; ties keep the given order."""
    norms = [float(np.sqrt(sum(float(np.sum((np.asarray(m) - c) ** 2)) for m, c in zip(model, current, strict=True))))
             for model in models]
    return sorted(range(len(models)), key=lambda i: -norms[i])[:k]


def merge_up(alg: Mapping, level: int, current: NDArrays, models: list[NDArrays], weights: list[int],
             residuals: list[NDArrays], state: Mapping[str, np.ndarray] | None
             ) -> tuple[NDArrays, dict[str, np.ndarray]]:
    """theta <- NODEOPT-up(theta, mean of the children) then, with residual updates from
    grandchildren, theta <- residual_up_opt(theta, their mean). Returns theta and the states."""
    target = mean_of(models, weights if alg["weighted"] else None)
    theta, up = merge(spec_for(alg, level, "up"), current, target, sub_state(state, "up"))
    new_state = with_prefix(up, "up")
    if residuals:
        spec = nodeopt.check_spec("algorithm.residual_up_opt", alg["residual_up_opt"])
        theta, res = merge(spec, theta, mean_of(residuals), sub_state(state, RES_UP))
        new_state.update(with_prefix(res, RES_UP))
    elif state:
        new_state.update(with_prefix(sub_state(state, RES_UP), RES_UP))
    return theta, new_state


def residual_parts(updates: Sequence[Update]) -> list[NDArrays]:
    """The residual updates the children forwarded (parts named ``res_up<i>``)."""
    return [arrays for u in updates for name, arrays in sorted(u.parts.items()) if name.startswith(RES_UP)]


# ---------------------------------------------------------------- checks
def check_config(alg: Mapping[str, Any]) -> None:
    for direction in DIRECTIONS:
        nodeopt.check_spec(f"algorithm.{direction}", alg[direction])
    nodeopt.check_spec("algorithm.residual_down_opt", alg["residual_down_opt"])
    nodeopt.check_spec("algorithm.residual_up_opt", alg["residual_up_opt"])
    levels = alg.get("levels") or {}
    if not isinstance(levels, Mapping):
        raise ConfigError("algorithm.levels", f"must be a mapping level -> {{up, down}}, got {levels!r}")
    for level, override in levels.items():
        if not str(level).isdigit():
            raise ConfigError("algorithm.levels", f"keys are tree levels (0 = root), got {level!r}")
        if not isinstance(override, Mapping) or set(override) - set(DIRECTIONS):
            raise ConfigError(f"algorithm.levels.{level}", f"may set only up and down, got {override!r}")
        for direction in override:
            spec_for(alg, int(level), direction)
    if not isinstance(alg.get("residual_down"), bool):
        raise ConfigError("algorithm.residual_down", f"must be true or false, got {alg.get('residual_down')!r}")
    # Ranges where a value can work, checked even while unused (proxy_samples null, the clock off):
    # a negative count or rate is a mistake whichever way it is later switched on.
    check_keys(alg, residual_up_k={"integer": True, "minimum": 0}, proxy_steps={"integer": True, "minimum": 1},
               proxy_lr={"minimum": 0, "open_min": True}, proxy_staleness={"minimum": 0, "maximum": 1},
               background_every={"minimum": 0}, background_max={"integer": True, "minimum": 0})
    if alg.get("proxy_samples") is not None:
        check_number_list("algorithm.proxy_samples", alg["proxy_samples"], "sizes per level", integer=True, minimum=0)


def check_federation(cfg: Mapping[str, Any], fed) -> None:  # noqa: ANN001 - hfl.data.Federation
    """Proxy sizes against the tree and the proxy pool, before training."""
    sizes = cfg["algorithm"].get("proxy_samples")
    if not sizes:
        return
    if len(sizes) != fed.tree.depth:
        raise ConfigError("algorithm.proxy_samples", f"has {len(sizes)} entries; this tree of depth {fed.tree.depth} "
                                                     f"needs one per server level 0..{fed.tree.depth - 1}")
    pool = 0 if fed.proxy_y is None else len(fed.proxy_y)
    if any(sizes) and pool == 0:
        raise ConfigError("dataset.proxy_fraction", "algorithm.proxy_samples trains servers on proxy data; "
                                                    "set dataset.proxy_fraction > 0 to carve a proxy pool")
    for level, n in enumerate(sizes):
        if n and not 2 <= n <= pool:
            raise ConfigError("algorithm.proxy_samples", f"level {level} asks for {n} proxy samples; the proxy pool "
                                                         f"holds {pool} (and a server needs at least 2)")


# ---------------------------------------------------------------- Flower wiring
def device_config(p: BHFLConfig, depth: int) -> dict:
    """What the lowest servers send their devices besides the model."""
    return {"alpha": p.alpha, "local_steps": p.local_steps, "persistent": p.persistent_devices,
            "background_every": p.background_every, "background_max": p.background_max,
            "down": json.dumps(spec_for(specs(p), depth, "down")),
            "residual_down": json.dumps(nodeopt.check_spec("algorithm.residual_down_opt", asdict(p.residual_down_opt)))}


def specs(p: BHFLConfig) -> dict[str, Any]:
    """The keys the pure merges read (``spec_for``, ``merge_down``, ``merge_up``), as the
    mapping they take (tests and B-HFL's devices hand them a few keys)."""
    return {"up": asdict(p.up), "down": asdict(p.down), "levels": p.levels, "weighted": p.weighted,
            "residual_down_opt": asdict(p.residual_down_opt), "residual_up_opt": asdict(p.residual_up_opt)}


@dataclass
class BHFLConfig(HierFAVGConfig):
    """BHFL's keys (conf/algorithm/bhfl.yaml), registered as /schema/algorithm/bhfl from here."""

    level_rounds: Optional[List[int]] = MISSING  # T_q per inner level 1..D-1
    sample_fraction: Any = MISSING  # a number or a list, root first
    up: NodeOptConfig = field(default_factory=NodeOptConfig)
    down: NodeOptConfig = field(default_factory=NodeOptConfig)
    levels: Any = MISSING  # per-depth overrides of up/down: {depth: {up: {...}, down: {...}}}
    persistent_devices: bool = MISSING
    residual_down: bool = MISSING
    residual_down_opt: NodeOptConfig = field(default_factory=NodeOptConfig)
    residual_up_k: int = MISSING
    residual_up_opt: NodeOptConfig = field(default_factory=NodeOptConfig)
    proxy_samples: Optional[List[int]] = MISSING  # per level 0..D-1
    proxy_steps: int = MISSING
    proxy_lr: float = MISSING
    proxy_async: bool = MISSING  # proxy training beside the children's round, merged late
    proxy_staleness: float = MISSING  # its update's factor at the merge
    background_every: float = MISSING  # simulated seconds between a persistent device's own sessions; 0 = off
    background_max: int = MISSING


class BHFLServer(ServerRule):
    """A node's call: merge down once (not at the root), then T_q rounds of (proxy training,
    broadcast, merge up). ``state`` is what the node keeps for its next call (at the root: for
    its next round)."""

    schema = BHFLConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    merges_replies = True  # the up merge takes the children's weighted mean (residual edges aside: hfl.clock.checks)
    personalized = True  # PM = each device's persistent model
    any_depth = True  # the proposal's tree is of any depth

    check_config = staticmethod(check_config)  # the module's checks, above
    check_federation = staticmethod(check_federation)

    @classmethod
    def device_evaluation_config(cls, params: BHFLConfig, depth: int) -> dict[str, Scalar]:
        if not params.background_every or not params.persistent_devices:
            return {}
        config = device_config(params, depth)  # its sessions' steps and rate
        return {k: config[k] for k in ("alpha", "local_steps", "background_every", "background_max")}

    @classmethod
    def devices_change_when_tested(cls, params: BHFLConfig) -> bool:
        return bool(cls.device_evaluation_config(params, 1))

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.specs, self.level, self.depth = specs(ctx.params), ctx.level, ctx.depth
        stored = ctx.state or {}
        self.down_state: dict[str, np.ndarray] = {}
        # The models of the ancestors this node passes on as residual edges (its parent's included).
        self.forward: dict[str, NDArrays] = {}
        if not ctx.is_root:
            received = ctx.payload.parts
            self.theta0, self.down_state = merge_down(self.specs, self.level, model_from_state(ctx.state), received, ctx.state)
            if self.params.residual_down:
                self.forward = {n: a for n, a in received.items() if n.startswith(RES_DOWN)}
                self.forward[f"{RES_DOWN}{self.level - 1}"] = received["model"]
        self.up_state = {k: v for k, v in stored.items() if k.startswith(("up.", RES_UP))}
        self.proxy = ProxyTrainer.maybe(ctx, ctx.state)
        self.residuals_out: list[NDArrays] = []
        self.proxy_delta: NDArrays | None = None  # proxy_async: this round's proxy training, merged late

    def start(self) -> NDArrays:
        return super().start() if self.ctx.is_root else self.theta0

    def fit_config(self) -> dict[str, Scalar]:
        return device_config(self.params, self.depth) if self.ctx.is_lowest else {}

    def prepare(self, rnd: int, model: NDArrays) -> NDArrays:
        if self.proxy is None:
            return model
        if self.params.proxy_async:
            # The proposal's async TRAIN: the children get the model before training; what the proxy
            # training moved is added at the merge, weighted by the staleness factor (proxy_delta).
            self.proxy_delta = [t - m for t, m in zip(self.proxy.train(model), model, strict=True)]
            return model
        return self.proxy.train(model)

    def fit_message(self, rnd: int, model: NDArrays) -> Message:
        if not self.forward:
            return model, {}
        return pack("parts", {"model": model, **self.forward})

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        k = self.params.residual_up_k
        if k and self.level >= 1:  # forwarded to the parent with this node's reply
            self.residuals_out = [replies.models[i] for i in largest_updates(model, replies.models, k)]
        theta, self.up_state = merge_up(self.specs, self.level, model, replies.models, replies.weights,
                                        residual_parts(replies.updates), self.up_state)
        if self.proxy_delta is not None:  # theta + proxy_staleness x the proxy training's update
            theta = sgd_step(theta, self.proxy_delta, -self.params.proxy_staleness)
            self.proxy_delta = None
        return theta

    def state(self) -> dict[str, np.ndarray]:
        proxy = self.proxy.state() if self.proxy is not None else {}
        return {**self.down_state, **self.up_state, **proxy}

    def reply_parts(self) -> dict[str, NDArrays]:
        """Parts sent up beside the node's model: the residual updates for the grandparent."""
        return {f"{RES_UP}{i}": m for i, m in enumerate(self.residuals_out)}

    def evaluation_metrics(self, model: NDArrays) -> dict[str, float]:
        if self.proxy is None:
            return {}
        accuracy, loss = self.proxy.evaluate(model)
        return {"gm_proxy_accuracy": accuracy, "gm_proxy_loss": loss}


SERVER = BHFLServer


class ProxyTrainer:
    """A server's minibatch SGD on its slice of the proxy pool (Algorithm 1, step 2a)."""

    def __init__(self, ctx: NodeContext, size: int, state) -> None:  # noqa: ANN001
        run, path, fed = ctx.run, ctx.path, ctx.fed
        self.data = proxy_data(fed, path, size, run.seed)
        self.trainer = LocalTrainer(build_model(run.model, fed.input_shape, fed.num_classes))
        self.sampler = BatchSampler(len(self.data.y_train), run.batch_size,
                                    derive_seed(run.seed, "proxy-batches", path or "root"))
        saved = sub_state(state, "proxy_sampler")
        if saved:
            self.sampler.restore(saved)
        self.steps, self.lr = ctx.params.proxy_steps, ctx.params.proxy_lr

    @classmethod
    def maybe(cls, ctx, state) -> ProxyTrainer | None:  # noqa: ANN001
        sizes = ctx.params.proxy_samples
        if not sizes or ctx.level >= len(sizes) or not sizes[ctx.level]:
            return None
        return cls(ctx, int(sizes[ctx.level]), state)

    def train(self, parameters: Parameters | NDArrays) -> NDArrays:
        arrays = parameters_to_ndarrays(parameters) if isinstance(parameters, Parameters) else parameters
        params, _ = run_local_steps(self.trainer, to_tensors(arrays), self.data.x_train, self.data.y_train,
                                    self.sampler, self.steps, lambda p, g: sgd_step(p, g, self.lr))
        return to_ndarrays(params)

    def evaluate(self, arrays: NDArrays) -> tuple[float, float]:
        loss_sum, correct, n = self.trainer.evaluate(to_tensors(arrays), self.data.x_test, self.data.y_test)
        return correct / n, loss_sum / n

    def state(self) -> dict[str, np.ndarray]:
        return with_prefix(self.sampler.state(), "proxy_sampler")


