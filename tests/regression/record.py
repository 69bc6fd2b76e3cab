"""Record every algorithm's results on a small fixed config, as regression data.

Run before an engine change (``python -m tests.regression.record [names]``) and commit
``models.npz``; ``tests/test_regression.py`` then checks that the engine still computes the
same results (float tolerance 1e-6):

- ``global``: the root's final model (``checkpoints/global_model.npz``);
- ``state/<key>/<name>``: every array of every stored node and device state (hfl.state.store), the
  nodes' models, optimiser moments, samplers and the devices' personal models and samplers;
- ``metrics/<field>``: every number of every ``metrics.jsonl`` row but wall-clock fields.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from hfl.device.state import stored_device_states
from hfl.state.store import StateStore

HERE = Path(__file__).resolve().parent
OUT = HERE / "models.npz"

# The small federation of tests/conftest.py (2 teams x 3 devices, 3 global rounds, K = 2,
# L = 5, seed 0), in-process, plus each algorithm's overrides from its end-to-end test.
FLAT = "algorithm.team_rounds=1"
# B-HFL on a depth-3 tree with proxy training at two levels, residual edges both ways and a
# non-trivial optimiser per direction (tests/test_bhfl.py's tree).
BHFL_DEEP = ["topology=tree", "topology.fanout=[2,2,3]", "dataset.max_samples=200", "dataset.proxy_fraction=0.2",
             "algorithm.proxy_samples=[40,20,0]", "algorithm.residual_down=true", "algorithm.residual_up_k=1",
             "algorithm.up.optimizer=adam", "algorithm.up.lr=0.5"]
# PFLEGO's end-to-end setting (tests/test_pflego.py): 12 devices, 2 classes each, an MLP body.
PFLEGO = ["model=mlp", "model.hidden=8", "dataset.partition=roundrobin", "dataset.classes_per_device=2",
          "dataset.max_samples=120", "dataset.batch_size=100000", "topology=tree", "algorithm.local_steps=5",
          "algorithm.sample_fraction=0.25", "algorithm.server_lr=0.05", FLAT]
# FeMAM's (tests/test_femam.py), shortened: global, 2 clusters, 4 clusters, personal in 8 rounds.
FEMAM = ["dataset=synthetic_multilevel", "dataset.clusters=[2,4]", "dataset.scales=[1.0,1.0,1.0,0.3]",
         "dataset.val_fraction=0.2", "model=mclr", "topology=tree", "global_rounds=8", "algorithm.levels=[1,2,4,0]",
         "algorithm.rounds_per_level=[3,2,2,1]", "algorithm.prune_window=2", "dataset.batch_size=32",
         "algorithm.local_epochs=1", "algorithm.alpha=0.05", "algorithm.team_rounds=1"]
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
    "fedavg_ft": [FLAT],
    "bhfl": [],
    "bhfl_deep": BHFL_DEEP,
    "pflego": PFLEGO,
    "femam": FEMAM,
    "fesem": [*(o for o in FEMAM if not o.startswith(("algorithm.levels", "algorithm.rounds_per_level"))),
              "algorithm.levels=[4]", "topology.fanout=[3,4]", "global_rounds=4"],
}
ALGORITHM = {"bhfl_deep": "bhfl"}  # a case named otherwise than its algorithm
# Wall-clock and machine fields of metrics.jsonl: not results.
TIMING = ("seconds", "compute_seconds", "time", "wall", "elapsed")


def overrides(case: str) -> list[str]:
    from tests.conftest import SMALL

    algorithm = ALGORITHM.get(case, case)
    return [*SMALL, f"algorithm={algorithm}", "runtime=inprocess", "seed=0", *CASES[case]]


def _arrays(path: Path, prefix: str) -> list[np.ndarray]:
    with np.load(path) as data:
        names = sorted((n for n in data.files if n.startswith(prefix) and n[len(prefix):].isdigit()),
                       key=lambda n: int(n[len(prefix):]))
        return [data[n] for n in names]


def _timing(field: str) -> bool:
    return any(part in field for part in TIMING)


def results(run_dir: Path) -> dict[str, np.ndarray]:
    """Every result of a finished run, flat: ``global/<i>``, ``state/<key>/<array>`` (device
    states as ``state/device<d>/<array>``) and ``metrics/<field>`` (a float64 column of the
    evaluated rounds, NaN where a row has None)."""
    out: dict[str, np.ndarray] = {}
    for i, a in enumerate(_arrays(run_dir / "checkpoints" / "global_model.npz", "arr_")):
        out[f"global/{i}"] = a
    store = StateStore(run_dir / "state")
    for path in sorted(store.root.glob("node-*.npz")):
        for name, a in (store.load(path.stem) or {}).items():
            out[f"state/{path.stem}/{name}"] = np.asarray(a)
    for device_id, state in sorted(stored_device_states(store).items()):
        for name, a in state.items():
            out[f"state/device{device_id}/{name}"] = np.asarray(a)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fields = sorted({k for row in rows for k, v in row.items()
                     if (isinstance(v, int | float) or v is None) and not isinstance(v, bool) and not _timing(k)})
    for field in fields:
        column = [row.get(field) for row in rows]
        if all(v is None for v in column):
            continue
        out[f"metrics/{field}"] = np.array([np.nan if v is None else float(v) for v in column])
    return out


def record(case: str) -> dict[str, np.ndarray]:
    from hfl.runtime.simulate import run
    from tests.conftest import compose_cfg

    with tempfile.TemporaryDirectory() as tmp:
        run(compose_cfg(*overrides(case)), Path(tmp))
        found = results(Path(tmp))
    return {f"{case}/{name}": a for name, a in found.items()}


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    flat: dict[str, np.ndarray] = {}
    if OUT.exists() and sys.argv[1:]:  # re-record some cases, keep the others
        with np.load(OUT) as data:
            flat = {k: data[k] for k in data.files if k.split("/")[0] not in names}
    for case in names:
        flat.update(record(case))
        print(f"recorded {case}")
    np.savez_compressed(OUT, **flat)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(flat)} arrays)")


if __name__ == "__main__":
    main()
