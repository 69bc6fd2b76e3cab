#!/usr/bin/env bash
# Run here, in the repository root, before using a lent GPU machine (device tool). Its image has
# torch but neither Flower, Hydra nor Ray, and reaches no package index: this fetches their
# wheels for its Python (3.12, x86-64) into .whl/, a trimmed Ray into .whl-ray/ and MNIST's test
# split into .gpudata/, all three ignored by git. A call carries what it needs (the device tool
# carries at most 64 MiB, the working tree included): `carry: [".whl", ".gpudata"]` for runs
# without Ray (in process: the GPU peer comparison, benchmarks/device/peers_gpu.sh, and the Table 1
# sweep, table1_gpu.sh), 33 MB with the tree; add ".whl-ray" (34 MB: Ray's wheel less its Java
# jar and its rllib/serve/llm/tune/train/data folders) for Ray, which with the tree came to 68 MB
# on 2026-11-28, over the limit. There, start every command with
# `source benchmarks/device/setup.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
for ignored in /.whl/ /.whl-ray/ /.gpudata/; do
  grep -qx "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
mkdir -p .whl .whl-ray .gpudata/MNIST/raw
rm -f .whl/ray_trim.zip  # where an earlier version of this script put it
cp ../shared/data/MNIST/raw/*.gz .gpudata/MNIST/raw/
versions() { .venv/bin/pip show "$@" 2>/dev/null | awk '/^Name/{n=$2}/^Version/{print n"=="$2}'; }
# What `import hfl.runtime.simulate` and a Ray team actor load that the image lacks (found by listing
# sys.modules' distributions here against the image's package list, /work/.library/device/KINDS.md).
specs=$(versions flwr hydra-core omegaconf grpcio grpcio-health-checking protobuf iterators pycryptodome dill \
  cryptography cffi pycparser tomli tomli-w jsonschema jsonschema-specifications referencing rpds-py mako sqlalchemy \
  alembic fastapi pydantic pydantic-core starlette typing-inspection annotated-types wcwidth \
  datasets flwr-datasets)  # the last two: dataset.partition=iid / dirichlet (hfl/data/partition.py)
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# pfl-research and what it needs beyond the image, for the GPU peer comparison (benchmarks/device/peers_gpu.sh).
specs="$specs pfl==0.6.0 dp-accounting==0.5.1 dm-tree==0.1.10 prv-accountant==0.2.0 multiprocess==0.70.19"
for spec in $specs; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms -d .whl "$spec" 2>&1 | grep -v WARNING || true
done
.venv/bin/pip wheel -q --no-deps -w .whl "$(versions antlr4-python3-runtime)"  # an sdist only
ray=$(versions ray); tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $platforms -d "$tmp" "$ray" 2>&1 | grep -v WARNING || true
python3 -m zipfile -e "$tmp"/ray-*.whl "$tmp/trim"
(cd "$tmp/trim" && rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/serve ray/llm ray/tune ray/train ray/data)
python3 -c "import shutil, sys; shutil.make_archive(sys.argv[1], 'zip', sys.argv[2])" .whl-ray/ray_trim "$tmp/trim"
rm -rf "$tmp"
du -sh .whl .whl-ray .gpudata
