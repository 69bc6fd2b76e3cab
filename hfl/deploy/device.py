"""The device tier of a deployment: the algorithm's device NumPyClient on a SuperNode of
its team SuperLink, its data chosen by the node config, its state kept on the device host.

Node config (``flower-supernode --node-config``):
  role="device"   device-id=N         the device's index in the federation the Hydra config
                                       describes (its partition), or
  data-path="/data/dev.npz"           its own data: x_train, y_train, x_test, y_test, num_classes
                                       (device-id then only names it);
  state-dir="/var/lib/hfl"            where its personalized model and minibatch position live
                                       between messages (default: ~/.cache/hfl/device-state).
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import NDArrays, Scalar

from hfl.device.client import DeviceClient
from hfl.config.checks import load_module, load_server
from hfl.data import DeviceData
from hfl.models import build_model
from hfl.data.labels import device_classes, device_data, model_classes
from hfl.device.allocator import keep_freed_memory
from hfl.runtime.build import device_runtime, federation_for
from hfl.deploy.datafile import check_data_file
from hfl.deploy.private import private_dir, write_private
from hfl.output.paths import confined_name
from hfl.errors import ConfigError
from hfl.deploy.roles import DEFAULT_STATE_DIR
from hfl.state.store import StateStore, atomic_savez
from hfl.device.training import LocalTrainer



REPLY = "reply_"  # the last fit's reply, kept beside the device's state (hfl.device.state ignores it)


def pack_reply(round_path: str, arrays: NDArrays, n: int, metrics: dict[str, Scalar]) -> dict[str, np.ndarray]:
    out = {f"{REPLY}round": np.array(round_path), f"{REPLY}n": np.array(n), f"{REPLY}count": np.array(len(arrays)),
           f"{REPLY}metrics": np.array(json.dumps(metrics))}
    out.update({f"{REPLY}{i}": np.asarray(a) for i, a in enumerate(arrays)})
    return out


def unpack_reply(stored: dict[str, np.ndarray]) -> tuple[NDArrays, int, dict[str, Scalar]]:
    arrays = [stored[f"{REPLY}{i}"] for i in range(int(stored[f"{REPLY}count"]))]
    return arrays, int(stored[f"{REPLY}n"]), json.loads(str(stored[f"{REPLY}metrics"]))


class DeployedDevice(NumPyClient):
    """The algorithm's device client on its own host: it says which device it is (its node server
    asks once) and saves its state after every fit, in its own state directory, with its reply."""

    def __init__(self, inner: DeviceClient, store: StateStore) -> None:
        self.inner = inner
        self.store = store

    def get_properties(self, config: dict[str, Scalar]) -> dict[str, Scalar]:
        return {"device_id": self.inner.device.device_id}

    def get_parameters(self, config: dict[str, Scalar]) -> NDArrays:
        return self.inner.get_parameters(config)

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        """The algorithm's fit, its state and its reply saved together (one file, replaced at once):
        a node that asks again for the same round (``round_path``; its node server was restarted
        mid-round) gets the same reply, and the device does not train twice."""
        device = self.inner.device
        asked = str(config.get("round_path", ""))
        if asked:
            stored = self.store.load(device.key)
            if stored is not None and str(stored.get(f"{REPLY}round", "")) == asked:
                return unpack_reply(stored)
        arrays, n, metrics = self.inner.fit(parameters, config)
        state = device.state()
        if asked:
            state.update(pack_reply(asked, arrays, n, metrics))
        self.store.save(device.key, state)
        return arrays, n, metrics

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        """One model (the config says which), or with ``targets`` (hfl.deploy.grid.evaluate_targets_together)
        several in one message: per target i its ``t{i}_loss``, ``t{i}_n`` and ``t{i}_correct``."""
        if "targets" not in config:
            return self.inner.evaluate(parameters, config)
        layout = json.loads(str(config["targets"]))
        if not layout or sum(count for count, _ in layout) != len(parameters):
            raise ValueError(f"evaluation targets {config['targets']} do not match the {len(parameters)} arrays sent")
        metrics: dict[str, Scalar] = {"device_id": self.inner.device.device_id}
        offset, first = 0, None
        for i, (count, target_config) in enumerate(layout):
            loss, n, reply = self.inner.evaluate(parameters[offset:offset + count], target_config)
            offset += count
            metrics.update({f"t{i}_loss": loss, f"t{i}_n": n, f"t{i}_correct": reply["correct"]})
            first = first or (loss, n)
        return first[0], first[1], metrics


def load_device_data(path: str | Path, device_id: int) -> tuple[DeviceData, int]:
    """A device's own data file (npz: x_train, y_train, x_test, y_test, num_classes), checked
    (hfl.deploy.datafile)."""
    check_data_file(path)
    with np.load(path) as f:
        arrays = {k: torch.from_numpy(np.ascontiguousarray(f[k])) for k in ("x_train", "y_train", "x_test", "y_test")}
        num_classes = int(f["num_classes"])
    data = DeviceData(device_id, arrays["x_train"].float(), arrays["y_train"].long(),
                      arrays["x_test"].float(), arrays["y_test"].long())
    return data, num_classes


def export_device_data(cfg: Mapping, device_id: int, path: str | Path) -> None:
    """Write one partition of the configured federation as a device data file, readable by its
    owner alone (a device's data is private; a symlink at ``path`` is replaced, not followed)."""
    fed = federation_for(cfg)
    if not 0 <= device_id < len(fed.devices):  # -1 would be the last device: a silent wrong file
        raise ConfigError("--device-id", f"{device_id} is no device of the federation: valid ids are "
                                         f"0..{len(fed.devices) - 1}")
    d = fed.devices[device_id]
    buffer = io.BytesIO()
    np.savez(buffer, x_train=d.x_train.numpy(), y_train=d.y_train.numpy(), x_test=d.x_test.numpy(),
             y_test=d.y_test.numpy(), num_classes=np.array(fed.num_classes))
    write_private(path, buffer.getvalue(), replace=True)


def partition(cfg: Mapping, device_id: int, folder: Path) -> tuple[DeviceData, int, tuple, list[int] | None]:
    """The device's partition of the configured federation as a node builds it in simulation
    (hfl.runtime.build.build_node: local labels too), its model's output size, input shape and
    classes. Kept in ``folder`` after the first message: Flower starts a process per message, and
    building the federation each time would cost more than the message's work."""
    path = folder / f"partition-{device_id}.npz"
    try:
        with np.load(path) as f:
            tensors = {k: torch.from_numpy(f[k]) for k in ("x_train", "y_train", "x_test", "y_test", "x_val", "y_val")}
            classes = [int(c) for c in f["classes"]] if bool(f["has_classes"]) else None
            return (DeviceData(device_id, **tensors), int(f["num_classes"]), tuple(int(d) for d in f["input_shape"]),
                    classes)
    except (OSError, KeyError, ValueError):
        pass  # none yet, or unreadable: built again
    fed = federation_for(cfg)
    if not 0 <= device_id < len(fed.devices):
        raise ValueError(f"device-id {device_id} does not exist: the federation has {len(fed.devices)} devices")
    data, num_classes = device_data(cfg, fed, device_id), model_classes(cfg["algorithm"]["local_labels"], fed, load_server(cfg["algorithm"]).personal_heads)
    classes = device_classes(fed, device_id) if cfg["algorithm"]["local_labels"] else None
    private_dir(folder)
    atomic_savez(path, **{k: getattr(data, k).numpy() for k in ("x_train", "y_train", "x_test", "y_test", "x_val", "y_val")},
                 num_classes=np.array(num_classes), input_shape=np.array(fed.input_shape),
                 classes=np.array(classes or [], dtype=np.int64), has_classes=np.array(classes is not None))
    return data, num_classes, tuple(fed.input_shape), classes


def device_client(cfg: Mapping, node_config: Mapping[str, Scalar], state_key: str) -> DeployedDevice:
    keep_freed_memory()
    torch.set_num_threads(int(cfg["runtime"]["torch_threads"]))
    if "device-id" not in node_config:
        raise ValueError('a device SuperNode needs device-id in its node config (--node-config "role=\'device\' device-id=N")')
    device_id = int(node_config["device-id"])
    state_folder = Path(str(node_config.get("state-dir") or DEFAULT_STATE_DIR)) / confined_name("state-key", state_key)
    if node_config.get("data-path"):
        data, num_classes = load_device_data(str(node_config["data-path"]), device_id)
        input_shape = tuple(data.x_train.shape[1:])
        classes = None
    else:
        data, num_classes, input_shape, classes = partition(cfg, device_id, state_folder)
    trainer = LocalTrainer(build_model(cfg["model"], input_shape, num_classes))
    store = StateStore(state_folder)
    device = device_runtime(cfg, device_id, data, trainer, store, classes)
    return DeployedDevice(load_module(cfg["algorithm"], "client").make_client(device), store)
