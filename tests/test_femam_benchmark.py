"""benchmarks/femam_compare.py: the jobs it builds and its dry run (no training)."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def femam_compare():
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("femam_compare", BENCHMARKS / "femam_compare.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["femam_compare"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("femam_compare", None)
    sys.path.remove(str(BENCHMARKS))


def dry_run(module, capsys, *argv: str) -> list[list[str]]:
    assert module.main(["--dry-run", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    return [shlex.split(line) for line in lines if not line.startswith("#")]


def overrides(command: list[str]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in command if "=" in arg)


def test_dry_run_lists_54_runs_with_each_settings_overrides(femam_compare, capsys, tmp_path):
    commands = dry_run(femam_compare, capsys, "--out", str(tmp_path))
    assert len(commands) == 108  # each run and its validation twin
    twins = [c for c in commands if femam_compare.EVALUATE_ON_VALIDATION in c]
    assert len(twins) == 54
    runs = set()
    for command in commands:
        o = overrides(command)
        setting, algorithm, seed = Path(o["hydra.run.dir"]).parts[-3:]
        if command in twins:  # the same overrides, its own folder
            assert seed.endswith(femam_compare.VAL_SUFFIX)
            assert command[1] == str(BENCHMARKS / "femam_compare.py")
            continue
        runs.add((setting, algorithm, seed))
        assert o["algorithm"] == algorithm
        assert o["dataset.val_fraction"] == "0.15" and o["dataset.batch_size"] == "32"
        assert o["algorithm.alpha"] == "0.01" and o["model"] == "mclr" and o["runtime"] == "inprocess"
        assert o["global_rounds"] == "100" and o["seed"] == seed.removeprefix("seed")
        assert o["topology"] == "random" and o["topology.num_teams"] == "5"
        devices = 5 * int(o["topology.devices_per_team"])
        if setting == "synthetic":
            assert o["dataset"] == "synthetic_multilevel" and o["dataset.clusters"] == "[2,4]" and devices == 60
        else:
            assert o["dataset"] == "mnist" and devices == 50 and Path(o["dataset.root"]).name == "data"
            if setting == "mnist_clusterwise":
                assert o["dataset.partition"] == "clusterwise"
                assert o["dataset.cluster_classes"] == "3" and o["dataset.num_clusters"] == "5"
            else:
                assert o["dataset.partition"] == "dirichlet" and o["dataset.dirichlet_alpha"] == "0.1"
        if algorithm == "femam":
            assert o["algorithm.levels"] == "[1,5,5,0]"
            assert o["algorithm.rounds_per_level"] == "[40,20,20,20]" and o["algorithm.prune_window"] == "20"
        if algorithm in ("femam", "fesem"):
            assert o["algorithm.local_epochs"] == "2" and "algorithm.local_steps" not in o
        else:
            assert o["algorithm.local_steps"] == ("6" if setting == "synthetic" else "9")
        if algorithm == "ditto":
            assert o["algorithm.lam"] == "0.1"
    assert {(s, a) for s, a, _ in runs} == {(s, a) for s in femam_compare.DEFAULT_SETTINGS for a in femam_compare.ALGORITHMS}
    assert len(runs) == 54
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # a dry run writes nothing


def test_options_scale_the_schedule_and_select(femam_compare, capsys, tmp_path):
    commands = dry_run(femam_compare, capsys, "--out", str(tmp_path), "--settings", "mnist_dirichlet",
                       "--algorithms", "femam,local", "--seeds", "4", "--rounds", "50", "--femam-levels", "1,5,5,5,0",
                       "--no-val-twins")
    assert len(commands) == 2
    femam = overrides(commands[0])
    assert femam["algorithm.levels"] == "[1,5,5,5,0]" and femam["global_rounds"] == "50"
    assert femam["algorithm.rounds_per_level"] == "[20,7,7,7,7]" and femam["algorithm.prune_window"] == "7"
    assert femam["seed"] == "4" and femam["dataset.partition"] == "dirichlet"
    assert femam_compare.femam_schedule(100, 4) == ([40, 20, 20, 20], 20)


@pytest.mark.parametrize("argv", [["--settings", "cifar100"], ["--settings", ""], ["--algorithms", "fedprox"],
                                  ["--seeds", "x"], ["--rounds", "0"], ["--femam-levels", "1,0,5"]])
def test_bad_options_are_refused(femam_compare, capsys, argv):
    with pytest.raises(SystemExit) as exc:
        femam_compare.main(["--dry-run", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_complete_runs_are_skipped(femam_compare, capsys, tmp_path):
    argv = ["--out", str(tmp_path), "--settings", "synthetic", "--algorithms", "fedavg", "--seeds", "0", "--no-val-twins"]
    args = femam_compare.parse_args(argv)
    (job,) = femam_compare.build_jobs(args)
    job.run_dir.mkdir(parents=True)
    (job.run_dir / "summary.json").write_text(json.dumps({"rounds": 100, "best": {}, "final": {}}))
    dry_run(femam_compare, capsys, *argv)  # consumes the output of a first call
    assert femam_compare.main(["--dry-run", *argv]) == 0
    assert capsys.readouterr().out.startswith("# complete, skipped: ")


def test_levels_summary_counts_kept_levels(femam_compare, tmp_path):
    run = tmp_path / "seed0"
    run.mkdir()
    kept = {"0": [1, 1, 0, 1], "1": [1, 0, 0, 1], "2": [1, 1, 1, 0]}
    (run / "femam_levels.json").write_text(json.dumps({"levels": [1, 5, 5, 0], "rounds": [40, 20, 20, 20],
                                                       "kept": kept}))
    text = femam_compare.levels_summary([run, tmp_path / "missing"])
    assert "| seed0 | 3 / 2 / 1 / 2 of 3 | 2.67 | [40, 20, 20, 20] |" in text
    assert "(no femam_levels.json)" in text


def test_multilevel_setting_matches_the_reference_data(femam_compare, capsys, tmp_path):
    (command, twin) = dry_run(femam_compare, capsys, "--out", str(tmp_path), "--settings", "mnist_multilevel",
                              "--algorithms", "femam", "--seeds", "0", "--model", "resnet9")
    o = overrides(command)
    assert o["dataset.partition"] == "multilevel" and o["dataset.level_clusters"] == "[2,3,5]"
    assert o["dataset.level_classes"] == "[1,1,1]" and o["model"] == "resnet9"
    # the normalisation the authors' code applies under --data-name emnist (benchmarks/reference/femam.py)
    assert o["dataset.normalize"] == "[0.1307,0.3081]"
    assert twin[2] == femam_compare.EVALUATE_ON_VALIDATION and overrides(twin) == {
        **o, "hydra.run.dir": str(Path(o["hydra.run.dir"]).with_name("seed0" + femam_compare.VAL_SUFFIX))}


def write_metrics(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_lowest_validation_loss_reading(femam_compare, tmp_path):
    """The test figure is read at the round of the twin's lowest validation loss, of the model the
    devices predict with: PM where there is one, else the GM."""
    run, twin = tmp_path / "seed0", tmp_path / "seed0_val"
    write_metrics(run, [{"round": r, "client_mean_accuracy": a, "gm_client_mean_accuracy": 0.1, "pm_loss": 9.0}
                        for r, a in ((1, 0.5), (2, 0.7), (3, 0.9))])
    write_metrics(twin, [{"round": r, "client_mean_accuracy": 0.0, "pm_loss": v, "gm_loss": 0.0}
                         for r, v in ((1, 2.0), (2, 1.0), (3, 1.5))])
    reading = femam_compare.lowest_val_reading(run, twin)
    assert reading["round"] == 2 and reading["accuracy"] == 0.7 and reading["val_loss"] == 1.0
    assert reading["same_training"] is None  # no checkpoints to compare
    gm_run, gm_twin = tmp_path / "fedavg", tmp_path / "fedavg_val"
    write_metrics(gm_run, [{"round": r, "client_mean_accuracy": None, "gm_client_mean_accuracy": a}
                           for r, a in ((1, 0.4), (2, 0.6))])
    write_metrics(gm_twin, [{"round": r, "client_mean_accuracy": None, "pm_loss": None, "gm_loss": v}
                            for r, v in ((1, 0.5), (2, 0.8))])
    assert femam_compare.lowest_val_reading(gm_run, gm_twin)["accuracy"] == 0.4
    assert femam_compare.lowest_val_reading(run, tmp_path / "missing") is None


def test_femam_own_reading_shifts_by_one_round(femam_compare, tmp_path):
    """FeMAM's per-round mean validation loss is of the model it received, the one evaluated after
    the previous round: the lowest at round r reads the test figure of round r - 1."""
    import numpy as np

    run = tmp_path / "seed0"
    write_metrics(run, [{"round": r, "client_mean_accuracy": r / 10} for r in range(1, 6)])
    (run / "state").mkdir()
    np.savez(run / "state" / "node-root.npz", **{"femam.mean_val0": np.array([3.0, 2.0]),
                                                  "femam.mean_val1": np.array([1.5, 0.5, 1.0])})
    assert femam_compare.femam_own_reading(run) == {"round": 3, "accuracy": 0.3, "val_loss": 0.5}


def test_validation_twin_evaluates_on_the_validation_split(femam_compare, monkeypatch):
    """The twin's federation: every device's test split is its validation split, the rest unchanged."""
    import numpy as np
    import torch

    import hfl.runtime.simulate as simulate
    from hfl.data import federation

    x, y = np.arange(40, dtype=np.uint8).reshape(40, 1), np.arange(40) % 3
    original = federation.split_device
    seen = {}

    def fake_main():
        seen["data"] = federation.split_device(0, x, y, np.arange(40), 0.75, 0.2, 0, lambda a: a.astype(np.float32))

    monkeypatch.setattr(simulate, "main", fake_main)
    monkeypatch.setattr(federation, "split_device", original)  # restored after the test
    femam_compare.simulate_on_validation(["global_rounds=1"])
    data = seen["data"]
    reference = original(0, x, y, np.arange(40), 0.75, 0.2, 0, lambda a: a.astype(np.float32))
    assert len(reference.y_val) > 0 and not torch.equal(reference.y_test, reference.y_val)
    assert torch.equal(data.x_test, reference.x_val) and torch.equal(data.y_test, reference.y_val)
    assert torch.equal(data.x_train, reference.x_train) and torch.equal(data.x_val, reference.x_val)
