"""Errors hfl raises for bad input, and how a round's failures are named in error messages."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """An invalid configuration value; the message starts with the offending key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


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
