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
        super().__call__(grid, context)


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
