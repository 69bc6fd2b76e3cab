"""Flower wiring shared by every algorithm's team and global strategies.

Subclasses only supply ``aggregate(current, models, weights)`` — the algorithm's pure
update rule; sampling, validation of updates, ordering and bookkeeping live here.
"""

from __future__ import annotations

import json
import logging
import math
import time
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from flwr.common import (
    EvaluateIns,
    FitIns,
    FitRes,
    GetPropertiesIns,
    NDArrays,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from hfl.aggregate import all_finite, update_problem
from hfl.errors import first_failure
from hfl.evaluation import pool_evaluations
from hfl.faults import Dropout
from hfl.payload import LocalParameters, Payload, decode, payload_nbytes, unpack
from hfl.sampling import DeviceDraw
from hfl.store import StateStore

log = logging.getLogger(__name__)

def node_order(metrics: Mapping[str, Scalar]) -> tuple[int, str]:
    """A level-1 node's reply sorted by its team id and path, not by arrival order."""
    return int(metrics.get("team_id", 0)), str(metrics.get("node", ""))


def fit_test_metrics(history: Sequence[float], window: int = 10) -> dict[str, float]:
    """The PFLEGO paper's figure from the per-round accuracies of the sampled devices (each after
    its training, before the root's step, pooled over their test samples): ``pflego_accuracy``,
    the mean of the last ``window`` rounds, and ``pflego_round_accuracy``, the last round's."""
    if not history:
        return {}
    last = history[-window:]
    return {"pflego_accuracy": sum(last) / len(last), "pflego_round_accuracy": history[-1]}


def usable_needed(min_fit_fraction: float, asked: int) -> int:
    """The usable updates a round needs: ceil(min_fit_fraction x asked), at least 1 (a product
    that float arithmetic puts just above an integer is that integer)."""
    return max(1, math.ceil(min_fit_fraction * asked - 1e-9))


class Update(NamedTuple):
    model: NDArrays  # the payload's main arrays
    num_examples: int
    metrics: Mapping[str, Scalar]
    parts: dict[str, NDArrays]  # every part of a ``parts`` payload (just the model otherwise)


def accept_results(
    results: Sequence[tuple[ClientProxy, FitRes]], reference: NDArrays, order_key: str, tier: str
) -> tuple[list[Update], int]:
    """Updates that can be aggregated, ordered by ``metrics[order_key]`` (or the child node's
    path) so that float sums do not depend on arrival order, and the number rejected (logged
    with the reason). Empty payloads (a subtree with nothing to report) are skipped, not rejected."""
    accepted, rejected = [], 0
    unpacked: list[tuple[ClientProxy, FitRes, Payload | str]] = []
    for proxy, res in results:
        try:
            unpacked.append((proxy, res, unpack(decode(res.parameters), res.metrics)))
        except (ValueError, KeyError) as exc:
            unpacked.append((proxy, res, f"malformed payload: {exc}"))
    # NaN/Inf checked for all updates at once; only if one has some, update by update to name it.
    finite = all_finite([p.main for _, _, p in unpacked if isinstance(p, Payload) and "model" in p.parts])
    for proxy, res, payload in unpacked:
        if isinstance(payload, str):
            problem = payload
        else:
            if payload.kind == "empty":
                continue
            problem = update_problem(payload.main, reference, finite) if "model" in payload.parts else "no model part"
        if problem is None and res.num_examples <= 0:
            problem = f"num_examples is {res.num_examples}"
        if problem is not None:
            rejected += 1
            log.warning("%s: rejected the update of %s: %s", tier, proxy.cid, problem)
            continue
        accepted.append(Update(payload.main, res.num_examples, res.metrics, payload.parts))
    accepted.sort(key=lambda u: u.metrics.get(order_key, u.metrics.get("node", 0)))
    return accepted, rejected


class TeamStrategy(Strategy):
    """A team server: K rounds over its devices, starting from the parent model."""

    def __init__(self, parent: NDArrays, fit_config: Mapping[str, Scalar], min_fit_fraction: float = 1.0) -> None:
        self.parent = parent
        self.fit_config = dict(fit_config)
        self.min_fit_fraction = min_fit_fraction
        self.current: NDArrays = parent

    @abstractmethod
    def aggregate(self, current: NDArrays, models: list[NDArrays], weights: list[int]) -> NDArrays:
        """The team update rule."""

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.parent)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self.current = decode(parameters)  # the arrays aggregate_fit kept: no decoding
        ins = FitIns(parameters, {**self.fit_config, "team_round": server_round})
        return [(proxy, ins) for proxy in sorted(client_manager.all().values(), key=lambda p: p.cid)]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        accepted, rejected = accept_results(results, self.current, "device_id", "team")
        asked = len(results) + len(failures)
        needed = usable_needed(self.min_fit_fraction, asked)
        stats: dict[str, Scalar] = {"rejected": rejected, "failures": len(failures), "aggregated": len(accepted)}
        if len(accepted) < needed:
            log.error("team round %d: %d usable updates of %d asked, %d needed (min_fit_fraction %g)",
                      server_round, len(accepted), asked, needed, self.min_fit_fraction)
            return None, {**stats, "needed": needed}
        self.last_accepted = accepted  # for rules that read more than the models (e.g. residual parts)
        models = [u.model for u in accepted]
        weights = [u.num_examples for u in accepted]
        # Kept as arrays, encoded only if sent out of the process (hfl.payload.LocalParameters): the
        # next configure_fit and the node's batched devices read them back without decoding.
        return LocalParameters(self.aggregate(self.current, models, weights)), stats

    def configure_evaluate(self, server_round, parameters, client_manager):  # noqa: ANN001
        return []  # the team node evaluates its devices itself (hfl.team)

    def aggregate_evaluate(self, server_round, results, failures):  # noqa: ANN001
        return None, {}

    def evaluate(self, server_round, parameters):  # noqa: ANN001
        return None


class GlobalStrategy(Strategy):
    """The global server over team nodes: all teams every round, evaluation every
    ``eval_every`` rounds (and the last), fails loudly when a round aggregates nothing.

    Its state between rounds is its attributes: a killed run resumes from ``resume_state()``,
    written at the end of every round (hfl.resume), so a subclass's own attributes (optimiser
    moments, schedules, histories) are covered without code of its own. ``transient`` names
    those that are not state (rebuilt, or reset within a round); a state store is never state
    (it has versions of its own, hfl.store)."""

    transient: tuple[str, ...] = ("recorder", "_paths", "_round", "last_accepted", "min_fit_fraction", "dropout")

    def __init__(
        self,
        initial: NDArrays,
        *,
        num_teams: int,
        num_rounds: int,
        eval_every: int = 1,
        fit_config: Mapping[str, Scalar] | None = None,
        recorder=None,  # noqa: ANN001 - hfl.recorder.Recorder, optional
        team_wait_seconds: float = 60.0,
        device_sampling: DeviceDraw | None = None,
        min_fit_fraction: float = 0.0,
        dropout: Dropout | None = None,
    ) -> None:
        self.initial = initial
        self.device_sampling = device_sampling
        # A round needs this fraction of the level-1 nodes it asked (at least one): the same
        # algorithm.min_fit_fraction every inner node applies to its children (TeamStrategy).
        self.min_fit_fraction = min_fit_fraction
        self.dropout = dropout  # runtime.dropout_nodes of the level-1 nodes (hfl.faults)
        self._paths: dict[str, str] = {}  # level-1 node cid -> its path (asked once)
        self.fit_test_history: list[float] = []  # per global round: the devices' own test after training
        self.num_teams = num_teams
        self.num_rounds = num_rounds
        self.eval_every = eval_every
        self.fit_config = dict(fit_config or {})
        self.recorder = recorder
        self.team_wait_seconds = team_wait_seconds
        self.current: NDArrays = initial
        self._round: dict[str, float] = {}

    @abstractmethod
    def aggregate(self, current: NDArrays, models: list[NDArrays], weights: list[int]) -> NDArrays:
        """The global update rule."""

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.initial)

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
        self.current = decode(parameters)
        teams, extra = self._fit_targets(server_round, self._teams(client_manager))
        teams = self._drop_nodes(server_round, teams)
        parameters, meta = self.fit_message(server_round, parameters)
        self._round["bytes_down_global"] += payload_nbytes(parameters) * len(teams)
        ins = FitIns(parameters, {**self.fit_config, **extra, **meta, "global_round": server_round})
        return [(proxy, ins) for proxy in teams]

    def fit_message(self, server_round: int, parameters: Parameters) -> tuple[Parameters, dict[str, Scalar]]:
        """What the level-1 nodes are sent to train: the root's model, or (overridden) a payload
        with more in it, declared by the returned config entries (hfl.payload)."""
        return parameters, {}

    def evaluate_message(self, server_round: int, parameters: Parameters) -> tuple[Parameters, dict[str, Scalar]]:
        """What the level-1 nodes are sent to evaluate: the root's model as ``gm`` by default."""
        return parameters, {}

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
        called through a proxy whose fit raises (hfl.faults), so they count as failures; recorded
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
                key.startswith(("bytes_down_level", "bytes_up_level", "failures_level")) and key[-1].isdigit()
            ):
                self._round[key] = self._round.get(key, 0) + value

    def aggregate_fit(self, server_round, results, failures):  # noqa: ANN001
        accepted, rejected = accept_results(results, self.current, "team_id", "global")
        team_ids = [u.metrics.get("team_id") for u in accepted]
        if len(set(team_ids)) != len(team_ids):
            raise RuntimeError(f"global round {server_round}: duplicate team ids {sorted(team_ids)}; "
                               "two nodes serve the same team (check partition-id)")
        self._round["failures"] += len(failures) + rejected
        self._round["failures_level1"] = self._round.get("failures_level1", 0) + len(failures) + rejected
        # In node order, not arrival order (Flower's server collects futures in any order).
        for _, res in sorted(results, key=lambda r: node_order(r[1].metrics)):
            self._round["bytes_up_global"] += payload_nbytes(res.parameters)
            if res.metrics.get("samples"):
                self._round.setdefault("samples", []).append(str(res.metrics["samples"]))
            self._round["failures"] += int(res.metrics.get("device_failures", 0))
            self._count_team_report(res.metrics)
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
        tested = sum(int(res.metrics.get("fit_test_samples", 0)) for _, res in results)
        if tested:
            correct = sum(int(res.metrics.get("fit_test_correct", 0)) for _, res in results)
            self.fit_test_history.append(correct / tested)
        self.last_accepted = accepted
        models = [u.model for u in accepted]
        weights = [u.num_examples for u in accepted]
        self.current = self.aggregate(self.current, models, weights)
        return ndarrays_to_parameters(self.current), {}

    def evaluate(self, server_round, parameters):  # noqa: ANN001
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):  # noqa: ANN001
        if server_round % self.eval_every and server_round != self.num_rounds:
            self._finish(server_round, None)
            return []
        teams = self._teams(client_manager)
        parameters, meta = self.evaluate_message(server_round, parameters)
        self._round["bytes_down_global"] += payload_nbytes(parameters) * len(teams)
        ins = EvaluateIns(parameters, {**meta, "global_round": server_round})
        return [(proxy, ins) for proxy in teams]

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
        pooled = pool_evaluations(reports)
        pooled.update(fit_test_metrics(self.fit_test_history))
        pooled.update(self.root_evaluation())
        self._finish(server_round, pooled)
        loss = pooled["gm_loss"] if pooled.get("gm_loss") is not None else pooled.get("pm_loss")
        return loss, {k: v for k, v in pooled.items() if v is not None}

    def root_evaluation(self) -> dict[str, float]:
        """Metrics the root computes itself (e.g. on its own proxy test data); none by default."""
        return {}

    def resume_state(self) -> dict:
        """What a resumed run restores (``restore``): every attribute but the transient ones."""
        return {k: v for k, v in vars(self).items() if k not in self.transient and not isinstance(v, StateStore)}

    def restore(self, state: Mapping) -> None:
        vars(self).update(state)

    def _finish(self, server_round: int, evaluation: dict | None) -> None:
        seconds = time.perf_counter() - self._round.pop("start")
        if self.recorder is not None:
            self.recorder.round_done(server_round, seconds, dict(self._round), evaluation, self.current,
                                     resume_state=self.resume_state())
