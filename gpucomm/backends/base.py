"""The backend contract: one method per collective, shaped ``(send, recv, *, op, stream)``.

Tensors given to a backend are flat, contiguous and already validated by the op layer. A backend
either completes work on the host (Gloo: returns a ``Work``) or in stream order (NCCL: enqueues on
``stream`` and returns ``None``; the op layer records the completion event).
"""

from __future__ import annotations

import enum
from typing import Callable, Protocol, Sequence

import torch


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch is ``major.minor`` or newer (features its older releases lack)."""
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (major, minor)


class BackendOp(str, enum.Enum):
    """The reduction a backend performs (``ReduceOp`` is the user's; Average and Adasum become these). A str
    enum: hashing it costs no Python call."""

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


class Work(Protocol):
    def done(self) -> bool:
        """True once the operation has finished (successfully or not)."""

    def wait(self, timeout: float, failed: Callable[[], object] | None = None) -> None:
        """Block until finished; raise on failure, after ``timeout`` seconds, or (where the backend
        can tell) as soon as ``failed()`` reports that the job failed elsewhere."""


class Backend(Protocol):
    name: str
    rank: int
    size: int

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> Work | None: ...

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, *, stream: int | None = None) -> Work | None: ...

    def broadcast(self, send: torch.Tensor, recv: torch.Tensor, *, root: int, stream: int | None = None) -> Work | None: ...

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                 *, stream: int | None = None) -> Work | None: ...

    def reducescatter(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> Work | None: ...

    def barrier(self) -> Work | None: ...

    def close(self) -> None: ...
