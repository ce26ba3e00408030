"""``DistributedOptimizer``: gradients averaged across ranks while backward is still running.

Each trainable parameter gets a post-accumulate-grad hook. Parameters are grouped into buckets
(``gpucomm.dataplane.fusion``: reverse order, one dtype and device each, 1 MiB first, then 25 MiB);
when the last gradient of a bucket arrives, and every earlier bucket has been launched, the bucket's
allreduce is launched on the optimizer's fixed schedule by the data plane's reducer
(``gpucomm.dataplane.reducer``; the bucket kinds in ``bucket_kinds``: gradients end up living in the
buckets, see there), so communication overlaps the rest of backward. ``synchronize()`` (called by
``step()``) launches what is left and waits for the buckets in order.

Agree once, then run a fixed schedule: the parameters (names, shapes, dtypes) and the bucket
layout are verified across ranks when the optimizer is built, and again only when the set of
parameters that need gradients changes; every step in between sends no control-plane message.
A parameter whose hook did not fire by ``synchronize()`` is reduced as zeros (Horovod's rule), so
the ranks' collectives always match.

Semantics follow Horovod: a subclass of the wrapped optimizer's class, ``synchronize``,
``skip_synchronize``, ``set_backward_passes_per_step``, the ``zero_grad`` guard and the warning when
``step()`` follows ``synchronize()``. A parameter that produced no gradient on this rank
contributes zeros (and, if it still requires grad, receives the averaged gradient); a parameter
frozen with ``requires_grad_(False)`` contributes zeros and keeps its gradient untouched until the
next layout leaves it out. Sparse gradients (``nn.Embedding(sparse=True)``): ``sparse_as_dense=True``
averages them densely in their buckets; otherwise they are reduced sparse, outside the buckets,
once the ranks agreed which parameters have them (``sparse_grads.py``).

Where each part lives: the optimizer's methods are ``distributed_steps.DistributedSteps`` (a step's
reduction, ``zero_grad``, the state dict) with its concerns' mixins: ``gradient_hooks``,
``layout_agreement``, ``replanning`` (the first re-cut and autotune), ``finite_reports`` and
``job_binding`` (bind, rebind, join, close); ``outside_process_set`` for a rank outside the set.
``ZeroRedundancyOptimizer`` is built in ``zero.py``. This module builds ``DistributedOptimizer``.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch

from ..process_sets import ProcessSet, global_process_set
from . import finite_check
from .adasum import adasum_optimizer
from .compression import Compression, PowerSGD, resolve as resolve_compression
from .distributed_steps import distributed_steps
from .job_binding import one_rank_reducer  # noqa: F401 - public, importable from here as before the split
from .outside_process_set import outside_steps
from .parameters import check_passes, shared_steps
from .submission import Adasum, Average, Sum, current_job
from .zero import ZeroRedundancyOptimizer


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable | None = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         check_finite: bool | str | None = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks (Horovod's API).

    The result is an instance of a subclass of ``optimizer``'s class built from its
    ``param_groups`` (``isinstance`` and LR schedulers keep working; the original's state is not
    carried over, as in Horovod). ``check_finite`` (gpucomm's; default ``GPUCOMM_CHECK_FINITE``):
    ``"raise"``/True or ``"warn"`` names, on every rank in the same step, the rank and parameter
    whose gradient first went NaN or Inf (``finite_check.py``)."""
    compression = resolve_compression(compression)  # Compression.powersgd without its call: its defaults
    if op == Adasum:  # Horovod's delta optimizer (gpucomm/torch/adasum.py)
        if isinstance(compression, PowerSGD):
            raise NotImplementedError("Compression.powersgd is not supported with op=hvd.Adasum (its delta optimizer "
                                      "reduces weight changes, not gradients, in one request); use op=hvd.Average or "
                                      "hvd.Sum, or Compression.fp16 / bf16 with Adasum.")
        if finite_check.resolve_mode(check_finite) in finite_check.MODES:  # asked for (the default is off here)
            raise NotImplementedError("check_finite is not supported with op=hvd.Adasum (its delta optimizer "
                                      "reduces weight changes, not gradients); use op=hvd.Average or hvd.Sum.")
        if current_job().world.size > 1:
            return adasum_optimizer(optimizer, named_parameters, compression, backward_passes_per_step,
                                    gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set)
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        op = Sum  # one rank: the Adasum of one rank's gradients is those gradients
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer op must be hvd.Average or hvd.Sum, got {op!r}.")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    check_passes(backward_passes_per_step)
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    if isinstance(process_set, ProcessSet) and process_set.included() is False:  # registered, without this rank
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,), {**outside_steps(), **shared_steps()})
        return cls(optimizer.param_groups, named_parameters, backward_passes_per_step)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), {**distributed_steps(), **shared_steps()})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, check_finite)


__all__ = ["DistributedOptimizer", "ZeroRedundancyOptimizer"]
