"""An inner node of the tree: a client outside (a ``NumPyClient`` of its parent), a strategy
inside (a Flower ``Strategy`` run over its sampled children), with persistent state.

The same class serves every inner level: a lowest-level server's children are device
clients, a higher node's children are ``NodeClient``s of the next level, each behind an
in-process ``ClientProxy``. A node's state (its model and whatever its strategy keeps,
e.g. node-optimiser moments) lives in the state store under ``node-<path>`` between calls.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from flwr.client import NumPyClient
from flwr.common import EvaluateRes, NDArrays, Scalar
from flwr.server.client_manager import SimpleClientManager

from hfl.algorithm import Nature, ServerRule, model_from_state, model_state
from hfl.clock.model import Clock
from hfl.clock.policy import LevelPolicy
from hfl.clock.realtime import Flights, WallTimer
from hfl.clock.timer import SIM_TIME, NodeTimer, without_clock
from hfl.node.evaluation import DeviceScore, add_reports, evaluation_result, target_report
from hfl.node.cohort import Cohort, Selection, without_cohort
from hfl.node.inprocess import (EvaluateMany, FitMany, client_manager_of, evaluate_children, fit_one_by_one,
                                ordered_children, run_fit_rounds)
from hfl.rules.payload import LocalParameters, Payload, decode, npy_nbytes, pack, unpack
from hfl.tree.sampling import evaluation_sample, parse_devices
from hfl.node.round_counters import clipped_updates
from hfl.node.strategy import LEVEL1_INDEX, NodeStrategy
from hfl.state.store import StateStore
from hfl.tree.shape import level_of

# The config value devices read for each evaluation target (hfl.device.client.DeviceClient); a
# server level's model goes by its target name (level1, level2...).
DEVICE_MODEL = {"gm": "global", "pm": "personal"}
# Evaluation parts named ctx_* are no model to test: they travel down the tree and reach the
# devices with the PM target, which they complete their own model from (e.g. FeMAM's group models).
CONTEXT = "ctx_"
# An evaluation reply's record of the children each node of the subtree asked, where it sampled
# (top-level eval_fraction): the root writes them to samples.jsonl beside the fit samples.
EVAL_SAMPLES = "eval_samples"


@dataclass(frozen=True)
class NodeSpec:
    path: str
    rounds: int  # rounds over its children per call from the parent
    selection: Selection  # how its rounds pick their children (hfl.node.cohort)
    seed: int
    lowest: bool  # its children are devices
    device_sampling: bool = False  # algorithm.sampling=devices: the root draws devices, sent as config "devices"
    partial: bool = False  # a device may not have trained yet (hfl.runtime.build.partial_participation)
    eval_fraction: float = 1.0  # of its children, asked to evaluate (top-level eval_fraction, hfl.runtime.build)
    clock: Clock | None = None  # simulated time (clock.enabled, hfl.clock); None: rounds take no time
    policy: LevelPolicy = field(default_factory=LevelPolicy)  # how its rounds close in simulated time
    min_fit_fraction: float = 1.0  # of the children asked, the usable replies a round needs (algorithm.min_fit_fraction)

    @property
    def level(self) -> int:
        return level_of(self.path)

    @property
    def level1_index(self) -> int:
        """The index of the level-1 node this node belongs to (its SuperNode in simulation); -1 for the root."""
        return int(self.path.split(".")[0]) if self.path else -1

    @property
    def store_key(self) -> str:
        return node_key(self.path)


def node_key(path: str) -> str:
    return f"node-{path or 'root'}"


def rule_state(stored: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
    """What a node's rule is built from: its stored state less the clock's and the cohort's entries
    (the root's and every inner node's alike)."""
    return without_cohort(without_clock(stored))


# (children, [(parameters, config) per target]) -> per target, the replies and the bytes sent
EvaluateTargets = Callable[[SimpleClientManager, list[tuple[LocalParameters, dict]]],
                           list[tuple[list[tuple[str, EvaluateRes]], int]]]

# make_rule(parent payload, stored node state or None, the call's round path) -> the
# algorithm's server rule for one call (hfl.algorithm)
RuleFactory = Callable[[Payload, dict[str, np.ndarray] | None, str], ServerRule]


class NodeClient(NumPyClient):
    """Receives the parent's payload, runs ``spec.rounds`` rounds of its strategy over a
    seeded sample of its children, keeps its model and strategy state, returns its model
    with the sample count behind it (so weighted means compose up the tree).

    ``evaluate`` receives the models of the levels above (``gm``, ``level1``…), adds its own
    (``level<d>``), and either asks its devices to test each of them and their own model
    (PM), or forwards them to its child nodes; the counts it returns add up (hfl.node.evaluation).
    """

    def __init__(
        self,
        spec: NodeSpec,
        children: SimpleClientManager,
        make_rule: RuleFactory,
        store: StateStore,
        nature: Nature,
        *,
        persist: Callable[[], None] = lambda: None,
        holds: Mapping[str, frozenset[int]] | None = None,
        fit_many: FitMany = fit_one_by_one,
        evaluate_many: EvaluateMany = evaluate_children,
        evaluate_targets: EvaluateTargets | None = None,
        steps_of: Callable[[int], int] | None = None,
        at_time: Callable[[float], None] | None = None,
        flights: Flights | None = None,
    ) -> None:
        self.spec = spec
        self.children = children
        self.make_rule = make_rule
        self.store = store
        self.nature = nature  # what its algorithm is (ServerRule.nature): what its evaluation asks of whom
        self.persist = persist
        # child cid -> the devices in its subtree (for sampling=devices); a lazy mapping is kept as it is
        self.holds = holds if holds is not None else {}
        self.fit_many = fit_many  # how a round's children are called (a lowest node's devices may be batched)
        self.evaluate_many = evaluate_many  # likewise for evaluation (hfl.accel.batched.BatchedEvaluate)
        # Every target model to every device at once (a deployment: one message per device, not per target).
        self.evaluate_targets = evaluate_targets
        self.steps_of = steps_of  # a device's minibatch steps per call: its work in simulated time (hfl.clock)
        self.at_time = at_time  # tells a lowest node's devices the simulated time (their data may drift: hfl.clock.shift)
        self.flights = flights  # a deployment under clock.enabled: its policy on real arrivals (hfl.clock.realtime)

    def _evaluated_children(self, config: dict[str, Scalar]) -> tuple[SimpleClientManager, list[dict]]:
        """The children this evaluation asks (all, or a seeded ``spec.eval_fraction`` of them, by
        cid: a child's path or a device's id, the same in every runtime) and, where it samples, the
        record of whom for samples.jsonl. The hooks that call them (evaluate_many, evaluate_targets)
        get a manager of the sample alone, so a deployment asks the same children."""
        spec = self.spec
        if spec.eval_fraction >= 1:
            return self.children, []
        global_round = int(config.get("global_round", 0))
        asked = evaluation_sample(ordered_children(self.children), spec.eval_fraction, spec.seed, spec.path,
                                  global_round)
        record = {"node": spec.path, "round": str(global_round), "evaluated": [p.cid for p in asked]}
        return client_manager_of(asked), [record]

    def get_properties(self, config: dict[str, Scalar]) -> dict[str, Scalar]:
        return {"path": self.spec.path, "level": self.spec.level}

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        start = time.perf_counter()
        spec = self.spec
        round_path = str(config.get("round_path", config.get("global_round", 0)))
        # What this call saves (its state, its devices') is a version of the global round it
        # computes, the first entry of its round path (hfl.state.store: resuming rolls back to a round).
        self.store.round = int(round_path.split(".")[0])
        stored = self.store.load(spec.store_key)
        timer: NodeTimer | None = None
        if self.flights is not None:
            timer = WallTimer(spec.policy, self.flights, level=spec.level, lowest=spec.lowest, path=spec.path,
                              seed=spec.seed, stored=stored)
        elif spec.clock is not None:  # this call starts when the parent's message has arrived
            arrived = float(config.get(SIM_TIME, 0.0)) + spec.clock.message_seconds(
                spec.level - 1, sum(npy_nbytes(np.asarray(a)) for a in parameters))
            timer = NodeTimer(spec.clock, spec.policy, level=spec.level, lowest=spec.lowest, start=arrived,
                              path=spec.path, seed=spec.seed, steps_of=self.steps_of, stored=stored)
            if self.at_time is not None:
                self.at_time(arrived)
        rule = self.make_rule(unpack(parameters, config), rule_state(stored), round_path)
        strategy = NodeStrategy(rule, spec.min_fit_fraction)
        drawn = None
        if spec.device_sampling:  # the devices the root drew for this global round
            if "devices" not in config:
                raise RuntimeError(f"node {spec.path!r}: algorithm.sampling=devices but the parent sent no device list")
            drawn = parse_devices(str(config["devices"]))
        cohort = Cohort(spec.selection, spec.path, timer=timer, drawn=drawn, holds=self.holds, stored=stored)
        forward = {"devices": config["devices"]} if spec.device_sampling else None
        try:
            params, report = run_fit_rounds(strategy, self.children, spec.rounds, cohort, round_path, forward,
                                            self.fit_many, timer)
        except RuntimeError as exc:  # the node fails its call: its parent counts it as a failed child
            raise RuntimeError(f"node {spec.path}: {exc}") from exc
        model = decode(params)
        # A gradient relay (level_models false) keeps no model: its reply is no predictor.
        state = model_state(model) if self.nature.level_models else {}
        state.update(rule.state())  # e.g. node-optimiser moments (strategies.bhfl)
        state.update(strategy.privacy_state())  # adaptive clipping's C (hfl.node.privacy)
        state.update(cohort.state())
        if timer is not None:
            state.update(timer.state())  # its model version and the replies still in flight
        self.store.save(spec.store_key, state)
        self.persist()
        level = spec.level
        counters = dict(report.subtree)
        timed = [] if timer is None else [(f"late_level{level + 1}", report.late),
                                          (f"stale_level{level + 1}", report.stale),
                                          (f"merged_rounds_level{level}", report.merged_rounds),
                                          (f"empty_rounds_level{level}", report.empty_rounds)]
        clipped = [(f"dp_clipped_level{level + 1}", n)] if (n := clipped_updates(report)) else []  # central DP
        for key, value in ((f"bytes_down_level{level}", report.bytes_down), (f"bytes_up_level{level}", report.bytes_up),
                           (f"failures_level{level + 1}", report.failures), *timed, *clipped):
            counters[key] = counters.get(key, 0) + value
        below = int(counters.get("device_failures", 0)) + report.failures
        metrics: dict[str, Scalar] = {
            **counters,
            "node": spec.path,
            LEVEL1_INDEX: spec.level1_index,
            "compute_seconds": time.perf_counter() - start,
            "device_failures": below,
            "rejected": int(counters.get("rejected", 0)) + sum(int(m.get("rejected", 0)) for m in report.metrics),
            # Whom its rounds asked (where it is not every child), then its descendants' records (samples.jsonl).
            "samples": json.dumps(records) if (records := cohort.rows + report.child_samples) else "",
        }
        if level == 1:  # the names 3-tier runs have always reported
            metrics["bytes_down_team"] = sum(v for k, v in counters.items() if k.startswith("bytes_down_level"))
            metrics["bytes_up_team"] = sum(v for k, v in counters.items() if k.startswith("bytes_up_level"))
        extra = rule.reply_parts()
        arrays, meta = model, {}
        if timer is not None and not report.merged_rounds:
            # Nothing arrived in time in any of its rounds (hfl.clock): its model is its parent's, unchanged;
            # its reply carries nothing to merge (neither a failure nor a rejection), its counters do count.
            arrays, meta = pack("empty", None)
        elif extra:  # e.g. residual updates for the grandparent (strategies.bhfl)
            arrays, meta = pack("parts", {"model": model, **extra})
        elif rule.reply_kind != "model":  # e.g. a gradient mean (strategies.pflego)
            arrays, meta = pack(rule.reply_kind, model)
        if spec.clock is not None:  # when the reply reaches the parent
            metrics[SIM_TIME] = timer.time + spec.clock.message_seconds(
                level - 1, sum(npy_nbytes(np.asarray(a)) for a in arrays))
        return arrays, report.num_examples, {**metrics, **meta}

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        start = time.perf_counter()
        if self.at_time is not None and SIM_TIME in config:
            self.at_time(float(config[SIM_TIME]))
        received = unpack(parameters, config)
        models = {"gm": received.main} if received.kind == "model" else dict(received.parts)
        nature = self.nature
        if not nature.global_model and nature.pm_base != "gm":
            models.pop("gm", None)
        # The node's stored state, read once: its model (level_models) and its devices' PM context.
        state = self.store.load(self.spec.store_key) if nature.level_models or self.spec.lowest else None
        own = model_from_state(state) if nature.level_models else None
        if own is None and nature.level_models:
            # Never called yet (sampled out above): its first call would start from its parent's model.
            own = models.get(f"level{self.spec.level - 1}") if self.spec.level > 1 else models.get("gm")
        if own is not None:
            models[f"level{self.spec.level}"] = own
        metrics: dict[str, Scalar] = {"node": self.spec.path, f"bytes_down_level{self.spec.level}": 0}
        children, records = self._evaluated_children(config)
        if self.spec.lowest:
            timing = {SIM_TIME: config[SIM_TIME]} if SIM_TIME in config else {}
            reports = [self._evaluate_devices(children, models, metrics, state, timing)]
            if nature.devices_change_when_tested:  # its devices changed when tested (B-HFL's sessions)
                self.persist()
        else:
            reports = self._evaluate_nodes(children, models, metrics, config)
            records += [r for report in reports if report.get(EVAL_SAMPLES)
                        for r in json.loads(str(report[EVAL_SAMPLES]))]
        metrics.update(add_reports(reports))
        if records:  # only where evaluation is sampled: a full evaluation's reply is as it was
            metrics[EVAL_SAMPLES] = json.dumps(records)
        metrics[LEVEL1_INDEX] = self.spec.level1_index
        metrics["compute_seconds"] = time.perf_counter() - start
        if self.spec.level == 1:
            metrics["bytes_down_team"] = sum(v for k, v in metrics.items() if k.startswith("bytes_down_level"))
        return evaluation_result(metrics, nature.global_model)

    def _evaluate_devices(self, children: SimpleClientManager, models: dict[str, NDArrays],
                          metrics: dict[str, Scalar], state: dict[str, np.ndarray] | None,
                          timing: dict[str, Scalar] | None = None) -> dict[str, Scalar]:
        """Each target model on the asked devices' test splits; the devices' own models for PM."""
        targets = {k: v for k, v in models.items() if not k.startswith(CONTEXT)}
        context = {k: v for k, v in models.items() if k.startswith(CONTEXT)}
        nature = self.nature
        context.update(nature.evaluation_context(state))
        if not nature.global_model:
            targets.pop("gm", None)  # forwarded only as the base of the devices' PMs
        config: dict[str, dict[str, Scalar]] = {}
        if nature.pm_base == "gm":
            targets["pm"], config["pm"] = models["gm"], {}  # each device completes it with its own part
        elif nature.personalized and context:
            targets["pm"], config["pm"] = pack("parts", context)  # each device picks its part of it
        elif nature.personalized:
            # Devices test their own model; nothing is sent, unless some device may not have trained
            # yet (sampled out here or above, dropped, idle): it tests the model it would start from (this node's).
            samples = self.spec.partial and f"level{self.spec.level}" in models
            targets["pm"] = models[f"level{self.spec.level}"] if samples else []
            config["pm"] = {"fallback": True} if samples else {}
            if nature.device_evaluation_config:
                config["pm"].update({**nature.device_evaluation_config, **(timing or {})})
        report: dict[str, Scalar] = {}
        # batched devices read the arrays; bytes only if they leave
        asks = [(LocalParameters(arrays), {"model": DEVICE_MODEL.get(target, target), **config.get(target, {})})
                for target, arrays in targets.items()]
        if self.evaluate_targets is not None:
            answers = self.evaluate_targets(children, asks)
        else:
            answers = [self.evaluate_many(children, sent, ask) for sent, ask in asks]
        for target, (replies, moved) in zip(targets, answers, strict=True):
            metrics[f"bytes_down_level{self.spec.level}"] += moved
            rows = [DeviceScore(int(r.metrics["device_id"]), int(r.metrics["correct"]), r.num_examples, r.loss)
                    for _, r in replies]
            report.update(target_report(target, rows))
        return report

    def _evaluate_nodes(self, children: SimpleClientManager, models: dict[str, NDArrays],
                        metrics: dict[str, Scalar], config: dict[str, Scalar]) -> list[dict[str, Scalar]]:
        """The models forwarded to the asked child nodes (each asks its own sample, or all)."""
        arrays, meta = pack("parts", models)
        sent = LocalParameters(arrays)
        # The round goes along: a deployed child names its request by it (hfl.deploy.mailbox).
        rounds = {k: config[k] for k in ("global_round", SIM_TIME) if k in config}
        replies, moved = self.evaluate_many(children, sent, {**meta, **rounds})
        metrics[f"bytes_down_level{self.spec.level}"] += moved
        out = []
        for _, res in replies:
            for key, value in res.metrics.items():
                if key.startswith("bytes_down_level"):
                    metrics[key] = metrics.get(key, 0) + value
            out.append(res.metrics)
        return out
