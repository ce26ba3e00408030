"""A framework-neutral communicator for CuPy (or Numba, or NumPy) users.

Arrays with ``__cuda_array_interface__`` are wrapped as torch CUDA tensors without a copy and go
through NCCL; NumPy arrays go through Gloo. ``stream`` orders the work after everything already
queued on that stream (a CuPy/torch stream object or a raw ``cudaStream_t``), as NCCL calls do.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from . import job as jobs
from .control.config import Send
from .dataplane.requests import Request, check_op, check_tensors
from .reduce_op import ReduceOp


def _as_tensor(array: Any) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(array))
    if hasattr(array, "__cuda_array_interface__"):
        return torch.as_tensor(array, device="cuda")
    raise TypeError(f"expected a NumPy array or an object with __cuda_array_interface__, got {type(array).__name__}")


def _like(result: torch.Tensor, template: Any) -> Any:
    if isinstance(template, np.ndarray):
        return result.numpy()
    if isinstance(template, torch.Tensor) or not hasattr(template, "__cuda_array_interface__"):
        return result
    import cupy  # noqa: PLC0415 - only CuPy-typed inputs reach here

    return cupy.asarray(result)


def stream_handle(stream: Any) -> int:
    """The ``cudaStream_t`` of ``stream``: a raw handle (int), a CuPy stream (``.ptr``; 0 for its
    default stream ``cupy.cuda.Stream.null``) or a torch stream (``.cuda_stream``)."""
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    ptr = getattr(stream, "ptr", None)  # CuPy; 0 is a valid handle (the default stream), not "missing"
    if ptr is None:
        ptr = getattr(stream, "cuda_stream", None)  # torch
    if not isinstance(ptr, int):
        raise TypeError(f"stream must be a CuPy or torch CUDA stream, or a raw cudaStream_t (int); got "
                        f"{type(stream).__name__} {stream!r}.")
    return ptr


@contextlib.contextmanager
def _on_stream(stream: Any, device: torch.device):
    if stream is None or device.type != "cuda":
        yield
        return
    ptr = stream_handle(stream)
    # handle 0 is the default stream (CuPy's Stream.null): torch's own object for it on this device
    target = torch.cuda.default_stream(device) if ptr == 0 else torch.cuda.ExternalStream(ptr, device=device)
    with torch.cuda.stream(target):
        yield


class Communicator:
    """The job's collectives on raw arrays; ``Communicator()`` calls ``init()`` if needed."""

    def __init__(self) -> None:
        self._rt = jobs.init()

    @property
    def rank(self) -> int:
        return self._rt.world.rank

    @property
    def size(self) -> int:
        return self._rt.world.size

    def _run(self, kind: str, send: Any, recv: Any, stream: Any, *, reducing: bool = False, **fields: Any) -> Any:
        src = _as_tensor(send)
        device = check_tensors(kind, [src], reducing=reducing)
        if "op" in fields:
            check_op(kind, fields["op"])
        out = None if recv is None else _as_tensor(recv)
        in_place = kind in ("allreduce", "broadcast") and out is not None and out.shape == src.shape
        with _on_stream(stream, device):
            if in_place and out is not src:
                out.copy_(src)
            target = out if in_place else src
            req = Request(kind, f"comm.{kind}", [target], outputs=[target] if in_place else None, device=device, **fields)
            result = self._rt.submit(req, send=Send.ON_WAIT).wait()
            tensor = result[0][0] if kind == "allgather" else result[0]
            if out is not None and not in_place:
                out.view(-1).copy_(tensor.reshape(-1))
                return recv
        return recv if out is not None else _like(tensor, send)

    def allreduce(self, send: Any, recv: Any = None, op: ReduceOp = ReduceOp.SUM, stream: Any = None) -> Any:
        """Reduce ``send`` over all ranks into ``recv`` (or a new array)."""
        return self._run("allreduce", send, recv, stream, reducing=True, op=ReduceOp(op))

    def allgather(self, send: Any, recv: Any = None, stream: Any = None) -> Any:
        """Concatenate every rank's ``send`` along dim 0."""
        return self._run("allgather", send, recv, stream)

    def broadcast(self, buf: Any, root: int = 0, stream: Any = None) -> Any:
        """Overwrite ``buf`` with root's ``buf``."""
        if not 0 <= root < self.size:
            raise ValueError(f"root={root} is not a rank of this job (0..{self.size - 1}).")
        return self._run("broadcast", buf, buf, stream, root=root)

    def alltoall(self, send: Any, recv: Any = None, stream: Any = None) -> Any:
        """Rank i gets the i-th equal part of every rank's ``send`` (dim 0 split)."""
        return self._run("alltoall", send, recv, stream)

    def reducescatter(self, send: Any, recv: Any = None, op: ReduceOp = ReduceOp.SUM, stream: Any = None) -> Any:
        """Reduce over ranks; each keeps its share of dim 0 (Horovod's uneven rule)."""
        return self._run("reducescatter", send, recv, stream, reducing=True, op=ReduceOp(op))

    def barrier(self) -> None:
        self._rt.submit(Request("barrier", "comm.barrier", []), send=Send.ON_WAIT).wait()
