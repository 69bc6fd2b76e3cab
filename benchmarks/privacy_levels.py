"""Benchmark: differential privacy at the lowest servers versus at the root (issue 52's table).

PerMFL and B-HFL on the MNIST test split with MCLR (4 teams x 10 devices by default, the pFedMe
2-class split), in process. For each target ε (δ = 1e-5) the noise multiplier is the accountant's for the
run's rounds and sampling (hfl.rules.privacy.noise_for_epsilon): at the lowest servers each team
asks half its devices per team round (q = 0.5, global_rounds x team_rounds steps); at the root
every team is asked each global round (q = 1, global_rounds steps). Prints final PM and GM
accuracy per algorithm, DP level and ε, and the runs without DP, as a Markdown table.

    .venv/bin/python benchmarks/privacy_levels.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hfl.config import schema
from hfl.config.compose import CONF_DIR
from hfl.config.typed import algorithm_params
from hfl.node.privacy import PrivacySettings, plan
from hfl.rules.privacy import noise_for_epsilon
from hfl.runtime.simulate import run

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = {
    "permfl": ["experiment=permfl_mnist_mclr"],
    "bhfl": ["algorithm=bhfl", "dataset=mnist", "model=mclr", "dataset.batch_size=124",
             "dataset.normalize=[0.5,0.5]", "algorithm.alpha=0.01"],
}


def config(algorithm: str, args: argparse.Namespace, extra: list[str]) -> dict:
    overrides = [*ALGORITHMS[algorithm], f"dataset.root={args.root}", f"global_rounds={args.rounds}",
                 f"algorithm.team_rounds={args.team_rounds}", f"algorithm.local_steps={args.local_steps}",
                 "algorithm.sample_fraction=[1,0.5]", f"eval_every={args.rounds}", "runtime=inprocess",
                 "runtime.torch_threads=1", f"topology.devices_per_team={args.devices_per_team}", *extra]
    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


def noise_for(cfg: dict, level: str, epsilon: float) -> tuple[float, float, int]:
    """The noise multiplier whose ε after the run is ``epsilon``, and the run's q and steps."""
    settings = PrivacySettings.of({**cfg["privacy"], "level": level, "clip": 1.0, "noise_multiplier": 1.0})
    accounting = plan(settings, algorithm_params(cfg["algorithm"]), 2)
    steps = accounting.steps_per_round * int(cfg["global_rounds"])
    return noise_for_epsilon(epsilon, accounting.sample_rate, steps, 1e-5), accounting.sample_rate, steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(REPO.parent / "shared" / "data"), help="folder holding MNIST/raw")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--team-rounds", type=int, default=2)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--devices-per-team", type=int, default=10, help="4 teams of this many devices")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in args.algorithms:
            cases = [("none", None)] + [(level, eps) for level in ("lowest", "root") for eps in args.epsilons]
            for level, eps in cases:
                extra, sigma, q, steps = [], 0.0, None, None
                if eps is not None:
                    sigma, q, steps = noise_for(config(algorithm, args, []), level, eps)
                    extra = [f"privacy.level={level}", f"privacy.clip={args.clip}", f"privacy.noise_multiplier={sigma}"]
                start = time.perf_counter()
                out = Path(tmp) / f"{algorithm}-{level}-{eps}"
                run(config(algorithm, args, extra), out)
                last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
                rows.append((algorithm, level, eps, sigma, q, steps, last.get("dp_epsilon"), last.get("pm_accuracy"),
                             last.get("gm_accuracy"), time.perf_counter() - start))
                print(rows[-1], flush=True)
    print()
    print("| algorithm | DP level | target ε | noise multiplier | q | steps | ε spent | PM | GM | seconds |")
    print("|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for algorithm, level, eps, sigma, q, steps, spent, pm, gm, seconds in rows:
        def pct(v: float | None) -> str:
            return "—" if v is None else f"{100 * v:.2f}%"
        print(f"| {algorithm} | {level} | {'—' if eps is None else eps:} | {sigma:.3f} | {'—' if q is None else q} | "
              f"{'—' if steps is None else steps} | {'—' if spent is None else f'{spent:.2f}'} | {pct(pm)} | "
              f"{pct(gm)} | {seconds:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
