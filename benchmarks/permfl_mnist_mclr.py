"""Benchmark: experiment=permfl_mnist_mclr on the MNIST test split.

Prints best/final PM and GM and seconds per global round, split into compute (time
inside the team nodes: device training, team aggregation, evaluation) and Flower
overhead (the rest: messaging, serialisation, Ray scheduling, global aggregation).
The in-process runtime (Flower's server loop, no Ray) runs alongside as a reference, so
the Ray cost is read as a ratio measured on the same machine in the same session.

    .venv/bin/python benchmarks/permfl_mnist_mclr.py --rounds 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hfl.apps import CONF_DIR
from hfl.simulate import run

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--root", default=str(REPO.parent / "shared" / "data"), help="folder holding MNIST/raw")
    parser.add_argument("--no-reference", action="store_true", help="skip the in-process reference run")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()

    runtimes = ["simulation"] if args.no_reference else ["inprocess", "simulation"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="hfl-bench-") as tmp:
        for runtime in runtimes:
            results[runtime] = measure(config(args.root, args.rounds, runtime, args.overrides), Path(tmp) / runtime)

    print(f"\nPerMFL MNIST MCLR, {args.rounds} global rounds (medians over rounds 2..T)")
    print(f"{'runtime':<11} {'best PM':>8} {'final PM':>9} {'best GM':>8} {'final GM':>9} "
          f"{'s/round':>8} {'compute':>8} {'overhead':>9}")
    for runtime, r in results.items():
        s = r["summary"]
        print(f"{runtime:<11} {100 * s['best']['pm_accuracy']:8.2f} {100 * s['final']['pm_accuracy']:9.2f} "
              f"{100 * s['best']['gm_accuracy']:8.2f} {100 * s['final']['gm_accuracy']:9.2f} "
              f"{r['seconds']:8.2f} {r['compute']:8.2f} {r['overhead']:9.2f}")
    if "inprocess" in results:
        ratio = results["simulation"]["seconds"] / results["inprocess"]["seconds"]
        print(f"simulation / in-process seconds per round: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
