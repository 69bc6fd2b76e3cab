"""Time and asynchrony (hfl.clock): synchronous, deadline and buffered nodes in simulated time, and
B-HFL's asynchronous devices under dataset shift. Three parts, each a sweep of ``hfl-simulate`` runs
(reproduce_table1.py's runner: resumable, logs in ``<out>/logs/``), then ``hfl-report`` (tables,
and plots against simulated time) and a table printed here.

``policies``: FedAvg, HierFAVG and B-HFL (Adam up, a partial merge down) on a 3-tier tree (4 servers x 25 devices) and a 4-tier
tree (2 x 4 x 12 devices), device speeds lognormal(0, 1.5) (heavy-tailed: the slowest of 100
devices about 20x slower than the median), Synthetic(0.5, 0.5) with MCLR. Policies: ``sync``;
``deadline_devices`` / ``buffered_devices`` at the lowest servers (the others sync);
``deadline_nodes`` / ``buffered_nodes`` at the root. Printed: simulated seconds until the global
model first reaches ``--target`` accuracy (median over seeds; "-" when a seed never does), and the
final GM accuracy.

``shift``: labels drift (a new dominant class per device every ``--period`` simulated seconds,
``memory`` 60 samples) on the 3-tier tree with 20% of the devices asked per server round: B-HFL
(devices merging their parent's model into their own, down sgd 0.5) with devices that train between
requests (``algorithm.background_every``), the same without, HierFAVG and FedAvg. hfl-report draws every level's accuracy against simulated time.

``scale``: 10,000 devices (10 servers x 1,000), 10 asked per server round, FedAvg, sync against
buffered (10 kept busy per server, each round merging the first 5 to arrive): wall seconds per global round (summary.json's median),
one run after the other on this machine.

    .venv/bin/python benchmarks/async_time.py                       # all three parts, 3 seeds
    .venv/bin/python benchmarks/async_time.py --parts policies --seeds 0 --rounds 10
    .venv/bin/python benchmarks/async_time.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce_table1 import (  # noqa: E402  (the sweep runner this script shares)
    REPO,
    Job,
    finish_sweep,
    hfl_report,
    hydra_value,
    parse_seeds,
    pending_jobs,
    print_dry_run,
    run_sweep,
    split_list,
    tool,
)

PARTS = ("policies", "shift", "scale")
# every device: 10 steps of 0.05 s at speed 1; links 50 ms + 10 Mbit/s (the clock's defaults)
CLOCK = ["clock.enabled=true", "clock.speed.distribution=lognormal", "clock.speed.sigma=1.5",
         "algorithm.local_steps=10", "dataset=synthetic", "model=mclr", "runtime=inprocess", "eval_every=1"]
TREES = {"3tier": ("[4,25]", 2), "4tier": ("[2,4,12]", 3)}  # fanout, depth
ALGORITHMS = {"fedavg": ["algorithm=fedavg"],
              "hierfavg": ["algorithm=hierfavg", "algorithm.team_rounds=2"],
              # B-HFL's own settings (its defaults are HierFAVG): Adam up, a partial merge down, persistent devices
              "bhfl": ["algorithm=bhfl", "algorithm.team_rounds=2", "algorithm.up.optimizer=adam", "algorithm.up.lr=0.01",
                       "algorithm.down.optimizer=sgd", "algorithm.down.lr=0.5"]}
POLICIES = ("sync", "deadline_devices", "buffered_devices", "deadline_nodes", "buffered_nodes")


def policy_overrides(policy: str, depth: int, fanout: list[int]) -> list[str]:
    """The per-level clock.policy list (root first) and its settings for one policy variant."""
    if policy == "sync":
        return []
    kind, where = policy.split("_")
    level = depth - 1 if where == "devices" else 0
    kinds = ["sync"] * depth
    kinds[level] = kind
    children = fanout[level]
    out = [f"clock.policy=[{','.join(kinds)}]"]
    if kind == "deadline":  # about the 80th percentile of a device's 0.5 s of work (speed lognormal(0, 1.5))
        out += ["clock.deadline=2.0"] if where == "devices" else [f"clock.min_replies={max(1, children // 2)}"]
    else:  # buffered: merge half of the children's arrivals; all of them kept busy
        out += [f"clock.buffer={max(1, children // 2)}"]
    return out


def build_jobs(args: argparse.Namespace) -> list[Job]:
    simulate = tool("hfl-simulate", "hfl.runtime.simulate")
    jobs: list[Job] = []

    def add(setting: str, variant: str, seed: int, rounds: int, overrides: list[str]) -> None:
        run_dir = args.out / setting / variant / f"seed{seed}"
        overrides = [*overrides, f"algorithm.name={variant}", f"global_rounds={rounds}", f"seed={seed}", *args.override]
        command = simulate + overrides + [f"hydra.run.dir={hydra_value(str(run_dir))}"]
        jobs.append(Job(setting, variant, seed, rounds, run_dir, args.out / "logs" / setting / f"{variant}_seed{seed}.log",
                        command, overrides))

    if "policies" in args.parts:
        for tree, (fanout, depth) in TREES.items():
            sizes = [int(n) for n in fanout.strip("[]").split(",")]
            for algorithm, chosen in ALGORITHMS.items():
                for policy in POLICIES:
                    for seed in args.seeds:
                        add(f"policies_{tree}", f"{algorithm}_{policy}", seed, args.rounds,
                            [*chosen, *CLOCK, "topology=tree", f"topology.fanout={fanout}",
                             *policy_overrides(policy, depth, sizes)])
    if "shift" in args.parts:
        shift = [*CLOCK, "clock.speed.sigma=0.5", "topology=tree", "topology.fanout=[4,25]", "clock.shift.kind=labels",
                 f"clock.shift.period={args.period}", "clock.shift.memory=60"]
        # B-HFL's devices merge their parent's model into their own (down: sgd 0.5), so what they learn on
        # their own carries into their next reply; with down=replace (its default) B-HFL is HierFAVG
        bhfl = ["algorithm=bhfl", "algorithm.team_rounds=2", "algorithm.sample_fraction=[1,0.2]",
                "algorithm.down.optimizer=sgd", "algorithm.down.lr=0.5"]
        variants = {"bhfl_async_devices": [*bhfl, f"algorithm.background_every={args.period / 5}"],
                    "bhfl": bhfl,
                    "hierfavg": ALGORITHMS["hierfavg"] + ["algorithm.sample_fraction=[1,0.2]"],
                    "fedavg": ["algorithm=fedavg", "algorithm.sample_fraction=[1,0.2]"]}
        for variant, chosen in variants.items():
            for seed in args.seeds:
                add("shift", variant, seed, args.shift_rounds, [*chosen, *shift])
    if "scale" in args.parts:
        big = ["algorithm=fedavg", "dataset=synthetic", "model=mclr", "runtime=inprocess", "topology=tree",
               "topology.fanout=[10,1000]", "algorithm.sample_fraction=[1,0.01]", "algorithm.local_steps=10",
               "clock.enabled=true", "clock.speed.distribution=lognormal", "clock.speed.sigma=1.5",
               f"eval_every={args.scale_rounds}", "eval_fraction=0.01"]
        for seed in args.seeds:  # each seed a repeat, sync and buffered one after the other
            for variant, extra in {"sync": [], "buffered": ["clock.policy=[sync,buffered]", "clock.buffer=5",
                                                           "clock.concurrency=10"]}.items():
                add("scale", f"fedavg_{variant}", seed, args.scale_rounds, [*big, *extra])
    return jobs


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def time_to(lines: list[dict], key: str, target: float) -> float | None:
    """The simulated time of the first evaluated round whose ``key`` reaches ``target``."""
    for line in lines:
        if (line.get(key) or 0.0) >= target:
            return float(line["sim_time"])
    return None


def policies_table(jobs: list[Job], target: float) -> None:
    print(f"\nSimulated seconds to GM accuracy {100 * target:.0f}% (median over seeds; '-' = not reached by all), "
          "final GM accuracy (mean), simulated seconds per global round (median):")
    print(f"{'tree':6} {'algorithm':9} " + " ".join(f"{p:>26}" for p in POLICIES))
    done = [j for j in jobs if j.setting.startswith("policies_") and j.status in ("ok", "done")]
    for tree in TREES:
        for algorithm in ALGORITHMS:
            cells = []
            for policy in POLICIES:
                runs = [metrics(j.run_dir) for j in done if j.setting == f"policies_{tree}"
                        and j.algorithm == f"{algorithm}_{policy}"]
                if not runs:
                    cells.append(f"{'-':>26}")
                    continue
                reach = [time_to(r, "gm_accuracy", target) for r in runs]
                to = f"{statistics.median(reach):7.1f}s" if None not in reach else "      - "
                final = statistics.fmean(r[-1]["gm_accuracy"] for r in runs)
                per_round = statistics.median(r[-1]["sim_time"] / r[-1]["round"] for r in runs)
                cells.append(f"{to} {100 * final:5.1f}% {per_round:6.2f}s/rnd")
            print(f"{tree:6} {algorithm:9} " + " ".join(f"{c:>26}" for c in cells))


def shift_table(jobs: list[Job], period: float) -> None:
    done = [j for j in jobs if j.setting == "shift" and j.status in ("ok", "done")]
    if not done:
        return
    print("\nUnder dataset shift: mean accuracy over the evaluated rounds after the first shift (mean over seeds), "
          "PM / level1 (servers) / GM:")
    for variant in dict.fromkeys(j.algorithm for j in done):
        runs = [metrics(j.run_dir) for j in done if j.algorithm == variant]

        def mean_after(key: str) -> str:
            values = [line[key] for r in runs for line in r if line.get(key) is not None and line["sim_time"] >= period]
            return f"{100 * statistics.fmean(values):5.1f}%" if values else "   -  "

        print(f"  {variant:20} PM {mean_after('pm_accuracy')}  level1 {mean_after('level1_accuracy')}  "
              f"GM {mean_after('gm_accuracy')}")


def scale_table(jobs: list[Job]) -> None:
    done = [j for j in jobs if j.setting == "scale" and j.status in ("ok", "done") and j.summary]
    if not done:
        return
    print("\n10,000 devices, 100 asked per global round: wall seconds per global round (each run's median over "
          "its rounds after the first, summary.json; median over the repeats), simulated seconds per round:")
    wall: dict[str, dict[int, float]] = {}
    for job in done:
        wall.setdefault(job.algorithm, {})[job.seed] = float(job.summary["seconds_per_round"])
    for variant, by_seed in wall.items():
        sims = [(lines := metrics(j.run_dir))[-1]["sim_time"] / lines[-1]["round"] for j in done if j.algorithm == variant]
        print(f"  {variant:16} {statistics.median(by_seed.values()):6.3f} s wall/round "
              f"({', '.join(f'{v:.3f}' for v in by_seed.values())})   {statistics.median(sims):7.2f} s simulated/round")
    pairs = [wall["fedavg_buffered"][s] / wall["fedavg_sync"][s] for s in wall.get("fedavg_sync", {})
             if s in wall.get("fedavg_buffered", {})]
    if pairs:
        print(f"  buffered / sync wall time per round, per repeat: {', '.join(f'{r:.2f}' for r in pairs)}; "
              f"median {statistics.median(pairs):.2f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help="comma list of %(default)s")
    parser.add_argument("--seeds", default="0,1,2", help="comma list of seeds (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=30, help="global rounds, part policies (default: %(default)s)")
    parser.add_argument("--shift-rounds", type=int, default=30, help="global rounds, part shift (default: %(default)s)")
    parser.add_argument("--scale-rounds", type=int, default=6, help="global rounds, part scale (default: %(default)s)")
    parser.add_argument("--period", type=float, default=20.0,
                        help="simulated seconds per shift phase (default: %(default)s)")
    parser.add_argument("--target", type=float, default=0.6, help="GM accuracy to reach (default: %(default)s)")
    parser.add_argument("--out", default=str(REPO / "outputs" / "async_time"), help="output folder (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (default: 1)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Hydra override for every run (repeatable)")
    parser.add_argument("--no-report", action="store_true", help="run only, no hfl-report")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    args.parts = split_list(args.parts)
    if not args.parts or set(args.parts) - set(PARTS):
        parser.error(f"--parts: choose from {', '.join(PARTS)}")
    args.seeds = parse_seeds(parser, args.seeds)
    args.out = Path(args.out).resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jobs = build_jobs(args)
    pending = pending_jobs(jobs)
    if args.dry_run:
        print_dry_run(jobs, pending, f"parts {', '.join(args.parts)}, seeds {args.seeds}")
        return 0
    total = run_sweep("async_time", jobs, pending, args.jobs, args.out)
    written, failed = [], []
    if not args.no_report:
        for setting in dict.fromkeys(j.setting for j in jobs if j.setting != "scale"):
            runs = [j.run_dir for j in jobs if j.setting == setting and j.status in ("ok", "done")]
            out_dir = args.out / "report" / setting
            if runs and hfl_report(setting, runs, out_dir, f"hfl.clock: {setting}"):
                written.append(out_dir / "report.md")
            elif runs:
                failed.append(setting)

    def tables() -> None:
        policies_table(jobs, args.target)
        shift_table(jobs, args.period)
        scale_table(jobs)

    return finish_sweep(jobs, pending, total, args.jobs, failed, written, after_runs=tables)


if __name__ == "__main__":
    sys.exit(main())
