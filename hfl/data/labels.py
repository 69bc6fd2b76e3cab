"""The classes each device owns, and with ``algorithm.local_labels`` its labels as local class
indices (PFLEGO's setting): what sizes a model's output layer."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hfl.data.federation import DeviceData, Federation
from hfl.errors import ConfigError


def device_classes(fed: Federation, device_id: int) -> list[int]:
    """The classes a device owns: those it was dealt (class partitions), else those in its data."""
    if fed.device_classes is not None:
        return sorted(fed.device_classes[device_id])
    data = fed.devices[device_id]
    return sorted(set(data.y_train.tolist()) | set(data.y_val.tolist()) | set(data.y_test.tolist()))


_CLASS_COUNTS: dict[int, tuple[Federation, frozenset[int]]] = {}


def class_counts(fed: Federation) -> frozenset[int]:
    """How many classes the devices own (the distinct K_i), counted once per federation: every
    message's lowest node builds its model with it. From the classes dealt where the partition
    deals them; else each device's data is read, which a lazy federation makes device by device
    (once per process: local labels on generated natural data walk every device at start-up)."""
    kept = _CLASS_COUNTS.get(id(fed))
    if kept is None or kept[0] is not fed:
        if fed.device_classes is not None:
            counts = frozenset(len(c) for c in fed.device_classes)
        else:
            counts = frozenset(len(device_classes(fed, d)) for d in range(len(fed.devices)))
        if len(_CLASS_COUNTS) > 4:  # the federations this process built lately (federation_for keeps 2)
            _CLASS_COUNTS.clear()
        kept = _CLASS_COUNTS[id(fed)] = (fed, counts)
    return kept[1]


def model_classes(local_labels: bool, fed: Federation, personal_heads: bool = False) -> int:
    """The model's output size: the dataset's classes, or with ``algorithm.local_labels`` the
    number K_i of classes each device owns (labels become local indices 0..K_i-1, PFLEGO's
    setting). A head shared by the servers needs one K for every device; an algorithm whose
    heads stay on the devices (``personal_heads``: its rule's ``ServerRule.personal_heads``) builds
    each with its own K_i."""
    if not local_labels:
        return fed.num_classes
    counts = class_counts(fed)
    if len(counts) > 1 and not personal_heads:
        raise ConfigError("algorithm.local_labels", f"devices own different numbers of classes ({sorted(counts)}), so a "
                                                    "shared K-way head has no common K; use dataset.partition="
                                                    "roundrobin (every device gets classes_per_device classes)")
    return max(counts)


def device_data(cfg: Mapping, fed: Federation, device_id: int) -> DeviceData:
    """A device's data; with ``algorithm.local_labels`` its labels are local class indices."""
    data = fed.devices[device_id]
    if not cfg["algorithm"]["local_labels"]:
        return data
    classes = torch.tensor(device_classes(fed, device_id))
    local = {}
    for split in ("y_train", "y_val", "y_test"):
        y = getattr(data, split)
        idx = torch.searchsorted(classes, y)
        if len(y) and (idx.max() >= len(classes) or not torch.equal(classes[idx], y)):
            raise ValueError(f"device {device_id} holds labels outside its classes {classes.tolist()}")
        local[split] = idx
    return DeviceData(device_id, data.x_train, local["y_train"], data.x_test, local["y_test"],
                      x_val=data.x_val, y_val=local["y_val"])
