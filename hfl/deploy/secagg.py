"""Secure aggregation in a deployment: Flower's SecAgg+ between a lowest node server and its devices.

Node side, ``secagg_fit_together``: a ``FitMany`` that runs Flower's ``SecAggPlusWorkflow`` for one
round's calls. A thin legacy ``Strategy`` hands the workflow exactly those calls (its
``configure_fit``) and keeps what it returns (its ``aggregate_fit``): each device's ``FitRes`` with
its own ``num_examples`` and metrics, its parameters replaced by the weighted mean the workflow
unmasked. The node's rule then runs as it always does. The workflow's ``send_and_receive`` goes
through hfl's exchange (``hfl.deploy.grid.exchange``: pulls at tens of milliseconds, a crashed
task sent again), not Flower's 3-second poll. A device that dropped is that call's failure;
dropouts are handled by the workflow (a dropped device's masks are rebuilt from its neighbours'
shares, and the round halts below the reconstruction threshold).

Device side, ``device_mod``: Flower's ``secaggplus_mod`` with two things around it: its NumPy
global generator seeded from the node's ``secagg_seed`` (Flower's quantization rounds
stochastically from it; hfl.node.secagg.rounding_seed, so simulation computes the same numbers)
and put back after, and a refusal of a reply whose weighted values leave ±clipping_range (Flower
would clip them silently).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.app.error import Error
from flwr.common import (
    FitIns,
    FitRes,
    Parameters,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

from hfl.deploy.grid import ChildFailed, GridProxy, exchange
from hfl.node.secagg import (
    CLIP_MARK,
    SEED_KEY,
    SecAggOverflow,
    SecAggSettings,
    as_sent,
    check_fits,
    check_sum,
    rounding_seed,
)

log = logging.getLogger("hfl")


class _FastGrid:
    """What the workflow needs of a Grid (``send_and_receive``), over hfl's exchange; an error reply
    for a device that failed or did not answer in time (the workflow counts it as dropped). Keeps
    each device's failure reasons, which the workflow does not attribute."""

    def __init__(self, grid: Any) -> None:
        self.grid = grid
        self.reasons: dict[int, str] = {}
        self.seconds: list[float] = []  # per exchange (the workflow's stages in order: setup, keys, train, unmask)

    def send_and_receive(self, messages: Sequence[Message], *, timeout: float | None = None) -> list[Message]:
        sent = list(messages)
        out = []
        start = time.monotonic()
        replies = exchange(self.grid, sent, timeout)
        self.seconds.append(time.monotonic() - start)
        for message, reply in zip(sent, replies, strict=True):
            node = message.metadata.dst_node_id
            if isinstance(reply, ChildFailed):
                self.reasons[node] = str(reply)
                reply = Message(error=Error(code=ErrorCode.UNKNOWN, reason=str(reply)), reply_to=message)
            elif reply.has_error():
                self.reasons[node] = str(reply.error.reason)
            out.append(reply)
        return out


class _OneRound(Strategy):
    """The round's calls for the workflow, and its results back: nothing else of a Strategy is used."""

    def __init__(self, calls: list[tuple[ClientProxy, FitIns]]) -> None:
        self.calls = calls
        self.results: dict[int, FitRes] = {}

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        return self.calls

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        self.results = {proxy.node_id: res for proxy, res in results}
        return None, {}

    def initialize_parameters(self, client_manager: Any) -> None:
        return None

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        return []

    def aggregate_evaluate(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        return None


def secagg_fit_together(s: SecAggSettings, seed: int, path: str) -> Any:
    """A lowest node server's ``FitMany``: one SecAgg+ run per round over the devices it asks."""

    def fit_many(calls: list[tuple[ClientProxy, FitIns]]) -> list[FitRes | BaseException]:
        remote = [(p, FitIns(ins.parameters, {**ins.config, SEED_KEY: rounding_seed(
                      seed, path, p.cid, str(ins.config.get("round_path", "")))}))
                  for p, ins in calls if isinstance(p, GridProxy)]
        nodes = {p.node_id for p, _ in remote}
        if len(nodes) < len(remote):
            raise SecAggOverflow("privacy.secure_aggregation: two devices share a Flower node")
        grid = _FastGrid(remote[0][0].grid) if remote else None
        strategy = _OneRound(remote)
        if len(remote) >= 2:
            round_no = 1
            context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                                    strategy=strategy, client_manager=SimpleClientManager())
            context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: round_no})
            context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
            timeouts = [p.timeout for p, _ in remote]
            workflow = SecAggPlusWorkflow(s.num_shares, s.reconstruction_threshold, max_weight=s.max_weight,
                                          clipping_range=s.clipping_range, quantization_range=s.quantization_range,
                                          modulus_range=s.modulus_range,
                                          timeout=None if None in timeouts else max(timeouts))
            workflow(grid, context)
        clipped = [r for r in (grid.reasons.values() if grid else ()) if CLIP_MARK in r]
        if clipped:  # a device refused to be clipped: stop, loudly, rather than merge without it
            raise SecAggOverflow(clipped[0])
        if strategy.results:
            first = next(iter(strategy.results.values()))
            check_sum(len(strategy.results), sum(s.q_ratio(r.num_examples) for r in strategy.results.values()), s)
            mean = as_sent(parameters_to_ndarrays(first.parameters), parameters_to_ndarrays(remote[0][1].parameters))
            shared = ndarrays_to_parameters(mean)
        out: list[FitRes | BaseException] = []
        for proxy, _ in calls:
            node = getattr(proxy, "node_id", None)
            res = strategy.results.get(node) if isinstance(proxy, GridProxy) else None
            if res is not None:
                out.append(FitRes(res.status, shared, res.num_examples, res.metrics))
            elif not isinstance(proxy, GridProxy):
                out.append(ChildFailed(f"{proxy.cid}: not connected"))
            elif len(remote) < 2:
                out.append(ChildFailed(f"secure aggregation needs at least 2 devices a round, this round asked "
                                       f"{len(remote)}"))
            else:
                out.append(ChildFailed(grid.reasons.get(node) or "secure aggregation halted: fewer devices than its "
                                                                  "reconstruction threshold"))
        if grid is not None and grid.seconds:
            # the protocol's cost beside the devices' training: every stage but the one that trains (the third)
            train = grid.seconds[2] if len(grid.seconds) > 2 else 0.0
            log.info("node %s: secure aggregation of %d of %d devices in %.2f s, %.2f s of it beside training "
                     "(stages %s s)", path, len(strategy.results), len(calls), sum(grid.seconds),
                     sum(grid.seconds) - train, " / ".join(f"{x:.2f}" for x in grid.seconds))
        return out

    return fit_many


# ---------------------------------------------------------------- the device's side
def device_mod(msg: Message, ctxt: Context, call_next: Any) -> Message:
    """``secaggplus_mod`` for a SecAgg+ stage message (hfl.app's ClientApp passes the others by):
    NumPy's global generator seeded for the quantization and put back after; a reply that
    Flower's quantization would clip refused."""
    from flwr.client.mod import secaggplus_mod

    saved = np.random.get_state()
    try:
        return secaggplus_mod(msg, ctxt, lambda m, c: _checked(m, c, call_next))
    finally:
        np.random.set_state(saved)


def _checked(msg: Message, ctxt: Context, call_next: Any) -> Message:
    """The device's training (the collect-masked-vectors stage), checked, then the rounding seeded."""
    reply = call_next(msg, ctxt)
    if reply.has_error():
        return reply
    fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
    state = ctxt.state.config_records[RECORD_KEY_STATE]  # the setup stage's parameters, saved by the mod
    s = SecAggSettings(clipping_range=float(state["clipping_range"]), quantization_range=int(state["target_range"]),
                       modulus_range=int(state["mod_range"]), max_weight=float(state["max_weight"]))
    if str(fitres.metrics.get("payload", "model")) != "model":
        raise SecAggOverflow(f"{CLIP_MARK}: a {fitres.metrics.get('payload')!r} payload; secure aggregation averages "
                             "one model per device")
    check_fits(parameters_to_ndarrays(fitres.parameters), fitres.num_examples, s)
    config = msg.content.config_records.get("fitins.config")
    seed = None if config is None else config.get(SEED_KEY)
    if seed is not None:
        np.random.seed(int(seed))
    return reply
