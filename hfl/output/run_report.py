"""One run's own report, which hfl-simulate writes at the end of every run: ``accuracy.png``,
``loss.png`` (a line per model level) and ``report.md`` (config, final/best per level, seconds,
bytes per level) in the run directory. Reads runs and draws with hfl.output.report's helpers."""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hfl.output.report import (
    DASH,
    LEVEL_KEY_TEXT,
    timed,
    GM,
    PM,
    QUANTITIES,
    Level,
    Run,
    _flatten,
    curve,
    final_value,
    finish_axes,
    first_value,
    load_run,
    model_levels,
    new_figure,
    present_keys,
)
from hfl.state.store import atomic_write_bytes


def _checkpoint_warnings(run_dir: Path) -> list[str]:
    """The warnings a run's last checkpoint kept (a report drawn again after a kill)."""
    from hfl.state.resume import read_checkpoint  # a cycle at import time otherwise (resume -> recorder)

    try:
        checkpoint = read_checkpoint(run_dir)
    except Exception:  # noqa: BLE001 - a damaged checkpoint costs the report its warnings, nothing else
        return []
    return list(checkpoint.recorder.get("warnings", [])) if checkpoint is not None else []


@dataclass(frozen=True)
class LevelResult:
    """One model level of one run: accuracy (a fraction) at the last evaluated round and at
    the best one."""

    level: Level
    final: float | None
    best: float | None
    best_round: int | None


def run_levels(run: Run) -> list[Level]:
    """The run's model levels (PM, level1, ..., GM, ...)."""
    return model_levels(present_keys([run]))


def level_results(run: Run) -> list[LevelResult]:
    """Final and best accuracy of every model level the run reports; the best round is the
    first that reached the best value."""
    results = []
    for level in run_levels(run):
        keys = level.keys("accuracy")
        evaluated = [(value, line["round"]) for line in run.metrics if (value := first_value(line, keys)) is not None]
        best, best_round = max(evaluated, key=lambda pair: (pair[0], -pair[1])) if evaluated else (None, None)
        results.append(LevelResult(level, final_value(run, keys), best, best_round))
    return results


TRAFFIC_KEY = re.compile(r"total_bytes_(?:down|up)_level([0-9]+)")


# What a traffic row is, where its numbers are shown.
TRAFFIC_TEXT = "between each level's servers and their children"


def traffic_rows(summary: dict) -> list[tuple[str, int, int]]:
    """(level, bytes down, bytes up) over the run: ``level<d>`` = what the servers at depth d sent
    to their children and received from them (level0: the root's edges), as the models are named."""
    depths = sorted({int(match.group(1)) for key in summary if (match := TRAFFIC_KEY.fullmatch(key))})
    if not depths:  # a summary of before per-level counters: the root's edges, then every edge below summed
        return [(name, int(summary.get(f"total_bytes_down_{tier}", 0)), int(summary.get(f"total_bytes_up_{tier}", 0)))
                for name, tier in (("level0", "global"), ("level1+", "team"))]
    return [(f"level{d}", int(summary.get(f"total_bytes_down_level{d}", 0)),
             int(summary.get(f"total_bytes_up_level{d}", 0))) for d in depths]


def human_bytes(count: float) -> str:
    """Decimal units, three significant digits: 647 kB, 38.8 MB."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(count) < 999.5:
            return f"{count:.0f} {unit}" if unit == "B" or abs(count) >= 99.95 else f"{count:.3g} {unit}"
        count /= 1000
    return f"{count:.3g} TB"


def run_title(run: Run) -> str:
    return f"{run.algorithm} on {run.dataset} / {run.model}"


def run_figure(run: Run, levels: Sequence[Level], quantity: str, scale: float, ylabel: str, title: str,
               x: str = "round"):
    """One axes with a line per model level: a single run's levels side by side, which is
    what personalization is about (PM against team against GM)."""
    fig = new_figure(7, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    for index, level in enumerate(levels):
        rounds, values, _, _ = curve([run], level.keys(quantity), x)
        if rounds:
            ax.plot(rounds, [scale * v for v in values], color=f"C{index % 10}",
                    marker="o" if len(rounds) <= 20 else None, markersize=3, label=level.label)
    finish_axes(ax, f"{quantity} per global round" if x == "round" else f"{quantity} over simulated time", ylabel,
                f"no {quantity} in this run", x)
    fig.suptitle(title)
    return fig


def plot_run(run: Run, out_dir: Path) -> list[str]:
    """accuracy.png and loss.png in out_dir; returns the file names."""
    levels = run_levels(run) or [PM, GM]
    names = []
    for x in ["round", "sim_time"] if timed([run]) else ["round"]:  # a clock: also accuracy_time.png
        for quantity, scale, ylabel in QUANTITIES:
            name = f"{quantity}{'' if x == 'round' else '_time'}.png"
            image = io.BytesIO()  # drawn whole, then written atomically: a killed run leaves no half a PNG
            run_figure(run, levels, quantity, scale, ylabel, run_title(run), x).savefig(image, format="png", dpi=110)
            atomic_write_bytes(out_dir / name, image.getvalue())
            names.append(name)
    return names


def _percent(value: float | None) -> str:
    return DASH if value is None else f"{100 * value:.2f}"


def _settings(config: dict | None, section: str) -> str:
    """A config group's values as `key=value, ...` (the name aside)."""
    values = _flatten((config or {}).get(section) or {})
    return ", ".join(f"{key}={value}" for key, value in values.items() if key != "name")


def clock_line(config: dict) -> str | None:
    """``- simulated time: policy ...`` for a run with the clock on (None without): the policy of every
    inner level (a list: root first) and the keys that policy reads."""
    clock = config.get("clock")
    if not isinstance(clock, dict) or not clock.get("enabled"):
        return None
    policy = clock.get("policy")
    policies = policy if isinstance(policy, list) else [policy]
    text = ("policy " + ", ".join(map(str, policies)) + " (root first)" if isinstance(policy, list)
            else f"policy {policy} (every inner level)")
    details = []
    if "deadline" in policies:
        details += [f"deadline {clock.get('deadline')} s", f"min_replies {clock.get('min_replies')}",
                    f"late {clock.get('late')}"]
    if "buffered" in policies:
        details += [f"buffer {clock.get('buffer')}", f"concurrency {clock.get('concurrency')}",
                    f"max_staleness {clock.get('max_staleness')}"]
    speed = clock.get("speed") or {}
    details.append(f"speeds {speed.get('distribution')}")
    return f"- simulated time (clock): {text}; " + ", ".join(details)


def privacy_line(config: dict, run: Run) -> str | None:
    """``- differential privacy: ...`` for a run with a privacy level (None without): where, C, the
    noise multiplier, δ and the ε of its last evaluated round (hfl.node.privacy)."""
    privacy = config.get("privacy")
    if not isinstance(privacy, dict) or str(privacy.get("level", "off")).lower() in ("off", "false", "none"):
        return None
    level = str(privacy["level"])
    where = "local (each device noises its own update)" if level == "local" else f"central at level {level}"
    clip = "adaptive from " + str(privacy.get("clip")) if privacy.get("adaptive") else str(privacy.get("clip"))
    spent = [line["dp_epsilon"] for line in run.metrics if line.get("dp_epsilon") is not None]
    epsilon = f"; ε = {spent[-1]:.4g} after round {run.metrics[-1].get('round')}" if spent else ""
    budget = f" (budget {privacy['target_epsilon']})" if privacy.get("target_epsilon") is not None else ""
    stopped = f"; {run.summary['stopped']}" if run.summary.get("stopped") else ""
    return (f"- differential privacy: {where}, clip {clip}, noise multiplier {privacy.get('noise_multiplier')}, "
            f"δ {privacy.get('delta')}{epsilon}{budget}{stopped}")


def run_markdown(run: Run, plots: Sequence[str], warnings: Sequence[str] = ()) -> str:
    """report.md of one run: what ran, final and best accuracy per model level, time, bytes, the
    warnings the console showed during the run, plots."""
    config = run.config or {}
    parts = [f"# {run_title(run)}", ""]
    for section, name in (("algorithm", run.algorithm), ("dataset", run.dataset), ("model", run.model)):
        settings = _settings(config, section)
        parts.append(f"- {section}: `{name}`" + (f" ({settings})" if settings else ""))
    parts += [f"- global rounds: {run.rounds}, seed: {DASH if run.seed is None else run.seed}"
              + (f", runtime: {config['runtime'].get('name')}" if isinstance(config.get("runtime"), dict) else "")]
    if (clock := clock_line(config)) is not None:
        parts.append(clock)
    if (privacy := privacy_line(config, run)) is not None:
        parts.append(privacy)
    parts += ["", "Test accuracy in % (pooled over devices); final = the last evaluated round, "
              f"best = the best evaluated round. {LEVEL_KEY_TEXT}.", "",
              "| model | final | best | best round |", "|:---|---:|---:|---:|"]
    for result in level_results(run):
        parts.append(f"| {result.level.label} | {_percent(result.final)} | {_percent(result.best)} | "
                     f"{DASH if result.best_round is None else result.best_round} |")
    per_round = run.summary.get("seconds_per_round")
    parts += ["", f"Seconds per round: {DASH if per_round is None else f'{per_round:.2f}'} (median over the rounds "
              f"after the first); total {run.summary.get('total_seconds', 0):.1f} s; "
              f"failures: {run.summary.get('failures', 0)}.", "",
              f"Model bytes {TRAFFIC_TEXT}:", "",
              "| level | bytes down | bytes up |", "|:---|---:|---:|"]
    parts += [f"| {level} | {human_bytes(down)} | {human_bytes(up)} |" for level, down, up in traffic_rows(run.summary)]
    if warnings:
        parts += ["", "## Warnings", "", *(f"- {text}" for text in warnings)]
    for name in plots:
        parts += ["", f"![{name}]({name})"]
    return "\n".join(parts) + "\n"


def write_run_report(run_dir: str | Path, warnings: Sequence[str] | None = None) -> list[Path]:
    """accuracy.png, loss.png and report.md in a finished run's directory (summary.json and
    metrics.jsonl written), each written whole or not at all; returns their paths. ``warnings``:
    the console's warnings of the run (None: those of the run's last checkpoint)."""
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    plots = plot_run(run, run_dir)
    if warnings is None:
        warnings = _checkpoint_warnings(run_dir)
    atomic_write_bytes(run_dir / "report.md", run_markdown(run, plots, warnings).encode())
    return [run_dir / name for name in (*plots, "report.md")]
