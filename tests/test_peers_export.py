"""The peer benchmark's export (benchmarks/peers/peers_export.py): every framework must train on the
devices hfl trains on, from hfl's initial model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))
import peers_common as common  # noqa: E402 - benchmarks/peers/ is no package
import peers_export as export  # noqa: E402
import peers_workload as workload  # noqa: E402

SMALL = ["topology.devices_per_team=6"]  # 12 devices: the workload's settings, a small federation


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    out = tmp_path_factory.mktemp("peers") / "workload.npz"
    sizes = export.export(out, SMALL)
    cfg = export.hfl_config([*workload.hfl_overrides(workload.ROUNDS), *SMALL])
    return out, sizes, cfg


def test_devices_are_hfls_devices(exported: tuple[Path, dict, dict]) -> None:
    from hfl.data import build_federation

    out, sizes, cfg = exported
    fed = build_federation(cfg["dataset"], cfg["topology"], int(cfg["seed"]))
    read = common.Federation(out)
    assert read.devices == len(fed.devices) == sizes["devices"] == 12
    for d in range(read.devices):
        for split in ("train", "test"):
            x, y = read.device(d, split)
            assert torch.equal(x, getattr(fed.devices[d], f"x_{split}"))
            assert torch.equal(y, getattr(fed.devices[d], f"y_{split}"))
    assert sizes["train_samples"] == sum(len(fed.devices[d].y_train) for d in range(12))
    x, y = read.union("test")
    assert len(y) == sizes["test_samples"] == sum(len(fed.devices[d].y_test) for d in range(12))


def test_initial_model_and_workload(exported: tuple[Path, dict, dict]) -> None:
    from hfl.data import build_federation
    from hfl.runtime.build import initial_model

    out, _, cfg = exported
    read = common.Federation(out)
    expected = initial_model(cfg, build_federation(cfg["dataset"], cfg["topology"], int(cfg["seed"])))
    assert all(np.array_equal(a, b) for a, b in zip(read.init, expected))
    assert read.meta["local_steps"] == workload.LOCAL_STEPS
    assert read.meta["batch_size"] == workload.BATCH_SIZE
    assert read.meta["learning_rate"] == pytest.approx(workload.LEARNING_RATE)
    assert read.meta["seed"] == workload.SEED
    # The same MCLR: the peers' module with hfl's initial weights gives hfl's model's outputs.
    model = read.build_model()
    x, _ = read.device(0, "test")
    from hfl.models import build_model

    hfl_model = build_model(cfg["model"], read.input_shape, read.num_classes)
    hfl_model.load_state_dict({"fc.weight": torch.from_numpy(read.init[0]), "fc.bias": torch.from_numpy(read.init[1])})
    assert torch.allclose(model(x), hfl_model(x))


def test_epoch_batches_cover_each_epoch() -> None:
    generator = torch.Generator().manual_seed(0)
    batches = list(common.epoch_batches(25, 10, 7, generator))
    assert [len(b) for b in batches] == [10, 10, 5, 10, 10, 5, 10]
    assert sorted(torch.cat(batches[:3]).tolist()) == list(range(25))  # an epoch is a permutation


@pytest.mark.skipif(not (workload.REPO_DATA / "MNIST" / "raw").is_dir(), reason="shared MNIST test split absent")
def test_mnist_cnn_workload_exports_hfls_devices_and_cnn(tmp_path: Path) -> None:
    """The GPU comparison's workload: MNIST images kept in their shape, and the peers' model is
    hfl's CNN holding hfl's initial weights (the same outputs as hfl's model)."""
    from hfl.data import build_federation
    from hfl.models import build_model
    from hfl.runtime.build import initial_model

    small = ["topology.devices_per_team=5"]
    sizes = export.export(tmp_path / "cnn.npz", small, name="mnist_cnn")
    cfg = export.hfl_config([*workload.hfl_overrides(workload.ROUNDS, "mnist_cnn"), *small])
    fed = build_federation(cfg["dataset"], cfg["topology"], int(cfg["seed"]))
    read = common.Federation(tmp_path / "cnn.npz")
    assert sizes["model"] == read.model == "cnn" and read.input_shape == (1, 28, 28) == fed.input_shape
    assert read.devices == 10 and sizes["per_round"] == 2  # sample_fraction 0.2 of the devices
    for d in range(read.devices):
        for split in ("train", "test"):
            x, y = read.device(d, split)
            assert torch.equal(x, getattr(fed.devices[d], f"x_{split}")) and torch.equal(y, getattr(fed.devices[d], f"y_{split}"))
    model = read.build_model()
    expected = initial_model(cfg, fed)
    assert len(read.init) == len(expected) == len(list(model.parameters())) == 8
    hfl_model = build_model(cfg["model"], fed.input_shape, fed.num_classes)
    with torch.no_grad():
        for p, value in zip(hfl_model.parameters(), expected, strict=True):
            p.copy_(torch.from_numpy(value))
    x, _ = read.device(0, "test")
    assert type(model) is type(hfl_model) and torch.equal(model(x), hfl_model(x))
