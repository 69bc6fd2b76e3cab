"""Node-local, file-backed state keyed by name (device ids, team ids).

Flower ships ``context.state`` to the simulation actor and back on every message, and Ray
actors do not stick to nodes, so per-device models live here instead (DESIGN.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


class StateStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.npz"

    def load(self, key: str) -> dict[str, np.ndarray] | None:
        path = self._path(key)
        if not path.exists():
            return None
        with np.load(path) as data:
            return {name: data[name] for name in data.files}

    def save(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        # Write then rename so that a crash never leaves a half-written state behind.
        tmp = self.root / f".{key}.{os.getpid()}.tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, self._path(key))
