# Sourced on the lent GPU machine from the repository root (see prepare.sh): installs the carried
# wheels, and Ray where .whl-ray was carried, into /tmp/site, puts the repository on PYTHONPATH and
# MNIST at ../shared/data.
[ -f /tmp/site/.installed ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | { grep -v WARN || true; } | tail -3  # grep fails on no lines (set -e)
touch /tmp/site/.installed  # sourced again (table1_gpu.sh after peers_gpu.sh): installed once
if [ -f .whl-ray/ray_trim.zip ] && [ ! -d /tmp/site/ray ]; then
  python3 -m zipfile -e .whl-ray/ray_trim.zip /tmp/site && chmod -R +x /tmp/site/ray/core/src
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p ../shared && ln -sfn "$PWD/.gpudata" ../shared/data
python3 -c "
import importlib.util, torch, flwr, hydra
ray = importlib.util.find_spec('ray') and __import__('ray').__version__
print('torch', torch.__version__, 'flwr', flwr.__version__, 'ray', ray or 'not carried', 'cuda', torch.cuda.is_available())"
