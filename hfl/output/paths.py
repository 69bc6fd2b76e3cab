"""Run-config values that become paths on a host (``state-key``, ``run-name``, ``output-dir``,
``work-dir``) are checked on every host that reads them: a name is one path component, a
directory an absolute path without ``..``. Light to import (a ClientApp process per message
imports it)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from hfl.errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9._-]+")


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
