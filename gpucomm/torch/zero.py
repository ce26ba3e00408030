"""ZeRO stage 1 on DistributedOptimizer's fixed schedule (``hvd.ZeroRedundancyOptimizer``).

Each rank keeps the optimizer state of 1/N of the parameters only (Rajbhandari et al., SC 2020,
stage 1; torch's ``ZeroRedundancyOptimizer`` does the same over DDP). A training step:

1. backward: when a bucket is complete (its gradients' hooks fired), its gradients are copied,
   averaged, into its fusion buffer and the bucket is *reduce-scattered* on the optimizer's schedule
   (overlapping backward, as the allreduce of ``DistributedOptimizer`` does): every rank receives
   the averaged gradients of its own part of the bucket only;
2. ``step()``: the wrapped optimizer class steps this rank's part of the parameters (its *shard*),
   and each bucket's updated part is *allgathered* into every rank's parameters, on the same
   schedule. With ``overlap_with_forward=model``, the allgathers are left in flight and each module's
   forward (or the model's ``state_dict()``) waits only for the buckets that hold its parameters
   (launched first-layer first), so they overlap the next forward; code that reads the parameters
   elsewhere first calls ``wait_parameters()``. Without it, ``step()`` waits for them.

Partitioning is flat, per bucket: a bucket of ``n`` elements is cut into N equal parts of
``ceil(n / N)`` elements (the last padded), rank ``r`` owning part ``r``; a parameter may straddle two
ranks. Each rank's part is one buffer of parameter values; the wrapped class steps *segments* of it
(one per run of parameters of one param group, views of the buffer), so the optimizer must be
elementwise (SGD, Adam, AdamW, RMSprop, ...: ``ELEMENTWISE``); an optimizer that mixes elements
(LBFGS, Adafactor, LAMB's per-tensor norms) is refused unless ``elementwise=True`` says it is
elementwise. The parameters stay the source of truth: the shard buffer is refreshed from them
before every step, so ``broadcast_parameters`` or a model's ``load_state_dict`` between steps act
as with any optimizer.

The state dict is the wrapped class's own format over all parameters (``torch.optim`` indices and
shapes), gathered from every rank's segments, so it loads into a ``ZeroRedundancyOptimizer`` of any
world size or into the plain optimizer class, and vice versa. ``state_dict()`` gathers it on every
rank (a collective); ``consolidate_state_dict(to=r)`` gathers it for rank ``r`` only, whose next
``state_dict()`` (before the next step) returns it, as torch's does. ``load_state_dict(full)`` keeps
the full state and hands each rank its part at the next step (after a re-formed elastic job has
cut its new shards).

Where each part lives: ``zero_settings`` (the optimizers it accepts), ``zero_geometry`` (a bucket's
partition), ``zero_bucket`` (the reduce-scattered bucket), ``zero_state`` (the shards' state and the
full state dict), ``zero_overlap`` (the parameter allgathers and the forward hooks), ``zero_steps``
(the optimizer's methods over ``DistributedOptimizer``'s). This module builds the optimizer.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..process_sets import ProcessSet, global_process_set
from .compression import Compression
from .distributed_steps import distributed_steps
from .outside_process_set import outside_steps
from .parameters import check_passes, shared_steps
from .submission import Average, Sum
from .zero_settings import ZeroSettings, check_closure_free, check_elementwise
from .zero_steps import sharded_steps

# ZeRO's public names, importable from here as before the modules above were split out of this one
from .zero_bucket import ShardedBucket
from .zero_geometry import BucketShard, Piece, Segment
from .zero_settings import ELEMENTWISE
from .zero_state import Shards, per_element, travel_order
from .zero_steps import ShardedSteps, plain_option


def ZeroRedundancyOptimizer(params: Any, optimizer_class: type | None = None, *,
                            named_parameters: Iterable | None = None,
                            overlap_with_forward: torch.nn.Module | None = None,
                            backward_passes_per_step: int = 1, op: int = Average,
                            gradient_predivide_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                            check_finite: bool | str | None = None, elementwise: bool | None = None,
                            **defaults: Any) -> torch.optim.Optimizer:
    """ZeRO stage 1: ``optimizer_class`` built on ``params`` with ``defaults`` (``lr=...``), its state
    sharded across the ranks (each keeps 1/N), gradients reduce-scattered in buckets while backward
    runs and the updated parameters allgathered after ``step()`` (``zero.py``). Torch's argument
    order ``(params, optimizer_class, **defaults)``; ``(optimizer_class, params, ...)`` works too.

    Why a class of its own rather than a ``DistributedOptimizer`` option: its contract differs where
    users look (``state_dict()`` is a collective that gathers every rank's shard, with torch's
    ``consolidate_state_dict(to=0)``; ``load_state_dict`` takes a full state and re-shards it;
    ``synchronize()`` leaves the averaged gradients in the optimizer's shards, not in ``p.grad``),
    and torch users know it by this name. The hooks, buckets, schedule, accumulation
    (``backward_passes_per_step``), ``hvd.join`` and ``check_finite`` are DistributedOptimizer's.
    ``overlap_with_forward=model``: the parameter allgathers are left in flight after ``step()`` and
    each layer's forward (or ``model.state_dict()``) waits for its own, so they overlap the next
    forward; read parameters elsewhere only after ``opt.wait_parameters()``. Without it, ``step()``
    waits for them. ``elementwise``: declare that an optimizer class outside
    ``zero.ELEMENTWISE`` updates each element on its own (sharding is flat). The result is an
    instance of ``optimizer_class``; ``.optim`` is the optimizer of this rank's shard."""
    if isinstance(params, type) and issubclass(params, torch.optim.Optimizer):
        params, optimizer_class = optimizer_class, params  # Horovod-style order
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"ZeroRedundancyOptimizer(params, optimizer_class, **defaults): optimizer_class must be a "
                        f"torch.optim.Optimizer subclass such as torch.optim.Adam, got {optimizer_class!r}.")
    check_elementwise(optimizer_class, elementwise)
    check_closure_free(optimizer_class)
    if op not in (Average, Sum):
        raise ValueError(f"ZeroRedundancyOptimizer op must be hvd.Average or hvd.Sum, got {op!r}.")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    check_passes(backward_passes_per_step)
    base = optimizer_class(params, **defaults)  # the parameter groups with their options (no state yet)
    if isinstance(process_set, ProcessSet) and process_set.included() is False:
        cls = type(optimizer_class.__name__, (optimizer_class,), {**outside_steps(), **shared_steps()})
        return cls(base.param_groups, named_parameters, backward_passes_per_step)
    settings = ZeroSettings(optimizer_class, dict(defaults), overlap_with_forward)
    cls = type(optimizer_class.__name__, (optimizer_class,), {**distributed_steps(), **shared_steps(),
                                                              **sharded_steps(), "_zero_settings": settings})
    # sparse gradients are densified into the buckets: every rank's part is dense
    return cls(base.param_groups, named_parameters, Compression.none, backward_passes_per_step, op,
               gradient_predivide_factor, None, True, process_set, check_finite)


__all__ = ["ELEMENTWISE", "BucketShard", "Piece", "Segment", "ShardedBucket", "ShardedSteps", "Shards", "ZeroSettings",
           "ZeroRedundancyOptimizer", "check_closure_free", "check_elementwise", "per_element", "plain_option",
           "sharded_steps", "travel_order"]
