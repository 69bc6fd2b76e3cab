"""``flower-supernode`` with shorter waits: ``python -m hfl.deploy.supernode ARGS`` is Flower's
SuperNode with ARGS, whose loops sleep at most ``HFL_SUPERNODE_POLL`` seconds (default 0.5).

Flower 1.41/1.42's SuperNode sleeps 3 s whenever a pull finds no message, and 0.5 s between looks
for its ClientApp's reply (``flwr/supernode/start_client_internal.py``), with no setting for
either (``../shared/notes/flower-and-environment.md``, "Deployment latency"): every hop of a
deployed round waited 1.5 s on average before it started. The module's ``time`` is replaced by
one whose ``sleep`` is capped, only for the Flower versions this was read against and while the
module still waits with ``time.sleep(3)``; otherwise Flower's own SuperNode runs, with a warning.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
from typing import Any

log = logging.getLogger("hfl")
TESTED = ("1.41.", "1.42.")
DEFAULT_POLL = 0.5


class CappedSleep:
    """The ``time`` module, but ``sleep`` waits at most ``cap`` seconds."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.cap))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def shorten_waits(cap: float) -> bool:
    """Cap the SuperNode loop's sleeps at ``cap`` seconds; whether it was done."""
    import flwr
    from flwr.supernode import start_client_internal as loop

    source = inspect.getsource(loop)
    if not flwr.__version__.startswith(TESTED) or loop.time is not time or "time.sleep(3)" not in source:
        log.warning("hfl: Flower %s's SuperNode is not the one hfl.deploy.supernode was written for; "
                    "its own 3 s poll stays", flwr.__version__)
        return False
    loop.time = CappedSleep(cap)
    return True


def main() -> None:
    shorten_waits(float(os.environ.get("HFL_SUPERNODE_POLL", DEFAULT_POLL)))
    from flwr.supernode.cli import flower_supernode

    sys.argv[0] = "flower-supernode"
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()
