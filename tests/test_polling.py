"""runtime.poll_interval: how often Flower's simulation looks for messages (hfl.runtime.polling)."""

from __future__ import annotations

import threading
import time
from queue import Queue
from types import SimpleNamespace

import pytest
from flwr.server.superlink.fleet.vce import vce_api
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from hfl.errors import ConfigError
from hfl.runtime.polling import FLOWER_INTERVAL, PolledServerApp, SharedPulls, dispatch_loop, simulation_polling
from hfl.runtime.simulate import run
from tests.conftest import SMALL, compose_cfg


class FakeState:
    """A LinkState holding instructions per node, handing out at most ``limit`` a call."""

    def __init__(self, pending: dict[int, list[str]]) -> None:
        self.pending = pending
        self.calls = 0

    def get_message_ins(self, node_id: int, limit: int) -> list[str]:
        self.calls += 1
        out, self.pending[node_id] = self.pending[node_id][:limit], self.pending[node_id][limit:]
        return out


def test_dispatch_loop_hands_every_instruction_to_the_queue_and_stops():
    state = FakeState({1: ["a", "b"], 2: ["c"]})
    queue: Queue = Queue()
    stop = threading.Event()
    loop = threading.Thread(target=dispatch_loop(0.001), args=(state, queue, {1: 0, 2: 1}, stop))
    loop.start()
    got = sorted(queue.get(timeout=5) for _ in range(3))
    stop.set()
    loop.join(timeout=5)
    assert got == ["a", "b", "c"]
    assert not loop.is_alive()
    assert state.calls >= 4  # one message per node a look: node 1 needed two looks


def test_simulation_polling_replaces_flowers_loop_only_inside_the_block():
    flowers = vce_api.add_messages_to_queue
    with simulation_polling(0.01) as replaced:
        assert replaced
        assert vce_api.add_messages_to_queue is not flowers
    assert vce_api.add_messages_to_queue is flowers
    with simulation_polling(None) as replaced:
        assert not replaced
        assert vce_api.add_messages_to_queue is flowers


def test_a_changed_flower_loop_is_left_alone_with_a_warning(monkeypatch, caplog):
    def add_messages_to_queue(state, queue, f_stop):  # noqa: ANN001, ANN202 - another signature
        return None

    monkeypatch.setattr(vce_api, "add_messages_to_queue", add_messages_to_queue)
    with caplog.at_level("WARNING"), simulation_polling(0.01) as replaced:
        assert not replaced
        assert vce_api.add_messages_to_queue is add_messages_to_queue
    assert "not applied" in caplog.text


class Stop(Exception):
    pass


def _stop(_context):  # noqa: ANN001, ANN202
    raise Stop


@pytest.mark.parametrize(("interval", "expected"), [(0.01, 0.01), (None, FLOWER_INTERVAL)])
def test_server_app_sets_the_in_memory_grids_pull_interval(interval, expected):
    grid = object.__new__(InMemoryGrid)  # its constructor wants a live LinkState
    grid.pull_interval = FLOWER_INTERVAL
    with pytest.raises(Stop):
        PolledServerApp(server_fn=_stop, pull_interval=interval)(grid, None)
    assert grid.pull_interval == expected


@pytest.mark.parametrize("value", [0, 5, -0.1])  # a non-number: the schema refuses it at composition
def test_bad_poll_interval_is_refused_before_training(tmp_path, value):
    cfg = compose_cfg(*SMALL, "runtime=simulation", f"runtime.poll_interval={value}")
    with pytest.raises(ConfigError, match="runtime.poll_interval"):
        run(cfg, tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


class SlowGrid:
    """A grid whose reply to message ``m`` can be pulled from ``ready[m]`` seconds after its push;
    it counts pulls, and a reply is handed out once (as the in-memory grid deletes what it pulls)."""

    def __init__(self, delays: dict[str, float]) -> None:
        self.delays, self.ready, self.pulls, self.lock = delays, {}, 0, threading.Lock()

    def push_messages(self, messages):  # noqa: ANN001, ANN201
        with self.lock:
            for m in messages:
                self.ready[m] = time.monotonic() + self.delays[m]
        return list(messages)

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        with self.lock:
            self.pulls += 1
            now = time.monotonic()
            due = [m for m in message_ids if m in self.ready and self.ready[m] <= now]
            for m in due:
                del self.ready[m]
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=m)) for m in due]


def test_shared_pulls_give_each_call_its_own_replies_with_one_pull_per_interval():
    calls = 40
    delays = {f"m{i}": 0.05 + 0.005 * (i % 10) for i in range(calls)}
    grid = SlowGrid(delays)
    shared = SharedPulls(grid, interval=0.01)
    got: dict[int, list[str]] = {}

    def call(i: int) -> None:
        got[i] = [r.metadata.reply_to_message_id for r in shared.send_and_receive([f"m{i}"], timeout=5.0)]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(calls)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    assert got == {i: [f"m{i}"] for i in range(calls)}
    # Flower's loop: a pull per call and interval (~40 x 10 here); shared: about one per interval
    assert grid.pulls <= elapsed / 0.01 + 5
    assert not shared.waiting and not shared.arrived


def test_shared_pulls_time_out_as_flowers_loop_and_forget_the_message():
    grid = SlowGrid({"late": 0.3, "soon": 0.0})
    shared = SharedPulls(grid, interval=0.01)
    start = time.monotonic()
    assert [r.metadata.reply_to_message_id for r in shared.send_and_receive(["late", "soon"], timeout=0.05)] == ["soon"]
    assert 0.05 <= time.monotonic() - start < 0.25
    assert not shared.waiting and not shared.arrived


def test_server_app_shares_the_in_memory_grids_pulls_only_when_it_sets_the_interval():
    for interval, shared in ((0.01, True), (None, False)):
        grid = object.__new__(InMemoryGrid)
        grid.pull_interval = FLOWER_INTERVAL
        with pytest.raises(Stop):
            PolledServerApp(server_fn=_stop, pull_interval=interval)(grid, None)
        assert isinstance(getattr(grid.send_and_receive, "__self__", None), SharedPulls) is shared
