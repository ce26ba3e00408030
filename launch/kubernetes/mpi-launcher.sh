#!/bin/bash
# gpucomm from the launcher pod of a Kubernetes MPI job: a Kubeflow MPIJob (mpi-operator v2, mpijob.yaml) or a
# Kubeflow Trainer TrainJob on its MPI runtime (deepspeed-distributed, trainjob-mpi.yaml). Both operators mount
# an Open MPI hostfile, one "<pod DNS name> slots=<n>" line per pod that runs ranks, and point
# OMPI_MCA_orte_default_hostfile at it (/etc/mpi/hostfile). This starts one rank per slot with Open MPI's
# mpirun, set up as launch/mpirun.sh sets up a launch by hand:
#   - GPUCOMM_RENDEZVOUS_ADDR is the hostfile's first host: mpirun maps ranks by slot, so rank 0 runs there
#     and serves gpucomm's store on that name's address (its port is derived from mpirun's job id);
#   - a fresh GPUCOMM_SECRET, passed to the ranks by name (-x), never on a command line, and
#     GPUCOMM_REQUIRE_SECRET=1, so a rank that did not get it fails instead of using a derivable key.
#
#   bash launch/kubernetes/mpi-launcher.sh python examples/train_digits.py
#   MPIRUN=/path/to/mpirun bash launch/kubernetes/mpi-launcher.sh ...     # choose the launcher
set -euo pipefail
NAME="mpi-launcher.sh"
HOSTFILE="${OMPI_MCA_orte_default_hostfile:-/etc/mpi/hostfile}"
MPIRUN="${MPIRUN:-mpirun}"
if [ "$#" -eq 0 ]; then
    echo "$NAME: no command given; usage: $NAME python train.py [args]" >&2
    exit 2
fi
if [ ! -r "$HOSTFILE" ]; then
    echo "$NAME: cannot read the MPI hostfile $HOSTFILE: run this on the launcher pod of an MPIJob or of a" \
         "TrainJob on an MPI runtime (their operator mounts it there), or point OMPI_MCA_orte_default_hostfile" \
         "at a hostfile" >&2
    exit 2
fi

# The hosts and the number of ranks: the sum of the slots (a line without slots= gets the operator's
# OMPI_MCA_orte_set_default_slots, as mpirun would give it).
HOSTS=()
NP=0
while read -r host fields || [ -n "$host" ]; do
    case "$host" in ""|\#*) continue ;; esac
    slots="${OMPI_MCA_orte_set_default_slots:-1}"
    for field in $fields; do
        case "$field" in slots=*) slots="${field#slots=}" ;; esac
    done
    if ! [[ "$slots" =~ ^[1-9][0-9]*$ ]]; then
        echo "$NAME: $HOSTFILE: host $host has slots=$slots, which is not a positive whole number" >&2
        exit 2
    fi
    HOSTS+=("$host")
    NP=$((NP + slots))
done < "$HOSTFILE"
if [ "${#HOSTS[@]}" -eq 0 ]; then
    echo "$NAME: $HOSTFILE lists no hosts: the operator writes one line per pod; is the job's spec empty?" >&2
    exit 2
fi

# A pod's DNS record appears a little after the pod starts: wait (at most ~60 s) until every host resolves,
# as the mpi-operator's own images do, instead of failing in ssh.
for host in "${HOSTS[@]}"; do
    tries=0
    until getent hosts "$host" > /dev/null; do
        tries=$((tries + 1))
        if [ "$tries" -ge 60 ]; then
            echo "$NAME: $host (from $HOSTFILE) still does not resolve after 60 s: is its pod running, and does" \
                 "the job's headless service exist?" >&2
            exit 2
        fi
        sleep 1
    done
done

export GPUCOMM_RENDEZVOUS_ADDR="${HOSTS[0]}"
GPUCOMM_SECRET="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
export GPUCOMM_SECRET GPUCOMM_REQUIRE_SECRET=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# mpi4py, where installed, must load Open MPI's library rather than another MPI it may carry.
if [ -z "${MPI4PY_MPIABI+x}" ] && [ -z "${MPI4PY_LIBMPI+x}" ]; then
    export MPI4PY_MPIABI=openmpi
fi
# The pods are new on every run, so their ssh host keys cannot be known beforehand, and the .ssh directory is
# a read-only Secret: skip the host key check (the mpi-operator's base images do the same in ssh_config).
export OMPI_MCA_plm_rsh_args="${OMPI_MCA_plm_rsh_args:-} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"

# Forward the job's variables and, when set, the paths and settings (-x VAR copies it from here).
EXPORTS=(-x GPUCOMM_RENDEZVOUS_ADDR -x GPUCOMM_SECRET -x GPUCOMM_REQUIRE_SECRET -x OMP_NUM_THREADS -x PATH)
for var in PYTHONPATH LD_LIBRARY_PATH NCCL_SOCKET_IFNAME NCCL_DEBUG GPUCOMM_GLOO_IFACE GPUCOMM_TIMEOUT \
           GPUCOMM_CPU_AFFINITY GPUCOMM_CPU_OPERATIONS GPUCOMM_RENDEZVOUS_PORT MPI4PY_MPIABI MPI4PY_LIBMPI; do
    if [ -n "${!var+x}" ]; then EXPORTS+=(-x "$var"); fi
done

echo "$NAME: $NP ranks on ${#HOSTS[@]} hosts from $HOSTFILE; rank 0 and gpucomm's store on ${HOSTS[0]}" >&2
# -bind-to none: gpucomm pins GPUs itself. --allow-run-as-root: images that run as root (ours does).
exec "$MPIRUN" --allow-run-as-root --hostfile "$HOSTFILE" -np "$NP" -bind-to none -map-by slot "${EXPORTS[@]}" "$@"
