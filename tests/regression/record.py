"""Record every algorithm's final models on a small fixed config, as regression data.

Run once before an engine change (``python -m tests.regression.record``) and commit
``models.npz``; ``tests/test_regression.py`` then checks that the engine still computes
the same global, team (level-1) and personal models (float tolerance 1e-6).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from hfl.device import stored_device_states
from hfl.store import StateStore

HERE = Path(__file__).resolve().parent
OUT = HERE / "models.npz"

# The small federation of tests/conftest.py (2 teams x 3 devices, 3 global rounds, K = 2,
# L = 5, seed 0), in-process, plus each algorithm's overrides from its end-to-end test.
FLAT = "algorithm.team_rounds=1"
CASES: dict[str, list[str]] = {
    "permfl": [],
    "fedavg": [FLAT],
    "hierfavg": [],
    "local": [FLAT],
    "fedprox": [FLAT],
    "perfedavg": [FLAT, "algorithm.beta=0.05"],
    "perfedavg_hf": [FLAT, "algorithm.beta=0.05"],
    "pfedme": [FLAT],
    "ditto": [FLAT],
    "fedper": [FLAT, "model=dnn"],
    "fedrep": [FLAT, "model=dnn", "algorithm.head_steps=10"],
    "pfedbayes": [FLAT],
    "l2gd": [FLAT],
    "al2gd": ["algorithm.lam_global=1.0"],
    "demlearn": [],
}


def overrides(algorithm: str) -> list[str]:
    from tests.conftest import SMALL

    return [*SMALL, f"algorithm={algorithm}", "runtime=inprocess", "seed=0", *CASES[algorithm]]


def _arrays(path: Path, prefix: str) -> list[np.ndarray]:
    with np.load(path) as data:
        names = sorted((n for n in data.files if n.startswith(prefix) and n[len(prefix):].isdigit()),
                       key=lambda n: int(n[len(prefix):]))
        return [data[n] for n in names]


def final_models(run_dir: Path) -> dict[str, list[np.ndarray]]:
    """``global``, ``team{t}`` (level-1 node models) and ``device{d}`` (personal models) of a
    finished run, read from its checkpoint and state store."""
    out = {"global": _arrays(run_dir / "checkpoints" / "global_model.npz", "arr_")}
    for path in sorted((run_dir / "state").glob("node-*.npz")):  # level-1 nodes: node-0, node-1, ...
        if path.stem[len("node-"):].isdigit():
            out[f"team{path.stem[len('node-'):]}"] = _arrays(path, "w_")
    for device_id, state in sorted(stored_device_states(StateStore(run_dir / "state")).items()):
        count = int(state["num_personal"])
        out[f"device{device_id}"] = [state[f"personal_{i}"] for i in range(count)]
    return {name: arrays for name, arrays in out.items() if arrays}  # devices without a personal model


def record(algorithm: str) -> dict[str, np.ndarray]:
    from tests.conftest import compose_cfg
    from hfl.simulate import run

    with tempfile.TemporaryDirectory() as tmp:
        run(compose_cfg(*overrides(algorithm)), Path(tmp))
        models = final_models(Path(tmp))
    return {f"{algorithm}/{name}/{i}": a for name, arrays in models.items() for i, a in enumerate(arrays)}


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    flat: dict[str, np.ndarray] = {}
    for algorithm in names:
        flat.update(record(algorithm))
        print(f"recorded {algorithm}")
    np.savez_compressed(OUT, **flat)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(flat)} arrays)")


if __name__ == "__main__":
    main()
