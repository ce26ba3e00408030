#!/bin/bash
# gpucomm inside the CUDA container built from this repository's Dockerfile:
#
#   docker build -t gpucomm .
#   launch/docker-run.sh 4 python examples/train_digits.py
#
# --gpus all exposes every GPU (gpucomm pins one per rank through NVML); --ipc=host gives NCCL the
# shared memory it needs; --network=host lets ranks on several machines reach each other.
set -euo pipefail
NP="$1"; shift
exec docker run --rm --gpus all --ipc=host --network=host --ulimit memlock=-1 \
    -v "$PWD":/workspace -w /workspace gpucomm \
    gpucomm-run -np "$NP" "$@"
