"""A deployed node's children — or the root's level-1 nodes — named by their place in the tree.

Flower names each SuperNode by a node id it draws when the SuperNode connects, so a child whose
process is started again (after a crash, a reboot) is a new node. ``Children`` maps the tree's
names (a child path, or a device id as ``"000042"``) to the newest node that answers for each,
asking every new node who it is once; ``relocate`` tells an exchange in flight where a child it
is waiting for has come back (hfl.deploy.grid.exchange pushes the message again there).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.serverapp.grid import Grid

from hfl.deploy.grid import INTERVAL, ChildFailed, GridProxy, ask_properties

log = logging.getLogger("hfl")


class AbsentChild(ClientProxy):
    """A child the topology has that is not connected: asked, it fails (a counted failure), naming
    what the nodes that did not say who they are answered, if any (e.g. a runner refusing the app)."""

    def __init__(self, cid: str, why: str = "") -> None:
        super().__init__(cid)
        self.why = why

    def _fail(self, *_: object, **__: object):  # noqa: ANN202
        raise ChildFailed(f"child {self.cid} is not connected" + (f"; {self.why}" if self.why else ""))

    get_properties = get_parameters = fit = evaluate = reconnect = _fail


class Children:
    """The node's children as the topology names them, found among the SuperLink's nodes by
    asking each new one its properties once. A child that comes back (a restarted SuperNode is a
    new Flower node) replaces its old node."""

    def __init__(self, grid: Grid, expected: Iterable[str], *, devices: bool, wait_seconds: float,
                 timeout: float | None, interval: float = INTERVAL, rejoin_seconds: float | None = None) -> None:
        self.grid = grid
        self.expected = sorted(expected)
        self.devices = devices
        self.wait_seconds = wait_seconds
        self.timeout = timeout
        self.interval = interval
        # How long a message waits for its child to come back once Flower reports the child's
        # node gone (missed heartbeats): as long as a round waits for children to connect.
        self.rejoin_seconds = wait_seconds if rejoin_seconds is None else rejoin_seconds
        self.names: dict[int, str | None] = {}  # Flower node id -> the child it is (None: not one of ours)
        self.nodes: dict[str, int] = {}  # child -> its newest node id
        self.unnamed: dict[int, str] = {}  # node id -> why it did not say who it is (its last answer)
        self._lock = threading.Lock()  # the root's Flower server calls its children from threads

    def _name(self, props: Mapping) -> str | None:
        if self.devices:
            return f"{int(props['device_id']):06d}" if "device_id" in props else None
        return str(props["path"]) if "path" in props else None

    def refresh(self, timeout: float = 120.0) -> None:
        """Ask nodes not seen before who they are (``timeout``: for their answers; a ClientApp
        process starting on a busy host takes seconds)."""
        with self._lock:
            self._refresh(timeout)

    def _refresh(self, timeout: float) -> None:
        online = set(self.grid.get_node_ids())
        for name, node in list(self.nodes.items()):
            if node not in online:
                del self.nodes[name]
        for node in sorted(online):  # a node Flower declared gone (missed heartbeats) that is back, same id
            name = self.names.get(node)
            if name is not None and name not in self.nodes:
                self.nodes[name] = node
        new = sorted(online - set(self.names))
        if not new:
            return
        for node, reply in zip(new, ask_properties(self.grid, new, {}, timeout, self.interval), strict=True):
            if isinstance(reply, ChildFailed):
                log.warning("node %s did not say who it is: %s", node, reply)
                self.unnamed[node] = str(reply)
                continue  # asked again at the next refresh
            self.unnamed.pop(node, None)
            name = self._name(reply)
            if name not in self.expected:
                log.warning("ignored Flower node %s: %s is no child of this node", node, name)
                name = None
            self.names[node] = name
            if name is not None:
                if name in self.nodes:
                    log.info("child %s is back as Flower node %s (was %s)", name, node, self.nodes[name])
                self.nodes[name] = node

    def relocate(self, node_ids: Sequence[int]) -> dict[int, int]:
        """For nodes a message waits on: the node now answering for the same child, where one is
        connected (a newer one: the old node's process died and was started again; or the same one,
        back after Flower declared it gone)."""
        try:
            self.refresh(timeout=30.0)
        except Exception as exc:  # noqa: BLE001 - the SuperLink is busy or restarting: look again later
            log.warning("could not look for children that came back: %s", exc)
            return {}
        moved = {}
        for node in node_ids:
            name = self.names.get(node)
            newest = self.nodes.get(name) if name is not None else None
            if newest is not None:
                moved[node] = newest
        return moved

    def proxies(self) -> list[ClientProxy]:
        """Every child of the topology: connected ones (waiting up to ``wait_seconds`` for all),
        the others as absent (their calls fail and are counted)."""
        deadline = time.monotonic() + self.wait_seconds
        while True:
            self.refresh(max(self.wait_seconds, 120.0))
            if len(self.nodes) == len(self.expected) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        missing = [c for c in self.expected if c not in self.nodes]
        if missing:
            log.warning("%d of %d children not connected: %s", len(missing), len(self.expected), ", ".join(missing))
        return [GridProxy(c, self.nodes[c], self.grid, self.timeout, self.interval, relocate=self.relocate,
                          rejoin_seconds=self.rejoin_seconds) if c in self.nodes
                else AbsentChild(c, self._why()) for c in self.expected]

    def _why(self) -> str:
        """What the connected nodes that did not say who they are answered (the first of them)."""
        online = set(self.grid.get_node_ids()) if self.unnamed else set()
        answers = [why for node, why in self.unnamed.items() if node in online]
        return f"node(s) that did not say who they are answered: {answers[0]}" if answers else ""


class ChildrenManager(SimpleClientManager):
    """Flower's client manager over ``Children`` (the deployed root's level-1 nodes): every child
    of the topology, named by its path, those not connected (after waiting for them) failing."""

    def __init__(self, children: Children) -> None:
        super().__init__()
        self.children = children

    def all(self) -> dict[str, ClientProxy]:
        return {proxy.cid: proxy for proxy in self.children.proxies()}

    def num_available(self) -> int:
        return len(self.children.expected)

    def wait_for(self, num_clients: int, timeout: int = 86400) -> bool:
        return num_clients <= len(self.children.expected)
