"""What hfl writes on a deployment host is private to the user running it, and stays where it
belongs.

Keys, device data, node state, mailboxes, work directories and FLWR_HOME are readable by their
owner alone: folders are made 0700, private files 0600 from their creation (no window in
which another user could open them, no symlink at the path followed), and the role processes
run under umask 0077 so that files Flower itself creates (a SuperLink's ``superlink.db``) are
private too. Run-config values that become paths on a host (``state-key``, ``run-name``,
``output-dir``, ``work-dir``) are checked on every host that reads them: a name is one path
component, a directory an absolute path without ``..``. Light to import (a ClientApp process
per message imports it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from hfl.errors import ConfigError

UMASK = 0o077  # files 0600, folders 0700
_NAME = re.compile(r"[A-Za-z0-9._-]+")


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


def confined_name(key: str, value: object) -> str:
    """``value`` as one path component ([A-Za-z0-9._-], not '.' or '..'), else ConfigError
    naming ``key``: it names a folder under a host's own directory and must stay inside it."""
    text = str(value)
    if not _NAME.fullmatch(text) or text in (".", ".."):
        raise ConfigError(key, f"{text!r} must be a single name of letters, digits, '.', '_' or '-' "
                               "(no '/', not '.' or '..'): it names a file or folder on a host")
    return text


def confined_dir(key: str, value: object) -> Path:
    """``value`` as an absolute directory without a '..' part, else ConfigError naming ``key``."""
    text = str(value)
    path = PurePosixPath(text)
    if not text or not path.is_absolute() or ".." in path.parts or "\0" in text:
        raise ConfigError(key, f"{text!r} must be an absolute path without '..' parts")
    return Path(text)


def run_dir(run_config: Mapping[str, object], default_name: str, *, absolute: bool = True) -> Path:
    """The root run's directory, ``output-dir``/``run-name``, both checked. ``absolute=False``
    (``flwr run .`` in a simulation, where the app's default ``outputs/flwr`` is relative to
    where it runs) allows a relative ``output-dir``, still without '..'."""
    name = confined_name("run-name", run_config.get("run-name") or default_name)
    output = str(run_config.get("output-dir", "outputs/flwr"))
    if not absolute and output and not PurePosixPath(output).is_absolute():
        if ".." in PurePosixPath(output).parts:
            raise ConfigError("output-dir", f"{output!r} must be a path without '..' parts")
        return Path(output) / name
    return confined_dir("output-dir", output) / name
