"""``DistributedOptimizer``: gradients averaged across ranks while backward is still running.

Each trainable parameter gets a post-accumulate-grad hook. Parameters are grouped into buckets
(``gpucomm.dataplane.fusion``: reverse order, one dtype and device each, 1 MiB first, then 25 MiB). When the
last gradient of a bucket arrives, and every earlier bucket has been launched, the bucket's
gradients are packed into its fusion buffer (scaled, and cast for compression, in the same pass)
and its allreduce is submitted — on a communication stream after an event (GPU) or as an async
Gloo call (CPU) — so communication overlaps the rest of backward. ``synchronize()`` (called by
``step()``) launches what is left, waits for the buckets in order and unpacks each buffer into the
gradients, applying the average in the same pass. Every rank launches the same buckets in the same
order, which the parameter check at construction guarantees.

Semantics follow Horovod: a subclass of the wrapped optimizer's class, ``synchronize``,
``skip_synchronize``, ``set_backward_passes_per_step``, the ``zero_grad`` guard and the warning when
``step()`` follows ``synchronize()``. A parameter that produced no gradient on this rank
contributes zeros (and, if it still requires grad, receives the averaged gradient); a parameter
frozen with ``requires_grad_(False)`` contributes zeros and keeps its gradient untouched.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from .. import runtime
from ..dataplane import fusion
from ..dataplane.handles import Handle
from ..kernels.rules import CASTS
from ..dataplane.requests import Request
from ..reduce_op import ReduceOp
from .compression import BF16Compressor, Compression, FP16Compressor, NoneCompressor
from .functions import allgather_object
from ..process_sets import ProcessSet, global_process_set
from .mpi_ops import Adasum, Average, Sum, _set_id

TWICE_ERROR = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
               "Increase backward_passes_per_step to accumulate gradients locally.")
ZERO_GRAD_ERROR = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                   "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
STEP_AFTER_SYNC_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                           "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                           "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                           "your code.")


@dataclass(eq=False)
class _BucketState:
    """A planned bucket and what happened to it this step."""

    plan: fusion.Bucket
    params: list[torch.Tensor]
    wire_dtype: torch.dtype | None  # the fused buffer's dtype; None: a compressor the kernels cannot fuse
    pending: int = 0  # gradients still to arrive before the bucket is complete
    handle: Handle | None = None
    reduced: list[torch.Tensor] = field(default_factory=list)  # the fusion buffer, or the compressed gradients
    contexts: list[Any] = field(default_factory=list)  # the compressor's contexts (unfused buckets)
    in_flight: list[torch.Tensor] = field(default_factory=list)  # gradients read by the launch, kept alive


def _bucket_name(bucket: _BucketState) -> str:
    return f"DistributedOptimizer.bucket.{bucket.plan.index}"


def _wire_dtype(compression: Any, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a bucket of ``dtype`` gradients travels in, or None when the compressor is not one
    the pack kernels can fuse (then gradients are compressed one by one)."""
    if compression in (None, NoneCompressor, Compression.none):
        return dtype
    for builtin in (FP16Compressor, BF16Compressor):
        if compression is builtin or isinstance(compression, builtin):
            wire = builtin.wire_dtype
            if not dtype.is_floating_point or dtype == wire:
                return dtype
            return wire if (dtype, wire) in CASTS else None
    return None


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into a dynamic subclass of the user's optimizer class; see ``DistributedOptimizer``."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set):
        super(self.__class__, self).__init__(params)  # the wrapped class's __init__ with its defaults
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._passes = backward_passes_per_step
        params_in_order = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = _names(named_parameters, params_in_order)
        self._trainable = [p for p in params_in_order if p.requires_grad]
        rt = runtime.current()
        self._process_set = process_set
        self._set_id = _set_id(process_set)
        self._size = rt.group(self._set_id).size
        # Average: 1/f before the sum (packed in), f/size after (unpacked out), Horovod's predivide rule
        self._prescale = 1.0 / float(gradient_predivide_factor) if op == Average else 1.0
        self._postscale = float(gradient_predivide_factor) / self._size if op == Average else 1.0
        self._check_same_parameters_everywhere(rt)
        self._buffers = fusion.FusionBuffers()
        self._buckets = self._plan(groups)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._delay = {p: self._passes for p in self._trainable}
        self._next_launch = 0
        self._fired: set[torch.Tensor] = set()
        self._synchronized = False
        self._should_synchronize = True
        self._local_only = False
        self._hooks = []
        self._lock = threading.Lock()  # hooks of CPU and CUDA parameters run on different autograd threads
        self._backward_span: tuple[float, float] | None = None  # first and last gradient of this step (timeline)
        if self._size > 1:
            for p in self._trainable:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook()))

    # ------------------------------------------------------------------ construction helpers

    def _check_same_parameters_everywhere(self, rt) -> None:
        mine = [(self._parameter_names[p], list(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad)
                for p in (q for g in self.param_groups for q in g["params"])]
        if self._size == 1:
            return
        every = allgather_object(mine, name="DistributedOptimizer.parameters", process_set=self._process_set)
        reference = every[0]
        for rank, theirs in enumerate(every):
            if theirs == reference:
                continue
            for i in range(max(len(theirs), len(reference))):
                a = reference[i] if i < len(reference) else None
                b = theirs[i] if i < len(theirs) else None
                if a != b:
                    raise ValueError(
                        f"DistributedOptimizer: ranks disagree on the parameters to average. Parameter #{i} is "
                        f"{_describe_param(a)} on rank 0 but {_describe_param(b)} on rank {rank} (name, shape, "
                        f"dtype, requires_grad). Every rank must build the same model and pass its parameters in "
                        f"the same order; otherwise ranks would average unrelated tensors or wait for each other "
                        f"forever. Likely causes: rank-dependent model construction, a different model config or "
                        f"checkpoint on some ranks, or parameters frozen on only some ranks.")
            raise AssertionError("unreachable: lists differ but no element differs")

    def _plan(self, groups) -> list[_BucketState]:
        trainable = self._trainable
        if groups is None:
            plans = fusion.plan_buckets(trainable)
        else:
            plans = _explicit_buckets(trainable, groups)
        return [_BucketState(plan, [trainable[i] for i in plan.param_indices],
                             _wire_dtype(self._compression, plan.dtype), len(plan.param_indices))
                for plan in plans]

    # ------------------------------------------------------------------ hooks and launching

    def _make_hook(self):
        def hook(p: torch.Tensor) -> None:
            if self._local_only:
                return
            if p.grad is not None and p.grad.is_sparse and not self._sparse_as_dense:
                raise ValueError(f"parameter {self._parameter_names[p]!r} has a sparse gradient; gpucomm averages "
                                 f"dense gradients only. Pass sparse_as_dense=True to DistributedOptimizer.")
            with self._lock:
                self._delay[p] -= 1
                if self._delay[p] > 0:
                    return
                tracer = runtime.current().tracer
                if tracer is not None:  # the backward pass, as seen from its gradients (timeline)
                    now = tracer.now_us()
                    self._backward_span = (self._backward_span[0] if self._backward_span else now, now)
                if self._delay[p] < 0 or p in self._fired:
                    raise AssertionError(TWICE_ERROR)
                self._fired.add(p)
                bucket = self._bucket_of[p]
                bucket.pending -= 1
                self._synchronized = False
                self._launch_complete_buckets()

        return hook

    def _launch_complete_buckets(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: _BucketState) -> None:
        grads = [self._gradient_to_send(p) for p in bucket.params]
        if bucket.wire_dtype is not None:
            buffer = self._buffers.get(bucket.plan.device, bucket.wire_dtype, bucket.plan.numel, slot=bucket.plan.index)
            tracer = runtime.current().tracer
            start = tracer.now_us() if tracer is not None else 0.0
            with torch.no_grad():
                fusion.pack_bucket(grads, buffer, scale=self._prescale)
            if tracer is not None and buffer.device.type == "cpu":  # GPU copies are timed by CUDA events
                tracer.span(_bucket_name(bucket), "MEMCPY_IN_FUSION_BUFFER", start, tracer.now_us())
            bucket.reduced = [buffer]
        else:  # a user compressor: compress each gradient, reduce them as one grouped call
            for g in grads:
                c, ctx = self._compression.compress(g.mul(self._prescale) if self._prescale != 1.0 else g)
                bucket.reduced.append(c.contiguous())
                bucket.contexts.append(ctx)
        bucket.in_flight = grads
        request = Request("allreduce", _bucket_name(bucket), bucket.reduced,
                          outputs=bucket.reduced, op=ReduceOp.SUM, device=bucket.plan.device, set_id=self._set_id)
        bucket.handle = runtime.current().submit(request, send="now")  # start it while backward goes on

    def _gradient_to_send(self, p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        if g is None or not p.requires_grad:
            return torch.zeros_like(p, memory_format=torch.contiguous_format)
        if g.is_sparse:
            g = g.to_dense()
        return g if g.is_contiguous() else g.contiguous()

    # ------------------------------------------------------------------ Horovod API

    def synchronize(self) -> None:
        """Finish averaging every gradient: launch the buckets not yet launched, wait for all in
        order, and write the averaged gradients into ``p.grad``."""
        if self._size == 1:
            self._synchronized = True
            return
        with self._lock:
            for bucket in self._buckets[self._next_launch:]:
                self._launch(bucket)
            self._next_launch = len(self._buckets)
        try:
            for bucket in self._buckets:
                self._finish(bucket)
        finally:
            self._reset_step()
        self._synchronized = True
        span, self._backward_span = self._backward_span, None
        tracer = runtime.current().tracer
        if tracer is not None and span is not None:
            tracer.span("DistributedOptimizer.backward", "BACKWARD", span[0], span[1])

    def _finish(self, bucket: _BucketState) -> None:
        assert bucket.handle is not None
        bucket.handle.wait()
        targets = []
        for p in bucket.params:
            if not p.requires_grad:
                targets.append(None)  # frozen since construction: leave its gradient alone
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            targets.append(p.grad)
        tracer = runtime.current().tracer
        start = tracer.now_us() if tracer is not None else 0.0
        with torch.no_grad():
            if bucket.wire_dtype is not None:
                dests = [t if t is not None and t.is_contiguous() else torch.empty(p.shape, dtype=p.dtype,
                                                                                    device=p.device)
                         for t, p in zip(targets, bucket.params)]
                fusion.unpack_bucket(bucket.reduced[0], dests, scale=self._postscale)
                for t, d in zip(targets, dests):
                    if t is not None and t is not d:
                        t.copy_(d)
            else:
                for t, r, ctx in zip(targets, bucket.reduced, bucket.contexts):
                    if t is not None:
                        averaged = self._compression.decompress(r, ctx)
                        t.copy_(averaged.mul(self._postscale) if self._postscale != 1.0 else averaged)
        if tracer is not None and bucket.plan.device.type == "cpu":
            tracer.span(_bucket_name(bucket), "MEMCPY_OUT_FUSION_BUFFER", start, tracer.now_us())

    def _reset_step(self) -> None:
        for bucket in self._buckets:
            bucket.pending = len(bucket.params)
            bucket.handle = None
            bucket.reduced, bucket.contexts, bucket.in_flight = [], [], []
        for p in self._delay:
            self._delay[p] = self._passes
        self._fired.clear()
        self._next_launch = 0

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context only accumulate gradients locally (like DDP's
        ``no_sync``); the first backward after it averages the accumulated sum."""
        self._local_only = True
        try:
            yield
        finally:
            self._local_only = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Average every ``passes`` backward passes (gradients accumulate locally in between)."""
        _check_passes(passes)
        self._passes = passes
        for p in self._delay:
            self._delay[p] = passes

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(STEP_AFTER_SYNC_WARNING)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(b.handle is not None for b in self._buckets):
            raise AssertionError(ZERO_GRAD_ERROR)
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        if any(b.handle is not None for b in self._buckets):
            self.synchronize()  # finish what is in flight; the gradients are discarded by the caller's next step
        self._reset_step()
        return super(self.__class__, self).load_state_dict(state_dict)


# ---------------------------------------------------------------------------------------------
# construction


def _describe_param(entry) -> str:
    if entry is None:
        return "missing"
    name, shape, dtype, requires_grad = entry
    return f"{name!r} {shape} {dtype}" + ("" if requires_grad else " (frozen)")


def _check_passes(passes: int) -> None:
    if not isinstance(passes, int) or passes <= 0:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {passes!r}.")


def _names(named_parameters, params_in_order: list[torch.Tensor]) -> dict[torch.Tensor, str]:
    """Map each optimizer parameter to its name, validating ``named_parameters`` as Horovod does."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params_in_order)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                         "model.named_parameters().")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    by_id = {id(p): n for n, p in named}
    unnamed = [p for p in params_in_order if id(p) not in by_id]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         f"Python object ids: {', '.join(str(id(p)) for p in unnamed)}. Pass "
                         f"model.named_parameters() of the model whose parameters the optimizer holds.")
    return {p: by_id[id(p)] for p in params_in_order}


def _explicit_buckets(trainable: list[torch.Tensor], groups) -> list[fusion.Bucket]:
    """Horovod's ``groups``: an int N (N groups of consecutive parameters) or lists of parameters,
    each list one bucket; parameters in no list get buckets of their own. Buckets keep Horovod's
    requirement of one dtype and device each."""
    index = {p: i for i, p in enumerate(trainable)}
    if isinstance(groups, int):
        if groups <= 0:
            raise ValueError(f"groups must be a positive number of groups or a list of parameter lists, got {groups}.")
        n = len(trainable)
        lists = [list(range(n))[k * n // groups:(k + 1) * n // groups] for k in range(groups)]
    else:
        lists, seen = [], set()
        for g in groups:
            ids = []
            for p in g:
                if p not in index:
                    raise ValueError("groups contains a tensor that is not a trainable parameter of this optimizer.")
                if index[p] in seen:
                    raise ValueError("groups lists a parameter twice; each parameter belongs to at most one group.")
                seen.add(index[p])
                ids.append(index[p])
            lists.append(ids)
        lists += [[i] for i in range(len(trainable)) if i not in seen]
    lists = [sorted(ids, reverse=True) for ids in lists if ids]
    lists.sort(key=lambda ids: -ids[0])  # groups holding later parameters are ready first
    plans = []
    for number, ids in enumerate(lists):
        first = trainable[ids[0]]
        if any(trainable[i].dtype != first.dtype or trainable[i].device != first.device for i in ids):
            raise ValueError("each group in groups must hold parameters of one dtype on one device.")
        numels = tuple(trainable[i].numel() for i in ids)
        offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
        plans.append(fusion.Bucket(number, tuple(ids), offsets, numels, sum(numels), first.dtype, first.device))
    return plans


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable | None = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks (Horovod's API).

    The result is an instance of a subclass of ``optimizer``'s class built from its
    ``param_groups`` (``isinstance`` and LR schedulers keep working; the original's state is not
    carried over, as in Horovod)."""
    if op == Adasum:
        raise NotImplementedError("DistributedOptimizer(op=Adasum) is not supported by gpucomm; use op=hvd.Average.")
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer op must be hvd.Average or hvd.Sum, got {op!r}.")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    _check_passes(backward_passes_per_step)
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set)


__all__ = ["DistributedOptimizer"]
