"""Speed of device training: the batched path (runtime.batched=on) against the per-device path
(off) and a textbook PyTorch loop, each measured in this same run (ratios carry between
machines, absolute seconds do not). Prints median seconds per global round (rounds 2..T; round
1 holds start-up) and the peak resident memory of all processes (driver, Ray's processes and
actors).

    .venv/bin/python benchmarks/speed.py                 # every section
    .venv/bin/python benchmarks/speed.py --only mclr,devices
    .venv/bin/python benchmarks/speed.py --only cnn --device cuda

Sections:
- ``mclr``: experiment=permfl_mnist_mclr (4 teams x 10 devices, K = 10, L = 20, batch 124) in
  process: batched, per-device, and the textbook loop (nn.Module + optim.SGD + DataLoader,
  prox term in the loss: the same device work, server rules reduced to means); then the
  default Ray simulation, batched.
- ``devices``: 3,500 devices (5 x 700 Synthetic, MCLR, K = 2, L = 5) on the default Ray
  simulation, batched and per-device, evaluated every round; at least 12 rounds (see MIN_ROUNDS).
- ``cnn``: experiment=table1_mnist_cnn with PerMFL, a shortened global round (K = 1, L = 2,
  evaluated only in the last round, so the median round is training alone): seconds per device
  step and the full round (K = 10, L = 20) extrapolated from it; batched forced on against off
  (runtime.batched=auto picks per-device for the CNN on a CPU, hfl.accel.batched.batching_pays).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from hfl.config import schema
from hfl.config.compose import CONF_DIR
from hfl.models import build_model
from hfl.runtime.build import federation_for
from hfl.runtime.simulate import run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_memory import PeakMemory  # noqa: E402 - benchmarks/ is no package

REPO = Path(__file__).resolve().parents[1]
MNIST_ROOT = str(REPO.parent / "shared" / "data")
DEVICES_3500 = ["topology.num_teams=5", "topology.devices_per_team=700", "algorithm.team_rounds=2",
                "algorithm.local_steps=5"]


def config(overrides: list[str]) -> dict:
    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


def timed_run(overrides: list[str], out: Path) -> dict:
    """One hfl run; median seconds per global round over rounds 2..T (every round, evaluated or
    not: the summary's seconds_per_round) and peak memory."""
    cfg = config(overrides)
    with PeakMemory() as peak:
        summary = run(cfg, out)
    return {"seconds": summary["seconds_per_round"], "gib": peak.gib,
            "pm": summary["final"].get("pm_accuracy"), "gm": summary["final"].get("gm_accuracy")}


def textbook_round_seconds(overrides: list[str], rounds: int) -> dict:
    """PerMFL's device work written the textbook way: per device an nn.Module loaded with the
    team model, optim.SGD, a shuffling DataLoader (restarted when exhausted) and the prox term
    lam/2 ||theta - w||^2 in the loss; team and global models are plain means. Median seconds
    per global round over rounds 2..T."""
    cfg = config(overrides)
    alg, fed = cfg["algorithm"], federation_for(cfg)
    model = build_model(cfg["model"], fed.input_shape, fed.num_classes)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    loaders = {d: DataLoader(TensorDataset(fed.devices[d].x_train, fed.devices[d].y_train),
                             batch_size=int(cfg["dataset"]["batch_size"]), shuffle=True) for d in range(len(fed.devices))}
    iterators = {d: iter(loader) for d, loader in loaders.items()}
    seconds = []
    with PeakMemory() as peak:
        for _ in range(rounds):
            start = time.perf_counter()
            team_states = []
            for team in fed.level1_devices:
                team_state = {k: v.clone() for k, v in global_state.items()}
                for _ in range(int(alg["team_rounds"])):
                    device_states = []
                    anchor = [v.clone() for v in team_state.values()]
                    for d in team:
                        model.load_state_dict(team_state)
                        opt = torch.optim.SGD(model.parameters(), lr=float(alg["alpha"]))
                        for _ in range(int(alg["local_steps"])):
                            try:
                                x, y = next(iterators[d])
                            except StopIteration:
                                iterators[d] = iter(loaders[d])
                                x, y = next(iterators[d])
                            prox = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))
                            loss = F.nll_loss(model(x), y) + float(alg["lam"]) / 2 * prox
                            opt.zero_grad()
                            loss.backward()
                            opt.step()
                        device_states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
                    team_state = {k: torch.stack([s[k] for s in device_states]).mean(0) for k in team_state}
                team_states.append(team_state)
            global_state = {k: torch.stack([s[k] for s in team_states]).mean(0) for k in global_state}
            seconds.append(time.perf_counter() - start)
    return {"seconds": statistics.median(seconds[1:] or seconds), "gib": peak.gib, "pm": None, "gm": None}


def ray_gpus(device: str, teams: int) -> list[str]:
    """On a GPU the team actors share it: Ray's num_gpus 1/teams each."""
    return [f"runtime.num_gpus_per_team={1 / teams}"] if device == "cuda" else []


def line(name: str, r: dict, reference: dict | None) -> str:
    ratio = f"{r['seconds'] / reference['seconds']:7.3f}x" if reference else "        -"
    acc = lambda v: f"{100 * v:6.2f}" if v is not None else "     -"  # noqa: E731
    return f"  {name:<34} {r['seconds']:8.3f} {ratio} {r['gib']:8.2f} {acc(r['pm'])} {acc(r['gm'])}"


HEADER = f"  {'set-up':<34} {'s/round':>8} {'vs ref':>8} {'peak GiB':>8} {'PM %':>6} {'GM %':>6}"


def section_mclr(tmp: Path, rounds: int, device: str) -> None:
    base = ["experiment=permfl_mnist_mclr", f"dataset.root={MNIST_ROOT}", f"global_rounds={rounds}",
            f"runtime.device={device}"]
    results = {
        "textbook loop (in process)": textbook_round_seconds(base, rounds),
        "per-device (in process)": timed_run([*base, "runtime=inprocess", "runtime.batched=off"], tmp / "m-off"),
        "batched (in process)": timed_run([*base, "runtime=inprocess", "runtime.batched=on"], tmp / "m-on"),
        "batched (Ray simulation, default)": timed_run([*base, "runtime.batched=on", *ray_gpus(device, 4)], tmp / "m-sim"),
    }
    print(f"\nPerMFL MNIST MCLR preset, {rounds} global rounds, runtime.device={device} (ref: the textbook loop)")
    print(HEADER)
    for name, r in results.items():
        print(line(name, r, results["textbook loop (in process)"]))


def section_devices(tmp: Path, rounds: int, device: str) -> None:
    base = [*DEVICES_3500, f"global_rounds={rounds}", f"runtime.device={device}"]
    results = {
        "per-device (Ray simulation)": timed_run([*base, "runtime.batched=off"], tmp / "d-off"),
        "batched (Ray simulation)": timed_run([*base, "runtime.batched=on", *ray_gpus(device, 5)], tmp / "d-on"),
        "batched (in process)": timed_run([*base, "runtime=inprocess", "runtime.batched=on"], tmp / "d-inproc"),
    }
    print(f"\n3,500 devices (5 x 700 Synthetic, MCLR, K = 2, L = 5), {rounds} global rounds, evaluated every round "
          f"(ref: per-device)")
    print(HEADER)
    for name, r in results.items():
        print(line(name, r, results["per-device (Ray simulation)"]))


def section_cnn(tmp: Path, rounds: int, device: str) -> None:
    k, steps = 1, 2
    base = ["experiment=table1_mnist_cnn", "algorithm=permfl", f"dataset.root={MNIST_ROOT}", f"global_rounds={rounds}",
            f"algorithm.team_rounds={k}", f"algorithm.local_steps={steps}", "runtime=inprocess",
            f"runtime.device={device}", f"eval_every={rounds}"]
    devices = len(federation_for(config(base)).devices)
    full = 10 * 20  # K * L of the preset
    print(f"\nPerMFL MNIST CNN (table1_mnist_cnn), shortened global rounds K = {k}, L = {steps}, {devices} devices, "
          f"runtime.device={device}; a full round (K = 10, L = 20) extrapolated")
    print(f"  {'path':<12} {'s/round':>8} {'s/device step':>14} {'full round s':>13} {'peak GiB':>8}")
    for mode in ("off", "on"):  # "on": forced, auto would not batch a CNN on the CPU
        r = timed_run([*base, f"runtime.batched={mode}"], tmp / f"c-{mode}")
        per_step = r["seconds"] / (devices * k * steps)
        name = "batched" if mode == "on" else "per-device"  # per-device: always on the CPU
        print(f"  {name:<12} {r['seconds']:8.3f} {per_step:14.4f} "
              f"{per_step * devices * full:13.1f} {r['gib']:8.2f}")


SECTIONS = {"mclr": section_mclr, "devices": section_devices, "cnn": section_cnn}
# devices: Ray hands a team to whichever actor is free, and an actor generates a team's 700
# devices (and keeps their data, hfl.accel.batched.concatenated) the first time it hosts it, so the
# first rounds after round 1 still pay that (2.4-3.6 s against ~2 s from round 5 on, measured):
# the median is taken over enough rounds to be the steady state.
MIN_ROUNDS = {"cnn": 4, "devices": 12}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {', '.join(SECTIONS)}")
    parser.add_argument("--rounds", type=int, default=5, help="global rounds per run (medians over rounds 2..T)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    args = parser.parse_args()
    torch.set_num_threads(1)  # the runtimes' torch_threads: 1, so the textbook loop gets the same
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    with tempfile.TemporaryDirectory(prefix="hfl-speed-") as tmp:
        for name in names:
            SECTIONS[name](Path(tmp), max(args.rounds, MIN_ROUNDS.get(name, 1)), args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
