"""The backend of a one-member group on CPU: every collective's result is this rank's own data, so
it is computed inline on the caller's thread (a copy at most) instead of crossing to Gloo's worker
thread and back. Same contract as ``base.Backend``; every call completes before it returns."""

from __future__ import annotations

from typing import Sequence

import torch

from .base import BackendOp


class SelfBackend:
    """Collectives among one rank (CPU tensors)."""

    name = "self"
    rank = 0
    size = 1

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> None:
        if send.data_ptr() != recv.data_ptr():  # sum, average, min, max or product of one value: the value
            recv.copy_(send)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, *, stream: int | None = None) -> None:
        recv.copy_(send)

    def broadcast(self, send: torch.Tensor, recv: torch.Tensor, *, root: int, stream: int | None = None) -> None:
        if send.data_ptr() != recv.data_ptr():
            recv.copy_(send)

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                 *, stream: int | None = None) -> None:
        recv.copy_(send)

    def reducescatter(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> None:
        recv.copy_(send[: recv.numel()])

    def barrier(self) -> None:
        return None

    def close(self, *, abort: bool = False) -> None:
        return None


__all__ = ["SelfBackend"]
