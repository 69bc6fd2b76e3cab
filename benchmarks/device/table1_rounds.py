"""Each run of a Table 1 sweep (benchmarks/reproduce_table1.py's output folder), finished or
stopped: the rounds its log records, its seconds per round (the median of round-to-round times
after round 1), T = 400 extrapolated, and its last round's line (PM / team / GM accuracies).
Used by benchmarks/device/table1_gpu.sh:

    python3 benchmarks/device/table1_rounds.py RUNS_FOLDER SETTING
"""
from __future__ import annotations

import datetime
import re
import statistics
import sys
from pathlib import Path

runs, setting = Path(sys.argv[1]), sys.argv[2]
line = re.compile(r"^\[(\S+ \S+)\]\[hfl\]\[INFO\] - round\s+(\d+)/(\d+)\b(.*)$")
print(f"{'algorithm':<10} {'rounds':>7} {'s/round':>8} {'T=400 est. min':>15}  last round's line")
for log in sorted(runs.glob(f"{setting}/*/seed0/simulate.log")):
    ends, last = {}, ""
    for text in log.read_text(errors="replace").splitlines():
        m = line.match(text)
        if m:
            ends[int(m.group(2))] = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            last = m.group(4).strip()
    steps = [ends[r] - ends[r - 1] for r in sorted(ends) if r - 1 in ends and r > 1]
    per = statistics.median(steps) if steps else float("nan")
    print(f"{log.parts[-3]:<10} {len(ends):>7} {per:8.2f} {400 * per / 60:15.1f}  {last}")
print("s/round: the median of round-to-round times after round 1, from each run's log; the runs shared the GPU")
