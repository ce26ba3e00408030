"""Functions that tests/test_programmatic_run.py runs through ``gpucomm.run`` (module level: the
ranks import this module by reference, while the drivers' closures travel by value)."""

from __future__ import annotations

import os

import torch

import gpucomm.torch as hvd


def rank_sum_and_env() -> dict:
    """Each rank's place, two collectives' results, and what the launcher put in its environment."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum, name="sum").item()
    gathered = hvd.allgather(torch.tensor([rank * 10]), name="gather").tolist()
    hvd.shutdown()
    return {"rank": rank, "size": size, "total": total, "gathered": gathered, "pid": os.getpid(),
            "start_timeout": os.environ.get("GPUCOMM_START_TIMEOUT")}


def fail_on_last_rank(marker: str) -> int:
    """The last rank raises after a first collective; the others wait in a second one."""
    hvd.init()
    hvd.allreduce(torch.ones(1), name="first")
    if hvd.rank() == hvd.size() - 1:
        raise ValueError(f"{marker} on rank {hvd.rank()}")
    hvd.allreduce(torch.ones(1), name="second")
    return hvd.rank()


def exit_without_raising(code: int) -> int:
    """Rank 0 ends its process without a Python exception (as a crash or os._exit would)."""
    hvd.init()
    if hvd.rank() == 0:
        os._exit(code)
    hvd.allreduce(torch.ones(1), name="never")
    return hvd.rank()


def collectives_on_mpi() -> dict:
    """``rank_sum_and_env`` under MPI's launcher, with the counters that say which backend carried
    the CPU collectives and which launcher the rank saw."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # large enough for the data plane (a few values ride in the control plane's messages instead)
    total = hvd.allreduce(torch.full((1 << 16,), float(rank + 1)), op=hvd.Sum, name="sum")[0].item()
    stats = hvd.stats()
    hvd.shutdown()
    return {"rank": rank, "size": size, "total": total, "mpi": stats["mpi_collectives"],
            "gloo": stats["gloo_collectives"], "mpi_rank_var": os.environ.get("PMI_RANK")
            or os.environ.get("OMPI_COMM_WORLD_RANK")}
