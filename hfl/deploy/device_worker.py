"""A device host's worker: one long-lived process that answers the device's fit and evaluate
messages, so that the ClientApp process Flower starts for each message only relays it.

Flower starts a new ClientApp process for every message a SuperNode receives (its issue #3670);
a device's costs importing torch and the engine, about 2 s of CPU a message here, before any
training. With a worker beside the SuperNode (``hfl-deploy device`` starts both), the ClientApp
posts the message to the worker's mailbox (``hfl.deploy.mailbox``, in the device's state
directory) and returns its reply; the worker builds the device exactly as the ClientApp would
(``hfl.deploy.device.device_client``: its state read from and saved to the state directory, the
reply kept beside it), so a message answered by the worker or by the ClientApp itself gives the
same reply. No worker alive (none started, or it died): the ClientApp computes the reply itself.

    python -m hfl.deploy.device_worker --device-id 3 [--state-dir DIR] [--data-path F]

A second worker for the same device and state directory waits (a file lock) and takes over when
the first one dies.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from flwr.client import NumPyClient
from flwr.common import NDArrays, Scalar

from hfl.deploy.mailbox import Letter, Mailbox, request_name
from hfl.deploy.private import private_umask
from hfl.output.paths import confined_name
from hfl.deploy.roles import DEFAULT_STATE_DIR

log = logging.getLogger("hfl")
KEY, OVERRIDES = "__experiment", "__overrides"  # what a relayed message adds to its config
POLL, MAX_POLL = 0.01, 0.1


def worker_box(node_config: Mapping) -> Mailbox:
    """The mailbox of a device's worker, in its state directory."""
    state_dir = Path(str(node_config.get("state-dir") or DEFAULT_STATE_DIR))
    return Mailbox(state_dir / f"worker-{int(node_config['device-id'])}")


class DeviceRelay(NumPyClient):
    """A device's ClientApp when its worker is alive: the message goes to the worker; if the
    worker stops beating while it waits, ``fallback`` (the device built here) answers instead."""

    def __init__(self, box: Mailbox, key: str, overrides: str, fallback: Callable[[], NumPyClient]) -> None:
        self.box = box
        self.key = key
        self.overrides = overrides
        self.fallback = fallback

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        reply = self._ask("fit", parameters, config)
        if reply is None:
            return self.fallback().fit(parameters, config)
        return reply.arrays, reply.number, reply.config

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        reply = self._ask("evaluate", parameters, config)
        if reply is None:
            return self.fallback().evaluate(parameters, config)
        return reply.loss, reply.number, reply.config

    def _ask(self, action: str, arrays: NDArrays, config: dict) -> Letter | None:
        relayed = {**config, KEY: self.key, OVERRIDES: self.overrides}
        name = request_name(action, relayed)
        self.box.post(name, Letter(action, list(arrays), relayed))
        wait, next_check = POLL, time.monotonic() + 2.0
        try:
            while (reply := self.box.reply(name)) is None:
                if time.monotonic() > next_check:
                    if not self.box.server_alive(stale_after=5.0):
                        log.warning("device worker %s stopped beating; answering here", self.box.root)
                        return None
                    next_check = time.monotonic() + 2.0
                time.sleep(wait)
                wait = min(wait * 1.5, MAX_POLL)
        finally:
            self.box.forget(name)
        if reply.error:
            raise RuntimeError(f"device worker: {reply.error}")
        return reply


def handle(letter: Letter, node_config: Mapping, compose: Callable[[str], Mapping]) -> Letter:
    """Answer one relayed message as the device's ClientApp would."""
    from hfl.deploy.device import device_client
    from hfl.deploy.wiring import cached_config

    config = dict(letter.config)
    key, overrides = str(config.pop(KEY)), str(config.pop(OVERRIDES))
    state_dir = Path(str(node_config.get("state-dir") or DEFAULT_STATE_DIR))
    try:
        key = confined_name("state-key", key)  # it names a folder in the state directory
        cfg = cached_config(state_dir / key, overrides, lambda: compose(overrides))
        device = device_client(cfg, node_config, key)
        if letter.action == "fit":
            arrays, number, metrics = device.fit(letter.arrays, config)
            return Letter("fit", list(arrays), dict(metrics), number=number)
        loss, number, metrics = device.evaluate(letter.arrays, config)
        return Letter("evaluate", [], dict(metrics), number=number, loss=loss)
    except Exception as exc:  # noqa: BLE001 - the device's failure, reported to its node
        log.exception("device worker: %s failed", letter.action)
        return Letter(letter.action, [], {}, error=f"{type(exc).__name__}: {exc}")


def serve(node_config: Mapping, stop: threading.Event | None = None,
          compose: Callable[[str], Mapping] | None = None) -> None:
    """Answer the device's relayed messages until ``stop`` is set (or forever); ``compose``: the
    experiment's config from its overrides (Hydra's, as the ClientApp composes it)."""
    if compose is None:
        from hfl.config.compose import compose_config

        def compose(overrides: str) -> Mapping:
            return compose_config(overrides, 0)

    stop = stop or threading.Event()
    box = worker_box(node_config)
    with (box.root / "lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker per device; a second one waits here as a standby
        log.info("device worker %s: serving", box.root)
        box.keep_beating(stop)
        last = 0.0
        while not stop.is_set():
            pending = box.pending()
            if not pending:
                stop.wait(0.01 if time.monotonic() - last < 1.0 else 0.05)
                continue
            name = pending[0]
            try:
                letter = box.request(name)
            except (FileNotFoundError, ValueError):  # forgotten by its relay meanwhile, or half written
                continue
            started = time.monotonic()
            box.answer(name, handle(letter, node_config, compose))
            last = time.monotonic()
            log.info("device worker: answered %s in %.2f s", name, last - started)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hfl.deploy.device_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device-id", type=int, required=True)
    p.add_argument("--state-dir")
    p.add_argument("--data-path")
    args = p.parse_args(argv)
    private_umask()  # the device's state and data: the owner's alone
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node_config = {"role": "device", "device-id": args.device_id}
    if args.state_dir:
        node_config["state-dir"] = args.state_dir
    if args.data_path:
        node_config["data-path"] = args.data_path
    serve(node_config)


if __name__ == "__main__":
    main()
