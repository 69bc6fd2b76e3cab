"""hfl-report as a user runs it (issue 49, item 6): a folder mixing configurations gets short legend
labels and a configurations table, --paper says when the runs' setting is not the paper's, the
console gets a summary (the report goes to a file); a run's own report names its seed and clock."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hfl.output import report, run_report

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def write_run(run_dir: Path, seed: int, accuracy: list[float], **config: object) -> Path:
    """A finished run as hfl-simulate leaves it, with its recorded config (checkpoints/config.json)."""
    run_dir.mkdir(parents=True)
    lines = [{"round": i + 1, "pm_accuracy": a, "pm_loss": 1 - a, "gm_accuracy": a / 2, "gm_loss": 2 - a}
             for i, a in enumerate(accuracy)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = {"algorithm": "permfl", "dataset": "synthetic", "model": "mclr", "rounds": len(accuracy),
               "final": {"pm_accuracy": accuracy[-1], "gm_accuracy": accuracy[-1] / 2},
               "best": {"pm_accuracy": max(accuracy), "gm_accuracy": max(accuracy) / 2}, "seconds_per_round": 0.1}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    cfg = {"algorithm": {"name": "permfl", "lam": 0.5, "eta": 0.03, "team_rounds": 10},
           "dataset": {"name": "synthetic", "size_scale": 1}, "model": {"name": "mclr"},
           "topology": {"name": "random", "num_teams": 4, "devices_per_team": 10}, "global_rounds": len(accuracy),
           "seed": seed, "runtime": {"name": "inprocess"},
           "clock": {"enabled": False, "policy": "sync", "deadline": 60.0, "min_replies": 0, "late": "drop",
                     "buffer": 4, "concurrency": 0, "max_staleness": 0, "speed": {"distribution": "constant"}}}
    for key, value in config.items():  # dotted keys, as on the command line
        *path, last = key.split(".")
        node = cfg
        for part in path:
            node = node[part]
        node[last] = value
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "config.json").write_text(json.dumps(cfg))
    return run_dir


def hfl_report(*args: str) -> subprocess.CompletedProcess:
    script = BIN / "hfl-report"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "hfl.output.report"]
    return subprocess.run([*argv, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def mixed_folder(root: Path) -> Path:
    """Three configurations of PerMFL (two seeds of the first), differing in five keys at once."""
    write_run(root / "a0", 0, [0.5, 0.6, 0.7])
    write_run(root / "a1", 1, [0.5, 0.7, 0.8])
    write_run(root / "b", 0, [0.4, 0.5, 0.6], **{"algorithm.lam": 15, "algorithm.eta": 0.05,
                                                 "algorithm.team_rounds": 5, "topology.num_teams": 2,
                                                 "dataset.size_scale": 5})
    write_run(root / "c", 0, [0.3, 0.4, 0.5], **{"algorithm.lam": 1.0, "topology.name": "explicit_teams_by_hand"})
    return root


def test_a_mixed_folder_gets_short_labels_a_configurations_table_and_a_console_summary(tmp_path):
    runs = mixed_folder(tmp_path / "runs")
    proc = hfl_report(str(runs), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    # the console: a summary, not the report (which is in the file it names)
    out = proc.stdout.splitlines()
    assert out[0] == f"hfl-report: 4 run(s) in 1 dataset/model group(s): {tmp_path / 'out' / 'report.md'}, " \
                     f"2 plot(s) in {tmp_path / 'out'}/"
    assert out[1] == "synthetic / mclr: final accuracy (%)" and len(out) == 2 + 1 + 3
    assert not any(line.startswith(("#", "|")) for line in out)
    markdown = (tmp_path / "out" / "report.md").read_text()
    rows = report.group_runs(report.collect_runs([runs]))[("synthetic", "mclr")]
    labels = list(rows)
    # short labels: what differs, cut at LABEL_WIDTH (the old labels ran past 120 characters)
    assert labels == ["permfl eta=0.03, lam=0.5, team_rounds=10, +3", "permfl eta=0.03, lam=1.0, team_rounds=10, +3",
                      "permfl eta=0.05, lam=15, team_rounds=5, +3"]
    assert max(map(len, labels)) <= len("permfl ") + report.LABEL_WIDTH + len(", +3")
    # ...and in the plot's legend
    fig = report.levels_figure(rows, [report.PM], "accuracy", 100.0, "%", "t")
    legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert legend == [f"{label} (n={len(rows[label].runs)})" for label in labels] and max(map(len, legend)) <= 50
    # the configurations table gives every differing key in full
    configurations = markdown.split("Configurations (", 1)[1]
    row = next(line for line in configurations.splitlines() if line.startswith("| permfl eta=0.05"))
    for pair in ("algorithm.eta=0.05", "algorithm.lam=15", "algorithm.team_rounds=5", "dataset.size_scale=5",
                 "topology.num_teams=2", "topology.name=random"):
        assert f"`{pair}`" in row
    assert str(runs / "b") in row


def test_paper_setting_differences_are_one_warning_line_and_in_the_report(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs / "a", 0, [0.5, 0.6])
    paper = tmp_path / "paper.yaml"
    paper.write_text("setting:\n  '*': {global_rounds: 400, topology.num_teams: 4}\n"
                     "  synthetic/mclr: {dataset.size_scale: 5}\n"
                     "synthetic/mclr:\n  permfl: {pm: 87.94, gm: 84.92}\n")
    proc = hfl_report(str(runs), "--out", str(tmp_path / "out"), "--paper", str(paper))
    assert proc.returncode == 0, proc.stderr
    line = ("hfl-report: warning: --paper: synthetic/mclr: not the paper's setting: global_rounds 2 here, 400 in "
            "the paper; dataset.size_scale 1 here, 5 in the paper")
    assert proc.stderr.splitlines() == [line]
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert ("**Not the paper's setting**: global_rounds 2 here, 400 in the paper; dataset.size_scale 1 here, 5 in "
            "the paper.") in markdown
    # the paper's setting itself: no warning
    write_run(tmp_path / "same", 0, [0.5, 0.6], **{"global_rounds": 400, "dataset.size_scale": 5.0})
    proc = hfl_report(str(tmp_path / "same"), "--out", str(tmp_path / "out2"), "--paper", str(paper))
    assert proc.returncode == 0 and proc.stderr == ""
    # a paper file that states no setting is said to be unchecked
    paper.write_text("synthetic/mclr:\n  permfl: {pm: 87.94}\n")
    proc = hfl_report(str(runs), "--out", str(tmp_path / "out3"), "--paper", str(paper))
    assert proc.returncode == 0 and proc.stderr.splitlines() == [
        "hfl-report: warning: --paper: the paper file states no setting; the runs' setting is not checked against "
        "the paper's"]


def test_a_bad_paper_setting_is_refused_in_one_line(tmp_path):
    write_run(tmp_path / "runs" / "a", 0, [0.5])
    paper = tmp_path / "paper.yaml"
    paper.write_text("setting: [global_rounds]\nsynthetic/mclr:\n  permfl: {pm: 87.94}\n")
    proc = hfl_report(str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--paper", str(paper))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"hfl-report: {paper}: setting: expected "
                                                '{"*" or "dataset/model": {config key: value}}']


def test_the_repository_paper_file_states_table1s_setting(tmp_path):
    """benchmarks/table1_paper.yaml: the README tour's sweep (30 rounds, size_scale 1) is warned about."""
    write_run(tmp_path / "runs" / "a", 0, [0.5, 0.6])
    proc = hfl_report(str(tmp_path / "runs"), "--out", str(tmp_path / "out"),
                      "--paper", str(ROOT / "benchmarks" / "table1_paper.yaml"))
    assert proc.returncode == 0
    assert "hfl-report: warning: --paper: synthetic/mclr: not the paper's setting: global_rounds 2 here, 400 " \
           "in the paper" in proc.stderr


def test_a_clock_runs_report_names_its_policy(tmp_path):
    run_dir = write_run(tmp_path / "r", 3, [0.5, 0.6], **{"clock.enabled": True, "clock.policy": ["sync", "buffered"],
                                                          "clock.buffer": 8})
    run_report.write_run_report(run_dir, warnings=[])
    text = (run_dir / "report.md").read_text()
    assert "seed: 3" in text
    assert ("- simulated time (clock): policy sync, buffered (root first); buffer 8, concurrency 0, max_staleness 0, "
            "speeds constant") in text
    plain = write_run(tmp_path / "p", 3, [0.5, 0.6], **{"clock.policy": "deadline"})
    run_report.write_run_report(plain, warnings=[])
    assert "simulated time" not in (plain / "report.md").read_text()  # the clock off: no policy applies
