"""torch.distributed on its own default group (NCCL on CUDA, Gloo on CPU): the anchor, what a user
would write without gpucomm. It has only in-place allreduce and broadcast, so their out-of-place form is
what a user writes: copy, then call."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_group import FLAT_GATHER, FLAT_SCATTER, all_gather_into, gloo_collectives, init_torch_group

from .impl_base import Impl


class TorchImpl(Impl):
    """all_reduce, all_gather_single (or _into_tensor), broadcast, all_to_all_single, reduce_scatter_single."""

    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.label = f"torch.distributed ({self.backend})"
        self._store = init_torch_group(self.backend)
        self._ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
                     "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
        self._gather, self._scatter = FLAT_GATHER, FLAT_SCATTER  # torch's newest names for them
        self._has_scatter = True
        if self.backend == "gloo":  # torch 2.1's Gloo has neither flat collective: it gathers into views of the
            # output, and reduce-scatters not at all
            has = gloo_collectives()
            if not has["allgather"]:
                self._gather = all_gather_into_views
            self._has_scatter = has["reducescatter"]

    def unsupported(self, coll: str, dtype: torch.dtype, op: str) -> str | None:
        if self.backend == "gloo" and op == "avg" and not dtype.is_floating_point:
            return "Gloo's ReduceOp.AVG cannot write an integer result"
        if coll == "reducescatter" and not self._has_scatter:
            return "this torch's Gloo has no reduce-scatter (torch 2.1)"
        return None

    def api(self, coll: str) -> str:
        return {"allreduce": "all_reduce", "allgather": self._gather.__name__, "broadcast": "broadcast",
                "alltoall": "all_to_all_single", "reducescatter": self._scatter.__name__}[coll]

    def run(self, coll: str, send: torch.Tensor, recv: torch.Tensor, *, op: str, root: int,
            in_place: bool) -> torch.Tensor:
        if coll == "allreduce":  # no out-of-place form: copy, then reduce in place
            if not in_place:
                recv.copy_(send)
            dist.all_reduce(recv, op=self._ops[op])
        elif coll == "broadcast":
            if not in_place and dist.get_rank() == root:
                recv.copy_(send)
            dist.broadcast(recv, root)
        elif coll == "allgather":
            self._gather(recv, send)
        elif coll == "reducescatter":
            self._scatter(recv, send, op=self._ops[op])
        elif coll == "alltoall":
            dist.all_to_all_single(recv, send)
        else:
            raise ValueError(f"unknown collective {coll!r}")
        return recv

    def close(self) -> None:
        dist.destroy_process_group()
        self._store = None


def all_gather_into_views(recv: torch.Tensor, send: torch.Tensor) -> None:
    """``all_gather_into_tensor`` as a user of torch 2.1 writes it on Gloo (which has no flat allgather there)."""
    all_gather_into(recv, send, flat=False)
