"""Raw CuPy NCCL: a ``cupy.cuda.nccl.NcclCommunicator`` of its own (unique id shared with
hvd.broadcast_object), called with data_ptr()s on torch's current stream, the same calls nccl-tests makes:
the floor that gpucomm's Python dispatch adds to. CUDA only."""

from __future__ import annotations

from typing import Any

import torch

import gpucomm.torch as hvd
from gpucomm.backends.nccl import version_text

from .impl_base import Impl


class NcclImpl(Impl):
    """allReduce, allGather, broadcast, reduceScatter, and alltoall as send/recv pairs in one group."""

    name = "nccl"

    def __init__(self, nccl: Any) -> None:
        import cupy  # noqa: PLC0415 - present whenever nccl_module() is

        self._nccl = nccl
        self.label = f"raw NCCL {version_text(nccl.get_version())} (cupy.cuda.nccl)"
        uid = nccl.get_unique_id() if hvd.rank() == 0 else None
        uid = hvd.broadcast_object(uid, 0, name="bench.nccl_uid")  # bytes (CuPy >= 14) or a tuple: sent as is
        with cupy.cuda.Device(torch.cuda.current_device()):
            self.comm = nccl.NcclCommunicator(hvd.size(), uid, hvd.rank())
        self._dtypes = {torch.int8: nccl.NCCL_INT8, torch.uint8: nccl.NCCL_UINT8, torch.int32: nccl.NCCL_INT32,
                        torch.int64: nccl.NCCL_INT64, torch.float16: nccl.NCCL_FLOAT16,
                        torch.float32: nccl.NCCL_FLOAT32, torch.float64: nccl.NCCL_FLOAT64,
                        torch.bfloat16: nccl.NCCL_BFLOAT16}
        self._ops = {"sum": nccl.NCCL_SUM, "prod": nccl.NCCL_PROD, "min": nccl.NCCL_MIN, "max": nccl.NCCL_MAX,
                     "avg": nccl.NCCL_AVG}

    def api(self, coll: str) -> str:
        return {"allreduce": "allReduce", "allgather": "allGather", "broadcast": "broadcast",
                "alltoall": "send/recv in a group", "reducescatter": "reduceScatter"}[coll]

    def run(self, coll: str, send: torch.Tensor, recv: torch.Tensor, *, op: str, root: int,
            in_place: bool) -> torch.Tensor:
        stream, dt, c = torch.cuda.current_stream().cuda_stream, self._dtypes[send.dtype], self.comm
        if coll == "allreduce":
            c.allReduce(send.data_ptr(), recv.data_ptr(), recv.numel(), dt, self._ops[op], stream)
        elif coll == "broadcast":
            c.broadcast(send.data_ptr(), recv.data_ptr(), recv.numel(), dt, root, stream)
        elif coll == "allgather":
            c.allGather(send.data_ptr(), recv.data_ptr(), send.numel(), dt, stream)
        elif coll == "reducescatter":
            c.reduceScatter(send.data_ptr(), recv.data_ptr(), recv.numel(), dt, self._ops[op], stream)
        elif coll == "alltoall":
            self._alltoall(send, recv, dt, stream)
        else:
            raise ValueError(f"unknown collective {coll!r}")
        return recv

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor, dt: int, stream: int) -> None:
        """One chunk to and from every peer, as nccl-tests' alltoall: send/recv pairs in one group."""
        n = hvd.size()
        chunk = send.numel() // n
        step = chunk * send.element_size()
        self._nccl.groupStart()
        try:
            for peer in range(n):
                self.comm.send(send.data_ptr() + peer * step, chunk, dt, peer, stream)
                self.comm.recv(recv.data_ptr() + peer * step, chunk, dt, peer, stream)
        finally:
            self._nccl.groupEnd()

    def close(self) -> None:
        torch.cuda.synchronize()
        self.comm.destroy()
