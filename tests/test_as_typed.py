"""Every algorithm runs as typed (issue 32, item 6): ``hfl-simulate algorithm=<name>`` with no
other override composes a config that passes every check before training, because an algorithm
declares what it needs in its defaults list and the default composition provides it (FeMAM/FeSEM:
a validation split, conf/algorithm/needs/validation_split.yaml merged into ``dataset``; PFLEGO: a
body/head model, ``override /model@_global_.model: mlp``). A choice the user or a preset makes
still wins, and a mismatch it forces stops naming the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hfl.config.compose import CONF_DIR
from hfl.config.checks import validate
from hfl.errors import ConfigError
from hfl.runtime.build import check_tree, federation_for
from tests.conftest import compose_cfg

ALGORITHMS = sorted(p.stem for p in (Path(CONF_DIR) / "algorithm").glob("*.yaml"))
DATASETS = sorted(p.stem for p in (Path(CONF_DIR) / "dataset").glob("*.yaml"))


def checked(*overrides: str) -> dict:
    """The composed config after every check hfl-simulate makes before training."""
    cfg = compose_cfg(*overrides)
    validate(cfg)
    check_tree(cfg, federation_for(cfg).tree)
    return cfg


def test_all_algorithms_are_listed():
    assert len(ALGORITHMS) >= 20 and {"femam", "fesem", "pflego", "permfl"} <= set(ALGORITHMS)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_passes_the_checks_as_typed(name):
    cfg = checked(f"algorithm={name}")
    assert cfg["algorithm"]["name"] == name


def test_what_the_algorithms_declare_reaches_the_composed_config():
    for name in ("femam", "fesem"):
        cfg = compose_cfg(f"algorithm={name}")
        assert cfg["dataset"]["val_fraction"] == 0.1
        assert cfg["model"]["name"] == "mclr"
    cfg = compose_cfg("algorithm=pflego")
    assert cfg["model"] == {"name": "mlp", "hidden": 200} and cfg["dataset"]["val_fraction"] == 0.0
    # The others keep the plain defaults: no validation split, MCLR.
    for name in set(ALGORITHMS) - {"femam", "fesem", "pflego"}:
        cfg = compose_cfg(f"algorithm={name}")
        assert cfg["dataset"]["val_fraction"] == 0.0 and cfg["model"] == {"name": "mclr"}, name
    for dataset in DATASETS:  # every dataset takes the algorithm's split, and 0 without one
        assert compose_cfg("algorithm=femam", f"dataset={dataset}")["dataset"]["val_fraction"] == 0.1
        assert compose_cfg(f"dataset={dataset}")["dataset"]["val_fraction"] == 0.0


@pytest.mark.parametrize("overrides,key,value", [
    (["algorithm=femam", "dataset.val_fraction=0.25"], "dataset.val_fraction", 0.25),
    (["dataset.val_fraction=0.25", "algorithm=fesem"], "dataset.val_fraction", 0.25),
    (["experiment=table1_synthetic_mclr", "algorithm=femam", "dataset.val_fraction=0.3"], "dataset.val_fraction", 0.3),
    (["algorithm=pflego", "model=conv4"], "model.name", "conv4"),
    (["model=pflego_cnn", "algorithm=pflego"], "model.name", "pflego_cnn"),
    (["algorithm=pflego", "model=mlp", "model.hidden=8"], "model.hidden", 8),
    # A preset's model (its `override /model`) wins over the algorithm's too.
    (["experiment=table1_synthetic_dnn", "algorithm=pflego"], "model.name", "dnn"),
    (["algorithm=pflego", "experiment=table1_mnist_cnn"], "model.name", "cnn"),
    (["algorithm=pflego", "experiment=table1_mnist_cnn", "model=mlp"], "model.name", "mlp"),
])
def test_an_explicit_choice_wins_over_the_algorithms(overrides, key, value):
    cfg = compose_cfg(*overrides)
    group, name = key.split(".")
    assert cfg[group][name] == value


@pytest.mark.parametrize("overrides,key", [
    (["algorithm=femam", "dataset.val_fraction=0"], "dataset.val_fraction"),
    (["algorithm=fesem", "dataset.val_fraction=0.0"], "dataset.val_fraction"),
    (["algorithm=femam", "dataset=synthetic_multilevel", "dataset.val_fraction=0"], "dataset.val_fraction"),
    (["algorithm=femam", "experiment=table1_synthetic_mclr", "dataset.val_fraction=0"], "dataset.val_fraction"),
    (["algorithm=pflego", "model=mclr"], "model.name"),
    (["algorithm=pflego", "experiment=table1_synthetic_dnn"], "model.name"),
])
def test_a_forced_mismatch_stops_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as caught:
        checked(*overrides)
    assert caught.value.key == key


def test_the_command_names_the_key_of_a_forced_mismatch(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hfl.runtime.simulate", "algorithm=pflego", "model=mclr", "runtime=inprocess",
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("hfl-simulate: model.name: PFLEGO needs a body")


@pytest.mark.parametrize("name", ["femam", "pflego"])
def test_a_tiny_run_as_typed(tmp_path, name):
    from hfl.runtime.simulate import run

    cfg = compose_cfg(f"algorithm={name}", "runtime=inprocess", "runtime.torch_threads=1", "global_rounds=1",
                      "topology.num_teams=2", "topology.devices_per_team=3", "dataset.max_samples=120",
                      "algorithm.local_steps=2", *(["algorithm.local_epochs=1"] if name == "femam" else []),
                      *(["model.hidden=8"] if name == "pflego" else []))
    run(cfg, tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["round"] == 1 and lines[0]["pm_accuracy"] is not None
