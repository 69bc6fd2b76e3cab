"""Run the FeMAM authors' code on hfl's own data, as a reference for hfl's FeMAM.

The authors' code: https://github.com/shutong043/FeMAM at commit 86f4ff9 (PyTorch; main.py,
server.py, clients.py, loaddata.py, resnet.py, metric.py). Clone it and give its path:

    git clone https://github.com/shutong043/FeMAM /tmp/femam_ref && git -C /tmp/femam_ref checkout 86f4ff9
    .venv/bin/python benchmarks/reference/femam.py /tmp/femam_ref --seed 0 --rounds 40 \\
        --out outputs/femam_reference

Nothing of theirs is copied into this repository; their code is run from the checkout.

What it does:

1. **Data.** Builds hfl's federation (``hfl.data.federation.build_federation``, through the same
   Hydra composition hfl-simulate uses) for a setting of benchmarks/femam_compare.py (default
   ``mnist_multilevel``: the MNIST test split, ``dataset.partition=multilevel``, 50 devices) and
   seed, with ``dataset.normalize=null`` so that each device's train / validation / test arrays
   are the raw images / 255; these are turned back into uint8 (exactly: checked) and written in
   the layout the authors' ``loaddata.load_memmap_clients`` reads: per client ``train``,
   ``eval`` (= hfl's validation split) and ``test`` arrays as ``<split>_data.dat`` (uint8, NHWC)
   + ``<split>_data.npy`` (its shape) and ``<split>_label.dat`` (int64) + ``.npy``, in the folder
   their code derives from its arguments, with their pickles ``client_by_class`` (each client's
   classes), ``class_by_client`` (each class's clients: its length is their model's number of
   classes) and ``gd_cluster`` (hfl's true cluster of each client at each level). Same clients,
   partition and train/val/test split as the hfl runs of that setting and seed.
   Their ResNet-9's first convolution takes 3 channels: the grey image is written three times
   (NHWC with C = 3). Their code picks its normalisation by ``--data-name``; ``emnist``'s is
   (x/255 - 0.1307) / 0.3081, so hfl's runs of this setting use ``dataset.normalize=[0.1307,0.3081]``
   (femam_compare's mnist_multilevel does): both sides see the same numbers (theirs thrice).

2. **Run.** Their ``main.py`` with ``--use-class-partition True`` (read the per-client data and the
   pickles), ``--data-name emnist``, ``--num-client`` = the setting's devices,
   ``--cluster-num`` = FeMAM's groups per level (default [1,5,5] + the personal level:
   ``--structure-length 4``; their code makes the last level K-means with K = #clients, i.e.
   personal), ``--global-epoch`` = rounds, ``--init-epoch`` = level 1's rounds and
   ``--acc-queue-length`` = each later level's rounds (their convergence test, std of the last
   window's mean validation loss < 1, holds as soon as the window is full: a fixed schedule;
   40 rounds, init 16, window 8 give levels of [16, 8, 8, 8] rounds, as hfl's
   ``algorithm.rounds_per_level=[16,8,8,8]``), the rest their defaults (2 local epochs, batch 32,
   SGD lr 0.01 without momentum, prox 0.01, K-means on the last layer).

   Edits at run time only, by a small launcher (the ``LAUNCHER`` string below, run with this
   interpreter in a fresh process): (a) no GPU here: ``torch.Tensor.cuda`` and
   ``torch.nn.Module.cuda`` are replaced by functions that return the object itself, so their
   ``.cuda(device)`` calls keep everything on the CPU; (b) ``cv2`` (imported by loaddata.py, used
   only to read Tiny-ImageNet) is given an empty stand-in module when it is not installed;
   (c) one torch thread; (d) ``server.Server.test`` is wrapped to record each round's mean test
   accuracy (their code only prints it), and after main.py returns the launcher writes
   ``result.json`` from their ``server`` object: per round the mean validation loss and mean test
   accuracy, their own figure at the round of lowest mean validation loss
   (``meters.optimal_test_accuracy`` / ``optimal_epoch``), the last round's mean test accuracy and
   the clients' level masks. Their code seeds numpy / torch / random with 11 when loaddata is
   imported (not our seed; the data is ours, so only their initialisation and batch order
   differ from hfl's).

Output (``--out``, default outputs/femam_reference): ``<setting>/seed<s>/`` with the data folder,
``main.log`` (their prints) and ``result.json``; the script prints one summary line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
COMMIT = "86f4ff9"

# Run in a fresh interpreter: argv[1] = checkout, argv[2] = result.json, argv[3:] = main.py's arguments.
LAUNCHER = r"""
import json, os, runpy, sys, types
checkout, result_path, main_args = sys.argv[1], sys.argv[2], sys.argv[3:]
import torch
torch.set_num_threads(1)
torch.Tensor.cuda = lambda self, *a, **k: self          # (a) no GPU: stay on the CPU
torch.nn.Module.cuda = lambda self, *a, **k: self
try:
    import cv2  # noqa: F401
except ImportError:
    sys.modules["cv2"] = types.ModuleType("cv2")         # (b) only their Tiny-ImageNet reader uses it
sys.path.insert(0, checkout)
import server as femam_server
test_means = []
original_test = femam_server.Server.test
def recording_test(self, clients):                        # (d) record each round's mean test accuracy
    original_test(self, clients)
    test_means.append(float(self.mean_test_acc))
femam_server.Server.test = recording_test
sys.argv = [os.path.join(checkout, "main.py"), *main_args]
g = runpy.run_path(os.path.join(checkout, "main.py"), run_name="__main__")
srv = g["server"]
m = srv.meters
json.dump({
    "mean_val_loss": [float(v) for _, v in m.overall_eval_loss],
    "mean_val_accuracy": [float(v) for _, v in m.overall_eval_accuracy],
    "mean_test_accuracy": test_means,
    "optimal_epoch": int(m.optimal_epoch),
    "optimal_test_accuracy": float(m.optimal_test_accuracy),
    "min_mean_val_loss": float(m.min_overall_eval_loss),
    "final_test_accuracy": float(srv.mean_test_acc),
    "levels": len(srv.structure),
    "process_mask": [[None if v is None else (bool(v) if isinstance(v, bool) else int(v)) for v in mask]
                     if isinstance(mask, list) else None for mask in srv.process_mask],
}, open(result_path, "w"), indent=1)
"""


def hfl_federation(setting: str, seed: int, mnist_root: Path):
    """hfl's federation for femam_compare's ``setting`` and ``seed``, images unnormalised (x / 255)."""
    import femam_compare
    from hfl.data import build_federation
    from hfl.config.compose import compose_config

    spec = femam_compare.SETTINGS[setting]
    args = argparse.Namespace(mnist_root=mnist_root)
    overrides = [o for o in spec.overrides(args) if not o.startswith("dataset.normalize=")]
    overrides += ["dataset.normalize=null", "dataset.val_fraction=0.15", "topology=random",
                  f"topology.num_teams={femam_compare.TEAMS}",
                  f"topology.devices_per_team={spec.devices // femam_compare.TEAMS}", f"seed={seed}"]
    cfg = compose_config(shlex.join(overrides), 0)
    return build_federation(cfg["dataset"], cfg["topology"], cfg["seed"]), spec


def to_uint8_nhwc(x) -> np.ndarray:
    """hfl's float images x/255 (N, 1, H, W) back to uint8, the grey channel repeated thrice: (N, H, W, 3)."""
    a = x.numpy() if hasattr(x, "numpy") else np.asarray(x)
    u = np.rint(a * 255.0)
    if a.size and (np.abs(u / 255.0 - a).max() > 1e-6 or u.min() < 0 or u.max() > 255):
        raise SystemExit("femam reference: the images are not x/255 of uint8 images (dataset.normalize must be null)")
    u = u.astype(np.uint8)
    if u.ndim != 4 or u.shape[1] not in (1, 3):
        raise SystemExit(f"femam reference: expected images (N, C, H, W), got {u.shape}")
    if u.shape[1] == 1:
        u = np.repeat(u, 3, axis=1)
    return np.ascontiguousarray(u.transpose(0, 2, 3, 1))


def write_memmap(folder: Path, name: str, array: np.ndarray) -> None:
    """One array as their loaddata.memmap_clients writes it: shape in .npy, data in a raw .dat."""
    np.save(folder / f"{name}.npy", np.asarray(array.shape))
    if array.size:
        fp = np.memmap(folder / f"{name}.dat", dtype=array.dtype, mode="w+", shape=array.shape)
        fp[:] = array[:]
        fp.flush()
        del fp
    else:
        (folder / f"{name}.dat").write_bytes(b"")


def data_folder(path: Path, data_name: str, num_class_per_cluster: str, hierarchical_dis: int, alpha: float) -> Path:
    """The folder their load_memmap_clients reads (its formula, with --use-class-partition True and
    --hierarchical-data False)."""
    return path / f"{data_name}_{num_class_per_cluster}__True_False_{hierarchical_dis}_{alpha}"


def write_data(fed, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    num_classes = fed.num_classes
    client_by_class = []
    for d, dev in enumerate(fed.devices):
        sub = folder / f"client{d}"
        sub.mkdir(exist_ok=True)
        for split, (x, y) in {"train": (dev.x_train, dev.y_train), "eval": (dev.x_val, dev.y_val),
                              "test": (dev.x_test, dev.y_test)}.items():
            write_memmap(sub, f"{split}_data", to_uint8_nhwc(x))
            write_memmap(sub, f"{split}_label", y.numpy().astype(np.int64))
        classes = fed.device_classes[d] if fed.device_classes is not None else sorted(
            set(dev.y_train.tolist()) | set(dev.y_val.tolist()) | set(dev.y_test.tolist()))
        client_by_class.append([int(c) for c in classes])
    class_by_client = [[d for d, cs in enumerate(client_by_class) if c in cs] for c in range(num_classes)]
    clusters = [list(p) for p in fed.device_clusters] if fed.device_clusters is not None else [[0]] * len(fed.devices)
    per_level = [np.array([p[level] for p in clusters]) for level in range(len(clusters[0]))]
    gd_cluster = ([len(set(a.tolist())) for a in per_level], per_level)
    for name, value in (("client_by_class", client_by_class), ("class_by_client", class_by_client),
                        ("gd_cluster", gd_cluster)):
        with open(folder / f"{name}.pkl", "wb") as f:
            pickle.dump(value, f)


def main(argv: list[str] | None = None) -> int:
    import femam_compare

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help=f"a checkout of shutong043/FeMAM at {COMMIT}")
    parser.add_argument("--setting", default="mnist_multilevel", choices=sorted(femam_compare.SETTINGS))
    parser.add_argument("--seeds", default="0", help="comma list (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=40, help="--global-epoch (default: %(default)s)")
    parser.add_argument("--init-rounds", type=int, default=None,
                        help="--init-epoch: level 1's rounds (default: femam_compare's schedule for --rounds)")
    parser.add_argument("--window", type=int, default=None,
                        help="--acc-queue-length: each later level's rounds (default: femam_compare's schedule)")
    parser.add_argument("--cluster-num", default="1,5,5", help="groups of the shared levels; a personal level follows")
    parser.add_argument("--mnist-root", type=Path, default=femam_compare.MNIST_ROOT)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "femam_reference")
    parser.add_argument("--data-only", action="store_true", help="write the data, do not run their code")
    args = parser.parse_args(argv)
    checkout = args.checkout.resolve()
    if not (checkout / "main.py").exists() or not (checkout / "server.py").exists():
        parser.error(f"{checkout}: not a FeMAM checkout (no main.py / server.py)")
    groups = [int(k) for k in args.cluster_num.split(",") if k.strip()]
    schedule, window = femam_compare.femam_schedule(args.rounds, len(groups) + 1)
    init = args.init_rounds if args.init_rounds is not None else schedule[0]
    window = args.window if args.window is not None else window
    status = 0
    for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
        run_dir = (args.out / args.setting / f"seed{seed}").resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        fed, spec = hfl_federation(args.setting, seed, args.mnist_root.resolve())
        main_args = ["--path", str(run_dir), "--mark", f"hfl_{args.setting}_seed{seed}", "--data-name", "emnist",
                     "--use-class-partition", "True", "--hierarchical-data", "False",
                     "--num-client", str(len(fed.devices)),
                     "--cluster-num", "[" + ",".join(map(str, groups + [5])) + "]",
                     "--structure-length", str(len(groups) + 1), "--global-epoch", str(args.rounds),
                     "--init-epoch", str(init), "--acc-queue-length", str(window)]
        write_data(fed, data_folder(run_dir, "emnist", "[10]", 6, 0.1))  # their defaults for the last three
        if args.data_only:
            print(f"{args.setting} seed {seed}: data in {run_dir}")
            continue
        result = run_dir / "result.json"
        result.unlink(missing_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        start = time.time()
        with open(run_dir / "main.log", "w") as log:
            rc = subprocess.run([sys.executable, "-c", LAUNCHER, str(checkout), str(result), *main_args],
                                cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        wall = time.time() - start
        if rc != 0 or not result.exists():
            print(f"{args.setting} seed {seed}: their main.py failed (exit {rc}); see {run_dir / 'main.log'}")
            status = 1
            continue
        r = json.loads(result.read_text())
        r["wall_seconds"] = wall
        r["main_args"] = main_args
        result.write_text(json.dumps(r, indent=1))
        print(f"{args.setting} seed {seed}: authors' FeMAM, {args.rounds} rounds (levels {groups}+personal, init {init}, "
              f"window {window}): mean test accuracy at the lowest mean validation loss (after round {r['optimal_epoch']}) "
              f"{100 * r['optimal_test_accuracy']:.2f} %, last round {100 * r['final_test_accuracy']:.2f} %; "
              f"{wall:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
