#!/usr/bin/env bash
# PerMFL's Table 1, MNIST CNN column, on a lent GPU machine (the device tool): every algorithm of
# the table that hfl implements (benchmarks/reproduce_table1.py --settings mnist_cnn), seed 0, all
# at once (one process each, in process, runtime.device=auto: the GPU), for at most SECONDS of
# wall time: the preset's T = 400 does not fit a session's device time, so the result is the
# rounds each run finished by then, its seconds per round and its last evaluation (every round),
# read from the runs' logs, and T = 400 extrapolated. The table, the sweep's log, the runs' logs
# and metrics (runs.tgz) and the GPU's memory over the runs go to $OUT. Here first:
# bash benchmarks/device/prepare.sh; then the device tool's run with carry [".whl", ".gpudata"] and
#     bash benchmarks/device/table1_gpu.sh SECONDS [ROUNDS]
# (ROUNDS: each run's T, 400 by default; a run that reaches it ends with its summary.json.) On an
# H200, 115 s gave 3 to 37 rounds a run (docs/performance.md, "On a GPU").
# TABLE1_SETTINGS, TABLE1_ALGORITHMS, TABLE1_JOBS override the setting, the algorithms and the
# runs at once (a check on a CPU: TABLE1_SETTINGS=synthetic_mclr TABLE1_ALGORITHMS=fedavg).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -c "import flwr, hydra" 2> /dev/null || source benchmarks/device/setup.sh  # on the GPU machine
limit=${1:?SECONDS: the wall-time limit of the sweep}; rounds=${2:-400}
out=${OUT:-/tmp/table1-gpu}; runs=/tmp/table1-gpu-runs
settings=${TABLE1_SETTINGS:-mnist_cnn}; jobs=${TABLE1_JOBS:-8}
mkdir -p "$out"; rm -rf "$runs"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 500 > "$out/gpu_memory.csv" 2> /dev/null &
  sampler=$!
  trap 'kill $sampler 2> /dev/null || true' EXIT
fi
# Its own process group, so that the limit stops the sweep with the runs it forked.
setsid python3 benchmarks/reproduce_table1.py --settings "$settings" --seeds 0 --rounds "$rounds" \
  --jobs "$jobs" --out "$runs" --no-report ${TABLE1_ALGORITHMS:+--algorithms "$TABLE1_ALGORITHMS"} > "$out/table1.log" 2>&1 &
sweep=$!
(sleep "$limit"; kill -TERM -- "-$sweep" 2> /dev/null; sleep 3; kill -KILL -- "-$sweep" 2> /dev/null) &
watchdog=$!
wait "$sweep" || echo "the sweep ended with exit status $? (stopped at the limit of $limit s, or a run failed)"
kill "$watchdog" 2> /dev/null || true; kill -KILL -- "-$sweep" 2> /dev/null || true
[ -z "${sampler:-}" ] || kill "$sampler" 2> /dev/null || true
tail -n 25 "$out/table1.log"
python3 benchmarks/device/table1_rounds.py "$runs" "$settings" | tee "$out/table1_gpu.txt"
[ ! -f "$out/gpu_memory.csv" ] || python3 benchmarks/device/gpu_memory.py "$out/gpu_memory.csv" | tee -a "$out/table1_gpu.txt"
tar -czf "$out/runs.tgz" -C "$runs" --exclude='state' --exclude='checkpoints' . 2> /dev/null || true
