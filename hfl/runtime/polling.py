"""How often Flower's Simulation Runtime looks for messages (``runtime.poll_interval``).

Flower 1.41's simulation moves messages by polling its in-memory LinkState, at 0.1 s in two
places: the SuperLink's thread that hands instructions to the Ray workers
(``vce_api.add_messages_to_queue``) and the ``InMemoryGrid`` that collects the replies
(``pull_interval``, a constructor argument). Every exchange (a fit, an evaluation) waits for
both, so a global round lost ~0.2 s to them, more than a third of a round of the MNIST MCLR
preset (docs/performance.md). Flower's maintainers chose 0.1 s as a safe default and note that the
state's flags allow 0.01 s or lower (flwrlabs/flower#3369). The grid's interval is set through
its public attribute; the dispatch loop has no setting, so it is replaced for the duration of a
run by the same loop with a shorter wait, and only where Flower's function still has the
signature it was written against (else Flower's own loop runs, with a warning)."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from queue import Queue
from typing import Any

from flwr.server import ServerApp

log = logging.getLogger(__name__)

# Flower's own interval (both loops), kept by runtime.poll_interval=null.
FLOWER_INTERVAL = 0.1
_DISPATCH_PARAMS = ["state", "queue", "nodes_mapping", "f_stop"]


class PolledServerApp(ServerApp):
    """A ``ServerApp`` that sets the in-memory grid's ``pull_interval`` before it runs (a grid
    of another kind, as in a deployment, is left as it is)."""

    def __init__(self, *args: Any, pull_interval: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pull_interval = pull_interval

    def __call__(self, grid: Any, context: Any) -> None:
        from flwr.superlink.grid.inmemory_grid import InMemoryGrid

        if self.pull_interval is not None and isinstance(grid, InMemoryGrid):
            grid.pull_interval = float(self.pull_interval)
            grid.send_and_receive = SharedPulls(grid, float(self.pull_interval)).send_and_receive
        super().__call__(grid, context)


class SharedPulls:
    """``send_and_receive`` for a grid that every level-1 call of the root uses at once (one
    thread each): one pull per interval looks for the replies of all the calls waiting, where
    Flower's loop pulls once per interval for each call. With 100 level-1 nodes at 0.01 s that was
    10,000 pulls a second; sharing them saved the driver ~0.2 CPU-seconds a round on the
    100,000-device tree of benchmarks/scale.py (docs/performance.md). The same replies, the same
    timeout."""

    def __init__(self, grid: Any, interval: float) -> None:
        self.grid, self.interval = grid, interval
        self.lock = threading.Lock()
        self.waiting: set[str] = set()      # messages some call still waits for
        self.arrived: dict[str, Any] = {}   # replies pulled for a call that has not taken them yet
        self.last_pull = float("-inf")

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list:
        mine = set(self.grid.push_messages(messages))
        with self.lock:
            self.waiting |= mine
        end = None if timeout is None else time.monotonic() + timeout
        replies: list = []
        try:
            while True:
                with self.lock:
                    self._pull_if_due()
                    for mid in [m for m in mine if m in self.arrived]:
                        replies.append(self.arrived.pop(mid))
                        mine.discard(mid)
                if not mine or (end is not None and time.monotonic() >= end):
                    return replies
                time.sleep(self.interval)
        finally:
            with self.lock:  # given up (timeout): no longer looked for, nor kept if pulled
                self.waiting -= mine
                for mid in mine:
                    self.arrived.pop(mid, None)

    def _pull_if_due(self) -> None:
        now = time.monotonic()
        if not self.waiting or now - self.last_pull < self.interval:
            return
        self.last_pull = now
        for reply in self.grid.pull_messages(set(self.waiting)):
            mid = reply.metadata.reply_to_message_id
            self.waiting.discard(mid)
            self.arrived[mid] = reply


def dispatch_loop(interval: float):  # noqa: ANN201 (Flower's private types)
    """Flower's ``add_messages_to_queue`` with ``interval`` in place of its 0.1 s wait."""

    def add_messages_to_queue(state: Any, queue: Queue, nodes_mapping: Any, f_stop: threading.Event) -> None:
        while not f_stop.is_set():
            for node_id in nodes_mapping.keys():
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
            f_stop.wait(interval)

    return add_messages_to_queue


@contextmanager
def simulation_polling(interval: float | None) -> Iterator[bool]:
    """Within the block, Flower's simulation dispatches instructions every ``interval`` seconds
    (``None``: Flower's loop, untouched). Yields whether the loop was replaced."""
    from flwr.server.superlink.fleet.vce import vce_api

    original = vce_api.add_messages_to_queue
    if interval is None:
        yield False
        return
    params = list(inspect.signature(original).parameters)
    if params != _DISPATCH_PARAMS:
        log.warning("hfl: runtime.poll_interval=%s not applied to Flower's dispatch loop: "
                    "vce_api.add_messages_to_queue%s is not the function it was written for "
                    "(Flower's 0.1 s loop runs)", interval, tuple(params))
        yield False
        return
    vce_api.add_messages_to_queue = dispatch_loop(float(interval))
    try:
        yield True
    finally:
        vce_api.add_messages_to_queue = original
