"""A Hugging Face dataset on a real deployment (issue 51): writers as devices and groups as level-1
nodes, every host a process of its own (tests/test_deployment.py's harness), each device SuperNode
building its own writer's partition from the dataset folder; the run ends as the in-process run.

A dataset folder a host cannot reach (a relative dataset.path, which resolves against each host's
working directory) stops the run with one line naming dataset.path and where the host looked.

Minutes: marked deployment and slow, so ``make test-deploy`` runs them, not ``make test``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("flwr_datasets")

from tests.test_deployment import assert_same_run, deployed, simulated  # noqa: E402
from tests.test_hf_datasets import _digits  # noqa: E402

pytestmark = [pytest.mark.deployment, pytest.mark.slow]

WRITERS, GROUPS, ROWS = 4, 2, 600  # 2 level-1 node hosts x 2 writers' device SuperNodes


def save_writers(path: Path) -> Path:
    """The first ROWS MNIST test digits, a synthetic writer column (4 writers) and group column
    (writer mod 2), save_to_disk."""
    x, y = _digits()
    writer = np.random.default_rng(1).integers(0, WRITERS, ROWS)
    features = datasets.Features({"image": datasets.Array2D((28, 28), "uint8"),
                                  "label": datasets.ClassLabel(num_classes=10),
                                  "writer": datasets.Value("string"), "group": datasets.Value("int64")})
    datasets.Dataset.from_dict({"image": list(x[:ROWS]), "label": y[:ROWS], "writer": [f"w{w}" for w in writer],
                                "group": writer % GROUPS}, features=features).save_to_disk(str(path))
    return path


def overrides(path: str | Path) -> list[str]:
    return ["dataset=huggingface", f"dataset.path={path}", "dataset.partitioner.name=NaturalIdPartitioner",
            "dataset.columns.natural_id=writer", "dataset.columns.group=group", "topology=sequential",
            f"topology.num_teams={GROUPS}", "topology.devices_per_team=null", "model=mclr", "global_rounds=2",
            "eval_every=2", "algorithm.team_rounds=2", "algorithm.local_steps=5", "algorithm.alpha=0.05",
            "dataset.batch_size=32", "runtime.torch_threads=1"]


def test_a_natural_tree_deployed_matches_in_process_and_an_unreachable_folder_is_named(tmp_path, monkeypatch):
    """One deployment, two submissions: first with a relative dataset.path that exists where
    hfl-deploy submit runs but not in the hosts' working directory (the run stops, its one line
    naming dataset.path and the folder the host looked in); then with the absolute path: PerMFL,
    2 global rounds, the global model and the final accuracies of the in-process run."""
    submitter = tmp_path / "submitter"
    save_writers(submitter / "writers")
    monkeypatch.chdir(submitter)  # hfl-deploy submit runs here; the hosts in tmp_path/deploy
    absolute = overrides(submitter / "writers")
    failed: dict[str, str] = {}

    def during(dep, out):  # noqa: ANN001, ANN202
        first = dep.submit([*overrides("writers"), "runtime=deployment", "runtime.device_wait_seconds=30"],
                           tmp_path / "failed")
        failed["out"], failed["code"] = first.stdout + first.stderr, str(first.returncode)
        failed["logs"] = dep.logs()
        return dep.submit([*absolute, "runtime=deployment", "runtime.device_wait_seconds=30"], out)

    run_dir, dep = deployed(tmp_path, absolute, during=during)
    assert failed["code"] == "1", failed["out"]
    # what the operator reads: hfl-deploy submit's line, the global host's error as it was raised there
    said = f"failed with exception: dataset.path: {dep.root / 'writers'} does not exist on "
    assert any(said in line and "('writers' from the working directory" in line
               for line in failed["out"].splitlines()), failed["out"] + failed["logs"][-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["failures"] == 0
    assert_same_run(run_dir, simulated(tmp_path, absolute))


def test_a_natural_tree_deployed_with_bhfl_matches_in_process(tmp_path):
    """B-HFL on the same deployment shape: its root's and nodes' optimiser state travel as PerMFL's
    do not; the models and final accuracies equal the in-process run's."""
    given = [*overrides(save_writers(tmp_path / "writers")), "algorithm=bhfl", "algorithm.team_rounds=1"]
    run_dir, _ = deployed(tmp_path, given)
    assert json.loads((run_dir / "summary.json").read_text())["failures"] == 0
    assert_same_run(run_dir, simulated(tmp_path, given))
