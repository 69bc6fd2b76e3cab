"""What a team bridge and the team run it starts exchange on the team host.

The bridge (a SuperNode of the global SuperLink) writes a job file and the parent model;
the team ServerApp, which its SuperLink starts as a subprocess on the same host, reads
them and writes the result the bridge reads back. Run configs carry only the job's path.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common import NDArrays

from hfl.state.store import atomic_savez, atomic_write_bytes

ACTIONS = ("fit", "evaluate")


@dataclass(frozen=True)
class TeamJob:
    action: str                  # "fit": K team rounds; "evaluate": GM/team/PM on the devices
    team_id: int
    global_round: int
    parent: str                  # npz: the parent (global) model
    result: str                  # json written by the team run; a fit's model goes next to it
    device_ids: list[int] | None  # the team's devices per the topology; None = any device
    num_devices: int             # how many device SuperNodes the team run waits for
    device_wait_seconds: float
    team_model: str | None = None  # npz: the last team model (evaluate)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"team job: action must be one of {ACTIONS}, got {self.action!r}")
        if self.num_devices < 1:
            raise ValueError(f"team job: num_devices must be >= 1, got {self.num_devices}")
        if self.device_ids is not None and len(self.device_ids) != self.num_devices:
            raise ValueError(f"team job: {len(self.device_ids)} device ids for {self.num_devices} devices")

    @property
    def model_path(self) -> Path:
        return Path(self.result).with_suffix(".npz")

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, asdict(self))

    @classmethod
    def load(cls, path: str | os.PathLike) -> TeamJob:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"team job {path}: unreadable ({exc})") from exc


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write then rename: the bridge polls for the file and must never read half of it."""
    atomic_write_bytes(path, json.dumps(data, indent=1).encode())


def save_arrays(path: str | os.PathLike, arrays: NDArrays) -> None:
    atomic_savez(path, *arrays)


def load_arrays(path: str | os.PathLike) -> NDArrays:
    with np.load(path) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]
