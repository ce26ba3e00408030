"""Adasum (``op=hvd.Adasum``): Horovod's adaptive summation, for allreduce and DistributedOptimizer.

Two ranks' tensors ``a`` and ``b`` combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a side whose squared norm is below sqrt(DBL_MIN) keeps coefficient 1), which is the sum for
orthogonal inputs and the average for parallel ones. Ranks combine in a binary tree: (0,1), (2,3),
... first, then neighbouring results, so the job size must be a power of two. Each tensor of a
fused group gets its own dot products. All of this is Horovod's (``horovod/common/ops/adasum``).

How gpucomm runs it (design note): one allgather of the group, then every rank computes the same
tree locally in float64 and casts back. Every rank holds every rank's tensors for a moment (memory
and traffic grow with the job size, unlike Horovod's vector-halving exchange), but the result is
identical on all ranks, on CPU and GPU alike, with no new communication pattern to get right.
Horovod's GPU build averages within a node with NCCL and runs Adasum only between nodes; gpucomm
runs the flat Adasum over all ranks everywhere.

``DistributedOptimizer(op=Adasum)`` is Horovod's delta optimizer: each rank runs the wrapped
optimizer on its own gradients, and the weights then move by the Adasum of the ranks' deltas.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch

from ..process_sets import ProcessSet, global_process_set
from . import submission
from .submission import Send, check_tensors, current_job
from .functions import allgather_object
from .parameters import (TWICE_ERROR, ZERO_GRAD_ERROR, check_passes, check_same_parameters, parameter_names,
                         shared_steps)

ADASUM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TINY = sys.float_info.min ** 0.5  # Horovod's threshold below which a squared norm counts as zero
SKIP_SYNC_ERROR = "Skipping synchronization is not supported when using Adasum optimizer."
NON_GLOBAL_ERROR = "Adasum does not support non-global process sets yet."


# ---------------------------------------------------------------------------------------------
# the math


def adasum_rows(rows: torch.Tensor) -> torch.Tensor:
    """Horovod's Adasum of the rows of ``rows`` (one per rank, in rank order, a power of two of
    them), in float64: level 1 combines rows (0,1), (2,3), ...; each next level combines
    neighbouring results, the lower ranks' as ``a``."""
    x = rows.to(torch.float64)
    while x.shape[0] > 1:
        a, b = x[0::2], x[1::2]
        dot, aa, bb = ((u * v).sum(dim=1, keepdim=True) for u, v in ((a, b), (a, a), (b, b)))
        x = _coefficient(dot, aa) * a + _coefficient(dot, bb) * b
    return x[0]


def _coefficient(dot: torch.Tensor, norm_sq: torch.Tensor) -> torch.Tensor:
    return torch.where(norm_sq >= TINY, 1.0 - dot / (2.0 * norm_sq.clamp_min(TINY)), 1.0)


# ---------------------------------------------------------------------------------------------
# the collective


def check_adasum(tensors: Sequence[torch.Tensor], process_set: ProcessSet | None) -> None:
    """Horovod's conditions for Adasum, in its order: the global process set, a power-of-two job;
    and floating-point tensors."""
    if process_set is not None and process_set != global_process_set:
        raise NotImplementedError(NON_GLOBAL_ERROR)
    size = current_job().world.size
    if size & (size - 1):
        raise NotImplementedError(
            f"Running Adasum with non-power of 2 ranks is not supported yet. This job has {size} ranks; Adasum "
            f"combines ranks pairwise in a binary tree, as Horovod does. Run on 1, 2, 4, 8, ... ranks, or use "
            f"op=hvd.Average.")
    for t in tensors:
        if t.dtype not in ADASUM_DTYPES:
            raise ValueError(f"Adasum reduces floating-point tensors only (float16, bfloat16, float32, float64), got "
                             f"{str(t.dtype).replace('torch.', '')}; use op=hvd.Sum or hvd.Average for integers, or "
                             f"convert with .float().")


def _as_allgather(tensors: Sequence[torch.Tensor], name: str | None, in_place: bool, prescale: float,
                  postscale: float, process_set: ProcessSet | None) -> tuple[list, str | None, Callable[[Any], list]]:
    """Validate an Adasum allreduce and turn it into an allgather of one row per tensor, plus the
    step that reduces the gathered rows into the results (written into ``tensors`` when in place)."""
    submission.check_name("allreduce", name)
    tensors = list(tensors)
    check_tensors("allreduce", tensors, reducing=True)
    check_adasum(tensors, process_set)
    if in_place:
        submission.mark_written("allreduce", tensors)
    rows = [t.detach().unsqueeze(0) for t in tensors]  # one row per rank; a shape mismatch names the user's shapes
    size = current_job().world.size

    def finish(gathered: Any) -> list:
        outs = []
        for t, g in zip(tensors, gathered[0]):
            stacked = g.reshape(size, t.numel()).to(torch.float64)
            if prescale != 1.0:
                stacked.mul_(prescale)
            result = adasum_rows(stacked)
            if postscale != 1.0:
                result.mul_(postscale)
            result = result.view(t.shape).to(t.dtype)
            if in_place:
                t.detach().copy_(result)
                result = t
            outs.append(result)
        return outs

    return rows, (f"adasum.{name}" if name else None), finish


def start(tensors: Sequence[torch.Tensor], name: str | None, convert: Callable[[list], Any] | None, send: Send, *,
          in_place: bool = False, prescale: float = 1.0, postscale: float = 1.0,
          process_set: ProcessSet | None = None, **_: Any) -> tuple[Any, Callable[[Any], Any]]:
    """Start an Adasum allreduce (``submission``'s one dispatch calls this for ``op=hvd.Adasum``):
    the allgather's handle, and what turns its result into the reduced tensors (``tensors``
    themselves when in place), then ``convert``'s form (None: as they are)."""
    rows, gather_name, finish = _as_allgather(tensors, name, in_place, prescale, postscale, process_set)
    job = current_job()
    handle = submission.submit_request(job, submission.build_request(job, "allgather", rows, gather_name), send)
    if convert is None:
        return handle, finish
    return handle, lambda gathered: convert(finish(gathered))


def allreduce(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The Adasum of ``tensors`` over the job (the delta optimizer's one request per step)."""
    return submission.execute("allreduce", list(tensors), None,
                              **submission.reduction(submission.Adasum, None, 1.0, 1.0, None))


submission.register_adasum(start)


# ---------------------------------------------------------------------------------------------
# the delta optimizer


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Mixed into a dynamic subclass of the user's optimizer class; see ``adasum_optimizer``.

    Hooks only count backward passes (for Horovod's guards); ``step()`` does the work: keep the
    weights, run the wrapped optimizer's step on this rank's gradients, Adasum-reduce the deltas of
    every parameter in one fused request, and set weights = kept + reduced delta."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step):
        super(self.__class__, self).__init__(params)  # the wrapped class's __init__ with its defaults
        self._compression = compression
        self._passes = backward_passes_per_step
        self._params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = parameter_names(named_parameters, self._params)
        self._lock = threading.Lock()  # hooks of CPU and CUDA parameters run on different autograd threads
        self._fired: set[torch.Tensor] = set()
        self._delay = {p: self._passes for p in self._params if p.requires_grad}
        mine = [(self._parameter_names[p], list(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad)
                for p in self._params]
        every = allgather_object(mine, name="DistributedAdasumOptimizer.params")
        for rank, theirs in enumerate(every):
            check_same_parameters(every[0], theirs, rank)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in self._delay]

    def add_param_group(self, param_group: dict) -> None:
        if "_hooks" in self.__dict__:  # torch's __init__ adds the first groups before ours runs
            raise ValueError(
                "DistributedOptimizer(op=hvd.Adasum): adding a parameter group after it was built is not supported: "
                "the new parameters' updates would not be reduced, and the replicas would drift apart. Build the "
                "optimizer with every group; a layer to train later can be in it from the start with "
                "requires_grad=False.")
        super(self.__class__, self).add_param_group(param_group)

    def _hook(self, p: torch.Tensor) -> None:
        with self._lock:
            if self._delay[p] <= 0:
                raise AssertionError(TWICE_ERROR)
            self._delay[p] -= 1
            self._fired.add(p)

    def synchronize(self) -> None:
        """Nothing to wait for: the deltas are reduced inside ``step()`` (as in Horovod)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError(SKIP_SYNC_ERROR)
        yield  # never reached; the yield makes this a context manager, so the error comes at ``with``

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params  # all of them: whatever the local step moved must move alike everywhere
        with torch.no_grad():
            start = [p.detach().clone() for p in params]
            super(self.__class__, self).step()
            pairs = [self._compression.compress(p.detach() - s) for p, s in zip(params, start)]
            reduced = allreduce([c for c, _ in pairs]) if params else []
            for p, s, r, (_, ctx) in zip(params, start, reduced, pairs):
                p.copy_(s.add_(self._compression.decompress(r, ctx)))
        with self._lock:
            self._fired.clear()
            for p in self._delay:
                self._delay[p] = self._passes
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._fired:
            raise AssertionError(ZERO_GRAD_ERROR)
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def adasum_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Any, compression: Any,
                     backward_passes_per_step: int, gradient_predivide_factor: float, num_groups: int, groups: Any,
                     sparse_as_dense: bool, process_set: ProcessSet) -> torch.optim.Optimizer:
    """``DistributedOptimizer(..., op=Adasum)`` on more than one rank: Horovod's delta optimizer
    (``DistributedOptimizer`` itself takes a one-rank job, where the reduction changes nothing)."""
    if gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    check_passes(backward_passes_per_step)
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
    check_adasum([], process_set)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {**_DistributedAdasumOptimizer.__dict__, "set_backward_passes_per_step":
                shared_steps()["set_backward_passes_per_step"]})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step)


__all__ = ["ADASUM_DTYPES", "adasum_optimizer", "adasum_rows", "allreduce", "check_adasum", "start"]
