"""Run a Flower Strategy over clients living in the same process.

A team node is "a client outside, a strategy inside" (DESIGN.md): in simulation its
devices are NumPyClients in the team node's process, driven through the ordinary
Strategy API (configure_fit / aggregate_fit) by this small, sequential round loop.
Children may themselves be team nodes, which is what makes deeper trees possible.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

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

from hfl.aggregate import nbytes

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


def client_manager_of(proxies: list[ClientProxy]) -> SimpleClientManager:
    manager = SimpleClientManager()
    for proxy in proxies:
        manager.register(proxy)
    return manager


@dataclass
class RoundsReport:
    """What a run of team rounds moved and lost."""

    bytes_down: int = 0
    bytes_up: int = 0
    failures: int = 0
    metrics: list[dict] = field(default_factory=list)


def run_fit_rounds(
    strategy: Strategy, manager: SimpleClientManager, num_rounds: int
) -> tuple[Parameters, RoundsReport]:
    """``num_rounds`` rounds of configure_fit -> client.fit -> aggregate_fit, in order."""
    report = RoundsReport()
    parameters = strategy.initialize_parameters(manager)
    if parameters is None:
        raise RuntimeError(f"{type(strategy).__name__}.initialize_parameters returned no model")
    for server_round in range(1, num_rounds + 1):
        instructions = strategy.configure_fit(server_round, parameters, manager)
        results: list[tuple[ClientProxy, FitRes]] = []
        failures: list[tuple[ClientProxy, FitRes] | BaseException] = []
        for proxy, ins in instructions:
            report.bytes_down += nbytes(ins.parameters.tensors)
            try:
                res = proxy.fit(ins, timeout=None, group_id=server_round)
            except Exception as exc:  # a dead child is counted, the round goes on
                log.warning("client %s failed in round %d: %r", proxy.cid, server_round, exc)
                failures.append(exc)
                continue
            if res.status.code != Code.OK:
                failures.append((proxy, res))
                continue
            report.bytes_up += nbytes(res.parameters.tensors)
            results.append((proxy, res))
        report.failures += len(failures)
        aggregated, metrics = strategy.aggregate_fit(server_round, results, failures)
        if aggregated is None:
            raise RuntimeError(
                f"round {server_round}: no model aggregated from {len(results)} results "
                f"({metrics.get('rejected', 0)} rejected as NaN/Inf or misshaped), {len(failures)} failures"
            )
        parameters = aggregated
        report.metrics.append(dict(metrics))
    return parameters, report


def evaluate_children(
    manager: SimpleClientManager, parameters: Parameters, config: dict
) -> tuple[list[tuple[str, EvaluateRes]], int]:
    """Send one EvaluateIns to every child (sorted by cid); returns replies and bytes sent."""
    replies, sent = [], 0
    for proxy in sorted(manager.all().values(), key=lambda p: p.cid):
        sent += nbytes(parameters.tensors)
        res = proxy.evaluate(EvaluateIns(parameters, dict(config)), timeout=None, group_id=None)
        if res.status.code != Code.OK:
            raise RuntimeError(f"child {proxy.cid} failed to evaluate: {res.status.message}")
        replies.append((proxy.cid, res))
    return replies, sent

