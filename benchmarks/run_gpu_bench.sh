#!/bin/sh
# benchmarks/gpu_bench.py in one command on a GPU machine whose python3 already holds CUDA torch and
# transformers and that has no network: installs this checkout (no dependencies, no build isolation)
# into a temporary folder and runs the benchmark; the JSON goes to stdout and to DIR/gpu_bench.json.
#
#   sh benchmarks/run_gpu_bench.sh [DIR]      (DIR defaults to $OUT, else the current folder)
set -eu
cd "$(dirname "$0")/.."
out=${1:-${OUT:-.}}
site=$(mktemp -d)
python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --target "$site" .
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
PYTHONPATH="$site" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 python3 benchmarks/gpu_bench.py --out "$out/gpu_bench.json"
