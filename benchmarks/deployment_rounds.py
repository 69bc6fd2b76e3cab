"""Seconds per global round and per team round on a real deployment (loopback processes:
1 global SuperLink, 2 team hosts, 2 devices each), and how its final global model compares
with the in-process simulation of the same configuration.

    .venv/bin/python benchmarks/deployment_rounds.py --team-rounds 1,3 --global-rounds 2

For each K it runs a fresh deployment for T global rounds (evaluating every round) and
prints: median seconds per global round (fit + evaluation, from metrics.jsonl), median
wall seconds of a team fit run and a team evaluation run (job file written -> result
written, per team), and the largest absolute difference from the simulated global model.
The marginal cost of one team round is the slope of the fit run's seconds over K.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from hfl.runtime.apps import compose_config
from hfl.deploy.loopback import Deployment
from hfl.runtime.build import federation_for
from hfl.runtime.simulate import run

BASE = ["topology.num_teams=2", "topology.devices_per_team=2", "dataset.max_samples=300", "dataset.batch_size=32",
        "algorithm.local_steps=5", "algorithm.alpha=0.05"]


def global_model(run_dir: Path) -> list[np.ndarray]:
    with np.load(run_dir / "checkpoints" / "global_model.npz") as f:
        return [f[k] for k in sorted(k for k in f.files if k.startswith("arr_"))]


def team_run_seconds(work: Path, action: str) -> list[float]:
    """Wall seconds from the bridge writing a job to the team run writing its result."""
    return [(d / "result.json").stat().st_mtime - (d / "job.json").stat().st_mtime
            for d in sorted(work.glob(f"team*-work/run-*/round-*-{action}")) if (d / "result.json").exists()]


def measure(team_rounds: int, global_rounds: int, root: Path) -> dict:
    overrides = [*BASE, f"global_rounds={global_rounds}", f"algorithm.team_rounds={team_rounds}"]
    cfg = compose_config(" ".join(overrides), 0)
    dep = Deployment(root / f"K{team_rounds}", [list(t) for t in federation_for(cfg).teams])
    dep.root.mkdir(parents=True)
    try:
        dep.start()
        result = dep.submit([*overrides, "runtime=deployment"], root / f"K{team_rounds}-out")
        if result.returncode:
            raise SystemExit(f"deployment K={team_rounds} failed:\n{result.stdout}\n{result.stderr}\n{dep.logs()}")
    finally:
        dep.stop()
    (run_dir,) = (root / f"K{team_rounds}-out").iterdir()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sim_dir = root / f"K{team_rounds}-sim"
    sim_cfg = compose_config(" ".join([*overrides, "runtime=inprocess"]), 0)
    run(sim_cfg, sim_dir)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(global_model(run_dir), global_model(sim_dir), strict=True))
    sim_last = json.loads((sim_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return {
        "K": team_rounds,
        "s_per_global_round": statistics.median(line["seconds"] for line in lines),
        "fit_run_s": statistics.median(team_run_seconds(dep.root, "fit")),
        "eval_run_s": statistics.median(team_run_seconds(dep.root, "evaluate")),
        "max_abs_diff": diff,
        "pm": (lines[-1]["pm_accuracy"], sim_last["pm_accuracy"]),
        "gm": (lines[-1]["gm_accuracy"], sim_last["gm_accuracy"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--team-rounds", default="1,3", help="comma-separated K values")
    parser.add_argument("--global-rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hfl-deploy-bench-") as tmp:
        rows = [measure(int(k), args.global_rounds, Path(tmp)) for k in args.team_rounds.split(",")]
    print("| K | s / global round | team fit run s | team eval run s | max |x_deploy - x_sim| | PM deploy / sim | GM deploy / sim |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['K']} | {r['s_per_global_round']:.1f} | {r['fit_run_s']:.1f} | {r['eval_run_s']:.1f} | "
              f"{r['max_abs_diff']:.2e} | {100 * r['pm'][0]:.2f} / {100 * r['pm'][1]:.2f} | "
              f"{100 * r['gm'][0]:.2f} / {100 * r['gm'][1]:.2f} |")
    if len(rows) > 1:
        slope = (rows[-1]["fit_run_s"] - rows[0]["fit_run_s"]) / (rows[-1]["K"] - rows[0]["K"])
        print(f"marginal seconds per team round: {slope:.1f}")


if __name__ == "__main__":
    main()
