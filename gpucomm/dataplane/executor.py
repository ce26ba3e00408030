"""Turns agreed requests into backend calls: Gloo on CPU (host-completed works), NCCL on a
communication stream ordered by events on GPU (never blocking the host).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..backends.base import WireOp
from ..reduce_op import ReduceOp
from .handles import Issued
from .requests import Request, reducescatter_rows, scale_

_WIRE = {ReduceOp.SUM: WireOp.SUM, ReduceOp.MIN: WireOp.MIN, ReduceOp.MAX: WireOp.MAX, ReduceOp.PRODUCT: WireOp.PRODUCT}

Plan = tuple[list[Any], Callable[[], Any]]  # backend works, and the step that produces the result


class Executor:
    """Turns negotiated requests into backend calls for one initialized job.

    ``groups(set_id)`` gives the process set a request runs on (its members, this rank's index in
    it, its Gloo and NCCL backends); ``meta`` is what the coordinator added: the other ranks' first
    dimensions for allgather and the matrix of splits for alltoall, so no extra exchange is needed."""

    def __init__(self, groups: Callable[[int], Any], tracer: Callable[[], Any] = lambda: None) -> None:
        self._groups = groups
        self._tracer = tracer  # the timeline's tracer while one is recording (rank 0), else None
        self._streams: dict[int, Any] = {}

    def __call__(self, req: Request, meta: dict) -> Issued:
        group = self._groups(req.set_id)
        tracer = self._tracer()
        if req.device.type == "cpu":
            works, after = self._plan(req, meta, group, group.gloo(), None)
            if tracer is not None:
                tracer.cpu_op(req.name, req.kind, req.tensors, works)
            return Issued(works, None, after)
        backend = group.nccl()
        comm = self._comm_stream(req.device)
        trace = tracer.gpu_op(req.name, req.kind, comm) if tracer is not None else None
        comm.wait_event(req.ready_event)
        if trace is not None:
            trace.step("QUEUE", comm)
        with torch.cuda.stream(comm):
            works, after = self._plan(req, meta, group, backend, comm.cuda_stream)
            result = after()
            if trace is not None:
                trace.step(f"NCCL_{req.kind.upper()}", comm)
                trace.submit(req.tensors[0].dtype if req.tensors else None,
                             req.tensors[0].shape if len(req.tensors) == 1 else f"[{len(req.tensors)} tensors]")
            done = torch.cuda.Event()
            done.record(comm)
        for t in req.tensors + (req.outputs or []):
            t.record_stream(comm)  # the caching allocator must not reuse them while NCCL runs
        return Issued(works, done, lambda: result)

    def _comm_stream(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def _plan(self, req: Request, meta: dict, group, backend, stream: int | None) -> Plan:
        return getattr(self, "_" + req.kind)(req, meta, group, backend, stream)

    # -- collectives -------------------------------------------------------------------------
    @staticmethod
    def _wire(req: Request, group, backend, dtype: torch.dtype) -> tuple[WireOp, float]:
        """The backend reduction and the post-scale that together give ``req.op``."""
        if req.op != ReduceOp.AVERAGE:
            return _WIRE[req.op], req.postscale
        if backend.name == "nccl" and dtype.is_floating_point and req.prescale == 1.0 and req.postscale == 1.0:
            return WireOp.AVG, 1.0
        return WireOp.SUM, req.postscale / group.size

    def _allreduce(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        outs = req.outputs if req.outputs is not None else [torch.empty_like(t) for t in req.tensors]
        if len(req.tensors) == 1:
            src, out = req.tensors[0], outs[0]  # contiguous: backends need no flat view
            if out is not src:
                out.copy_(src)
            scale_(out, req.prescale)
            wire, post = self._wire(req, group, backend, out.dtype)
            work = backend.allreduce(out, out, op=wire, stream=stream)

            def after_one():
                scale_(out, post)
                return outs

            return [w for w in (work,) if w is not None], after_one
        # Grouped: one fused buffer per dtype, one backend call each.
        works, fused = [], []
        for dtype in dict.fromkeys(t.dtype for t in req.tensors):
            idx = [i for i, t in enumerate(req.tensors) if t.dtype == dtype]
            buf = torch.cat([req.tensors[i].reshape(-1) for i in idx])
            scale_(buf, req.prescale)
            wire, post = self._wire(req, group, backend, dtype)
            w = backend.allreduce(buf, buf, op=wire, stream=stream)
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
        src = req.tensors[0]
        root = group.index_of(req.root)
        out = req.outputs[0] if req.outputs is not None else (src.clone() if group.rank == root else torch.empty_like(src))
        work = backend.broadcast(out.view(-1), out.view(-1), root=root, stream=stream)
        return [w for w in (work,) if w is not None], lambda: [out]

    def _allgather(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        works, pieces = [], []
        for i, t in enumerate(req.tensors):
            rows = meta["rows"][i]
            tail = list(t.shape[1:])
            row_numel = math.prod(tail)
            most = max(rows)
            send = t.reshape(-1)
            if min(rows) != most:  # uneven first dimension: pad to the longest, compact afterwards
                send = torch.zeros(most * row_numel, dtype=t.dtype, device=t.device)
                send[: t.numel()].copy_(t.reshape(-1))
            recv = torch.empty(group.size * most * row_numel, dtype=t.dtype, device=t.device)
            w = backend.allgather(send, recv, stream=stream)
            if w is not None:
                works.append(w)
            pieces.append((recv, rows, most, row_numel, tail, t.dim() == 0))

        def after():
            outs = []
            for recv, rows, most, row_numel, tail, scalar in pieces:
                if scalar:
                    outs.append(recv.view(group.size))
                elif min(rows) == most:
                    outs.append(recv.view(group.size * most, *tail))
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
        recv = torch.empty(sum(received) * row_numel, dtype=t.dtype, device=t.device)
        w = backend.alltoall(t.reshape(-1), recv, [s * row_numel for s in splits], [s * row_numel for s in received],
                             stream=stream)
        return [w] if w is not None else [], lambda: (recv.view(sum(received), *tail), received)

    def _reducescatter(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        works, pieces = [], []
        for t in req.tensors:
            rows = reducescatter_rows(t.shape[0], group.size)
            tail = list(t.shape[1:])
            row_numel, most = math.prod(tail), rows[0]
            send = torch.zeros(group.size * most * row_numel, dtype=t.dtype, device=t.device)
            flat, pos = t.reshape(-1), 0
            for r, n in enumerate(rows):  # rank r's rows go to slot r, padded to the longest slot
                send[r * most * row_numel : (r * most + n) * row_numel].copy_(flat[pos : pos + n * row_numel])
                pos += n * row_numel
            scale_(send, req.prescale)
            recv = torch.empty(most * row_numel, dtype=t.dtype, device=t.device)
            wire, post = self._wire(req, group, backend, t.dtype)
            w = backend.reducescatter(send, recv, op=wire, stream=stream)
            if w is not None:
                works.append(w)
            pieces.append((recv, rows[group.rank], row_numel, tail, post))

        def after():
            outs = []
            for recv, n, row_numel, tail, post in pieces:
                out = recv[: n * row_numel].view(n, *tail)
                scale_(out, post)
                outs.append(out)
            return outs

        return works, after


__all__ = ["Executor"]
