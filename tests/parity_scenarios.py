"""Rank functions for tests/test_horovod_parity.py (module level, so the rank pool can import them)."""

from __future__ import annotations

import torch

import gpucomm.torch as hvd


def homogeneous_and_set_barriers() -> dict:
    """``is_homogeneous`` on one host, and barriers on a non-global process set (static and dynamic)."""
    first_two = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[first_two] if hvd_size_hint() > 2 else None)
    homogeneous = hvd.is_homogeneous()
    ps = first_two if hvd.size() > 2 else hvd.global_process_set
    if hvd.rank() in ps.ranks:
        hvd.barrier(process_set=ps)
    hvd.barrier()
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    hvd.shutdown()
    return {"homogeneous": homogeneous, "total": total}


def hvd_size_hint() -> int:
    import os

    return int(os.environ["GPUCOMM_SIZE"])
