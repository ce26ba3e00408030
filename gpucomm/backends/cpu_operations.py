"""Which transport carries CPU collectives: Gloo (TCP, any launcher) or MPI (shared memory on one
host, the launcher's fabric across hosts; only under an MPI launcher).

``GPUCOMM_CPU_OPERATIONS`` (or Horovod's ``HOROVOD_CPU_OPERATIONS``) chooses: ``gloo``, ``mpi`` or
``auto`` (the default). ``auto`` takes MPI when an MPI launcher started the process (``mpiexec``,
``mpirun``, ``gpucomm-run --mpi``), mpi4py is installed and its MPI library can serve (the
launcher's own library, ``MPI_THREAD_MULTIPLE``); otherwise Gloo, with the reason.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

from ..settings import CPU_OPERATIONS, ELASTIC
from ..bootstrap.launch_env import MPICH_MARKERS, OPENMPI_MARKERS, mpi_launcher
from .mpi import MpiUnavailable, load_mpi, mpi4py_installed

CHOICE_VARS = CPU_OPERATIONS.names
CHOICES = ("auto", "gloo", "mpi")
_LAUNCHER_NAMES = {"openmpi": "Open MPI's mpirun", "mpich": "MPICH's mpiexec (Hydra)"}


class CpuOperations(NamedTuple):
    """The choice and why it was made (a sentence for the log)."""

    name: str  # "gloo" or "mpi"
    reason: str


def requested_cpu_operations(env: Mapping[str, str]) -> tuple[str, str | None]:
    """What the environment asks for, and the variable that asked (None: nobody, ``auto``).
    Auto: MPI under an MPI launcher with mpi4py installed, else Gloo."""
    given = CPU_OPERATIONS.given(env)
    if given is None:
        return "auto", None
    return CPU_OPERATIONS.read(env), given[0]


def explain_cpu_operations(env: Mapping[str, str]) -> CpuOperations:
    """Decide the CPU transport for the job ``env`` describes, with the reason.

    Raises ``MpiUnavailable`` when MPI was asked for explicitly and cannot serve, and
    ``ValueError`` for a value other than gloo, mpi or auto. When MPI can serve, MPI is
    initialized here (its thread level can only be known that way); under ``auto``, a library
    that belongs to another launcher is never initialized (MPICH would abort the process)."""
    requested, var = requested_cpu_operations(env)
    if requested == "gloo":
        return CpuOperations("gloo", f"{var}=gloo")
    launcher = mpi_launcher(env)
    elastic = ELASTIC.read(env, False)
    if requested == "mpi":
        if elastic:
            raise MpiUnavailable(f"{var}=mpi, but this is an elastic job: MPI's communicators cannot add or remove "
                                 f"ranks, so elastic jobs run on Gloo. Unset {var} (or set it to gloo).")
        if launcher is None:
            raise MpiUnavailable(f"{var}=mpi, but no MPI launcher started this process (none of "
                                 f"{', '.join(OPENMPI_MARKERS + MPICH_MARKERS)} is set), so MPI would see each rank alone. Launch with "
                                 f"`gpucomm-run --mpi`, mpiexec or mpirun, or unset {var}.")
        load_mpi(env)  # raises MpiUnavailable with the reason and the fix
        return CpuOperations("mpi", f"{var}=mpi, under {_LAUNCHER_NAMES[launcher]}")
    if launcher is None:
        return CpuOperations("gloo", "no MPI launcher started this process")
    if elastic:
        return CpuOperations("gloo", "an elastic job (MPI communicators cannot change size)")
    if not mpi4py_installed():
        return CpuOperations("gloo", f"started by {_LAUNCHER_NAMES[launcher]} but mpi4py is not installed "
                                     f"(pip install \"gpucomm[mpi]\" to move CPU tensors through MPI)")
    try:
        load_mpi(env)
    except MpiUnavailable as e:
        return CpuOperations("gloo", f"MPI cannot serve: {e}")
    return CpuOperations("mpi", f"started by {_LAUNCHER_NAMES[launcher]} with mpi4py installed")


def choose_cpu_operations(env: Mapping[str, str]) -> str:
    """``"mpi"`` or ``"gloo"``: the CPU transport for this job (``explain_cpu_operations`` says why)."""
    return explain_cpu_operations(env).name


__all__ = ["CHOICES", "CHOICE_VARS", "CpuOperations", "choose_cpu_operations", "explain_cpu_operations",
           "requested_cpu_operations"]
