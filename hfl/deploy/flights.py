"""A deployed node's calls whose replies come when they come (hfl.clock.realtime.Flights): fits
pushed through Flower's Grid one round at a time, their replies looked for while the node's
policy decides when a round closes, kept awaited across its rounds and calls (late: next,
buffered). One per node server process (and one for the root's run): a node server started
again has none, and its timer sends again the calls its stored state still awaits."""

from __future__ import annotations

import logging
import time

from flwr.app.message_type import MessageType
from flwr.common import FitIns, FitRes
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_proxy import ClientProxy
from flwr.serverapp.grid import Grid

from hfl.deploy.grid import ChildFailed, Exchange, GridProxy, Relocate

log = logging.getLogger("hfl")


class GridFlights:
    """``Flights`` over a Grid: a call to a child that is not connected (an ``AbsentChild``) fails
    at once; one whose reply does not come within the child's timeout (``runtime.team_round_timeout``
    for devices) fails then."""

    def __init__(self, grid: Grid, relocate: Relocate | None = None, rejoin_seconds: float = 60.0) -> None:
        self.exchange = Exchange(grid, relocate, rejoin_seconds)
        self.keys: dict[int, str] = {}  # message index -> its call's key
        self.index: dict[str, int] = {}
        self.expires: dict[int, float] = {}  # message index -> when it fails unanswered
        self.timeouts: dict[int, float | None] = {}
        self.ready: dict[str, FitRes | BaseException] = {}  # outcomes known before any pull (absent children)

    def push(self, key: str, proxy: ClientProxy, ins: FitIns) -> None:
        if key in self.index:
            self.drop(key)
        while not isinstance(proxy, GridProxy) and isinstance(getattr(proxy, "proxy", None), ClientProxy):
            proxy = proxy.proxy  # a child named otherwise around its Grid proxy (the root's PathProxy)
        if not isinstance(proxy, GridProxy):
            try:
                self.ready[key] = proxy.fit(ins, None, None)
            except Exception as exc:  # noqa: BLE001 - that child's failure (e.g. not connected)
                self.ready[key] = exc
            return
        (i,) = self.exchange.add([proxy.message(compat.fitins_to_recorddict(ins, keep_input=True), MessageType.TRAIN)])
        self.keys[i], self.index[key], self.timeouts[i] = key, i, proxy.timeout
        if proxy.timeout is not None:
            self.expires[i] = time.monotonic() + proxy.timeout

    def poll(self) -> dict[str, FitRes | BaseException]:
        out, self.ready = self.ready, {}
        if not self.exchange.open:
            return out
        replies = self.exchange.poll()
        now = time.monotonic()
        for i in [i for i in self.exchange.open if self.expires.get(i, now + 1) < now]:
            self.exchange.drop(i)
            replies[i] = None
        for i, reply in replies.items():
            key = self.keys.pop(i)
            del self.index[key]
            self.expires.pop(i, None)
            failed = self.exchange.failure(i, reply, self.timeouts.pop(i))
            if failed is not None:
                out[key] = failed
                continue
            try:
                out[key] = compat.recorddict_to_fitres(reply.content, keep_input=False)
            except Exception as exc:  # noqa: BLE001 - a malformed reply is that child's failure
                out[key] = ChildFailed(f"malformed reply: {exc!r}")
        return out

    def awaiting(self, key: str) -> bool:
        return key in self.index or key in self.ready

    def drop(self, key: str) -> None:
        i = self.index.pop(key, None)
        if i is not None:
            self.exchange.drop(i)
            self.keys.pop(i, None)
            self.expires.pop(i, None)
            self.timeouts.pop(i, None)
        self.ready.pop(key, None)
