"""A deployed node's children behind Flower's ``Grid``, polled at tens of milliseconds.

Flower's ``GridClientProxy`` sends through ``Grid.send_and_receive``, which sleeps 3 s between
pulls, and its client-manager thread refreshes the node list every 5 s
(``../shared/notes/flower-and-environment.md``, "Deployment latency"). ``push_messages`` and
``pull_messages`` are public, so here every exchange pushes its messages at once and pulls
their replies every ``interval`` seconds: a node's round costs its children's work, not
Flower's sleeps. Messages are the legacy ones (``fitins``/``evaluateins`` records) that
``NumPyClient`` ClientApps answer.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from flwr.app import Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import (
    Code,
    Status,
    ndarrays_to_parameters,
    DisconnectRes,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetParametersIns,
    GetParametersRes,
    GetPropertiesIns,
    GetPropertiesRes,
    MessageTypeLegacy,
    ReconnectIns,
)
from flwr.common.constant import ErrorCode
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.serverapp.grid import Grid

log = logging.getLogger("hfl")

# Seconds between pulls: the first after INTERVAL, then each wait 1.5 times longer up to MAX_INTERVAL,
# so that a reply is seen within a quarter second and a long round costs tens of pulls, not
# thousands (every pull is a request the SuperLink serves; on 2 cores, polling at a fixed 20 ms
# from every node of a 4-tier tree kept the SuperLinks busy).
INTERVAL = 0.02
MAX_INTERVAL = 0.25


# Seconds between looks, while replies are awaited, for children that came back as new Flower nodes.
RELOCATE_EVERY = 2.0
Relocate = Callable[[Sequence[int]], dict[int, int]]  # node ids awaited -> the newest node of the same child


class ChildFailed(RuntimeError):
    """A child's reply carried an error, or none came before the deadline."""


CRASH_RETRIES = 2  # a message is sent again this often to a child whose task process died


class Exchange:
    """Messages in flight to a node's children, pushed as they come (``add``) and their replies
    looked for (``poll``, one pull): how ``exchange`` waits for a batch, and how a node's
    real-time policies (hfl.clock.realtime) keep replies in flight across rounds.

    With ``relocate`` (hfl.deploy.children.Children.relocate), a message whose child came back
    as a new Flower node (its process killed and started again) is pushed again to that node:
    looked for every RELOCATE_EVERY seconds, and once Flower reports the old node gone, for
    ``rejoin_seconds`` more before the child counts as failed. A child whose task process died
    (Flower's "ClientApp stopped responding") is sent the message again, ``CRASH_RETRIES`` times
    at most. Children answer a message they see again as they did the first time
    (hfl.deploy.device, hfl.deploy.bridge)."""

    def __init__(self, grid: Grid, relocate: Relocate | None = None, rejoin_seconds: float = 60.0) -> None:
        self.grid, self.relocate, self.rejoin_seconds = grid, relocate, rejoin_seconds
        self.messages: list[Message] = []
        self.dst: list[int] = []
        self.current: list[str | None] = []  # per message, the id of its newest push (None: its node is gone)
        self.crashes: list[int] = []  # per message: how often its child's task process died and it was resent
        self.gone: dict[int, tuple[Message, float]] = {}  # message index -> Flower's "node unavailable", since when
        self.open: set[int] = set()  # messages whose reply is still awaited
        self.moved = False  # the last poll sent a message again to a child that came back
        self.next_look = time.monotonic() + RELOCATE_EVERY

    def add(self, messages: Sequence[Message]) -> list[int]:
        """Push ``messages`` together; their indices (what ``poll`` and ``drop`` name them by)."""
        first = len(self.messages)
        self.messages.extend(messages)
        self.dst.extend(m.metadata.dst_node_id for m in messages)
        self.current.extend(mid or None for mid in self.grid.push_messages(messages))
        self.crashes.extend(0 for _ in messages)
        indices = list(range(first, len(self.messages)))
        self.open.update(indices)
        return indices

    def drop(self, i: int) -> None:
        """No longer wait for message ``i``'s reply (a reply the node's policy dropped as late)."""
        self.open.discard(i)
        self.gone.pop(i, None)

    def poll(self) -> dict[int, Message]:
        """One pull: the replies that came (an error reply included: a failure), a child gone for
        longer than ``rejoin_seconds`` answered with Flower's "node unavailable"."""
        final: dict[int, Message] = {}
        self.moved = False
        inflight = {self.current[i]: i for i in self.open if self.current[i] is not None}
        for reply in self.grid.pull_messages(list(inflight)) if inflight else ():
            i = inflight[reply.metadata.reply_to_message_id]
            if self.relocate is not None and reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE:
                # since when: kept while the message is sent again to a node that is back (same id or new)
                self.gone[i] = (reply, self.gone[i][1] if i in self.gone else time.monotonic())
                self.current[i] = None
            elif (reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_CRASHED
                  and self.crashes[i] < CRASH_RETRIES):
                # The process running the child's task died (its runner, or Flower's per-message ClientApp,
                # killed); the child is still there and answers a message it sees again as the first time.
                self.crashes[i] += 1
                log.info("node %s: its ClientApp stopped (%s); sending its message again", self.dst[i],
                         reply.error.reason)
                (self.current[i],) = self.grid.push_messages([again(self.messages[i], self.dst[i])])
            else:
                final[i] = reply
                self.gone.pop(i, None)  # answered after all (sent again to its node, back)
        now = time.monotonic()
        waiting = sorted(self.open - set(final))
        if self.relocate is not None and (self.gone or now >= self.next_look) and waiting:
            newest = self.relocate([self.dst[i] for i in waiting])
            for i in waiting:
                node = newest.get(self.dst[i])
                # A child started again (a new node), or back online after Flower declared it gone (its
                # heartbeats missed through a long cut: the same node, the message answered "unavailable")
                if node is not None and (node != self.dst[i] or self.current[i] is None):
                    log.info("node %s is back as node %s: sending its message again", self.dst[i], node)
                    if node != self.dst[i]:
                        self.gone.pop(i, None)
                    self.dst[i] = node
                    (self.current[i],) = self.grid.push_messages([again(self.messages[i], self.dst[i])])
                    self.moved = True
            self.next_look = now + RELOCATE_EVERY
        for i, (reply, since) in list(self.gone.items()):
            if now - since > self.rejoin_seconds:
                final[i] = reply
                del self.gone[i]
        self.open -= set(final)
        return final

    def failure(self, i: int, reply: Message | None, timeout: float | None) -> ChildFailed | None:
        """Message ``i``'s outcome as a failure (no reply, or an error reply), else None."""
        if reply is None:
            reply = self.gone[i][0] if i in self.gone else None
        if reply is None:
            return ChildFailed(f"node {self.dst[i]}: no reply within {timeout} s")
        if reply.has_error():
            return ChildFailed(f"node {self.dst[i]}: {reply.error.reason}")
        return None


def exchange(grid: Grid, messages: Sequence[Message], timeout: float | None,
             interval: float = INTERVAL, relocate: Relocate | None = None,
             rejoin_seconds: float = 60.0) -> list[Message | ChildFailed]:
    """Push ``messages`` together, pull their replies (``interval`` after the push, then less and
    less often, hfl.deploy.grid.MAX_INTERVAL at most) until all are in or ``timeout`` passes; per
    message, in order, its reply or the failure (a child that came back, or whose task process
    died, is sent its message again: ``Exchange``)."""
    flight = Exchange(grid, relocate, rejoin_seconds)
    indices = flight.add(messages)
    replies: dict[int, Message] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    wait = interval
    while True:
        replies.update(flight.poll())
        if flight.moved:
            wait = interval
        if len(replies) == len(indices) or (deadline is not None and time.monotonic() > deadline):
            break
        time.sleep(wait if not flight.gone else min(wait, 1.0))
        wait = min(wait * 1.5, max(interval, MAX_INTERVAL))
    return [flight.failure(i, replies.get(i), timeout) or replies[i] for i in indices]


def again(message: Message, node_id: int) -> Message:
    """``message`` for another node: same content, type, group and time to live."""
    meta = message.metadata
    return Message(content=message.content, dst_node_id=node_id, message_type=meta.message_type,
                   ttl=meta.ttl, group_id=meta.group_id)


def ask_properties(grid: Grid, node_ids: Sequence[int], config: dict, timeout: float | None,
                   interval: float = INTERVAL) -> list[dict | ChildFailed]:
    """``get_properties`` of every node in ``node_ids`` in one exchange: per node its properties
    or the failure."""
    content = compat.getpropertiesins_to_recorddict(GetPropertiesIns(dict(config)))
    messages = [Message(content=content, dst_node_id=n, message_type=MessageTypeLegacy.GET_PROPERTIES, ttl=timeout)
                for n in node_ids]
    return [reply if isinstance(reply, ChildFailed) else compat.recorddict_to_getpropertiesres(reply.content).properties
            for reply in exchange(grid, messages, timeout, interval)]


def tell_stop(grid: Grid, node_ids: Sequence[int]) -> None:
    """Tell node hosts' bridges the experiment is over (their node servers end their runs and
    tell theirs); a node already gone ends on its own (its idle limit, or its SuperLink gone)."""
    for node, reply in zip(node_ids, ask_properties(grid, node_ids, {"stop": True}, 30.0), strict=True):
        if isinstance(reply, ChildFailed):
            log.warning("could not tell node %s to stop: %s", node, reply)


class GridProxy(ClientProxy):
    """A remote child named by its place in the tree (``cid``: a child path, or a device id as
    ``"000042"``), reached at Flower node ``node_id``."""

    def __init__(self, cid: str, node_id: int, grid: Grid, timeout: float | None = None,
                 interval: float = INTERVAL, relocate: Relocate | None = None, rejoin_seconds: float = 60.0) -> None:
        super().__init__(cid)
        self.node_id = node_id
        self.grid = grid
        self.timeout = timeout
        self.interval = interval
        self.relocate = relocate  # where a child that was started again is now (hfl.deploy.children)
        self.rejoin_seconds = rejoin_seconds

    def message(self, content: RecordDict, message_type: str, timeout: float | None = None) -> Message:
        return Message(content=content, dst_node_id=self.node_id, message_type=message_type,
                       ttl=timeout or self.timeout)

    def _call(self, content: RecordDict, message_type: str, timeout: float | None) -> RecordDict:
        (reply,) = exchange(self.grid, [self.message(content, message_type, timeout)], timeout or self.timeout,
                            self.interval, self.relocate, self.rejoin_seconds)
        if isinstance(reply, ChildFailed):
            raise reply
        return reply.content

    def get_properties(self, ins: GetPropertiesIns, timeout: float | None, group_id: int | None) -> GetPropertiesRes:
        content = self._call(compat.getpropertiesins_to_recorddict(ins), MessageTypeLegacy.GET_PROPERTIES, timeout)
        return compat.recorddict_to_getpropertiesres(content)

    def get_parameters(self, ins: GetParametersIns, timeout: float | None, group_id: int | None) -> GetParametersRes:
        content = self._call(compat.getparametersins_to_recorddict(ins), MessageTypeLegacy.GET_PARAMETERS, timeout)
        return compat.recorddict_to_getparametersres(content, False)

    def fit(self, ins: FitIns, timeout: float | None, group_id: int | None) -> FitRes:
        content = self._call(compat.fitins_to_recorddict(ins, keep_input=True), MessageType.TRAIN, timeout)
        return compat.recorddict_to_fitres(content, keep_input=False)

    def evaluate(self, ins: EvaluateIns, timeout: float | None, group_id: int | None) -> EvaluateRes:
        content = self._call(compat.evaluateins_to_recorddict(ins, keep_input=True), MessageType.EVALUATE, timeout)
        return compat.recorddict_to_evaluateres(content)

    def reconnect(self, ins: ReconnectIns, timeout: float | None, group_id: int | None) -> DisconnectRes:
        return DisconnectRes(reason="")


def _together(calls: Sequence[tuple[ClientProxy, Any]], encode: Callable, message_type: str,
              decode: Callable, direct: Callable[[ClientProxy, Any], Any]) -> list[Any]:
    """One exchange for the ``calls`` (proxy, instruction) to remote children, ``direct`` for the
    others (e.g. an absent child, which fails): per call its result or exception."""
    out: list[Any] = [None] * len(calls)
    remote = [(i, proxy, ins) for i, (proxy, ins) in enumerate(calls) if isinstance(proxy, GridProxy)]
    for i, (proxy, ins) in enumerate(calls):
        if not isinstance(proxy, GridProxy):
            try:
                out[i] = direct(proxy, ins)
            except Exception as exc:  # noqa: BLE001 - that child's failure
                out[i] = exc
    if not remote:
        return out
    first = remote[0][1]
    messages = [proxy.message(encode(ins, keep_input=True), message_type) for _, proxy, ins in remote]
    timeouts = [proxy.timeout for _, proxy, _ in remote]
    timeout = None if None in timeouts else max(timeouts)
    replies = exchange(first.grid, messages, timeout, first.interval, first.relocate, first.rejoin_seconds)
    for (i, _, _), reply in zip(remote, replies, strict=True):
        if isinstance(reply, ChildFailed):
            out[i] = reply
            continue
        try:
            out[i] = decode(reply.content)
        except Exception as exc:  # noqa: BLE001 - a malformed reply is that child's failure
            out[i] = ChildFailed(f"malformed reply: {exc!r}")
    return out


def fit_together(calls: list[tuple[ClientProxy, FitIns]]) -> list[FitRes | BaseException]:
    """``hfl.node.inprocess.FitMany`` for remote children: every fit of a round in flight at once."""
    return _together(calls, compat.fitins_to_recorddict, MessageType.TRAIN,
                     lambda rd: compat.recorddict_to_fitres(rd, keep_input=False),
                     lambda proxy, ins: proxy.fit(ins, None, None))


def evaluate_together(manager: SimpleClientManager, parameters: Any, config: dict) -> tuple[list[tuple[str, EvaluateRes]], int]:
    """``hfl.node.inprocess.EvaluateMany`` for remote children: one exchange, every child asked.
    A child that is absent or fails is left out of the figures with a warning (a real device can
    die between rounds); the figures say how many devices are behind them."""
    from hfl.rules.payload import payload_nbytes

    children = sorted(manager.all().values(), key=lambda p: p.cid)
    results = _together([(p, EvaluateIns(parameters, dict(config))) for p in children], compat.evaluateins_to_recorddict,
                        MessageType.EVALUATE, compat.recorddict_to_evaluateres,
                        lambda proxy, ins: proxy.evaluate(ins, None, None))
    return answered(children, results), len(children) * payload_nbytes(parameters)


def answered(children: Sequence[ClientProxy], results: Sequence[Any]) -> list[tuple[str, EvaluateRes]]:
    """The evaluations that came back (cid, reply); a child that is absent or failed is left out
    with a warning (a real device can die between rounds)."""
    out = []
    for proxy, res in zip(children, results, strict=True):
        if isinstance(res, BaseException) or res.status.code != Code.OK:
            log.warning("child %s did not evaluate: %s", proxy.cid, res if isinstance(res, BaseException) else res.status)
            continue
        out.append((proxy.cid, res))
    return out


def evaluate_targets_together(manager: SimpleClientManager, asks: list[tuple[Any, dict]]) -> list[tuple[list, int]]:
    """``hfl.node.client.EvaluateTargets`` for remote devices: every target model in one message per
    device (``targets``: per target its array count and config; hfl.deploy.device answers each), so
    an evaluation starts one ClientApp process per device, not one per device and target."""
    from hfl.rules.payload import decode, payload_nbytes

    children = sorted(manager.all().values(), key=lambda p: p.cid)
    arrays: list = []
    layout = []
    for params, config in asks:
        part = decode(params)
        layout.append([len(part), config])
        arrays.extend(part)
    packed = ndarrays_to_parameters(arrays)
    ins = EvaluateIns(packed, {"targets": json.dumps(layout)})
    results = _together([(p, ins) for p in children], compat.evaluateins_to_recorddict, MessageType.EVALUATE,
                        compat.recorddict_to_evaluateres, lambda proxy, i: proxy.evaluate(i, None, None))
    per_target: list[list[tuple[str, EvaluateRes]]] = [[] for _ in asks]
    for cid, res in answered(children, results):
        m = res.metrics
        for i, replies in enumerate(per_target):
            replies.append((cid, EvaluateRes(Status(Code.OK, ""), float(m[f"t{i}_loss"]), int(m[f"t{i}_n"]),
                                                   {"device_id": m["device_id"], "correct": m[f"t{i}_correct"]})))
    return [(replies, len(children) * payload_nbytes(params)) for replies, (params, _) in zip(per_target, asks, strict=True)]
