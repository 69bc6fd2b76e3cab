"""A node's policies on real arrivals (hfl.clock.realtime.WallTimer): the same close_round and
staleness weights as simulated time, fed by the times replies come in. A scripted ``Flights``
and a manual clock make the arrivals exact; GridFlights is checked over an in-memory Grid."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common import Code, FitIns, FitRes, Status
from flwr.server.client_proxy import ClientProxy

from hfl.clock.policy import LevelPolicy, staleness_weight
from hfl.clock.realtime import WallTimer
from hfl.node.inprocess import NamedChild
from hfl.rules.payload import LocalParameters, decode


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


class Scripted:
    """Children answer ``model + delta[cid]`` after ``delay[cid]`` seconds (None: never)."""

    def __init__(self, clock: Clock, delay: dict, delta: dict | None = None) -> None:
        self.clock, self.delay, self.delta = clock, delay, delta or {}
        self.inflight: dict[str, tuple[float, FitRes]] = {}
        self.pushed: list[tuple[str, str, FitIns]] = []
        self.dropped: list[str] = []

    def push(self, key: str, proxy: ClientProxy, ins: FitIns) -> None:
        self.pushed.append((key, proxy.cid, ins))
        delay = self.delay[proxy.cid]
        if delay is None:
            self.inflight[key] = (float("inf"), None)
            return
        reply = [a + self.delta.get(proxy.cid, 1.0) for a in decode(ins.parameters)]
        self.inflight[key] = (self.clock.now() + delay, FitRes(Status(Code.OK, ""), LocalParameters(reply), 10, {}))

    def poll(self) -> dict:
        due = {k: res for k, (t, res) in self.inflight.items() if t <= self.clock.now()}
        for k in due:
            del self.inflight[k]
        return due

    def awaiting(self, key: str) -> bool:
        return key in self.inflight

    def drop(self, key: str) -> None:
        self.dropped.append(key)
        self.inflight.pop(key, None)


def calls(cids: list[str], model: list[np.ndarray], round_path: str) -> list:
    return [(NamedChild(c), FitIns(LocalParameters(model), {"round_path": round_path})) for c in cids]


def timer(policy: LevelPolicy, flights: Scripted, clock: Clock, stored=None) -> WallTimer:  # noqa: ANN001
    return WallTimer(policy, flights, level=1, lowest=True, path="0", seed=0, stored=stored,
                     now=clock.now, sleep=clock.sleep)


MODEL = [np.zeros(3, dtype=np.float32)]


def test_a_deadline_round_closes_at_its_deadline_and_drops_the_late_reply() -> None:
    clock = Clock()
    flights = Scripted(clock, {"a": 1.0, "b": 10.0})
    t = timer(LevelPolicy("deadline", deadline=5.0), flights, clock)
    start = t.now()
    arrived, closed, timing = t.exchange(calls(["a", "b"], MODEL, "1.1"), None, lambda: MODEL)
    assert [e.cid for e in closed.merged] == ["a"] and [e.cid for e in closed.late] == ["b"]
    assert timing.late == 1 and len(arrived) == 1
    assert closed.end == pytest.approx(start + 5.0, abs=1e-6)  # not a poll later
    assert flights.dropped == ["0|1.1|b"] and not t.inflight  # b's reply is no longer awaited


def test_a_deadline_round_closes_at_the_min_replies_th_reply() -> None:
    clock = Clock()
    flights = Scripted(clock, {"a": 1.0, "b": 3.0, "c": None})
    t = timer(LevelPolicy("deadline", deadline=60.0, min_replies=2), flights, clock)
    start = t.now()
    _, closed, timing = t.exchange(calls(["a", "b", "c"], MODEL, "1.1"), None, lambda: MODEL)
    assert sorted(e.cid for e in closed.merged) == ["a", "b"] and timing.late == 1
    assert start + 3.0 <= closed.end < start + 3.3  # b's arrival, seen at the next look


def test_a_buffered_node_merges_a_stale_reply_with_the_simulated_policys_weight() -> None:
    """buffer 1, two children busy: a comes first and is merged; b, sent the first model, comes
    in the next round, one merge old, and is merged as current + w(1) (reply - sent)."""
    clock = Clock()
    flights = Scripted(clock, {"a": 1.0, "b": 1.5}, delta={"a": 1.0, "b": 4.0})
    policy = LevelPolicy("buffered", buffer=1, concurrency=2, staleness="polynomial", a=0.5)
    t = timer(policy, flights, clock)
    children = [NamedChild("a"), NamedChild("b")]
    assert [c.cid for c in t.pick(children, 1.0, "1.1")] == ["a", "b"]
    _, closed, _ = t.exchange(calls(["a", "b"], MODEL, "1.1"), None, lambda: MODEL)
    assert [e.cid for e in closed.merged] == ["a"] and [e.cid for e in t.inflight] == ["b"]
    current = [np.full(3, 1.0, dtype=np.float32)]  # the node's model after merging a
    assert [c.cid for c in t.pick(children, 1.0, "1.2")] == ["a"]  # b is busy
    _, closed, timing = t.exchange(calls(["a"], current, "1.2"), None, lambda: current)
    assert [e.cid for e in closed.merged] == ["b"] and timing.stale == 1
    merged = decode(closed.merged[0].result.parameters)[0]
    np.testing.assert_allclose(merged, 1.0 + staleness_weight(1, "polynomial", 0.5) * 4.0)


def test_a_node_started_again_sends_the_calls_it_still_awaited_and_merges_their_replies() -> None:
    clock = Clock()
    flights = Scripted(clock, {"a": 1.0, "b": None})
    policy = LevelPolicy("deadline", deadline=5.0, late="next")
    t = timer(policy, flights, clock)
    sent = [np.arange(3, dtype=np.float32)]
    t.exchange(calls(["a", "b"], sent, "1.1"), None, lambda: sent)
    stored = t.state()
    # The node server dies; a new one has no call in flight and a child b that answers now.
    again = Scripted(clock, {"a": 1.0, "b": 0.5}, delta={"b": 2.0})
    t2 = timer(policy, again, clock, stored)
    assert t2.version == 3 and [e.cid for e in t2.inflight] == ["b"]  # 1: sent b; 2: merged a; 3: this call
    t2.pick([NamedChild("a"), NamedChild("b")], 1.0, "2.1")
    _, closed, timing = t2.exchange([], None, lambda: sent)
    (key, cid, ins), = again.pushed
    assert (key, cid, ins.config) == ("0|1.1|b", "b", {"round_path": "1.1"})  # the same call, sent again
    np.testing.assert_array_equal(decode(ins.parameters)[0], sent[0])
    assert [e.cid for e in closed.merged] == ["b"] and timing.stale == 1


def test_a_sync_round_waits_for_every_reply() -> None:
    clock = Clock()
    flights = Scripted(clock, {"a": 1.0, "b": 30.0})
    t = timer(LevelPolicy(), flights, clock)
    start = t.now()
    _, closed, _ = t.exchange(calls(["a", "b"], MODEL, "1.1"), None, lambda: MODEL)
    assert sorted(e.cid for e in closed.merged) == ["a", "b"] and closed.end >= start + 30.0


@pytest.fixture
def task_identity():  # noqa: ANN201
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield


def test_grid_flights_give_replies_as_they_come_fail_the_absent_at_once_and_the_silent_at_their_timeout(
        task_identity) -> None:  # noqa: ANN001
    from test_deploy_grid import Doubler, MemoryGrid

    from hfl.deploy.children import AbsentChild
    from hfl.deploy.flights import GridFlights
    from hfl.deploy.grid import ChildFailed, GridProxy

    grid = MemoryGrid({11: Doubler({"device_id": 1}), 12: Doubler({"device_id": 2})})
    grid.down.add(12)
    flights = GridFlights(grid)
    ins = FitIns(LocalParameters([np.ones(2, dtype=np.float32)]), {"round": 1})
    flights.push("a", GridProxy("000001", 11, grid, timeout=60.0), ins)
    flights.push("b", GridProxy("000002", 12, grid, timeout=0.05), ins)
    flights.push("c", AbsentChild("000003"), ins)
    assert all(flights.awaiting(k) for k in "abc")
    first = flights.poll()
    assert sorted(first) == ["a", "c"] and isinstance(first["c"], ChildFailed)
    np.testing.assert_array_equal(decode(first["a"].parameters)[0], [2.0, 2.0])
    assert flights.awaiting("b") and not flights.awaiting("a")
    import time

    time.sleep(0.1)
    late = flights.poll()
    assert isinstance(late["b"], ChildFailed) and "no reply within 0.05 s" in str(late["b"])
    flights.push("d", GridProxy("000002", 12, grid, timeout=60.0), ins)
    flights.drop("d")  # a reply the policy dropped as late is no longer looked for
    assert not flights.awaiting("d") and flights.poll() == {}
    from hfl.node.root import PathProxy

    flights.push("e", PathProxy("1", GridProxy("000002", 12, grid, timeout=60.0)), ins)  # the root's children
    assert flights.poll() == {} and flights.awaiting("e")  # pushed, not called (12 is down: no reply yet)


@pytest.mark.parametrize("override, key", [
    ("clock.availability.online=0.5", "clock.availability.online"),
    ("clock.shift.kind=labels", "clock.shift.kind"),
    ("algorithm.background_every=5", "algorithm.background_every"),
])
def test_a_deployment_refuses_what_only_simulated_time_models(override: str, key: str) -> None:
    from conftest import compose_cfg

    from hfl.errors import ConfigError
    from hfl.runtime.build import check_tree, federation_for

    base = ["runtime=deployment", "clock.enabled=true", "algorithm=bhfl", "clock.policy=buffered"]
    cfg = compose_cfg(*base)
    check_tree(cfg, federation_for(cfg).tree)  # the policies themselves run there
    cfg = compose_cfg(*base, override)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_tree(cfg, federation_for(cfg).tree)
