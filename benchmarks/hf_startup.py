"""Start-up of a million-device natural-id federation (issue 51): the seconds ``build_federation``
takes and the peak resident memory of the process, for

- ``flower-natural``: a Hugging Face dataset (save_to_disk) of 2 rows per device, 8 float32
  features, an int64 writer id, 10 classes, split by Flower Datasets' ``NaturalIdPartitioner``
  (one device per writer), ``topology=tree topology.fanout=[100, N/100]``;
- ``flower-grouped``: the same with a group column (1,000 groups of N/1,000 writers) as the
  level-1 nodes (``topology=sequential``, teams from the data);
- ``hfl-iid``: the same pool split by hfl's own ``dataset.partition=iid`` into N devices (it
  loads each of Flower's IidPartitioner shards through its API, ~0.7 ms a device: left out above
  100,000 devices unless named in ``--only``);
- ``synthetic``: today's generated data (``dataset=synthetic``, ``partition=natural``, lazy),
  N devices, nothing pooled.

Each case runs in a fresh process (peak memory its own; wall-clock and CPU seconds of the build; imports and the dataset's creation are
not timed; the peak before the build (imports, the config) is printed beside the peak after it). Devices are
made lazily in every case: nothing here trains. Flower's ``IidPartitioner`` keeps no index map
(~2 ms a device through its API: ~30 min for a million) and is left out.

    .venv/bin/python benchmarks/hf_startup.py                     # 1,000,000 devices (22 s)
    .venv/bin/python benchmarks/hf_startup.py --devices 100000    # and hfl-iid (85 s)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("flower-natural", "flower-grouped", "hfl-iid", "synthetic")
GROUPS = 1000


def make_dataset(path: Path, devices: int) -> None:
    """2 rows a writer, 8 features, labels 0..9, writers in GROUPS groups; save_to_disk."""
    import datasets
    import numpy as np

    gen = np.random.default_rng(0)
    rows = 2 * devices
    writer = np.repeat(np.arange(devices, dtype=np.int64), 2)
    columns = {f"f{i}": gen.standard_normal(rows, dtype=np.float32) for i in range(8)}
    table = {**columns, "label": gen.integers(0, 10, rows), "writer": writer, "group": writer % GROUPS}
    datasets.Dataset.from_dict(table).save_to_disk(str(path))


def overrides(case: str, path: Path, devices: int) -> list[str]:
    hf = ["dataset=huggingface", f"dataset.path={path}", "dataset.columns.image=null",
          f"dataset.columns.features=[{','.join(f'f{i}' for i in range(8))}]", "dataset.scale=1",
          "dataset.normalize=null", "dataset.num_classes=10"]
    tree = ["topology=tree", f"topology.fanout=[100,{devices // 100}]"]
    natural = ["dataset.partitioner.name=NaturalIdPartitioner", "dataset.columns.natural_id=writer"]
    if case == "flower-natural":
        return [*hf, *natural, *tree]
    if case == "flower-grouped":
        return [*hf, *natural, "dataset.columns.group=group", "topology=sequential", "topology.num_teams=null",
                "topology.devices_per_team=null"]
    if case == "hfl-iid":
        return [*hf, "dataset.partition=iid", *tree]
    return ["dataset=synthetic", *tree]


def measure(case: str, path: Path, devices: int) -> dict:
    """In this process: build the federation once; seconds and memory."""
    from hfl.config.compose import compose_config
    from hfl.data import build_federation

    cfg = compose_config(" ".join(overrides(case, path, devices)), 0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss: KiB on Linux)
    start, cpu = time.perf_counter(), time.process_time()
    fed = build_federation(cfg["dataset"], cfg["topology"], cfg["seed"])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu  # CPU time: less moved by other load
    fed.devices[len(fed.devices) - 1]  # the last device made, as a node would make it
    return {"case": case, "devices": len(fed.devices), "level1": len(fed.level1_devices), "seconds": round(seconds, 2),
            "cpu_seconds": round(cpu, 2),
            "peak_before_build_gib": round(before, 2),
            "peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=1_000_000)
    p.add_argument("--only", default=None, help=f"cases, comma-separated (default: {','.join(CASES)}; hfl-iid only "
                                                 "up to 100,000 devices)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # a child process's one case
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        print(json.dumps(measure(args.case, Path(args.path), args.devices)), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="hf-startup-") as tmp:
        path = Path(tmp) / "writers"
        start = time.perf_counter()
        make_dataset(path, args.devices)
        print(f"dataset: {2 * args.devices:,} rows, {args.devices:,} writers, {GROUPS} groups; made in "
              f"{time.perf_counter() - start:.1f} s (not counted)", flush=True)
        print(f"{'case':<16}{'devices':>10}{'level-1':>9}{'start-up s':>12}{'cpu s':>8}{'before build GiB':>19}{'peak GiB':>10}")
        cases = args.only.split(",") if args.only else [c for c in CASES if c != "hfl-iid" or args.devices <= 100_000]
        for case in cases:
            done = subprocess.run([sys.executable, __file__, "--case", case, "--path", str(path),
                                   "--devices", str(args.devices)], capture_output=True, text=True, check=False)
            if done.returncode:
                print(f"{case:<16} failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{case:<16}{r['devices']:>10,}{r['level1']:>9,}{r['seconds']:>12.2f}{r['cpu_seconds']:>8.2f}{r['peak_before_build_gib']:>19.2f}"
                  f"{r['peak_gib']:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
