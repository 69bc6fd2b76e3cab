"""Seconds per global round on a real deployment (loopback processes: the root's SuperLink, a
host per inner node, a SuperNode per device), and how its final global model compares with the
in-process run of the same configuration.

    .venv/bin/python benchmarks/deployment_rounds.py --team-rounds 1,3 --global-rounds 3
    .venv/bin/python benchmarks/deployment_rounds.py --fanout 2,2,2 --team-rounds 1 --global-rounds 3 algorithm=bhfl
    .venv/bin/python benchmarks/deployment_rounds.py --modes per-message,warm   # Flower's process per message, then the runner

For each K (rounds of the lowest nodes per call) it runs a fresh deployment for T global rounds,
evaluating every round, and prints: the first global round's seconds (node servers start,
children are found), the median seconds of the later ones (fit + evaluation, metrics.jsonl),
the median seconds a level-1 node takes to answer a fit (request posted -> reply written, its
mailbox), the CPU-seconds a device host spends per message it receives (its SuperNode, its runner or
worker, and every process they started: ClientApps, Flower's SuperExec) over the whole run and over
rounds 2..T (once its processes are up, with torch and the app loaded), and the largest absolute
difference from the in-process global model. The marginal cost of one lowest-level round is the slope
of the later rounds' seconds over K. ``--modes``: each host's messages taken by its warm runner
(hfl.deploy.runner, the default) or by a process Flower starts per message (``per-message``), measured
one after the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from hfl.deploy.loopback import Deployment
from hfl.config.compose import compose_config
from hfl.runtime.build import federation_for
from hfl.runtime.simulate import run

BASE = ["dataset.max_samples=300", "dataset.batch_size=32", "algorithm.local_steps=5", "algorithm.alpha=0.05",
        "eval_every=1"]


def global_model(run_dir: Path) -> list[np.ndarray]:
    with np.load(run_dir / "checkpoints" / "global_model.npz") as f:
        return [f[k] for k in sorted(k for k in f.files if k.startswith("arr_"))]


def answer_seconds(dep: Deployment, action: str) -> list[float]:
    """Per level-1 node and request: seconds from the bridge posting it to the node server's reply."""
    out = []
    for path in dep.tree.nodes_at(1):
        for reply in (dep.root / f"node-{path}-work").glob(f"run-*/replies/{action}-*.json"):
            out.append(reply.stat().st_mtime - (reply.parent.parent / "requests" / reply.name).stat().st_mtime)
    return out


def host_cpu_seconds(dep: Deployment, names: list[str]) -> float:
    """CPU-seconds of the named processes and of every process they started (live ones, and those
    that ended, as their parents' children times)."""
    total = 0.0
    for name in names:
        try:
            root = psutil.Process(dep.procs[name].pid)
            for proc in [root, *root.children(recursive=True)]:
                t = proc.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
        except (KeyError, psutil.NoSuchProcess):
            continue
    return total


def device_messages(dep: Deployment, device_id: int) -> int:
    """Messages device ``device_id``'s SuperNode received (its log's lines)."""
    return (dep.root / f"device{device_id}.log").read_text(errors="replace").count("Received successfully")


def measure(topology: list[str], team_rounds: int, global_rounds: int, root: Path, mode: str = "warm") -> dict:
    overrides = [*BASE, *topology, f"global_rounds={global_rounds}", f"algorithm.team_rounds={team_rounds}"]
    cfg = compose_config(" ".join(overrides), 0)
    name = f"{mode}-K{team_rounds}"
    dep = Deployment(root / name, federation_for(cfg).tree, per_message=mode == "per-message")
    dep.root.mkdir(parents=True)
    devices = list(dep.tree.devices_under(""))
    out = root / f"{name}-out"
    try:
        dep.start()
        submit = subprocess.Popen(dep.submit_command(out, "--timeout", "600", *overrides, "runtime=deployment"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # After round 1 (processes started, torch and the app loaded): the steady state's starting point
        while submit.poll() is None and not any(f.stat().st_size for f in out.glob("*/metrics.jsonl")):
            time.sleep(0.05)
        cpu_first = [host_cpu_seconds(dep, [f"device{d}", f"worker{d}"]) for d in devices]
        messages_first = [device_messages(dep, d) for d in devices]
        stdout, stderr = submit.communicate(timeout=900)
        if submit.returncode:
            raise SystemExit(f"deployment {name} failed:\n{stdout}\n{stderr}\n{dep.logs()}")
        cpu = [host_cpu_seconds(dep, [f"device{d}", f"worker{d}"]) for d in devices]
        messages = [device_messages(dep, d) for d in devices]
    finally:
        dep.stop()
    (run_dir,) = (root / f"{name}-out").iterdir()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sim_dir = root / f"{name}-sim"
    run(compose_config(" ".join([*overrides, "runtime=inprocess"]), 0), sim_dir)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(global_model(run_dir), global_model(sim_dir), strict=True))
    sim_last = json.loads((sim_dir / "metrics.jsonl").read_text().splitlines()[-1])
    later = [line["seconds"] for line in lines[1:]] or [float("nan")]
    return {
        "mode": mode,
        "cpu_per_message": statistics.median(c / max(m, 1) for c, m in zip(cpu, messages, strict=True)),
        # rounds 2..T only: what a message costs once the host's processes are up
        "steady_cpu_per_message": statistics.median((c - c1) / max(m - m1, 1) for c, c1, m, m1 in zip(
            cpu, cpu_first, messages, messages_first, strict=True)),
        "K": team_rounds,
        "first_s": lines[0]["seconds"],
        "s_per_global_round": statistics.median(later),
        "node_fit_s": statistics.median(answer_seconds(dep, "fit")),
        "max_abs_diff": diff,
        "pm": (lines[-1].get("pm_accuracy", float("nan")), sim_last.get("pm_accuracy", float("nan"))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--team-rounds", default="1,3", help="comma-separated K values")
    parser.add_argument("--global-rounds", type=int, default=3)
    parser.add_argument("--fanout", help="a tree, e.g. 2,2,2 (default: 2 teams x 2 devices)")
    parser.add_argument("--modes", default="warm", help="comma-separated: warm (the hosts' runners), per-message")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides, e.g. algorithm=bhfl")
    args = parser.parse_args()
    topology = ["topology=tree", f"topology.fanout=[{args.fanout}]"] if args.fanout else \
        ["topology.num_teams=2", "topology.devices_per_team=2"]
    with tempfile.TemporaryDirectory(prefix="hfl-deploy-bench-") as tmp:
        rows = [measure([*topology, *args.overrides], int(k), args.global_rounds, Path(tmp), mode)
                for mode in args.modes.split(",") for k in args.team_rounds.split(",")]
    print("| mode | K | first global round s | later global rounds s (median) | level-1 node fit s | "
          "device host CPU-s per message (all / rounds 2..T) | max abs diff to in-process | PM deploy / in-process |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['K']} | {r['first_s']:.1f} | {r['s_per_global_round']:.2f} | {r['node_fit_s']:.2f} | "
              f"{r['cpu_per_message']:.3f} / {r['steady_cpu_per_message']:.3f} | {r['max_abs_diff']:.2e} | {100 * r['pm'][0]:.2f} / {100 * r['pm'][1]:.2f} |")
    for mode in args.modes.split(","):
        mine = [r for r in rows if r["mode"] == mode]
        if len(mine) > 1:
            slope = (mine[-1]["s_per_global_round"] - mine[0]["s_per_global_round"]) / (mine[-1]["K"] - mine[0]["K"])
            print(f"{mode}: marginal seconds per lowest-level round: {slope:.2f}")


if __name__ == "__main__":
    main()
