"""B-HFL ablation on a depth-3 tree (four tiers: root -> 2 regions -> 3 teams each -> 10 devices
each, 60 devices): HierFAVG against B-HFL variants, several seeds, then ``hfl-report`` per setting.

One run per (setting, variant, seed), each a separate process (reproduce_table1.py's runner:
resumable, failures recorded in ``<out>/logs/`` and the sweep goes on, exit 1 if any failed):

    hfl-simulate <variant overrides> algorithm.name=<variant> <setting overrides> topology=tree \\
        'topology.fanout=[2,3,10]' runtime=inprocess global_rounds=<N> algorithm.team_rounds=<K> \\
        algorithm.local_steps=<S> seed=<s> hydra.run.dir=<out>/<setting>/<variant>/seed<s>

then ``hfl-report <the runs of that setting> --out <out>/report/<setting>``.

Variants (``algorithm.name=<variant>`` makes the variant the run's algorithm name in summary.json,
which is the row label of hfl-report; the name is a label only, nothing dispatches on it):

* ``hierfavg``: algorithm=hierfavg (its rule, FedAvgServer, is defined on any tree: on a deeper
  tree it runs team_rounds at the lowest servers and 1 round above)
* ``bhfl_fedavg``: algorithm=bhfl, its defaults (up = sgd lr 1, down = replace)
* ``bhfl_adam_partial``: up = adam lr 0.01, down = sgd lr 0.5
* ``bhfl_adam_partial_nopersist``: as bhfl_adam_partial, algorithm.persistent_devices=false
* ``bhfl_residual``: as bhfl_adam_partial, residual_down=true, residual_up_k=2

Settings: ``mnist`` (the MNIST test split under ../shared/data or --mnist-root, 2 classes per
device, MCLR) and ``synthetic`` (Synthetic(0.5, 0.5), MCLR).

    .venv/bin/python benchmarks/bhfl_ablation.py                      # 2 settings x 5 variants x 3 seeds, 30 rounds
    .venv/bin/python benchmarks/bhfl_ablation.py --dry-run            # the commands only
    .venv/bin/python benchmarks/bhfl_ablation.py --rounds 2 --seeds 0 --settings synthetic
    .venv/bin/python benchmarks/bhfl_ablation.py --variants hierfavg,bhfl_residual --jobs 2
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce_table1 import (  # noqa: E402  (the sweep runner this script shares)
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

FANOUT = "[2,3,10]"  # root -> 2 regions -> 3 teams each -> 10 devices each
ADAM_PARTIAL = ["algorithm=bhfl", "algorithm.up.optimizer=adam", "algorithm.up.lr=0.01",
                "algorithm.down.optimizer=sgd", "algorithm.down.lr=0.5"]
VARIANTS: dict[str, list[str]] = {
    "hierfavg": ["algorithm=hierfavg"],
    "bhfl_fedavg": ["algorithm=bhfl"],
    "bhfl_adam_partial": ADAM_PARTIAL,
    "bhfl_adam_partial_nopersist": ADAM_PARTIAL + ["algorithm.persistent_devices=false"],
    "bhfl_residual": ADAM_PARTIAL + ["algorithm.residual_down=true", "algorithm.residual_up_k=2"],
}
SETTINGS: dict[str, Callable[[argparse.Namespace], list[str]]] = {
    "mnist": lambda args: ["dataset=mnist", f"dataset.root={hydra_value(str(args.mnist_root))}",
                           "dataset.partition=classes", "dataset.classes_per_device=2", "model=mclr"],
    "synthetic": lambda args: ["dataset=synthetic", "model=mclr"],
}


def choose(parser: argparse.ArgumentParser, flag: str, text: str, known: list[str]) -> list[str]:
    """A comma list of names out of known (in the order given), or a parser error."""
    chosen = split_list(text)
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        parser.error(f"{flag}: unknown {unknown or 'empty'}; choose from {', '.join(known)}")
    return chosen


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma list of {', '.join(SETTINGS)} (default: %(default)s)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma list of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--seeds", default="0,1,2", help="comma list of seeds (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=30, help="global rounds (default: %(default)s)")
    parser.add_argument("--team-rounds", type=int, default=2,
                        help="algorithm.team_rounds, rounds of the lowest servers per call (default: %(default)s)")
    parser.add_argument("--local-steps", type=int, default=10,
                        help="algorithm.local_steps, device SGD steps per call (default: %(default)s)")
    parser.add_argument("--out", default=str(REPO / "outputs" / "bhfl_ablation"),
                        help="output folder (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (default: 1; each uses one torch thread)")
    parser.add_argument("--mnist-root", default=str(MNIST_ROOT),
                        help="folder holding MNIST/raw (default: ../shared/data next to the repository)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Hydra override for every run (repeatable), e.g. --override eval_every=5")
    parser.add_argument("--no-report", action="store_true", help="run only, no hfl-report")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit; runs and deletes nothing")
    args = parser.parse_args(argv)

    args.settings = choose(parser, "--settings", args.settings, list(SETTINGS))
    args.variants = choose(parser, "--variants", args.variants, list(VARIANTS))
    args.seeds = parse_seeds(parser, args.seeds)
    for flag in ("rounds", "team_rounds", "local_steps", "jobs"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be >= 1")
    args.out = Path(args.out).resolve()
    args.mnist_root = Path(args.mnist_root).resolve()
    return args


def build_jobs(args: argparse.Namespace) -> list[Job]:
    """One Job per (setting, variant, seed); Job.algorithm holds the variant name."""
    simulate = tool("hfl-simulate", "hfl.runtime.simulate")
    jobs = []
    for setting in args.settings:
        for variant in args.variants:
            for seed in args.seeds:
                run_dir = args.out / setting / variant / f"seed{seed}"
                overrides = (VARIANTS[variant] + [f"algorithm.name={variant}"] + SETTINGS[setting](args)
                             + ["topology=tree", f"topology.fanout={FANOUT}", "runtime=inprocess",
                                f"global_rounds={args.rounds}", f"algorithm.team_rounds={args.team_rounds}",
                                f"algorithm.local_steps={args.local_steps}", f"seed={seed}"]
                             + args.override)
                command = simulate + overrides + [f"hydra.run.dir={hydra_value(str(run_dir))}"]
                log = args.out / "logs" / setting / f"{variant}_seed{seed}.log"
                jobs.append(Job(setting, variant, seed, args.rounds, run_dir, log, command, overrides))
    return jobs


def report(args: argparse.Namespace, jobs: list[Job]) -> tuple[list[Path], list[str]]:
    """hfl-report per setting over this sweep's finished runs (not other runs left in <out>);
    returns the report.md paths written and the settings whose report failed."""
    written, failed = [], []
    for setting in args.settings:
        runs = [job.run_dir for job in jobs if job.setting == setting and job.status in ("ok", "done")]
        if not runs:
            print(f"\n== {setting}: no finished runs, no report", flush=True)
            continue
        out_dir = args.out / "report" / setting
        title = (f"B-HFL ablation: {setting}, tree fanout {FANOUT}, {args.rounds} global rounds, "
                 f"team_rounds {args.team_rounds}, local_steps {args.local_steps}")
        if hfl_report(setting, runs, out_dir, title):
            written.append(out_dir / "report.md")
        else:
            failed.append(setting)
    return written, failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jobs = build_jobs(args)
    pending = pending_jobs(jobs)
    if args.dry_run:
        print_dry_run(jobs, pending, f"{len(args.settings)} settings x {len(args.variants)} variants x "
                                     f"{len(args.seeds)} seeds")
        return 0
    total = run_sweep("bhfl_ablation", jobs, pending, args.jobs, args.out)
    written, failed_reports = ([], []) if args.no_report else report(args, jobs)
    return finish_sweep(jobs, pending, total, args.jobs, failed_reports, written)


if __name__ == "__main__":
    sys.exit(main())
