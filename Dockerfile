# gpucomm on CUDA 13 GPUs: a CUDA build of torch, gpucomm with CuPy + NCCL (the cuda13 extra), and the
# test suite as the default command.
#
#   docker build -t gpucomm .
#   docker run --rm --gpus all --ipc=host gpucomm                          # the test suite (GPU tests included)
#   docker run --rm --gpus all --ipc=host gpucomm \
#       gpucomm-run -np 2 --single-gpu-test python benchmarks/train.py --quick      # 2 ranks on 1 GPU (slow)
#   # training throughput and scaling: a 1-rank run (the baseline), then N ranks, one GPU each
#   docker run --rm --gpus all --ipc=host -v "$PWD/bench-out":/out gpucomm \
#       gpucomm-run -np 1 python benchmarks/train.py --json /out/train_1.json
#   docker run --rm --gpus all --ipc=host -v "$PWD/bench-out":/out gpucomm \
#       gpucomm-run -np 8 python benchmarks/train.py --baseline /out/train_1.json --json /out/train_8.json
#   launch/docker-run.sh 4 python examples/train_digits.py                 # mounts this checkout at /workspace
#
# --ipc=host gives NCCL the shared memory it needs (or pass --shm-size=1g); --network=host for several hosts.
#
# Base image: CUDA 13.0, cuDNN runtime flavour, Ubuntu 24.04, whose python3 is 3.12 (pyproject:
# requires-python >= 3.10). This is the stack gpucomm's users run today: Python 3.12, torch from the cu130
# index, CuPy 14 (cupy-cuda13x), NCCL for CUDA 13, numba-cuda 0.30 and, on Python 3.12, NumPy 2.5, which
# numba-cuda 0.30 cannot compile with on its own (gpucomm/kernels/compat.py restores what it needs). The
# runtime flavour is enough: nothing here runs nvcc (Numba's NVRTC/NVVM come as wheels with numba-cuda[cu13]).
# For CUDA 12 hosts build FROM a 12.x image with TORCH_INDEX_URL=.../cu126 and the cuda12 extra.
# Host: an NVIDIA driver for CUDA 13 (R580+) and the NVIDIA Container Toolkit.
FROM nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04

ARG DEBIAN_FRONTEND=noninteractive
# Python from the distribution; OpenSSH (client for remote ranks, server for the ssh launcher tests) and
# Open MPI's mpirun (the mpirun recipe and its test), as .ci/run installs them.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv openssh-client openssh-server openmpi-bin \
    && rm -rf /var/lib/apt/lists/*

# The README's install steps, with /opt/venv in place of .venv.
# 1-2. A venv, then torch first: the CUDA 13.0 build instead of the README's CPU pin. Pin it to match CI with
#      --build-arg TORCH=torch==2.13.0.
ARG TORCH=torch
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir "${TORCH}" --index-url "${TORCH_INDEX_URL}"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1

WORKDIR /workspace
COPY . /workspace

# 3. gpucomm, editable, with its extras: cuda13 (CuPy, NCCL and Numba's NVRTC/NVVM for CUDA 13), as on the
#    README's machines, plus the test and examples extras.
RUN /opt/venv/bin/pip install --no-cache-dir -e ".[cuda13,test,examples]"

# 4. The README's test command (what .ci/run runs): the suite, then the kernel simulator suite in its own process.
CMD ["/bin/sh", "-c", "/opt/venv/bin/python -m pytest -q -n 2 --dist loadfile && NUMBA_ENABLE_CUDASIM=1 /opt/venv/bin/python -m pytest -q tests/kernels/test_sim.py"]
