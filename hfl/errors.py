"""Errors hfl raises for bad input."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration value; the message starts with the offending key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class DatasetNotFoundError(FileNotFoundError):
    """A dataset that is neither on disk nor allowed to be downloaded."""
