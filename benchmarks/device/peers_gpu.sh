#!/usr/bin/env bash
# Issue 38's GPU comparison, for a lent GPU machine (the device tool): hfl in process and
# pfl-research in one process, both training the MNIST CNN peer workload on the GPU
# (benchmarks/peers/run.py --workload mnist_cnn --device cuda), 30 rounds; the table, every
# run's rounds and the GPU's memory over the runs go to $OUT. Here first:
# bash benchmarks/device/prepare.sh (wheels and MNIST); then the device tool's run with carry
# [".whl", ".gpudata"] (no Ray: both run in process) and the command
#     bash benchmarks/device/peers_gpu.sh [ROUNDS]
# (PEERS_LIMIT: seconds after which run.py is stopped, 1200 by default.) On an H200 30 rounds took
# 84 s of the call, set-up included; a machine's start costs 35-65 s more (docs/performance.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device/setup.sh
out=${OUT:-/tmp/peers-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 250 > "$out/gpu_memory.csv" 2> /dev/null &
sampler=$!
trap 'kill $sampler 2> /dev/null || true' EXIT  # else it holds the caller's pipe open
timeout "${PEERS_LIMIT:-1200}" python3 benchmarks/peers/run.py --here --workload mnist_cnn --device cuda --only hfl-inprocess,pfl-1 \
  --rounds "${1:-30}" --cache /tmp/hfl-peers --json "$out/peers_gpu.json" 2>&1 | tee "$out/peers_gpu.log"
kill "$sampler" 2> /dev/null || true
python3 benchmarks/device/gpu_memory.py "$out/gpu_memory.csv" | tee -a "$out/peers_gpu.log"
