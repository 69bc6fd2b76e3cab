"""How a node host's bridge and its node server talk: files in the node's work directory.

The bridge (a ClientApp process Flower starts per message from the parent) posts the parent's
message as a request; the node server (one long-lived ServerApp run on the host's own
SuperLink, ``hfl.deploy.node_server``) answers it with a reply; both poll every 10 to 100 ms. A request
is named by what it asks (action and the parent's config), so a message delivered again after a
restart of either side finds its reply instead of being computed twice. The node server
touches ``alive`` every second; a bridge that finds it stale starts a new node server.

Files are written then renamed (``hfl.state.store``); a request's or reply's ``.json`` is
written last and marks it complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common import NDArrays

from hfl.deploy.private import private_dir
from hfl.state.store import atomic_savez, atomic_write_bytes

ACTIONS = ("fit", "evaluate", "stop")


@dataclass
class Letter:
    """A request (``action``, ``arrays``, ``config``) or a reply (``arrays``, ``number``: the
    samples behind it, ``loss`` for an evaluation, ``metrics``; ``error`` when the node failed)."""

    action: str
    arrays: NDArrays
    config: dict[str, Any]
    number: int = 0
    loss: float = 0.0
    error: str = ""


def request_name(action: str, config: dict[str, Any]) -> str:
    """What a request is called: its action and a digest of the parent's config (which carries
    the round), the same for a message delivered twice."""
    if action not in ACTIONS:
        raise ValueError(f"unknown request action {action!r}; known: {', '.join(ACTIONS)}")
    digest = hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{action}-{digest}"


class Mailbox:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        for sub in ("requests", "replies"):
            private_dir(self.root / sub)  # models and data in transit: the owner's alone

    @property
    def alive_file(self) -> Path:
        return self.root / "alive"

    def _write(self, folder: str, name: str, letter: Letter) -> None:
        atomic_savez(self.root / folder / f"{name}.npz", *letter.arrays)
        meta = {"action": letter.action, "config": letter.config, "number": letter.number, "loss": letter.loss,
                "error": letter.error}
        atomic_write_bytes(self.root / folder / f"{name}.json", json.dumps(meta, default=str).encode())

    def _read(self, folder: str, name: str) -> Letter | None:
        meta_file = self.root / folder / f"{name}.json"
        try:
            meta = json.loads(meta_file.read_text())
        except FileNotFoundError:
            return None
        with np.load(self.root / folder / f"{name}.npz") as data:
            arrays = [data[f"arr_{i}"] for i in range(len(data.files))]
        return Letter(meta["action"], arrays, meta["config"], int(meta["number"]), float(meta["loss"]),
                      str(meta["error"]))

    # the bridge's side
    def post(self, name: str, letter: Letter) -> None:
        self._write("requests", name, letter)

    def reply(self, name: str) -> Letter | None:
        return self._read("replies", name)

    def server_alive(self, stale_after: float = 10.0) -> bool:
        try:
            return time.time() - self.alive_file.stat().st_mtime < stale_after
        except FileNotFoundError:
            return False

    # the node server's side
    def pending(self) -> list[str]:
        """Requests without a reply, oldest first."""
        names = [(p.stat().st_mtime_ns, p.stem) for p in (self.root / "requests").glob("*.json")]
        return [n for _, n in sorted(names) if not (self.root / "replies" / f"{n}.json").exists()]

    def request(self, name: str) -> Letter:
        letter = self._read("requests", name)
        if letter is None:
            raise FileNotFoundError(f"request {name} vanished from {self.root / 'requests'}")
        return letter

    def answer(self, name: str, letter: Letter) -> None:
        self._write("replies", name, letter)

    def beat(self) -> None:
        self.alive_file.touch()

    def keep_beating(self, stop: threading.Event) -> None:
        """Beat every second, in a daemon thread, until ``stop`` is set."""

        def loop() -> None:
            while not stop.is_set():
                self.beat()
                stop.wait(1.0)

        threading.Thread(target=loop, name="mailbox-beat", daemon=True).start()

    def forget(self, name: str) -> None:
        """Remove a request and its reply (a device's worker keeps no history: the device's
        state holds its last reply)."""
        for folder in ("replies", "requests"):
            for suffix in (".json", ".npz"):
                (self.root / folder / f"{name}{suffix}").unlink(missing_ok=True)
