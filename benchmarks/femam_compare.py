"""FeMAM against its paper's baselines (FedAvg, FedAvg+, Ditto, FeSEM, Local) on three
settings with cluster structure, several seeds, then ``hfl-report`` per setting and a summary of
the levels FeMAM's clients kept.

The paper (../shared/seeds/001; ../shared/notes/femam.md) reports CIFAR-100 / Tiny-ImageNet with
ResNet-9, which are not available offline; its headline numbers (CIFAR-100, client mean accuracy
in %: multi-level [3,6,11] FeMAM 61.86 vs pFedMe 51.85; cluster-wise (30,5) FeMAM 53.72 vs
FedAvg+ 46.67; Dirichlet 0.1 FeMAM 61.96 vs Ditto 56.06) are a different dataset and model and
are not put beside ours (hfl-report's --paper file is keyed by our runs' dataset/model).

Settings (every one: model=mclr, dataset.val_fraction=0.15 -- the same seeded split for every
algorithm, FeMAM needs it --, dataset.batch_size=32, full participation, topology=random with 5
teams under the root (exact for all six: their inner servers relay or take composing means, so
the tree gives the flat run's models), runtime=inprocess):

* ``synthetic``: dataset=synthetic_multilevel, 60 devices, nested clusters [2,4] (2 coarse, 4
  fine), scales [0.5,1,1,0.3] (global, coarse, fine, device: the cluster parts dominate a
  device's true model, so neither one global model nor ~80 samples per device suffice),
  max_samples 300 (caps the log-normal tail);
* ``mnist_clusterwise``: MNIST's test split (../shared/data or --mnist-root), 50 devices,
  dataset.partition=clusterwise, 5 clusters of c = 3 classes (FeMAM's (c, K) = (3, 5));
* ``mnist_dirichlet``: the same images, 50 devices, dataset.partition=dirichlet, alpha 0.1,
  min_samples_per_device 8 (FeMAM asks 100 of a 60k pool; with 10k images over 50 devices
  alpha 0.1 cannot give 10 to every device in flwr-datasets' 11 draws; 8 works for seeds 0-2);
* ``mnist_multilevel`` (opt-in: ``--settings mnist_multilevel``; the FeMAM paper's premise, clients
  sharing structure at several levels): the same images, 50 devices, dataset.partition=multilevel,
  nested clusters [2,3,5] with 1 class per cluster at each level (MNIST's 10 classes all used), so a
  device holds 3 classes: one shared with ~25 devices, one with ~17, one with ~10; normalised as
  the authors' code does under --data-name emnist ([0.1307, 0.3081]) so that
  benchmarks/reference/femam.py feeds their code the same numbers. Local steps 9 (mean of
  2*ceil(n_train/32), seeds 0-2: 9.04 / 8.84 / 8.92).

``--model`` (default mclr) sets every run's model, e.g. ``--model resnet9`` (the authors' ResNet-9;
~17 s a round for FeMAM on mnist_multilevel on one shared core).

Algorithms, all SGD lr 0.01 without momentum (the authors') and the same rounds:

* ``femam``: levels [1,5,5,0] (global, two K-means levels of K = 5, personal), Q = 2 local
  epochs, prox 0.01, pruning as the paper; a fixed schedule scaled from the authors' (400
  rounds, then 50 per level) to --rounds: 40 % for level 1, the rest split evenly (100 rounds:
  [40,20,20,20]); prune_window = the later levels' length (the authors' window is a whole later
  level: 50);
* ``fesem``: one level of K = 5 centres, nearest-centre assignment, 2 local epochs;
* ``fedavg``, ``fedavg_ft`` (FedAvg+, 2 fine-tuning epochs at evaluation), ``ditto`` (lambda 0.1,
  the FeMAM paper's; local_steps for w and again for v), ``local``: local_steps per round =
  FeMAM's 2 epochs on the average device, mean over devices of 2*ceil(n_train/32) for seeds
  0-2: synthetic 6, MNIST 9.

One run per (setting, algorithm, seed), each a separate process (reproduce_table1.py's runner:
resumable, failures recorded in ``<out>/logs/`` and the sweep goes on, exit 1 if any failed):

    hfl-simulate algorithm=<alg> <algorithm overrides> <setting overrides> model=mclr \\
        topology=random topology.num_teams=5 topology.devices_per_team=<n/5> runtime=inprocess \\
        global_rounds=<R> eval_every=<E> seed=<s> hydra.run.dir=<out>/<setting>/<alg>/seed<s>

then ``hfl-report <the setting's runs> --out <out>/report/<setting>`` (PM pooled over test
samples, GM, and the client mean: unweighted mean over devices of PM accuracy, the FeMAM
paper's figure), ``<out>/report/<setting>/client_mean.md`` (the client mean of every algorithm's
predictor: PM, or the GM for fedavg, which hfl-report's PM-only column leaves blank) and
``<out>/report/<setting>/femam_levels.md`` from every FeMAM run's ``femam_levels.json``: how many
clients kept each level, mean levels kept.

The paper's figure, the client mean at the round of lowest mean validation loss: hfl evaluates on
test splits only, so each run has a **validation twin** (``<alg>/seed<s>_val``, on by default,
``--no-val-twins`` to skip: it doubles the sweep): the same hfl-simulate run (same overrides and seed,
hence the same data, training and models: checked by comparing the final global models) started
through this script's ``--evaluate-on-validation`` mode, which replaces every device's test split
by its validation split. client_mean.md then adds, per algorithm, the run's client mean test
accuracy at the round where its twin's validation loss (pooled over the devices' validation
samples; hfl's metrics keep no per-device loss) is lowest, and for FeMAM a second reading from its
own root state: the unweighted client mean of the devices' validation losses of the model they
received each round (the authors' exact measure; it belongs to the model evaluated after the
previous round).

Cost (MCLR; CNN is ~150x slower per step on CPU, out of budget): a 4-round mnist_clusterwise run
(measured while another sweep shared the 2 cores) took 6-9 s
(start-up ~5 s, 0.46-0.94 s/round with evaluation every round, femam the dearest), so the
default sweep (54 runs x 100 rounds) is ~60 min sequential, ~30 min at --jobs 2 on 2 cores.

    .venv/bin/python benchmarks/femam_compare.py --jobs 2              # 3 settings x 6 algorithms x 3 seeds
    .venv/bin/python benchmarks/femam_compare.py --dry-run             # the commands only
    .venv/bin/python benchmarks/femam_compare.py --settings mnist_clusterwise --seeds 0 --rounds 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bhfl_ablation import choose  # noqa: E402  (the sweep runner these scripts share)
from reproduce_table1 import (  # noqa: E402
    MNIST_ROOT,
    REPO,
    finish_sweep,
    hfl_report,
    hydra_value,
    Job,
    parse_seeds,
    pending_jobs,
    print_dry_run,
    run_sweep,
    split_list,
    tool,
)

TEAMS = 5
LR = "0.01"  # the authors' SGD step size, every algorithm
FEMAM_LEVELS = (1, 5, 5, 0)
DEFAULT_ROUNDS = 100
FIRST_LEVEL_SHARE = 0.4  # the authors' 400 of 700 rounds would be 57 %; 40 % leaves the later levels 20 each at 100


@dataclass(frozen=True)
class Setting:
    devices: int
    local_steps: int  # baselines' steps per round: FeMAM's 2 epochs on the average device
    overrides: Callable[[argparse.Namespace], list[str]]
    title: str


def mnist(partition: list[str]) -> Callable[[argparse.Namespace], list[str]]:
    return lambda args: ["dataset=mnist", f"dataset.root={hydra_value(str(args.mnist_root))}", *partition]


SETTINGS: dict[str, Setting] = {
    "synthetic": Setting(
        60, 6,
        lambda args: ["dataset=synthetic_multilevel", "dataset.clusters=[2,4]", "dataset.scales=[0.5,1.0,1.0,0.3]",
                      "dataset.max_samples=300"],
        "synthetic_multilevel, clusters [2,4], scales [0.5,1,1,0.3], 60 devices"),
    "mnist_clusterwise": Setting(
        50, 9,
        mnist(["dataset.partition=clusterwise", "dataset.num_clusters=5", "dataset.cluster_classes=3"]),
        "MNIST test split, cluster-wise (c=3, K=5), 50 devices"),
    "mnist_dirichlet": Setting(
        50, 9,
        mnist(["dataset.partition=dirichlet", "dataset.dirichlet_alpha=0.1", "dataset.min_samples_per_device=8"]),
        "MNIST test split, Dirichlet alpha 0.1, 50 devices"),
    "mnist_multilevel": Setting(
        50, 9,
        mnist(["dataset.partition=multilevel", "dataset.level_clusters=[2,3,5]", "dataset.level_classes=[1,1,1]",
               "dataset.normalize=[0.1307,0.3081]"]),
        "MNIST test split, multi-level [2,3,5] (1 class per cluster per level), 50 devices"),
}
DEFAULT_SETTINGS = ("synthetic", "mnist_clusterwise", "mnist_dirichlet")  # mnist_multilevel: ask for it
ALGORITHMS = ("femam", "fedavg", "fedavg_ft", "ditto", "fesem", "local")
VAL_SUFFIX = "_val"  # a validation twin's run folder: seed<s>_val


def femam_schedule(rounds: int, levels: int) -> tuple[list[int], int]:
    """rounds_per_level (level 1 gets FIRST_LEVEL_SHARE of the rounds, the others an even share of
    the rest; the last level runs on to the end) and the pruning window (a later level's length)."""
    first = max(1, round(FIRST_LEVEL_SHARE * rounds))
    later = max(1, (rounds - first) // max(1, levels - 1))
    return [first] + [later] * (levels - 1), later


def algorithm_overrides(algorithm: str, setting: Setting, args: argparse.Namespace) -> list[str]:
    if algorithm in ("femam", "fesem"):
        out = [f"algorithm={algorithm}", "algorithm.local_epochs=2", f"algorithm.alpha={LR}"]
        if algorithm == "femam":
            schedule, window = femam_schedule(args.rounds, len(args.femam_levels))
            out += [f"algorithm.levels=[{','.join(map(str, args.femam_levels))}]",
                    f"algorithm.rounds_per_level=[{','.join(map(str, schedule))}]",
                    f"algorithm.prune_window={window}"]
        return out
    out = [f"algorithm={algorithm}", f"algorithm.local_steps={setting.local_steps}", f"algorithm.alpha={LR}"]
    if algorithm == "ditto":
        out.append("algorithm.lam=0.1")  # the FeMAM paper's Ditto (0.1)
    return out


def parse_levels(parser: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        levels = [int(k) for k in split_list(text)]
    except ValueError:
        parser.error(f"--femam-levels: expected comma-separated group counts, got {text!r}")
    if not levels or min(levels) < 0 or 0 in levels[:-1]:
        parser.error("--femam-levels: group counts >= 1, only the last may be 0 (personal)")
    return levels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                        help=f"comma list of {', '.join(SETTINGS)} (default: %(default)s)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma list (default: %(default)s)")
    parser.add_argument("--seeds", default="0,1,2", help="comma list of seeds (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="global rounds of every run (default: %(default)s)")
    parser.add_argument("--eval-every", type=int, default=1,
                        help="evaluate every this many rounds, and the last (default: %(default)s)")
    parser.add_argument("--femam-levels", default=",".join(map(str, FEMAM_LEVELS)),
                        help="FeMAM's groups per level, 0 = personal (default: %(default)s)")
    parser.add_argument("--out", default=str(REPO / "outputs" / "femam_compare"),
                        help="output folder (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (default: 1; each uses one torch thread)")
    parser.add_argument("--mnist-root", default=str(MNIST_ROOT),
                        help="folder holding MNIST/raw (default: ../shared/data next to the repository)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Hydra override for every run (repeatable)")
    parser.add_argument("--model", default="mclr", help="model= of every run (default: %(default)s)")
    parser.add_argument("--no-val-twins", dest="val_twins", action="store_false",
                        help="no validation twins: no reading at the round of lowest validation loss")
    parser.add_argument("--no-report", action="store_true", help="run only, no hfl-report")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit; runs and deletes nothing")
    args = parser.parse_args(argv)
    args.settings = choose(parser, "--settings", args.settings, list(SETTINGS))
    args.algorithms = choose(parser, "--algorithms", args.algorithms, list(ALGORITHMS))
    args.seeds = parse_seeds(parser, args.seeds)
    args.femam_levels = parse_levels(parser, args.femam_levels)
    for flag in ("rounds", "eval_every", "jobs"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be >= 1")
    args.out, args.mnist_root = Path(args.out).resolve(), Path(args.mnist_root).resolve()
    return args


def build_jobs(args: argparse.Namespace) -> list[Job]:
    simulate = tool("hfl-simulate", "hfl.runtime.simulate")
    jobs = []
    for name in args.settings:
        setting = SETTINGS[name]
        for algorithm in args.algorithms:
            for seed in args.seeds:
                run_dir = args.out / name / algorithm / f"seed{seed}"
                overrides = (algorithm_overrides(algorithm, setting, args) + setting.overrides(args)
                             + ["dataset.val_fraction=0.15", "dataset.batch_size=32", f"model={args.model}",
                                "topology=random", f"topology.num_teams={TEAMS}",
                                f"topology.devices_per_team={setting.devices // TEAMS}", "runtime=inprocess",
                                f"global_rounds={args.rounds}", f"eval_every={args.eval_every}", f"seed={seed}"]
                             + args.override)
                command = simulate + overrides + [f"hydra.run.dir={hydra_value(str(run_dir))}"]
                log = args.out / "logs" / name / f"{algorithm}_seed{seed}.log"
                jobs.append(Job(name, algorithm, seed, args.rounds, run_dir, log, command, overrides))
                if args.val_twins:
                    twin_dir = run_dir.with_name(run_dir.name + VAL_SUFFIX)
                    twin = [sys.executable, str(Path(__file__).resolve()), EVALUATE_ON_VALIDATION, *overrides,
                            f"hydra.run.dir={hydra_value(str(twin_dir))}"]
                    jobs.append(Job(name, algorithm, seed, args.rounds, twin_dir,
                                    log.with_name(log.stem + VAL_SUFFIX + ".log"), twin, overrides))
    return jobs


def is_twin(job: Job) -> bool:
    return job.run_dir.name.endswith(VAL_SUFFIX)


# ---------------------------------------------------------------- validation twins
# The FeMAM paper (and its authors' code) reports the client mean test accuracy at the round of lowest
# mean validation loss. hfl evaluates on the devices' test splits only; a validation twin is the same run
# (same config and seed, so the same data, training and models: the test split is read by nothing but
# the evaluation, and no random stream depends on it) whose evaluation reads each device's validation
# split in place of its test split. Its metrics.jsonl then holds, per round, the loss of the same
# predictor on the validation splits; the twin's final global model is checked to equal its run's.
EVALUATE_ON_VALIDATION = "--evaluate-on-validation"


def simulate_on_validation(argv: list[str]) -> None:
    """``hfl-simulate argv`` with every device's test split replaced by its validation split."""
    from hfl.data import federation
    from hfl.runtime.simulate import main as simulate_main

    split = federation.split_device

    def split_device_val(*args, **kwargs):
        data = split(*args, **kwargs)
        return dataclasses.replace(data, x_test=data.x_val, y_test=data.y_val)

    federation.split_device = split_device_val
    sys.argv = ["hfl-simulate", *argv]
    simulate_main()


def read_metrics(run: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    try:
        for line in (run / "metrics.jsonl").read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[int(row["round"])] = row
    except (OSError, json.JSONDecodeError, KeyError, ValueError):
        return {}
    return rows


def predictor_keys(rows: dict[int, dict]) -> tuple[str, str]:
    """(accuracy key, loss key) of the model the devices predict with: PM, or the GM (fedavg)."""
    has_pm = any(r.get("client_mean_accuracy") is not None for r in rows.values())
    return ("client_mean_accuracy", "pm_loss") if has_pm else ("gm_client_mean_accuracy", "gm_loss")


def same_training(run: Path, twin: Path) -> bool | None:
    """Whether the twin's final global model equals its run's (None: not both saved)."""
    import numpy as np

    a, b = run / "checkpoints" / "global_model.npz", twin / "checkpoints" / "global_model.npz"
    if not (a.exists() and b.exists()):
        return None
    with np.load(a) as x, np.load(b) as y:
        return sorted(x.files) == sorted(y.files) and all(np.array_equal(x[k], y[k]) for k in x.files)


def lowest_val_reading(run: Path, twin: Path) -> dict | None:
    """The run's client mean test accuracy at the round its twin's validation loss (pooled over the
    devices' validation samples) is lowest, that round, and whether both trained the same models."""
    test, val = read_metrics(run), read_metrics(twin)
    if not test or not val:
        return None
    acc_key, loss_key = predictor_keys(test)
    rounds = [r for r in sorted(test) if r in val and val[r].get(loss_key) is not None
              and test[r].get(acc_key) is not None and math.isfinite(float(val[r][loss_key]))]
    if not rounds:
        return None
    best = min(rounds, key=lambda r: float(val[r][loss_key]))
    return {"round": best, "accuracy": float(test[best][acc_key]), "val_loss": float(val[best][loss_key]),
            "same_training": same_training(run, twin)}


def femam_own_reading(run: Path) -> dict | None:
    """FeMAM only, from its root's state: the authors' measure itself. Each round every device reports
    the validation loss of the additive model it received (the one evaluated after the previous
    round); the root keeps their unweighted mean per round (femam.mean_val<level>). The client mean
    test accuracy after round r-1 is read at the round r of the lowest such mean (r >= 2)."""
    import numpy as np

    path = run / "state" / "node-root.npz"
    test = read_metrics(run)
    if not path.exists() or not test:
        return None
    with np.load(path) as z:
        levels = sorted((k for k in z.files if k.startswith("femam.mean_val")), key=lambda k: int(k[len("femam.mean_val"):]))
        means = [float(v) for k in levels for v in z[k].tolist()]
    candidates = [(loss, r) for r, loss in enumerate(means, start=1) if r >= 2 and (r - 1) in test]
    if not candidates:
        return None
    loss, r = min(candidates)
    acc_key, _ = predictor_keys(test)
    return {"round": r - 1, "accuracy": float(test[r - 1][acc_key]), "val_loss": loss}


# ---------------------------------------------------------------- FeMAM's kept levels
def levels_summary(runs: list[Path]) -> str:
    """Markdown: per FeMAM run, clients keeping each level (1 kept, 0 pruned, -1 never finished)
    and the mean number of levels kept per client; then the mean over the runs."""
    rows, per_level, means = [], [], []
    for run in runs:
        try:
            record = json.loads((run / "femam_levels.json").read_text())
        except (OSError, json.JSONDecodeError):
            rows.append(f"| {run.name} | (no femam_levels.json) | | |")
            continue
        kept = list(record.get("kept", {}).values())
        levels = len(record.get("levels", []))
        if not kept or not levels:
            rows.append(f"| {run.name} | (empty femam_levels.json) | | |")
            continue
        counts = [sum(1 for k in kept if k[level] == 1) for level in range(levels)]
        unfinished = [level + 1 for level in range(levels) if all(k[level] == -1 for k in kept)]
        mean = statistics.fmean(sum(1 for v in k if v == 1) for k in kept)
        per_level.append(counts)
        means.append(mean)
        rows.append(f"| {run.name} | {' / '.join(f'{c}' for c in counts)} of {len(kept)}"
                    + (f" (level {', '.join(map(str, unfinished))} never finished)" if unfinished else "")
                    + f" | {mean:.2f} | {record.get('rounds')} |")
    lines = ["| run | clients keeping level 1 / 2 / ... | mean levels kept | rounds per level |",
             "|:---|:---|---:|:---|", *rows]
    if per_level and len({len(c) for c in per_level}) == 1:
        avg = [statistics.fmean(c[i] for c in per_level) for i in range(len(per_level[0]))]
        lines.append(f"| mean of {len(per_level)} | {' / '.join(f'{a:.1f}' for a in avg)} | "
                     f"{statistics.fmean(means):.2f} | |")
    return "\n".join(lines)


# ---------------------------------------------------------------- client mean of every algorithm's predictor
def client_mean_table(jobs: list[Job], twins: dict[Path, Job] | None = None) -> str:
    """Markdown: per algorithm, the unweighted client mean of the model its devices predict with
    (PM: client_mean_accuracy; no PM (fedavg): the GM's, gm_client_mean_accuracy), best and final,
    mean +- std over the runs, in percent. hfl-report's client-mean columns show PM only.
    With validation twins (``twins``: run folder -> its finished twin): also the client mean at the
    round of lowest validation loss (the FeMAM paper's figure) and that round; for FeMAM a second
    reading from its own per-round client-mean validation losses (``femam_own_reading``)."""
    twins = twins or {}
    lines = ["| algorithm | predictor | client mean best | client mean final | runs |", "|:---|:---|---:|---:|---:|"]
    by_algorithm: dict[str, list[dict]] = {}
    readings: dict[str, list[dict]] = {}
    own: dict[str, list[dict]] = {}
    for job in jobs:
        if job.summary:
            by_algorithm.setdefault(job.algorithm, []).append(job.summary)
            twin = twins.get(job.run_dir)
            if twin is not None and (reading := lowest_val_reading(job.run_dir, twin.run_dir)) is not None:
                readings.setdefault(job.algorithm, []).append(reading)
            if job.algorithm == "femam" and (reading := femam_own_reading(job.run_dir)) is not None:
                own.setdefault(job.algorithm, []).append(reading)

    def cell(values: list[float]) -> str:
        if not values:
            return "—"
        mean = statistics.fmean(values)
        return f"{mean:.2f}" + (f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else "")

    for algorithm, summaries in by_algorithm.items():
        has_pm = any((s.get("final") or {}).get("client_mean_accuracy") is not None for s in summaries)
        key = "client_mean_accuracy" if has_pm else "gm_client_mean_accuracy"
        values = {kind: [100 * v for s in summaries if (v := (s.get(kind) or {}).get(key)) is not None]
                  for kind in ("best", "final")}
        lines.append(f"| {algorithm} | {'PM' if has_pm else 'GM'} | {cell(values['best'])} | "
                     f"{cell(values['final'])} | {len(summaries)} |")
    if readings or own:
        lines += ["", "At the round of lowest validation loss (the FeMAM paper's figure; validation twins: "
                  "loss pooled over the devices' validation samples):", "",
                  "| algorithm | client mean at lowest val loss | final | rounds chosen | runs | twins train the same |",
                  "|:---|---:|---:|:---|---:|:---|"]
        for algorithm, summaries in by_algorithm.items():
            has_pm = any((s.get("final") or {}).get("client_mean_accuracy") is not None for s in summaries)
            key = "client_mean_accuracy" if has_pm else "gm_client_mean_accuracy"
            final = [100 * v for s in summaries if (v := (s.get("final") or {}).get(key)) is not None]
            for label, rows in ((algorithm, readings.get(algorithm)),
                                (f"{algorithm} (own client-mean val loss)", own.get(algorithm))):
                if not rows:
                    continue
                same = {r.get("same_training") for r in rows} if label == algorithm else {"n/a"}
                lines.append(f"| {label} | {cell([100 * r['accuracy'] for r in rows])} | {cell(final)} | "
                             f"{', '.join(str(r['round']) for r in rows)} | {len(rows)} | "
                             f"{'yes' if same == {True} else 'n/a' if same == {'n/a'} else same} |")
    return "\n".join(lines)


def report(args: argparse.Namespace, jobs: list[Job]) -> tuple[list[Path], list[str]]:
    """hfl-report per setting over this sweep's finished runs, and FeMAM's kept levels;
    returns the files written and the settings whose report failed."""
    written, failed = [], []
    for name in args.settings:
        finished = [job for job in jobs if job.setting == name and job.status in ("ok", "done")]
        twins = {job.run_dir.with_name(job.run_dir.name[:-len(VAL_SUFFIX)]): job for job in finished if is_twin(job)}
        finished = [job for job in finished if not is_twin(job)]
        runs = [job.run_dir for job in finished]
        if not runs:
            print(f"\n== {name}: no finished runs, no report", flush=True)
            continue
        out_dir = args.out / "report" / name
        title = (f"FeMAM comparison: {SETTINGS[name].title}, {args.model}, {args.rounds} global rounds, "
                 f"batch 32, lr {LR}, val_fraction 0.15")
        if hfl_report(name, runs, out_dir, title):
            written.append(out_dir / "report.md")
        else:
            failed.append(name)
        table = client_mean_table(finished, twins)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "client_mean.md").write_text(
            f"# Client mean accuracy (%): {name}\n\nEvery device counts once (the FeMAM paper's figure); the model "
            "each algorithm's devices predict with: PM, or the GM where there is no PM (fedavg).\n\n" + table + "\n")
        written.append(out_dir / "client_mean.md")
        print(f"\n== {name}: client mean of each algorithm's predictor\n{table}", flush=True)
        femam = [job.run_dir for job in finished if job.algorithm == "femam"]
        if femam:
            text = (f"# FeMAM's kept levels: {name}\n\nlevels {args.femam_levels} (groups per level, 0 = personal); "
                    "level 1 is always kept; a client keeps a later level iff it lowered its mean validation loss "
                    "over the level's last prune_window rounds.\n\n" + levels_summary(femam) + "\n")
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "femam_levels.md").write_text(text)
            written.append(out_dir / "femam_levels.md")
            print(f"\n== {name}: FeMAM's kept levels\n{levels_summary(femam)}", flush=True)
    return written, failed


def estimate(jobs: list[Job], rounds: int, seeds: int, workers: int) -> None:
    """Extrapolate the runs made now to ``rounds`` rounds and ``seeds`` seeds at ``workers`` jobs:
    per run start-up + rounds x s/round."""
    ran = [job for job in jobs if job.status == "ok" and job.summary]
    if not ran:
        return
    print(f"\nEstimate at {rounds} rounds (start-up = wall - time in rounds; s/round: summary.json's median):")
    total = 0.0
    for job in ran:
        s = job.summary
        per_round = s.get("seconds_per_round") or s["total_seconds"] / s["rounds"]
        startup = max(0.0, job.wall - s["total_seconds"])
        one = startup + rounds * per_round
        total += one
        print(f"  {job.setting:<18} {job.algorithm:<10} seed{job.seed}: start-up {startup:5.1f} s, "
              f"{per_round:6.3f} s/round -> {one / 60:5.1f} min")
    per_seed = total / len({job.seed for job in ran})
    print(f"  these settings x algorithms: {per_seed / 60:.1f} min per seed sequential; x {seeds} seeds / "
          f"{workers} jobs ~ {per_seed * seeds / workers / 60:.1f} min (if parallel runs do not slow each other)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [EVALUATE_ON_VALIDATION]:  # a validation twin (build_jobs' command)
        simulate_on_validation(argv[1:])
        return 0
    args = parse_args(argv)
    jobs = build_jobs(args)
    pending = pending_jobs(jobs)
    if args.dry_run:
        print_dry_run(jobs, pending, f"{len(args.settings)} settings x {len(args.algorithms)} algorithms x "
                                     f"{len(args.seeds)} seeds")
        return 0
    total = run_sweep("femam_compare", jobs, pending, args.jobs, args.out)
    written, failed_reports = ([], []) if args.no_report else report(args, jobs)
    return finish_sweep(jobs, pending, total, args.jobs, failed_reports, written,
                        after_runs=lambda: estimate(jobs, DEFAULT_ROUNDS, 3, 2))  # the default sweep at --jobs 2


if __name__ == "__main__":
    sys.exit(main())
