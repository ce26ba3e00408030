"""The environment a launcher and its ranks agree on, written and read from this one place: where the
ranks meet (:func:`rendezvous_env`, read back by ``gpucomm.bootstrap.world``), an elastic worker's
variables (:func:`elastic_worker_env`, read back by ``gpucomm.job.elastic``), and which MPI launcher
started this process (:func:`mpi_launcher`; for MPICH's, which job: :func:`hydra_job_id`). A rank's place travels in ``placement_env``
(``gpucomm.bootstrap.placement``)."""

from __future__ import annotations

import os

from typing import Mapping

# where the ranks meet: the store's address and port, the job secret and the run id
GPUCOMM_RENDEZVOUS_ADDR = "GPUCOMM_RENDEZVOUS_ADDR"
GPUCOMM_RENDEZVOUS_PORT = "GPUCOMM_RENDEZVOUS_PORT"
GPUCOMM_RENDEZVOUS_HOSTED = "GPUCOMM_RENDEZVOUS_HOSTED"  # "1": the launcher hosts the store, rank 0 does not
GPUCOMM_SECRET = "GPUCOMM_SECRET"
GPUCOMM_RUN_ID = "GPUCOMM_RUN_ID"

# an elastic worker's own variables (its place comes from the rounds, not from its environment)
GPUCOMM_ELASTIC = "GPUCOMM_ELASTIC"
HOROVOD_ELASTIC = "HOROVOD_ELASTIC"
GPUCOMM_ELASTIC_WORKER = "GPUCOMM_ELASTIC_WORKER"
GPUCOMM_ELASTIC_TIMEOUT = "GPUCOMM_ELASTIC_TIMEOUT"
HOROVOD_ELASTIC_TIMEOUT = "HOROVOD_ELASTIC_TIMEOUT"
GPUCOMM_HOSTNAME = "GPUCOMM_HOSTNAME"
HOROVOD_HOSTNAME = "HOROVOD_HOSTNAME"

# the MPI launchers' own variables (Intel MPI and MVAPICH use MPICH's launcher protocol, PMI)
OMPI_RANK = "OMPI_COMM_WORLD_RANK"
OMPI_SIZE = "OMPI_COMM_WORLD_SIZE"
PMIX_RANK = "PMIX_RANK"
PMI_RANK = "PMI_RANK"
PMI_SIZE = "PMI_SIZE"
OPENMPI_MARKERS = (OMPI_SIZE, OMPI_RANK, PMIX_RANK)
MPICH_MARKERS = (PMI_SIZE, PMI_RANK)
# a rank's number under an MPI launcher, first found wins (gpucomm/runner/mpi_rank.py keeps a copy: it
# runs without gpucomm; tests/test_launch_env.py checks the two are equal)
MPI_RANK_VARS = (OMPI_RANK, PMI_RANK, PMIX_RANK)


def rendezvous_env(addr: str, port: int, secret: bytes, run_id: str) -> dict[str, str]:
    """The variables that tell a rank where to meet: the store the launcher hosts at ``addr:port``,
    the job secret and the run id (and unbuffered output, so that lines reach the launcher)."""
    return {GPUCOMM_RENDEZVOUS_ADDR: addr, GPUCOMM_RENDEZVOUS_PORT: str(port), GPUCOMM_RENDEZVOUS_HOSTED: "1",
            GPUCOMM_SECRET: secret.hex(), GPUCOMM_RUN_ID: run_id, "PYTHONUNBUFFERED": "1"}


def elastic_worker_env(worker: str, host: str, elastic_timeout: float) -> dict[str, str]:
    """The variables that make a process elastic worker ``worker`` on ``host``, under gpucomm's and
    Horovod's names (``rendezvous_env`` says where it meets)."""
    timeout = f"{elastic_timeout:g}"
    return {GPUCOMM_ELASTIC: "1", HOROVOD_ELASTIC: "1", GPUCOMM_ELASTIC_WORKER: worker,
            GPUCOMM_ELASTIC_TIMEOUT: timeout, HOROVOD_ELASTIC_TIMEOUT: timeout,
            GPUCOMM_HOSTNAME: host, HOROVOD_HOSTNAME: host}


HYDRA_PROXIES = ("hydra_pmi_proxy", "pmi_proxy")  # MPICH's and Intel MPI's per-host proxy of mpiexec


def hydra_job_id() -> str:
    """The job id MPICH's Hydra never exports: mpiexec's ``--control-port host:port``, which each of its
    per-host proxies is started with, on every host of the job, read from this process's nearest proxy
    ancestor (however many wrappers lie between). "" when there is none (another launcher, a rank in a PID
    namespace of its own, a wrapper that exited and left it to init) or it cannot be read: every rank of one
    job must find the same, so one that does not reaches no store (``rank0_output_hint`` says so)."""
    import psutil  # noqa: PLC0415 - only for an MPICH launch

    try:
        for proc in psutil.Process().parents():
            argv = proc.cmdline()
            if argv and os.path.basename(argv[0]) in HYDRA_PROXIES:
                i = argv.index("--control-port") if "--control-port" in argv else -1
                return f"hydra-{argv[i + 1]}" if 0 <= i < len(argv) - 1 else ""
    except (psutil.Error, OSError):
        return ""
    return ""


def mpi_launcher(env: Mapping[str, str]) -> str | None:
    """``"openmpi"`` or ``"mpich"`` when an MPI launcher started this process (its variables are
    set), else None. Intel MPI and MVAPICH use MPICH's launcher protocol (PMI) and count as MPICH."""
    if any(v in env for v in OPENMPI_MARKERS):
        return "openmpi"
    if any(v in env for v in MPICH_MARKERS):
        return "mpich"
    return None


__all__ = ["GPUCOMM_ELASTIC", "GPUCOMM_ELASTIC_TIMEOUT", "GPUCOMM_ELASTIC_WORKER", "GPUCOMM_HOSTNAME",
           "GPUCOMM_RENDEZVOUS_ADDR", "GPUCOMM_RENDEZVOUS_HOSTED", "GPUCOMM_RENDEZVOUS_PORT", "GPUCOMM_RUN_ID",
           "GPUCOMM_SECRET", "HOROVOD_ELASTIC", "HOROVOD_ELASTIC_TIMEOUT", "HOROVOD_HOSTNAME", "MPICH_MARKERS",
           "MPI_RANK_VARS", "OMPI_RANK", "OMPI_SIZE", "OPENMPI_MARKERS", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
           "elastic_worker_env", "hydra_job_id", "mpi_launcher", "rendezvous_env"]
