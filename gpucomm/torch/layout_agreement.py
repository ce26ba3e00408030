"""``DistributedOptimizer``'s bucket layout, agreed once: planned for the parameters that need
gradients now, verified across ranks (parameters, buckets, strides, compression, the finite
check, the optimizer class) at one collective point, and hooked.

Agree once, then run a fixed schedule: every step in between sends no control-plane message. A
new layout is agreed only when the trainable set changes, some gradients turn out sparse, or the
buckets are re-cut (``replanning.py``); an error names what differs between ranks and why.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..counters import COUNTERS
from ..tuning.plans import to_fusion_buckets
from .compression import wire_of
from .functions import allgather_object
from .parameters import check_same_parameters
from .powersgd import powersgd_buckets
from .submission import (Average, BucketSettings, GradientBuckets, MakeBuckets, current_job, plan_buckets,
                         keep_views_wanted, plan_by_readiness, plan_groups, views_wanted)

log = logging.getLogger("gpucomm")


class LayoutAgreement:
    """Planning, verifying and adopting a layout, for ``DistributedSteps`` (merged into its
    namespace: ``self`` is the optimizer)."""

    def _agree_on_layout(self, job) -> GradientBuckets:
        """Plan buckets for the parameters that need gradients now, verify parameters and buckets
        across ranks (a collective: every rank calls this at the same point), and hook them. Nothing
        of the optimizer changes unless the ranks agreed."""
        requires = [p.requires_grad for p in self._params]
        trainable = [p for p in self._params if p.requires_grad]
        if self._reducing:  # before any collective: a trainable parameter on another GPU than the rank's
            first_on: dict = {}
            for p in trainable:
                first_on.setdefault(p.device, p)
            for device, p in first_on.items():
                job.check_gpu(device, lambda p=p: f"{self._kind}: parameter '{self._parameter_names[p]}'")
        dense = self._sparse.split(trainable)  # the agreed sparse ones are reduced on their own
        if self._groups is not None:
            plans = plan_groups(dense, _trainable_groups(self._groups, dense))
        elif self._planned is not None and sorted(i for b in self._planned for i in b) == list(range(len(dense))):
            plans = to_fusion_buckets(dense, self._planned)
        elif self._ready_us is not None:
            index = {p: i for i, p in enumerate(self._params)}
            plans = plan_by_readiness(dense, [self._ready_us[index[p]] for p in dense])
        else:
            plans = plan_buckets(dense)
        settings = BucketSettings(self._compression, self._prescale, self._postscale, self._set_id, self._finite,
                                  average=self._op == Average, predivide=self._predivide,
                                  wire_of=wire_of(self._compression), views=views_wanted(),
                                  keep_views=keep_views_wanted(), sparse_seen=self._bucket_saw_sparse)
        buckets = GradientBuckets(self._schedule, dense, plans, settings, self._flush_step, make=self._bucket_maker())
        self._layouts += 1
        if self._reducing:
            self._verify_everywhere(buckets)
            if self._layouts > 1:  # a new layout, agreed at a collective point: NCCL connects for it here
                buckets.warm_up()
            if self._by_order:  # hooked for the old buckets' arrival order: every gradient's own hook again
                self._hook_every_gradient()
            hooked = set(trainable)
            for p in list(self._hooks):
                if p not in hooked:
                    self._hooks.pop(p).remove()
            for p in trainable:
                if p not in self._hooks:
                    self._hooks[p] = p.register_post_accumulate_grad_hook(self._hook)
        self._requires, self._trainable, self._dense = requires, trainable, dense
        self._delay = {id(p): self._passes for p in trainable}  # by id: a tensor's hash is a Python call
        return buckets

    def _bucket_maker(self) -> MakeBuckets | None:
        """How this optimizer's buckets are built from the plans (None: ``buckets.standard_buckets``)."""
        if self._powersgd is not None:
            return powersgd_buckets(self._powersgd, self._size)
        return None

    def _verify_everywhere(self, buckets: GradientBuckets) -> None:
        index = {p: i for i, p in enumerate(self._params)}
        params = [(self._parameter_names[p], list(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad)
                  for p in self._params]
        layout = [([index[p] for p in b.params], str(b.wire_dtype), type(b).__name__) for b in buckets.buckets]
        sparse = [index[p] for p in self._sparse.active]
        describe = getattr(self._compression, "describe", None)
        mine = {"params": params, "buckets": layout, "schedule": self._schedule.number, "sparse": sparse,
                "compression": describe() if callable(describe) else getattr(self._compression, "__name__", "user"),
                "sparse_as_dense": self._sparse_as_dense,
                "check_finite": self._finite.mode if self._finite is not None else None,
                "strides": [list(buckets.stride_of(p)) for p in self._params if buckets.holds(p)],
                "optimizer": self._agreed_optimizer()}
        COUNTERS.layout_checks += 1
        every = allgather_object(mine, name=f"DistributedOptimizer.layout.{self._schedule.number}.{self._layouts}",
                                 process_set=self._process_set)
        for rank, theirs in enumerate(every):
            check_same_parameters(every[0]["params"], theirs["params"], rank, self._kind)
        for rank, theirs in enumerate(every):
            if theirs["optimizer"] != every[0]["optimizer"]:
                raise ValueError(
                    f"{self._kind}: ranks disagree on the optimizer class that steps the parameters: rank 0 has "
                    f"{every[0]['optimizer'].get('class')}, rank {rank} has {theirs['optimizer'].get('class')}. Each "
                    f"rank steps its own shard of the parameters with its own optimizer, so different classes would "
                    f"silently train each shard differently. Build it with the same optimizer class on every rank.")
        for rank, theirs in enumerate(every):
            if theirs != every[0]:
                raise ValueError(
                    f"{self._kind}: ranks disagree on the gradient buckets (rank 0: {_layout_text(every[0])}; "
                    f"rank {rank}: {_layout_text(theirs)}), although their parameters match. Every rank must plan the "
                    f"same buckets, or their allreduces would pair unrelated data. Likely causes: "
                    f"GPUCOMM_FUSION_THRESHOLD / HOROVOD_FUSION_THRESHOLD / GPUCOMM_FUSION_FIRST_BUCKET, groups=, "
                    f"sparse_as_dense=, compression= (PowerSGD's settings) or check_finite= (GPUCOMM_CHECK_FINITE) set "
                    f"differently on some ranks, a "
                    f"model in channels_last memory format on some ranks only (gradients travel in the parameters' "
                    f"memory order), or DistributedOptimizers built in a different order. Set them alike on every "
                    f"rank.")

    def _agreed_optimizer(self) -> dict:
        """What of the wrapped optimizer the ranks must share (DistributedOptimizer: nothing; every
        rank steps every parameter, as Horovod's does)."""
        return {}

    def _layout_changed(self) -> bool:
        return [p.requires_grad for p in self._params] != self._requires

    def _adopt_new_layout(self, sparse_agreed: bool = False) -> None:
        """The parameters that need gradients changed (a layer was frozen or unfrozen), or some
        turned out sparse: agree on the new layout (and, unless just done, on which parameters are
        sparse), and average now the gradients of parameters that just joined it."""
        if not sparse_agreed:
            self._sparse.agree()
        if self._tuner is not None and not self._tuner.done:  # its plans index the old layout: start over
            log.info("gpucomm autotune: the trainable parameters changed during the trial; it starts again")
            self._tuner = None
        self._planned = None
        before = set(self._trainable)
        self._drain_checks()  # the old layout's reports still on their way, decoded against it
        self._buckets = self._agree_on_layout(current_job())
        self._average_added(before)

    def _average_added(self, before: set) -> None:
        """Average now this step's gradients of the parameters that joined the layout just agreed (not in
        ``before``): unfrozen, or added in a new group; their hooks were not registered during backward."""
        added = [p for p in self._trainable if p not in before]
        if added and self._reducing:
            self._buckets.reduce_once(added, f"DistributedOptimizer.added.{self._layouts}")


def _trainable_groups(groups: Any, trainable: list[torch.Tensor]) -> Any:
    """``groups`` restricted to the parameters that need gradients now (lists of parameters)."""
    if isinstance(groups, int):
        return groups
    keep = set(trainable)
    return [[p for p in g if p in keep] for g in groups]


def _layout_text(mine: dict) -> str:
    """One rank's layout (``_verify_everywhere``'s record) in a line, for an error that compares ranks."""
    buckets = mine["buckets"]
    sizes = ", ".join(f"{len(ids)} params ({dtype.replace('torch.', '')}, {kind})" for ids, dtype, kind in buckets[:4])
    more = f", +{len(buckets) - 4} more" if len(buckets) > 4 else ""
    return f"schedule {mine['schedule']}, {len(buckets)} buckets [{sizes}{more}], compression {mine['compression']}"
