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
    assert len(commands) == 54
    runs = set()
    for command in commands:
        o = overrides(command)
        setting, algorithm, seed = Path(o["hydra.run.dir"]).parts[-3:]
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
    assert {(s, a) for s, a, _ in runs} == {(s, a) for s in femam_compare.SETTINGS for a in femam_compare.ALGORITHMS}
    assert len(runs) == 54
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # a dry run writes nothing


def test_options_scale_the_schedule_and_select(femam_compare, capsys, tmp_path):
    commands = dry_run(femam_compare, capsys, "--out", str(tmp_path), "--settings", "mnist_dirichlet",
                       "--algorithms", "femam,local", "--seeds", "4", "--rounds", "50", "--femam-levels", "1,5,5,5,0")
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
    argv = ["--out", str(tmp_path), "--settings", "synthetic", "--algorithms", "fedavg", "--seeds", "0"]
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
