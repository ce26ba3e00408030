"""gpucomm, the implementation under test, called as a Horovod user calls it (``import gpucomm.torch as
hvd``): out-of-place is the function that returns a new tensor, in-place the ``_`` form. Horovod has no
in-place allgather, alltoall or reducescatter, so those columns read N/A rather than timing the
out-of-place path again under an in-place label."""

from __future__ import annotations

import torch

import gpucomm.torch as hvd

from .impl_base import Impl


class GpucommImpl(Impl):
    """hvd.allreduce(_), hvd.allgather, hvd.broadcast(_), hvd.alltoall, hvd.reducescatter."""

    name, label = "gpucomm", "gpucomm (import gpucomm.torch as hvd)"
    _OPS = {"sum": hvd.Sum, "prod": hvd.Product, "min": hvd.Min, "max": hvd.Max, "avg": hvd.Average}

    def in_place(self, coll: str) -> bool:
        return coll in ("allreduce", "broadcast")  # Horovod's only in-place collectives

    def api(self, coll: str) -> str:
        return f"hvd.{coll}" + (f" / hvd.{coll}_" if self.in_place(coll) else "")

    def run(self, coll: str, send: torch.Tensor, recv: torch.Tensor, *, op: str, root: int,
            in_place: bool) -> torch.Tensor:
        if coll == "allreduce":
            return hvd.allreduce_(recv, op=self._OPS[op]) if in_place else hvd.allreduce(send, op=self._OPS[op])
        if coll == "broadcast":
            return hvd.broadcast_(recv, root) if in_place else hvd.broadcast(send, root)
        if coll == "allgather":
            return hvd.allgather(send)
        if coll == "alltoall":
            return hvd.alltoall(send)
        if coll == "reducescatter":
            return hvd.reducescatter(send, op=self._OPS[op])
        raise ValueError(f"unknown collective {coll!r}")
