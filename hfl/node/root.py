"""The root: the algorithm's ``ServerRule`` at level 0 under a thin Flower driver.

``RootStrategy`` is the ServerApp's strategy. Each global round it asks the level-1 nodes
(all of them, those holding a device drawn for the round with ``sampling=devices``, less those
a simulated fault drops), hands the accepted replies to the rule, and saves the root's model and
the rule's state in the state store under ``node-root`` as a version of that round, like every
other node's (hfl.state.store): a resumed run rebuilds the rule from the store, rolled back to its
checkpoint's round, so the root keeps no state of its own. Evaluation rounds pool the subtrees'
counts (hfl.node.evaluation); the recorder (hfl.output.recorder) observes every finished round and writes
the outputs and the checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping

import numpy as np
from flwr.common import EvaluateIns, FitIns, FitRes, GetPropertiesIns, NDArrays, Parameters, Scalar, ndarrays_to_parameters
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from hfl.algorithm import Replies, ServerRule, model_state
from hfl.clock.model import Clock
from hfl.clock.policy import LevelPolicy
from hfl.clock.timer import PREFIX as CLOCK_PREFIX
from hfl.clock.timer import SIM_TIME, NodeTimer, without_clock
from hfl.node.inprocess import NamedChild
from hfl.errors import ConfigError, first_failure
from hfl.node.client import EVAL_SAMPLES, node_key
from hfl.node.evaluation import pool_evaluations
from hfl.node.faults import Dropout
from hfl.node.payload import payload_nbytes
from hfl.node.strategy import accept_results, node_order, usable_needed
from hfl.state.store import StateStore
from hfl.tree.sampling import DeviceDraw, EvaluationDraw

log = logging.getLogger(__name__)
ROOT_KEY = node_key("")  # "node-root": the store key of the node at path ""
MERGES = f"{CLOCK_PREFIX}merges"  # the root's stored count of merged and empty rounds per level


class RootStrategy(Strategy):
    """The global server over the level-1 nodes: every one of them each round (or those holding
    a drawn device), evaluation every ``eval_every`` rounds (and the last); fails loudly when a
    round aggregates nothing. ``make_rule(stored state)`` builds the algorithm's root rule."""

    def __init__(
        self,
        make_rule: Callable[[dict | None], ServerRule],
        store: StateStore,
        *,
        num_teams: int,
        num_rounds: int,
        eval_every: int = 1,
        recorder=None,  # noqa: ANN001 - hfl.output.recorder.Recorder, optional
        team_wait_seconds: float = 60.0,
        device_sampling: DeviceDraw | None = None,
        min_fit_fraction: float = 0.0,
        dropout: Dropout | None = None,
        evaluation: EvaluationDraw | None = None,
        clock: Clock | None = None,
        policy: LevelPolicy | None = None,
        seed: int = 0,
    ) -> None:
        self.store = store
        stored = store.load(ROOT_KEY)
        self.rule = make_rule(without_clock(stored))
        # Simulated time (hfl.clock): the root's clock, model version and level-1 replies in flight.
        self.timer = None if clock is None else NodeTimer(
            clock, policy or LevelPolicy(), level=0, lowest=False, path="", seed=seed, stored=stored, new_call=False,
            start=float(stored.get(f"{CLOCK_PREFIX}time", 0.0)) if stored else 0.0)
        self._sent: dict[str, FitIns] = {}
        # Per level (str), the rounds of its nodes that merged replies and those that merged nothing (hfl.clock)
        self.merges: dict[str, dict[str, int]] = json.loads(bytes(stored[MERGES]).decode()) \
            if stored and MERGES in stored else {}
        self.current: NDArrays = self.rule.start()
        self.num_teams = num_teams
        self.num_rounds = num_rounds
        self.eval_every = eval_every
        self.recorder = recorder
        self.team_wait_seconds = team_wait_seconds
        self.device_sampling = device_sampling
        # A round needs this fraction of the level-1 nodes it asked (at least one): the same
        # algorithm.min_fit_fraction every inner node applies to its children (hfl.node.strategy).
        self.min_fit_fraction = min_fit_fraction
        self.dropout = dropout  # runtime.dropout_nodes of the level-1 nodes (hfl.node.faults)
        self.evaluation = evaluation  # sampled evaluation (eval_fraction); None: every device is tested
        self._paths: dict[str, str] = {}  # level-1 node cid -> its path (asked once)
        self._round: dict[str, float] = {}

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.current)

    def _teams(self, client_manager: ClientManager) -> list[ClientProxy]:
        # Every team takes part; a node count that differs from the topology is a deployment
        # mistake (e.g. flwr run's num-supernodes), not something to wait out or sample around.
        client_manager.wait_for(self.num_teams, timeout=self.team_wait_seconds)
        available = client_manager.num_available()
        if available != self.num_teams:
            raise RuntimeError(
                f"{available} team nodes connected but topology has {self.num_teams} teams; "
                "run one SuperNode per team (flwr run: num-supernodes = number of teams)"
            )
        return sorted(client_manager.all().values(), key=lambda p: p.cid)

    def configure_fit(self, server_round, parameters, client_manager):  # noqa: ANN001
        self._round = {"start": time.perf_counter(), "bytes_down_global": 0, "bytes_up_global": 0,
                       "bytes_down_team": 0, "bytes_up_team": 0, "compute_seconds": 0.0, "failures": 0}
        self.store.round = server_round  # the root's state is a version of this round (hfl.state.store)
        self.current = self.rule.prepare(server_round, self.current)
        teams, extra = self._fit_targets(server_round, self._teams(client_manager))
        if self.timer is not None and self.timer.policy.kind != "sync":  # the idle level-1 nodes it asks
            by_path = sorted((int(self._path_of(p, server_round)), p) for p in teams)
            teams = self.timer.pick([p for _, p in by_path], 1.0, str(server_round))
            if not teams:
                # Every level-1 node is busy: the round closes over the replies in flight (the timer has
                # moved to the next arrival). Flower cancels a fit round with nobody to ask, so it closes here.
                self._aggregate(server_round, [], [])
                return []
        teams = self._drop_nodes(server_round, teams)
        arrays, meta = self.rule.fit_message(server_round, self.current)
        parameters = ndarrays_to_parameters(arrays)
        self._round["bytes_down_global"] += payload_nbytes(parameters) * len(teams)
        ins = FitIns(parameters, {**extra, **meta, "global_round": server_round})
        calls = [(proxy, ins) for proxy in teams]
        if self.timer is not None:  # each call carries the root's time
            calls = self.timer.send(calls)
            self._sent = {proxy.cid: sent for proxy, sent in calls}
        return calls

    def _path_of(self, proxy: ClientProxy, server_round: int) -> str:
        """A level-1 node's path in the tree: Flower's node ids say nothing of the tree, so each
        node is asked once."""
        if proxy.cid not in self._paths:
            # No timeout, as for fit: Flower makes it the message's TTL, and a node's first message
            # (building its subtree, on a busy machine) can take longer than team_wait_seconds.
            props = proxy.get_properties(GetPropertiesIns({}), timeout=None, group_id=server_round)
            self._paths[proxy.cid] = str(props.properties["path"])
        return self._paths[proxy.cid]

    def _fit_targets(self, server_round: int, teams: list[ClientProxy]) -> tuple[list[ClientProxy], dict[str, Scalar]]:
        """Every level-1 node, or with ``sampling=devices`` those holding a device drawn for the
        round (a subtree without one is not called), and the config entry naming the devices."""
        if self.device_sampling is None:
            return teams, {}
        drawn = self.device_sampling.draw(server_round)
        wanted = set(drawn)
        asked = [p for p in teams if self.device_sampling.holds[self._path_of(p, server_round)] & wanted]
        record = [{"node": "root", "round": str(server_round), "devices": drawn}]
        self._round.setdefault("samples", []).append(json.dumps(record))
        return asked, {"devices": ",".join(map(str, drawn))}

    def _drop_nodes(self, server_round: int, teams: list[ClientProxy]) -> list[ClientProxy]:
        """``runtime.dropout_nodes``: the level-1 nodes (whole subtrees) that fail this round are
        called through a proxy whose fit raises (hfl.node.faults), so they count as failures; recorded
        in samples.jsonl."""
        if self.dropout is None:
            return teams
        by_path = sorted((int(self._path_of(p, server_round)), p) for p in teams)  # tree order, not Flower's ids
        paths, teams = [str(path) for path, _ in by_path], [p for _, p in by_path]
        teams, dropped = self.dropout.apply(teams, paths, "", str(server_round))
        record = [{"node": "root", "round": str(server_round), "asked": paths, "dropped": dropped}]
        self._round.setdefault("samples", []).append(json.dumps(record))
        return teams

    def _count_team_report(self, metrics: Mapping[str, Scalar]) -> None:
        """Add a level-1 node's subtree counters (bytes per edge level, seconds) to the round's."""
        for key, value in metrics.items():
            if key in ("bytes_down_team", "bytes_up_team", "compute_seconds") or (
                key.startswith(("bytes_down_level", "bytes_up_level", "failures_level", "late_level", "stale_level",
                                "merged_rounds_level", "empty_rounds_level"))
                and key[-1].isdigit()
            ):
                self._round[key] = self._round.get(key, 0) + value

    def _timed(self, results: list) -> tuple[list, int]:
        """The replies the root's policy merges this round (hfl.clock): all with sync; the level-1
        replies that arrived in time or filled the buffer otherwise, stale ones as weighted deltas;
        and how many it did not take but may still come (late, in flight, empty)."""
        calls = [(proxy, self._sent[proxy.cid]) for proxy, _ in results]
        closed, timing = self.timer.close(calls, [res for _, res in results], self.current)
        self._round["sim_time"] = timing.end
        self._round["late_level1"] = self._round.get("late_level1", 0) + timing.late
        self._round["stale_level1"] = self._round.get("stale_level1", 0) + timing.stale
        return [(entry.proxy or NamedChild(entry.cid), entry.result) for entry in closed.merged], timing.pending

    def aggregate_fit(self, server_round, results, failures):  # noqa: ANN001
        return self._aggregate(server_round, results, failures)

    def _aggregate(self, server_round: int, results: list, failures: list) -> tuple[Parameters, dict]:
        # In node order, not arrival order (Flower's server collects futures in any order); a subtree's
        # counters count when it computed them, whether its reply is merged now, later (hfl.clock) or never.
        for _, res in sorted(results, key=lambda r: node_order(r[1].metrics)):
            self._count_team_report(res.metrics)
            if self.timer is not None:  # merged or not (without a clock: every reply, below)
                self._count_subtree(res)
        # A level-1 node that failed is counted in the round it failed in, whatever the policy.
        self._round["failures"] += len(failures)
        self._round["failures_level1"] = self._round.get("failures_level1", 0) + len(failures)
        if self.timer is not None:
            results, pending = self._timed(results)
            if not results and (pending or not failures):
                # No level-1 reply arrived in time: the policy merges nothing this round (counted); failures
                # alone with nothing left to come stop the run below, naming the first, as under sync.
                self._round["empty_rounds_level0"] = self._round.get("empty_rounds_level0", 0) + 1
                self._save()
                return ndarrays_to_parameters(self.current), {}
        accepted, rejected = accept_results(results, self.current, "team_id", "global")
        team_ids = [u.metrics.get("team_id") for u in accepted]
        if len(set(team_ids)) != len(team_ids):
            raise RuntimeError(f"global round {server_round}: duplicate team ids {sorted(team_ids)}; "
                               "two nodes serve the same team (check partition-id)")
        self._round["failures"] += rejected
        self._round["failures_level1"] += rejected
        for _, res in sorted(results, key=lambda r: node_order(r[1].metrics)):
            self._round["bytes_up_global"] += payload_nbytes(res.parameters)
            if self.timer is None:
                self._count_subtree(res)
        if not accepted:
            raise RuntimeError(
                f"global round {server_round}: no team model to aggregate "
                f"({len(failures)} failures, {rejected} rejected){first_failure(failures)}; "
                "stopping rather than keeping the old model"
            )
        asked = len(results) + len(failures)
        needed = usable_needed(self.min_fit_fraction, asked)
        if len(accepted) < needed:
            raise RuntimeError(
                f"global round {server_round}: {len(accepted)} usable level-1 models of {asked} asked, {needed} "
                f"needed (algorithm.min_fit_fraction={self.min_fit_fraction:g}); {len(failures)} failures, "
                f"{rejected} rejected{first_failure(failures)}"
            )
        # The devices' own test after training (fit_test): counted for the recorder's figure.
        for key in ("fit_test_correct", "fit_test_samples"):
            self._round[key] = sum(int(res.metrics.get(key, 0)) for _, res in results)
        self.current = self.rule.aggregate(self.current, Replies(server_round, str(server_round), accepted))
        if self.timer is not None:
            self._round["merged_rounds_level0"] = self._round.get("merged_rounds_level0", 0) + 1
        self._save()
        return ndarrays_to_parameters(self.current), {}

    def _count_subtree(self, res: FitRes) -> None:
        """A level-1 reply's sample records and its subtree's failures, counted once."""
        if res.metrics.get("samples"):
            self._round.setdefault("samples", []).append(str(res.metrics["samples"]))
        self._round["failures"] += int(res.metrics.get("device_failures", 0))

    def _save(self) -> None:
        clock = {}
        if self.timer is not None:  # the run's rounds merged or empty per level so far (a resumed run goes on from them)
            for key, value in self._round.items():
                level = key.rsplit("level", 1)[-1]
                if key.startswith(("merged_rounds_level", "empty_rounds_level")) and level.isdigit():
                    kind = key.split("_", 1)[0]
                    self.merges.setdefault(level, {"merged": 0, "empty": 0})[kind] += int(value)
            clock = {**self.timer.state(), MERGES: np.frombuffer(json.dumps(self.merges).encode(), dtype=np.uint8)}
        self.store.save(ROOT_KEY, {**model_state(self.current), **self.rule.state(), **clock})

    def evaluate(self, server_round, parameters):  # noqa: ANN001
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):  # noqa: ANN001
        if server_round % self.eval_every and server_round != self.num_rounds:
            self._finish(server_round, None)
            return []
        teams = self._evaluated_teams(server_round, self._teams(client_manager))
        arrays, meta = self.rule.evaluation_message(self.current)
        parameters = ndarrays_to_parameters(arrays)
        self._round["bytes_down_global"] += payload_nbytes(parameters) * len(teams)
        timed = {} if self.timer is None else {SIM_TIME: self.timer.time}  # data may drift (hfl.clock.shift)
        ins = EvaluateIns(parameters, {**meta, "global_round": server_round, **timed})
        return [(proxy, ins) for proxy in teams]

    def _evaluated_teams(self, server_round: int, teams: list[ClientProxy]) -> list[ClientProxy]:
        """The level-1 nodes this evaluation asks: all, or a seeded sample of them in tree order
        (Flower's node ids say nothing of the tree), recorded in samples.jsonl."""
        if self.evaluation is None or self.evaluation.fraction >= 1:
            return teams
        by_path = sorted((int(self._path_of(p, server_round)), p) for p in teams)
        asked = self.evaluation.sample(by_path, server_round)
        record = [{"node": "root", "round": str(server_round), "evaluated": [str(path) for path, _ in asked]}]
        self._round.setdefault("samples", []).append(json.dumps(record))
        return [p for _, p in asked]

    def aggregate_evaluate(self, server_round, results, failures):  # noqa: ANN001
        if not results:
            raise RuntimeError(f"global round {server_round}: evaluation failed on all {len(failures)} team(s)")
        for failure in failures:  # the other teams' devices are still pooled; the loss is counted
            log.warning("global round %d: a team's evaluation failed: %s", server_round, failure)
        self._round["failures"] += len(failures)
        self._round["evaluation_failures"] = len(failures)
        # In node order, not arrival order, so that float sums are reproducible.
        reports = sorted((res.metrics for _, res in results), key=node_order)
        for report in reports:
            self._count_team_report(report)
            if report.get(EVAL_SAMPLES):  # the children each node asked to evaluate
                self._round.setdefault("samples", []).append(str(report[EVAL_SAMPLES]))
        pooled = pool_evaluations(reports, None if self.evaluation is None else self.evaluation.population)
        pooled.update(self.rule.evaluation_metrics(self.current))
        self._finish(server_round, pooled)
        loss = pooled["gm_loss"] if pooled.get("gm_loss") is not None else pooled.get("pm_loss")
        return loss, {k: v for k, v in pooled.items() if v is not None}

    def _finish(self, server_round: int, evaluation: dict | None) -> None:
        seconds = time.perf_counter() - self._round.pop("start")
        idle = never_merged(self.merges) if self.timer is not None and server_round == self.num_rounds else []
        for level in idle:
            log.warning("%s", idle_message(level, self.merges[level], server_round))
        if idle and self.recorder is not None:  # summary.json says so (the recorder writes its meta into it)
            self.recorder.meta["never_merged"] = [int(level) for level in idle]
        if self.recorder is not None:
            self.recorder.round_done(server_round, seconds, dict(self._round), evaluation, self.current)
        if idle and len(idle) == len(self.merges):
            raise ConfigError("clock.deadline" if self.timer.policy.kind == "deadline" else "clock.policy",
                              f"no node at any level merged a reply in {server_round} global rounds: the run "
                              "trained nothing (every reply was late, in flight or failed); give the slowest "
                              "subtree time to answer (a longer clock.deadline, or clock.late=next)")


def never_merged(merges: Mapping[str, Mapping[str, int]]) -> list[str]:
    """The levels (root first) whose nodes closed rounds but never merged a reply in the run."""
    return sorted((level for level, counts in merges.items() if not counts["merged"] and counts["empty"]), key=int)


def idle_message(level: str, counts: Mapping[str, int], rounds: int) -> str:
    where = "the root" if level == "0" else f"the level-{level} nodes"
    return (f"{where} never merged a reply in {rounds} global rounds ({counts['empty']} rounds closed with "
            f"nothing arrived in time): {'the global model' if level == '0' else 'their models'} did not train; "
            "a longer clock.deadline (or clock.late=next) lets the slower subtrees answer")
