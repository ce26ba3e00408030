"""Horovod's collective functions on torch tensors: sync, async (integer handles) and in-place forms
(``gpucomm.torch.mpi_ops`` is this module under Horovod's name).

Names follow Horovod so that ``import gpucomm.torch as hvd`` is the only change a script needs.
Autograd lives in ``autograd.py``; these functions are the non-differentiable building blocks,
built on the front's seam (``submission.py``). The synchronous forms (``execute``) submit and wait
without registering an integer handle: the request leaves at once and the caller's thread collects
the result.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from ..process_sets import ProcessSet, check_members, global_process_set
from .submission import (Adasum, Average, Max, Min, Product, Request, Send, Sum, build_request, check_name, check_root,
                         control, current_job, equal_splits,
                         execute, first, handle_average_backwards_compatibility, poll, reduction, set_id, set_size,
                         submit, submit_request, synchronize)

# -- allreduce -------------------------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allreduce into a new tensor; returns a handle for ``synchronize``."""
    return submit("allreduce", [tensor], name, first,
                   **reduction(op, average, prescale_factor, postscale_factor, process_set))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce of ``tensor``."""
    return submit("allreduce", [tensor], name, first, in_place=True,
                   **reduction(op, average, prescale_factor, postscale_factor, process_set))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce; returns ``tensor``."""
    return execute("allreduce", [tensor], name, in_place=True,
                    **reduction(op, average, prescale_factor, postscale_factor, process_set))[0]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start one fused allreduce of several tensors into new tensors."""
    return submit("allreduce", list(tensors), name, list,
                   **reduction(op, average, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    return submit("allreduce", list(tensors), name, list, in_place=True,
                   **reduction(op, average, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return list(execute("allreduce", list(tensors), name, in_place=True,
                         **reduction(op, average, prescale_factor, postscale_factor, process_set)))


# -- allgather -------------------------------------------------------------------------------
def _gathered_first(result) -> torch.Tensor:
    return result[0][0]


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather along dim 0 (dim 0 may differ per rank)."""
    return submit("allgather", [tensor], name, _gathered_first, process_set=process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    return submit("allgather", list(tensors), name, lambda result: result[0], process_set=process_set)


# -- broadcast -------------------------------------------------------------------------------

def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start a broadcast of root's ``tensor`` into a new tensor on every rank."""
    return submit("broadcast", [tensor], name, first, root=check_root(root_rank, process_set),
                   process_set=process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place broadcast of root's ``tensor``."""
    return submit("broadcast", [tensor], name, first, in_place=True, root=check_root(root_rank, process_set),
                   process_set=process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return execute("broadcast", [tensor], name, in_place=True, root=check_root(root_rank, process_set),
                    process_set=process_set)[0]


# -- alltoall --------------------------------------------------------------------------------
def _normalize_splits(tensor: torch.Tensor, splits, sid: int) -> list[int] | None:
    if splits is None:
        return None
    size = set_size(sid)
    values = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    if len(values) != size or any(int(s) != s or s < 0 for s in values):
        raise ValueError(f"alltoall: splits must hold {size} non-negative integers (one per rank), got {values}.")
    rows = tensor.shape[0] if tensor.dim() else 0
    if sum(values) != rows:
        raise ValueError(f"alltoall: splits sum to {sum(values)} but the tensor's dim 0 is {rows}.")
    return [int(s) for s in values]


def _alltoall_splits(tensor: torch.Tensor, splits, process_set: ProcessSet | None) -> list[int] | None:
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension.")
    sid = set_id(process_set)
    norm = _normalize_splits(tensor, splits, sid)
    if norm is None:
        equal_splits(tensor.shape[0], set_size(sid), "alltoall")
    return norm


def _with_int_splits(result) -> tuple:
    return result[0], torch.tensor(result[1], dtype=torch.int32)


def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    return submit("alltoall", [tensor], name, _with_int_splits, splits=_alltoall_splits(tensor, splits, process_set),
                   process_set=process_set)


def alltoall_now(tensor: torch.Tensor, splits=None, name: str | None = None,
                 process_set: ProcessSet = global_process_set) -> tuple:
    """Synchronous alltoall: ``(output, received_splits)``."""
    return _with_int_splits(execute("alltoall", [tensor], name, splits=_alltoall_splits(tensor, splits, process_set),
                                     process_set=process_set))


# -- reducescatter ---------------------------------------------------------------------------
def _check_reducescatter(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("reducescatter needs tensors of at least one dimension (it splits dim 0).")


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start a reduce-scatter: reduce across ranks, each keeps its share of dim 0 (Horovod's split)."""
    _check_reducescatter([tensor])
    return submit("reducescatter", [tensor], name, first,
                   **reduction(op, None, prescale_factor, postscale_factor, process_set))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    _check_reducescatter(tensors)
    return submit("reducescatter", list(tensors), name, list,
                   **reduction(op, None, prescale_factor, postscale_factor, process_set))


# -- control operations: barrier, join, process sets -------------------------------------------

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` has called ``barrier``."""
    control("barrier", "barrier", set_id(process_set))


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, take part in the others'
    allreduces with zeros (and in their DistributedOptimizer steps). Returns the rank that joined
    last (the same on every rank).

    ``device``: the GPU index for the zero tensors of CUDA collectives (-1: this rank's GPU)."""
    job = current_job()
    if device >= 0:
        if torch.cuda.is_available():  # the stand-ins' zeros meet the job's NCCL communicators there
            job.check_gpu(torch.device("cuda", device), lambda: f"hvd.join(device={device})")
        job.join_device = device
    else:  # the stand-ins make their zeros on gpucomm's threads: the rank's GPU is known before they start
        job.adopt_caller_gpu()
    # the join leaves for the coordinator before the stand-ins start: a rank still training can only
    # finish a step with this rank's zeros after its join was sent, so "joined last" is that rank
    joined = submit_request(job, Request("join", "join", [], set_id=0), Send.NOW)
    stand_ins = [_StandIn(party, job.select_device) for party in job.join_parties()]
    try:
        last = joined.wait()  # a failure here also ends the stand-ins' collectives
    finally:
        job.join_device = -1
    errors = [e for e in (s.finish(job.timeout) for s in stand_ins) if e is not None]
    if errors:
        raise errors[0]
    return last


class _StandIn:
    """Runs ``party.stand_in_until_all_joined()`` (an optimizer's fixed schedule, with zeros) on a
    thread of its own while ``join`` waits for the other ranks; ``select_device()`` makes this
    rank's GPU current on that thread first."""

    def __init__(self, party: Any, select_device: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(party, select_device), name="gpucomm-join-stand-in",
                                        daemon=True)
        self._thread.start()

    def _run(self, party: Any, select_device: Callable[[], None]) -> None:
        try:
            select_device()
            party.stand_in_until_all_joined()
        except BaseException as e:  # noqa: BLE001 - raised from join()
            self.error = e

    def finish(self, timeout: float) -> BaseException | None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            return RuntimeError(f"join(): a DistributedOptimizer kept standing in for more than {timeout:.0f} s "
                                f"after every rank joined; this is a gpucomm bug, please report it.")
        return self.error


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set; every rank must call this, in the same order, with the same ranks.
    Needs ``hvd.init(process_sets="dynamic")`` (or GPUCOMM_DYNAMIC_PROCESS_SETS=1)."""
    job = current_job()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if not job.dynamic_sets:
        raise ValueError("add_process_set needs dynamic process sets: call hvd.init(process_sets='dynamic') or set "
                         "GPUCOMM_DYNAMIC_PROCESS_SETS=1 (HOROVOD_DYNAMIC_PROCESS_SETS=1) on every rank; or pass the "
                         "sets to hvd.init(process_sets=[...]).")
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered.")
    check_members(ps.ranks, job.world.size, "add_process_set")
    set_id, ranks = control("add_process_set", job.next_set_name("add"), ranks=tuple(ps.ranks))
    ps.register(set_id, ranks, job.world.rank)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank, same order). False if it was not registered."""
    job = current_job()
    if not job.dynamic_sets:
        raise ValueError("remove_process_set needs dynamic process sets: call hvd.init(process_sets='dynamic') or "
                         "set GPUCOMM_DYNAMIC_PROCESS_SETS=1 on every rank.")
    if process_set is global_process_set or process_set.process_set_id == 0:
        raise ValueError("the global process set cannot be removed.")
    if process_set.process_set_id is None:
        return False
    control("remove_process_set", job.next_set_name("remove"), root=process_set.process_set_id)
    process_set.unregister()
    job.release_removed_sets()  # every rank, after the agreement: its communicators are released here
    return True


# -- sparse allreduce ------------------------------------------------------------------------
def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: int,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor (e.g. the gradient of ``nn.Embedding(sparse=True)``) as
    Horovod does: every rank's coalesced indices and values are allgathered, both in one request.
    Returns a callable (Horovod's contract) that waits and returns the reduced sparse tensor,
    coalesced (entries at the same index summed); ``Average`` then divides the values by the
    process set's size (integers truncate, as a dense Average does). Only Average and Sum."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        what = f"a {tensor.layout} tensor" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"sparse_allreduce_async expects a sparse COO tensor, got {what}; reduce dense tensors with "
                        f"hvd.allreduce_async, or convert with tensor.to_sparse().")
    rop = handle_average_backwards_compatibility(op, None)
    if rop not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async reduces with op=hvd.Average or hvd.Sum only, got "
                         f"hvd.{rop.name.title()}: it gathers every rank's entries and sums those at the same index. "
                         f"For another op, densify and use hvd.allreduce(tensor.to_dense(), op=...).")
    check_name("sparse_allreduce_async", name)
    job = current_job()
    t = tensor.detach().coalesce()
    indices = t.indices().t().contiguous()  # [nnz, sparse_dim]: allgather concatenates along dim 0
    request = build_request(job, "allgather", [indices, t.values().contiguous()],
                            None if name is None else f"{name}.sparse", process_set=process_set)
    handle = submit_request(job, request, Send.CYCLE)
    size, shape = set_size(request.set_id), t.shape

    def wait() -> torch.Tensor:
        (all_indices, all_values), _ = handle.wait()
        out = torch.sparse_coo_tensor(all_indices.t(), all_values, shape, check_invariants=False).coalesce()
        if rop != Average:
            return out
        values = out.values()
        values = values / size if values.is_floating_point() else torch.div(values, size, rounding_mode="trunc")
        return torch.sparse_coo_tensor(out.indices(), values, shape, check_invariants=False, is_coalesced=True)

    return wait


__all__ = ["Adasum", "Average", "Max", "Min", "Product", "Sum", "add_process_set", "allgather_async", "allreduce_",
           "allreduce_async", "allreduce_async_", "alltoall_async", "alltoall_now", "barrier", "broadcast_",
           "broadcast_async", "broadcast_async_", "grouped_allgather_async", "grouped_allreduce_",
           "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter_async",
           "handle_average_backwards_compatibility", "join", "poll", "reducescatter_async", "remove_process_set",
           "sparse_allreduce_async", "synchronize"]
