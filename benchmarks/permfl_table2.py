"""PerMFL's Table 2 (team formation): PerMFL on MNIST MCLR with two teams whose label sets are
disjoint (worst) or overlap (average), T = 400, several seeds, then ``hfl-report`` beside the
paper (worst PM 96.86 / GM 80.48, average PM 97.01 / GM 80.86).

One run per (formation, seed), each a separate process (reproduce_table1.py's runner:
resumable, failures recorded in ``<out>/logs/``, exit 1 if any failed):

    hfl-simulate experiment=permfl_mnist_mclr topology=by_label_<worst|average> runtime=inprocess \\
        global_rounds=<T> eval_every=<E> seed=<s> dataset.root=<MNIST root> hydra.run.dir=<out>/<formation>/permfl/seed<s>

    .venv/bin/python benchmarks/permfl_table2.py --jobs 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce_table1 import (  # noqa: E402
    MNIST_ROOT,
    REPO,
    Job,
    describe,
    hfl_report,
    hydra_value,
    parse_seeds,
    pending_jobs,
    run_all,
    tool,
)

FORMATIONS = ("worst", "average")
PAPER = {"worst": (96.86, 80.48), "average": (97.01, 80.86)}  # PM, GM in %


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=400, help="global rounds T (default: %(default)s, the paper's)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "outputs" / "permfl_table2"))
    parser.add_argument("--mnist-root", default=str(MNIST_ROOT))
    args = parser.parse_args(argv)
    seeds = parse_seeds(parser, args.seeds)
    out = Path(args.out).resolve()
    simulate = tool("hfl-simulate", "hfl.runtime.simulate")
    jobs = []
    for formation in FORMATIONS:
        for seed in seeds:
            run_dir = out / formation / "permfl" / f"seed{seed}"
            overrides = ["experiment=permfl_mnist_mclr", f"topology=by_label_{formation}", "runtime=inprocess",
                         f"global_rounds={args.rounds}", f"eval_every={args.eval_every}", f"seed={seed}",
                         f"dataset.root={hydra_value(str(Path(args.mnist_root).resolve()))}"]
            command = simulate + overrides + [f"hydra.run.dir={hydra_value(str(run_dir))}"]
            jobs.append(Job(formation, "permfl", seed, args.rounds, run_dir, out / "logs" / f"{formation}_seed{seed}.log",
                            command, overrides))
    pending = pending_jobs(jobs)
    start = time.perf_counter()
    run_all(jobs, args.jobs)
    print(f"{len(pending)} run(s) in {time.perf_counter() - start:.1f} s")
    failed = [job for job in jobs if job.status == "failed"]
    for formation in FORMATIONS:
        runs = [job.run_dir for job in jobs if job.setting == formation and job.status in ("ok", "done")]
        if runs:
            pm, gm = PAPER[formation]
            paper = out / "report" / formation / "paper.yaml"
            paper.parent.mkdir(parents=True, exist_ok=True)
            paper.write_text(f"# PerMFL Table 2, {formation} case\nmnist/mclr:\n  permfl: {{pm: {pm}, gm: {gm}}}\n")
            hfl_report(formation, runs, out / "report" / formation,
                       f"PerMFL Table 2, {formation} case, {args.rounds} rounds", paper)
    for job in jobs:
        print(f"  {describe(job)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
