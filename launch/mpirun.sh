#!/bin/bash
# gpucomm under Open MPI's mpirun (MPI is only the launcher: gpucomm moves data with NCCL/Gloo).
# gpucomm.torch.init() reads OMPI_COMM_WORLD_* variables. Across hosts it needs the address of the
# host running rank 0, exported to every rank with -x.
#
#   launch/mpirun.sh 8 node1:4,node2:4 python examples/train_digits.py
#   launch/mpirun.sh 2 localhost:2 python examples/hello_allreduce.py
set -euo pipefail
NP="$1"; HOSTS="$2"; shift 2

FIRST_HOST="${HOSTS%%,*}"; FIRST_HOST="${FIRST_HOST%%:*}"
[ "$FIRST_HOST" = "localhost" ] && FIRST_HOST=127.0.0.1
export GPUCOMM_RENDEZVOUS_ADDR="$FIRST_HOST"
# A fresh secret per job, passed by name (-x VAR copies it from this environment; it never
# appears on a command line). Without it the store's key would be derived from the job id, address
# and port, which anyone who can reach the store can compute; GPUCOMM_REQUIRE_SECRET=1 makes a rank
# that did not receive it fail instead of falling back to that.
GPUCOMM_SECRET="$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
export GPUCOMM_SECRET GPUCOMM_REQUIRE_SECRET=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# Forward the job's variables and, when set, the paths and NCCL settings.
EXPORTS=(-x GPUCOMM_RENDEZVOUS_ADDR -x GPUCOMM_SECRET -x GPUCOMM_REQUIRE_SECRET -x OMP_NUM_THREADS -x PATH)
for var in PYTHONPATH LD_LIBRARY_PATH NCCL_SOCKET_IFNAME NCCL_DEBUG GPUCOMM_GLOO_IFACE GPUCOMM_TIMEOUT \
           GPUCOMM_CPU_AFFINITY GPUCOMM_SINGLE_GPU_TEST; do
    if [ -n "${!var+x}" ]; then EXPORTS+=(-x "$var"); fi
done

# -bind-to none: gpucomm pins GPUs itself (and CPU affinity with GPUCOMM_CPU_AFFINITY=1).
# --allow-run-as-root only matters in containers that run as root.
exec mpirun -np "$NP" -H "$HOSTS" -bind-to none -map-by slot --allow-run-as-root "${EXPORTS[@]}" "$@"
