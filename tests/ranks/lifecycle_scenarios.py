"""Rank-side scenarios for lifecycle and failure tests (module-level so spawn can import them)."""

from __future__ import annotations

import os
import time

import torch

import gpucomm.torch as hvd
from gpucomm.errors import CollectiveError


def topology() -> tuple:
    hvd.init()
    out = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
           hvd.is_initialized())
    hvd.shutdown()
    return out + (hvd.is_initialized(),)


def reinit_three_times() -> list[float]:
    results = []
    for i in range(3):
        hvd.init()
        results.append(hvd.allreduce(torch.tensor([float(i + hvd.rank())]), op=hvd.Sum).item())
        hvd.shutdown()
    return results


def raise_on_rank_one() -> None:
    hvd.init()
    if hvd.rank() == 1:
        raise RuntimeError("boom from rank one")
    hvd.shutdown()


def wait_forever() -> None:
    time.sleep(3600)


def mismatched_allgather_shapes() -> str:
    hvd.init()
    t = torch.ones(2, 3 + hvd.rank())
    try:
        hvd.allgather(t, name="bad")
    except CollectiveError as e:
        message = str(e)
    else:
        raise AssertionError("mismatched allgather must raise on every rank")
    # the job is still usable afterwards
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()
    hvd.shutdown()
    return message


def bad_arguments() -> list[str]:
    hvd.init()
    errors = []
    cases = [
        lambda: hvd.allreduce(torch.ones(4, 4).t()),
        lambda: hvd.allreduce(torch.ones(3, dtype=torch.int16)),
        lambda: hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum),
        lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum, average=True),
        lambda: hvd.broadcast(torch.ones(3), root_rank=hvd.size()),
        lambda: hvd.alltoall(torch.ones(5)),
        lambda: hvd.alltoall(torch.ones(4), splits=[1, 1, 1, 1, 0][: hvd.size() + 1]),
        lambda: hvd.alltoall(torch.ones(4), splits=[5] + [0] * (hvd.size() - 1)),
        lambda: hvd.reducescatter(torch.tensor(1.0)),
        lambda: hvd.synchronize(123456789),
        lambda: hvd.grouped_allreduce([torch.ones(2), torch.ones(2, dtype=torch.float64).to("meta")]),
    ]
    for case in cases:
        try:
            case()
        except (ValueError, NotImplementedError, TypeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
        else:
            raise AssertionError(f"case {len(errors)} did not raise")
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()  # nothing was issued by bad calls
    hvd.shutdown()
    return errors


def init_and_report() -> None:
    hvd.init()
    hvd.shutdown()


def pid() -> int:
    return os.getpid()


def numpy_communicator() -> None:
    import numpy as np

    from gpucomm import Communicator, ReduceOp

    comm = Communicator()
    n, r = comm.size, comm.rank
    a = np.arange(6, dtype=np.float32) + r
    out = comm.allreduce(a)
    assert isinstance(out, np.ndarray) and np.array_equal(out, sum(np.arange(6, dtype=np.float32) + q for q in range(n)))
    recv = np.empty(6, dtype=np.float32)
    assert comm.allreduce(a, recv, op=ReduceOp.MAX) is recv and np.array_equal(recv, a - r + n - 1)
    g = comm.allgather(np.full((r + 1, 2), r, dtype=np.int64))
    assert g.shape == (sum(q + 1 for q in range(n)), 2)
    b = np.full(3, r, dtype=np.float64)
    comm.broadcast(b, root=n - 1)
    assert np.array_equal(b, np.full(3, n - 1.0))
    x = np.arange(2 * n, dtype=np.int32) + 100 * r
    assert np.array_equal(comm.alltoall(x), np.array([100 * q + 2 * r + k for q in range(n) for k in range(2)], dtype=np.int32))
    rs = comm.reducescatter(np.ones((n, 2), dtype=np.float32))
    assert np.array_equal(rs, np.full((1, 2), float(n), dtype=np.float32))
    comm.barrier()
    hvd.shutdown()
