"""ZeRO's reduce-scattered bucket (``ShardedBucket``): the one class of ZeRO that extends the data
plane's ``Bucket`` (the ``seam`` contract in pyproject.toml lists it), and the buckets of a
layout cut into shards (``sharded_buckets``).

At launch each gradient is copied, averaged, into its place in every rank's part of the fusion
buffer; the reduce-scatter hands each rank the averaged gradients of its own part, which become
its segments' gradients.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..dataplane.bucket_kinds import Bucket  # the bucket class ZeRO's reduce-scattered buckets extend
from ..reduce_op import ReduceOp
from .submission import BucketSettings, PlannedBucket, Request, send_view, standard_buckets
from .zero_geometry import BucketShard
from .zero_state import Shards


class ShardedBucket(Bucket):
    """A bucket reduce-scattered instead of allreduced: at launch each gradient is copied, averaged,
    into its place in every rank's part, and each rank receives the averaged gradients of its own
    part, which become its segments' gradients. Every part carries the tail (bucket 0's training
    flag; the finite check's slots, each rank's value written into every part), so every rank reads
    the same flag and the same findings."""

    def __init__(self, plan: PlannedBucket, params: list[torch.Tensor], wire: torch.dtype, settings: BucketSettings,
                 shard: BucketShard) -> None:
        super().__init__(plan, params, wire, settings)
        self.shard = shard
        self.full: torch.Tensor | None = None

    def request(self, tensors: list[torch.Tensor]) -> Request:
        return Request("reducescatter", self.name, tensors, op=ReduceOp.SUM, device=self.plan.device,
                       set_id=self.settings.set_id)

    def fill(self) -> list[torch.Tensor]:
        shard, check, settings = self.shard, self.settings.check, self.settings
        if self.full is None:
            self.full = settings.buffers.get(self.plan.device, self.wire_dtype, shard.size * shard.chunk,
                                             slot=self.plan.index)
        full = self.full
        scale = settings.prescale * settings.postscale
        data = self.plan.numel
        with torch.no_grad():
            for p, offset, n in zip(self.params, self.plan.offsets, self.plan.numels):
                g = send_view(p, settings.strides[p])
                for at, start, length in shard.spans(offset, n):
                    torch.mul(g[start : start + length], scale, out=full[at : at + length])
            for k in range(shard.size):
                base = k * shard.chunk
                used = min(max(data - k * shard.per_rank, 0), shard.per_rank)
                full[base + used : base + shard.chunk].zero_()  # padding and tail
                if self.first:
                    full[base + shard.per_rank] = 1  # the training flag, in every rank's part
            if check is not None:
                mine = torch.zeros(1, dtype=full.dtype, device=full.device)
                check.search([send_view(p, self.settings.strides[p]) for p in self.params], mine)
                for k in range(shard.size):
                    at = k * shard.chunk + shard.per_rank + self.first + check.rank
                    full[at : at + 1].copy_(mine)
        return [full]

    def write_gradients(self, result: list[torch.Tensor]) -> None:
        out = result[0]
        shard = self.shard
        for segment in shard.segments:
            segment.tensor.grad = out[segment.start : segment.start + segment.length]
        check = self.settings.check
        if check is not None:
            at = shard.per_rank + self.first
            self.checks = out[at : at + check.size]

    def zeros(self) -> list[torch.Tensor]:
        return [torch.zeros(self.shard.size * self.shard.chunk, dtype=self.wire_dtype, device=self.plan.device)]

    def training_flag(self, result: list[torch.Tensor]) -> torch.Tensor:
        return result[0][self.shard.per_rank]

    def release(self) -> None:
        if self.handle is None:
            for segment in self.shard.segments:
                segment.tensor.grad = None


def sharded_buckets(shards: Shards, plans: Sequence[PlannedBucket], trainable: Sequence[torch.Tensor],
                    settings: BucketSettings) -> list[Bucket]:
    """The buckets of a layout cut into ``shards``: reduce-scattered, one per bucket shard (one
    rank: nothing is sharded, the standard buckets)."""
    if shards.size == 1:
        return standard_buckets(plans, trainable, settings)
    return [ShardedBucket(b.plan, b.params, b.plan.dtype, settings, b) for b in shards.buckets]


__all__ = ["ShardedBucket", "sharded_buckets"]
