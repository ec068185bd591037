#!/usr/bin/env bash
# The GPU suite in one call on the GPU machine (benchmarks/README.md): installs the wheels fetch_gpu_wheels.sh
# downloaded (carried along in .gpu-wheels/) into a folder of their own, puts it and the repository first on
# PYTHONPATH, and runs benchmarks/gpu_suite.py with the arguments given, its table and JSON written to $OUT.
#
#   bash benchmarks/gpu_run.sh                     # the training rows, about 7 minutes on an H100 or H200
#   bash benchmarks/gpu_run.sh --rows generate     # generation, a second call
#   bash benchmarks/gpu_run.sh --rows t5           # T5 beside transformers, a call of its own
#   bash benchmarks/gpu_run.sh --smoke             # tiny shapes, on a CPU
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${GPU_WHEELS:-.gpu-wheels}
site=${GPU_SITE:-/tmp/gpu-run-site}
out=${OUT:-gpu-results}
if ! compgen -G "$wheels/*.whl" > /dev/null; then
    echo "error: no wheels in $wheels: run benchmarks/fetch_gpu_wheels.sh first and carry $wheels along" >&2
    exit 2
fi
mkdir -p "$site" "$out"
python -m pip install --quiet --no-index --no-deps --upgrade --target "$site" "$wheels"/*.whl
export PYTHONPATH="$site:$PWD" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python -c "import datasets, transformers; print('datasets', datasets.__version__, 'transformers', transformers.__version__)"
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.csv"
fi
python benchmarks/gpu_suite.py --json "$out/gpu_suite.json" "$@" | tee "$out/gpu_suite.md"
