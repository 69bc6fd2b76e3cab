"""A Hugging Face dataset on hfl's other runtimes: writers as devices and groups as teams (the
natural tree of tests/test_hf_datasets.py) trained on Flower's Simulation Runtime (Ray) end as the
in-process run ends; a run killed mid-way and resumed ends as the uninterrupted one; a deployed
device builds its own partition only.

The dataset is the one tests/test_hf_datasets.py saves (MNIST test split with a synthetic writer
and group column, save_to_disk)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
pytest.importorskip("flwr_datasets")

from hfl.runtime.simulate import run  # noqa: E402
from tests.conftest import compose_cfg  # noqa: E402
from tests.test_hf_datasets import FAST, GROUPS, WRITERS, digits, natural, saved  # noqa: E402, F401 - fixtures
from tests.test_resume import assert_same_run  # noqa: E402

ALGORITHMS = {"permfl": [], "bhfl": ["algorithm=bhfl", "algorithm.team_rounds=1"]}


def _overrides(path: Path, *extra: str) -> list[str]:
    """The natural tree as hfl-simulate overrides (what tests/test_hf_datasets.natural composes)."""
    return ["dataset=huggingface", f"dataset.path={path}", "dataset.partitioner.name=NaturalIdPartitioner",
            "dataset.columns.natural_id=writer", "dataset.columns.group=group", "topology=sequential",
            f"topology.num_teams={GROUPS}", "topology.devices_per_team=null", *FAST, *extra]


# ---------------------------------------------------------------- Flower's Simulation Runtime (Ray)
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_a_natural_tree_on_ray_equals_the_inprocess_run(saved, tmp_path, algorithm):
    """Each team node in its Ray actor loads the dataset and makes its writers' devices; the
    models, every node's and device's stored state and every metrics row equal the in-process
    run's, bit for bit."""
    cfg = natural(saved, *FAST, *ALGORITHMS[algorithm], "runtime.batched=off")
    ray = run({**cfg, "runtime": compose_cfg("runtime=simulation", "runtime.torch_threads=1",
                                             "runtime.batched=off")["runtime"]}, tmp_path / "ray")
    inprocess = run(cfg, tmp_path / "inprocess")
    assert ray["failures"] == 0 and ray["rounds"] == 2
    assert_same_run(tmp_path / "ray", tmp_path / "inprocess")
    states = sorted(p.stem for p in (tmp_path / "ray" / "state").glob("[!.]*.npz"))
    assert len(states) > GROUPS  # the teams' devices' state was stored, and compared


# ---------------------------------------------------------------- hfl-simulate SIGKILLed mid-run and resumed
@pytest.mark.parametrize(("algorithm", "runtime"), [
    ("bhfl", "inprocess"), pytest.param("permfl", "simulation", marks=pytest.mark.slow)])  # Ray: 51 s, two starts
def test_hfl_simulate_killed_and_resumed_equals_the_uninterrupted_run(saved, tmp_path, algorithm, runtime):
    """hfl-simulate on the natural tree, 8 global rounds, SIGKILLed (its whole process group: Ray's
    too) once a round is recorded and a node has stored a later one, then run again with
    resume=true: bit for bit the uninterrupted in-process run."""
    from tests.test_resume import _killed_and_resumed

    overrides = _overrides(saved, *ALGORITHMS[algorithm], "global_rounds=8", "eval_every=2", "runtime.batched=off")
    run_dir = _killed_and_resumed(tmp_path, [*overrides, f"runtime={runtime}", "runtime.torch_threads=1",
                                             "runtime.batched=off"])
    run(compose_cfg(*overrides), tmp_path / "whole")
    assert_same_run(run_dir, tmp_path / "whole")
    assert np.isfinite(json.loads((run_dir / "summary.json").read_text())["final"]["gm_accuracy"])


# ---------------------------------------------------------------- a deployed device's own partition
def test_a_deployed_device_makes_its_own_partition_only(saved, tmp_path):
    """A device SuperNode's ClientApp (hfl.deploy.device.partition) loads the pool and runs the
    partitioner, but makes the tensors of its own writer alone; they equal that device's data in
    the in-process federation, and the next message reads them from its state folder."""
    from hfl.deploy.device import partition
    from hfl.runtime import build

    cfg = natural(saved, *FAST, "seed=11")
    build._federation.cache_clear()  # noqa: SLF001 - a process of its own, as a device host is
    data, num_classes, input_shape, _ = partition(cfg, 5, tmp_path)
    fed = build.federation_for(cfg)
    assert fed.devices.made == 1 and len(fed.devices) == WRITERS  # writer 5's device, of 12
    assert (num_classes, input_shape) == (10, (1, 28, 28))
    build._federation.cache_clear()  # noqa: SLF001
    again, *_ = partition(cfg, 5, tmp_path)  # from tmp_path/partition-5.npz: no federation built
    assert build._federation.cache_info().currsize == 0  # noqa: SLF001
    whole = build.build_federation(cfg["dataset"], cfg["topology"], cfg["seed"])
    for got in (data, again):
        for split in ("x_train", "y_train", "x_test", "y_test"):
            np.testing.assert_array_equal(getattr(got, split).numpy(), getattr(whole.devices[5], split).numpy())
