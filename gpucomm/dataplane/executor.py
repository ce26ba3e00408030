"""Turns agreed requests into backend calls: Gloo on CPU (host-completed works), NCCL on a
communication stream ordered by events on GPU (never blocking the host).

The latency-critical kinds (one-tensor allreduce, broadcast) are *prepared* on the caller's thread
at submission: their outputs are allocated there, on the caller's stream and before its ready
event, so launching them later needs no stream context, no copy (NCCL reduces out of place) and
no ``record_stream``; their post-scaling runs when the caller collects the result, on its stream.
Every other kind plans its buffers on the communication stream when it runs.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Sequence

import torch

from ..backends.base import BackendOp
from ..counters import COUNTERS
from ..reduce_op import ReduceOp
from . import cuda_calls
from .completion import StreamCompletion
from .events import EventPool
from .handles import Issued
from .requests import Request, reducescatter_rows, scale_
from .results import ResultBuffers

_BACKEND_OPS = {ReduceOp.SUM: BackendOp.SUM, ReduceOp.MIN: BackendOp.MIN, ReduceOp.MAX: BackendOp.MAX, ReduceOp.PRODUCT: BackendOp.PRODUCT}

Plan = tuple[list[Any], Callable[[], Any]]  # backend works, and the step that produces the result

_results = ResultBuffers()  # large CPU results, recycled once their callers dropped them


def new_result(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized result tensor: on the CPU warm memory from the pool when large (see
    ``results.py``: a fresh mapping costs a page fault per 4 KiB on the first write), else new."""
    if device.type == "cpu":
        return _results.empty(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


SMALL_GLOO_GROUP = 4  # Gloo groups up to this size take the faster collectives below (measured at 2 ranks)
BROADCAST_GATHER_BYTES = 1 << 20  # an allgather this large (result bytes) runs as one broadcast per rank


def _small_gloo_group(backend, group) -> bool:
    """Gloo's reduce-scatter and allgather are its slow collectives on CPU: in a group this small a
    reduce-scatter runs as an allreduce (twice the bytes, still faster) and a large allgather as
    broadcasts. The answer depends only on what every member shares, so all members take one path."""
    return backend.name == "gloo" and 1 < group.size <= SMALL_GLOO_GROUP


def release_results() -> None:
    """Let go of the pooled result memory (the job shut down)."""
    _results.clear()


def prepare(req: Request) -> None:
    """Caller's thread, at submission: allocate the outputs of a one-tensor allreduce or a broadcast
    and pre-scale the allreduce's input into its new output (so the op sends ``req.send``). The
    caller's tensors are never changed here: an in-place allreduce with a prescale is left to run
    time, after the ranks agreed (and the coordinator may still reduce it from the unscaled input)."""
    if req.kind == "allreduce" and len(req.tensors) == 1:
        src = req.tensors[0]
        if req.prescale != 1.0 and req.outputs is not None:
            return
        out = req.outputs[0] if req.outputs is not None else new_result(src.shape, src.dtype, src.device)
        if req.prescale != 1.0:
            out.copy_(src)
            scale_(out, req.prescale)
            src = out
        req.outputs, req.send = [out], src
    elif req.kind == "broadcast":
        src = req.tensors[0]
        req.outputs = req.outputs if req.outputs is not None else [new_result(src.shape, src.dtype, src.device)]
        req.send = src


class CommunicatorCreation:
    """What the watchdog names while a process set's NCCL communicator is being created, inside the
    host call of its first collective (``ncclCommInitRank`` waits for every member)."""

    creating = True

    def __init__(self, set_id: int, request: Request) -> None:
        self.set_id, self.request = set_id, request

    def describe(self) -> str:
        return f"the creation of process set {self.set_id}'s NCCL communicator for {self.request.describe()}"


class Executor:
    """Turns negotiated requests into backend calls for one initialized job.

    ``groups(set_id)`` gives the process set a request runs on (its members, this rank's index in
    it, its Gloo and NCCL backends); ``meta`` is what the coordinator added: the other ranks' first
    dimensions for allgather and the matrix of splits for alltoall, so no extra exchange is needed.
    ``events`` takes back each request's ready event once the communication stream waits on it and
    gives the done events; ``watch(done_event, device, request, stream)`` hands a CUDA collective
    to the data plane's watchdog, which returns the done event to ``events`` once it is finished and
    waited for (the returned callable is what the waiter calls).

    On a GPU a request runs in one of three ways: a synchronous prepared one (one-tensor allreduce,
    broadcast, waited for at once) on the caller's own stream, with no communication stream and no
    ready event (one done event for the watchdog, which its waiter does not wait on); a fixed
    schedule's launch (``per_step``) on the executor's communication stream, completed by its step's
    one done event (``completion``); any other on the communication stream with a ready and a done
    event of its own."""

    def __init__(self, groups: Callable[[int], Any], tracer: Callable[[], Any] = lambda: None, *,
                 events: EventPool, watch: Callable[..., Callable[[], None]],
                 host_calls: dict[int, tuple[Any, float]] | None = None,
                 start_watch: Callable[[], None] = lambda: None) -> None:
        self._groups = groups
        self._tracer = tracer  # the timeline's tracer while one is recording (rank 0), else None
        self._events = events
        self._watch = watch
        # each CUDA collective's host call, noted while it runs (the watchdog reports one that never
        # returns: NCCL's lazy connection to a peer that never comes); the watchdog runs from the first
        self._host_calls = host_calls if host_calls is not None else {}
        self._start_watch = start_watch
        self._nccl_made: set = set()  # groups whose NCCL communicator this executor has seen created
        self._streams: dict[int, int] = {}  # device index -> this executor's communication stream (raw)
        self._completions: dict[int, StreamCompletion] = {}
        self._made = threading.Lock()  # a device's stream and completion are made once, whatever thread asks
        # each collective kind's plan (the one dispatch from a request's kind)
        self._plans: dict[str, Callable[..., Plan]] = {
            "allreduce": self._allreduce, "broadcast": self._broadcast, "allgather": self._allgather,
            "alltoall": self._alltoall, "reducescatter": self._reducescatter}

    def __call__(self, req: Request, meta: dict) -> Issued:
        group = self._groups(req.set_id)
        tracer = self._tracer()
        nbytes = 0
        for t in req.tensors:
            nbytes += t.numel() * t.element_size()
        COUNTERS.collectives += 1
        COUNTERS.bytes += nbytes
        if req.device.type not in cuda_calls.calls().gpu_types:
            backend = group.cpu_backend()
            name = backend.name
            if name == "gloo":
                COUNTERS.gloo_collectives += 1
            elif name == "mpi":
                COUNTERS.mpi_collectives += 1
            works, after = self._plan(req, meta, group, backend, None)
            if tracer is not None:
                tracer.cpu_op(req.name, req.kind, req.tensors, works, transport=name)
            return Issued(works, None, after)
        host_calls, thread = self._host_calls, threading.get_ident()
        if group in self._nccl_made:
            backend = group.nccl()
        else:  # the set's first CUDA collective creates its communicator: watched as a creation
            self._start_watch()  # from the first (idempotent): a host call may block before anything is watched
            host_calls[thread] = (CommunicatorCreation(group.id, req), time.monotonic())
            try:
                backend = group.nccl()
            finally:
                host_calls.pop(thread, None)
            self._nccl_made.add(group)
        host_calls[thread] = (req, time.monotonic())
        try:
            if req.waited_at_once and req.send is not None and req.ready_event is None and tracer is None:
                return self._on_caller_stream(req, meta, group, backend)
            return self._cuda(req, meta, group, backend, tracer)
        finally:
            host_calls.pop(thread, None)

    def _on_caller_stream(self, req: Request, meta: dict, group, backend) -> Issued:
        """A synchronous prepared request: launched on the stream its caller waits on."""
        COUNTERS.sync_fast_ops += 1
        stream, index = req.stream, req.index
        works, after = self._plan(req, meta, group, backend, stream)
        done = self._events.record(stream, index)  # for the watchdog only: the caller's stream is ordered already
        return Issued(works, done, after, done_stream=stream, release_done=self._watch(done, index, req, stream))

    def comm_stream(self, index: int) -> int:
        """This executor's communication stream on GPU ``index`` (made at first use), raw."""
        stream = self._streams.get(index)
        if stream is None:
            with self._made:
                stream = self._streams.get(index)
                if stream is None:
                    stream = self._streams[index] = cuda_calls.calls().new_stream(index)
        return stream

    def _completion(self, index: int, stream: int) -> StreamCompletion:
        completion = self._completions.get(index)
        if completion is None:
            with self._made:
                completion = self._completions.get(index)
                if completion is None:
                    completion = self._completions[index] = StreamCompletion(self._events, self._watch, index,
                                                                             stream)
        return completion

    def _cuda(self, req: Request, meta: dict, group, backend, tracer) -> Issued:
        calls = cuda_calls.calls()
        index = req.index
        comm = self.comm_stream(index)
        trace = tracer.gpu_op(req.name, req.kind, calls.torch_stream(index, comm)) if tracer is not None else None
        ready = req.ready_event
        if ready is None:  # submitted without one (a synchronous op while a timeline records): record it now,
            ready = self._events.record(req.stream, index)  # the caller waits, so its stream has nothing newer
        calls.wait(comm, ready, index)
        self._events.release(ready, index)
        if trace is not None:
            trace.step("QUEUE", calls.torch_stream(index, comm))
        if req.send is not None:  # prepared on the caller's stream: launch only
            works, after = self._plan(req, meta, group, backend, comm)
            on_comm = False
        else:
            with calls.stream_context(index, comm):
                works, after = self._plan(req, meta, group, backend, comm)
                result = after()
            after, on_comm = (lambda: result), True
        if trace is not None:
            trace.step(f"NCCL_{req.kind.upper()}", calls.torch_stream(index, comm))
            trace.submit(req.tensors[0].dtype if req.tensors else None,
                         req.tensors[0].shape if len(req.tensors) == 1 else f"[{len(req.tensors)} tensors]")
        if req.per_step:  # a fixed schedule's launch: its step's one done event completes it
            # (its inputs are the bucket's persistent buffer, or its result, which the waiter keeps alive)
            covered = self._completion(index, comm).launched(req)
            return Issued(works, None, after, results_on_comm=on_comm, covered=covered)
        done = self._events.record(comm, index)
        if on_comm:
            for t in req.tensors:
                calls.keep_alive(t, index, comm)  # the caching allocator must not reuse them while NCCL reads them
        return Issued(works, done, after, results_on_comm=on_comm, done_stream=comm,
                      release_done=self._watch(done, index, req, comm))

    def seal_step(self) -> None:
        """A fixed schedule's launches so far get their done event now (one per stream), watched from
        here: at the end of backward, and again when the step ends if more were launched since."""
        for completion in list(self._completions.values()):
            completion.seal()

    def close(self) -> None:
        """Hand the last done events back (the executor's schedule or job ends)."""
        for completion in list(self._completions.values()):
            completion.close()

    def destroy_streams(self) -> None:
        """Let go of the communication streams (after their work was drained: a schedule's release)."""
        with self._made:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            cuda_calls.calls().destroy_stream(stream)

    def _plan(self, req: Request, meta: dict, group, backend, stream: int | None) -> Plan:
        return self._plans[req.kind](req, meta, group, backend, stream)

    # -- collectives -------------------------------------------------------------------------
    @staticmethod
    def _backend_op(req: Request, group, backend, dtype: torch.dtype) -> tuple[BackendOp, float]:
        """The backend reduction and the post-scale that together give ``req.op``."""
        if req.op != ReduceOp.AVERAGE:
            return _BACKEND_OPS[req.op], req.postscale
        if backend.name == "nccl" and dtype.is_floating_point and req.prescale == 1.0 and req.postscale == 1.0:
            return BackendOp.AVG, 1.0
        return BackendOp.SUM, req.postscale / group.size

    def _allreduce(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        if req.send is not None:  # one tensor, prepared: out of place, pre-scaled already
            outs = req.outputs
            out = outs[0]
            op, post = self._backend_op(req, group, backend, out.dtype)
            work = backend.allreduce(req.send, out, op=op, stream=stream)
            if post == 1.0:
                return ([work] if work is not None else []), lambda: outs

            def after_one():
                scale_(out, post)
                return outs

            return ([work] if work is not None else []), after_one
        if len(req.tensors) == 1 and req.outputs is not None and req.outputs[0] is req.tensors[0]:
            t = req.tensors[0]  # one tensor in place with a prescale: reduced where it lies, no staging copy
            op, post = self._backend_op(req, group, backend, t.dtype)
            scale_(t, req.prescale)
            work = backend.allreduce(t, t, op=op, stream=stream)

            def after_in_place():
                scale_(t, post)
                return req.tensors

            return ([work] if work is not None else []), after_in_place
        outs = req.outputs if req.outputs is not None else [torch.empty_like(t) for t in req.tensors]
        # Grouped: one fused buffer per dtype, one backend call each.
        works, fused = [], []
        for dtype in dict.fromkeys(t.dtype for t in req.tensors):
            idx = [i for i, t in enumerate(req.tensors) if t.dtype == dtype]
            buf = torch.cat([req.tensors[i].reshape(-1) for i in idx])
            scale_(buf, req.prescale)
            op, post = self._backend_op(req, group, backend, dtype)
            w = backend.allreduce(buf, buf, op=op, stream=stream)
            if w is not None:
                works.append(w)
            fused.append((idx, buf, post))

        def after_group():
            for idx, buf, post in fused:
                scale_(buf, post)
                pos = 0
                for i in idx:
                    n = outs[i].numel()
                    outs[i].view(-1).copy_(buf[pos : pos + n])
                    pos += n
            return outs

        return works, after_group

    def _broadcast(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        outs = req.outputs  # prepared: root sends req.send, every rank receives into outs[0]
        work = backend.broadcast(req.send.view(-1), outs[0].view(-1), root=group.index_of(req.root), stream=stream)
        return ([work] if work is not None else []), lambda: outs

    def _allgather(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        works, pieces = [], []
        for i, t in enumerate(req.tensors):
            rows = meta["rows"][i]
            tail = list(t.shape[1:])
            row_numel = math.prod(tail)
            most = max(rows)
            send = t.reshape(-1)
            if _small_gloo_group(backend, group) and sum(rows) * row_numel * t.element_size() >= BROADCAST_GATHER_BYTES:
                # Gloo's allgather is slow on CPU (2 ranks, 32 MiB each: 36.8 ms, where one 32 MiB broadcast
                # takes 11.9 ms): each rank's rows are broadcast by their owner, straight into the compact result
                recv = new_result((sum(rows) * row_numel,), t.dtype, t.device)
                offset = 0
                for r, n in enumerate(rows):
                    if n:
                        part = recv[offset * row_numel : (offset + n) * row_numel]
                        works.append(backend.broadcast(send if r == group.rank else part, part, root=r, stream=stream))
                    offset += n
                pieces.append((recv, rows, None, row_numel, tail, t.dim() == 0))
                continue
            if min(rows) != most and backend.name == "mpi":  # allgatherv: straight into the compact result
                recv = new_result((sum(rows) * row_numel,), t.dtype, t.device)
                w = backend.allgather(send, recv, recv_counts=[n * row_numel for n in rows], stream=stream)
                works.append(w)
                pieces.append((recv, rows, None, row_numel, tail, False))
                continue
            if min(rows) != most:  # uneven first dimension: pad to the longest, compact afterwards
                send = torch.zeros(most * row_numel, dtype=t.dtype, device=t.device)
                send[: t.numel()].copy_(t.reshape(-1))
            recv = new_result((group.size * most * row_numel,), t.dtype, t.device)
            w = backend.allgather(send, recv, stream=stream)
            if w is not None:
                works.append(w)
            pieces.append((recv, rows, most, row_numel, tail, t.dim() == 0))

        def after():
            outs = []
            for recv, rows, most, row_numel, tail, scalar in pieces:
                if scalar:
                    outs.append(recv.view(group.size))
                elif most is None or min(rows) == most:  # compact already
                    outs.append(recv.view(sum(rows), *tail))
                else:
                    parts = [recv[r * most * row_numel : (r * most + rows[r]) * row_numel] for r in range(group.size)]
                    outs.append(torch.cat(parts).view(sum(rows), *tail))
            return outs, [p[1] for p in pieces]

        return works, after

    def _alltoall(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        t = req.tensors[0]
        matrix = meta["splits"]
        splits = matrix[group.rank]
        received = [matrix[r][group.rank] for r in range(group.size)]
        tail = list(t.shape[1:])
        row_numel = math.prod(tail)
        recv = new_result((sum(received) * row_numel,), t.dtype, t.device)
        w = backend.alltoall(t.reshape(-1), recv, [s * row_numel for s in splits], [s * row_numel for s in received],
                             stream=stream)
        return [w] if w is not None else [], lambda: (recv.view(sum(received), *tail), received)

    def _reducescatter(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        works, pieces = [], []
        # Gloo's reduce-scatter (2 ranks, 32 MiB: 50.7 ms, where its allreduce takes 26.6 ms): in a small
        # group, allreduce a private copy and keep this rank's slot. MPI's and NCCL's run as they are.
        via_allreduce = _small_gloo_group(backend, group)
        for t in req.tensors:
            rows = reducescatter_rows(t.shape[0], group.size)
            tail = list(t.shape[1:])
            row_numel, most = math.prod(tail), rows[0]
            slot = most * row_numel
            if rows[-1] == most and req.prescale == 1.0 and not via_allreduce:  # the input is the send buffer
                send = t.reshape(-1)
            elif rows[-1] == most:  # a private copy (allreduce works in place), scaled
                send = new_result((group.size * slot,), t.dtype, t.device)
                send.copy_(t.reshape(-1))
                scale_(send, req.prescale)
            else:  # rank r's rows go to slot r, padded to the longest slot; scaled in the copy
                send = torch.zeros(group.size * slot, dtype=t.dtype, device=t.device)
                flat, pos = t.reshape(-1), 0
                for r, n in enumerate(rows):
                    send[r * slot : r * slot + n * row_numel].copy_(flat[pos : pos + n * row_numel])
                    pos += n * row_numel
                scale_(send, req.prescale)
            recv = new_result((slot,), t.dtype, t.device)
            op, post = self._backend_op(req, group, backend, t.dtype)
            if via_allreduce:
                w = backend.allreduce(send, send, op=op, stream=stream)
                reduced = send[group.rank * slot : (group.rank + 1) * slot]
            else:
                w = backend.reducescatter(send, recv, op=op, stream=stream)
                reduced = None
            if w is not None:
                works.append(w)
            pieces.append((recv, reduced, rows[group.rank], row_numel, tail, post))

        def after():
            outs = []
            for recv, reduced, n, row_numel, tail, post in pieces:
                if reduced is not None:
                    recv.copy_(reduced)  # the result owns its memory, not a view of the whole allreduced buffer
                out = recv[: n * row_numel].view(n, *tail)
                scale_(out, post)
                outs.append(out)
            return outs

        return works, after


__all__ = ["Executor", "new_result", "prepare", "release_results"]
