"""Run a Flower Strategy over clients living in the same process.

An inner node is "a client outside, a strategy inside" (DESIGN.md): in simulation its
devices are NumPyClients in the node's process, driven through the ordinary
Strategy API (configure_fit / aggregate_fit) by this small, sequential round loop.
Children may themselves be inner nodes, which is what makes deeper trees possible.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

from flwr.client import Client
from flwr.common import (
    Code,
    DisconnectRes,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetParametersIns,
    GetParametersRes,
    GetPropertiesIns,
    GetPropertiesRes,
    Parameters,
    ReconnectIns,
)
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from hfl.clock.dropped import SimulatedFault
from hfl.errors import first_failure
from hfl.node.lockstep import Execute, Lockstep
from hfl.rules.payload import payload_nbytes

if TYPE_CHECKING:
    from hfl.clock.timer import NodeTimer, RoundTiming
    from hfl.node.cohort import Cohort

log = logging.getLogger(__name__)


class InProcessClientProxy(ClientProxy):
    """A ClientProxy that calls a Flower ``Client`` directly.

    ``client`` may be a factory, called for every message like Flower's ``client_fn``, so
    that node state must survive through the node's store exactly as in the simulation.
    """

    def __init__(self, cid: str, client: Client | Callable[[], Client]) -> None:
        super().__init__(cid)
        self._client = client

    @property
    def client(self) -> Client:
        return self._client if isinstance(self._client, Client) else self._client()

    def get_properties(self, ins: GetPropertiesIns, timeout: float | None, group_id: int | None) -> GetPropertiesRes:
        return self.client.get_properties(ins)

    def get_parameters(self, ins: GetParametersIns, timeout: float | None, group_id: int | None) -> GetParametersRes:
        return self.client.get_parameters(ins)

    def fit(self, ins: FitIns, timeout: float | None, group_id: int | None) -> FitRes:
        return self.client.fit(ins)

    def evaluate(self, ins: EvaluateIns, timeout: float | None, group_id: int | None) -> EvaluateRes:
        return self.client.evaluate(ins)

    def reconnect(self, ins: ReconnectIns, timeout: float | None, group_id: int | None) -> DisconnectRes:
        return DisconnectRes(reason="in-process client")


class NamedChild(ClientProxy):
    """A child known by its cid alone: the sender of a reply carried over from an earlier call
    (hfl.clock), which nothing calls again through this proxy."""

    def _absent(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError(f"child {self.cid} is not called through a carried reply")

    get_properties = get_parameters = fit = evaluate = reconnect = _absent


class ChildProxies(Sequence[ClientProxy]):
    """A node's children in cid order, each proxy made when it is first read (``make(cid)``) and
    kept: a node of 10,000 devices that asks 10 of them a round makes 10 proxies, not 10,000."""

    def __init__(self, cids: Sequence[str], make: Callable[[str], ClientProxy]) -> None:
        self.cids = cids  # sorted, as sorted(cid) would order the proxies
        self._make = make
        self._made: dict[str, ClientProxy] = {}

    def __len__(self) -> int:
        return len(self.cids)

    @overload
    def __getitem__(self, index: int) -> ClientProxy: ...

    @overload
    def __getitem__(self, index: slice) -> list[ClientProxy]: ...

    def __getitem__(self, index: int | slice) -> ClientProxy | list[ClientProxy]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self._proxy(self.cids[index])

    def _proxy(self, cid: str) -> ClientProxy:
        proxy = self._made.get(cid)
        if proxy is None:
            proxy = self._made[cid] = self._make(cid)
        return proxy

    def get(self, cid: str, default: ClientProxy | None = None) -> ClientProxy | None:
        """The proxy of child ``cid`` (made now if need be), else ``default``."""
        return self._proxy(cid) if cid in self.cids else default


class LazyClientManager(SimpleClientManager):
    """A node's children as Flower's client manager, their proxies made as they are read
    (``ChildProxies``): ``ordered_children`` hands the sampling code the lazy sequence; ``all()``
    makes every proxy (a full evaluation, a round without sampling)."""

    def __init__(self, children: ChildProxies) -> None:
        super().__init__()
        self.children = children

    def __len__(self) -> int:
        return len(self.children)

    def num_available(self) -> int:
        return len(self.children)

    def all(self) -> dict[str, ClientProxy]:
        return {proxy.cid: proxy for proxy in self.children}


def ordered_children(manager: SimpleClientManager) -> Sequence[ClientProxy]:
    """A manager's children sorted by cid; lazily where the manager makes them (LazyClientManager)."""
    if isinstance(manager, LazyClientManager):
        return manager.children
    return sorted(manager.all().values(), key=lambda p: p.cid)


def client_manager_of(proxies: list[ClientProxy]) -> SimpleClientManager:
    manager = SimpleClientManager()
    for proxy in proxies:
        manager.register(proxy)
    return manager


# Counters a node adds up over its subtree (its children's replies carry theirs).
# fit_test_*: devices' own test of the model they trained this round (the PFLEGO paper's figure).
# bytes_*_team and compute_seconds: a level-1 node's totals, which the root records (a node's own override them).
# train_loss_*: the devices' training losses (a reply's train_loss x its examples), summed: a subtree's mean loss
# (what a loss-aware choice of children reads, hfl.node.cohort).
SUBTREE_COUNTERS = ("bytes_down_level", "bytes_up_level", "failures_level", "device_failures", "rejected", "fit_test_",
                    "late_level", "stale_level", "merged_rounds_level", "empty_rounds_level",
                    "bytes_down_team", "bytes_up_team", "compute_seconds", "train_loss_", "dp_clipped_level")


@dataclass
class RoundsReport:
    """What a run of a node's rounds moved, lost and asked."""

    bytes_down: int = 0
    bytes_up: int = 0
    failures: int = 0
    num_examples: int = 0  # samples behind the last round's aggregate (they sum up the tree)
    metrics: list[dict] = field(default_factory=list)
    subtree: dict[str, float] = field(default_factory=dict)  # SUBTREE_COUNTERS from the children
    child_samples: list[dict] = field(default_factory=list)  # the sample records of child nodes

    sim_time: float | None = None  # the simulated time the last round closed (hfl.clock)
    late: int = 0  # replies dropped as late (deadline) or too stale
    stale: int = 0  # replies merged stale
    merged_rounds: int = 0  # rounds that merged replies (hfl.clock: a policy may close a round with none)
    empty_rounds: int = 0  # rounds in which no reply arrived in time: the model stays as it was

    def add_timing(self, timing: RoundTiming) -> None:
        self.sim_time = timing.end
        self.late += timing.late
        self.stale += timing.stale

    def add_child_counters(self, metrics: dict, num_examples: int) -> None:
        for key, value in metrics.items():
            if key.startswith(SUBTREE_COUNTERS) and isinstance(value, int | float):
                self.subtree[key] = self.subtree.get(key, 0) + value
        loss = metrics.get("train_loss")  # a device's
        if isinstance(loss, int | float) and math.isfinite(loss):
            self.subtree["train_loss_sum"] = self.subtree.get("train_loss_sum", 0.0) + float(loss) * num_examples
            self.subtree["train_loss_examples"] = self.subtree.get("train_loss_examples", 0) + num_examples
        if metrics.get("samples"):
            self.child_samples.extend(json.loads(str(metrics["samples"])))


# Fits a round's children together (hfl.accel.batched.BatchedFit): per (proxy, FitIns), the FitRes or
# the exception the child raised.
FitMany = Callable[[list[tuple[ClientProxy, FitIns]]], list[FitRes | BaseException]]


def call_fit(proxy: ClientProxy, ins: FitIns, timeout: float | None = None,
             group_id: int | None = None) -> FitRes | BaseException:
    """A child's FitRes, or the exception it raised (a dead child is counted, the round goes on)."""
    try:
        return proxy.fit(ins, timeout=timeout, group_id=group_id)
    except Exception as exc:  # noqa: BLE001 - the caller counts it as the child's failure
        return exc


def fit_one_by_one(calls: list[tuple[ClientProxy, FitIns]]) -> list[FitRes | BaseException]:
    return [call_fit(proxy, ins) for proxy, ins in calls]


def call_evaluate(proxy: ClientProxy, ins: EvaluateIns, timeout: float | None = None,
                  group_id: int | None = None) -> EvaluateRes | BaseException:
    """A child's EvaluateRes, or the exception it raised (the caller counts it)."""
    try:
        return proxy.evaluate(ins, timeout=timeout, group_id=group_id)
    except Exception as exc:  # noqa: BLE001 - the caller counts it as the child's failure
        return exc


# Evaluates children together (the root's level-1 nodes): per (proxy, EvaluateIns), the EvaluateRes or the
# exception the child raised, in the order of the calls.
EvaluateCalls = Callable[[list[tuple[ClientProxy, EvaluateIns]]], list[EvaluateRes | BaseException]]


def _together(call: Callable, group_id: int | None, timeout: float | None, max_workers: int | None) -> Callable:
    """``call`` for each (proxy, ins) at once, each on a thread of its own (as Flower's legacy server
    calls its clients; ``max_workers`` 1: one after the other); the outcomes in the order of the calls."""

    def many(calls: list) -> list:
        if len(calls) <= 1 or max_workers == 1:
            return [call(proxy, ins, timeout, group_id) for proxy, ins in calls]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers or len(calls)) as pool:
            futures = [pool.submit(call, proxy, ins, timeout, group_id) for proxy, ins in calls]
            return [f.result() for f in futures]

    return many


def fit_together(group_id: int | None = None, timeout: float | None = None,
                 max_workers: int | None = None) -> FitMany:
    """The children's fits at once (``_together``): the root's level-1 nodes work in parallel where
    they live elsewhere (Ray actors, deployed hosts)."""
    return _together(call_fit, group_id, timeout, max_workers)


def evaluate_together(group_id: int | None = None, timeout: float | None = None,
                      max_workers: int | None = None) -> EvaluateCalls:
    """The children's evaluations at once (``_together``), as their fits."""
    return _together(call_evaluate, group_id, timeout, max_workers)


def fit_in_lockstep(execute: Execute, group_id: int | None = None, timeout: float | None = None) -> FitMany:
    """The children as the parties of a ``Lockstep`` (hfl.node.lockstep): their fits take turns,
    and the batched steps they reach are merged by ``execute`` (hfl.accel.batched.run_plan_requests)."""

    def fit_many(calls: list[tuple[ClientProxy, FitIns]]) -> list[FitRes | BaseException]:
        return Lockstep(execute).run([lambda proxy=proxy, ins=ins: proxy.fit(ins, timeout=timeout, group_id=group_id)
                                      for proxy, ins in calls])

    return fit_many


def run_fit_rounds(
    strategy: Strategy,
    manager: SimpleClientManager,
    num_rounds: int,
    cohort: Cohort | None = None,
    round_path: str = "",
    forward: dict | None = None,
    fit_many: FitMany = fit_one_by_one,
    timer: NodeTimer | None = None,
    first_round: int = 1,
) -> tuple[Parameters, RoundsReport]:
    """``num_rounds`` rounds of configure_fit -> client.fit -> aggregate_fit, in order: the round
    loop of every node, the root included (one global round a call, ``first_round`` its number).

    Each round the strategy sees only the children ``cohort`` asks (hfl.node.cohort; all of them
    without one), and the cohort sees the replies the round merged; each FitIns also carries the ``round_path`` of that round
    (e.g. ``"3.2"`` = round 2 of a level-1 node's call in global round 3) so that a child node seeds its own
    sampling by it, and the ``forward`` entries (e.g. the devices the root drew). ``fit_many``
    calls the round's children (one by one, or a lowest node's devices batched). With a ``timer``
    (simulated time, hfl.clock), each reply reaches the node at its simulated time and the level's
    policy decides which replies a round merges (sync: all; deadline, buffered: hfl.clock.policy).
    Under a clock, stale replies are merged against the strategy's ``merge_reference()``: the node's
    model as it sent it this round.
    """
    report = RoundsReport()
    parameters = strategy.initialize_parameters(manager)
    if parameters is None:
        raise RuntimeError(f"{type(strategy).__name__}.initialize_parameters returned no model")
    children = ordered_children(manager)  # proxies made only for the children a sample reads
    for server_round in range(first_round, first_round + num_rounds):
        here = f"{round_path}.{server_round}" if round_path else str(server_round)
        asked = cohort.ask(here, children) if cohort is not None else list(children)
        instructions = strategy.configure_fit(server_round, parameters, client_manager_of(asked))
        results: list[tuple[ClientProxy, FitRes]] = []
        failures: list[tuple[ClientProxy, FitRes] | BaseException] = []
        calls = [(proxy, FitIns(ins.parameters, {**ins.config, **(forward or {}), "round_path": here}))
                 for proxy, ins in instructions]
        if timer is not None:
            calls = timer.send(calls)
        report.bytes_down += sum(payload_nbytes(ins.parameters) for _, ins in calls)
        if timer is None:
            outcomes = fit_many(calls)
        else:
            arrived, closed, timing = timer.exchange(calls, fit_many, strategy.merge_reference)
            # A subtree's counters (its failures first) count when it computed them, whether its reply is
            # merged now, in a later round or never (dropped as late): as the root counts them.
            for res in arrived:
                if isinstance(res, FitRes) and res.status.code == Code.OK:
                    report.add_child_counters(res.metrics, res.num_examples)
            report.add_timing(timing)
            by_cid = {proxy.cid: proxy for proxy, _ in calls}
            outcomes = [entry.result for entry in closed.merged + closed.failed]
            calls = [(entry.proxy or by_cid.get(entry.cid) or NamedChild(entry.cid), None)
                     for entry in closed.merged + closed.failed]
        for (proxy, _), res in zip(calls, outcomes, strict=True):
            if isinstance(res, BaseException):  # a dead child is counted, the round goes on
                # A simulated fault (runtime.dropout) is expected: the log file has it, the console not.
                log.log(logging.INFO if isinstance(res, SimulatedFault) else logging.WARNING,
                        "client %s failed in round %d: %r", proxy.cid, server_round, res)
                failures.append(res)
                continue
            if res.status.code != Code.OK:
                failures.append((proxy, res))
                continue
            report.bytes_up += payload_nbytes(res.parameters)
            if timer is None:
                report.add_child_counters(res.metrics, res.num_examples)
            results.append((proxy, res))
        report.failures += len(failures)  # in every round of every policy, merged or not
        if cohort is not None:
            cohort.observe(here, results)
        if timer is not None and not results and (timing.pending or not failures):
            # No reply arrived in time (the others are late, in flight or came empty): the policy merges
            # nothing this round, the model stays as it was; counted. Failures alone with nothing left to
            # come go on to aggregate_fit, which stops the call naming the first failure, as under sync.
            report.empty_rounds += 1
            report.metrics.append({"empty": 1})
            continue
        aggregated, metrics = strategy.aggregate_fit(server_round, results, failures)
        if aggregated is None:
            needed = metrics.get("needed")
            needed = f"; {needed} usable updates needed (algorithm.min_fit_fraction)" if needed is not None else ""
            raise RuntimeError(
                f"round {here}: no model aggregated from {len(results)} results "
                f"({metrics.get('rejected', 0)} rejected as NaN/Inf or misshaped), {len(failures)} failures{needed}"
                f"{first_failure(failures)}"  # e.g. CUDA out of memory: the cause, not just a count
            )
        parameters = aggregated
        report.merged_rounds += 1
        report.metrics.append(dict(metrics))
        report.num_examples = sum(res.num_examples for _, res in results if res.metrics.get("payload") != "empty")
    return parameters, report


# Evaluates every child of a manager (evaluate_children, or hfl.accel.batched.BatchedEvaluate).
EvaluateMany = Callable[[SimpleClientManager, Parameters, dict], tuple[list[tuple[str, EvaluateRes]], int]]


def evaluate_children(
    manager: SimpleClientManager, parameters: Parameters, config: dict
) -> tuple[list[tuple[str, EvaluateRes]], int]:
    """Send one EvaluateIns to every child (sorted by cid); returns replies and bytes sent."""
    children = sorted(manager.all().values(), key=lambda p: p.cid)
    return [(proxy.cid, evaluate_child(proxy, parameters, config)) for proxy in children], \
        len(children) * payload_nbytes(parameters)


def evaluate_child(proxy: ClientProxy, parameters: Parameters, config: dict) -> EvaluateRes:
    """One child's evaluation; a reply that is not OK raises (evaluation is never dropped)."""
    res = proxy.evaluate(EvaluateIns(parameters, dict(config)), timeout=None, group_id=None)
    if res.status.code != Code.OK:
        raise RuntimeError(f"child {proxy.cid} failed to evaluate: {res.status.message}")
    return res

