"""Horovod's collective functions on torch tensors: sync, async (integer handles) and in-place forms.

Names follow Horovod so that ``import gpucomm.torch as hvd`` is the only change a script needs.
Autograd lives in ``autograd.py``; these functions are the non-differentiable building blocks.
The synchronous forms (``_execute``) submit and wait without registering an integer handle: the
request leaves at once and the caller's thread collects the result.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Sequence

import torch

from .. import runtime
from ..control.config import Send
from ..dataplane.requests import Request, check_op, check_tensors, equal_splits, reduce_op_of
from ..process_sets import ProcessSet, check_members, global_process_set
from ..reduce_op import ReduceOp

Average, Sum, Adasum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM, ReduceOp.MIN,
                                           ReduceOp.MAX, ReduceOp.PRODUCT)
_OPS = {int(op): op for op in ReduceOp}

_handles: dict[int, tuple[Any, Callable[[Any], Any]]] = {}
_handles_lock = threading.Lock()
_handle_ids = itertools.count()


def handle_average_backwards_compatibility(op: int | None, average: bool | None) -> ReduceOp:
    """Horovod's rule for the deprecated ``average=`` flag."""
    if average is not None:
        if op is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return Average if average else Sum
    if op is None:
        return Average
    rop = _OPS.get(op) if isinstance(op, int) else None
    return rop if rop is not None else reduce_op_of(op)


def _set_id(process_set: ProcessSet | None) -> int:
    """The registered id of ``process_set``; ``ValueError`` when this rank cannot use it."""
    if process_set is None or process_set is global_process_set:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a hvd.ProcessSet, got {type(process_set).__name__}.")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: pass it to hvd.init(process_sets=[...]) or register it "
                         f"with hvd.add_process_set() on every rank first.")
    if not process_set.included():
        raise ValueError(f"Rank {runtime.current().world.rank} is not a member of the provided process set "
                         f"{process_set.ranks}; only its members may run collectives on it.")
    return process_set.process_set_id


def _set_size(set_id: int) -> int:
    return runtime.current().group(set_id).size


def _request(job: Any, kind: str, tensors: Sequence[torch.Tensor], name: str | None, *, in_place: bool = False,
             reducing: bool = False, process_set: ProcessSet | None = None, **fields: Any) -> Request:
    """Validate the arguments (on the caller's thread, so bad input raises here) and build the request.
    Unnamed requests are numbered per job, so every rank names them alike."""
    check_name(kind, name)
    device = check_tensors(kind, tensors, reducing=reducing)
    if "op" in fields:
        check_op(kind, fields["op"])
    set_id = _set_id(process_set)
    if in_place:
        _mark_written(kind, tensors)
    detached = [t.detach() if t.requires_grad else t for t in tensors]
    return Request(kind, f"{kind}.{name}" if name else job.unnamed_name(kind, set_id), detached,
                   outputs=detached if in_place else None, device=device, set_id=set_id, **fields)


def check_name(kind: str, name: object) -> None:
    """A collective's name must be a string every rank spells alike (it is how ranks find each
    other's requests): not another type, and not an object's default repr, whose address differs
    from process to process."""
    if name is None:
        return
    if not isinstance(name, str):
        raise TypeError(f"{kind}: name must be a str (the same on every rank) or None, got {type(name).__name__} "
                        f"{name!r}. Pass a string such as name='layer3.weight', or leave it out.")
    if " object at 0x" in name:
        raise ValueError(f"{kind}: name {name!r} contains an object's default repr, whose address differs on every "
                         f"rank, so the ranks' requests would never meet. Use a stable string (e.g. the parameter's "
                         f"name).")


def _mark_written(kind: str, tensors: Sequence[torch.Tensor]) -> None:
    """An in-place collective writes its tensors as torch's in-place ops do: a leaf that requires
    grad is refused while grad mode is on (torch's rule and message), and every tensor's version
    counter is bumped, so autograd raises if one was saved for backward."""
    grad_mode = torch.is_grad_enabled()
    for t in tensors:
        if grad_mode and t.requires_grad and t.is_leaf:
            raise RuntimeError(
                f"a leaf Variable that requires grad is being used in an in-place operation. ({kind}_ writes its "
                f"result into the tensor.) Fix: use the out-of-place hvd.{kind}(), or write under torch.no_grad() "
                f"(or into p.data) when changing parameters on purpose, as broadcast_parameters does.")
    with torch.no_grad():
        for t in tensors:
            t.as_strided_(t.size(), t.stride(), t.storage_offset())  # no data touched: bumps _version


def _submit(kind: str, tensors: Sequence[torch.Tensor], name: str | None, convert: Callable[[Any], Any],
            **options: Any) -> int:
    """Validate, submit and register a request; returns Horovod's integer handle."""
    if kind == "allreduce" and options.get("op") is Adasum:
        from .adasum import submit  # noqa: PLC0415 - adasum.py builds on this module
        return submit(tensors, name, convert, **options)
    job = runtime.current()
    handle = job.submit(_request(job, kind, tensors, name, **options), send=Send.CYCLE)
    handle_id = next(_handle_ids)
    with _handles_lock:
        _handles[handle_id] = (handle, convert)
    return handle_id


def _execute(kind: str, tensors: Sequence[torch.Tensor], name: str | None, **options: Any) -> Any:
    """Submit and wait: the synchronous forms."""
    if kind == "allreduce" and options.get("op") is Adasum:
        from .adasum import execute  # noqa: PLC0415 - adasum.py builds on this module
        return execute(tensors, name, **options)
    job = runtime.current()
    return job.submit(_request(job, kind, tensors, name, **options), send=Send.ON_WAIT).wait()


def poll(handle: int) -> bool:
    """True if the operation behind ``handle`` has finished; never blocks."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"poll: unknown handle {handle!r}; it was never issued or was already synchronized.")
    return entry[0].poll()


def synchronize(handle: int) -> Any:
    """Wait for ``handle`` and return its output; raises ``HorovodInternalError`` if it failed."""
    with _handles_lock:
        entry = _handles.pop(handle, None)
    if entry is None:
        raise ValueError(f"synchronize: unknown handle {handle!r}; it was never issued or was already synchronized.")
    h, convert = entry
    return convert(h.wait())


def _first(outs: list) -> torch.Tensor:
    return outs[0]


def _reduction(op: ReduceOp | int | None, average: bool | None, prescale_factor: float, postscale_factor: float,
               process_set: ProcessSet | None) -> dict:
    """The request fields of a reduction (``op`` may already be resolved to a ``ReduceOp``)."""
    resolved = op if op.__class__ is ReduceOp and average is None else handle_average_backwards_compatibility(op, average)
    return {"reducing": True, "op": resolved,
            "prescale": float(prescale_factor), "postscale": float(postscale_factor), "process_set": process_set}


# -- allreduce -------------------------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allreduce into a new tensor; returns a handle for ``synchronize``."""
    return _submit("allreduce", [tensor], name, _first,
                   **_reduction(op, average, prescale_factor, postscale_factor, process_set))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce of ``tensor``."""
    return _submit("allreduce", [tensor], name, _first, in_place=True,
                   **_reduction(op, average, prescale_factor, postscale_factor, process_set))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce; returns ``tensor``."""
    return _execute("allreduce", [tensor], name, in_place=True,
                    **_reduction(op, average, prescale_factor, postscale_factor, process_set))[0]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start one fused allreduce of several tensors into new tensors."""
    return _submit("allreduce", list(tensors), name, list,
                   **_reduction(op, average, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    return _submit("allreduce", list(tensors), name, list, in_place=True,
                   **_reduction(op, average, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return list(_execute("allreduce", list(tensors), name, in_place=True,
                         **_reduction(op, average, prescale_factor, postscale_factor, process_set)))


# -- allgather -------------------------------------------------------------------------------
def _gathered_first(result) -> torch.Tensor:
    return result[0][0]


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather along dim 0 (dim 0 may differ per rank)."""
    return _submit("allgather", [tensor], name, _gathered_first, process_set=process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    return _submit("allgather", list(tensors), name, lambda result: result[0], process_set=process_set)


# -- broadcast -------------------------------------------------------------------------------
def _check_root(root_rank: int, process_set: ProcessSet | None = None) -> int:
    set_id = _set_id(process_set)
    members = runtime.current().group(set_id).ranks
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in members:
        where = (f"a rank of this job (0..{len(members) - 1})" if set_id == 0 else
                 f"a member of the process set {list(members)} (root_rank is a global rank)")
        raise ValueError(f"root_rank={root_rank!r} is not {where}.")
    return root_rank


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start a broadcast of root's ``tensor`` into a new tensor on every rank."""
    return _submit("broadcast", [tensor], name, _first, root=_check_root(root_rank, process_set),
                   process_set=process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place broadcast of root's ``tensor``."""
    return _submit("broadcast", [tensor], name, _first, in_place=True, root=_check_root(root_rank, process_set),
                   process_set=process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return _execute("broadcast", [tensor], name, in_place=True, root=_check_root(root_rank, process_set),
                    process_set=process_set)[0]


# -- alltoall --------------------------------------------------------------------------------
def _normalize_splits(tensor: torch.Tensor, splits, set_id: int) -> list[int] | None:
    if splits is None:
        return None
    size = _set_size(set_id)
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
    set_id = _set_id(process_set)
    norm = _normalize_splits(tensor, splits, set_id)
    if norm is None:
        equal_splits(tensor.shape[0], _set_size(set_id), "alltoall")
    return norm


def _with_int_splits(result) -> tuple:
    return result[0], torch.tensor(result[1], dtype=torch.int32)


def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    return _submit("alltoall", [tensor], name, _with_int_splits, splits=_alltoall_splits(tensor, splits, process_set),
                   process_set=process_set)


def alltoall_now(tensor: torch.Tensor, splits=None, name: str | None = None,
                 process_set: ProcessSet = global_process_set) -> tuple:
    """Synchronous alltoall: ``(output, received_splits)``."""
    return _with_int_splits(_execute("alltoall", [tensor], name, splits=_alltoall_splits(tensor, splits, process_set),
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
    return _submit("reducescatter", [tensor], name, _first,
                   **_reduction(op, None, prescale_factor, postscale_factor, process_set))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    _check_reducescatter(tensors)
    return _submit("reducescatter", list(tensors), name, list,
                   **_reduction(op, None, prescale_factor, postscale_factor, process_set))


# -- control operations: barrier, join, process sets -------------------------------------------
def _control(kind: str, name: str, set_id: int = 0, **fields: Any) -> Any:
    """Run a control operation (no tensors) and return its value."""
    return runtime.current().submit(Request(kind, name, [], set_id=set_id, **fields), send=Send.ON_WAIT).wait()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` has called ``barrier``."""
    _control("barrier", "barrier", _set_id(process_set))


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, take part in the others'
    allreduces with zeros (and in their DistributedOptimizer steps). Returns the rank that joined
    last (the same on every rank).

    ``device``: the GPU index for the zero tensors of CUDA collectives (-1: this rank's GPU)."""
    job = runtime.current()
    if device >= 0:
        job.join_device = device
    # the join leaves for the coordinator before the stand-ins start: a rank still training can only
    # finish a step with this rank's zeros after its join was sent, so "joined last" is that rank
    joined = job.submit(Request("join", "join", [], set_id=0), send=Send.NOW)
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
    job = runtime.current()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if not job.dynamic_sets:
        raise ValueError("add_process_set needs dynamic process sets: call hvd.init(process_sets='dynamic') or set "
                         "GPUCOMM_DYNAMIC_PROCESS_SETS=1 (HOROVOD_DYNAMIC_PROCESS_SETS=1) on every rank; or pass the "
                         "sets to hvd.init(process_sets=[...]).")
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered.")
    check_members(ps.ranks, job.world.size, "add_process_set")
    set_id, ranks = _control("add_process_set", job.next_set_name("add"), ranks=tuple(ps.ranks))
    ps._bind(set_id, ranks, job.world.rank)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank, same order). False if it was not registered."""
    job = runtime.current()
    if not job.dynamic_sets:
        raise ValueError("remove_process_set needs dynamic process sets: call hvd.init(process_sets='dynamic') or "
                         "set GPUCOMM_DYNAMIC_PROCESS_SETS=1 on every rank.")
    if process_set is global_process_set or process_set.process_set_id == 0:
        raise ValueError("the global process set cannot be removed.")
    if process_set.process_set_id is None:
        return False
    _control("remove_process_set", job.next_set_name("remove"), root=process_set.process_set_id)
    process_set._unbind()
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
    job = runtime.current()
    t = tensor.detach().coalesce()
    indices = t.indices().t().contiguous()  # [nnz, sparse_dim]: allgather concatenates along dim 0
    request = _request(job, "allgather", [indices, t.values().contiguous()], None if name is None else f"{name}.sparse",
                       process_set=process_set)
    handle = job.submit(request, send=Send.CYCLE)
    size, shape = _set_size(request.set_id), t.shape

    def wait() -> torch.Tensor:
        (all_indices, all_values), _ = handle.wait()
        out = torch.sparse_coo_tensor(all_indices.t(), all_values, shape, check_invariants=False).coalesce()
        if rop != Average:
            return out
        values = out.values()
        values = values / size if values.is_floating_point() else torch.div(values, size, rounding_mode="trunc")
        return torch.sparse_coo_tensor(out.indices(), values, shape, check_invariants=False, is_coalesced=True)

    return wait
