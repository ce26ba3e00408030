#!/bin/bash
# gpucomm's own launcher, horovodrun-style. Ranks on other hosts are started over ssh (key-based,
# no password prompt) in the same working directory, so use a shared file system or identical
# paths; the remote hosts need the same Python environment (--remote-python if its path differs).
#
#   launch/gpucomm-run.sh 8 node1:4,node2:4 python train.py
#   launch/gpucomm-run.sh 4 localhost:4 python examples/hello_allreduce.py
set -euo pipefail
NP="$1"; HOSTS="$2"; shift 2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# --network-interface eth0   pick the NIC for NCCL and Gloo
# --output-filename logs/    per-rank stdout/stderr files
# --single-gpu-test          TEST ONLY: several ranks share one GPU (one NCCL_HOSTID per rank)
exec gpucomm-run -np "$NP" -H "$HOSTS" "$@"
