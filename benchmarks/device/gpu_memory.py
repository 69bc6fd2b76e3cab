"""The GPU's memory over a run, from a sampler started beside it on the lent GPU machine
(benchmarks/device/peers_gpu.sh, table1_gpu.sh):

    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 250 > gpu.csv &

Prints the whole run's peak, and each stretch in which memory was held (above the first sample
by more than 64 MiB): one per process that held a CUDA context in turn, as when run.py runs its
frameworks one after another. Plain Python: no package needed."""

from __future__ import annotations

import sys
from datetime import datetime


def main(path: str) -> None:
    samples = []
    for line in open(path):
        fields = [f.strip() for f in line.split(",")]
        try:
            stamp = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f")
            samples.append((stamp, float(fields[1]), float(fields[2])))
        except (ValueError, IndexError):
            continue  # a header, or a line cut off when the sampler was stopped
    if not samples:
        print(f"{path}: no samples")
        return
    base = samples[0][1]
    print(f"GPU memory: peak {max(s[1] for s in samples) / 1024:.2f} GiB used ({base:.0f} MiB at the start), "
          f"{len(samples)} samples")
    stretches, current = [], []
    for sample in samples:
        if sample[1] > base + 64:
            current.append(sample)
        elif current:
            stretches.append(current)
            current = []
    if current:
        stretches.append(current)
    for i, s in enumerate(stretches, 1):
        busy = sorted(x[2] for x in s)
        print(f"  stretch {i}: {s[0][0]:%H:%M:%S}-{s[-1][0]:%H:%M:%S} ({(s[-1][0] - s[0][0]).total_seconds():.0f} s), "
              f"peak {max(x[1] for x in s) / 1024:.2f} GiB, GPU busy median {busy[len(busy) // 2]:.0f} %")


if __name__ == "__main__":
    main(sys.argv[1])
