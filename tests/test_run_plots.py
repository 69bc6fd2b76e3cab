"""Every run draws itself: accuracy.png, loss.png and report.md in the run directory at the
end of the run, every model level in them (and in summary.json), and a plot failure never
costs a finished run."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from hfl.output import report

from hfl.output import run_report
from hfl.output.recorder import Recorder

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
META = {"algorithm": "bhfl", "dataset": "synthetic", "model": "mclr"}


def evaluation(rnd: int) -> dict:
    """A depth-3 tree's evaluation with the root's proxy set and a model of the algorithm's own."""
    values = {"pm": 0.5 + 0.1 * rnd, "level1": 0.3 + 0.05 * rnd, "level2": 0.35 + 0.05 * rnd,
              "gm": 0.2 + 0.1 * rnd, "gm_proxy": 0.25, "pflego": 0.6 + 0.1 * (rnd == 2)}
    line = {f"{name}_accuracy": value for name, value in values.items()}
    line.update({f"{name}_loss": 2 - value for name, value in values.items()})
    line.update({"team_accuracy": values["level1"], "team_loss": 2 - values["level1"], "pm_accuracy_min": 0.1})
    return line


def record_run(run_dir, rounds: int = 3) -> Recorder:
    recorder = Recorder(run_dir, META, num_rounds=rounds)
    counters = {"bytes_down_global": 10, "bytes_up_global": 5, "bytes_down_level1": 2000, "bytes_up_level1": 1000,
                "bytes_down_level2": 300_000, "bytes_up_level2": 200_000}
    for rnd in range(1, rounds + 1):
        recorder.round_done(rnd, 0.5, counters, evaluation(rnd), [np.zeros(2, dtype=np.float32)])
    return recorder


def test_a_finished_run_has_its_plots_and_report(tmp_path):
    record_run(tmp_path)
    for name in ("accuracy.png", "loss.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
    markdown = (tmp_path / "report.md").read_text()
    assert markdown.startswith("# bhfl on synthetic / mclr\n")
    assert "![accuracy.png](accuracy.png)" in markdown and "![loss.png](loss.png)" in markdown
    lines = markdown.splitlines()
    models = lines[lines.index("| model | final | best | best round |") + 2:]
    models = [[cell.strip() for cell in line.split("|")[1:-1]] for line in models[:models.index("")]]
    # every level in tree order, then the others: final, best, best round
    assert models == [["PM", "80.00", "80.00", "3"], ["level1", "45.00", "45.00", "3"],
                      ["level2", "50.00", "50.00", "3"], ["GM", "50.00", "50.00", "3"],
                      ["GM proxy", "25.00", "25.00", "1"],
                      ["pflego", "60.00", "70.00", "2"]]  # pflego: best at round 2, not the last
    assert "| level0 | 30 B | 15 B |" in markdown
    assert "| level1 | 6 kB | 3 kB |" in markdown and "| level2 | 900 kB | 600 kB |" in markdown
    assert "Seconds per round: 0.50" in markdown


def test_the_plots_have_a_line_per_level(tmp_path):
    record_run(tmp_path)
    run = report.load_run(tmp_path)
    levels = run_report.run_levels(run)
    fig = run_report.run_figure(run, levels, "accuracy", 100.0, "test accuracy (%)", "title")
    (ax,) = fig.axes
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.lines}
    assert list(lines) == [level.label for level in levels]
    assert lines["pflego"] == pytest.approx([60, 70, 60])
    assert lines["level1"] == pytest.approx([35, 40, 45])


def test_summary_has_every_accuracy_key(tmp_path):
    record_run(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    expected = ["pm_accuracy", "gm_accuracy", "team_accuracy", "level1_accuracy", "level2_accuracy",
                "gm_proxy_accuracy", "pflego_accuracy"]
    assert list(summary["final"]) == list(summary["best"]) == expected
    assert summary["final"]["pflego_accuracy"] == pytest.approx(0.6)
    assert summary["best"]["pflego_accuracy"] == pytest.approx(0.7)
    assert summary["best"]["gm_proxy_accuracy"] == pytest.approx(0.25)


def test_report_compares_runs_with_other_models_too(tmp_path):
    record_run(tmp_path / "a")
    groups = report.group_runs(report.collect_runs([tmp_path]))
    levels = report.group_levels(groups[("synthetic", "mclr")])
    assert [level.name for level in levels] == ["PM", "level1", "level2", "GM", "GM proxy", "pflego"]


def test_a_plot_failure_is_a_warning_not_a_failed_run(tmp_path, monkeypatch, caplog):
    def broken(run_dir, *args, **kwargs):  # noqa: ANN002, ANN003 - whatever the report is given
        raise RuntimeError("no backend")

    monkeypatch.setattr(run_report, "write_run_report", broken)
    with caplog.at_level(logging.WARNING, logger="hfl"):
        record_run(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["rounds"] == 3
    assert not (tmp_path / "accuracy.png").exists()
    assert any("could not draw" in r.getMessage() and "no backend" in r.getMessage() for r in caplog.records)


def test_human_bytes():
    assert [run_report.human_bytes(n) for n in (0, 999, 6000, 647_040, 38_822_400, 999_600, 2.5e12)] == [
        "0 B", "999 B", "6 kB", "647 kB", "38.8 MB", "1 MB", "2.5 TB"]
