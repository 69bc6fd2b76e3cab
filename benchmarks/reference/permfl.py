"""Run the PerMFL authors' released code on hfl's own devices, beside hfl, seed by seed.

The reference is sourasb05/PerMFL_1 (PyTorch; run and checked at commit 85f46c6, "Update
README.md"). Give the path of a checkout of it; nothing of it is copied into this repository:

    git clone /work/.mirror/sourasb05+PerMFL_1/repo /tmp/permfl_ref      # or github.com/sourasb05/PerMFL_1
    .venv/bin/python benchmarks/reference/permfl.py /tmp/permfl_ref --algorithms permfl,perfedavg --rounds 100
    .venv/bin/python benchmarks/reference/permfl.py /tmp/permfl_ref --algorithms permfl --rounds 100 \\
        --override dataset.normalize=per_feature --tag zscore        # one factor changed on both sides

For every (algorithm, seed) it

1. composes hfl's configuration (``experiment=<--experiment> algorithm=<alg> seed=<s>`` + ``--override``)
   and builds the federation with hfl's own code (``hfl.data.build_federation``): the same devices,
   class partition, per-device train/test split, preprocessing and teams an hfl run of that
   configuration trains on;
2. writes them to ``<out>/<tag>/<alg>/seed<s>/data.pkl`` in the structure the authors' ``read_data``
   returns (client ids, the teams as lists of client indices, ``{id: {'x', 'y'}}`` for train and
   test; the images already preprocessed by hfl);
3. starts the authors' ``main.py`` in a subprocess (this file, ``_launch`` mode, with hfl's venv:
   their code needs only torch, numpy, pandas, tqdm) with hfl's settings as their command-line
   arguments, in a fresh temporary working directory (their ``./results``, ``./models`` and
   ``./data`` land there, never in the checkout);
4. runs hfl (``hfl-simulate ... runtime=inprocess``) on the same configuration, unless ``--no-hfl``;
5. prints PM and GM per seed, final and best round, both codes side by side, and the mean ± std.

What the launcher changes in the authors' code, at run time only (monkeypatching in the child
process; no file of the checkout is edited):

* ``utils.model_utils.read_data`` (and the name the server modules import) returns hfl's devices
  instead of generating its own split from a torchvision download (which also pools the 70k
  MNIST images; only the 10k test split is available here, hfl's data are built from it);
* the servers' ``save_results`` (an ``h5py`` writer) is replaced by one that writes the
  per-round accuracies to ``result.json``; when ``h5py`` is not installed an empty stand-in
  module is put in its place, since nothing else uses it;
* Per-FedAvg (``PerAvg``) records, without changing what it trains, two more figures each round
  next to its own ``evaluate_one_step``: the global model before any adaptation (their
  ``evaluate()``, which ``PerAvg.train`` never calls) and hfl's PM protocol (the global model
  after one full-batch alpha-step on the device's *training* split). Their own
  ``evaluate_one_step`` (what the paper's Per-FedAvg figure is) adapts with one alpha step and
  then one beta step, on minibatches of the device's *test* split, then tests on that split.
* ``--ref-classes 10``: the authors' ``Mclr_Logistic()`` for ``--dataset Mnist`` has 62 outputs
  (its EMNIST default); this option gives it 10 (a one-factor experiment; default: as released).
* ``--ref-fix-slip``: ``UserPerMFL.__init__`` passes its arguments to ``User.__init__`` one
  position off, so the device prox coefficient becomes L (local_iters) where lambda belongs; this
  option sets it back to lambda after their constructor ran (``user.lamda`` and a new
  ``pFedMeOptimizer``) - a one-factor experiment; default: as released (the slip).
* torch uses one thread (``torch.set_num_threads``, ``--threads``).

Settings passed to their ``main.py`` (from hfl's resolved configuration): ``--dataset Mnist
--model_name mclr --gpu -1 --batch_size <dataset.batch_size> --alpha --beta --num_global_iters
<T>``; PerMFL: ``--lamda <lam> --gamma --eta --num_team_iters <K> --local_iters <L> --num_teams
--p_teams <all> --numusers <devices per team> --tot_users``; Per-FedAvg: ``--local_iters <L>
--numusers <all devices>``. Their code's own quirks stay: the device prox coefficient is L where
lambda belongs (hfl's ``algorithm.prox_slip=true``), minibatches are taken in order without
shuffling, the initial model comes from their ``torch.manual_seed(0)``, and each round's
Per-FedAvg figure is taken before that round's training.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MNIST_ROOT = REPO.parent / "shared" / "data"
REF_NAMES = {"permfl": "PerMFL", "perfedavg": "PerAvg"}


# ------------------------------------------------------------------ parent side (imports hfl)

def hfl_config(overrides: list[str]) -> dict:
    """hfl's resolved configuration, composed as ``hfl-simulate`` composes it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hfl.config import schema
    from hfl.config.compose import CONF_DIR

    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


def reference_payload(cfg: dict) -> dict:
    """hfl's federation for ``cfg`` as the authors' ``read_data`` returns it:
    clients, groups (teams as client indices), train and test data keyed by client id."""
    from hfl.data import build_federation

    fed = build_federation(cfg["dataset"], cfg["topology"], int(cfg["seed"]))
    train, test = {}, {}
    for d in range(len(fed.devices)):
        dev = fed.devices[d]
        train[d] = {"x": dev.x_train.numpy().reshape(len(dev.y_train), -1).astype("float32"),
                    "y": dev.y_train.numpy().astype("int64")}
        test[d] = {"x": dev.x_test.numpy().reshape(len(dev.y_test), -1).astype("float32"),
                   "y": dev.y_test.numpy().astype("int64")}
    return {"clients": list(range(len(fed.devices))), "groups": [list(map(int, t)) for t in fed.level1_devices],
            "train": train, "test": test, "num_classes": int(fed.num_classes)}


def reference_args(cfg: dict, algorithm: str, payload: dict, rounds: int) -> list[str]:
    """The authors' main.py arguments for hfl's configuration."""
    alg, teams = cfg["algorithm"], payload["groups"]
    n = len(payload["clients"])
    args = ["--dataset", "Mnist", "--model_name", "mclr", "--algorithm", REF_NAMES[algorithm], "--gpu", "-1",
            "--batch_size", str(cfg["dataset"]["batch_size"]), "--alpha", str(alg["alpha"]), "--beta", str(alg["beta"]),
            "--num_global_iters", str(rounds), "--local_iters", str(alg["local_steps"]), "--tot_users", str(n),
            "--num_teams", str(len(teams)), "--times", "1"]
    if algorithm == "permfl":
        sizes = {len(t) for t in teams}
        if len(sizes) != 1:
            raise SystemExit(f"the authors' PerMFL needs equal teams (numusers per team), got sizes {sorted(sizes)}")
        if alg.get("weighted"):
            raise SystemExit("the authors' PerMFL uses uniform means; run hfl's algorithm.weighted=false")
        args += ["--lamda", str(alg["lam"]), "--gamma", str(alg["gamma"]), "--eta", str(alg["eta"]),
                 "--num_team_iters", str(alg["team_rounds"]), "--p_teams", str(len(teams)),
                 "--numusers", str(sizes.pop())]
    else:
        fraction = alg.get("sample_fraction", 1.0)
        fraction = fraction[-1] if isinstance(fraction, list) else fraction
        args += ["--lamda", "0", "--numusers", str(round(float(fraction) * n))]
    return args


def run_reference(ref: Path, cfg: dict, algorithm: str, rounds: int, run_dir: Path, threads: int,
                  ref_classes: int | None, fix_slip: bool = False) -> dict:
    result = run_dir / "result.json"
    if result.exists() and json.loads(result.read_text()).get("rounds") == rounds:
        return json.loads(result.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = reference_payload(cfg)
    data = run_dir / "data.pkl"
    with open(data, "wb") as f:
        pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
    argv = reference_args(cfg, algorithm, payload, rounds)
    (run_dir / "main_args.txt").write_text(" ".join(argv) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="permfl_ref_cwd_") as cwd, open(run_dir / "reference.log", "w") as log:
        command = [sys.executable, str(Path(__file__).resolve()), "_launch", str(ref.resolve()), str(data.resolve()),
                   str(result.resolve()), str(threads), str(ref_classes or 0), str(int(fix_slip)), "--", *argv]
        rc = subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"the authors' code failed (exit {rc}); log: {run_dir / 'reference.log'}")
    data.unlink()  # the devices are rebuilt from the seed; no need to keep 10 MB per run
    out = json.loads(result.read_text())
    out["seconds"] = time.perf_counter() - start
    result.write_text(json.dumps(out))
    return out


def run_hfl(overrides: list[str], run_dir: Path, rounds: int) -> dict:
    summary = run_dir / "summary.json"
    if not (summary.exists() and json.loads(summary.read_text()).get("rounds") == rounds):
        command = [str(REPO / ".venv" / "bin" / "hfl-simulate"), *overrides, "runtime=inprocess",
                   "runtime.torch_threads=1", f"global_rounds={rounds}", f"hydra.run.dir={run_dir}", "overwrite=true"]
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(str(run_dir) + ".log", "w") as log:
            rc = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
        if rc != 0:
            raise SystemExit(f"hfl failed (exit {rc}); log: {run_dir}.log")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"rounds": rounds, "pm": [r.get("pm_accuracy") for r in rows], "gm": [r.get("gm_accuracy") for r in rows]}


def final_best(series: list | None) -> tuple[float, float] | None:
    values = [v for v in (series or []) if v is not None]
    return (100 * values[-1], 100 * max(values)) if values else None


def mean_std(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


# Figures per code: label -> series key in its result.
FIGURES = {
    "permfl": {"hfl": {"PM": "pm", "GM": "gm"}, "ref": {"PM": "pm", "GM": "gm"}},
    "perfedavg": {"hfl": {"PM": "pm", "GM": "gm"},
                  "ref": {"PM (their one_step, test batches)": "pm_one_step", "PM (hfl protocol)": "pm_hfl_protocol",
                          "GM": "gm"}},
}


def report(algorithm: str, results: dict[int, dict[str, dict]]) -> str:
    lines = [f"### {algorithm}", "", "| code | figure | seed | final | best |", "|:--|:--|--:|--:|--:|"]
    summary = ["", "| code | figure | final (mean ± std) | best (mean ± std) |", "|:--|:--|--:|--:|"]
    for code in ("hfl", "ref"):
        for label, key in FIGURES[algorithm][code].items():
            finals, bests = [], []
            for seed, res in sorted(results.items()):
                if code not in res:
                    continue
                fb = final_best(res[code].get(key))
                if fb is None:
                    continue
                finals.append(fb[0])
                bests.append(fb[1])
                lines.append(f"| {code} | {label} | {seed} | {fb[0]:.2f} | {fb[1]:.2f} |")
            if finals:
                summary.append(f"| {'authors' if code == 'ref' else 'hfl'} | {label} | {mean_std(finals)} | {mean_std(bests)} |")
    return "\n".join(lines + summary) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", type=Path, help="a checkout of sourasb05/PerMFL_1 (85f46c6)")
    parser.add_argument("--algorithms", default="permfl,perfedavg", help="permfl and/or perfedavg")
    parser.add_argument("--experiment", default="table1_mnist_mclr", help="hfl's preset (data, model, topology)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=100, help="global rounds T, both codes")
    parser.add_argument("--override", action="append", default=[], help="an hfl override, both codes (repeatable)")
    parser.add_argument("--hfl-override", action="append", default=[], help="an hfl override for hfl's run only")
    parser.add_argument("--tag", default="base", help="subfolder of --out for this variant")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "reference_permfl")
    parser.add_argument("--mnist-root", type=Path, default=MNIST_ROOT)
    parser.add_argument("--no-hfl", action="store_true", help="the authors' code only")
    parser.add_argument("--no-reference", action="store_true", help="hfl only")
    parser.add_argument("--ref-classes", type=int, default=None,
                        help="outputs of the authors' MNIST MCLR (released: 62); 10 for the one-factor experiment")
    parser.add_argument("--ref-fix-slip", action="store_true",
                        help="the authors' PerMFL with lambda (not L) as the device prox coefficient")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if not (args.reference / "main.py").exists():
        parser.error(f"{args.reference} is not a checkout of PerMFL_1 (no main.py)")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    out = args.out.resolve() / args.tag
    text = [f"PerMFL authors' code ({args.reference}) vs hfl, {args.experiment}, T = {args.rounds}, "
            f"overrides {args.override or 'none'}" + (f", hfl only {args.hfl_override}" if args.hfl_override else "")
            + (f", authors' MCLR outputs {args.ref_classes}" if args.ref_classes else "")
            + (", authors' device prox = lambda (slip fixed)" if args.ref_fix_slip else ""), ""]
    for algorithm in [a.strip() for a in args.algorithms.split(",") if a.strip()]:
        if algorithm not in REF_NAMES:
            parser.error(f"unknown algorithm {algorithm!r}: permfl or perfedavg")
        results: dict[int, dict[str, dict]] = {}
        for seed in seeds:
            overrides = [f"experiment={args.experiment}", f"algorithm={algorithm}", f"seed={seed}",
                         f"dataset.root={args.mnist_root.resolve()}", *args.override]
            cfg = hfl_config(overrides)
            results[seed] = {}
            if not args.no_reference:
                t = time.perf_counter()
                results[seed]["ref"] = run_reference(args.reference, cfg, algorithm, args.rounds,
                                                     out / algorithm / f"seed{seed}" / "reference", args.threads,
                                                     args.ref_classes, args.ref_fix_slip)
                print(f"{algorithm} seed {seed}: authors' code {time.perf_counter() - t:.0f} s", flush=True)
            if not args.no_hfl:
                t = time.perf_counter()
                results[seed]["hfl"] = run_hfl(overrides + args.hfl_override, out / algorithm / f"seed{seed}" / "hfl",
                                               args.rounds)
                print(f"{algorithm} seed {seed}: hfl {time.perf_counter() - t:.0f} s", flush=True)
        text.append(report(algorithm, results))
    (out / "report.md").parent.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(text))
    print("\n".join(text))
    print(f"report: {out / 'report.md'}")
    return 0


# ------------------------------------------------------------------ child side (the authors' code)

def launch(ref: str, data_path: str, result_path: str, threads: int, classes: int, fix_slip: bool,
           argv: list[str]) -> None:
    """Start the authors' main.py with ``argv``, fed hfl's devices (see the module docstring)."""
    import copy
    import runpy
    import types

    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, ref)
    try:
        import h5py  # noqa: F401 - only their results writer uses it, replaced below
    except ImportError:
        sys.modules["h5py"] = types.ModuleType("h5py")
    with open(data_path, "rb") as f:
        payload = pickle.load(f)

    import utils.model_utils as model_utils

    def read_data(dataset, num_users, num_labels, num_groups, group_division):  # noqa: ANN001, ANN202 - theirs
        assert num_users == len(payload["clients"]) and num_groups == len(payload["groups"]), (num_users, num_groups)
        return payload["clients"], payload["groups"], payload["train"], payload["test"]

    model_utils.read_data = read_data
    import FLAlgorithms.servers.serverperavg as serverperavg
    import FLAlgorithms.servers.serverPerMFL as serverpermfl
    import FLAlgorithms.trainmodel.models as models

    serverpermfl.read_data = serverperavg.read_data = read_data
    if classes:
        # their __init__(self, input_dim=784, output_dim=62): only the default changes (a subclass would
        # recurse through their super(Mclr_Logistic, self), which looks the name up at call time)
        models.Mclr_Logistic.__init__.__defaults__ = (784, classes)
    if fix_slip:
        import FLAlgorithms.users.userPerMFL as userpermfl

        released_init = userpermfl.UserPerMFL.__init__

        def init(self, device, numeric_id, train_data, test_data, model, model_name, batch_size, alpha, beta, lamda,
                 local_epochs, dataset):  # noqa: ANN001, ANN202 - theirs
            released_init(self, device, numeric_id, train_data, test_data, model, model_name, batch_size, alpha, beta,
                          lamda, local_epochs, dataset)
            self.lamda = lamda
            self.optimizer = userpermfl.pFedMeOptimizer(self.model.parameters(), alpha=self.alpha, lamda=lamda)

        userpermfl.UserPerMFL.__init__ = init

    def dump(series: dict) -> None:
        rounds = int(sys.argv[sys.argv.index("--num_global_iters") + 1])
        Path(result_path).write_text(json.dumps({"rounds": rounds, **{k: [float(v) for v in s] for k, s in series.items()}}))

    def permfl_results(self) -> None:  # noqa: ANN001 - replaces PerMFL.save_results
        dump({"pm": self.avg_per_test_acc, "gm": self.global_test_acc})

    def peravg_results(self) -> None:  # noqa: ANN001 - replaces PerAvg.save_results
        dump({"pm_one_step": self.rs_test_acc_per, "gm": self.rs_glob_acc, "pm_hfl_protocol": self.hfl_protocol_pm})

    one_step = serverperavg.PerAvg.evaluate_one_step

    def evaluate_one_step(self) -> None:  # noqa: ANN001 - records GM and hfl's PM first, then theirs
        self.evaluate()  # the global model as sent (send_parameters ran just before), no adaptation
        correct = total = 0
        for c in self.users:
            saved = copy.deepcopy(list(c.model.parameters()))
            c.model.train()
            for x, y in c.trainloaderfull:  # one full-batch alpha step on the training split
                c.optimizer.zero_grad()
                c.loss(c.model(x), y).backward()
                c.optimizer.step()
            c.model.eval()
            with torch.no_grad():
                for x, y in c.testloaderfull:
                    correct += int((c.model(x).argmax(1) == y).sum())
                    total += len(y)
            c.update_parameters(saved)
        self.hfl_protocol_pm = [*getattr(self, "hfl_protocol_pm", []), correct / total]
        one_step(self)

    serverpermfl.PerMFL.save_results = permfl_results
    serverperavg.PerAvg.save_results = peravg_results
    serverperavg.PerAvg.evaluate_one_step = evaluate_one_step
    sys.argv = [str(Path(ref) / "main.py"), *argv]
    runpy.run_path(str(Path(ref) / "main.py"), run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_launch":
        _, _, ref_, data_, result_, threads_, classes_, fix_, sep, *rest = sys.argv
        assert sep == "--"
        launch(ref_, data_, result_, int(threads_), int(classes_), fix_ == "1", rest)
    else:
        sys.exit(main())
