"""What an implementation of the five collectives provides to the driver, and the implementations' names
in the order every table runs them (gpucomm, then its anchors)."""

from __future__ import annotations

import torch

IMPLS = ("gpucomm", "nccl", "torch")


class Impl:
    """One way of calling the collectives: ``run`` returns the tensor that holds this rank's result."""

    name = ""
    label = ""

    def in_place(self, coll: str) -> bool:
        """Whether this implementation has an in-place form of ``coll`` (none has an in-place alltoall)."""
        return coll != "alltoall"

    def unsupported(self, coll: str, dtype: torch.dtype, op: str) -> str | None:
        """Why this implementation cannot run ``coll`` on ``dtype`` with ``op``; None when it can."""
        return None

    def api(self, coll: str) -> str:
        """The call the table's header names for ``coll``."""
        return ""

    def run(self, coll: str, send: torch.Tensor, recv: torch.Tensor, *, op: str, root: int,
            in_place: bool) -> torch.Tensor:
        """One call of ``coll``; in place, ``send`` and ``recv`` are views of one buffer."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the implementation set up (its communicator or process group)."""
