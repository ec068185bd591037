#!/usr/bin/env bash
# Downloads into .gpu-wheels/ (ignored by git) the wheels the GPU machine lacks, for its Python (3.12), so that
# benchmarks/gpu_run.sh can install them there without a network: datasets (which the training scripts import) with
# dill and multiprocess, the transformers the peers and the tests use, and TRL (with accelerate) for the
# post-training rows. The machine's own huggingface_hub, tokenizers and safetensors serve them.
#
#   bash benchmarks/fetch_gpu_wheels.sh                      # for the GPU machine
#   GPU_PYTHON_VERSION=3.11 GPU_WHEELS=/tmp/wheels bash benchmarks/fetch_gpu_wheels.sh  # to try gpu_run.sh here
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${GPU_WHEELS:-.gpu-wheels}
python -m pip download --quiet --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
    --dest "$wheels" datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 transformers==5.24.0 trl==1.16.0 \
    accelerate==1.15.0
ls "$wheels"
