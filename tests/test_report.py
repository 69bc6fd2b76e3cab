"""hfl-report on hand-written run directories: numbers, missing models, plots, paper columns, errors."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from hfl.output import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(run_dir: Path, algorithm: str, dataset: str, model: str, seed: int | None,
             pm: list[float] | None, gm: list[float] | None, hydra: bool = True,
             extra: dict[str, list[float | None]] | None = None, **config) -> Path:
    """A run as hfl-simulate leaves it: metrics.jsonl, summary.json and .hydra/config.yaml.

    pm / gm: accuracy per evaluated round (None = the algorithm has no such model; the
    PM keys are then written as null, the GM keys left out, to cover both forms).
    extra: more metrics.jsonl keys (e.g. level2_accuracy), a value per round."""
    run_dir.mkdir(parents=True)
    rounds = len(pm or gm)
    lines = []
    for i in range(rounds):
        line = {"round": i + 1}
        line.update({"pm_accuracy": pm[i], "pm_loss": 1 - pm[i]} if pm else {"pm_accuracy": None, "pm_loss": None})
        if gm:
            line.update({"gm_accuracy": gm[i], "gm_loss": 2 - gm[i]})
        line.update({key: values[i] for key, values in (extra or {}).items()})
        line.update({"seconds": 0.1, "failures": 0})
        lines.append(json.dumps(line))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = {"algorithm": algorithm, "dataset": dataset, "model": model, "rounds": rounds,
               "final": {"pm_accuracy": pm[-1] if pm else None, "gm_accuracy": gm[-1] if gm else None},
               "best": {"pm_accuracy": max(pm) if pm else None, "gm_accuracy": max(gm) if gm else None},
               "seconds_per_round": 0.1}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if hydra:
        (run_dir / ".hydra").mkdir()
        lam = config.get("lam", 0.5)
        (run_dir / ".hydra" / "config.yaml").write_text(
            f"algorithm:\n  name: {algorithm}\n  lam: {lam}\ndataset:\n  name: {dataset}\n"
            f"model:\n  name: {model}\nruntime:\n  name: inprocess\nglobal_rounds: {rounds}\nseed: {seed}\n")
    return run_dir


# synthetic/mclr: permfl x 3 seeds (PM and GM), pfedme x 2 seeds (no GM);
# mnist/cnn: fedavg x 1 seed (no PM). Round values: [first, best, final].
PERMFL = {0: ([0.50, 0.80, 0.78], [0.30, 0.60, 0.55]),
          1: ([0.50, 0.82, 0.80], [0.30, 0.70, 0.65]),
          2: ([0.50, 0.87, 0.85], [0.30, 0.65, 0.60])}
PFEDME = {0: [0.40, 0.90, 0.88], 1: [0.40, 0.86, 0.84]}
FEDAVG = [0.20, 0.70, 0.68]


def make_tree(root: Path) -> Path:
    """A Hydra-multirun-like tree (runs at different depths)."""
    for i, (seed, (pm, gm)) in enumerate(PERMFL.items()):
        make_run(root / "multirun" / "2026-01-01" / "10-00-00" / str(i), "permfl", "synthetic", "mclr", seed, pm, gm)
    for seed, pm in PFEDME.items():
        make_run(root / "pfedme" / f"seed{seed}", "pfedme", "synthetic", "mclr", seed, pm, None)
    make_run(root / "fedavg", "fedavg", "mnist", "cnn", 0, None, FEDAVG)
    return root


def table_rows(markdown: str, heading: str) -> dict[str, dict[str, str]]:
    """{algorithm: {column: cell}} of the table under '## heading'."""
    section = markdown.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    """One hfl-report run over the tree (with a paper file), shared by the tests below."""
    root = make_tree(tmp_path_factory.mktemp("runs"))
    paper = root / "paper.yaml"
    paper.write_text("synthetic/mclr:\n  permfl: {pm: 87.4, gm: 81.2}\n  pfedme: {pm: 85.0}\n")
    out = root / "report"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert report.main([str(root / "multirun"), str(root / "pfedme"), str(root / "fedavg"),
                            "--out", str(out), "--paper", str(paper), "--title", "Test report"]) == 0
    return out, (out / "report.md").read_text(), stdout.getvalue()


def test_table_means_and_sample_stds(produced):
    out, markdown, stdout = produced
    # the console: where the report went and each row's final PM / GM, not the report itself
    assert stdout.startswith(f"hfl-report: 6 run(s) in 2 dataset/model group(s): {out / 'report.md'}, 4 plot(s)")
    assert "## " not in stdout and len(stdout.splitlines()) == 1 + 2 * 2 + 3
    assert markdown.startswith("# Test report\n")
    rows = table_rows(markdown, "synthetic / mclr")
    assert list(rows) == ["permfl", "pfedme"]  # sorted by name
    permfl = rows["permfl"]
    # PM best 80, 82, 87: mean 83, sample std sqrt((9 + 1 + 16) / 2) = 3.606; final 78, 80, 85
    assert permfl["PM best"] == f"83.00 ± {math.sqrt(13):.2f}" == "83.00 ± 3.61"
    assert permfl["PM final"] == "81.00 ± 3.61"
    # GM best 60, 70, 65: mean 65, sample std sqrt((25 + 25 + 0) / 2) = 5; final 55, 65, 60
    assert permfl["GM best"] == "65.00 ± 5.00"
    assert permfl["GM final"] == "60.00 ± 5.00"
    assert permfl["seeds"] == "3 (0, 1, 2)"
    assert permfl["rounds"] == "3"
    pfedme = rows["pfedme"]
    # 90, 86: mean 88, sample std sqrt(8) = 2.83; final 88, 84
    assert pfedme["PM best"] == "88.00 ± 2.83"
    assert pfedme["PM final"] == "86.00 ± 2.83"
    assert pfedme["seeds"] == "2 (0, 1)"


def test_missing_models_and_single_seed(produced):
    _, markdown, _ = produced
    pfedme = table_rows(markdown, "synthetic / mclr")["pfedme"]
    assert pfedme["GM best"] == pfedme["GM final"] == "—"
    fedavg = table_rows(markdown, "mnist / cnn")["fedavg"]
    assert fedavg["PM best"] == fedavg["PM final"] == "—"
    assert fedavg["GM best"] == "70.00"  # one seed: the value alone, no ±
    assert fedavg["GM final"] == "68.00"
    assert fedavg["seeds"] == "1 (0)"


def test_paper_columns(produced):
    _, markdown, _ = produced
    header = next(line for line in markdown.splitlines() if line.startswith("| algorithm"))
    assert "| paper PM | paper GM |" in header
    rows = table_rows(markdown, "synthetic / mclr")
    assert (rows["permfl"]["paper PM"], rows["permfl"]["paper GM"]) == ("87.40", "81.20")
    assert (rows["pfedme"]["paper PM"], rows["pfedme"]["paper GM"]) == ("85.00", "—")
    fedavg = table_rows(markdown, "mnist / cnn")["fedavg"]  # no paper entry for this group
    assert (fedavg["paper PM"], fedavg["paper GM"]) == ("—", "—")


def test_plots_are_png_files(produced):
    out, markdown, _ = produced
    for name in ("synthetic_mclr_accuracy.png", "synthetic_mclr_loss.png",
                 "mnist_cnn_accuracy.png", "mnist_cnn_loss.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
        assert f"]({name})" in markdown


def test_runs_without_level_keys_keep_the_table_and_plots(produced):
    _, markdown, _ = produced
    assert "level" not in markdown
    headers = [line for line in markdown.splitlines() if line.startswith("| algorithm")]
    today = "| algorithm | PM best | PM final | GM best | GM final | paper PM | paper GM | seeds | rounds |"
    assert headers == [today] * 2
    groups = report.group_runs(report.collect_runs([produced[0].parent]))  # the tree the report came from
    assert [lv.name for lv in report.group_levels(groups[("synthetic", "mclr")])] == ["PM", "GM"]
    assert [lv.name for lv in report.group_levels(groups[("mnist", "cnn")])] == ["GM"]  # fedavg: PM keys null


def test_curve_mean_min_max(tmp_path):
    runs = report.collect_runs([make_tree(tmp_path) / "multirun"])
    rounds, mean, low, high = report.curve(runs, "gm_accuracy")
    assert rounds == [1, 2, 3]
    assert mean == pytest.approx([0.30, 0.65, 0.60])
    assert low == pytest.approx([0.30, 0.60, 0.55]) and high == pytest.approx([0.30, 0.70, 0.65])


def test_no_paper_no_paper_columns_and_default_out(tmp_path, monkeypatch, capsys):
    make_run(tmp_path / "runs" / "a", "fedavg", "mnist", "cnn", 0, None, FEDAVG)
    monkeypatch.chdir(tmp_path)
    report.main([str(tmp_path / "runs")])
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "paper" not in markdown
    assert capsys.readouterr().out.startswith("hfl-report: 1 run(s) in 1 dataset/model group(s): report/report.md")


def test_finds_runs_at_any_depth_once(tmp_path):
    root = make_tree(tmp_path)
    run = root / "multirun" / "2026-01-01" / "10-00-00" / "1"
    found = report.find_run_dirs([root, run, run / "summary.json"])  # overlapping paths: no duplicates
    assert len(found) == 6
    groups = report.group_runs(report.collect_runs([root]))
    assert list(groups) == [("mnist", "cnn"), ("synthetic", "mclr")]
    assert [r.seed for r in groups[("synthetic", "mclr")]["permfl"].runs] == [0, 1, 2]


def test_seed_from_summary_without_hydra_config(tmp_path):
    make_run(tmp_path / "r", "fedavg", "mnist", "cnn", None, None, FEDAVG, hydra=False)
    (run,) = report.collect_runs([tmp_path])
    assert run.seed is None and run.config is None
    row = report.group_runs([run])[("mnist", "cnn")]["fedavg"]
    assert report.group_table({"fedavg": row}, None).splitlines()[2].endswith("| 70.00 | 68.00 | 1 | 3 |")


def test_rounds_disagreement_warned_and_shown(tmp_path):
    make_run(tmp_path / "a", "permfl", "synthetic", "mclr", 0, [0.5, 0.6, 0.7], [0.1, 0.2, 0.3])
    make_run(tmp_path / "b", "permfl", "synthetic", "mclr", 1, [0.5, 0.6, 0.7, 0.8, 0.9], [0.1] * 5)
    groups = report.group_runs(report.collect_runs([tmp_path]))
    warnings = report.check_groups(groups)
    assert any("disagree on rounds" in w for w in warnings)
    # 3 and 5 global rounds are two experiments: two rows, not one averaged over both
    lines = report.group_table(groups[("synthetic", "mclr")], None).splitlines()[2:]
    assert [line.split(" | ")[0] for line in lines] == ["| permfl global_rounds=3", "| permfl global_rounds=5"]
    assert lines[0].endswith("| 1 (0) | 3 |") and lines[1].endswith("| 1 (1) | 5 |")


def test_runs_of_other_configs_are_reported_apart_and_repeated_seeds_warned(tmp_path):
    make_run(tmp_path / "a", "permfl", "synthetic", "mclr", 0, [0.5], [0.1], lam=0.5)
    make_run(tmp_path / "b", "permfl", "synthetic", "mclr", 0, [0.7], [0.1], lam=15)
    make_run(tmp_path / "c", "permfl", "synthetic", "mclr", 1, [0.9], [0.1], lam=15)
    make_run(tmp_path / "d", "permfl", "synthetic", "mclr", 1, [0.9], [0.1], lam=15)
    groups = report.group_runs(report.collect_runs([tmp_path]))
    rows = groups[("synthetic", "mclr")]
    assert sorted(rows) == ["permfl lam=0.5", "permfl lam=15"]
    assert [len(row.runs) for row in rows.values()] == [1, 3]
    table = report.group_table(rows, None)
    assert "| permfl lam=0.5 | 50.00 |" in table  # not averaged with the lam=15 runs (70, 90, 90)
    warnings = report.check_groups(groups)
    assert any("runs of 2 configurations, reported apart (algorithm.lam)" in w for w in warnings)
    assert any("seed(s) [1] appear more than once" in w for w in warnings)


def test_a_malformed_run_directory_is_named_and_skipped(tmp_path, capsys):
    make_run(tmp_path / "good", "permfl", "synthetic", "mclr", 0, [0.5], [0.1])
    bad = make_run(tmp_path / "bad", "permfl", "synthetic", "mclr", 1, [0.5], [0.1])
    (bad / "summary.json").write_text("{ not json")
    runs = report.collect_runs([tmp_path])
    assert [run.path.name for run in runs] == ["good"]
    assert f"{bad / 'summary.json'}: malformed JSON" in capsys.readouterr().err
    (tmp_path / "good" / "metrics.jsonl").write_text("garbage\n")
    with pytest.raises(SystemExit, match="no readable runs: .*good/metrics.jsonl:1: malformed JSON line"):
        report.collect_runs([tmp_path])


def test_aggregate_and_format():
    assert report.aggregate([None, None]) is None
    single = report.aggregate([None, 42.0])
    assert single == report.Stat(42.0, None, 1)
    assert report.format_stat(single, 2) == "42.00 (n=1)"  # only one of the row's two seeds has it
    assert report.format_stat(report.aggregate([1.0, 3.0]), 2) == f"2.00 ± {math.sqrt(2):.2f}"
    assert report.format_stat(None, 3) == "—"


# ---------------------------------------------------------------- errors


def test_error_no_runs(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"empty: no runs found"):
        report.main([str(tmp_path / "empty"), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=r"missing: no such file"):
        report.main([str(tmp_path / "missing")])
    assert not (tmp_path / "out").exists()


def test_error_malformed_metrics_line(tmp_path):
    run = make_run(tmp_path / "r", "fedavg", "mnist", "cnn", 0, None, FEDAVG)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"round": 4, "gm_accuracy": 0.7\n')
    with pytest.raises(SystemExit, match=r"metrics\.jsonl:4: malformed JSON line") as exc:
        report.main([str(tmp_path)])
    assert str(run) in str(exc.value)


def test_error_summary_without_algorithm_or_dataset(tmp_path):
    run = make_run(tmp_path / "r", "fedavg", "mnist", "cnn", 0, None, FEDAVG)
    summary = json.loads((run / "summary.json").read_text())
    del summary["algorithm"], summary["dataset"]
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit, match=r"summary\.json: summary lacks algorithm, dataset") as exc:
        report.main([str(tmp_path)])
    assert str(run) in str(exc.value)
    (run / "summary.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"summary\.json: malformed JSON"):
        report.main([str(tmp_path)])


def test_error_bad_paper_file(tmp_path):
    make_run(tmp_path / "r", "fedavg", "mnist", "cnn", 0, None, FEDAVG)
    paper = tmp_path / "paper.json"
    paper.write_text(json.dumps({"mnist/cnn": {"fedavg": {"pm": "high"}}}))
    with pytest.raises(SystemExit, match=r"paper\.json: mnist/cnn/fedavg/pm: not a number"):
        report.main([str(tmp_path / "r"), "--paper", str(paper)])
    paper.write_text(json.dumps({"mnist/cnn": {"fedavg": {"accuracy": 80}}}))
    with pytest.raises(SystemExit, match=r"paper\.json: mnist/cnn/fedavg: expected"):
        report.main([str(tmp_path / "r"), "--paper", str(paper)])
    with pytest.raises(SystemExit, match=r"nope\.yaml: paper file not found"):
        report.main([str(tmp_path / "r"), "--paper", str(tmp_path / "nope.yaml")])


def test_paper_entry_matching_no_run_is_warned(tmp_path):
    make_run(tmp_path / "r", "fedavg", "mnist", "cnn", 0, None, FEDAVG)
    groups = report.group_runs(report.collect_runs([tmp_path]))
    paper = report.Paper({"mnist/cnn": {"fedavg": {"pm": None, "gm": 99.0}, "fedavgg": {"pm": None, "gm": 1.0}},
                          "mnist/mclr": {"fedavg": {"pm": None, "gm": 1.0}}}, setting={})
    warnings = report.check_paper(paper, groups)
    assert len(warnings) == 2
    assert "mnist/cnn/fedavgg" in warnings[0] and "'mnist/mclr'" in warnings[1]


# ---------------------------------------------------------------- trees of any depth

# synthetic/mclr at depth 4: permfl x 2 seeds with level1, level2 and GM proxy (level2
# not evaluated at round 1); a 3-tier run beside it with team_* only (level1 = team).
DEPTH4 = {0: {"level1_accuracy": [0.40, 0.72, 0.70], "level2_accuracy": [None, 0.61, 0.60],
              "gm_proxy_accuracy": [0.2, 0.5, 0.55]},
          1: {"level1_accuracy": [0.40, 0.75, 0.74], "level2_accuracy": [None, 0.65, 0.66],
              "gm_proxy_accuracy": [0.2, 0.5, 0.57]}}


def with_losses(accuracies: dict[str, list[float | None]]) -> dict[str, list[float | None]]:
    extra = dict(accuracies)
    for key, values in accuracies.items():
        extra[key.replace("_accuracy", "_loss")] = [None if v is None else 1 - v for v in values]
    return extra


def make_depth4(root: Path) -> Path:
    for seed, levels in DEPTH4.items():
        pm, gm = PERMFL[seed]
        make_run(root / "permfl" / str(seed), "permfl", "synthetic", "mclr", seed, pm, gm, extra=with_losses(levels))
    make_run(root / "hierfavg" / "0", "hierfavg", "synthetic", "mclr", 0, None, FEDAVG,
             extra=with_losses({"team_accuracy": [0.25, 0.5, 0.52]}))
    return root


def test_model_levels_choice():
    def names(keys):
        return [(level.name, level.label) for level in report.model_levels(keys)]

    assert names(set()) == []
    assert names({"round", "seconds", "gm_accuracy"}) == [("GM", "GM")]
    # 3-tier: team is level1, and named so (one name per level in every output)
    assert names({"pm_accuracy", "team_loss", "gm_loss"}) == [("PM", "PM"), ("level1", "level1"), ("GM", "GM")]
    # depth 4 and deeper: depths in numeric order, level1 keys win the label, GM proxy last
    assert [name for name, _ in names({"gm_proxy_accuracy", "level10_loss", "level2_accuracy", "team_accuracy",
                                       "level1_accuracy", "gm_accuracy", "pm_loss", "level0_accuracy"})] == [
        "PM", "level1", "level2", "level10", "GM", "GM proxy"]
    (level1,) = report.model_levels({"level1_accuracy", "team_accuracy"})
    assert level1.label == "level1" and level1.depth == 1
    assert level1.keys("loss") == ("level1_loss", "team_loss")  # team: the fallback of a 3-tier run


def test_depth4_level_columns_mean_and_std(tmp_path):
    make_depth4(tmp_path / "runs")
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    markdown = (tmp_path / "out" / "report.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| algorithm"))
    assert header == ("| algorithm | PM best | PM final | GM best | GM final | level1 final | level2 final "
                      "| seeds | rounds |")
    rows = table_rows(markdown, "synthetic / mclr")
    # level1 final 70, 74: mean 72, sample std sqrt(8) = 2.83; level2 final 60, 66: 63 +/- sqrt(18) = 4.24
    assert rows["permfl"]["level1 final"] == f"72.00 ± {math.sqrt(8):.2f}" == "72.00 ± 2.83"
    assert rows["permfl"]["level2 final"] == f"63.00 ± {math.sqrt(18):.2f}" == "63.00 ± 4.24"
    assert rows["permfl"]["PM final"] == "79.00 ± 1.41"  # the other columns as before
    # the 3-tier run: team as level1, no level2
    assert rows["hierfavg"]["level1 final"] == "52.00"
    assert rows["hierfavg"]["level2 final"] == "—"
    for name in ("synthetic_mclr_accuracy.png", "synthetic_mclr_loss.png"):
        assert (tmp_path / "out" / name).read_bytes()[:8] == PNG_MAGIC


def test_level_final_prefers_summary_then_last_line(tmp_path):
    run_dir = make_run(tmp_path / "r", "hierfavg", "mnist", "cnn", 0, None, FEDAVG,
                       extra={"team_accuracy": [0.1, 0.2, 0.3]})
    (run,) = report.collect_runs([run_dir])
    level1 = report.model_levels({"team_accuracy"})[0]
    assert report.final_value(run, level1.keys("accuracy")) == 0.3  # summary has no team: last line
    run.summary["final"]["team_accuracy"] = 0.35  # as hfl/output/recorder.py writes it
    assert report.final_value(run, level1.keys("accuracy")) == 0.35
    run.metrics[-1]["team_accuracy"] = None
    del run.summary["final"]["team_accuracy"]
    assert report.final_value(run, level1.keys("accuracy")) is None


def test_levels_figure_has_an_axis_per_level(tmp_path):
    rows = report.group_runs(report.collect_runs([make_depth4(tmp_path)]))[("synthetic", "mclr")]
    levels = report.group_levels(rows)
    assert [level.label for level in levels] == ["PM", "level1", "level2", "GM", "GM proxy"]
    fig = report.levels_figure(rows, levels, "accuracy", 100.0, "test accuracy (%)", "title")
    assert [ax.get_title() for ax in fig.axes] == [f"{level.label} accuracy" for level in levels]
    level1_ax, level2_ax = fig.axes[1], fig.axes[2]
    lines = {line.get_label(): line for line in level1_ax.lines}
    assert set(lines) == {"permfl (n=2)", "hierfavg (n=1)"}
    assert list(lines["hierfavg (n=1)"].get_ydata()) == pytest.approx([25, 50, 52])  # team_* as level1
    assert list(lines["permfl (n=2)"].get_ydata()) == pytest.approx([40, 73.5, 72])
    (permfl_level2,) = level2_ax.lines  # hierfavg has no level2; round 1 not evaluated (null)
    assert list(permfl_level2.get_xdata()) == [2, 3]
    assert list(permfl_level2.get_ydata()) == pytest.approx([63, 63])
    pm_ax = fig.axes[0]  # hierfavg has no PM (null keys): no line, the others still plotted
    assert [line.get_label() for line in pm_ax.lines] == ["permfl (n=2)"]
