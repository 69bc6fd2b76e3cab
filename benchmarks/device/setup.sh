# Sourced on the lent GPU machine from the repository root (see prepare.sh): installs the carried
# wheels and Ray into /tmp/site, puts the repository on PYTHONPATH and MNIST at ../shared/data.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -3
python3 -m zipfile -e .whl/ray_trim.zip /tmp/site && chmod -R +x /tmp/site/ray/core/src
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p ../shared && ln -sfn "$PWD/.gpudata" ../shared/data
python3 -c "import torch, flwr, hydra, ray; print('torch', torch.__version__, 'flwr', flwr.__version__, 'ray', ray.__version__, 'cuda', torch.cuda.is_available())"
