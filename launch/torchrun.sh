#!/bin/bash
# gpucomm under torchrun. gpucomm.torch.init() reads RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE;
# rank 0 serves gpucomm's store on a free port and publishes it, with a fresh secret, through
# torchrun's own store, so nothing else needs configuring.
#
# One node:       launch/torchrun.sh 4 python-script.py [args]
# Several nodes:  NNODES=2 RDZV_HOST=node1 launch/torchrun.sh 4 train.py   (run on every node)
set -euo pipefail
NPROC="$1"; shift
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "${NNODES:-1}" = "1" ]; then
    exec torchrun --standalone --nproc-per-node "$NPROC" "$@"
fi
exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "${RDZV_HOST:?set RDZV_HOST to the first node}:${RDZV_PORT:-29400}" \
    --rdzv-id "${RDZV_ID:-gpucomm-$(date +%s)}" "$@"
