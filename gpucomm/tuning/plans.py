"""Turn a plan of the step model (buckets of parameter indices, launch order) into what gpucomm's
optimizer takes: ``fusion.Bucket`` records (the planner's output type) or, for
``DistributedOptimizer(groups=...)``, lists of parameters."""

from __future__ import annotations

from typing import Sequence

import torch

from ..dataplane.fusion import Bucket

__all__ = ["to_fusion_buckets", "to_groups"]


def _check(params: Sequence[torch.Tensor], buckets: Sequence[Sequence[int]]) -> None:
    flat = sorted(i for b in buckets for i in b)
    if flat != list(range(len(params))):
        raise ValueError(f"plan: the buckets must hold each of the {len(params)} parameters exactly once "
                         f"(they hold {len(flat)} entries); build them from the same parameter list.")


def to_fusion_buckets(params: Sequence[torch.Tensor], buckets: Sequence[Sequence[int]]) -> list[Bucket]:
    """``fusion.Bucket`` records for ``buckets`` of indices into ``params``, numbered in launch order;
    each bucket must hold one dtype on one device (a fused buffer has one)."""
    _check(params, buckets)
    out = []
    for number, indices in enumerate(buckets):
        first = params[indices[0]]
        mixed = [i for i in indices if params[i].dtype != first.dtype or params[i].device != first.device]
        if mixed:
            raise ValueError(f"plan: bucket {number} mixes dtypes or devices (parameters {indices[0]} and {mixed[0]}); "
                             "plan each (dtype, device) separately.")
        numels = tuple(params[i].numel() for i in indices)
        offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
        out.append(Bucket(number, tuple(indices), offsets, numels, sum(numels), first.dtype, first.device))
    return out


def to_groups(params: Sequence[torch.Tensor], buckets: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
    """The buckets as ``DistributedOptimizer(groups=...)`` lists: each list becomes one bucket."""
    _check(params, buckets)
    return [[params[i] for i in b] for b in buckets]
