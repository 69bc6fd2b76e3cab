"""PFLEGO's Table 1, MNIST columns: PFLEGO, FedPer and FedAvg at high (2 classes per device)
and no (10 classes) personalisation, several seeds, then ``hfl-report`` per setting beside
the paper's numbers (benchmarks/pflego_paper_<setting>.yaml).

The paper's setting (seeds/004, Sec. 4; ../shared/notes/pflego.md): I = 100 devices in one
federation, r = 20 % drawn uniformly per round, tau = 50, T = 200, full local batch, client
rate beta = 0.007, PFLEGO's root rate rho = 0.001 with Adam (the authors' code), labels local to
each device (K_i-way heads, the baselines' too), classes dealt round-robin, images scaled by
1/255 only, the MLP body 784 -> 200 -> ReLU. Differences: only MNIST's 10k test images exist
offline (the paper: 60k training images), so each device's dealt samples are split 75/25.
The baselines run tau = 50 full-batch SGD steps at beta (the paper: "the client learning
rate for all algorithms is beta") and a plain sample-weighted mean at the server.

One run per (setting, algorithm, seed), each a separate process (reproduce_table1.py's runner:
resumable, failures recorded in ``<out>/logs/``, exit 1 if any failed):

    hfl-simulate <algorithm overrides> dataset=mnist dataset.partition=roundrobin \\
        dataset.classes_per_device=<2|10> model=mlp topology.num_teams=1 topology.devices_per_team=100 \\
        runtime=inprocess global_rounds=<T> seed=<s> hydra.run.dir=<out>/<setting>/<algorithm>/seed<s>

Our PM (every device's head + body on its own test split) and the paper's figure
(``pflego_accuracy``: the drawn devices right after their training, pooled, mean of the last 10
rounds) are both in the report.

    .venv/bin/python benchmarks/pflego_table1.py                      # 2 settings x 3 algorithms x 3 seeds
    .venv/bin/python benchmarks/pflego_table1.py --rounds 5 --seeds 0 --dry-run
"""

from __future__ import annotations

import argparse
import sys
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
    tool,
)

PAPERS = Path(__file__).resolve().parent  # pflego_paper_<setting>.yaml
SETTINGS = {"high": 2, "no": 10}  # personalisation -> classes per device
# The baselines as the paper runs them: local-label K-way heads, the same device draw, tau steps.
BASELINE = ["algorithm.local_labels=true", "algorithm.sampling=devices", "algorithm.sample_fraction=0.2",
            "algorithm.fit_test=true", "algorithm.local_steps=50", "algorithm.alpha=0.007", "algorithm.team_rounds=1"]
ALGORITHMS: dict[str, list[str]] = {
    "pflego": ["algorithm=pflego"],
    "fedper": ["algorithm=fedper", *BASELINE],
    "fedavg": ["algorithm=fedavg", *BASELINE],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma list of high, no (default: both)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma list (default: %(default)s)")
    parser.add_argument("--seeds", default="0,1,2", help="comma list of seeds (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=200, help="global rounds T (default: %(default)s)")
    parser.add_argument("--eval-every", type=int, default=10, help="PM evaluation period (default: %(default)s)")
    parser.add_argument("--out", default=str(REPO / "outputs" / "pflego_table1"), help="output folder")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (default: 1)")
    parser.add_argument("--mnist-root", default=str(MNIST_ROOT), help="folder holding MNIST/raw")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Hydra override for every run (repeatable)")
    parser.add_argument("--no-report", action="store_true", help="run only, no hfl-report")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    args.settings = choose(parser, "--settings", args.settings, list(SETTINGS))
    args.algorithms = choose(parser, "--algorithms", args.algorithms, list(ALGORITHMS))
    args.seeds = parse_seeds(parser, args.seeds)
    if args.rounds < 1 or args.jobs < 1 or args.eval_every < 1:
        parser.error("--rounds, --jobs and --eval-every must be >= 1")
    args.out, args.mnist_root = Path(args.out).resolve(), Path(args.mnist_root).resolve()
    return args


def build_jobs(args: argparse.Namespace) -> list[Job]:
    simulate = tool("hfl-simulate", "hfl.runtime.simulate")
    jobs = []
    for setting in args.settings:
        for algorithm in args.algorithms:
            for seed in args.seeds:
                run_dir = args.out / setting / algorithm / f"seed{seed}"
                overrides = (ALGORITHMS[algorithm]
                             + ["dataset=mnist", f"dataset.root={hydra_value(str(args.mnist_root))}",
                                "dataset.partition=roundrobin", f"dataset.classes_per_device={SETTINGS[setting]}",
                                "dataset.normalize=[0,1]", "dataset.batch_size=100000", "model=mlp",
                                "topology.num_teams=1", "topology.devices_per_team=100", "runtime=inprocess",
                                f"global_rounds={args.rounds}", f"eval_every={args.eval_every}", f"seed={seed}"]
                             + args.override)
                command = simulate + overrides + [f"hydra.run.dir={hydra_value(str(run_dir))}"]
                log = args.out / "logs" / setting / f"{algorithm}_seed{seed}.log"
                jobs.append(Job(setting, algorithm, seed, args.rounds, run_dir, log, command, overrides))
    return jobs


def report(args: argparse.Namespace, jobs: list[Job]) -> list[str]:
    """hfl-report per setting over this sweep's finished runs; returns the settings that failed."""
    failed = []
    for setting in args.settings:
        runs = [job.run_dir for job in jobs if job.setting == setting and job.status in ("ok", "done")]
        if not runs:
            continue
        title = (f"PFLEGO Table 1, MNIST, {setting} personalisation ({SETTINGS[setting]} classes per device), "
                 f"{args.rounds} rounds")
        if not hfl_report(setting, runs, args.out / "report" / setting, title,
                          PAPERS / f"pflego_paper_{setting}.yaml"):
            failed.append(setting)
    return failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jobs = build_jobs(args)
    pending = pending_jobs(jobs)
    if args.dry_run:
        print_dry_run(jobs, pending, "PFLEGO Table 1, MNIST")
        return 0
    total = run_sweep("pflego_table1", jobs, pending, args.jobs, args.out)
    failed_reports = [] if args.no_report else report(args, jobs)
    return finish_sweep(jobs, pending, total, args.jobs, failed_reports)


if __name__ == "__main__":
    sys.exit(main())
