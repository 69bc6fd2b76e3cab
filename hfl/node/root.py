"""The root: the algorithm's ``ServerRule`` at level 0, in the round loop every node runs.

``RootStrategy`` is the root's Flower strategy. Each global round ``RootServer`` (Flower's legacy
``Server``, its loop hfl's) calls ``RootStrategy.fit_round``, which runs the nodes' own round loop
(``hfl.node.inprocess.run_fit_rounds``: the exchange, the clock's close, failures, empty rounds,
the strategy's configure_fit/aggregate_fit) over the level-1 nodes it asks (all of them, those
holding a device drawn for the round with ``sampling=devices``, the idle ones under a clock, less
those a simulated fault drops), then saves the root's model and the rule's state in the state
store under ``node-root`` as a version of that round, like every other node's (hfl.state.store):
a resumed run rebuilds the rule from the store, rolled back to its checkpoint's round. Evaluation
rounds (Flower's own, over this strategy) pool the subtrees' counts (hfl.node.evaluation); the
recorder (hfl.output.recorder) observes every finished round and writes the outputs and the
checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from flwr.common import Code, EvaluateIns, EvaluateRes, GetPropertiesIns, NDArrays, Parameters, Scalar, ndarrays_to_parameters
from flwr.common.logger import log as flwr_log
from flwr.server import History, Server
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from hfl.algorithm import ServerRule, model_state
from hfl.clock.model import Clock
from hfl.clock.policy import LevelPolicy
from hfl.clock.timer import PREFIX as CLOCK_PREFIX
from hfl.clock.realtime import Flights, WallTimer
from hfl.clock.timer import SIM_TIME, NodeTimer
from hfl.node.cohort import Cohort, Selection
from hfl.node.inprocess import (ChildProxies, EvaluateCalls, FitMany, LazyClientManager, evaluate_together, fit_together,
                                run_fit_rounds)
from hfl.errors import ConfigError
from hfl.node.client import EVAL_SAMPLES, node_key, rule_state
from hfl.node.privacy import PrivacyPlan, PrivacySettings
from hfl.node.privacy import plan as privacy_plan
from hfl.node.evaluation import pool_evaluations
from hfl.node.round_counters import RoundCounters
from hfl.rules.payload import payload_nbytes
from hfl.node.strategy import LEVEL1_INDEX, NodeStrategy, node_order
from hfl.state.store import StateStore
from hfl.tree.sampling import DeviceDraw, EvaluationDraw, evaluation_sample

log = logging.getLogger(__name__)
ROOT_KEY = node_key("")  # "node-root": the store key of the node at path ""
MERGES = f"{CLOCK_PREFIX}merges"  # the root's stored count of merged and empty rounds per level


class PathProxy(ClientProxy):
    """A level-1 node known by its path in the tree (its cid), whatever Flower's node id: the root's
    children are named as every node's are, so who is asked, dropped, in flight (hfl.clock) and
    stored is the same in every runtime and after a restart."""

    def __init__(self, path: str, proxy: ClientProxy) -> None:
        super().__init__(path)
        self.proxy = proxy

    def get_properties(self, ins, timeout, group_id):  # noqa: ANN001, ANN201
        return self.proxy.get_properties(ins, timeout, group_id)

    def get_parameters(self, ins, timeout, group_id):  # noqa: ANN001, ANN201
        return self.proxy.get_parameters(ins, timeout, group_id)

    def fit(self, ins, timeout, group_id):  # noqa: ANN001, ANN201
        return self.proxy.fit(ins, timeout, group_id)

    def evaluate(self, ins, timeout, group_id):  # noqa: ANN001, ANN201
        return self.proxy.evaluate(ins, timeout, group_id)

    def reconnect(self, ins, timeout, group_id):  # noqa: ANN001, ANN201
        return self.proxy.reconnect(ins, timeout, group_id)


class RootStrategy(Strategy):
    """The global server over the level-1 nodes: every one of them each round (or those holding
    a drawn device), evaluation every ``eval_every`` rounds (and the last); fails loudly when a
    round aggregates nothing. ``make_rule(stored state)`` builds the algorithm's root rule."""

    def __init__(
        self,
        make_rule: Callable[[dict | None], ServerRule],
        store: StateStore,
        *,
        num_children: int,
        num_rounds: int,
        eval_every: int = 1,
        wait_seconds: float = 60.0,
        device_sampling: DeviceDraw | None = None,
        min_fit_fraction: float = 0.0,
        selection: Selection = Selection(),
        evaluation: EvaluationDraw | None = None,
        clock: Clock | None = None,
        policy: LevelPolicy | None = None,
        seed: int = 0,
        flights: Flights | None = None,
    ) -> None:
        self.store = store
        self.make_rule = make_rule
        self.clock, self.policy, self.seed = clock, policy or LevelPolicy(), seed
        self.flights = flights  # a deployment under clock.enabled: the root's policy on real arrivals
        self.node: NodeStrategy  # the round's strategy over the level-1 nodes, as every node's over its children
        self.timer: NodeTimer | None
        self.merges: dict[str, dict[str, int]]
        # A round needs this fraction of the level-1 nodes it asked (at least one): the same
        # algorithm.min_fit_fraction every inner node applies to its children (hfl.node.strategy).
        self.min_fit_fraction = min_fit_fraction
        self._restore()
        self.num_children = num_children  # the level-1 nodes of the topology
        self.num_rounds = num_rounds
        self.eval_every = eval_every
        self.finished: RoundDone | None = None  # the last round's outcome, for RootServer's observers
        self.wait_seconds = wait_seconds  # how long the first round waits for them to connect
        self.device_sampling = device_sampling
        self.selection = selection  # how its rounds pick level-1 nodes (hfl.node.cohort), as every node's
        self.evaluation = evaluation  # sampled evaluation (eval_fraction); None: every device is tested
        self._paths: dict[str, str] = {}  # level-1 node cid -> its path (asked once)
        self.counts = RoundCounters()  # what the round did, under the outputs' names (hfl.node.round_counters)

    def _restore(self) -> None:
        """The rule, its model and the clock, built from the root's stored state as every node builds
        them at each call (the root's call: a global round), so what the root keeps between rounds
        is exactly what it stores."""
        stored = self.store.load(ROOT_KEY)
        self.stored = stored  # what the round's cohort starts from (hfl.node.cohort)
        rule = self.make_rule(rule_state(stored))
        # Simulated time (hfl.clock): the root's clock, model version and level-1 replies in flight.
        self.timer = None if self.clock is None else NodeTimer(
            self.clock, self.policy, level=0, lowest=False, path="", seed=self.seed, stored=stored, new_call=False,
            start=float(stored.get(f"{CLOCK_PREFIX}time", 0.0)) if stored else 0.0)
        if self.flights is not None:
            self.timer = WallTimer(self.policy, self.flights, level=0, lowest=False, path="", seed=self.seed,
                                   stored=stored, new_call=False)
        # Per level (str), the rounds of its nodes that merged replies and those that merged nothing (hfl.clock)
        self.merges = json.loads(bytes(stored[MERGES]).decode()) if stored and MERGES in stored else {}
        self.node = NodeStrategy(rule, self.min_fit_fraction, order_key=LEVEL1_INDEX)

    @property
    def rule(self) -> ServerRule:
        """The root's rule for this global round (its strategy's)."""
        return self.node.rule

    @property
    def current(self) -> NDArrays:
        """The root's model (after the round's prepare, then its aggregate)."""
        return self.node.current

    def _children(self, client_manager: ClientManager) -> list[ClientProxy]:
        # Every level-1 node takes part; a node count that differs from the topology is a deployment
        # mistake (e.g. flwr run's num-supernodes), not something to wait out or sample around.
        client_manager.wait_for(self.num_children, timeout=self.wait_seconds)
        available = client_manager.num_available()
        if available != self.num_children:
            raise RuntimeError(
                f"{available} level-1 nodes connected but topology has {self.num_children}; "
                "run one SuperNode per level-1 node (flwr run: num-supernodes = number of level-1 nodes)"
            )
        return list(client_manager.all().values())

    # ------------------------------------------------------------------ a global round
    def fit_round(self, server_round: int, client_manager: ClientManager, fit_many: FitMany) -> None:
        """Global round ``server_round``: the node's round loop (hfl.node.inprocess.run_fit_rounds,
        as every inner node runs it) over the level-1 nodes this round asks, with this strategy's
        configure_fit and aggregate_fit; then the root's state is saved as a version of the round."""
        self.counts = RoundCounters()
        self._restore()
        self.store.round = server_round  # the root's state is a version of this round (hfl.state.store)
        children = self._level1(client_manager, server_round)
        drawn, extra = self._draw(server_round)

        cohort = Cohort(self.selection, "", timer=self.timer, drawn=drawn, stored=self.stored,
                        holds=self.device_sampling.holds if self.device_sampling else None)
        # In tree order (paths as numbers: '10' after '9'), as the cohort draws and the calls go out.
        level1 = LazyClientManager(ChildProxies([c.cid for c in children], {c.cid: c for c in children}.__getitem__))
        try:
            _, report = run_fit_rounds(self, level1, 1, cohort, "", {"global_round": server_round, **extra},
                                       fit_many, self.timer, first_round=server_round)
        except RuntimeError as exc:  # named as a node's failure is (hfl.node.client): "root: round 3: ..."
            raise RuntimeError(f"root: {exc}") from exc
        self.counts.fit(report, cohort.rows, timed=self.timer is not None)
        self._save(cohort)

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return self.node.initialize_parameters(client_manager)

    def configure_fit(self, server_round, parameters, client_manager):  # noqa: ANN001
        """The rule's message to the level-1 nodes the round asks, as every node sends its children's."""
        return self.node.configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):  # noqa: ANN001
        """The accepted level-1 replies to the rule, as every node hands its children's (too few: None)."""
        return self.node.aggregate_fit(server_round, results, failures)

    def merge_reference(self) -> NDArrays:
        """What a stale level-1 reply is merged against (hfl.clock): the root's model after ``prepare``."""
        return self.node.merge_reference()

    def _path_of(self, proxy: ClientProxy, server_round: int) -> str:
        """A level-1 node's path in the tree: Flower's node ids say nothing of the tree, so each
        node is asked once."""
        if proxy.cid not in self._paths:
            # No timeout, as for fit: Flower makes it the message's TTL, and a node's first message
            # (building its subtree, on a busy machine) can take longer than wait_seconds.
            props = proxy.get_properties(GetPropertiesIns({}), timeout=None, group_id=server_round)
            self._paths[proxy.cid] = str(props.properties["path"])
        return self._paths[proxy.cid]

    def _level1(self, client_manager: ClientManager, server_round: int) -> list[ClientProxy]:
        """The level-1 nodes in tree order, each known by its path (``PathProxy``): Flower's node ids
        say nothing of the tree, so the root's children are named as every node's are."""
        named = [PathProxy(self._path_of(proxy, server_round), proxy) for proxy in self._children(client_manager)]
        return sorted(named, key=lambda p: int(p.cid))

    def _draw(self, server_round: int) -> tuple[frozenset[int] | None, dict[str, Scalar]]:
        """With ``sampling=devices``, the devices drawn for the round (recorded) and the config entry
        naming them, which every node below reads."""
        if self.device_sampling is None:
            return None, {}
        drawn = self.device_sampling.draw(server_round)
        self.counts.root_row({"devices": drawn}, server_round)
        return frozenset(drawn), {"devices": ",".join(map(str, drawn))}

    def _save(self, cohort: Cohort) -> None:
        clock = {}
        if self.timer is not None:  # the run's rounds merged or empty per level so far (a resumed run goes on from them)
            for level, counts in self.counts.merges_per_level().items():
                for kind, value in counts.items():
                    self.merges.setdefault(level, {"merged": 0, "empty": 0})[kind] += value
            clock = {**self.timer.state(), MERGES: np.frombuffer(json.dumps(self.merges).encode(), dtype=np.uint8)}
        self.store.save(ROOT_KEY, {**model_state(self.current), **self.rule.state(), **self.node.privacy_state(),
                                  **cohort.state(), **clock})

    def evaluate(self, server_round, parameters):  # noqa: ANN001
        return None

    @property
    def privacy_plan(self) -> PrivacyPlan | None:
        """The run's privacy accounting (hfl.node.privacy), None without privacy."""
        ctx = self.rule.ctx
        settings = PrivacySettings.of(ctx.run.privacy)
        return None if settings is None else privacy_plan(settings, ctx.params, ctx.depth)

    def last_within_budget(self, server_round: int) -> bool:
        """Whether the privacy budget (privacy.target_epsilon) ends the run after this round."""
        plan = self.privacy_plan
        return plan is not None and server_round < self.num_rounds and plan.over_budget(server_round + 1)

    def configure_evaluate(self, server_round, parameters, client_manager):  # noqa: ANN001
        if server_round % self.eval_every and server_round != self.num_rounds \
                and not self.last_within_budget(server_round):
            self._finish(server_round, None)
            return []
        children = self._evaluated_children(server_round, self._level1(client_manager, server_round))
        arrays, meta = self.rule.evaluation_message(self.current)
        parameters = ndarrays_to_parameters(arrays)
        self.counts.add("bytes_down_global", payload_nbytes(parameters) * len(children))
        timed = {} if self.clock is None else {SIM_TIME: self.timer.time}  # data may drift (hfl.clock.shift)
        ins = EvaluateIns(parameters, {**meta, "global_round": server_round, **timed})
        return [(proxy, ins) for proxy in children]

    def evaluate_round(self, server_round: int, client_manager: ClientManager,
                       evaluate_many: EvaluateCalls) -> tuple[float | None, dict[str, Scalar]] | None:
        """Global round ``server_round``'s evaluation, if the schedule has one (``eval_every`` and the
        last round; else the round is finished unevaluated): the level-1 nodes it asks, called by
        ``evaluate_many``, their reports pooled (``aggregate_evaluate``); None when not evaluated."""
        calls = self.configure_evaluate(server_round, None, client_manager)
        if not calls:
            return None
        results: list[tuple[ClientProxy, EvaluateRes]] = []
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException] = []
        for (proxy, _), res in zip(calls, evaluate_many(calls), strict=True):
            if isinstance(res, BaseException):
                failures.append(res)
            elif res.status.code != Code.OK:
                failures.append((proxy, res))
            else:
                results.append((proxy, res))
        return self.aggregate_evaluate(server_round, results, failures)

    def _evaluated_children(self, server_round: int, children: list[ClientProxy]) -> list[ClientProxy]:
        """The level-1 nodes this evaluation asks: all, or a seeded sample of them in tree order, as
        every node samples its children (hfl.node.cohort), recorded in samples.jsonl."""
        if self.evaluation is None or self.evaluation.fraction >= 1:
            return children
        asked = evaluation_sample(children, self.evaluation.fraction, self.evaluation.seed, "", server_round)
        self.counts.root_row({"evaluated": [p.cid for p in asked]}, server_round)
        return asked

    def aggregate_evaluate(self, server_round, results, failures):  # noqa: ANN001
        if not results:
            raise RuntimeError(f"global round {server_round}: evaluation failed on all {len(failures)} level-1 node(s)")
        for failure in failures:  # the other level-1 nodes' devices are still pooled; the loss is counted
            log.warning("global round %d: a level-1 node's evaluation failed: %s", server_round, failure)
        self.counts.add("failures", len(failures))
        self.counts.values["evaluation_failures"] = len(failures)
        # In node order, not arrival order, so that float sums are reproducible.
        reports = sorted((res.metrics for _, res in results), key=node_order)
        for report in reports:
            self.counts.subtree(report)
            if report.get(EVAL_SAMPLES):  # the children each node asked to evaluate
                self.counts.samples(str(report[EVAL_SAMPLES]))
        pooled = pool_evaluations(reports, None if self.evaluation is None else self.evaluation.population)
        pooled.update(self.rule.evaluation_metrics(self.current))
        self._finish(server_round, pooled)
        loss = pooled["gm_loss"] if pooled.get("gm_loss") is not None else pooled.get("pm_loss")
        return loss, {k: v for k, v in pooled.items() if v is not None}

    def _finish(self, server_round: int, evaluation: dict | None) -> None:
        """The round is over: what it did, for whoever observes the run (RootServer hands it on)."""
        seconds, counters = self.counts.finish()
        privacy = self.privacy_plan
        if privacy is not None:  # the ε spent so far (hfl.node.privacy), and whether the budget ends the run here
            counters["dp_epsilon"] = privacy.epsilon(server_round)
            if server_round < self.num_rounds and privacy.over_budget(server_round + 1):
                counters["dp_budget_stop"] = 1
                log.warning("privacy.target_epsilon %g: the run stops after global round %d of %d (epsilon %.4g; "
                            "one more round would spend %.4g)", privacy.target_epsilon, server_round,
                            self.num_rounds, counters["dp_epsilon"], privacy.epsilon(server_round + 1))
        idle = never_merged(self.merges) if self.timer is not None and server_round == self.num_rounds else []
        for level in idle:
            log.warning("%s", idle_message(level, self.merges[level], server_round))
        self.finished = RoundDone(server_round, seconds, counters, evaluation, self.current,
                                  [int(level) for level in idle])

    def check_trained(self, done: RoundDone) -> None:
        """A run in which no node at any level merged a reply trained nothing: refused, once its
        last round's outputs are written."""
        if done.never_merged and len(done.never_merged) == len(self.merges):
            raise ConfigError("clock.deadline" if self.timer.policy.kind == "deadline" else "clock.policy",
                              f"no node at any level merged a reply in {done.round} global rounds: the run "
                              "trained nothing (every reply was late, in flight or failed); give the slowest "
                              "subtree time to answer (a longer clock.deadline, or clock.late=next)")


@dataclass
class RoundDone:
    """A finished global round, as the run's observers see it (hfl.output.recorder.Recorder)."""

    round: int
    seconds: float
    counters: dict
    evaluation: dict | None  # pooled figures of an evaluated round, else None
    model: NDArrays
    never_merged: list[int]  # levels whose nodes never merged a reply in the run (its last round only)


class RoundObserver(Protocol):
    def observe(self, done: RoundDone) -> None: ...


class RootServer(Server):
    """Flower's legacy ``Server`` with hfl's loop: each global round the root's ``fit_round`` (the
    round loop every node runs), then its ``evaluate_round`` where the schedule has one. Flower
    carries the messages (in-process proxies, Ray actors, a deployment's hosts); ``offset``: the
    global rounds a resumed run has done already (hfl.state.resume)."""

    def __init__(self, *, client_manager: ClientManager, strategy: RootStrategy, offset: int = 0,
                 fit_many: Callable[[int, float | None], FitMany] | None = None,
                 observers: Sequence[RoundObserver] = ()) -> None:
        super().__init__(client_manager=client_manager, strategy=strategy)
        self.root = strategy
        self.offset = offset
        self._fit_many = fit_many
        self.observers = list(observers)  # e.g. the run's recorder: outputs, checkpoints, trackers

    def evaluate_many(self, server_round: int, timeout: float | None) -> EvaluateCalls:
        """How a round's level-1 nodes are asked to evaluate: at once, or one after the other where
        the server has one worker (in process)."""
        return evaluate_together(server_round, timeout, self.max_workers)

    def fit_many(self, server_round: int, timeout: float | None) -> FitMany:
        """How a round's level-1 nodes are called: ``fit_many`` if given, else at once (Flower's
        default), or one after the other where the server has one worker (in process)."""
        if self._fit_many is not None:
            return self._fit_many(server_round, timeout)
        return fit_together(server_round, timeout, self.max_workers)

    def fit(self, num_rounds: int, timeout: float | None) -> tuple[History, float]:
        history = History()
        start = time.perf_counter()
        for server_round in range(self.offset + 1, self.offset + num_rounds + 1):
            flwr_log(logging.INFO, "[ROUND %s]", server_round)
            plan = self.root.privacy_plan
            if plan is not None and plan.over_budget(server_round):  # a resumed run that had spent its budget
                log.warning("privacy.target_epsilon %g: global round %d would spend %.4g; the run has stopped",
                            plan.target_epsilon, server_round, plan.epsilon(server_round))
                break
            self.root.fit_round(server_round, self._client_manager, self.fit_many(server_round, timeout))
            # The root decides whether the round is evaluated; hfl calls the level-1 nodes, Flower carries it.
            evaluated = self.root.evaluate_round(server_round, self._client_manager,
                                                 self.evaluate_many(server_round, timeout))
            if evaluated is not None and evaluated[0] is not None:
                history.add_loss_distributed(server_round, evaluated[0])
                history.add_metrics_distributed(server_round, evaluated[1])
            done = self.root.finished
            for observer in self.observers:
                observer.observe(done)
            self.root.check_trained(done)
            if done.counters.get("dp_budget_stop"):  # privacy.target_epsilon: the recorder has finished the run
                break
        return history, time.perf_counter() - start


def never_merged(merges: Mapping[str, Mapping[str, int]]) -> list[str]:
    """The levels (root first) whose nodes closed rounds but never merged a reply in the run."""
    return sorted((level for level, counts in merges.items() if not counts["merged"] and counts["empty"]), key=int)


def idle_message(level: str, counts: Mapping[str, int], rounds: int) -> str:
    where = "the root" if level == "0" else f"the level-{level} nodes"
    return (f"{where} never merged a reply in {rounds} global rounds ({counts['empty']} rounds closed with "
            f"nothing arrived in time): {'the global model' if level == '0' else 'their models'} did not train; "
            "a longer clock.deadline (or clock.late=next) lets the slower subtrees answer")
