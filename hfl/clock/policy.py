"""How a node closes its rounds in simulated time (``clock.policy``, per level):

- ``sync``: a round closes when the last child asked has answered (or failed).
- ``deadline``: a round closes ``deadline`` seconds after it starts, or at the ``min_replies``-th
  reply if that comes first (or at the last reply, if all come before). A late reply is dropped
  (``late: drop``), or stays in flight and is merged into the round it arrives in (``late: next``)
  as a stale update; its child is not asked again until then.
- ``buffered`` (FedBuff): the node keeps ``concurrency`` children busy; a round closes at the
  ``buffer``-th arrival and merges those, each weighted by its staleness; the children merged are
  free to be asked again at once, from the node's newest model.

A reply's staleness is how many merges the node made since the child was sent its model. A stale
reply is merged as the node's current model plus its weighted delta, ``current + w(s) (model - sent)``
(FedBuff's rule, so a server optimiser sees the right pseudo-gradient); a fresh one as it is. With
``buffer`` = every child and a constant weight, a buffered round is a synchronous one.
Everything here is pure arithmetic over arrival times: the engine (hfl.node.inprocess, hfl.node.root)
computes what each child answers and when, and asks this module which replies a round merges.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hfl.clock.model import level_entry
from hfl.errors import ConfigError
from hfl.rules.steps import sgd_step

POLICIES = ("sync", "deadline", "buffered")
STALENESS = ("constant", "polynomial", "hinge")
LATE = ("drop", "next")


def staleness_weight(staleness: int, function: str = "constant", a: float = 0.5, b: float = 4.0) -> float:
    """The weight of a reply ``staleness`` merges old: constant 1; polynomial (1 + s)^-a;
    hinge 1 for s <= b, else 1 / (a (s - b) + 1) (Xie et al.'s FedAsync functions)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if function == "constant":
        return 1.0
    if function == "polynomial":
        return float((1.0 + staleness) ** -a)
    if function == "hinge":
        return 1.0 if staleness <= b else 1.0 / (a * (staleness - b) + 1.0)
    raise ValueError(f"unknown staleness function {function!r}; known: {', '.join(STALENESS)}")


@dataclass(frozen=True)
class LevelPolicy:
    """The policy of the nodes at one level (``LevelPolicy.for_level`` reads the config)."""

    kind: str = "sync"
    deadline: float = math.inf
    min_replies: int = 0
    late: str = "drop"
    buffer: int = 1
    concurrency: int = 0  # 0: as many as the node's sample fraction asks
    staleness: str = "constant"
    a: float = 0.5
    b: float = 4.0
    max_staleness: int = 0  # 0: no limit

    @classmethod
    def for_level(cls, clock: Mapping[str, Any], level: int) -> LevelPolicy:
        if not clock["enabled"]:
            return cls()
        kind = str(level_entry(clock["policy"], level, "clock.policy"))
        if kind not in POLICIES:
            raise ConfigError("clock.policy", f"unknown policy {kind!r}; known: {', '.join(POLICIES)}")
        stale = dict(clock.get("staleness") or {})

        def number(key: str, value: Any, kind: type = float) -> Any:
            try:  # a value that is no number is refused naming its key, not with a bare ValueError
                made = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(key, f"must be a number, got {value!r}") from None
            if kind is int and made != value:
                raise ConfigError(key, f"must be a whole number, got {value!r}")
            return made

        # The clock's keys (ClockConfig) are all in conf/config.yaml; the nested staleness dict may be
        # replaced whole by an override, so its entries keep the defaults of LevelPolicy's fields.
        policy = cls(kind, number("clock.deadline", level_entry(clock["deadline"], level, "clock.deadline")),
                     number("clock.min_replies", level_entry(clock["min_replies"], level, "clock.min_replies"), int),
                     str(clock["late"]),
                     number("clock.buffer", level_entry(clock["buffer"], level, "clock.buffer"), int),
                     number("clock.concurrency", level_entry(clock["concurrency"], level, "clock.concurrency"), int),
                     str(stale.get("function", "constant")), number("clock.staleness.a", stale.get("a", 0.5)),
                     number("clock.staleness.b", stale.get("b", 4.0)),
                     number("clock.max_staleness", clock["max_staleness"], int))
        policy.check()
        return policy

    def check(self) -> None:
        if self.late not in LATE:
            raise ConfigError("clock.late", f"unknown {self.late!r}; known: {', '.join(LATE)}")
        if self.staleness not in STALENESS:
            raise ConfigError("clock.staleness.function", f"unknown {self.staleness!r}; known: {', '.join(STALENESS)}")
        if not self.deadline > 0:
            raise ConfigError("clock.deadline", f"must be > 0, got {self.deadline}")
        # staleness weights: a negative a makes an older reply weigh more (polynomial) or divides by
        # zero at s = b - 1/a (hinge); a negative b has no meaning (a staleness is >= 0)
        for key, value in (("clock.staleness.a", self.a), ("clock.staleness.b", self.b)):
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(key, f"must be a finite number >= 0, got {value}")
        for key, value, low in (("clock.buffer", self.buffer, 1), ("clock.min_replies", self.min_replies, 0),
                                ("clock.concurrency", self.concurrency, 0), ("clock.max_staleness", self.max_staleness, 0)):
            if value < low:
                raise ConfigError(key, f"must be >= {low}, got {value}")

    @property
    def carries(self) -> bool:
        """Whether replies may stay in flight past the round they were asked in."""
        return self.kind == "buffered" or (self.kind == "deadline" and self.late == "next")

    def weight(self, staleness: int) -> float:
        return staleness_weight(staleness, self.staleness, self.a, self.b)


@dataclass
class InFlight:
    """A child's reply on its way: what it answered (or the error it failed with), when it reaches
    the node, and the node's model version it was sent."""

    cid: str
    arrival: float
    version: int
    result: Any  # a FitRes, or the exception the child failed with
    sent: list[np.ndarray] | None = None  # the model it was sent (a stale reply is merged as a delta)
    proxy: Any = None
    key: str = ""  # in real time (hfl.clock.realtime): the call's name while its reply is awaited
    ins: Any = None  # in real time: the FitIns, sent again if the node was started again meanwhile


@dataclass
class Closed:
    """What one round merges (``merged``), which failures it counts, what it drops as late or too
    stale, and when it closes."""

    end: float
    merged: list[InFlight] = field(default_factory=list)
    failed: list[InFlight] = field(default_factory=list)
    late: list[InFlight] = field(default_factory=list)
    too_stale: list[InFlight] = field(default_factory=list)


def _order(entry: InFlight) -> tuple[float, str]:
    return entry.arrival, entry.cid


def close_round(policy: LevelPolicy, start: float, inflight: list[InFlight], version: int) -> tuple[Closed, list[InFlight]]:
    """The round that started at ``start`` with these replies in flight: what it takes, and what
    stays in flight. Failures count in the round they are noticed in (they are never carried)."""
    pending = sorted(inflight, key=_order)
    if not pending:
        return Closed(start), []
    if policy.kind == "sync":
        end = max(start, pending[-1].arrival)
    elif policy.kind == "deadline":
        end = start + policy.deadline
        answers = [e for e in pending if not isinstance(e.result, BaseException)]
        if policy.min_replies and len(answers) >= policy.min_replies:
            end = min(end, answers[policy.min_replies - 1].arrival)
        if pending[-1].arrival <= end:
            end = pending[-1].arrival  # everyone answered in time: no need to wait out the deadline
        end = max(end, start)
    else:  # buffered: the buffer-th arrival (failures do not fill the buffer)
        answers = [e for e in pending if not isinstance(e.result, BaseException)]
        k = min(policy.buffer, len(answers))
        end = answers[k - 1].arrival if k else pending[-1].arrival
        end = max(end, start)
    closed, kept = Closed(end), []
    taken = 0
    for entry in pending:
        if isinstance(entry.result, BaseException):
            closed.failed.append(entry)  # counted now, never carried: the child is free again
        elif entry.arrival > end:
            (kept if policy.carries else closed.late).append(entry)
        elif policy.kind == "buffered" and taken >= policy.buffer:
            kept.append(entry)  # arrived together with the buffer-th: the next round's
        elif policy.max_staleness and version - entry.version > policy.max_staleness:
            closed.too_stale.append(entry)
        else:
            closed.merged.append(entry)
            taken += 1
    return closed, kept


def merged_model(current: Sequence[np.ndarray], reply: Sequence[np.ndarray], sent: Sequence[np.ndarray] | None,
                 staleness: int, weight: float) -> list[np.ndarray]:
    """A reply as the node merges it: as it is when fresh with weight 1, else the node's current
    model plus the weighted delta the child made from the model it was sent."""
    if staleness == 0 and weight == 1.0:
        return list(reply)
    if sent is None:
        raise ValueError("a stale reply needs the model it was sent")
    delta = [np.asarray(r) - np.asarray(s) for r, s in zip(reply, sent, strict=True)]
    return sgd_step(current, delta, -weight)  # a step of ``weight`` along the delta
