"""What hfl writes on a deployment host is private to the user running it, and stays where it
belongs.

Keys, device data, node state, mailboxes, work directories and FLWR_HOME are readable by their
owner alone: folders are made 0700, private files 0600 from their creation (no window in
which another user could open them, no symlink at the path followed), and the role processes
run under umask 0077 so that files Flower itself creates (a SuperLink's ``superlink.db``) are
private too. Run-config values that become paths on a host are checked on every host that
reads them (hfl.output.paths). Light to import (a ClientApp process per message imports it).
"""

from __future__ import annotations

import os
from pathlib import Path

UMASK = 0o077  # files 0600, folders 0700


def private_umask() -> int:
    """Set this process's umask to 0077 (its children inherit it); the previous one."""
    return os.umask(UMASK)


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` as a folder, made 0700 (and any missing parent) if it does not exist yet; an
    existing folder is left as its owner made it."""
    path = Path(path)
    if not path.is_dir():
        old = os.umask(UMASK)  # parents made on the way are private too
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        finally:
            os.umask(old)
    return path


def write_private(path: str | os.PathLike, data: bytes, *, replace: bool = False, mode: int = 0o600) -> Path:
    """Write ``data`` to a new file readable by its owner alone (0600 from its creation; ``mode``
    0644 for a public certificate: it is opened 0600 all the same and widened once written).

    Without ``replace`` an existing file — or a symlink, even a dangling one — at ``path`` is
    refused (FileExistsError) and nothing is written through it. With ``replace`` the data goes
    to a private temporary file beside it, renamed over ``path``: a symlink there is replaced,
    never followed."""
    path = Path(path)
    if not replace:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        _fill(fd, data, mode)
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:  # named by the file asked for, not the temporary one
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    try:
        _fill(fd, data, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _fill(fd: int, data: bytes, mode: int) -> None:
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.fchmod(fd, mode)  # exactly ``mode`` whatever the umask (it could only have narrowed 0600)
    finally:
        os.close(fd)
