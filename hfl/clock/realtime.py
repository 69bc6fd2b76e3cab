"""A node's policies on real arrivals (a deployment with ``clock.enabled``): the same rules as in
simulated time (hfl.clock.policy.close_round over ``InFlight`` replies), fed with the wall-clock
times replies come in instead of simulated ones.

A round pushes its calls through the node's ``Flights`` (hfl.deploy.flights over Flower's Grid)
and looks for replies until the level's policy closes it: sync at the last reply; deadline
``clock.deadline`` seconds after it started or at the ``min_replies``-th reply; buffered at the
``buffer``-th arrival. A reply still awaited then counts as arriving at infinity, so the policy
treats it as it treats a late one: dropped (``late: drop``; its call is no longer awaited), or
kept in flight (``late: next``, buffered) and merged stale in the round it comes in, with the
same staleness weights. Replies in flight are part of the node's stored state (its clock
entries): the calls whose replies had not come are sent again by a node server started again,
and a child answers a call it sees again as it did the first time.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
from flwr.common import FitIns, FitRes
from flwr.server.client_proxy import ClientProxy

from hfl.clock.policy import Closed, InFlight, LevelPolicy, close_round
from hfl.clock.timer import PREFIX, NodeTimer, RoundTiming
from hfl.rules.payload import LocalParameters, decode

log = logging.getLogger("hfl")

FIRST_WAIT = 0.02  # seconds between looks for replies: the first, then 1.5 times longer each time...
LONGEST_WAIT = 0.25  # ...up to this (hfl.deploy.grid waits so for a batch)


class Flights(Protocol):
    """Calls to a node's children whose replies come when they come (hfl.deploy.flights.GridFlights)."""

    def push(self, key: str, proxy: ClientProxy, ins: FitIns) -> None:
        """Send ``ins`` to ``proxy``'s child; its reply will be named ``key``."""

    def poll(self) -> dict[str, FitRes | BaseException]:
        """The replies (or failures) that came since the last look, by key."""

    def awaiting(self, key: str) -> bool:
        """Whether call ``key``'s reply is still awaited (False for a call this process never made)."""

    def drop(self, key: str) -> None:
        """Stop waiting for call ``key``'s reply (the policy dropped it as late)."""


class WallTimer(NodeTimer):
    """One call of a deployed node (the root: its run) on the wall clock. Its time is seconds
    since the node's first call (stored as ``clock_origin``), so stored arrival times stay
    comparable across the node server's restarts."""

    def __init__(self, policy: LevelPolicy, flights: Flights, *, level: int, lowest: bool, path: str, seed: int,
                 stored: dict[str, np.ndarray] | None = None, new_call: bool = True,
                 now: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(None, policy, level=level, lowest=lowest, start=0.0, path=path, seed=seed,
                         stored=stored, new_call=new_call)
        self.flights, self._now, self._sleep = flights, now, sleep
        self.origin = float(stored[f"{PREFIX}origin"]) if stored and f"{PREFIX}origin" in stored else now()
        self.inflight += load_pending(stored)
        self.time = self.now()
        self._lookup: Callable[[str], ClientProxy | None] = lambda cid: None

    def now(self) -> float:
        return self._now() - self.origin

    def pick(self, children: Sequence[ClientProxy], fraction: float, round_path: str) -> list[ClientProxy]:
        get = getattr(children, "get", None)  # hfl.node.inprocess.ChildProxies; else a list
        self._lookup = get if get is not None else {c.cid: c for c in children}.get
        self.time = self.now()
        return super().pick(children, fraction, round_path)

    def wait_for_reply(self) -> None:
        """Every child it could ask is busy: the round's exchange waits for the next real reply."""

    def send(self, calls: list[tuple[ClientProxy, FitIns]]) -> list[tuple[ClientProxy, FitIns]]:
        return calls  # no simulated time to carry, no simulated offline device

    def exchange(self, calls: list[tuple[ClientProxy, FitIns]], fit_many: Callable,
                 reference: Callable[[], Sequence[np.ndarray]]) -> tuple[list, Closed, RoundTiming]:
        """Push the round's calls, look for replies until the policy closes the round (the replies
        still awaited count as arriving at infinity), then settle it as in simulated time."""
        start = self.now()
        for proxy, ins in calls:
            key = f"{self.path or 'root'}|{ins.config.get('round_path', '')}|{proxy.cid}"
            self.flights.push(key, proxy, ins)
            self.inflight.append(InFlight(proxy.cid, math.inf, self.version, None, decode(ins.parameters), proxy,
                                          key=key, ins=ins))
        for entry in self.inflight:  # awaited when the node stored its state, by a process now gone
            if entry.result is None and not self.flights.awaiting(entry.key):
                proxy = entry.proxy or self._lookup(entry.cid)
                if proxy is None:
                    entry.result, entry.arrival = RuntimeError(f"child {entry.cid} is no longer a child"), start
                    continue
                entry.proxy = proxy
                log.info("node %s: sending call %s again (awaited when the node stored its state)", self.path or "root",
                         entry.key)
                self.flights.push(entry.key, proxy, entry.ins)
        arrived: list = []
        wait = FIRST_WAIT
        while True:
            by_key = {entry.key: entry for entry in self.inflight if entry.result is None}
            for key, result in self.flights.poll().items():
                entry = by_key.get(key)
                if entry is not None:  # else a reply dropped as late that came anyway
                    entry.result, entry.arrival = result, self.now()
                    arrived.append(result)
            closed, kept = close_round(self.policy, start, self.inflight, self.version)
            now = self.now()
            if closed.end <= now:
                break
            self._sleep(max(min(wait, closed.end - now), 0.001))
            wait = min(wait * 1.5, LONGEST_WAIT)
        for entry in closed.late:
            if entry.result is None:
                self.flights.drop(entry.key)
        return arrived, *self.settle((closed, kept), reference())

    def state(self) -> dict[str, np.ndarray]:
        pending = [entry for entry in self.inflight if entry.result is None]
        self.inflight = [entry for entry in self.inflight if entry.result is not None]
        try:
            out = super().state()
        finally:
            self.inflight += pending
        return {**out, f"{PREFIX}origin": np.array(self.origin), **dump_pending(pending)}


def dump_pending(pending: list[InFlight]) -> dict[str, np.ndarray]:
    """The calls whose replies are awaited, as stored arrays: enough to send each again."""
    out: dict[str, np.ndarray] = {}
    metas = []
    for i, entry in enumerate(pending):
        for j, s in enumerate(entry.sent):
            out[f"{PREFIX}p{i}_sent_{j}"] = np.asarray(s)
        metas.append({"cid": entry.cid, "version": entry.version, "key": entry.key, "arrays": len(entry.sent),
                      "config": dict(entry.ins.config)})
    out[f"{PREFIX}pending"] = np.frombuffer(json.dumps(metas).encode(), dtype=np.uint8)
    return out


def load_pending(stored: dict[str, np.ndarray] | None) -> list[InFlight]:
    """The awaited calls a node stored (``dump_pending``), their replies still to come."""
    if not stored or f"{PREFIX}pending" not in stored:
        return []
    entries = []
    for i, meta in enumerate(json.loads(bytes(stored[f"{PREFIX}pending"]).decode() or "[]")):
        sent = [stored[f"{PREFIX}p{i}_sent_{j}"] for j in range(meta["arrays"])]
        ins = FitIns(LocalParameters(sent), meta["config"])
        entries.append(InFlight(meta["cid"], math.inf, meta["version"], None, sent, key=meta["key"], ins=ins))
    return entries
