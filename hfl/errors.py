"""Errors hfl raises for bad input (and ``check_number``, the check of a configured number that
raises them), how a round's failures are named in error messages, and the one line a command
prints for an error the user can fix (``user_error``)."""

from __future__ import annotations

import errno
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """An invalid configuration value; the message starts with the offending key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


def check_number(
    key: str,
    value: Any,
    *,
    integer: bool = False,
    minimum: float = -math.inf,
    maximum: float = math.inf,
    open_min: bool = False,
    open_max: bool = False,
) -> Any:
    """``value`` if it is an integer (or any number) within the bounds; else a ConfigError
    naming ``key``. Booleans are rejected: YAML's ``true`` for a count is a typo; so are NaN and
    infinities, whatever the bounds."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ConfigError(key, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value}")
    if value < minimum or value > maximum or (open_min and value == minimum) or (open_max and value == maximum):
        if maximum == math.inf:
            allowed = f"{'>' if open_min else '>='} {minimum}"
        else:
            allowed = f"in {'(' if open_min else '['}{minimum}, {maximum}{')' if open_max else ']'}"
        raise ConfigError(key, f"must be {allowed}, got {value}")
    return value


def check_number_list(key: str, value: Any, what: str, **bounds: Any) -> list:
    """``value`` if it is a non-empty list whose entries pass ``check_number(**bounds)``
    (each error names ``key[i]``); else a ConfigError naming ``key``."""
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(key, f"must be null or a non-empty list of {what}, got {value!r}")
    return [check_number(f"{key}[{i}]", v, **bounds) for i, v in enumerate(value)]


class DatasetNotFoundError(FileNotFoundError):
    """A dataset that is neither on disk nor allowed to be downloaded."""


def first_failure(failures: Sequence) -> str:
    """'; first failure: <why>' for an error message (a raised exception, or a reply whose
    status is not OK), or '' without failures."""
    if not failures:
        return ""
    failure = failures[0]
    why = repr(failure) if isinstance(failure, BaseException) else str(failure[1].status.message)
    return f"; first failure: {why}"


# ---------------------------------------------------------------- errors a user can cause, in one line
# What to do about a file system error, by errno; {key} is the setting that chose the path.
_FILE_SYSTEM = {
    errno.ENOSPC: "no space left on the device: free some there, or give {key} a directory on another disk",
    errno.EDQUOT: "disk quota exceeded: free some space, or give {key} a directory on another disk",
    errno.EROFS: "read-only file system: give {key} a directory you can write to",
    errno.EACCES: "permission denied: give {key} a directory you can {use}",
    errno.EPERM: "operation not permitted: give {key} a directory you can {use}",
    errno.EEXIST: "a file stands where a directory is needed: give {key} a directory, or move the file away",
    errno.ENOTDIR: "a file stands where a directory is needed: give {key} a directory, or move the file away",
    errno.EISDIR: "a directory stands where a file is needed: give {key} another path",
}
# The same errors as text, as a round's first failure reports them: "[Errno 28] No space left on device:
# '/x'" (str, a Ray actor's), or "OSError(28, 'No space left on device')" (repr, which drops the path).
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] [^:'\"]*(?:: ['\"]([^'\"]+)['\"])?|\b[A-Za-z]*Error\((\d+), '")
# The node engine (hfl.node) rejects NaN/inf updates; a round none of whose updates survived diverged.
_REJECTED = re.compile(r"\b[1-9]\d* rejected\b")
# The root's failures name their global round "root: round N" (hfl.node.root), its nodes' "round N.k".
_GLOBAL_ROUND = re.compile(r"(?:global round|root: round) (\d+)")
RATE_KEYS = ("alpha", "eta", "beta")  # the algorithms' step sizes, besides every key ending in "lr"


def one_line(text: str) -> str:
    """``text`` with its line breaks (and runs of spaces) folded into single spaces."""
    return " ".join(text.split())


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def setting_of(path: str, cfg: Mapping | None) -> str:
    """The key that chose ``path``: dataset.root, runtime.state_dir or runtime.ray_tmp_dir when
    it lies under theirs, else hydra.run.dir (where a run writes)."""
    resolved = Path(path).absolute()
    for key in ("dataset.root", "runtime.state_dir", "runtime.ray_tmp_dir"):
        section, name = key.split(".")
        value = ((cfg or {}).get(section) or {}).get(name)
        if value and resolved.is_relative_to(Path(str(value)).expanduser().absolute()):
            return key
    return "hydra.run.dir"


def file_system_message(code: int, path: str, cfg: Mapping | None = None, key: str | None = None) -> str | None:
    """``<key>: <path>: <what went wrong and what to do>`` for a file system error a user can fix;
    ``key``: the setting that chose ``path`` (else found with ``setting_of``)."""
    advice = _FILE_SYSTEM.get(code)
    if advice is None or not path:
        return None
    key = key or setting_of(path, cfg)
    return f"{key}: {path}: {advice.format(key=key, use='read' if key == 'dataset.root' else 'write to')}"


def diverged_message(text: str, cfg: Mapping | None = None) -> str | None:
    """For a run stopped because a round's updates were all NaN or infinite (rejected), a line
    naming the round and the algorithm's step sizes to lower; None for any other failure."""
    if not _REJECTED.search(text):
        return None
    found = _GLOBAL_ROUND.search(text)
    where = f"global round {found[1]}" if found else "a round"
    alg = (cfg or {}).get("algorithm") or {}
    rates = [f"algorithm.{k}={v:g}" for k, v in _numbers(alg) if k.split(".")[-1] in RATE_KEYS or k.endswith("lr")]
    shown = f" ({', '.join(rates)})" if rates else ""
    return (f"{where}: training diverged: the updates were NaN or infinite and were rejected, so no model could be "
            f"aggregated; lower the learning rates{shown}")


def _numbers(tree: Mapping, prefix: str = "") -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.extend(_numbers(value, f"{prefix}{key}."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out.append((f"{prefix}{key}", value))
    return out


def user_error(exc: BaseException, cfg: Mapping | None = None, run_dir: str | Path | None = None,
               key: str | None = None) -> str | None:
    """One line (no program name) for an error the user can fix: a bad setting (ConfigError,
    DatasetNotFoundError), a file system error (a full disk, a read-only or file-as-directory
    path), a diverged run; None for anything else, which is a bug and keeps its traceback.
    ``cfg``: the run's config, to name the key that chose a path; ``run_dir``: the path named
    when the error does not say (a node's failure reaches the root as text, without it); ``key``:
    the option that chose a path (hfl-deploy's ``--out``), instead of the setting found from ``cfg``."""
    chain = _chain(exc)
    for error in chain:
        if isinstance(error, ConfigError | DatasetNotFoundError):
            return one_line(str(error))
    for error in chain:
        if isinstance(error, OSError) and error.errno is not None:
            message = file_system_message(error.errno, str(error.filename or run_dir or ""), cfg, key)
            if message is not None:
                return message
    text = " ".join(str(error) for error in chain)
    for code, path, bare in _ERRNO_TEXT.findall(text):
        message = file_system_message(int(code or bare), path or str(run_dir or ""), cfg)
        if message is not None:
            return message
    return diverged_message(text, cfg)


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` comes of a full disk (or quota): the run it stopped can be resumed."""
    chain = _chain(exc)
    codes = {error.errno for error in chain if isinstance(error, OSError)}
    codes |= {int(code or bare) for code, _, bare in _ERRNO_TEXT.findall(" ".join(map(str, chain)))}
    return bool(codes & {errno.ENOSPC, errno.EDQUOT})
