#!/bin/bash
# gpucomm under an MPI launcher: Open MPI's mpirun, or MPICH's mpiexec from PyPI
# (`pip install "gpucomm[mpi]"` brings mpi4py and MPICH: no system MPI needed).
# gpucomm.torch.init() reads the launcher's variables (OMPI_COMM_WORLD_* or PMI_*). Across hosts it
# needs the address of the host running rank 0, exported to every rank.
#
#   launch/mpirun.sh 8 node1:4,node2:4 python examples/train_digits.py
#   launch/mpirun.sh 2 localhost:2 python examples/hello_allreduce.py
#   MPIRUN=/usr/bin/mpirun launch/mpirun.sh 2 localhost:2 python ...   # choose the launcher
#
# `gpucomm-run --mpi -np 2 python ...` does the same with the store served by the launcher itself.
set -euo pipefail
NP="$1"; HOSTS="$2"; shift 2

# The launcher: $MPIRUN, else the first mpirun/mpiexec on PATH (a venv's bin/ first when it is on PATH,
# which is where the `mpich` wheel puts MPICH's mpiexec).
MPIRUN="${MPIRUN:-$(command -v mpirun || command -v mpiexec || true)}"
if [ -z "$MPIRUN" ]; then
    echo "mpirun.sh: no mpirun or mpiexec on PATH; install MPICH from PyPI (pip install \"gpucomm[mpi]\") or" \
         "Open MPI (apt-get install openmpi-bin), or set MPIRUN=/path/to/mpirun" >&2
    exit 127
fi
VERSION="$("$MPIRUN" --version 2>&1 || true)"
case "$VERSION" in
    *"Open MPI"*|*OpenRTE*|*"PRRTE"*) FLAVOR=openmpi ;;
    *HYDRA*|*"Intel(R) MPI"*) FLAVOR=mpich ;;
    *) echo "mpirun.sh: $MPIRUN is neither Open MPI's mpirun nor MPICH's (Hydra) mpiexec; its --version" \
            "said: $(head -n 1 <<<"$VERSION"). Set MPIRUN to one of those." >&2
       exit 2 ;;
esac

# Rank 0 runs on the first host. Written as localhost, it is 127.0.0.1 when it is the only host; with others
# it is this host's address on the route towards the next one (there, 127.0.0.1 is their own host). An
# exported GPUCOMM_RENDEZVOUS_ADDR names rank 0's host instead (e.g. its address on a second network).
FIRST_HOST="${HOSTS%%,*}"; FIRST_HOST="${FIRST_HOST%%:*}"
if [ "$FIRST_HOST" = "localhost" ]; then
    if [ "$HOSTS" = "${HOSTS%%,*}" ]; then
        FIRST_HOST=127.0.0.1
    else
        NEXT_HOST="${HOSTS#*,}"; NEXT_HOST="${NEXT_HOST%%,*}"; NEXT_HOST="${NEXT_HOST%%:*}"
        FIRST_HOST="$(python3 -c 'import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[1], 9))  # no packet is sent: the route picks the address
print(s.getsockname()[0])' "$NEXT_HOST" 2>/dev/null)" || {
            echo "mpirun.sh: cannot tell this host's address towards $NEXT_HOST (does it resolve?); write this" \
                 "host by its name or address instead of localhost, or set GPUCOMM_RENDEZVOUS_ADDR" >&2
            exit 2
        }
    fi
fi
export GPUCOMM_RENDEZVOUS_ADDR="${GPUCOMM_RENDEZVOUS_ADDR:-$FIRST_HOST}"
# A fresh secret per job, passed by name (it never appears on a command line). Without it the
# store's key would be derived from the job id, address and port, which anyone who can reach the
# store can compute; GPUCOMM_REQUIRE_SECRET=1 makes a rank that did not receive it fail instead of
# falling back to that.
GPUCOMM_SECRET="$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
export GPUCOMM_SECRET GPUCOMM_REQUIRE_SECRET=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

if [ "$FLAVOR" = mpich ]; then
    # Hydra forwards this whole environment to every rank (its default, -genvall).
    exec "$MPIRUN" -n "$NP" -hosts "$HOSTS" "$@"
fi

# Open MPI. mpi4py must load Open MPI's library, not the MPICH one a `gpucomm[mpi]` install also
# brings (MPICH aborts in MPI_Init under Open MPI's launcher): pick the ABI unless the user chose.
if [ -z "${MPI4PY_MPIABI+x}" ] && [ -z "${MPI4PY_LIBMPI+x}" ]; then
    export MPI4PY_MPIABI=openmpi
fi
# Forward the job's variables and, when set, the paths and settings (-x VAR copies it from here).
EXPORTS=(-x GPUCOMM_RENDEZVOUS_ADDR -x GPUCOMM_SECRET -x GPUCOMM_REQUIRE_SECRET -x OMP_NUM_THREADS -x PATH)
for var in PYTHONPATH LD_LIBRARY_PATH NCCL_SOCKET_IFNAME NCCL_DEBUG GPUCOMM_GLOO_IFACE GPUCOMM_TIMEOUT \
           GPUCOMM_CPU_AFFINITY GPUCOMM_SINGLE_GPU_TEST GPUCOMM_CPU_OPERATIONS HOROVOD_CPU_OPERATIONS \
           MPI4PY_MPIABI MPI4PY_LIBMPI; do
    if [ -n "${!var+x}" ]; then EXPORTS+=(-x "$var"); fi
done

# -bind-to none: gpucomm pins GPUs itself (and CPU affinity with GPUCOMM_CPU_AFFINITY=1).
# --allow-run-as-root only matters in containers that run as root.
exec "$MPIRUN" -np "$NP" -H "$HOSTS" -bind-to none -map-by slot --allow-run-as-root "${EXPORTS[@]}" "$@"
