"""Stand-ins for the CUDA calls of the data plane, for tests on machines without a GPU.

``StandInCuda`` replaces ``gpucomm.dataplane.cuda_calls.CudaCalls`` (``install`` it): streams are
numbers, events are numbers recorded "done" at once unless a test holds them (``hold``), and every
call is counted in the process counters as the real ones are (records, waits, queries) and in
``calls`` by name. With ``cpu_is_gpu`` (the default) CPU tensors take the data plane's CUDA path,
so that path's Python work, its events and its stream waits are exercised on CPU tensors.

``NcclOverCpu`` stands in for ``NcclBackend`` on such tensors: each collective runs at once on the
group's CPU backend (Gloo, or the one-rank backend), with NCCL's ``AVG`` done as a sum then a
division, so a whole job's CUDA path computes real results on CPU.
"""

from __future__ import annotations

import collections
import itertools
from contextlib import nullcontext
from typing import Any

import pytest
import torch

from gpucomm.backends.base import BackendOp
from gpucomm.counters import COUNTERS
from gpucomm.dataplane import cuda_calls


class StandInCuda(cuda_calls.CudaCalls):
    """Counting CUDA calls with no GPU (see the module doc)."""

    def __init__(self, cpu_is_gpu: bool = True) -> None:
        super().__init__()
        if cpu_is_gpu:
            self.gpu_types = frozenset({"cuda", "cpu"})
        self.calls: collections.Counter = collections.Counter()
        self.hold = False  # events recorded from now on stay unfinished until ``finish_all``
        self.pending: set[int] = set()
        self.failing: set[int] = set()  # events whose query or stream wait raises (a CUDA error)
        self.waits: list[tuple[int, int]] = []  # (stream, event) in order
        self._ids = itertools.count(1)
        self.current = 7  # the caller's stream

    def index(self, device: torch.device) -> int:
        return 0

    def current_stream(self, device: torch.device) -> int:
        self.calls["current_stream"] += 1
        return self.current

    def new_stream(self, index: int) -> int:
        self.calls["new_stream"] += 1
        return 1000 + next(self._ids)

    def torch_stream(self, index: int, handle: int) -> Any:
        return None

    def destroy_stream(self, handle: int) -> None:
        self.calls["destroy_stream"] += 1

    def stream_context(self, index: int, handle: int):
        return nullcontext()

    def keep_alive(self, tensor: torch.Tensor, index: int, handle: int) -> None:
        self.calls["keep_alive"] += 1

    def new_event(self, index: int) -> int:
        self.calls["new_event"] += 1
        return next(self._ids)

    def destroy_event(self, event: int) -> None:
        self.calls["destroy_event"] += 1

    def record(self, event: int, stream: int, index: int) -> None:
        COUNTERS.cuda_event_records += 1
        self.calls["record"] += 1
        if self.hold:
            self.pending.add(event)
        else:
            self.pending.discard(event)

    def wait(self, stream: int, event: int, index: int) -> None:
        COUNTERS.cuda_stream_waits += 1
        self.calls["wait"] += 1
        if event in self.failing:  # CUDA reports an earlier asynchronous error at the next call
            raise RuntimeError("cudaErrorLaunchFailure: unspecified launch failure (stand-in)")
        self.waits.append((stream, event))

    def query(self, event: int) -> bool:
        COUNTERS.cuda_event_queries += 1
        self.calls["query"] += 1
        if event in self.failing:
            raise RuntimeError("cudaErrorLaunchFailure: unspecified launch failure (stand-in)")
        return event not in self.pending

    def read_later(self, tensor: torch.Tensor) -> Any:
        self.calls["read_later"] += 1
        return tensor.clone()

    def read_if_done(self, token: Any) -> torch.Tensor | None:
        return token

    def read_now(self, token: Any) -> torch.Tensor:
        self.calls["read_now"] += 1
        return token

    def finish_all(self) -> None:
        """The GPU caught up: every event recorded so far is done."""
        self.pending.clear()


class NcclOverCpu:
    """``NcclBackend``'s interface over a CPU backend (see the module doc)."""

    name = "nccl"

    def __init__(self, cpu: Any, size: int) -> None:
        self._cpu, self.size = cpu, size
        self.calls: collections.Counter = collections.Counter()

    def _done(self, work: Any) -> None:
        if work is not None and hasattr(work, "wait"):
            work.wait(60.0, lambda: None)

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> None:
        self.calls["allreduce"] += 1
        if send.data_ptr() != recv.data_ptr():
            recv.copy_(send)
        self._done(self._cpu.allreduce(recv, recv, op=BackendOp.SUM if op == BackendOp.AVG else op))
        if op == BackendOp.AVG:
            recv.div_(self.size)

    def broadcast(self, send: torch.Tensor, recv: torch.Tensor, *, root: int, stream: int | None = None) -> None:
        self.calls["broadcast"] += 1
        self._done(self._cpu.broadcast(send, recv, root=root))

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, *, stream: int | None = None) -> None:
        self.calls["allgather"] += 1
        self._done(self._cpu.allgather(send, recv))

    def reducescatter(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> None:
        self.calls["reducescatter"] += 1
        self._done(self._cpu.reducescatter(send, recv, op=op))

    def check_async_error(self) -> None:
        return None

    def abort(self) -> None:
        return None

    def close(self, *, abort: bool = False) -> None:
        return None


def install(cpu_is_gpu: bool = True) -> StandInCuda:
    """Install a fresh ``StandInCuda`` as the process's CUDA calls and return it."""
    stand_in = StandInCuda(cpu_is_gpu)
    cuda_calls.install(stand_in)
    return stand_in


@pytest.fixture
def stand_in_cuda() -> Any:
    """(a pytest fixture: import it into a test module) This process's CUDA calls as counting
    stand-ins for one test, CPU tensors staying on the CPU path; the real calls again after."""
    stand_in = StandInCuda(cpu_is_gpu=False)
    previous = cuda_calls.install(stand_in)
    yield stand_in
    cuda_calls.install(previous)
