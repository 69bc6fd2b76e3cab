"""A run directory is owned by one run at a time: the driver holds an exclusive ``flock`` on
``<run dir>/checkpoints/run.lock`` for the life of the run. The operating system releases it
when the process ends however it ends (SIGKILL, a power cut), so a lock file left by a dead run
is no lock; the file itself only says who holds it (pid and host), for the message, and is
emptied when the run ends."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from types import TracebackType

from hfl.errors import ConfigError

LOCK = Path("checkpoints") / "run.lock"


class RunLock:
    """``with RunLock(run_dir):`` — raises ConfigError (naming ``hydra.run.dir``) while another
    process holds it."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError("hydra.run.dir", f"{self.path.parent.parent} is in use by another hfl run ({holder}); "
                                               "wait for it to end, or give this run another directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._fd is not None:
            # Emptied as it is released: a run that ends (a refused one included) leaves the file as
            # it found it, and only a live holder, or a dead one, is ever named in it.
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None
