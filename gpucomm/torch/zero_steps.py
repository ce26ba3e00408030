"""``ZeroRedundancyOptimizer``'s methods over ``DistributedOptimizer``'s (``ShardedSteps``): its
buckets are reduce-scattered, ``synchronize`` leaves this rank's averaged part in its segments'
gradients, ``step`` steps this rank's shard and launches the parameter allgathers, and a new
layout re-cuts the shards, moving the state over. ``sharded_steps()`` merges them with the
state-dict methods (``zero_state``) and the allgather waits (``zero_overlap``) into one namespace.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch

from .functions import allgather_object
from .parameters import STEP_AFTER_SYNC_WARNING
from .submission import BucketSettings, MakeBuckets, PlannedBucket, current_job
from .zero_bucket import sharded_buckets
from .zero_overlap import ForwardOverlap
from .zero_state import ShardedStateDict, Shards, keeping_frozen


def plain_option(value: Any) -> Any:
    """An optimizer option as plain data every rank can compare (a one-element tensor as its number)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else f"tensor of shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return [plain_option(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def options_text(groups: list[dict]) -> str:
    """The param groups' options (``plain_option``s) as one line, for an error that compares ranks."""
    return "; ".join("[" + ", ".join(f"{k}={v}" for k, v in sorted(g.items())) + "]" for g in groups)


class ShardedSteps:
    """``ZeroRedundancyOptimizer``'s methods, merged over ``DistributedOptimizer``'s in its dynamic
    class: the buckets are ``ShardedBucket``s, ``synchronize`` leaves this rank's averaged part in
    its segments' gradients, ``step`` steps the shard and gathers the parameters, and the state dict
    is the full one."""

    _tunable = False  # autotune times allreduces; ZeRO's buckets are reduce-scattered
    _kind = "ZeroRedundancyOptimizer"
    _reduces_at_one_rank = False  # one rank: the wrapped optimizer steps the parameters, nothing is sharded

    def _prepare(self) -> None:
        self._shards: Shards | None = None
        self._shards_job: Any = None  # the job the shards were cut in
        self._pending: dict | None = None  # a full state loaded, handed to the shards at the next step
        self._parked: dict = {}  # the state of parameters outside the layout (frozen), by index, kept whole
        self._frozen_scalars: dict = {}  # step counts of parameters frozen in this step, before it (keeping_frozen)
        self._gathers: list = []  # parameter allgathers in flight: (handle, bucket shard), launch order
        self._consolidated: dict | None = None
        self._options_agreed = False  # the groups' options checked alike on every rank (the first step)
        self._consolidated_to: int | None = None
        self._state_calls = 0
        model = self._zero_settings.overlap_with_forward
        if model is not None:
            self._hook_model(model)

    # -- the layout ----------------------------------------------------------------------------------
    def _agreed_optimizer(self) -> dict:
        """The optimizer class, agreed with the layout: each rank steps its own shard with its own
        optimizer. (Its options are agreed at the first step, ``_agree_on_options``: Horovod's
        pattern builds the optimizer first and then broadcasts rank 0's options to the others.)"""
        cls = self._zero_settings.optimizer_class
        return {"class": f"{cls.__module__}.{cls.__qualname__}"}

    def _agree_on_options(self) -> None:
        """(every rank, at its first step) Every parameter group's options must be alike: each rank
        steps its shard with them, so a different learning rate on one rank would train its shard
        differently without a word. One gather, once."""
        self._options_agreed = True
        if self._size == 1:
            return
        mine = [{k: plain_option(v) for k, v in group.items() if k != "params"} for group in self.param_groups]
        every = allgather_object(mine, name=f"ZeroRedundancyOptimizer.options.{self._schedule.number}",
                                 process_set=self._process_set)
        for rank, theirs in enumerate(every):
            if theirs != every[0]:
                raise ValueError(
                    f"ZeroRedundancyOptimizer: ranks disagree on the optimizer's options at the first step: rank 0 "
                    f"has {options_text(every[0])}, rank {rank} has {options_text(theirs)}. Each rank steps its own "
                    f"shard of the parameters with these options, so different ones would silently train each shard "
                    f"differently. Build the optimizer with the same options on every rank, or call "
                    f"hvd.broadcast_optimizer_state(opt, root_rank=0) before the first step.")

    def _bucket_maker(self) -> MakeBuckets:
        return self._make_sharded

    def _make_sharded(self, plans: Sequence[PlannedBucket], trainable: Sequence[torch.Tensor],
                      settings: BucketSettings) -> list:
        """Cut this layout's shards, moving the optimizer state over: from the shards of the last layout
        when they were cut in this job (a gather: every rank agrees on the layout at the same point),
        from a full state loaded since, or none (a re-formed elastic job gets it from its sync)."""
        job = current_job()
        self._wait_parameters()
        full = None
        if self._pending is not None:
            full = self._take_pending()
        elif self._shards is not None and self._shards_job is not None and self._shards_job() is job:
            full = self._gather()
        check = settings.check
        tails = [(plan.index == 0) + (check.size if check is not None else 0) for plan in plans]
        group = job.group(self._set_id)
        self._shards = Shards(self._zero_settings, self._params, self.param_groups, plans, trainable, self._size,
                              group.rank, tails)
        self._shards_job = weakref.ref(job)
        self.optim = self._shards.optim
        if full:
            if self._size > 1:  # a frozen parameter keeps its state for when it trains again
                inside = {self._shards.index[p] for b in self._shards.buckets for p in b.params}
                self._parked = {i: v for i, v in full.items() if i not in inside}
            self._shards.load(full)
        self._frozen_scalars = {}
        return sharded_buckets(self._shards, plans, trainable, settings)

    # -- a step --------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Reduce-scatter the gradients: this rank's part of each bucket, averaged, becomes its
        segments' gradients (the model's ``p.grad`` keep this rank's own gradients)."""
        self._reduce_step()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """(``closure`` runs first, with gradients enabled, as torch's optimizers run it.) Reduce,
        step this rank's shard, and gather the updated parameters on every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(STEP_AFTER_SYNC_WARNING)
            self.synchronize()
        self._synchronized = False
        if not self._options_agreed:
            self._agree_on_options()
        self._shard_step()
        if self._size > 1:
            self._settle_step()  # a changed layout re-cuts the shards (moving the state over)
        return loss

    def _shard_step(self) -> None:
        self._wait_parameters()
        self._consolidated, self._consolidated_to = None, None
        if self._pending is not None:
            self._shards.load(self._take_pending())
        shards = self._shards
        if shards.optim is not None:
            for local, group in zip(shards.optim.param_groups, self.param_groups):
                local.update({k: v for k, v in group.items() if k != "params"})  # LR schedulers act on ours
        for bucket in shards.buckets:
            bucket.refresh_values()
        if shards.optim is not None:
            with keeping_frozen(shards, self._frozen_scalars):
                shards.optim.step()
        if self._size == 1:
            return
        buckets = list(reversed(shards.buckets))  # the first layers' parameters first: the next forward needs them first
        handles = self._buckets.launch_now([b.gather_request(self._set_id) for b in buckets])
        self._gathers = list(zip(handles, buckets))
        if self._zero_settings.overlap_with_forward is None:
            self._wait_parameters()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """After ``synchronize()``: scale the averaged gradients this optimizer holds (each rank's part)
        so that their norm over every rank is at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``
        does to whole gradients; returns that total norm. Every rank calls it at the same point (one
        allreduce on the optimizer's schedule). Horovod's pattern: ``synchronize()``, this, then
        ``with opt.skip_synchronize(): opt.step()``."""
        norm_type = float(norm_type)
        if not math.isfinite(norm_type) or norm_type <= 0:
            raise ValueError(f"ZeroRedundancyOptimizer.clip_grad_norm_: norm_type must be a finite p > 0, got "
                             f"{norm_type} (the norm over ranks is summed from each rank's part).")
        if self._size == 1:
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        grads = [s.tensor.grad for b in self._shards.buckets for s in b.segments if s.tensor.grad is not None]
        device = self._shards.buckets[0].plan.device
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for g in grads:
            total += g.detach().double().abs().pow(norm_type).sum()
        self._buckets.allreduce_now([total], f"ZeroRedundancyOptimizer.clip.{self._schedule.number}")
        norm = total.pow(1.0 / norm_type)[0]
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for g in grads:
                g.mul_(scale.to(g.dtype))
        return norm.float()

    def stand_in_until_all_joined(self) -> None:
        """A joined rank steps its shard on the others' averaged gradients (its own count as zeros)
        and takes part in the parameter allgathers, until every rank has joined."""
        while self._buckets.stand_in_step(write=True):
            self._shard_step()
        self._wait_parameters()


def sharded_steps() -> dict:
    """``ShardedSteps``' methods with the state dict's and the allgathers' (``ShardedStateDict``,
    ``ForwardOverlap``), for a dynamic class's namespace (over DistributedOptimizer's)."""
    namespace: dict = {}
    for mixin in (ShardedSteps, ShardedStateDict, ForwardOverlap):
        namespace.update({k: v for k, v in mixin.__dict__.items() if not k.startswith("__")})
    return namespace


__all__ = ["ShardedSteps", "options_text", "plain_option", "sharded_steps"]
