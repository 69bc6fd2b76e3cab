"""What a device holds between messages: its data, sampler and personalized model."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hfl.data.federation import validation_or_empty
from hfl.state.store import StateStore
from hfl.device.training import BatchSampler, LocalTrainer, Params


@dataclass
class DeviceRuntime:
    device_id: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    trainer: LocalTrainer
    sampler: BatchSampler
    personal: Params | None = None  # the model the device keeps (PerMFL's theta)
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # other kept state, e.g. node-optimiser moments
    seed: int = 0  # the run's seed (for state a device creates itself, e.g. a personal head)
    classes: list[int] | None = None  # the classes it owns; with local labels, y indexes this list
    # Validation split (dataset.val_fraction); None -> empty, shaped (0, *input_shape) like x_train.
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.x_val, self.y_val = validation_or_empty(self.x_train, self.y_train, self.x_val, self.y_val)

    @property
    def key(self) -> str:
        return f"device-{self.device_id}"

    def restore(self, state: dict[str, np.ndarray]) -> None:
        """Take up the state ``state()`` gave."""
        self.sampler.restore({k[len("sampler_"):]: v for k, v in state.items() if k.startswith("sampler_")})
        count = int(state["num_personal"])
        self.personal = [torch.from_numpy(state[f"personal_{i}"]) for i in range(count)] if count else None
        self.extra = {k[len("extra_"):]: v for k, v in state.items() if k.startswith("extra_")}

    def state(self) -> dict[str, np.ndarray]:
        """What it keeps between messages: sampler position, personal model, extra state."""
        arrays = {f"sampler_{k}": v for k, v in self.sampler.state().items()}
        personal = self.personal or []
        arrays["num_personal"] = np.array(len(personal))
        arrays.update({f"personal_{i}": p.detach().cpu().numpy() for i, p in enumerate(personal)})
        arrays.update({f"extra_{k}": v for k, v in self.extra.items()})
        return arrays

    def load(self, store: StateStore) -> None:
        state = store.load(self.key)
        if state is not None:
            self.restore(state)

    def save(self, store: StateStore) -> None:
        store.save(self.key, self.state())


# ------------------------------------------------------------------ a node's devices in one file
# One file per lowest node instead of one per device: 700 small .npz files cost ~1.6 s a call
# (zip and header overhead per array), their packed arrays a few ms. Each field is flattened and
# concatenated over the devices, with a table of each device's shape (first column: present).
def pack_states(states: dict[int, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Devices' ``state()`` dicts (by device id) as a few arrays."""
    ids = sorted(states)
    names = sorted(set().union(*(states[i].keys() for i in ids))) if ids else []
    packed = {"ids": np.array(ids, dtype=np.int64), "names": np.array(names, dtype=str)}
    for j, name in enumerate(names):
        arrays = [states[i].get(name) for i in ids]
        given = [a for a in arrays if a is not None]
        ndim = given[0].ndim
        if any(a.ndim != ndim or a.dtype != given[0].dtype for a in given):
            raise ValueError(f"device state {name!r} differs in rank or dtype between devices")
        table = np.zeros((len(ids), 1 + ndim), dtype=np.int64)
        for d, a in enumerate(arrays):
            if a is not None:
                table[d, 0], table[d, 1:] = 1, a.shape
        packed[f"shape_{j}"] = table
        packed[f"data_{j}"] = np.concatenate([a.reshape(-1) for a in given]) if given else np.zeros(0)
    return packed


def unpack_states(packed: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
    """``pack_states``'s inverse: each device's arrays are views into the packed data."""
    ids = packed["ids"].tolist()
    states: dict[int, dict[str, np.ndarray]] = {i: {} for i in ids}
    for j, name in enumerate(str(n) for n in packed["names"]):
        table, data = packed[f"shape_{j}"], packed[f"data_{j}"]
        present = table[:, 0].astype(bool)
        shapes = table[present, 1:]
        holders = [i for i, p in zip(ids, present.tolist(), strict=True) if p]
        if shapes.shape[1] and len(shapes) and (shapes == shapes[0]).all():  # one shape (models): one reshape
            parts = list(data.reshape(len(shapes), *shapes[0].tolist()))
        else:  # ragged (a sampler's permutation) or scalars
            ends = np.cumsum(shapes.prod(axis=1))
            parts = [chunk.reshape(shape) for chunk, shape in
                     zip(np.split(data, ends[:-1]), map(tuple, shapes.tolist()), strict=True)] if len(shapes) else []
        for i, part in zip(holders, parts, strict=True):
            states[i][name] = part
    return states


def has_state(device: DeviceRuntime) -> bool:
    """Whether it holds anything a fresh device does not (it drew a batch, keeps a model or more);
    a lowest node stores only such devices (hfl.runtime.build.NodeDevices.save), so a node of 1,000 devices
    sampled at 1 % stays small."""
    return len(device.sampler.perm) > 0 or device.personal is not None or bool(device.extra)


DEVICES_PREFIX = "devices-"  # hfl.runtime.build.devices_key: "devices-<lowest node's path>"


def stored_device_states(store: StateStore) -> dict[int, dict[str, np.ndarray]]:
    """Every device state the lowest nodes saved in ``store``, by device id (tests, inspection)."""
    states: dict[int, dict[str, np.ndarray]] = {}
    for path in sorted(store.root.glob(f"{DEVICES_PREFIX}*.npz")):
        packed = store.load(path.stem)
        if packed is not None:
            states.update(unpack_states(packed))
    return states

