"""hfl-report: tables and plots from a set of run directories.

    hfl-report multirun/2026-01-01/12-00-00 outputs/ --out report --paper paper.yaml

Each path is a run directory (one holding ``summary.json``, as hfl/output/recorder.py writes it)
or any directory with run directories below it at any depth (a Hydra multirun, outputs/).
Runs are grouped by (dataset, model), then by algorithm; the seeds of one algorithm are
aggregated. Writes ``OUT/report.md`` with one table per dataset/model (the console gets a short
summary: where the report went and each row's final PM and GM) and, per dataset/model, ``<dataset>_<model>_accuracy.png`` and
``<dataset>_<model>_loss.png`` with one panel per model level per global round.

Model levels, named alike in every output (console, report.md, hfl-report, the trackers): PM
(the devices' personal models, ``pm_*`` in metrics.jsonl), ``level<d>`` for the inner servers'
models of each depth d >= 1 (``level{d}_*``; metrics.jsonl's ``team_*`` repeats ``level1_*``, the
teams of a 3-tier run, and is read where a run lacks ``level1_*``), GM (the root's model, level 0:
``gm_*``), GM proxy (the root's model on its proxy test set, ``gm_proxy_*``) and any other model an
algorithm evaluates (``<name>_accuracy``, e.g. ``pflego_accuracy``). Any of them may be absent or
null in a line.

hfl-simulate draws every run with these helpers (hfl.output.run_report): ``accuracy.png``,
``loss.png`` (a line per model level) and ``report.md`` in the run directory.

Conventions:

* Accuracies are in percent: mean +/- sample standard deviation (n - 1) over the seeds of
  a row; the number of seeds is in the "seeds" column. A single seed shows the value
  alone, with no "+/-" (a std of one sample is undefined, and "+/- 0.00" would claim a
  spread of zero). "best" is each run's best evaluated round (summary.json), averaged
  over seeds; "final" its last evaluated round.
* A model an algorithm does not have (no GM for a purely personalized method, no PM for
  FedAvg) shows "—". If only some seeds of a row have the value, the cell says
  ``(n=k)``.
* Rounds: the "rounds" column lists every distinct ``rounds`` of the row's summaries;
  runs of one dataset/model that disagree on rounds also produce a warning (stderr),
  since their "final" then means different rounds.
* A row holds the runs of one algorithm whose configs (the one each run recorded,
  ``checkpoints/config.json``, deployed runs included; Hydra's ``.hydra/config.yaml`` for a run
  without it) agree in everything but the seed
  (and how they ran: runtime, resume, overwrite, logger); runs of other configs get rows of
  their own, with a warning, labelled by the keys that differ (last part of the key, at most
  LABEL_WIDTH characters, then ``+N``: the plots' legends stay short); a "Configurations" table under
  the dataset/model's table gives those keys in full and a run of each row. A malformed run directory
  is named and skipped.
* Client mean: where some run of a table reports ``client_mean_accuracy`` (the unweighted
  mean over devices of each device's PM accuracy, the FeMAM paper's figure; the PM columns
  pool every test sample instead), the table gets "client mean best" and "client mean final"
  columns, read from summary.json as the PM ones are. Each level's own client mean
  (``<level>_client_mean_accuracy``) is a figure of that level, not a model level: no panel.
* Inner levels: a table gets a "level{d} final" column per depth d that some of its runs
  report (``team_*`` as level1): each run's value at its last evaluated round (summary.json's
  "final" where it has it, else the last metrics.jsonl line). Tables whose runs report no
  inner level have no such column.
* Plots: one panel per model level that some run of the dataset/model reports, in the
  order PM, level1, level2, ..., GM, GM proxy (PM and GM when no run reports any); one
  line per algorithm, the mean over seeds at each evaluated round (over the seeds that
  evaluated it), with a shaded band from the seeds' minimum to maximum.
* ``--paper FILE`` (YAML or JSON): ``{"dataset/model": {algorithm: {pm: x, gm: y}}}`` in
  percent; adds "paper PM" and "paper GM" columns (and "paper pflego" / "paper client mean"
  where the file gives ``pflego`` / ``client_mean`` numbers). Missing entries show "—". The file's
  ``setting: {"*" | "dataset/model": {dotted config key: value}}`` says what the paper ran; runs
  that differ get a warning (one line per dataset/model) and a "Not the paper's setting" line under
  their table; a file without it is warned about once.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hfl.errors import file_system_message
from hfl.state.store import atomic_write_bytes

DASH = "—"
MODELS = ("pm", "gm")
CLIENT_MEAN = "client_mean"  # client_mean_accuracy: the devices' PM accuracies, unweighted mean (hfl.node.evaluation)
# Paper-file keys: pm, gm, pflego (the PFLEGO paper's figure, our pflego_accuracy) and
# client_mean (the FeMAM paper's figure, our client_mean_accuracy).
PAPER_KEYS = (*MODELS, "pflego", CLIENT_MEAN)
PAPER_LABELS = {"pm": "PM", "gm": "GM", "pflego": "pflego", CLIENT_MEAN: "client mean"}
KINDS = ("best", "final")
# May differ between the seeds of one row: how a run ran, not what it computed.
IGNORED_CONFIG_KEYS = ("seed", "runtime", "resume", "overwrite", "logger")


def fail(message: str) -> SystemExit:
    return SystemExit(f"hfl-report: {message}")


def warn(message: str) -> None:
    print(f"hfl-report: warning: {message}", file=sys.stderr)


@dataclass
class Run:
    path: Path
    algorithm: str
    dataset: str
    model: str
    summary: dict
    metrics: list[dict]
    config: dict | None = None
    seed: int | None = None

    @property
    def rounds(self) -> int | None:
        return self.summary.get("rounds")


@dataclass(frozen=True)
class Level:
    """One model level: how columns and the placeholder name it, its panel title, and the
    metric-name prefixes that hold it (the first one with a value wins)."""

    name: str
    label: str
    prefixes: tuple[str, ...]
    depth: int | None = None  # inner levels only

    def keys(self, quantity: str) -> tuple[str, ...]:
        return tuple(f"{prefix}_{quantity}" for prefix in self.prefixes)


PM = Level("PM", "PM", ("pm",))
GM = Level("GM", "GM", ("gm",))
GM_PROXY = Level("GM proxy", "GM proxy", ("gm_proxy",))
# What the names mean, said once where a reader meets them (report.md), with the paper's 3-tier word.
LEVEL_KEY_TEXT = ("PM: the devices' personalized models; level1, level2, ...: the models of the servers at depth "
                  "1, 2, ... (level1: the teams of a three-tier tree); GM: the root's global model (level 0)")
# Not a model level: the PM accuracies' unweighted mean over devices (FeMAM's figure); accuracy only.
CLIENT_MEAN_PANEL = Level("client mean", "PM client mean (unweighted over devices)", ("client_mean",))
LEVEL_KEY = re.compile(r"(pm|gm|gm_proxy|team|level([1-9][0-9]*))_(?:accuracy|loss)")
# Any other model an algorithm evaluates (e.g. pflego_accuracy) is a level of its own;
# level<d> names outside LEVEL_KEY (level0, level01) are not models, nor are client means
# (client_mean_accuracy, <level>_client_mean_accuracy: a figure of a level, hfl.node.evaluation).
OTHER_MODEL_KEY = re.compile(r"(?!level[0-9])(?!(?:[a-z0-9_]*_)?client_mean_accuracy$)([a-z][a-z0-9_]*)_accuracy")


def model_levels(keys: Iterable[str]) -> list[Level]:
    """The model levels that these metric names (those with a value) show, in the order
    PM, level1, level2, ..., GM, GM proxy, then any other ``<name>_accuracy`` by name.
    team_* is level1 (named level1 alike), the fallback of a run without level1_*."""
    keys = set(keys)
    prefixes = {match.group(1) for key in keys if (match := LEVEL_KEY.fullmatch(key))}
    depths = {int(prefix.removeprefix("level")) for prefix in prefixes if prefix.startswith("level")}
    if "team" in prefixes:
        depths.add(1)
    inner = [Level(f"level{d}", f"level{d}", ("level1", "team") if d == 1 else (f"level{d}",), d)
             for d in sorted(depths)]
    known = {"pm", "gm", "gm_proxy", "team"}
    others = sorted({match.group(1) for key in keys if (match := OTHER_MODEL_KEY.fullmatch(key))} - known)
    return ([level for level in (PM,) if level.prefixes[0] in prefixes] + inner
            + [level for level in (GM, GM_PROXY) if level.prefixes[0] in prefixes]
            + [Level(name, name, (name,)) for name in others])


def present_keys(runs: Iterable[Run]) -> set[str]:
    """Names of the metrics that some run gives a value (metrics.jsonl lines, summary.json's final)."""
    return {key for run in runs for record in (*run.metrics, run.summary.get("final") or {})
            for key, value in record.items() if value is not None}


def first_value(record: dict, keys: Sequence[str]) -> float | None:
    """The value of the first of keys that record has as a finite number."""
    for key in keys:
        value = record.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            return float(value)
    return None


@dataclass
class Row:
    """One configuration of an algorithm on one dataset/model: its runs (one per seed)."""

    algorithm: str
    runs: list[Run] = field(default_factory=list)
    # Set where the algorithm has runs of several configurations: the keys that tell this one apart,
    # short (a legend entry); ``differing``: those keys in full (the report's configurations table).
    label: str = ""
    differing: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.label or self.algorithm


def group_levels(rows: dict[str, Row]) -> list[Level]:
    """The model levels that some run of these rows reports."""
    return model_levels(present_keys(run for row in rows.values() for run in row.runs))


# ---------------------------------------------------------------- reading runs


def find_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Run directories (those holding summary.json) at or below each path, sorted, unique."""
    found: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise fail(f"{path}: no such file or directory")
        if path.is_file():
            if path.name != "summary.json":
                raise fail(f"{path}: not a run directory (expected a directory or a summary.json)")
            path = path.parent
        runs = {p.parent.resolve() for p in path.rglob("summary.json")}
        for metrics in path.rglob("metrics.jsonl"):
            if metrics.parent.resolve() not in runs:
                warn(f"{metrics.parent}: metrics.jsonl but no summary.json (unfinished run?), skipped")
        if not runs:
            raise fail(f"{path}: no runs found (no summary.json at or below it)")
        found |= runs
    if not found:
        raise fail("no runs found")
    return sorted(found)


def read_text(path: Path) -> str:
    """A run's or paper's file as text; one that cannot be read is named (the run is skipped)."""
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise fail(f"{path}: not a text file (damaged?)") from None
    except OSError as exc:
        raise fail(f"{path}: cannot be read: {exc.strerror or exc}") from None


def read_json(path: Path) -> dict:
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise fail(f"{path}: malformed JSON: {exc}") from None
    if not isinstance(data, dict):
        raise fail(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl: one JSON object per evaluated round; a missing file is no rounds."""
    if not path.exists():
        return []
    lines = []
    for number, text in enumerate(read_text(path).splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as exc:
            raise fail(f"{path}:{number}: malformed JSON line: {exc}") from None
        if not isinstance(line, dict) or not isinstance(line.get("round"), int):
            raise fail(f"{path}:{number}: expected a JSON object with an integer 'round'")
        lines.append(line)
    return lines


RECORDED_CONFIG = Path("checkpoints") / "config.json"  # hfl.state.resume.CONFIG (no import: a cycle)


def read_config(run_dir: Path) -> dict | None:
    """The config the run recorded when it began (``checkpoints/config.json``; deployed runs have
    one too), else Hydra's ``.hydra/config.yaml`` (a run of an hfl before it recorded one)."""
    recorded = run_dir / RECORDED_CONFIG
    if recorded.exists():
        return read_json(recorded)
    path = run_dir / ".hydra" / "config.yaml"
    if not path.exists():
        return None
    try:
        config = yaml.safe_load(read_text(path))
    except yaml.YAMLError as exc:
        raise fail(f"{path}: malformed YAML: {exc}") from None
    return config if isinstance(config, dict) else None


def load_run(run_dir: Path) -> Run:
    summary_path = run_dir / "summary.json"
    summary = read_json(summary_path)
    missing = [key for key in ("algorithm", "dataset", "model") if not summary.get(key)]
    if missing:
        raise fail(f"{summary_path}: summary lacks {', '.join(missing)}")
    config = read_config(run_dir)
    seed = config.get("seed") if config else None
    if seed is None:
        seed = summary.get("seed")
    return Run(path=run_dir, algorithm=str(summary["algorithm"]), dataset=str(summary["dataset"]),
               model=str(summary["model"]), summary=summary,
               metrics=read_metrics(run_dir / "metrics.jsonl"), config=config, seed=seed)


def collect_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Every readable run at or below ``paths``; a malformed run directory is named and skipped."""
    runs, errors = [], []
    for run_dir in find_run_dirs(paths):
        try:
            runs.append(load_run(run_dir))
        except SystemExit as exc:
            errors.append(str(exc.code).removeprefix("hfl-report: "))
    if not runs:
        raise fail("no readable runs: " + "; ".join(errors))
    for error in errors:
        warn(f"{error}; skipped")
    return runs


def config_signature(run: Run) -> str:
    """What a run computed, as far as its config says: every key but the seed and how it ran."""
    if run.config is None:
        return ""
    flat = {k: v for k, v in _flatten(run.config).items() if k.split(".")[0] not in IGNORED_CONFIG_KEYS}
    return json.dumps(flat, sort_keys=True, default=str)


def group_runs(runs: Iterable[Run]) -> dict[tuple[str, str], dict[str, Row]]:
    """{(dataset, model): {row name: Row}}, both levels sorted by name. A row holds the runs of one
    algorithm whose configs agree but for the seed (and how they ran); an algorithm with runs of
    several configs gets a row per config, named by the keys that tell them apart."""
    found: dict[tuple[str, str], dict[str, dict[str, list[Run]]]] = {}
    for run in runs:
        found.setdefault((run.dataset, run.model), {}).setdefault(run.algorithm, {}) \
            .setdefault(config_signature(run), []).append(run)
    groups: dict[tuple[str, str], dict[str, Row]] = {}
    for key, algorithms in sorted(found.items()):
        rows: dict[str, Row] = {}
        for algorithm, configs in algorithms.items():
            if len(configs) == 1:
                rows[algorithm] = Row(algorithm, next(iter(configs.values())))
                continue
            differing = config_differences([run for runs_ in configs.values() for run in runs_])
            for runs_ in configs.values():
                label = short_label(algorithm, runs_[0].config, differing)
                if label in rows:  # cut short alike: numbered (the configurations table tells them apart)
                    label = f"{label} #{sum(name.startswith(label) for name in rows) + 1}"
                rows[label] = Row(algorithm, runs_, label, differing)
        groups[key] = dict(sorted(rows.items()))
    return groups


LABEL_WIDTH = 40  # characters of a row's label (a plot's legend entry) at most, the algorithm's name aside


def config_value(value: object) -> str:
    """A config value as a label or table shows it: scalars bare, lists and maps as compact JSON."""
    return value if isinstance(value, str) else json.dumps(value, default=str, separators=(",", ":"))


def short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Each dotted key by its last part (``algorithm.lam`` -> ``lam``), or in full where two
    keys share that part."""
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {key: part if last.count(part) == 1 else key for key, part in zip(keys, last, strict=True)}


def short_label(algorithm: str, config: dict | None, differing: Sequence[str]) -> str:
    """``algorithm key=value, ...``: the keys that tell this configuration apart, shortened, as many as
    fit in LABEL_WIDTH characters, then ``+N`` (the report's configurations table has them all)."""
    if config is None:
        return f"{algorithm} (no config)"
    flat, names = _flatten(config), short_keys(differing)
    pairs = [f"{names[key]}={config_value(flat.get(key))}" for key in differing]
    shown: list[str] = []
    for pair in pairs:
        if shown and len(", ".join([*shown, pair])) > LABEL_WIDTH:
            break
        shown.append(pair if len(pair) <= LABEL_WIDTH else pair[:LABEL_WIDTH - 1] + "…")
    rest = len(pairs) - len(shown)
    return f"{algorithm} {', '.join(shown)}" + (f", +{rest}" if rest else "")


def configurations_table(rows: dict[str, Row]) -> str:
    """Rows whose label stands for a configuration: every key that differs in full, and a run of it
    (its checkpoints/config.json holds the whole config). Empty when no row has such a label."""
    labelled = [row for row in rows.values() if row.label]
    if not labelled:
        return ""
    lines = ["| row | keys that differ | a run of it |", "|:---|:---|:---|"]
    for row in labelled:
        flat = _flatten(row.runs[0].config) if row.runs[0].config is not None else None
        keys = DASH if flat is None else "<br>".join(f"`{key}={config_value(flat.get(key))}`" for key in row.differing)
        lines.append(f"| {row.label} | {keys} | `{row.runs[0].path}` |")
    return "\n".join(lines)


# ---------------------------------------------------------------- checks


def _flatten(config: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def config_differences(runs: Sequence[Run]) -> list[str]:
    """Config keys (dotted) whose values differ between runs, seed and runtime.* aside."""
    flats = [_flatten(run.config) for run in runs if run.config is not None]
    keys = sorted(set().union(*flats)) if flats else []
    return [key for key in keys
            if key.split(".")[0] not in IGNORED_CONFIG_KEYS
            and len({json.dumps(flat.get(key), sort_keys=True, default=str) for flat in flats}) > 1]


def check_groups(groups: dict[tuple[str, str], dict[str, Row]]) -> list[str]:
    """Warnings about mixing: differing rounds, differing configs, repeated seeds."""
    warnings = []
    for (dataset, model), rows in groups.items():
        rounds = {run.rounds for row in rows.values() for run in row.runs}
        if len(rounds) > 1:
            detail = "; ".join(f"{row.name}: {_rounds_text(row)}" for row in rows.values())
            warnings.append(f"{dataset}/{model}: runs disagree on rounds ({detail})")
        for row in rows.values():
            seeds = [run.seed for run in row.runs if run.seed is not None]
            repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
            if repeated:
                warnings.append(f"{dataset}/{model} {row.name}: seed(s) {repeated} appear more than once: "
                                + ", ".join(str(run.path) for run in row.runs if run.seed in repeated))
        configs = {}
        for row in rows.values():
            configs.setdefault(row.algorithm, []).append(row)
        for algorithm, split in configs.items():
            if len(split) > 1:
                differing = config_differences([run for row in split for run in row.runs])
                shown = ", ".join(differing[:8]) + (", ..." if len(differing) > 8 else "")
                warnings.append(f"{dataset}/{model} {algorithm}: runs of {len(split)} configurations, reported "
                                f"apart ({shown or 'one without a config'})")
    return warnings


# ---------------------------------------------------------------- aggregation


@dataclass(frozen=True)
class Stat:
    mean: float
    std: float | None  # None for a single value
    n: int


def aggregate(values: Iterable[float | None]) -> Stat | None:
    """Mean and sample std of the non-missing values; None when all are missing."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    return Stat(statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else None, len(present))


def percent_stat(values: Iterable[float | None]) -> Stat | None:
    return aggregate(None if value is None else 100 * value for value in values)


def row_stat(row: Row, model: str, kind: str) -> Stat | None:
    """kind = best | final, model = pm | gm (or client_mean); in percent."""
    return percent_stat((run.summary.get(kind) or {}).get(f"{model}_accuracy") for run in row.runs)


def final_value(run: Run, keys: Sequence[str]) -> float | None:
    """The run's value of the first of keys at its last evaluated round: summary.json's
    "final" where it has one, else the last metrics.jsonl line."""
    value = first_value(run.summary.get("final") or {}, keys)
    return value if value is not None or not run.metrics else first_value(run.metrics[-1], keys)


def level_final_stat(row: Row, level: Level) -> Stat | None:
    """The level's final accuracy over the row's runs, in percent."""
    return percent_stat(final_value(run, level.keys("accuracy")) for run in row.runs)


def format_stat(stat: Stat | None, runs: int) -> str:
    if stat is None:
        return DASH
    text = f"{stat.mean:.2f}" if stat.std is None else f"{stat.mean:.2f} ± {stat.std:.2f}"
    return text if stat.n == runs else f"{text} (n={stat.n})"


def _rounds_text(row: Row) -> str:
    rounds = sorted({run.rounds for run in row.runs}, key=lambda r: (r is None, r))
    return ", ".join("?" if r is None else str(r) for r in rounds)


def _seeds_text(row: Row) -> str:
    seeds = sorted(run.seed for run in row.runs if run.seed is not None)
    return f"{len(row.runs)}" + (f" ({', '.join(map(str, seeds))})" if seeds else "")


# ---------------------------------------------------------------- paper numbers


@dataclass
class Paper:
    """A --paper file: its figures ``{"dataset/model": {algorithm: {pm: x, ...}}}`` and the setting
    they were measured in, as hfl config keys (``{"*" or "dataset/model": {dotted key: value}}``)."""

    figures: dict[str, dict[str, dict[str, float | None]]]
    setting: dict[str, dict[str, object]] | None = None

    def setting_of(self, dataset: str, model: str) -> dict[str, object] | None:
        """The paper's keys for this dataset/model ("*" and its own entry); None: the file states none."""
        if self.setting is None:
            return None
        return {**self.setting.get("*", {}), **self.setting.get(f"{dataset}/{model}", {})}


SETTING = "setting"  # the paper file's reserved top-level key (group keys hold a "/")


def load_paper(path: str | Path) -> Paper:
    """{"dataset/model": {algorithm: {"pm": x, "gm": y}}} from YAML or JSON (percent), and an optional
    ``setting: {"*" | "dataset/model": {dotted config key: value}}``."""
    path = Path(path)
    if not path.is_file():
        raise fail(f"{path}: paper file not found")
    try:
        data = json.loads(read_text(path)) if path.suffix == ".json" else yaml.safe_load(read_text(path))
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise fail(f"{path}: malformed paper file: {exc}") from None
    shape = 'expected {"dataset/model": {algorithm: {pm: x, gm: y}}} (also pflego, client_mean)'
    if not isinstance(data, dict):
        raise fail(f"{path}: {shape}")
    setting = data.pop(SETTING, None)
    if setting is not None and not (isinstance(setting, dict) and all(isinstance(v, dict) for v in setting.values())):
        raise fail(f"{path}: {SETTING}: expected {{\"*\" or \"dataset/model\": {{config key: value}}}}")
    paper: dict[str, dict[str, dict[str, float | None]]] = {}
    for group, algorithms in data.items():
        if not isinstance(algorithms, dict):
            raise fail(f"{path}: {group}: {shape}")
        paper[str(group)] = {}
        for algorithm, values in algorithms.items():
            if not isinstance(values, dict) or set(values) - set(PAPER_KEYS):
                raise fail(f"{path}: {group}/{algorithm}: {shape}")
            for key, value in values.items():
                if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                    raise fail(f"{path}: {group}/{algorithm}/{key}: not a number: {value!r}")
            paper[str(group)][str(algorithm)] = {m: values.get(m) for m in PAPER_KEYS}
    return Paper(paper, None if setting is None else {str(k): dict(v) for k, v in setting.items()})


def _same(a: object, b: object) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def setting_differences(paper: Paper, dataset: str, model: str, rows: dict[str, Row]) -> str | None:
    """How the runs of a dataset/model differ from the paper's setting, e.g. ``global_rounds 10 here, 400 in
    the paper``; "" when they agree, None when the paper file states no setting."""
    expected = paper.setting_of(dataset, model)
    if expected is None:
        return None
    flats = [_flatten(run.config) for row in rows.values() for run in row.runs if run.config is not None]
    missing = object()
    parts = []
    for key, value in expected.items():
        ours = []
        for flat in flats:
            have = flat.get(key, missing)
            if have is missing or not _same(have, value):
                text = "absent" if have is missing else config_value(have)
                if text not in ours:
                    ours.append(text)
        if ours:
            parts.append(f"{key} {' / '.join(ours)} here, {config_value(value)} in the paper")
    unknown = sum(run.config is None for row in rows.values() for run in row.runs)
    if unknown:
        parts.append(f"{unknown} run(s) without a recorded config not checked")
    return "; ".join(parts)


def check_paper(paper: Paper, groups: dict[tuple[str, str], dict[str, Row]]) -> list[str]:
    """Paper entries that match no run (likely a typo in the key); runs of a setting other than the
    paper's (a line per dataset/model), or a paper file that states no setting."""
    warnings = []
    if paper.setting is None:
        warnings.append("--paper: the paper file states no setting; the runs' setting is not checked against the paper's")
    for (dataset, model), rows in groups.items():
        if f"{dataset}/{model}" in paper.figures and (differences := setting_differences(paper, dataset, model, rows)):
            warnings.append(f"--paper: {dataset}/{model}: not the paper's setting: {differences}")
    for key, algorithms in paper.figures.items():
        dataset, _, model = key.partition("/")
        rows = groups.get((dataset, model))
        if rows is None:
            warnings.append(f"paper entry {key!r} matches no dataset/model among the runs")
            continue
        for algorithm in algorithms:
            if algorithm not in rows:
                warnings.append(f"paper entry {key}/{algorithm} matches no algorithm among the runs")
    return warnings


# ---------------------------------------------------------------- Markdown


def reports_client_mean(rows: dict[str, Row]) -> bool:
    """Whether some run of these rows reports ``client_mean_accuracy`` in its summary."""
    return any((run.summary.get(kind) or {}).get(f"{CLIENT_MEAN}_accuracy") is not None
               for row in rows.values() for run in row.runs for kind in KINDS)


def group_table(rows: dict[str, Row], paper: dict[str, dict[str, float | None]] | None) -> str:
    inner = [level for level in group_levels(rows) if level.depth is not None]
    # The PFLEGO paper's figure, where runs report it: each run's final mean of its last 10 rounds.
    pflego = any(final_value(run, ("pflego_accuracy",)) is not None for row in rows.values() for run in row.runs)
    # The FeMAM paper's figure, where runs report it: PM accuracy averaged over devices, unweighted.
    client_mean = reports_client_mean(rows)
    paper_keys = [k for k in PAPER_KEYS if k in MODELS or any(v.get(k) is not None for v in (paper or {}).values())]
    header = ["algorithm", "PM best", "PM final", "GM best", "GM final"]
    header += ["client mean best", "client mean final"] if client_mean else []
    header += [f"{level.name} final" for level in inner]
    header += ["pflego final"] if pflego else []
    if paper is not None:
        header += [f"paper {PAPER_LABELS[k]}" for k in paper_keys]
    header += ["seeds", "rounds"]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    for row in rows.values():
        stats = [row_stat(row, m, k) for m in MODELS for k in KINDS]
        stats += [row_stat(row, CLIENT_MEAN, k) for k in KINDS] if client_mean else []
        stats += [level_final_stat(row, lv) for lv in inner]
        stats += [percent_stat(final_value(run, ("pflego_accuracy",)) for run in row.runs)] if pflego else []
        cells = [row.name] + [format_stat(stat, len(row.runs)) for stat in stats]
        if paper is not None:
            ours = paper.get(row.algorithm, {})
            cells += [DASH if ours.get(m) is None else f"{ours[m]:.2f}" for m in paper_keys]
        cells += [_seeds_text(row), _rounds_text(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(groups: dict[tuple[str, str], dict[str, Row]], paper: Paper | None = None,
                    title: str = "hfl report", plots: dict[tuple[str, str], list[str]] | None = None) -> str:
    parts = [f"# {title}", "",
             "Test accuracy in %, mean ± sample std over seeds (a single seed: the value alone); "
             "best = each run's best evaluated round, final = its last; — = the algorithm has no such model."
             + (" Client mean: each device's PM accuracy, averaged over devices unweighted (PM pools every "
                "test sample)." if any(reports_client_mean(rows) for rows in groups.values()) else "")
             + (" Paper columns: as given in the --paper file." if paper is not None else "")]
    for (dataset, model), rows in groups.items():
        parts += ["", f"## {dataset} / {model}", "",
                  group_table(rows, None if paper is None else paper.figures.get(f"{dataset}/{model}", {}))]
        if paper is not None and f"{dataset}/{model}" in paper.figures:
            differences = setting_differences(paper, dataset, model, rows)
            parts += ["", "**Not the paper's setting**: " + differences + "." if differences
                      else "The paper file states no setting: these runs were not checked against the paper's."
                      if differences is None else "The runs' setting is the paper's (as the paper file states it)."]
        configurations = configurations_table(rows)
        if configurations:
            parts += ["", "Configurations (the keys that differ between the rows of an algorithm):", "", configurations]
        for name in (plots or {}).get((dataset, model), []):
            parts += ["", f"![{name}]({name})"]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------- plots


def curve(runs: Sequence[Run], keys: str | Sequence[str],
          x: str = "round") -> tuple[list[float], list[float], list[float], list[float]]:
    """Per evaluated round: (x, mean, min, max) over the runs that report it; with several
    keys, each line's first one that has a value. ``x="sim_time"``: x is the runs' mean simulated
    time at that round (hfl.clock), and only lines that record one count."""
    keys = (keys,) if isinstance(keys, str) else keys
    by_round: dict[int, list[float]] = {}
    times: dict[int, list[float]] = {}
    for run in runs:
        for line in run.metrics:
            value = first_value(line, keys)
            if value is not None and (x == "round" or line.get(x) is not None):
                by_round.setdefault(line["round"], []).append(value)
                if x != "round":
                    times.setdefault(line["round"], []).append(float(line[x]))
    rounds = sorted(by_round)
    xs = rounds if x == "round" else [statistics.fmean(times[r]) for r in rounds]
    return (xs, [statistics.fmean(by_round[r]) for r in rounds],
            [min(by_round[r]) for r in rounds], [max(by_round[r]) for r in rounds])


X_LABELS = {"round": "global round", "sim_time": "simulated time (s)"}


def timed(runs: Iterable[Run]) -> bool:
    """Whether some run records simulated time (clock.enabled): its plots are also drawn against it."""
    return any(line.get("sim_time") is not None for run in runs for line in run.metrics)


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"


QUANTITIES = (("accuracy", 100.0, "test accuracy (%)"), ("loss", 1.0, "test loss"))


def levels_figure(rows: dict[str, Row], levels: Sequence[Level], quantity: str, scale: float, ylabel: str,
                  title: str, x: str = "round"):
    """A matplotlib Figure with one panel per level (in a grid of at most 3 columns), one line
    per algorithm with its seeds' min-max band."""
    colors = {algorithm: f"C{i % 10}" for i, algorithm in enumerate(rows)}
    columns = len(levels) if len(levels) <= 3 else math.ceil(math.sqrt(len(levels)))
    grid_rows = math.ceil(len(levels) / columns)
    fig = new_figure(5 * columns, 4 * grid_rows)
    for index, level in enumerate(levels, start=1):
        ax = fig.add_subplot(grid_rows, columns, index)
        for algorithm, row in rows.items():
            rounds, mean, low, high = curve(row.runs, level.keys(quantity), x)
            if not rounds:
                continue
            n = len(row.runs)
            ax.plot(rounds, [scale * v for v in mean], color=colors[algorithm],
                    marker="o" if len(rounds) <= 20 else None, markersize=3,
                    label=f"{algorithm} (n={n})")
            if n > 1:
                ax.fill_between(rounds, [scale * v for v in low], [scale * v for v in high],
                                color=colors[algorithm], alpha=0.2, linewidth=0)
        finish_axes(ax, f"{level.label} {quantity}", ylabel, f"no {level.name} {quantity} in these runs", x)
    fig.suptitle(title)
    return fig


def new_figure(width: float, height: float):
    """A matplotlib Figure on the Agg canvas: no pyplot, so no display and no global state
    (safe in a server thread)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def finish_axes(ax, title: str, ylabel: str, empty: str, x: str = "round") -> None:  # noqa: ANN001 - an Axes
    """Titles, integer round ticks, grid and legend; an axes with no line says so instead."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel(X_LABELS[x])
    if x == "round":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
    else:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_group(rows: dict[str, Row], dataset: str, model: str, out_dir: Path) -> list[str]:
    """<dataset>_<model>_accuracy.png and _loss.png in out_dir, a panel per model level that
    the runs report (PM and GM when they report none); returns the file names."""
    levels = group_levels(rows) or [PM, GM]
    names = []
    axes = ["round", "sim_time"] if timed(run for row in rows.values() for run in row.runs) else ["round"]
    for x in axes:  # runs with a clock: also against simulated time (<...>_accuracy_time.png)
        for quantity, scale, ylabel in QUANTITIES:
            panels = [*levels, CLIENT_MEAN_PANEL] if quantity == "accuracy" and reports_client_mean(rows) else levels
            fig = levels_figure(rows, panels, quantity, scale, ylabel,
                                f"{dataset} / {model}: mean over seeds, band = min–max", x)
            name = f"{safe_name(dataset)}_{safe_name(model)}_{quantity}{'' if x == 'round' else '_time'}.png"
            image = io.BytesIO()  # written whole or not at all
            fig.savefig(image, format="png", dpi=120)
            atomic_write_bytes(out_dir / name, image.getvalue())
            names.append(name)
    return names


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hfl-report",
        description="Markdown table (algorithm x dataset/model; PM and GM, best and final, mean ± std over "
                    "seeds) and PNG curves per global round from hfl run directories.")
    parser.add_argument("paths", nargs="+", help="run directories, or directories with run directories below "
                                                 "them (e.g. a Hydra multirun directory)")
    parser.add_argument("--out", default="report", help="output directory (default: ./report)")
    parser.add_argument("--paper", help='YAML/JSON {"dataset/model": {algorithm: {pm: x, gm: y}}} in percent '
                                        '(also pflego, client_mean), shown as "paper" columns')
    parser.add_argument("--title", default="hfl report", help="report title")
    return parser


def console_summary(groups: dict[tuple[str, str], dict[str, Row]], out_dir: Path,
                    plots: dict[tuple[str, str], list[str]]) -> str:
    """What hfl-report prints: where the report went, and per dataset/model each row's final PM and GM
    (mean ± std over seeds, %); report.md holds the rest."""
    runs = sum(len(row.runs) for rows in groups.values() for row in rows.values())
    lines = [f"hfl-report: {runs} run(s) in {len(groups)} dataset/model group(s): {out_dir / 'report.md'}, "
             f"{sum(map(len, plots.values()))} plot(s) in {out_dir}/"]
    for (dataset, model), rows in groups.items():
        cells = [(row.name, format_stat(row_stat(row, "pm", "final"), len(row.runs)),
                  format_stat(row_stat(row, "gm", "final"), len(row.runs)), str(len(row.runs))) for row in rows.values()]
        widths = [max(len(c[i]) for c in [("", "PM final", "GM final", "seeds"), *cells]) for i in range(4)]
        lines.append(f"{dataset} / {model}: final accuracy (%)")
        for cell in [("", "PM final", "GM final", "seeds"), *cells]:
            lines.append("  " + cell[0].ljust(widths[0]) + "".join(f"  {c.rjust(w)}" for c, w in zip(cell[1:], widths[1:], strict=True)))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    paper = load_paper(args.paper) if args.paper else None
    groups = group_runs(collect_runs(args.paths))
    for message in check_groups(groups) + (check_paper(paper, groups) if paper is not None else []):
        warn(message)
    out_dir = Path(args.out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        plots = {key: plot_group(rows, *key, out_dir) for key, rows in groups.items()}
        markdown = render_markdown(groups, paper, args.title, plots)
        atomic_write_bytes(out_dir / "report.md", markdown.encode())
    except OSError as exc:  # a read-only, full or file-as-directory --out
        message = file_system_message(exc.errno, str(exc.filename or out_dir), key="--out") if exc.errno else None
        raise fail(message or f"--out: {out_dir}: {exc}") from None
    print(console_summary(groups, out_dir, plots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
