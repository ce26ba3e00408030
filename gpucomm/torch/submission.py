"""The torch front's one seam into the job: request building, submission (asynchronous with
Horovod's integer handles, or synchronous), the handle table, process-set ids, and the checks every
collective shares. ``collectives.py`` (Horovod's functions), ``autograd.py``, ``functions.py``,
``sync_batch_norm.py``, the optimizer and Adasum all go through it; nothing of the front reaches
the job, the control plane or the data plane another way (the bucket classes ZeRO and PowerSGD
extend excepted). An Adasum allreduce starts in one place, ``_start_adasum``.

The names below the functions are what the front uses of the layers under it, named once here:
the job's lifecycle (``current_job`` ...), the request checks, and the reducer the optimizer
builds (``GradientBuckets`` and its planning), which lives in the data plane.

A synchronous collective (``execute``) keeps a validated plan per call shape (kind, dtypes,
shapes, op, scaling, process set, in place or not): a repeated call skips the argument checks
and request defaults and only fills in the tensors; in a one-rank job it then runs where its data
lies (``dataplane.local``: a copy, or nothing in place), with no NCCL at all.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Sequence

import torch

from .. import job as jobs
from ..control.config import Send
from ..dataplane import fusion
from ..dataplane.bucket_kinds import standard_bucket, standard_buckets, sub_plan
from ..dataplane.bucket_settings import BucketSettings, fused_wire, keep_views_wanted, views_wanted
from ..dataplane.finite import AUTO_BUDGET, FiniteSlots, exact_limit
from ..dataplane.grad_layout import gradient_targets, gradient_to_send, layout_of, send_view, view_in_order
from ..dataplane.reducer import GradientBuckets, MakeBuckets
from ..dataplane.requests import (Request, check_op, check_tensor_arg, check_tensor_list, check_tensors, equal_splits,
                                  reduce_op_of)
from ..process_sets import ProcessSet, global_process_set
from ..reduce_op import ReduceOp

# the job's lifecycle, as the front calls it
current_job, active_job, job_initialized = jobs.current, jobs.active, jobs.is_initialized
init_job, shutdown_job = jobs.init, jobs.shutdown
# the reducer's planning (``dataplane.fusion``)
PlannedBucket, plan_buckets, plan_by_readiness, plan_groups = (fusion.Bucket, fusion.plan_buckets,
                                                               fusion.plan_by_readiness, fusion.plan_groups)

Average, Sum, Adasum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM, ReduceOp.MIN,
                                           ReduceOp.MAX, ReduceOp.PRODUCT)
_OPS = {int(op): op for op in ReduceOp}

_handles: dict[int, tuple[Any, Callable[[Any], Any]]] = {}
_handles_lock = threading.Lock()
_handle_ids = itertools.count()


def clear_handles() -> None:
    """Forget every outstanding handle, as if the process had just started (a process reused as a
    fresh rank: the test harness's pooled workers)."""
    with _handles_lock:
        _handles.clear()


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


def set_id(process_set: ProcessSet | None) -> int:
    """The registered id of ``process_set``; ``ValueError`` when this rank cannot use it."""
    if process_set is None or process_set is global_process_set:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a hvd.ProcessSet, got {type(process_set).__name__}.")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: pass it to hvd.init(process_sets=[...]) or register it "
                         f"with hvd.add_process_set() on every rank first.")
    if not process_set.included():
        raise ValueError(f"Rank {jobs.current().world.rank} is not a member of the provided process set "
                         f"{process_set.ranks}; only its members may run collectives on it.")
    return process_set.process_set_id


def set_size(sid: int) -> int:
    """The number of ranks in registered process set ``sid``."""
    return jobs.current().group(sid).size


def build_request(job: Any, kind: str, tensors: Sequence[torch.Tensor], name: str | None, *, in_place: bool = False,
                  reducing: bool = False, process_set: ProcessSet | None = None, **fields: Any) -> Request:
    """Validate the arguments (on the caller's thread, so bad input raises here) and build the request.
    Unnamed requests are numbered per job, so every rank names them alike. A call shaped like an
    earlier one (kind, dtypes, shapes, devices, layouts, op and scaling, on the global set) reuses
    that call's validation (``_validated``)."""
    if name is not None:
        check_name(kind, name)
    cacheable = (process_set is None or process_set is global_process_set) and "splits" not in fields
    key = device = None
    if cacheable:
        try:
            key = (kind, reducing, *fields.values(), *[(t.dtype, t.shape, t.device, t.layout, t.is_contiguous())
                                                        for t in tensors])
            device = _validated.get(key)
        except (AttributeError, TypeError):  # not tensors, or an unhashable field: the full check says what
            key = None
    if device is None:
        device = check_tensors(kind, tensors, reducing=reducing)
        if "op" in fields:
            check_op(kind, fields["op"])
        if key is not None:
            if len(_validated) >= _VALIDATED_KEPT:
                _validated.clear()
            _validated[key] = device
    sid = 0 if cacheable else set_id(process_set)
    if in_place:
        mark_written(kind, tensors)
    detached = [t.detach() if t.requires_grad else t for t in tensors]
    return Request(kind, f"{kind}.{name}" if name else job.unnamed_name(kind, sid), detached,
                   outputs=detached if in_place else None, device=device, set_id=sid, **fields)


_validated: dict[tuple, torch.device] = {}  # a validated call shape -> its device
_VALIDATED_KEPT = 1024  # call shapes kept; beyond that the table starts again


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


def mark_written(kind: str, tensors: Sequence[torch.Tensor]) -> None:
    """An in-place collective writes its tensors as torch's in-place ops do: a leaf that requires
    grad is refused while grad mode is on (torch's rule and message), and every tensor's version
    counter is bumped, so autograd raises if one was saved for backward."""
    grad_mode = torch.is_grad_enabled()
    tracked = False
    for t in tensors:
        if t.requires_grad:
            tracked = True
            if grad_mode and t.is_leaf:
                raise RuntimeError(
                    f"a leaf Variable that requires grad is being used in an in-place operation. ({kind}_ writes "
                    f"its result into the tensor.) Fix: use the out-of-place hvd.{kind}(), or write under "
                    f"torch.no_grad() (or into p.data) when changing parameters on purpose, as broadcast_parameters "
                    f"does. (Horovod wrote into such a tensor without this check, out of autograd's sight.)")
    if not tracked:  # no autograd in the way: the common case, without a grad-mode context
        for t in tensors:
            t.as_strided_(t.size(), t.stride(), t.storage_offset())  # no data touched: bumps _version
        return
    with torch.no_grad():
        for t in tensors:
            t.as_strided_(t.size(), t.stride(), t.storage_offset())


def submit(kind: str, tensors: Sequence[torch.Tensor], name: str | None, convert: Callable[[Any], Any],
            **options: Any) -> int:
    """Validate, submit and register a request; returns Horovod's integer handle (``synchronize``
    gives ``convert(result)``)."""
    if kind == "allreduce" and options.get("op") is ReduceOp.ADASUM:
        handle, convert = _start_adasum(tensors, name, convert, Send.CYCLE, options)
    else:
        job = jobs.current()
        handle = submit_request(job, build_request(job, kind, tensors, name, **options), Send.CYCLE)
    handle_id = next(_handle_ids)
    with _handles_lock:
        _handles[handle_id] = (handle, convert)
    return handle_id


def execute(kind: str, tensors: Sequence[torch.Tensor], name: str | None, **options: Any) -> Any:
    """Submit and wait: the synchronous forms."""
    if kind == "allreduce" and options.get("op") is ReduceOp.ADASUM:
        handle, convert = _start_adasum(tensors, name, None, Send.ON_WAIT, options)
        result = handle.wait()
        return result if convert is None else convert(result)
    job = jobs.current()
    return job.execute(build_request(job, kind, tensors, name, **options))


def submit_request(job: Any, request: Request, send: Send) -> Any:
    """Submit a built ``request`` to ``job``; its handle. The front's one call into the job's
    submission (``submit``/``execute`` here, and the requests built elsewhere: ``join``, the sparse
    allreduce, Adasum's allgather)."""
    return job.submit(request, send=send)


def register_adasum(start: Callable[..., tuple[Any, Callable[[Any], Any] | None]]) -> None:
    """``start(tensors, name, convert, send, **options) -> (handle, convert)``: how an Adasum
    allreduce is started (``adasum.py`` registers it when imported, which ``gpucomm.torch`` does)."""
    _adasum.append(start)


def _start_adasum(tensors: Sequence[torch.Tensor], name: str | None, convert: Callable[[Any], Any] | None,
                  send: Send, options: dict) -> tuple[Any, Callable[[Any], Any] | None]:
    """The one place an Adasum allreduce starts (``adasum.py`` registers how: ``gpucomm.torch``
    imports it, so it is registered before any collective can run); ``convert`` None: the result as
    it comes."""
    if not _adasum:
        raise RuntimeError("internal error: no Adasum allreduce is registered (gpucomm.torch imports "
                           "gpucomm.torch.adasum, which registers it); please report this as a gpucomm bug.")
    return _adasum[0](tensors, name, convert, send, **options)


_adasum: list[Callable[..., tuple[Any, Callable[[Any], Any]]]] = []


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


def first(outs: list) -> torch.Tensor:
    """The one output of a single-tensor collective."""
    return outs[0]


def reduction(op: ReduceOp | int | None, average: bool | None, prescale_factor: float, postscale_factor: float,
               process_set: ProcessSet | None) -> dict:
    """The request fields of a reduction (``op`` may already be resolved to a ``ReduceOp``)."""
    if average is None and (op is None or op.__class__ is ReduceOp):
        resolved = Average if op is None else op
    else:
        resolved = handle_average_backwards_compatibility(op, average)
    return {"reducing": True, "op": resolved,
            "prescale": float(prescale_factor), "postscale": float(postscale_factor), "process_set": process_set}


def check_root(root_rank: int, process_set: ProcessSet | None = None) -> int:
    """``root_rank`` if it is a (global) rank of ``process_set``; ValueError naming the valid ones."""
    sid = set_id(process_set)
    members = jobs.current().group(sid).ranks
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in members:
        where = (f"a rank of this job (0..{len(members) - 1})" if sid == 0 else
                 f"a member of the process set {list(members)} (root_rank is a global rank)")
        raise ValueError(f"root_rank={root_rank!r} is not {where}.")
    return root_rank


def control(kind: str, name: str, sid: int = 0, **fields: Any) -> Any:
    """Run a control operation (no tensors) on process set ``sid`` and return its value."""
    return submit_request(jobs.current(), Request(kind, name, [], set_id=sid, **fields), Send.ON_WAIT).wait()


__all__ = ["Adasum", "Average", "Max", "Min", "Product", "Sum", "build_request", "check_name", "check_root", "control",
           "execute", "first", "handle_average_backwards_compatibility", "mark_written", "poll", "reduction",
           "register_adasum", "set_id", "set_size", "submit", "synchronize"]
