"""Scale on one machine (issue 11): seconds per global round and the peak resident memory of all
processes (driver, Ray's processes and the team actors) for

- ``3500``: 3,500 devices, 5 x 700 Synthetic, MCLR, PerMFL (K = 2, L = 5), the default Ray
  simulation, evaluated every round; devices made when asked for (the default; a process keeps
  the devices it made within ``dataset.cache_mb``, 512 by default), the same keeping none
  (``dataset.cache_mb=0``: every message makes its devices again), and the eager build
  (``dataset.lazy=false``: every process builds every device's data up front, the reference),
  all measured in this run;
- ``100k``: 100,000 devices, ``topology=tree topology.fanout=[100,1000]``, Synthetic, MCLR,
  FedAvg with ``algorithm.sample_fraction=[1,0.01]`` (every server asks 10 of its 1,000 devices
  per round), the default Ray simulation, evaluated once, at the last round (every device
  tested), reported apart; with the default cache and with none. The same run with eager devices
  needs ~10 GiB of device data, ~3x that while building it, in every process that builds the
  federation (the driver and each actor), more than this machine has: its reference is the eager
  build of 10,000 of the same devices in one process, measured here and scaled to 100,000 (device
  data are independent draws, so memory grows linearly), beside the lazy build of all 100,000.

- ``sizes`` (issue 38): 10,000 / 100,000 / 1,000,000 devices at the same sampled work, Synthetic,
  MCLR, the default Ray simulation; FedAvg on 100 servers of N/100 devices asking 10 of them a round
  (``sample_fraction=[1,1000/N]``), and B-HFL on a depth-3 tree of 10 x 10 servers, half of each
  level-1 node's servers asked and 20 devices of each asked server (``[1,0.5,2000/N]``, one round
  per call at each level: ``level_rounds=[1,1]``): 1,000 devices trained per round at every size. Each is run twice, evaluated at its last round only:
  on a sample (``eval_fraction=0.01``: 1 % of every lowest server's devices) and in full (every
  device; skipped at 1,000,000 unless ``--full-million``: it would regenerate and test every
  device's data, about 10x the 100,000-device figure). Printed: round 1 (the actors' start-up and
  their federation build included), seconds per unevaluated round, the evaluated round and its
  evaluation's share, peak memory of all processes.

Each run is a fresh process (its own Ray instance, its own overrides for dataset.lazy
and dataset.cache_mb); seconds per round are medians over rounds 2..T (round 1
holds the actors' start-up), for ``100k`` and ``sizes`` over the rounds before the evaluated one.
``sizes --eval-every K`` evaluates every K-th round and the last instead: s/round is then the
median of the unevaluated rounds after round 1, the evaluated round the median of the evaluated
ones after round 1 (one evaluated round swings by tenths of a second on shared cores).

    .venv/bin/python benchmarks/scale.py                      # 3500 and 100k, 5 global rounds
    .venv/bin/python benchmarks/scale.py --only 100k --rounds 4
    .venv/bin/python benchmarks/scale.py --only sizes --rounds 4 [--sizes 10000,100000,1000000] [--algorithms fedavg,bhfl]
    .venv/bin/python benchmarks/scale.py --only sizes --sizes 100000 --eval-fractions 0.01 --rounds 11 --eval-every 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_memory import PeakMemory  # noqa: E402 - benchmarks/ is no package

REPO = Path(__file__).resolve().parents[1]
DEVICES_3500 = ["topology.num_teams=5", "topology.devices_per_team=700", "algorithm.team_rounds=2",
                "algorithm.local_steps=5"]
DEVICES_100K = ["algorithm=fedavg", "topology=tree", "topology.fanout=[100,1000]", "algorithm.sample_fraction=[1,0.01]"]
EAGER_SLICE = ["topology=tree", "topology.fanout=[10,1000]"]  # 10,000 of the same devices (ids 0..9,999)


# ---------------------------------------------------------------- in a child process
def config(overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hfl.config import schema
    from hfl.config.compose import CONF_DIR

    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


def child_run(overrides: list[str], out: Path) -> dict:
    """One hfl run: every global round's seconds and the final accuracies."""
    from hfl.state.resume import read_checkpoint
    from hfl.runtime.simulate import run

    summary = run(config(overrides), out)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return {"round_seconds": read_checkpoint(out).recorder["round_seconds"],
            "gm": summary["final"].get("gm_accuracy"), "pm": summary["final"].get("pm_accuracy"),
            "gm_devices": last.get("gm_eval_devices"), "gm_ci_low": last.get("gm_accuracy_ci_low"),
            "gm_ci_high": last.get("gm_accuracy_ci_high")}


def child_build(overrides: list[str]) -> dict:
    """The memory building the federation adds to this process (its peak RSS over the RSS before)."""
    import psutil

    from hfl.data import build_federation

    cfg = config(overrides)
    before = psutil.Process().memory_info().rss
    fed = build_federation(cfg["dataset"], cfg["topology"], int(cfg["seed"]))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return {"devices": len(fed.devices), "gib": max(peak - before, 0) / 2**30, "lazy": type(fed.devices).__name__}


# ---------------------------------------------------------------- the parent
LAZY: list[str] = []  # the default: devices made when asked for, kept within dataset.cache_mb (512 MiB)
NO_CACHE = ["dataset.cache_mb=0"]
EAGER = ["dataset.lazy=false"]


def in_child(kind: str, overrides: list[str], settings: list[str], out: Path | None = None) -> dict:
    """Run ``kind`` (run|build) in a fresh process with the overrides plus ``settings``; its result
    and the peak memory of it and all its descendants (Ray's processes included)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, __file__, "--child", kind, "--out", str(out or ""), "--", *overrides, *settings]
    with PeakMemory() as peak:
        proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"{kind} {' '.join(overrides)} failed (exit {proc.returncode})")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "peak_gib": peak.gib}


def pct(value: float | None) -> str:
    return f"{100 * value:6.2f}" if value is not None else "     -"


def section_3500(tmp: Path, rounds: int) -> None:
    base = [*DEVICES_3500, f"global_rounds={rounds}"]
    setups = {"made when asked for (default)": LAZY, "made when asked for, none kept (cache 0)": NO_CACHE,
              "all built up front in every process (ref)": EAGER}
    results = {name: in_child("run", base, env, tmp / f"3500-{i}") for i, (name, env) in enumerate(setups.items())}
    print(f"\n3,500 devices (5 x 700 Synthetic, MCLR, PerMFL K = 2, L = 5), default Ray simulation, {rounds} global "
          "rounds, evaluated every round")
    print(f"  {'devices':<44} {'s/round':>8} {'vs ref':>7} {'peak GiB':>9} {'vs ref':>7} {'PM %':>6} {'GM %':>6}")
    ref = results["all built up front in every process (ref)"]
    ref_s = statistics.median(ref["round_seconds"][1:])
    for label, r in results.items():
        s = statistics.median(r["round_seconds"][1:])
        print(f"  {label:<44} {s:8.2f} {s / ref_s:6.2f}x {r['peak_gib']:9.2f} {r['peak_gib'] / ref['peak_gib']:6.2f}x "
              f"{pct(r['pm'])} {pct(r['gm'])}")


def section_100k(tmp: Path, rounds: int) -> None:
    rounds = max(rounds, 3)  # round 1 (start-up), >= 1 round to time, the evaluated last one
    overrides = [*DEVICES_100K, f"global_rounds={rounds}", f"eval_every={rounds}"]
    runs = {"made when asked for (default)": in_child("run", overrides, LAZY, tmp / "100k"),
            "made when asked for, none kept (cache 0)": in_child("run", overrides, NO_CACHE, tmp / "100k-0")}
    lazy_build = in_child("build", DEVICES_100K, LAZY)
    eager_slice = in_child("build", EAGER_SLICE, EAGER)
    scale = 100_000 / eager_slice["devices"]
    per_process = eager_slice["gib"] * scale
    print(f"\n100,000 devices (100 x 1,000 Synthetic, MCLR, FedAvg, sample_fraction=[1,0.01]: 10 devices per server "
          f"and round), default Ray simulation, {rounds} global rounds, evaluated at round {rounds} only (all "
          f"100,000 devices); s/round: median of rounds 2..{rounds - 1}")
    print(f"  {'devices':<44} {'s/round':>8} {f'round {rounds}':>8} {'its eval':>8} {'peak GiB':>9} {'GM %':>6}")
    for label, r in runs.items():
        fit = statistics.median(r["round_seconds"][1:-1])
        last = r["round_seconds"][-1]  # its fit, then every device tested
        print(f"  {label:<44} {fit:8.2f} {last:8.2f} {last - fit:8.2f} {r['peak_gib']:9.2f} {pct(r['gm'])}")
    default = runs["made when asked for (default)"]
    print("  reference: the federation's build alone, in one process (the memory it adds)")
    print(f"  {'lazy, 100,000 devices':<44} {'':>8} {'':>8} {'':>8} {lazy_build['gib']:9.2f}")
    measured = f"eager, {eager_slice['devices']:,} devices (measured)"
    print(f"  {measured:<44} {'':>8} {'':>8} {'':>8} {eager_slice['gib']:9.2f}")
    print(f"  {f'eager, 100,000 devices (x {scale:g}, estimate)':<44} {'':>8} {'':>8} {'':>8} {per_process:9.2f}"
          f"  = {per_process / default['peak_gib']:.1f}x the default's whole run, in each of the driver and the actors")


def size_overrides(algorithm: str, devices: int) -> list[str]:
    """1,000 devices trained per round whatever the federation's size (see the module's ``sizes``)."""
    if algorithm == "fedavg":
        per_server = devices // 100
        return ["algorithm=fedavg", "topology=tree", f"topology.fanout=[100,{per_server}]",
                f"algorithm.sample_fraction=[1,{10 / per_server:g}]"]
    per_server = devices // 100
    # One round per call at each level (B-HFL's default is 10 at the lowest): 50 servers x 20 devices.
    return ["algorithm=bhfl", "topology=tree", f"topology.fanout=[10,10,{per_server}]",
            f"algorithm.sample_fraction=[1,0.5,{20 / per_server:g}]", "algorithm.level_rounds=[1,1]"]


def evaluated_rounds(rounds: int, eval_every: int | None) -> list[int]:
    """The global rounds (1-based) a sizes run evaluates: the last, and with ``eval_every`` every
    multiple of it (hfl's eval_every schedule)."""
    every = eval_every or rounds
    return [r for r in range(1, rounds + 1) if r % every == 0 or r == rounds]


def round_medians(seconds: list[float], evaluated: list[int]) -> tuple[float, float]:
    """Median seconds of the unevaluated and of the evaluated rounds, round 1 (start-up) left out."""
    plain = [s for r, s in enumerate(seconds, 1) if r > 1 and r not in evaluated]
    tested = [s for r, s in enumerate(seconds, 1) if r > 1 and r in evaluated]
    return statistics.median(plain), statistics.median(tested)


def section_sizes(tmp: Path, rounds: int, sizes: list[int], algorithms: list[str], full_million: bool,
                  settings: list[str], fractions: list[str], eval_every: int | None = None) -> None:
    rounds = max(rounds, 3)
    evaluated = evaluated_rounds(rounds, eval_every)
    when = (f"evaluated at round {rounds} only; s/round: median of rounds 2..{rounds - 1}" if len(evaluated) == 1 else
            f"evaluated at rounds {','.join(map(str, evaluated))}; s/round and evaluated: medians of the "
            f"unevaluated and the evaluated rounds after round 1")
    print(f"\nSizes at the same sampled work (1,000 devices trained per round), Synthetic, MCLR, default Ray "
          f"simulation, {rounds} global rounds, {when}; eval: the evaluated round less s/round, x: the evaluated "
          f"round over s/round; {' '.join(settings) or 'default device cache'}")
    print(f"  {'devices':>9} {'algorithm':<9} {'eval_fraction':<13} {'round 1':>8} {'s/round':>8} {'evaluated':>9} "
          f"{'its eval':>8} {'x':>5} {'peak GiB':>9} {'GM %':>6} {'GM 95% interval':>16} {'tested':>8}")
    for algorithm in algorithms:
        for devices in sizes:
            for fraction in fractions:
                if fraction == "1" and devices >= 1_000_000 and not full_million:
                    print(f"  {devices:>9,} {algorithm:<9} {fraction:<13} skipped (--full-million: every device "
                          "regenerated and tested)")
                    continue
                overrides = [*size_overrides(algorithm, devices), f"global_rounds={rounds}",
                             f"eval_every={eval_every or rounds}", f"eval_fraction={fraction}"]
                r = in_child("run", overrides, settings, tmp / f"sizes-{algorithm}-{devices}-{fraction}")
                fit, last = round_medians(r["round_seconds"], evaluated)
                low, high = r.get("gm_ci_low"), r.get("gm_ci_high")
                interval = f"{pct(low)}-{pct(high).strip()}" if low is not None else "-"
                tested = f"{r['gm_devices']:,}" if r.get("gm_devices") else "all"
                print(f"  {devices:>9,} {algorithm:<9} {fraction:<13} {r['round_seconds'][0]:8.2f} {fit:8.2f} {last:9.2f} "
                      f"{last - fit:8.2f} {last / fit:4.2f}x "
                      f"{r['peak_gib']:9.2f} {pct(r['gm'])} {interval:>16} {tested:>8}", flush=True)


SECTIONS = {"3500": section_3500, "100k": section_100k, "sizes": section_sizes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="3500,100k", help=f"comma-separated sections: {', '.join(SECTIONS)}")
    parser.add_argument("--rounds", type=int, default=5, help="global rounds per run (medians over rounds 2..T)")
    parser.add_argument("--sizes", default="10000,100000,1000000", help="devices per federation for --only sizes")
    parser.add_argument("--algorithms", default="fedavg,bhfl", help="fedavg and/or bhfl, for --only sizes")
    parser.add_argument("--full-million", action="store_true", help="also evaluate every device at 1,000,000")
    parser.add_argument("--eval-fractions", default="0.01,1", help="eval_fraction of each run, for --only sizes")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="for --only sizes: evaluate every this many rounds and the last (default: the last only); "
                             "medians over the evaluated and the unevaluated rounds")
    parser.add_argument("--cache-mb", type=float, default=None,
                        help="dataset.cache_mb for --only sizes (default: the config's, 512)")
    parser.add_argument("--child", choices=["run", "build"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one measured process (the parent reads its last line)
        result = child_run(args.overrides, Path(args.out)) if args.child == "run" else child_build(args.overrides)
        print(json.dumps(result))
        return 0
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (round 1 holds start-up)")
    if args.eval_every is not None and (args.eval_every < 1 or not any(
            r not in evaluated_rounds(args.rounds, args.eval_every) for r in range(2, args.rounds + 1))):
        parser.error(f"--eval-every {args.eval_every} leaves no unevaluated round after round 1 in {args.rounds} rounds")
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown sizes {unknown}; known: {', '.join(SECTIONS)}")
    print(f"{os.cpu_count()} cores; peak memory = the largest sum of RSS over a run's processes (psutil, every 0.1 s)")
    with tempfile.TemporaryDirectory(prefix="hfl-scale-") as tmp:
        for name in names:
            if name == "sizes":
                section_sizes(Path(tmp), args.rounds, [int(n) for n in args.sizes.split(",") if n],
                              [a for a in args.algorithms.split(",") if a], args.full_million,
                              [] if args.cache_mb is None else [f"dataset.cache_mb={args.cache_mb:g}"],
                              [f for f in args.eval_fractions.split(",") if f], args.eval_every)
            else:
                SECTIONS[name](Path(tmp), args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
