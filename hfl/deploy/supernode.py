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


# Flower pulls a message's objects with a retry whose first wait is 1 s (PULL_INITIAL_BACKOFF, doubling to
# 10 s), taken whenever an object is not there yet - which, between hosts that hand a message on at once,
# is every hop: a device's task measured 1.1 s here for 4 ms of work. hfl's processes retry after 20 ms,
# doubling to 0.25 s.
PULL_BACKOFF = (0.02, 0.25)
PULLERS = {  # module -> the name of the pull function it calls (each imported it by name)
    "flwr.supernode.start_client_internal": "pull_objects",  # a SuperNode pulling a message from its SuperLink
    "flwr.superlink.grid.http_grid": "pull_objects",  # a ServerApp pulling its children's replies
    "flwr.supernode.runtime.run_clientapp": "pull_and_inflate_object_from_tree",  # a ClientApp (the runner)
}


def shorten_object_pulls(initial: float = PULL_BACKOFF[0], cap: float = PULL_BACKOFF[1]) -> list[str]:
    """Give the Flower modules of this process a pull retry starting at ``initial`` seconds (capped at
    ``cap``) instead of 1 s; only on the Flower versions this was read against. The modules patched."""
    import functools
    import importlib

    import flwr

    if not flwr.__version__.startswith(TESTED):
        return []
    done = []
    for module_name, name in PULLERS.items():
        module = importlib.import_module(module_name)
        pull = getattr(module, name, None)
        if pull is None or isinstance(pull, functools.partial):
            continue
        if {"initial_backoff", "backoff_cap"} - set(inspect.signature(pull).parameters):
            continue
        setattr(module, name, functools.partial(pull, initial_backoff=initial, backoff_cap=cap))
        done.append(module_name)
    return done


def main() -> None:
    shorten_waits(float(os.environ.get("HFL_SUPERNODE_POLL", DEFAULT_POLL)))
    shorten_object_pulls()
    from flwr.supernode.cli import flower_supernode

    sys.argv[0] = "flower-supernode"
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()
