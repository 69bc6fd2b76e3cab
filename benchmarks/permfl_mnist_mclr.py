"""Benchmark: experiment=permfl_mnist_mclr on the MNIST test split.

Prints best/final PM and GM and seconds per global round for three set-ups run in the
same session (ratios, not absolute times, are what carry between machines):

- ``inprocess``: Flower's server loop over the team nodes in one process, no Ray — the
  reference;
- ``sim-1actor``: the Simulation Runtime with one actor, so team nodes run one at a time
  and a round splits cleanly into compute (time inside the team nodes: device training,
  team aggregation, evaluation) and Flower overhead (the rest: messaging, serialisation,
  Ray scheduling, global aggregation);
- ``simulation``: the Simulation Runtime as configured by default (one actor per core,
  team nodes in parallel) — what a user gets; there compute is summed over teams and
  exceeds the wall time.

    .venv/bin/python benchmarks/permfl_mnist_mclr.py --rounds 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hfl.config.compose import CONF_DIR
from hfl.runtime.simulate import run

REPO = Path(__file__).resolve().parents[1]


def config(root: str, rounds: int, runtime: str, extra: list[str]) -> dict:
    overrides = ["experiment=permfl_mnist_mclr", f"dataset.root={root}", f"global_rounds={rounds}", f"runtime={runtime}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=overrides + extra), resolve=True)


def measure(cfg: dict, out: Path) -> dict:
    summary = run(cfg, out)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = lines[1:] or lines  # round 1 includes start-up (actor spawn, imports)
    seconds = statistics.median(line["seconds"] for line in later)
    compute = statistics.median(line["compute_seconds"] for line in later)
    overhead = statistics.median(line["seconds"] - line["compute_seconds"] for line in later)
    return {"summary": summary, "seconds": seconds, "compute": compute, "overhead": overhead}


def overhead(name: str, result: dict) -> str:
    # With team nodes in parallel, summed compute exceeds the wall time: no clean split.
    return "-" if name == "simulation" else f"{result['overhead']:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--root", default=str(REPO.parent / "shared" / "data"), help="folder holding MNIST/raw")
    parser.add_argument("--no-reference", action="store_true", help="skip the in-process reference run")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()

    setups = {
        "inprocess": ("inprocess", []),
        "sim-1actor": ("simulation", [f"runtime.num_cpus_per_team={os.cpu_count()}"]),  # all cores: one actor
        "simulation": ("simulation", []),
    }
    if args.no_reference:
        setups = {"simulation": setups["simulation"]}
    results = {}
    with tempfile.TemporaryDirectory(prefix="hfl-bench-") as tmp:
        for name, (runtime, extra) in setups.items():
            cfg = config(args.root, args.rounds, runtime, extra + args.overrides)
            results[name] = measure(cfg, Path(tmp) / name)

    print(f"\nPerMFL MNIST MCLR, {args.rounds} global rounds (medians over rounds 2..T)")
    print(f"{'set-up':<11} {'best PM':>8} {'final PM':>9} {'best GM':>8} {'final GM':>9} "
          f"{'s/round':>8} {'compute':>8} {'overhead':>9}")
    for name, r in results.items():
        s = r["summary"]
        print(f"{name:<11} {100 * s['best']['pm_accuracy']:8.2f} {100 * s['final']['pm_accuracy']:9.2f} "
              f"{100 * s['best']['gm_accuracy']:8.2f} {100 * s['final']['gm_accuracy']:9.2f} "
              f"{r['seconds']:8.2f} {r['compute']:8.2f} {overhead(name, r):>9}")
    for name in ("sim-1actor", "simulation"):
        if "inprocess" in results and name in results:
            ratio = results[name]["seconds"] / results["inprocess"]["seconds"]
            print(f"{name} / in-process seconds per round: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
