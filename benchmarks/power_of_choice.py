"""Loss-aware choice of children (``algorithm.candidates``, power-of-choice with the losses the
children last reported; hfl.node.cohort) against a uniform draw, at the root, at the level-1
nodes and at both, on the same tree and data.

FedAvg over a tree of 10 level-1 nodes x 10 devices, Synthetic(1, 1) with MCLR (non-IID: every
device its own model and feature distribution), each node asking 3 of its 10 children a round
(``sample_fraction=[0.3,0.3]``); a loss-aware level draws 6 candidates (``candidates`` 0.6) and
asks the 3 whose last reported training loss is highest. Printed per variant, over ``--seeds``:
the median of the global model's accuracy and loss, each the mean of the 5 rounds up to a few
marks (single rounds swing by several points with 3 devices of 10 per node), and the median
seconds per round.

    .venv/bin/python benchmarks/power_of_choice.py                 # 5 seeds, 40 rounds
    .venv/bin/python benchmarks/power_of_choice.py --seeds 0 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hfl.runtime.simulate import run  # noqa: E402
from tests.conftest import compose_cfg  # noqa: E402

BASE = ["algorithm=fedavg", "dataset=synthetic", "dataset.alpha=1.0", "dataset.beta=1.0", "model=mclr",
        "topology=tree", "topology.fanout=[10,10]", "algorithm.team_rounds=1", "algorithm.local_steps=10",
        "algorithm.sample_fraction=[0.3,0.3]", "runtime=inprocess", "runtime.torch_threads=1"]
VARIANTS = {"uniform": [], "root": ["algorithm.candidates=[0.6,0]"], "level 1": ["algorithm.candidates=[0,0.6]"],
            "both": ["algorithm.candidates=[0.6,0.6]"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    marks = sorted({max(1, args.rounds // 4), args.rounds // 2, args.rounds})
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in VARIANTS.items():
            for seed in seeds:
                out = Path(tmp) / f"{name.replace(' ', '_')}-{seed}"
                summary = run(compose_cfg(*BASE, *extra, f"seed={seed}", f"global_rounds={args.rounds}",
                                          "eval_every=1"), out)
                lines = {line["round"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
                results.setdefault(name, []).append({"lines": lines, "seconds": summary["seconds_per_round"]})
    print(f"FedAvg, Synthetic(1,1) MCLR, fanout [10,10], 3 of 10 children asked per round; median of seeds {seeds}")
    head = " | ".join(f"GM acc / loss, rounds {max(1, m - 4)}-{m}" for m in marks)
    print(f"| variant | {head} | s / round |")
    print("|---|" + "---|" * (len(marks) + 1))
    for name, runs in results.items():
        cells = []
        for m in marks:
            window = range(max(1, m - 4), m + 1)
            acc = statistics.median(statistics.mean(r["lines"][k]["gm_accuracy"] for k in window) for r in runs)
            loss = statistics.median(statistics.mean(r["lines"][k]["gm_loss"] for k in window) for r in runs)
            cells.append(f"{100 * acc:.2f} % / {loss:.3f}")
        seconds = statistics.median(r["seconds"] for r in runs)
        print(f"| {name} | {' | '.join(cells)} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
