"""An inner node on its own host: the engine's node (``hfl.node.client.NodeClient``, the same
code and algorithm modules as simulation) with remote children, in one long-lived run.

A node host runs a SuperLink for its children (device SuperNodes, or the bridges of the next
level's nodes) and a SuperNode toward its parent (its bridge, ``hfl.deploy.bridge``). For a
whole experiment the bridge keeps one run of this ServerApp on the host's SuperLink: it answers
the requests the bridge posts (``hfl.deploy.mailbox``) by running the node's rounds over its
children through the Grid (``hfl.deploy.grid``). Its state — the node's model, its rule's
state — lives in the host's work directory under the experiment's key, so a node server that is
killed and started again goes on from it.

A node server whose SuperLink is gone ends (``watch_superlink``): Flower's Grid retries a call
to a SuperLink that refuses connections forever (``flwr.supercore.retry.http_retry``: no
``max_tries``, no ``max_time``), so a check through the Grid would itself wait forever, and a
node server busy in a round would never look.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from flwr.app import Context
from flwr.serverapp.grid import Grid

from hfl.deploy.children import Children
from hfl.deploy.flights import GridFlights
from hfl.deploy.grid import evaluate_targets_together, evaluate_together, fit_together, tell_stop
from hfl.deploy.mailbox import Letter, Mailbox
from hfl.deploy.private import private_dir, private_umask
from hfl.output.paths import confined_dir, confined_name
from hfl.state.store import StateStore

log = logging.getLogger("hfl")


def log_to(path: Path) -> None:
    """A ServerApp's output goes to Flower's run log, read with ``flwr log``; the host's operator
    reads this file (it outlives the SuperLink)."""
    private_dir(path.parent)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per pull otherwise


def serve_node(grid: Grid, context: Context, cfg: Mapping) -> None:
    """The node server's run: answer the bridge's requests until it says stop (the experiment
    is over) or none comes for ``runtime.team_run_timeout`` seconds."""
    from hfl.accel.batched import use_runtime_threads
    from hfl.runtime.build import federation_for, node_client

    use_runtime_threads(cfg["runtime"])  # a node's own training (e.g. B-HFL's proxy steps), as in simulation

    private_umask()  # its state, mailbox and log: the owner's alone (this process is the node server's own)
    run_config = context.run_config
    path = str(run_config["path"])
    work = confined_dir("work-dir", run_config["work-dir"]) / confined_name("state-key", run_config["state-key"])
    box = Mailbox(work)
    tree = federation_for(cfg).tree
    if path not in tree.inner_paths:
        raise ValueError(f"node path {path!r} is no inner node of the topology (depth {tree.depth})")
    runtime = cfg["runtime"]
    lowest = tree.is_lowest(path)
    log_to(work / "node.log")
    holds = ({f"{d:06d}": frozenset([d]) for d in tree.devices(path)} if lowest
             else {c: frozenset(tree.devices_under(c)) for c in tree.children(path)})
    # A device's reply is late after team_round_timeout; a child node's after team_run_timeout (its whole call).
    timeout = runtime.get("team_round_timeout") if lowest else runtime.get("team_run_timeout")
    children = Children(grid, holds, devices=lowest, wait_seconds=float(runtime.get("device_wait_seconds", 60)),
                        timeout=timeout)
    store = StateStore(work / "state")
    # clock.enabled: the level's policy on real arrivals; replies awaited across calls (hfl.clock.realtime)
    flights = GridFlights(grid, children.relocate, children.rejoin_seconds)
    (work / "server.pid").write_text(str(os.getpid()))  # for the host's operator (and the restart test)
    stop = threading.Event()
    box.keep_beating(stop)
    watch_superlink(grid, stop, name=f"node {path}")  # gone, or its parent gone: nobody to serve, even mid-round
    idle_limit = float(runtime.get("team_run_timeout", 3600))
    last = time.monotonic()
    fit_many = fit_together
    if lowest:
        from hfl.node.secagg import SecAggSettings

        secagg = SecAggSettings.of(cfg)
        if secagg is not None:  # Flower's SecAgg+ with the devices: this server sees only their sum
            from hfl.deploy.secagg import secagg_fit_together

            fit_many = secagg_fit_together(secagg, int(cfg["seed"]), path)
    log.info("node %s: serving requests from %s", path, work)
    try:
        while time.monotonic() - last < idle_limit:
            pending = box.pending()
            if not pending:
                # 10 ms right after an answer (the parent's next request is near), 0.1 s when idle
                time.sleep(0.01 if time.monotonic() - last < 1.0 else 0.1)
                continue
            last = time.monotonic()
            name = pending[0]
            letter = box.request(name)
            log.info("node %s: %s %s", path, letter.action, name)
            if letter.action == "stop":
                _stop_children(children)
                box.answer(name, Letter("stop", [], {}))
                return
            if letter.action == "fit":
                # A node server started again may have saved this round's state before it died:
                # the round starts over from the state of the round before, as it first did.
                store.rollback(int(str(letter.config.get("round_path", letter.config.get("global_round", 0)))
                                   .split(".")[0]) - 1)
            box.answer(name, _handle(letter, lambda: node_client(
                cfg, path, store, children.proxies(), holds,
                fit_many=fit_many, evaluate_many=evaluate_together, evaluate_targets=evaluate_targets_together,
                flights=flights)))
            log.info("node %s: answered %s", path, name)
    finally:
        stop.set()


def _superlink_lost(grid: Grid, lost: int, timeout: float = 3.0) -> int:
    """How many looks in a row the SuperLink has not answered (0 once it does). Flower's HTTP
    Grid (its address in ``_addr``) is probed with a plain connection, ``timeout`` seconds at
    most: through the Grid a refused connection is retried forever. Any other Grid is asked
    for its nodes."""
    address = getattr(grid, "_addr", None)
    try:
        if isinstance(address, str) and address:
            host, _, port = address.rpartition(":")
            socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout).close()
        else:
            grid.get_node_ids()
        return 0
    except Exception:  # noqa: BLE001 - connection refused, run stopped: the reason is in Flower's log
        return lost + 1


def _end_now(reason: str) -> None:
    """End this process at once: its SuperLink (or the SuperExec that started it) is gone, so
    Flower's own exit, which reports to the SuperLink, could wait forever. The node's state is
    saved atomically after every round, as it is for a killed node server."""
    log.error("%s; the node server ends", reason)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


def watch_superlink(grid: Grid, stop: threading.Event, *, name: str = "node", every: float = 5.0, misses: int = 3,
                    end: Callable[[str], None] = _end_now) -> threading.Thread:
    """A daemon thread that ends the node server (``end``) once its SuperLink has not answered
    ``misses`` looks ``every`` seconds apart, or once its parent process (the SuperExec that
    started it) is gone; it stops looking when ``stop`` is set."""
    parent = os.getppid()

    def watch() -> None:
        lost = 0
        while not stop.wait(every):
            if os.getppid() != parent:
                end(f"{name}: the process that started it ({parent}) is gone")
                return
            lost = _superlink_lost(grid, lost, timeout=min(every, 3.0))
            if lost >= misses:
                end(f"{name}: its SuperLink has not answered for {lost * every:.0f} s")
                return

    thread = threading.Thread(target=watch, name="superlink-watch", daemon=True)
    thread.start()
    return thread


def _handle(letter: Letter, make_node) -> Letter:  # noqa: ANN001
    try:
        node = make_node()
        if letter.action == "fit":
            arrays, number, metrics = node.fit(letter.arrays, letter.config)
            return Letter("fit", list(arrays), dict(metrics), number=number)
        loss, number, metrics = node.evaluate(letter.arrays, letter.config)
        return Letter("evaluate", [], dict(metrics), number=number, loss=loss)
    except Exception as exc:  # noqa: BLE001 - the parent counts this node as failed
        log.exception("node request %s failed", letter.action)
        return Letter(letter.action, [], {}, error=f"{type(exc).__name__}: {exc}")


def _stop_children(children: Children) -> None:
    """The experiment is over: child node servers stop too (devices have nothing to stop)."""
    if children.devices:
        return
    children.refresh()
    tell_stop(children.grid, list(children.nodes.values()))
