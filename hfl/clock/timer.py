"""A node's rounds in simulated time (hfl.clock.policy over hfl.clock.model): which children can be
asked (idle, and for devices online), when each reply reaches the node, what a round merges, and
the node's clock, model version and replies in flight, kept in its state between calls.

A device's reply reaches its node ``message(down) + work + message(up)`` after it was sent; a device
that goes offline before its work is done fails at that moment, untouched (it is called through
``DroppedProxy``, so its state does not change). A child node computes its own reply's arrival
(``sim_time`` in its reply's metrics: its last round's close plus the message up).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.common import Code, FitIns, FitRes, Status
from flwr.server.client_proxy import ClientProxy

from hfl.clock.dropped import DroppedProxy
from hfl.clock.model import Clock
from hfl.clock.policy import Closed, InFlight, LevelPolicy, close_round, merged_model
from hfl.rules.payload import LocalParameters, decode, payload_nbytes
from hfl.tree.sampling import sample_size, seeded_subset

SIM_TIME = "sim_time"  # config entry (when the parent sent) and reply metric (when it reaches the parent)
PREFIX = "clock_"  # a node's stored clock entries
MAX_WAIT_PERIODS = 1000  # availability periods a node waits for one of its devices to come online


@dataclass
class RoundTiming:
    """What a closed round reports: when it closed, how many replies it dropped (late, or older
    than max_staleness) and how many it merged stale."""

    end: float
    late: int = 0
    stale: int = 0
    pending: int = 0  # replies the round did not take but may still come or came empty: late, in flight, empty


def is_empty(result: object) -> bool:
    """A child's reply that carries nothing to merge (a subtree that merged nothing in its call)."""
    return isinstance(result, FitRes) and result.metrics.get("payload") == "empty"


@dataclass(frozen=True)
class Sent:
    """A call as the node made it: when the message reaches the child, when a device's work is
    done (devices only), and when a device went offline before that (then it fails)."""

    down: float
    done: float | None = None
    offline: float | None = None


class NodeTimer:
    """One call of a node (the root: the run) in simulated time."""

    def __init__(self, clock: Clock, policy: LevelPolicy, *, level: int, lowest: bool, start: float,
                 path: str, seed: int, steps_of: Callable[[int], int] | None = None,
                 stored: dict[str, np.ndarray] | None = None, new_call: bool = True) -> None:
        self.clock, self.policy = clock, policy
        self.level, self.lowest, self.path, self.seed = level, lowest, path, seed
        self.steps_of = steps_of  # a device's minibatch steps per call (lowest nodes)
        self.version, self.inflight = load_inflight(stored)
        self.version += new_call  # a call starts from its parent's model: a new version (the root's run: none)
        self.time = start
        self._sent: dict[str, Sent] = {}

    # ------------------------------------------------------------------ who is asked
    def busy(self) -> set[str]:
        return {entry.cid for entry in self.inflight}

    def candidates(self, children: Sequence[ClientProxy]) -> list[int]:
        """Indices of the children that can be asked now: not in flight, and (devices) online."""
        cids = getattr(children, "cids", None) or [c.cid for c in children]
        busy = self.busy()
        index = [i for i, cid in enumerate(cids) if cid not in busy]
        if self.lowest and self.clock is not None and self.clock.online < 1 and index:
            online = self.clock.online_at([int(cids[i]) for i in index], self.time)
            index = [i for i, on in zip(index, online.tolist(), strict=True) if on]
        return index

    def pick(self, children: Sequence[ClientProxy], fraction: float, round_path: str) -> list[ClientProxy]:
        """The children a round asks: sync and deadline ask ceil(fraction x n) of those that can be
        asked; buffered keeps ``concurrency`` (default that number) busy. Seeded like
        hfl.tree.sampling.sample_children, and the same sample where every child can be asked."""
        index = self.candidates(children)
        waited = 0
        while (not index and not self.inflight and self.lowest and self.clock is not None and self.clock.online < 1
               and len(children)):
            # none of its devices is online: the node waits for the next period's draw
            if waited == MAX_WAIT_PERIODS:
                raise RuntimeError(f"node {self.path}: none of its {len(children)} devices came online in "
                                   f"{MAX_WAIT_PERIODS} periods of clock.availability")
            self.time = (self.time // self.clock.period + 1) * self.clock.period
            index, waited = self.candidates(children), waited + 1
        wanted = self.policy.concurrency or sample_size(len(children), fraction)
        k = min(len(index), wanted - len(self.inflight) if self.policy.kind == "buffered" else wanted)
        if k <= 0:
            if self.inflight:  # every child it could ask is busy: the node waits for the next reply to come
                self.wait_for_reply()
            return []
        return [children[i] for i in seeded_subset(index, k, self.seed, "sample", self.path, round_path)]

    def wait_for_reply(self) -> None:
        """Every child the node could ask is busy: its time moves to the next arrival."""
        self.time = max(self.time, min(entry.arrival for entry in self.inflight))

    # ------------------------------------------------------------------ a round's messages
    def exchange(self, calls: list[tuple[ClientProxy, FitIns]], fit_many: Callable,
                 reference: Callable[[], Sequence[np.ndarray]]) -> tuple[list, Closed, RoundTiming]:
        """A round's calls made (``fit_many``) and closed: the replies that came (whose subtree
        counters count now), what the round merges, its timing. ``reference``: what a stale reply
        is merged against (the strategy's model as it sent it this round)."""
        outcomes = fit_many(calls)
        closed, timing = self.close(calls, outcomes, reference())
        return outcomes, closed, timing

    def send(self, calls: list[tuple[ClientProxy, FitIns]]) -> list[tuple[ClientProxy, FitIns]]:
        """The calls as made at the node's time: each carries it; a device that would go offline
        before its work is done is called through a proxy that fails (its state left as it was)."""
        out = []
        for proxy, ins in calls:
            ins = FitIns(ins.parameters, {**ins.config, SIM_TIME: self.time})
            sent = Sent(self.time + self.clock.message_seconds(self.level, payload_nbytes(ins.parameters)))
            if self.lowest and self.steps_of is not None:
                device = int(proxy.cid)
                done = sent.down + self.clock.work_seconds(device, self.steps_of(device))
                sent = Sent(sent.down, done, self.clock.offline_between(device, self.time, done))
                if sent.offline is not None:
                    proxy = DroppedProxy(proxy, f"device {device} went offline at simulated time {sent.offline:.1f}")
            self._sent[proxy.cid] = sent
            out.append((proxy, ins))
        return out

    def arrival(self, proxy: ClientProxy, result: FitRes | BaseException) -> float:
        """When a reply (or the news of a failure) reaches the node."""
        sent = self._sent[proxy.cid]
        if sent.offline is not None:  # went offline: noticed when it went
            return sent.offline
        if isinstance(result, BaseException) or result.status.code != Code.OK:
            return sent.down
        if not self.lowest:
            return float(result.metrics.get(SIM_TIME, sent.down))
        done = sent.down if sent.done is None else sent.done
        return done + self.clock.message_seconds(self.level, payload_nbytes(result.parameters))

    def close(self, calls: list[tuple[ClientProxy, FitIns]], outcomes: Sequence[FitRes | BaseException],
              current: Sequence[np.ndarray]) -> tuple[Closed, RoundTiming]:
        """The round's close: the new replies join those in flight, the policy takes its pick,
        and the merged replies are made ready for the rule (stale ones as weighted deltas)."""
        for (proxy, ins), result in zip(calls, outcomes, strict=True):
            self.inflight.append(InFlight(proxy.cid, self.arrival(proxy, result), self.version, result,
                                          decode(ins.parameters), proxy))
        return self.settle(close_round(self.policy, self.time, self.inflight, self.version), current)

    def settle(self, outcome: tuple[Closed, list[InFlight]], current: Sequence[np.ndarray]) -> tuple[Closed, RoundTiming]:
        """A closed round (``close_round``'s outcome) made ready for the rule: empty replies taken
        out, stale ones turned into weighted deltas against ``current``; the node's time and
        model version moved on."""
        closed, self.inflight = outcome
        # An empty reply (its subtree merged nothing) is taken out of the merge: nothing to weigh
        empty = [entry for entry in closed.merged if is_empty(entry.result)]
        closed.merged = [entry for entry in closed.merged if not is_empty(entry.result)]
        timing = RoundTiming(closed.end, late=len(closed.late) + len(closed.too_stale),
                             pending=len(closed.late) + len(closed.too_stale) + len(self.inflight) + len(empty))
        for entry in closed.merged:
            staleness = self.version - entry.version
            weight = self.policy.weight(staleness)
            timing.stale += staleness > 0
            res: FitRes = entry.result
            if staleness or weight != 1.0:
                model = merged_model(current, decode(res.parameters), entry.sent, staleness, weight)
                entry.result = FitRes(res.status, LocalParameters(model), res.num_examples, res.metrics)
        self.time = closed.end
        if closed.merged:
            self.version += 1
        return closed, timing

    def state(self) -> dict[str, np.ndarray]:
        return {**dump_inflight(self.version, self.inflight), f"{PREFIX}time": np.array(self.time)}


def load_inflight(stored: dict[str, np.ndarray] | None) -> tuple[int, list[InFlight]]:
    """The version and replies in flight a node stored (``dump_inflight``)."""
    if not stored or f"{PREFIX}version" not in stored:
        return 0, []
    entries = []
    for i, meta in enumerate(json.loads(bytes(stored[f"{PREFIX}inflight"]).decode() or "[]")):
        reply = [stored[f"{PREFIX}{i}_reply_{j}"] for j in range(meta.get("reply_arrays", meta["arrays"]))]
        sent = [stored[f"{PREFIX}{i}_sent_{j}"] for j in range(meta["arrays"])]
        result = FitRes(Status(Code.OK, "Success"), LocalParameters(reply), meta["num_examples"], meta["metrics"])
        entries.append(InFlight(meta["cid"], meta["arrival"], meta["version"], result, sent))
    return int(stored[f"{PREFIX}version"]), entries


def dump_inflight(version: int, inflight: list[InFlight]) -> dict[str, np.ndarray]:
    """A node's clock state as stored arrays: its model version and the replies in flight."""
    out: dict[str, np.ndarray] = {f"{PREFIX}version": np.array(version)}
    metas = []
    for i, entry in enumerate(inflight):
        res: FitRes = entry.result
        reply = decode(res.parameters)
        for j, r in enumerate(reply):  # an empty reply has none
            out[f"{PREFIX}{i}_reply_{j}"] = np.asarray(r)
        for j, s in enumerate(entry.sent):
            out[f"{PREFIX}{i}_sent_{j}"] = np.asarray(s)
        sizes = {} if len(reply) == len(entry.sent) else {"reply_arrays": len(reply)}
        metas.append({"cid": entry.cid, "arrival": entry.arrival, "version": entry.version, "arrays": len(entry.sent),
                      **sizes,
                      "num_examples": int(res.num_examples),
                      # wall-clock seconds left out: a resumed run stores what the uninterrupted one does
                      "metrics": {k: v for k, v in res.metrics.items() if k != "compute_seconds"}})
    out[f"{PREFIX}inflight"] = np.frombuffer(json.dumps(metas).encode(), dtype=np.uint8)
    return out


def without_clock(state: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
    """A stored node state less its clock entries (what the algorithm's rule reads)."""
    if not state:
        return state
    return {k: v for k, v in state.items() if not k.startswith(PREFIX)}

