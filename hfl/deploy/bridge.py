"""A node host's bridge: a SuperNode of the parent's SuperLink whose ClientApp hands each of the
parent's messages to the node server on the same host (``hfl.deploy.node_server``) and returns
its answer.

Flower starts a ClientApp process per message, so the bridge keeps nothing in memory: the node
server is one run on the host's own SuperLink for the whole experiment, started by the first
bridge that finds none alive (and again if it dies), and the two exchange files
(``hfl.deploy.mailbox``) polled every 10 to 100 ms.

Node config (``flower-supernode --node-config``):
  role="node"  path="0.1"                 which inner node of the topology this host serves
                                           (role="team" team-id=N is the level-1 node N)
  node-superlink="127.0.0.1:9192"         the host's own SuperLink (its Control API)
  node-root-certificates="/tls/ca.crt"    its CA when it serves TLS ("" = insecure)
  work-dir="/var/lib/hfl/node-0.1"        the node's state, the mailbox and a private FLWR_HOME
  app-dir="/opt/hfl"                       the app submitted to the host's SuperLink
                                           (default: this package's project directory)
"""

from __future__ import annotations

import fcntl
import logging
import time
from collections.abc import Callable
from pathlib import Path

from flwr.client import NumPyClient
from flwr.common import NDArrays, Scalar

from hfl.deploy.mailbox import Letter, Mailbox, request_name

log = logging.getLogger("hfl")
POLL, MAX_POLL = 0.01, 0.1  # seconds between looks for the node server's reply: 10 ms, growing to 0.1 s
START_SECONDS = 300.0  # a node server not beating this long after its run was submitted failed to start


def node_properties(path: str) -> dict[str, Scalar]:
    """What a bridge answers "who are you" with (its parent maps Flower node ids to paths by it)."""
    return {"path": path, "level": path.count(".") + 1}


class NodeBridge(NumPyClient):
    """The parent's view of a deployed node: its path, and its fit/evaluate answered by the
    node server. ``start()`` submits a node server run to the host's SuperLink."""

    def __init__(self, path: str, box: Mailbox, start: Callable[[], None], timeout: float) -> None:
        self.path = path
        self.box = box
        self.start = start
        self.timeout = timeout

    def get_properties(self, config: dict[str, Scalar]) -> dict[str, Scalar]:
        if config.get("stop") and self.box.server_alive():  # posted, not awaited: the node server passes it on
            self.box.post(request_name("stop", dict(config)), Letter("stop", [], dict(config)))
        return node_properties(self.path)

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        reply = self._ask("fit", parameters, dict(config))
        return reply.arrays, reply.number, reply.config

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        reply = self._ask("evaluate", parameters, dict(config))
        return reply.loss, reply.number, reply.config

    def ensure_server(self) -> None:
        """A node server is alive for this experiment: if none beats, submit one (one bridge at
        a time: a file lock) and wait for its first beat."""
        if self.box.server_alive():
            return
        with (self.box.root / "server.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.box.server_alive():
                return
            log.info("node %s: starting its node server", self.path)
            self.start()
            deadline = time.monotonic() + START_SECONDS
            while not self.box.server_alive():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {self.path}: its node server did not start within {START_SECONDS:.0f} s; "
                                       "see the node SuperLink's log")
                time.sleep(0.05)

    def _ask(self, action: str, arrays: NDArrays, config: dict) -> Letter:
        name = request_name(action, config)
        reply = self.box.reply(name)  # a message delivered again: answered already
        if reply is None:
            self.ensure_server()
            self.box.post(name, Letter(action, list(arrays), config))
            reply = self._wait(name)
        if reply.error:
            raise RuntimeError(f"node {self.path}: {reply.error}")
        return reply

    def _wait(self, name: str) -> Letter:
        deadline = time.monotonic() + self.timeout
        next_check = time.monotonic() + 2.0
        wait = POLL
        while True:
            reply = self.box.reply(name)
            if reply is not None:
                return reply
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"node {self.path}: no answer to {name} within {self.timeout:.0f} s")
            if now > next_check:  # a node server that died is started again; it answers the request
                self.ensure_server()
                next_check = now + 2.0
            time.sleep(wait)
            wait = min(wait * 1.5, MAX_POLL)


def submit_node_server(link, path: str, overrides: str, state_key: str, work_dir: Path) -> Callable[[], None]:  # noqa: ANN001
    """``NodeBridge.start`` for a host: one run of this app on its SuperLink, the node server."""

    def start() -> None:
        # absolute: the node server refuses any other work-dir (hfl.output.paths.confined_dir)
        run_config = {"tier": "node", "path": path, "overrides": overrides, "state-key": state_key,
                      "work-dir": str(Path(work_dir).absolute())}
        run_id = link.submit(run_config, work_dir / state_key / "run-config.toml")
        log.info("node %s: node server is run %d", path, run_id)

    return start
