# gpucomm on CUDA 12 GPUs: a CUDA build of torch, gpucomm with CuPy + NCCL (the cuda12 extra), and the
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
# Base image: CUDA 12.6.3 (the last 12.6 update), cuDNN runtime flavour, Ubuntu 24.04, whose python3 is 3.12
# (pyproject: requires-python >= 3.10). Why 12.6: PyTorch has published cu126 wheels for every release from
# 2.6 to 2.12, the longest run of any CUDA 12 index (2.12 has no cu128), so the cu126 index is the CUDA 12
# index most likely to carry current torch, and its wheels' CUDA libraries match the image's 12.6. The
# runtime flavour is enough: nothing here runs nvcc (Numba's NVRTC/NVVM come as wheels with numba-cuda[cu12]).
# Host: an NVIDIA driver for CUDA 12.6 (R560+, or R525+ through CUDA's minor-version compatibility) and the
# NVIDIA Container Toolkit.
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04

ARG DEBIAN_FRONTEND=noninteractive
# Python from the distribution; OpenSSH (client for remote ranks, server for the ssh launcher tests) and
# Open MPI's mpirun (the mpirun recipe and its test), as .ci/run installs them.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv openssh-client openssh-server openmpi-bin \
    && rm -rf /var/lib/apt/lists/*

# The README's install steps, with /opt/venv in place of .venv.
# 1-2. A venv, then torch first: the CUDA 12.6 build instead of the README's CPU pin. Pin it to match CI with
#      --build-arg TORCH=torch==2.13.0 once that release has cu126 wheels.
ARG TORCH=torch
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir "${TORCH}" --index-url "${TORCH_INDEX_URL}"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1

WORKDIR /workspace
COPY . /workspace

# 3. gpucomm, editable, with its extras: cuda12 (CuPy, NCCL and Numba's NVRTC/NVVM for CUDA 12) where the
#    README's CPU machines take cuda13, plus the test and examples extras.
RUN /opt/venv/bin/pip install --no-cache-dir -e ".[cuda12,test,examples]"

# 4. The README's test command (what .ci/run runs): the suite, then the kernel simulator suite in its own process.
CMD ["/bin/sh", "-c", "/opt/venv/bin/python -m pytest -q && NUMBA_ENABLE_CUDASIM=1 /opt/venv/bin/python -m pytest -q tests/kernels/test_sim.py"]
