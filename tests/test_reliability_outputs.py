"""Reports read what ran, and recovery keeps its promise (issue 46, items 4 and 5), in the form of
tests/test_durability.py: a refused run changes nothing in the directory it was refused for (its
.hydra/ files and log included), overwrite=true removes every output of the old run before
training, hfl-report groups by the config each run recorded and names a damaged file in one line,
warnings reach report.md, the overwrite guard survives the loss of checkpoints/config.json, and a
damaged samples.jsonl is refused on resume naming it."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hfl.errors import ConfigError
from hfl.output import report
from hfl.runtime.simulate import run
from hfl.state import resume
from hfl.state.resume import CONFIG, OUTPUTS
from tests.test_durability import _killed_after_checkpoint, garble, runs, truncate  # noqa: F401 - runs: a fixture
from tests.test_resume import Killed, assert_same_run
from tests.test_run_dir import CFG, contents
from tests.conftest import compose_cfg

ROOT = Path(__file__).resolve().parents[1]
CLI = [*CFG, "runtime=inprocess"]


def _cli(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hfl.runtime.simulate", *CLI, *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------- refusals touch nothing
def test_a_refused_run_changes_nothing_hydra_files_and_log_included(tmp_path):
    done = _cli(tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / ".hydra" / "config.yaml").exists() and (tmp_path / ".hydra" / "overrides.yaml").exists()
    before = {**contents(tmp_path), "lock": (tmp_path / "checkpoints" / "run.lock").read_text()}
    for overrides in (["algorithm.alpha=0.07"], ["algorithm.alpha=0.07", "resume=true"]):
        refused = _cli(tmp_path, *overrides)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith(("hfl-simulate: overwrite:", "hfl-simulate: resume:")), refused.stderr
        assert {**contents(tmp_path), "lock": (tmp_path / "checkpoints" / "run.lock").read_text()} == before
    # hfl-report labels the finished run with its own config, not the refused run's
    assert report.load_run(tmp_path).config["algorithm"]["alpha"] != 0.07


# ---------------------------------------------------------------- overwrite
def test_overwrite_removes_every_output_of_the_old_run_before_training(tmp_path, monkeypatch):
    run(compose_cfg(*CFG), tmp_path)
    assert all((tmp_path / name).exists() for name in ("summary.json", "report.md", "accuracy.png", "loss.png"))
    seen: dict[str, bool] = {}
    original = resume.record_config

    def record_config(cfg, run_dir):  # noqa: ANN001, ANN202 - the moment a killed overwrite would leave
        seen.update({name: (run_dir / name).exists() for name in OUTPUTS})
        original(cfg, run_dir)

    monkeypatch.setattr(resume, "record_config", record_config)
    run(compose_cfg(*CFG, "overwrite=true"), tmp_path)
    assert seen and not any(seen.values()), seen


@pytest.mark.parametrize("lost", [CONFIG, Path("summary.json"), Path("checkpoints/resume.pkl")])
def test_the_overwrite_guard_does_not_depend_on_one_file(tmp_path, lost):
    run(compose_cfg(*CFG), tmp_path)
    (tmp_path / lost).unlink()
    before = contents(tmp_path)
    with pytest.raises(ConfigError) as refused:
        run(compose_cfg(*CFG), tmp_path)
    assert refused.value.key == "overwrite" and "\n" not in str(refused.value)
    assert contents(tmp_path) == before


# ---------------------------------------------------------------- what a run writes
def test_outputs_are_atomic_and_warnings_reach_report_md(tmp_path, monkeypatch):
    from hfl.output import recorder
    original = recorder.Recorder.round_done

    def round_done(self, rnd, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        logging.getLogger("hfl.node").warning("a warning the console shows")  # as a node's, every round
        return original(self, rnd, *args, **kwargs)

    monkeypatch.setattr(recorder.Recorder, "round_done", round_done)
    run(compose_cfg(*CFG), tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "## Warnings" in text and text.count("a warning the console shows") == 1  # once, not once a round
    assert not list(tmp_path.glob(".*.tmp*"))  # no temporary file left behind


# ---------------------------------------------------------------- hfl-report
def _finished(tmp_path: Path, name: str, *overrides: str) -> Path:
    run_dir = tmp_path / name
    run(compose_cfg(*CFG, *overrides), run_dir)
    return run_dir


def test_hfl_report_groups_by_the_recorded_config_without_hydra(tmp_path, capsys):
    for name, alpha in (("a", "0.01"), ("b", "0.07")):
        _finished(tmp_path, name, f"algorithm.alpha={alpha}")  # run() writes no .hydra/: as a deployed run
    assert not list(tmp_path.rglob(".hydra"))
    rows = report.group_runs(report.collect_runs([tmp_path]))
    (group,) = rows.values()
    assert len(group) == 2 and all("alpha" in name for name in group), list(group)


def test_hfl_report_skips_a_damaged_summary_in_one_line(tmp_path, capsys):
    good, bad = _finished(tmp_path, "good"), _finished(tmp_path, "bad", "seed=1")
    truncate(bad / "summary.json")
    assert report.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    line = next(text for text in err.splitlines() if "summary.json" in text)
    assert str(bad / "summary.json") in line and "skipped" in line and "Traceback" not in err
    del good


def test_a_finished_run_with_a_torn_summary_is_written_again_on_resume(tmp_path):
    run_dir = _finished(tmp_path, "done")
    want = json.loads((run_dir / "summary.json").read_text())
    truncate(run_dir / "summary.json")
    got = run(compose_cfg(*CFG, "resume=true"), run_dir)
    assert got == want == json.loads((run_dir / "summary.json").read_text())


# ---------------------------------------------------------------- recovery
SAMPLED = [*CFG, "runtime.dropout=0.34", "algorithm.min_fit_fraction=0.6"]  # samples.jsonl: asked and dropped


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with samples.jsonl rows, killed right after round 1's checkpoint."""
    run_dir = tmp_path_factory.mktemp("sampled") / "killed"
    with pytest.MonkeyPatch.context() as patch:
        _killed_after_checkpoint(patch, 1)
        with pytest.raises(Killed):
            run(compose_cfg(*SAMPLED), run_dir)
    assert len((run_dir / "samples.jsonl").read_text().splitlines()) >= 3
    return run_dir


@pytest.mark.parametrize("damage", ["garbled", "truncated", "deleted"])
def test_damaged_samples_are_refused_on_resume_naming_the_file(sampled, tmp_path, damage):
    run_dir = tmp_path / "killed"
    shutil.copytree(sampled, run_dir)
    samples = run_dir / "samples.jsonl"
    lines = samples.read_text().splitlines()
    if damage == "garbled":  # still JSON, another value
        samples.write_text("\n".join([lines[0], lines[1].replace('"global_round": 1', '"global_round": 1, "x": 0'),
                                      *lines[2:]]) + "\n")
    elif damage == "truncated":  # a middle row lost
        samples.write_text("\n".join(lines[:1] + lines[2:]) + "\n")
    else:
        samples.unlink()
    before = contents(run_dir)
    with pytest.raises(ConfigError) as refused:
        run(compose_cfg(*SAMPLED, "resume=true"), run_dir)
    assert refused.value.key == "resume" and str(samples) in str(refused.value) and "\n" not in str(refused.value)
    assert contents(run_dir) == before


def test_intact_samples_resume_to_the_uninterrupted_run(sampled, tmp_path):
    run_dir, whole = tmp_path / "killed", tmp_path / "whole"
    shutil.copytree(sampled, run_dir)
    run(compose_cfg(*SAMPLED, "resume=true"), run_dir)
    run(compose_cfg(*SAMPLED), whole)
    assert_same_run(run_dir, whole)


def test_the_manifest_survives_a_damaged_checkpoint(runs, tmp_path, caplog):  # noqa: F811
    run_dir = tmp_path / "mid-round"
    shutil.copytree(runs["base"] / "mid-round", run_dir)
    manifest = json.loads((run_dir / resume.MANIFEST).read_text())
    assert manifest["round"] == 3 and manifest["store"]
    garble(run_dir / resume.CHECKPOINT)
    caplog.set_level(logging.WARNING, logger="hfl")
    run({**runs["cfg"], "resume": True}, run_dir)
    assert f"{run_dir / resume.MANIFEST} says it committed global round 3" in caplog.text

