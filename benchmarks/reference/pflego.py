"""PFLEGO's authors' code on hfl's own devices, beside hfl (issue 35's PFLEGO rows).

The authors' code is ``main.py`` of https://github.com/sotirisnik/PFLEGO at commit b24b905 (JAX,
with ``mytf23.yml``); pass the path of a checkout of it. Nothing of it is copied here: this script
runs it from the checkout.

    git clone https://github.com/sotirisnik/PFLEGO /tmp/pflego_ref   # then: git -C /tmp/pflego_ref checkout b24b905
    .venv/bin/python benchmarks/reference/pflego.py /tmp/pflego_ref --settings no --seeds 0,1,2 --hfl
    .venv/bin/python benchmarks/reference/pflego.py /tmp/pflego_ref --settings no --seeds 0 --rounds 2   # time a round
    # a variant: 20 devices (4 drawn a round), both codes on the same 20 devices
    .venv/bin/python benchmarks/reference/pflego.py /tmp/pflego_ref --tag devices20 --hfl \
        --hfl-override topology.devices_per_team=20 --their-option num_clients=20
    # their FedPer (main.py's fedavg_personalized) on the same devices
    .venv/bin/python benchmarks/reference/pflego.py /tmp/pflego_ref --settings high --tag fedper \
        --their-option algo=fedavg_personalized

What it does, per (setting, seed):

1. Writes hfl's devices for that seed (``<out>/data/<setting>_seed<s>.npz``): the federation
   ``benchmarks/pflego_table1.py`` runs, built by hfl's own code (``hfl.data.build_federation`` on the
   config ``hfl-simulate`` composes from that script's overrides): the same 100 devices, the same
   classes per device, the same per-device train/test split, the images as the uint8 pixels hfl
   divided by 255.
2. Runs the authors' ``main.py`` in its own venv (``~/.cache/hfl-reference/pflego-venv``: jax[cpu]
   0.4.30 and numpy < 2 from pip; their ``mytf23.yml`` pins jax 0.3.4 on Python 3.7, which has no
   wheels for the Python here) with the paper's settings::

       main.py --dataset_name mnist --algo pflego --num_clients 100 --users_fraction 0.2
               --inner_steps 50 --rounds 200 --client_lr 0.007 --server_lr 0.001 --optimizer adam
               --scenario nopers|highpers

   through a launcher (``--launch``, below) that changes nothing in the file and feeds it our data:
   - ``jax.experimental.optimizers`` / ``stax`` and ``jax.tree_util.tree_multimap`` are aliases of
     their newer homes (``jax.example_libraries``, ``tree_map``): the same functions, moved;
   - ``tensorflow`` and ``tensorflow_datasets`` are stubs: main.py uses them only to load and deal
     MNIST (``tfds.load``, ``RoundRobin``'s ``tf.random.shuffle``), to hold label vectors
     (``tf.Variable(...).numpy()``) and for no-op settings (``set_floatx``, ``tf.device``, an unused
     Keras loss object); ``tfds.load`` returns hfl's pooled samples;
   - ``RoundRobin``, their partition function, is replaced as main.py defines it (the module runs in
     a namespace that swaps that one name): it returns hfl's devices (train split for
     ``mode='train'``, test split for ``mode='test'``) and their classes, in their format;
   - ``MyDataset``, their per-client label mapper, is kept but its label map is set to the device's
     own sorted classes -> 0..K-1 after it is built. Their mapper numbers the labels *present in
     the split*, which is the same map whenever every owned class appears in both splits (always,
     on their 60k/10k data); on hfl's 75/25 split of ~100 samples a device may lack a class in its
     25 test samples, and their map would then shift every later class's test label by one.
   Everything else (the model, U[0, 1) heads from PRNGKey(i), the body's stax initialisers, the
   tau-1 analytic head steps, the joint gradient, the rho*I/C head step, the sampled-normalised
   gradient times I/C into Adam, client sampling from default_rng(1), the evaluation) is theirs.
   Their code has no seed argument: its own randomness (body init PRNGKey(0), heads, sampling)
   is the same for every seed; only hfl's data differ between seeds.
3. Reads their per-round ``Test_Accs`` (the sampled clients after their head update, pooled over
   their test samples) and prints the paper's figure: the mean of the last 10 rounds.
4. With ``--hfl``: runs hfl's PFLEGO on the same devices (``benchmarks/pflego_table1.py``'s command
   for that setting and seed, plus ``--hfl-override``s) and prints its ``pflego_accuracy`` (the same
   protocol) and PM beside theirs.

``--their-option KEY=VALUE`` passes extra main.py options (the last of a repeated option wins);
``--jit-grad`` compiles main.py's ``grad(client.method, ...)`` calls (``jax.jit``, static client;
the same gradients up to float rounding; env HFL_REF_JIT_GRAD=1 to the launcher): their FedPer
takes ~38 s a round eagerly on this machine. ``--hfl-override`` goes to hfl's runs and to the exported data alike; ``--tag`` names the
variant's folders under ``--out``. ``--factor`` applies one of the run-time variations of the
authors' code used to isolate the no-personalisation gap (each a monkeypatch of the launcher,
described in FACTORS). A JSON of the numbers is written to ``<out>/results_<factor>[_<tag>].json``.

Measured (2026-11-26, 2 shared cores, one thread each; the paper's figure, mean ± std over seeds
0, 1, 2 of hfl's data; their code 1.1-1.4 s a round, hfl's 0.3 s):

    no personalisation, 100 devices (75 train / 25 test each): theirs 73.86 ± 1.29, hfl 75.43 ± 0.93
        (paper 90.68); theirs with --factor torch_init 74.58 ± 0.67; --factor their_label_map 63.33 (seed 0)
    same, 20 devices (375 / 125 each, 4 drawn): theirs 84.93 ± 0.36, hfl 85.96 ± 0.35
    same, 10 devices (750 / 250 each, 2 drawn): theirs 87.93 ± 0.61, hfl 87.42 ± 0.40
    high personalisation, 100 devices: theirs 96.85 ± 0.65, hfl 97.35 ± 0.31 (paper 98.43); their FedPer
        (--tag fedper --their-option algo=fedavg_personalized --jit-grad) 96.56 ± 0.69, hfl's FedPer 97.21 (seed 0)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMIT = "b24b905"
VENV = Path.home() / ".cache" / "hfl-reference" / "pflego-venv"
PACKAGES = ["jax[cpu]==0.4.30", "numpy<2", "matplotlib"]  # main.py imports matplotlib.pyplot (unused for pflego)
SCENARIO = {"no": "nopers", "high": "highpers"}  # hfl setting -> their --scenario
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
# Run-time variations of the authors' code (--factor), one factor each, applied by the launcher.
FACTORS = {
    "none": "their code as it is",
    "their_label_map": "their MyDataset's label map as it is (the labels present in each split, numbered in order)",
    "torch_init": "the body's Dense(200) initialised as torch.nn.Linear (weight and bias U(-1/sqrt(784), "
                  "1/sqrt(784))) instead of stax's glorot_normal weight and N(0, 0.01) bias",
}


# ---------------------------------------------------------------- data (hfl's venv)
def hfl_overrides(setting: str, seed: int) -> list[str]:
    """pflego_table1.py's overrides for PFLEGO at ``setting`` and ``seed`` (rounds do not change the data)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import pflego_table1

    args = pflego_table1.parse_args(["--settings", setting, "--algorithms", "pflego", "--seeds", str(seed)])
    (job,) = pflego_table1.build_jobs(args)
    return list(job.overrides)


def hfl_config(overrides: list[str]) -> dict:
    """hfl's resolved configuration for ``overrides``, composed as ``hfl-simulate`` composes it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hfl.config import schema
    from hfl.config.compose import CONF_DIR

    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


def export(setting: str, seed: int, path: Path, extra: list[str]) -> dict:
    """Write hfl's devices for (setting, seed) to ``path`` (``extra``: more Hydra overrides, the
    hfl runs' ``--hfl-override``s); returns counts for the log."""
    import numpy as np

    from hfl.data import build_federation

    cfg = hfl_config(hfl_overrides(setting, seed) + list(extra))
    fed = build_federation(cfg["dataset"], cfg["topology"], int(cfg["seed"]))
    arrays: dict[str, np.ndarray] = {}
    missing_test = 0
    for split in ("train", "test"):
        xs, ys, offsets = [], [], [0]
        for d in range(len(fed.devices)):
            dev = fed.devices[d]
            x = getattr(dev, f"x_{split}").numpy()
            pixels = np.rint(x * 255.0)
            if np.abs(pixels / 255.0 - x).max() > 1e-6 or pixels.min() < 0 or pixels.max() > 255:
                raise SystemExit("hfl's images are not x/255 of uint8 pixels: check dataset.normalize=[0,1]")
            xs.append(pixels.astype(np.uint8).reshape(len(x), 28, 28, 1))  # their in_shape (-1, 28, 28, 1)
            ys.append(getattr(dev, f"y_{split}").numpy().astype(np.int64))
            offsets.append(offsets[-1] + len(x))
            if split == "test":
                missing_test += len(set(fed.device_classes[d]) - set(ys[-1].tolist())) > 0
        arrays[f"x_{split}"], arrays[f"y_{split}"] = np.concatenate(xs), np.concatenate(ys)
        arrays[f"{split}_offsets"] = np.asarray(offsets, np.int64)
    classes = fed.device_classes
    k = max(len(c) for c in classes)
    arrays["classes"] = np.asarray([list(c) + [-1] * (k - len(c)) for c in classes], np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return {"devices": len(classes), "train": len(arrays["y_train"]), "test": len(arrays["y_test"]),
            "devices_missing_a_class_in_test": missing_test}


# ---------------------------------------------------------------- the reference venv
def ensure_venv() -> Path:
    python, marker = VENV / "bin" / "python", VENV / "hfl-packages.txt"
    if not python.exists():
        VENV.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    if not marker.exists() or marker.read_text().split("\n") != PACKAGES:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES], check=True)
        marker.write_text("\n".join(PACKAGES))
    return python


# ---------------------------------------------------------------- the launcher (reference venv)
def launch(checkout: Path, data_path: Path, workdir: Path, factor: str, argv: list[str]) -> None:
    """Run ``checkout/main.py`` with ``argv`` on the devices in ``data_path`` (module docstring, 2)."""
    import contextlib
    import types

    import numpy as np

    import jax
    import jax.example_libraries.optimizers as optimizers
    import jax.example_libraries.stax as stax
    import jax.experimental

    # Moved, not changed: jax 0.3.4's names for the functions main.py imports.
    jax.experimental.optimizers, jax.experimental.stax = optimizers, stax
    sys.modules["jax.experimental.optimizers"], sys.modules["jax.experimental.stax"] = optimizers, stax
    jax.tree_util.tree_multimap = jax.tree_util.tree_map
    jax.tree_leaves = jax.tree_util.tree_leaves  # deprecated alias; used by main.py's FedProx/Ditto only

    data = np.load(data_path)
    devices = len(data["train_offsets"]) - 1

    class Labels(np.ndarray):
        """A label vector with tf.Variable's ``.numpy()``."""

        def numpy(self) -> np.ndarray:
            return np.asarray(self)

    def labels(values) -> Labels:  # noqa: ANN001
        return np.asarray(values, dtype=np.int64).view(Labels)

    def device_split(split: str, d: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = data[f"{split}_offsets"][d], data[f"{split}_offsets"][d + 1]
        return data[f"x_{split}"][lo:hi], data[f"y_{split}"][lo:hi]

    classes = [[int(c) for c in row if c >= 0] for row in data["classes"]]
    owners = [[d for d in range(devices) if c in classes[d]] for c in range(10)]

    def ns(**kw) -> types.SimpleNamespace:  # noqa: ANN003
        return types.SimpleNamespace(**kw)

    tf = types.ModuleType("tensorflow")
    tf.__version__ = "stub (benchmarks/reference/pflego.py: data from hfl)"
    tf.config = ns(experimental=ns(set_visible_devices=lambda *a, **k: None))
    tf.keras = ns(backend=ns(set_floatx=lambda *a, **k: None),
                  losses=ns(CategoricalCrossentropy=lambda *a, **k: None, Reduction=ns(SUM="sum")))
    tf.executing_eagerly = lambda: True
    tf.device = lambda *a, **k: contextlib.nullcontext()
    tf.Variable = lambda value, dtype=None, **k: labels(value)
    tfds = types.ModuleType("tensorflow_datasets")

    def tfds_load(name: str, **kwargs) -> dict:  # noqa: ANN003
        if name != "mnist":
            raise SystemExit(f"the launcher feeds MNIST only, main.py asked for {name!r}")
        return {split: (data[f"x_{split}"], labels(data[f"y_{split}"])) for split in ("train", "test")}

    tfds.load = tfds_load
    sys.modules["tensorflow"], sys.modules["tensorflow_datasets"] = tf, tfds

    def round_robin(sample_per_class, num_users=100, cat_per_client=None, mode="train",  # noqa: ANN001
                    users_that_have_cat=None, rng=None, scenario="mediumpers"):  # noqa: ANN001
        """hfl's devices in RoundRobin's format: (users, their classes, each class's owners)."""
        if num_users != devices:
            raise SystemExit(f"main.py asks for {num_users} clients, the data has {devices} devices")
        split = "train" if mode == "train" else "test"
        users = []
        for d in range(devices):
            x, y = device_split(split, d)
            users.append({"image": x, "label": labels(y), "classes": classes[d]})
        return users, [np.asarray(c) for c in classes], owners

    def own_classes(dataset_class):  # noqa: ANN001, ANN202
        class OwnedClasses(dataset_class):
            """Their MyDataset; labels mapped by the device's own sorted classes (docstring, 2)."""

            def __init__(self, ds, par="omniglot", num_classes=None) -> None:  # noqa: ANN001
                super().__init__(ds, par, num_classes)
                self.label_counter = {c: i for i, c in enumerate(sorted(ds["classes"]))}

        return OwnedClasses

    def torch_init_dense(dense):  # noqa: ANN001, ANN202
        def dense_torch(out_dim, W_init=None, b_init=None):  # noqa: ANN001, N803
            bound = {}

            def w_init(key, shape, dtype=jax.numpy.float32):  # noqa: ANN001
                bound["b"] = 1.0 / np.sqrt(shape[0])  # fan_in
                return jax.random.uniform(key, shape, dtype, -bound["b"], bound["b"])

            def bias_init(key, shape, dtype=jax.numpy.float32):  # noqa: ANN001
                return jax.random.uniform(key, shape, dtype, -bound["b"], bound["b"])

            return dense(out_dim, W_init=w_init, b_init=bias_init)

        return dense_torch

    def jit_grad(original):  # noqa: ANN001, ANN202
        """``grad`` as main.py imports it, but ``grad(client.method, argnums)`` is compiled once per
        (method, argnums, client): the same gradients, up to float rounding, without eager dispatch."""
        import inspect

        cache: dict = {}

        def grad(fun, argnums=0, **kwargs):  # noqa: ANN001, ANN003, ANN202
            if kwargs or not inspect.ismethod(fun):
                return original(fun, argnums, **kwargs)
            single = isinstance(argnums, int)
            nums = (argnums,) if single else tuple(argnums)
            key = (fun.__func__, nums)
            if key not in cache:
                shifted = nums[0] + 1 if single else tuple(n + 1 for n in nums)
                cache[key] = jax.jit(original(fun.__func__, shifted), static_argnums=0)
            compiled, owner = cache[key], fun.__self__
            return lambda *args: compiled(owner, *args)

        return grad

    swaps = {"RoundRobin": lambda value: round_robin, "MyDataset": own_classes}
    if os.environ.get("HFL_REF_JIT_GRAD") == "1":
        swaps["grad"] = jit_grad
    if factor == "their_label_map":
        del swaps["MyDataset"]
    elif factor == "torch_init":
        swaps["Dense"] = torch_init_dense
    elif factor != "none":
        raise SystemExit(f"unknown factor {factor!r}; known: {', '.join(FACTORS)}")

    class Module(dict):
        """main.py's module namespace: the names in ``swaps`` are replaced as main.py binds them."""

        def __setitem__(self, key: str, value) -> None:  # noqa: ANN001
            if key in swaps and not getattr(value, "_hfl_swapped", False):
                value = swaps[key](value)
                try:
                    value._hfl_swapped = True
                except (AttributeError, TypeError):
                    pass
            super().__setitem__(key, value)

    source = (checkout / "main.py").read_text()
    namespace = Module(__name__="__main__", __file__=str(checkout / "main.py"), __builtins__=__builtins__)
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)  # main.py writes its results to ../out/results/...
    sys.argv = ["main.py", *argv]
    exec(compile(source, str(checkout / "main.py"), "exec"), namespace, namespace)  # noqa: S102


# ---------------------------------------------------------------- driver (hfl's venv)
def their_argv(setting: str, rounds: int, extra: list[str]) -> list[str]:
    argv = ["--dataset_name", "mnist", "--algo", "pflego", "--num_clients", "100", "--users_fraction", "0.2",
            "--inner_steps", "50", "--rounds", str(rounds), "--client_lr", "0.007", "--server_lr", "0.001",
            "--optimizer", "adam", "--scenario", SCENARIO[setting]]
    for item in extra:
        key, _, value = item.partition("=")
        argv += [f"--{key.lstrip('-')}", value]
    return argv


def run_theirs(args: argparse.Namespace, setting: str, seed: int, data: Path) -> dict:
    python = ensure_venv()
    run = args.out / "theirs" / args.factor / (args.tag or "default") / setting / f"seed{seed}"
    workdir = run / "cwd"
    argv = their_argv(setting, args.rounds, args.their_option)
    command = [str(python), str(Path(__file__).resolve()), "--launch", str(args.checkout), str(data), str(workdir),
               args.factor, "--", *argv]
    run.mkdir(parents=True, exist_ok=True)
    log = run / "main.log"
    start = time.perf_counter()
    env = {**os.environ, **ONE_THREAD, "HFL_REF_JIT_GRAD": "1" if args.jit_grad else "0"}
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"their main.py failed ({done.returncode}); see {log}\n{shlex.join(command)}")
    (accs_file,) = list((run / "out").rglob("*_Test_Accs_*.npy"))
    import numpy as np

    accs = [float(a) for a in np.load(accs_file)]
    (run / "test_accs.json").write_text(json.dumps(accs))
    return {"figure": 100 * statistics.mean(accs[-10:]), "last": 100 * accs[-1], "wall": wall,
            "per_round": wall / len(accs), "rounds": len(accs), "command": shlex.join(command)}


def run_hfl(args: argparse.Namespace, setting: str, seed: int) -> dict:
    out = args.out / "hfl" / (args.tag or "default")
    command = [sys.executable, str(REPO / "benchmarks" / "pflego_table1.py"), "--settings", setting, "--algorithms",
               args.hfl_algorithm, "--seeds", str(seed), "--rounds", str(args.rounds), "--out", str(out), "--no-report",
               "--override", "runtime.torch_threads=1", *[f"--override={o}" for o in args.hfl_override]]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **ONE_THREAD})
    wall = time.perf_counter() - start
    run = out / setting / args.hfl_algorithm / f"seed{seed}"
    if done.returncode != 0 or not (run / "summary.json").exists():
        raise SystemExit(f"hfl failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    final = json.loads((run / "summary.json").read_text())["final"]
    return {"figure": 100 * final["pflego_accuracy"], "pm": 100 * final["pm_accuracy"], "wall": wall,
            "command": shlex.join(command)}


def mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--launch"]:
        checkout, data, workdir, factor = argv[1:5]
        launch(Path(checkout), Path(data), Path(workdir), factor, argv[6:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help=f"a checkout of sotirisnik/PFLEGO (commit {COMMIT})")
    parser.add_argument("--settings", default="no", help="comma list of no, high (default: %(default)s)")
    parser.add_argument("--seeds", default="0,1,2", help="comma list (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=200, help="T (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "pflego_reference")
    parser.add_argument("--factor", default="none", choices=list(FACTORS), help="variation of their code")
    parser.add_argument("--their-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra main.py option, e.g. optimizer=sgd (repeatable)")
    parser.add_argument("--hfl", action="store_true", help="also run hfl's PFLEGO on the same devices")
    parser.add_argument("--hfl-algorithm", default="pflego", choices=["pflego", "fedper", "fedavg"],
                        help="which of pflego_table1.py's algorithms hfl runs (default: %(default)s)")
    parser.add_argument("--hfl-override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Hydra override for hfl's runs and the exported data (repeatable)")
    parser.add_argument("--tag", default="", help="names this variant's folders (data, their runs, hfl's runs)")
    parser.add_argument("--jit-grad", action="store_true",
                        help="compile main.py's grad(client.method) calls (jax.jit, once per client): their "
                             "FedPer (50 joint gradients per client) takes ~38 s a round eagerly here")
    parser.add_argument("--skip-theirs", action="store_true", help="run hfl only")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.checkout = args.checkout.resolve()
    if not (args.checkout / "main.py").exists():
        parser.error(f"{args.checkout} has no main.py")
    settings = args.settings.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    head = subprocess.run(["git", "-C", str(args.checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    print(f"authors' code: {args.checkout} at {head or '?'} (expected {COMMIT}); factor {args.factor}: "
          f"{FACTORS[args.factor]}; rounds {args.rounds}", flush=True)
    results: dict[str, dict[int, dict]] = {}
    for setting in settings:
        for seed in seeds:
            row: dict = {}
            if not args.skip_theirs:
                data = args.out / "data" / (args.tag or "default") / f"{setting}_seed{seed}.npz"
                counts = export(setting, seed, data, args.hfl_override)
                print(f"[{setting} seed {seed}] data: {counts}", flush=True)
                row["theirs"] = run_theirs(args, setting, seed, data)
                print(f"[{setting} seed {seed}] theirs: {row['theirs']['figure']:.2f} (last round "
                      f"{row['theirs']['last']:.2f}), {row['theirs']['per_round']:.2f} s/round", flush=True)
            if args.hfl:
                row["hfl"] = run_hfl(args, setting, seed)
                print(f"[{setting} seed {seed}] hfl: figure {row['hfl']['figure']:.2f}, PM {row['hfl']['pm']:.2f}, "
                      f"{row['hfl']['wall']:.0f} s", flush=True)
            results.setdefault(setting, {})[seed] = row
    (args.out / f"results_{args.factor}{'_' + args.tag if args.tag else ''}.json").write_text(
        json.dumps(results, indent=1))
    for setting, rows in results.items():
        print(f"\n{setting} personalisation, {args.rounds} rounds, factor {args.factor}, tag {args.tag or '-'}, "
              f"hfl overrides {args.hfl_override}, their options {args.their_option}; the paper's figure "
              f"(sampled clients after their head update, mean of the last 10 rounds), %")
        print("| seed | authors' code | hfl figure | hfl PM |\n|---:|---:|---:|---:|")
        for seed, row in rows.items():
            theirs = f"{row['theirs']['figure']:.2f}" if "theirs" in row else "—"
            ours = (f"{row['hfl']['figure']:.2f} | {row['hfl']['pm']:.2f}") if "hfl" in row else "— | —"
            print(f"| {seed} | {theirs} | {ours} |")
        cols = []
        for key in ("theirs", "hfl"):
            vals = [row[key]["figure"] for row in rows.values() if key in row]
            cols.append(mean_std(vals) if vals else "—")
        pms = [row["hfl"]["pm"] for row in rows.values() if "hfl" in row]
        print(f"| mean ± std | {cols[0]} | {cols[1]} | {mean_std(pms) if pms else '—'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
