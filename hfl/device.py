"""What a device holds between messages: its data, sampler and personalized model."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hfl.data.federation import validation_or_empty
from hfl.store import StateStore
from hfl.training import BatchSampler, LocalTrainer, Params


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

    def load(self, store: StateStore) -> None:
        state = store.load(self.key)
        if state is None:
            return
        self.sampler.restore({k[len("sampler_"):]: v for k, v in state.items() if k.startswith("sampler_")})
        count = int(state["num_personal"])
        self.personal = [torch.from_numpy(state[f"personal_{i}"]) for i in range(count)] if count else None
        self.extra = {k[len("extra_"):]: v for k, v in state.items() if k.startswith("extra_")}

    def save(self, store: StateStore) -> None:
        arrays = {f"sampler_{k}": v for k, v in self.sampler.state().items()}
        personal = self.personal or []
        arrays["num_personal"] = np.array(len(personal))
        arrays.update({f"personal_{i}": p.numpy() for i, p in enumerate(personal)})
        arrays.update({f"extra_{k}": v for k, v in self.extra.items()})
        store.save(self.key, arrays)
