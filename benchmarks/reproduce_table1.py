"""Reproduce PerMFL's Table 1: every algorithm of the table on the table1_* presets, several
seeds, then ``hfl-report`` per setting with the paper's numbers beside ours.

One run per (setting, algorithm, seed), each a separate process (forked from an interpreter that
has already imported torch and Flower, benchmarks/preloaded.py; ``--fresh-processes``: started anew):

    hfl-simulate experiment=table1_<setting> algorithm=<alg> seed=<s> runtime=inprocess \\
        global_rounds=<N> [dataset.root=<MNIST root>] hydra.run.dir=<out>/<setting>/<alg>/seed<s>

then ``hfl-report <out>/<setting> --out <out>/report/<setting> --paper benchmarks/table1_paper.yaml``.

* Resumable: a run whose ``summary.json`` already has the requested rounds (and whose
  ``.hydra/overrides.yaml`` lists the same overrides) is skipped; an unfinished or
  different run in that directory is deleted and run again (its ``state/`` would
  otherwise seed the new run's personalized models).
* A failed run is recorded (exit status, log in ``<out>/logs/``) and the sweep goes on; the
  script exits 1 if any run failed.
* Prints each run's wall seconds and seconds per global round, the total wall time, and an
  estimate of the sweep's duration at other round counts, to plan a longer sweep.
* Default algorithms: Table 1's rows that hfl implements (Per-FedAvg = ``perfedavg``,
  h-SGD = ``hierfavg``); pFedBayes only in the MCLR settings, as in the table.
  MNIST reads the official test split from ``../shared/data`` (next to the repository),
  or ``--mnist-root``.

    .venv/bin/python benchmarks/reproduce_table1.py --rounds 100 --jobs 2
    .venv/bin/python benchmarks/reproduce_table1.py --dry-run            # the commands only
    .venv/bin/python benchmarks/reproduce_table1.py --settings mnist_cnn --rounds 5 --seeds 0

On a GPU every run uses it (``runtime.device=auto``); a mnist_cnn run holds ~6 GB of GPU memory
(its four teams' devices step together, hfl.node.lockstep): on an 80 GB H100 under CUDA MPS
``--jobs 12`` fit (76 GB at the peak) and ``--jobs 24`` did not (15 runs out of memory in their
first round; rerun by resuming with fewer jobs). See docs/runtimes.md, "The GPU".
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

import preloaded  # benchmarks/preloaded.py, beside this script

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
PAPER = Path(__file__).resolve().parent / "table1_paper.yaml"
MNIST_ROOT = REPO.parent / "shared" / "data"

# How a run computes, not what (the same models whatever it is): set by --jobs, ignored when a
# finished run is compared with the job it would be.
GROUP_THREADS = "runtime.batched_threads="
SETTINGS = ("synthetic_mclr", "synthetic_dnn", "mnist_mclr", "mnist_cnn")
DEFAULT_SETTINGS = ("synthetic_mclr", "synthetic_dnn", "mnist_mclr")  # mnist_cnn: minutes per round on CPU
# Table 1's algorithms, in the table's order (h-SGD = hierfavg); pFedBayes is in its MCLR half only.
TABLE1_CONVEX = ("fedavg", "perfedavg", "pfedme", "pfedbayes", "ditto", "hierfavg", "al2gd", "demlearn", "permfl")
TABLE1_NONCONVEX = tuple(a for a in TABLE1_CONVEX if a != "pfedbayes")
ESTIMATE_ROUNDS = (50, 100, 200)
SAFE = re.compile(r"^[A-Za-z0-9_./+:~-]+$")
# hfl-simulate runs are forked from an interpreter that has imported torch and Flower once
# (benchmarks/preloaded.py), not started afresh; --fresh-processes turns this off.
PRELOADED = True


@dataclass
class Job:
    setting: str
    algorithm: str
    seed: int
    rounds: int
    run_dir: Path
    log: Path
    command: list[str]
    overrides: list[str]           # the task overrides (as hydra stores them in overrides.yaml)
    status: str = "pending"        # pending | done (skipped: already complete) | ok | failed
    wall: float | None = None      # seconds of this process
    summary: dict | None = None
    error: str = ""


def computes(overrides: list[str]) -> list[str]:
    """The overrides that decide what a run computes, sorted (``GROUP_THREADS`` left out)."""
    return sorted(o for o in overrides if not o.startswith(GROUP_THREADS))


def hydra_value(value: str) -> str:
    """A value for a Hydra override: quoted unless plainly safe (paths with spaces etc.)."""
    if SAFE.match(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def tool(name: str, module: str) -> list[str]:
    """The venv's console script next to this interpreter, else ``python -m module``."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def preset_rounds(setting: str) -> int:
    path = CONF / "experiment" / f"table1_{setting}.yaml"
    rounds = (yaml.safe_load(path.read_text()) or {}).get("global_rounds")
    if not isinstance(rounds, int):
        raise SystemExit(f"reproduce_table1: {path}: no integer global_rounds")
    return rounds


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_seeds(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """``--seeds``: one or more comma-separated integers >= 0, or a parser error."""
    try:
        seeds = [int(s) for s in split_list(text)]
    except ValueError:
        parser.error(f"--seeds: expected comma-separated integers, got {text!r}")
    if not seeds or min(seeds) < 0:
        parser.error("--seeds: need one or more seeds >= 0")
    return seeds


def hfl_report(label: str, runs: list[Path], out_dir: Path, title: str, paper: Path | None = None) -> bool:
    """``hfl-report`` over ``runs`` (run or sweep folders) into ``out_dir``; True if it succeeded."""
    command = tool("hfl-report", "hfl.output.report") + [str(r) for r in runs] + ["--out", str(out_dir), "--title", title]
    if paper is not None:
        command += ["--paper", str(paper)]
    print(f"\n== {label}: {shlex.join(command)}", flush=True)
    return subprocess.run(command, check=False, cwd=REPO).returncode == 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                        help=f"comma list of {', '.join(SETTINGS)} (default: %(default)s)")
    parser.add_argument("--algorithms", default=None,
                        help="comma list of conf/algorithm names for every setting (default: Table 1's rows "
                             f"that hfl implements: {','.join(TABLE1_CONVEX)}; no pfedbayes for dnn/cnn)")
    parser.add_argument("--seeds", default="0,1,2", help="comma list of seeds (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="global rounds for every run (default: each preset's global_rounds, the paper's T)")
    parser.add_argument("--out", default=str(REPO / "outputs" / "table1"), help="output folder (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (default: 1; each uses one torch thread)")
    parser.add_argument("--mnist-root", default=str(MNIST_ROOT),
                        help="folder holding MNIST/raw (default: ../shared/data next to the repository)")
    parser.add_argument("--paper", default=str(PAPER), help="paper numbers for hfl-report (default: %(default)s)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Hydra override for every run (repeatable), e.g. --override eval_every=5")
    parser.add_argument("--no-report", action="store_true", help="run only, no hfl-report")
    parser.add_argument("--fresh-processes", action="store_true",
                        help="start each run as a new hfl-simulate process (default: forked from an interpreter "
                             "that has already imported torch and Flower, ~3 s less a run; benchmarks/preloaded.py)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit; runs and deletes nothing")
    args = parser.parse_args(argv)

    args.settings = split_list(args.settings)
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown or not args.settings:
        parser.error(f"--settings: unknown {unknown or 'empty'}; choose from {', '.join(SETTINGS)}")
    if args.algorithms is not None:
        args.algorithms = split_list(args.algorithms)
        missing = [a for a in args.algorithms if not (CONF / "algorithm" / f"{a}.yaml").is_file()]
        if missing or not args.algorithms:
            known = sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml"))
            parser.error(f"--algorithms: unknown {missing or 'empty'}; known: {', '.join(known)}")
    args.seeds = parse_seeds(parser, args.seeds)
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds: must be >= 1")
    if args.jobs < 1:
        parser.error("--jobs: must be >= 1")
    args.out = Path(args.out).resolve()
    args.mnist_root = Path(args.mnist_root).resolve()
    return args


def algorithms_for(setting: str, chosen: list[str] | None) -> list[str]:
    if chosen is not None:
        return chosen
    return list(TABLE1_CONVEX if setting.endswith("_mclr") else TABLE1_NONCONVEX)


def build_jobs(args: argparse.Namespace) -> list[Job]:
    simulate = tool("hfl-simulate", "hfl.runtime.simulate")
    jobs = []
    for setting in args.settings:
        rounds = args.rounds if args.rounds is not None else preset_rounds(setting)
        for algorithm in algorithms_for(setting, args.algorithms):
            for seed in args.seeds:
                run_dir = args.out / setting / algorithm / f"seed{seed}"
                overrides = [f"experiment=table1_{setting}", f"algorithm={algorithm}", f"seed={seed}",
                             "runtime=inprocess", f"global_rounds={rounds}"]
                if setting.startswith("mnist"):
                    overrides.append(f"dataset.root={hydra_value(str(args.mnist_root))}")
                overrides += args.override
                command = simulate + overrides + [f"hydra.run.dir={hydra_value(str(run_dir))}"]
                log = args.out / "logs" / setting / f"{algorithm}_seed{seed}.log"
                jobs.append(Job(setting, algorithm, seed, rounds, run_dir, log, command, overrides))
    return jobs


def read_summary(run_dir: Path) -> dict | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return summary if isinstance(summary, dict) else None


def is_complete(job: Job) -> bool:
    """summary.json with the requested rounds, and (when Hydra recorded them) the same overrides."""
    summary = read_summary(job.run_dir)
    if summary is None or summary.get("rounds") != job.rounds:
        return False
    recorded = job.run_dir / ".hydra" / "overrides.yaml"
    if recorded.exists():
        try:
            if computes(yaml.safe_load(recorded.read_text()) or []) != computes(job.overrides):
                return False
        except yaml.YAMLError:
            return False
    job.summary = summary
    return True


# Enough for a global round's error to reach the first device failure it nests (e.g. CUDA out of memory).
ERROR_CHARS = 900


def last_error(log: Path) -> str:
    """The most telling line of a failed run's log: the last error-looking one, else the last."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    for line in reversed(lines):
        if re.search(r"Error|error|Exception|hfl-simulate:", line):
            return line[:ERROR_CHARS]
    return lines[-1][:ERROR_CHARS] if lines else "(empty log)"


def pct(value: float | None) -> str:
    return "  -  " if value is None else f"{100 * value:5.2f}"


def execute(job: Job) -> Job:
    if job.run_dir.exists():
        shutil.rmtree(job.run_dir)  # an unfinished or different run: start clean (state/ included)
    job.log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    simulate = tool("hfl-simulate", "hfl.runtime.simulate")
    forked = PRELOADED and preloaded.available() and job.command[:len(simulate)] == simulate
    with job.log.open("w") as log:
        log.write("$ " + shlex.join(job.command) + (" (forked from a preloaded interpreter)" if forked else "") + "\n")
        log.flush()
        if forked:
            rc = preloaded.run_simulate(["hfl-simulate", *job.command[len(simulate):]], job.log, REPO)
        else:
            rc = subprocess.run(job.command, check=False, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    job.wall = time.perf_counter() - start
    job.summary = read_summary(job.run_dir)
    if rc == 0 and job.summary is not None and job.summary.get("rounds") == job.rounds:
        job.status = "ok"
    else:
        job.status = "failed"
        job.error = f"exit status {rc}: {last_error(job.log)}"
    return job


def describe(job: Job) -> str:
    name = f"{job.setting} {job.algorithm} seed{job.seed}"
    if job.status == "failed":
        return f"{name}: FAILED after {job.wall:.1f} s ({job.error}); log {job.log}"
    s = job.summary or {}
    best = s.get("best") or {}
    per_round = s.get("seconds_per_round")
    wall = "skipped (complete)" if job.status == "done" else f"{job.wall:.1f} s"
    return (f"{name}: {wall}, {s.get('rounds')} rounds, "
            f"{'-' if per_round is None else f'{per_round:.2f}'} s/round, "
            f"best PM {pct(best.get('pm_accuracy'))} GM {pct(best.get('gm_accuracy'))}")


def run_all(jobs: list[Job], workers: int) -> None:
    todo = [job for job in jobs if job.status == "pending"]
    lock = threading.Lock()
    finished = 0

    def one(job: Job) -> None:
        nonlocal finished
        execute(job)
        with lock:
            finished += 1
            print(f"[{finished}/{len(todo)}] {describe(job)}", flush=True)

    if workers > 1:  # the parallel runs fill the cores: each steps one size group at a time
        for job in todo:
            job.command = [*job.command, f"{GROUP_THREADS}1"]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, todo))


def paper_for(paper: Path, setting: str, folder: Path, out_dir: Path) -> Path:
    """The paper file cut down to this setting's "dataset/model" and the algorithms run in it (so that
    hfl-report does not warn about every other entry); written beside the report."""
    try:
        data = yaml.safe_load(paper.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return paper.resolve()  # hfl-report names the problem
    if not isinstance(data, dict):
        return paper.resolve()
    key = setting.replace("_", "/", 1)  # synthetic_mclr -> synthetic/mclr, as in summary.json
    present = {p.name for p in folder.iterdir() if p.is_dir()}
    entries = data.get(key) if isinstance(data.get(key), dict) else {}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "paper.yaml"
    path.write_text(f"# {key} entries of {paper.resolve()} for the algorithms run\n"
                    + yaml.safe_dump({key: {a: v for a, v in entries.items() if a in present}}, sort_keys=False))
    return path


def report(args: argparse.Namespace, jobs: list[Job]) -> list[str]:
    """hfl-report per setting that has finished runs; returns the settings whose report failed."""
    failed = []
    for setting in args.settings:
        folder = args.out / setting
        if not folder.is_dir() or not any(folder.rglob("summary.json")):
            print(f"\n== {setting}: no finished runs, no report", flush=True)
            continue
        rounds = sorted({job.rounds for job in jobs if job.setting == setting})
        title = f"PerMFL Table 1 reproduction: {setting} ({', '.join(map(str, rounds))} global rounds)"
        out_dir = args.out / "report" / setting
        paper = paper_for(Path(args.paper), setting, folder, out_dir) if args.paper else None
        if not hfl_report(setting, [folder], out_dir, title, paper):
            failed.append(setting)
    return failed


def timing_table(jobs: list[Job]) -> None:
    """Per setting and algorithm: mean wall s per run, s/round, and start-up (wall - rounds)."""
    ran = [job for job in jobs if job.status == "ok"]
    if not ran:
        return
    print("\nTimings of the runs made now (mean over seeds; s/round = median over rounds after the first, or the"
          " only round; start-up = process wall time - time in rounds):")
    print(f"{'setting':<15} {'algorithm':<12} {'runs':>4} {'wall s':>8} {'s/round':>8} {'start-up s':>10}")
    groups: dict[tuple[str, str], list[Job]] = {}
    for job in ran:
        groups.setdefault((job.setting, job.algorithm), []).append(job)
    estimate: dict[str, list[tuple[float, float]]] = {}
    for (setting, algorithm), group in groups.items():
        wall = sum(j.wall for j in group) / len(group)
        per_round = sum(j.summary.get("seconds_per_round") or j.summary["total_seconds"] / j.summary["rounds"]
                        for j in group) / len(group)
        startup = max(0.0, wall - sum(j.summary["total_seconds"] for j in group) / len(group))
        print(f"{setting:<15} {algorithm:<12} {len(group):>4} {wall:8.1f} {per_round:8.2f} {startup:10.1f}")
        estimate.setdefault(setting, []).append((per_round, startup))
    print("\nEstimated sequential time of one seed of these algorithms (sum over them of start-up + rounds x s/round;"
          " x seeds for the sweep, / --jobs if parallel runs do not slow each other):")
    header = [f"{r} rounds" for r in ESTIMATE_ROUNDS] + ["preset T"]
    print(f"{'setting':<15} " + " ".join(f"{h:>12}" for h in header))
    for setting, values in estimate.items():
        cells = [sum(s + r * p for p, s in values) for r in ESTIMATE_ROUNDS]
        cells.append(sum(s + preset_rounds(setting) * p for p, s in values))
        print(f"{setting:<15} " + " ".join(f"{c / 60:10.1f} m" for c in cells))


def pending_jobs(jobs: list[Job]) -> list[Job]:
    """Mark the runs that already finished as done; return the others."""
    for job in jobs:
        if is_complete(job):
            job.status = "done"
    return [job for job in jobs if job.status == "pending"]


# ---------------------------------------------------------------- the sweep skeleton the scripts share
def print_dry_run(jobs: list[Job], pending: list[Job], what: str) -> None:
    """Every command (the complete ones marked) and a count line."""
    for job in jobs:
        print(("# complete, skipped: " if job.status == "done" else "") + shlex.join(job.command))
    print(f"# {len(jobs)} runs ({what}); {len(pending)} to run, {len(jobs) - len(pending)} complete")


def run_sweep(name: str, jobs: list[Job], pending: list[Job], workers: int, out: Path | str,
              show_done: bool = False) -> float:
    """Run the pending jobs ``workers`` at a time; returns the wall seconds."""
    print(f"{name}: {len(jobs)} runs, {len(pending)} to run, {len(jobs) - len(pending)} already complete; "
          f"{workers} in parallel; output {out}", flush=True)
    if show_done:
        for job in jobs:
            if job.status == "done":
                print(f"  {describe(job)}")
    start = time.perf_counter()
    run_all(jobs, workers)
    return time.perf_counter() - start


def finish_sweep(jobs: list[Job], pending: list[Job], total: float, workers: int, failed_reports: list[str],
                 written: list[Path] | None = None, after_runs: Callable[[], None] | None = None) -> int:
    """Per-run lines, totals and failures; the exit status (1 if a run or a report failed)."""
    print("\nPer run:")
    for job in jobs:
        print(f"  {describe(job)}")
    if after_runs is not None:
        after_runs()
    failed = [job for job in jobs if job.status == "failed"]
    print(f"\nTotal wall time {total:.1f} s for {len(pending)} run(s) ({workers} in parallel); "
          f"{len(failed)} failed" + (f": {', '.join(f'{j.setting}/{j.algorithm}/seed{j.seed}' for j in failed)}"
                                     if failed else ""))
    for path in written or []:
        print(f"report: {path}")
    if failed_reports:
        print(f"hfl-report failed for: {', '.join(failed_reports)}")
    return 1 if failed or failed_reports else 0


def main(argv: list[str] | None = None) -> int:
    global PRELOADED
    args = parse_args(argv)
    PRELOADED = not args.fresh_processes
    jobs = build_jobs(args)
    pending = pending_jobs(jobs)
    if args.dry_run:
        print_dry_run(jobs, pending, ", ".join(f"{s}: {sum(j.setting == s for j in jobs)}" for s in args.settings))
        return 0
    total = run_sweep("reproduce_table1", jobs, pending, args.jobs, args.out, show_done=True)
    failed_reports = [] if args.no_report else report(args, jobs)
    return finish_sweep(jobs, pending, total, args.jobs, failed_reports, after_runs=lambda: timing_table(jobs))


if __name__ == "__main__":
    sys.exit(main())
