"""Timing and checking one call, as nccl-tests' BenchTime does: warm-up calls, then per size one untimed
call, a barrier, and -n calls back to back (pipelined; -z 1 completes each and runs a barrier), timed
with CUDA events on the current stream (GPU) or the host clock (CPU, where every call returns complete);
then, with -c 1, one call on freshly filled buffers whose result is counted element by element."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import gpucomm.torch as hvd

import anchors

from .expected import count_wrong, expected_result, tolerance
from .impl_base import Impl
from .inputs import DTYPES, Buffers, make_buffers
from .sizes import Layout, layout


@dataclass
class Case:
    """One table's fixed parameters."""

    coll: str
    impl: Impl
    dtype_name: str
    op: str  # a reduction op, or "none"
    root: int  # broadcast's root, -1 elsewhere
    device: torch.device
    counters: dict[str, int] = field(default_factory=dict)  # gpucomm's counters moved by the timed calls

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]


def synchronize(device: torch.device) -> None:
    """Wait for the current stream (a no-op on CPU, where every call returns complete)."""
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()


def call(case: Case, bufs: Buffers, in_place: bool) -> torch.Tensor:
    """One call of the case's collective; returns the tensor that holds this rank's result."""
    return case.impl.run(case.coll, bufs.send, bufs.recv, op=case.op, root=max(case.root, 0), in_place=in_place)


def time_calls(case: Case, bufs: Buffers, in_place: bool, iters: int, blocking: bool) -> float:
    """Seconds per call on this rank: ``iters`` calls back to back (or each completed, then a barrier)."""
    call(case, bufs, in_place)  # nccl-tests' untimed "sync" call
    synchronize(case.device)
    hvd.barrier()
    before = hvd.stats()
    if case.device.type == "cpu":  # every call returns complete: the host clock is the measure
        t0 = time.perf_counter()
        _calls(case, bufs, in_place, iters, blocking)
        seconds = time.perf_counter() - t0
    else:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _calls(case, bufs, in_place, iters, blocking)
        end.record()  # every implementation leaves the current stream waiting on its collective
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    anchors.add_counts(case.counters, anchors.counter_delta(before, hvd.stats()))
    return seconds / iters


def _calls(case: Case, bufs: Buffers, in_place: bool, iters: int, blocking: bool) -> None:
    for _ in range(iters):
        call(case, bufs, in_place)
        if blocking:
            synchronize(case.device)
            hvd.barrier()


def check_call(case: Case, lay: Layout, in_place: bool) -> int:
    """Wrong elements on this rank after one call on freshly filled buffers."""
    rank, n = hvd.rank(), hvd.size()
    bufs = make_buffers(case.coll, lay, case.op, rank, n, case.dtype, case.device, in_place)
    got = call(case, bufs, in_place)
    synchronize(case.device)
    want = expected_result(case.coll, lay, case.op, case.root, rank, n, case.dtype, case.device)
    return count_wrong(got, want, tolerance(case.op, case.dtype, n))


def measure(case: Case, lay: Layout, in_place: bool, args: argparse.Namespace) -> tuple[float, float]:
    """(seconds per call, wrong elements) on this rank; NaN for either when it does not apply."""
    if in_place and not case.impl.in_place(case.coll):
        return math.nan, math.nan
    bufs = make_buffers(case.coll, lay, case.op, hvd.rank(), hvd.size(), case.dtype, case.device, in_place)
    seconds = time_calls(case, bufs, in_place, args.iters, bool(args.blocking))
    wrong = float(check_call(case, lay, in_place)) if args.check else math.nan
    return seconds, wrong


def warm_up(case: Case, sizes: Sequence[int], iters: int) -> None:
    """nccl-tests' warm-up: ``iters`` out-of-place calls at the largest, then the smallest size."""
    elsize = torch.empty((), dtype=case.dtype).element_size()
    for nbytes in (sizes[-1], sizes[0]):
        lay = layout(case.coll, nbytes, elsize, hvd.size())
        bufs = make_buffers(case.coll, lay, case.op, hvd.rank(), hvd.size(), case.dtype, case.device, False)
        for _ in range(iters):
            call(case, bufs, False)
        synchronize(case.device)
