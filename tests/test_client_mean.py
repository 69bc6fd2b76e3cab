"""client_mean_accuracy: the unweighted mean over devices of their accuracies (the FeMAM
paper's figure), beside the pooled Σcorrect / Σn; in metrics, hfl-report and the console."""

from __future__ import annotations

import json

import pytest

from hfl.output import report
from hfl.output.console import plain_text, summary_renderable
from hfl.node.evaluation import pool_evaluations


def triples(target: str, rows: list[tuple[int, int, int]]) -> dict:
    return {f"{target}_correct": sum(r[1] for r in rows), f"{target}_n": sum(r[2] for r in rows),
            f"{target}_loss_sum": 0.5 * sum(r[2] for r in rows), f"{target}_devices": json.dumps(rows)}


def test_client_mean_is_the_unweighted_mean_of_device_accuracies():
    team_a = {**triples("pm", [(0, 1, 2)]), **triples("gm", [(0, 2, 2)]), **triples("team", [(0, 0, 2)])}
    team_b = {**triples("pm", [(1, 9, 10)]), **triples("gm", [(1, 5, 10)]), **triples("team", [(1, 10, 10)])}
    pooled = pool_evaluations([team_a, team_b])
    assert pooled["pm_accuracy"] == pytest.approx(10 / 12)
    assert pooled["pm_client_mean_accuracy"] == pytest.approx(0.7)  # (1/2 + 9/10) / 2
    assert pooled["client_mean_accuracy"] == pytest.approx(0.7)  # the top-level figure is PM's
    assert pooled["gm_accuracy"] == pytest.approx(7 / 12)
    assert pooled["gm_client_mean_accuracy"] == pytest.approx(0.75)
    assert pooled["level1_client_mean_accuracy"] == pooled["team_client_mean_accuracy"] == pytest.approx(0.5)


def test_client_mean_is_none_without_a_pm():
    pooled = pool_evaluations([triples("gm", [(0, 1, 2), (1, 9, 10)])])
    assert pooled["client_mean_accuracy"] is None and pooled["pm_accuracy"] is None
    assert "pm_client_mean_accuracy" not in pooled
    assert pooled["gm_client_mean_accuracy"] == pytest.approx(0.7)


def test_client_means_are_no_model_levels():
    keys = {"pm_accuracy", "gm_accuracy", "client_mean_accuracy", "pm_client_mean_accuracy",
            "gm_client_mean_accuracy", "team_client_mean_accuracy", "level2_client_mean_accuracy", "pflego_accuracy"}
    assert [level.name for level in report.model_levels(keys)] == ["PM", "GM", "pflego"]


def write_run(run_dir, algorithm: str, pm: list[float | None], gm: list[float], client_mean: list[float | None]):
    run_dir.mkdir(parents=True)
    lines = [{"round": r + 1, "pm_accuracy": pm[r], "gm_accuracy": gm[r], "client_mean_accuracy": client_mean[r],
              "pm_client_mean_accuracy": client_mean[r], "gm_client_mean_accuracy": gm[r] - 0.01, "seconds": 0.1}
             for r in range(len(gm))]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    def best(key):
        values = [line[key] for line in lines if line[key] is not None]
        return max(values) if values else None

    keys = ("pm_accuracy", "gm_accuracy", "client_mean_accuracy", "gm_client_mean_accuracy", "pm_client_mean_accuracy")
    summary = {"algorithm": algorithm, "dataset": "synthetic", "model": "mclr", "rounds": len(gm),
               "final": {k: lines[-1][k] for k in keys}, "best": {k: best(k) for k in keys}, "seconds_per_round": 0.1}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_report_has_client_mean_columns(tmp_path):
    write_run(tmp_path / "runs" / "ft", "fedavg_ft", [0.5, 0.8], [0.4, 0.6], [0.55, 0.75])
    write_run(tmp_path / "runs" / "avg", "fedavg", [None, None], [0.4, 0.6], [None, None])
    paper = tmp_path / "paper.yaml"
    paper.write_text("synthetic/mclr:\n  fedavg_ft: {client_mean: 70.1}\n")
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--paper", str(paper)]) == 0
    markdown = (tmp_path / "out" / "report.md").read_text()
    table = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header == ["algorithm", "PM best", "PM final", "GM best", "GM final", "client mean best",
                      "client mean final", "paper PM", "paper GM", "paper client mean", "seeds", "rounds"]
    rows = {cells[0]: dict(zip(header, cells, strict=True))
            for cells in ([c.strip() for c in line.strip("|").split("|")] for line in table[2:])}
    assert (rows["fedavg_ft"]["client mean best"], rows["fedavg_ft"]["client mean final"]) == ("75.00", "75.00")
    assert rows["fedavg_ft"]["PM final"] == "80.00" and rows["fedavg_ft"]["paper client mean"] == "70.10"
    assert rows["fedavg"]["client mean final"] == "—"
    assert "Client mean:" in markdown


def test_accuracy_plot_has_a_client_mean_panel_when_runs_report_it(tmp_path, monkeypatch):
    drawn = {}
    real = report.levels_figure

    def spy(rows, levels, quantity, *args):  # noqa: ANN001, ANN202
        drawn[quantity] = [level.name for level in levels]
        return real(rows, levels, quantity, *args)

    monkeypatch.setattr(report, "levels_figure", spy)
    write_run(tmp_path / "runs" / "ft", "fedavg_ft", [0.5, 0.8], [0.4, 0.6], [0.55, 0.75])
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    assert drawn["accuracy"][-1] == "client mean" and "client mean" not in drawn["loss"]
    monkeypatch.setattr(report, "levels_figure", spy)
    write_run(tmp_path / "plain" / "avg", "fedavg", [None, None], [0.4, 0.6], [None, None])
    assert report.main([str(tmp_path / "plain"), "--out", str(tmp_path / "out2")]) == 0
    assert "client mean" not in drawn["accuracy"]


def test_console_summary_shows_each_levels_client_mean(tmp_path):
    run = report.load_run(write_run(tmp_path / "ft", "fedavg_ft", [0.5, 0.8], [0.4, 0.6], [0.55, 0.75]))
    text = plain_text(summary_renderable(run, None))
    header = next(line for line in text.splitlines() if line.startswith("model"))
    assert "client mean final" in header and "client mean best" in header
    pm = next(line for line in text.splitlines() if line.startswith("PM ")).split()
    gm = next(line for line in text.splitlines() if line.startswith("GM ")).split()
    assert pm[1:] == ["80.00%", "80.00%", "2", "75.00%", "75.00%"]
    assert gm[1:] == ["60.00%", "60.00%", "2", "59.00%", "59.00%"]
