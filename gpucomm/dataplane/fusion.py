"""Bucket planning: which gradients share a fusion buffer, at which offsets (the copies into and out
of the buffers are ``bucket_copy``'s, the buffers ``buffers``').

Buckets follow PyTorch DDP: parameters are taken in *reverse* order (the order backward produces
their gradients), each bucket holds one dtype on one device, the first bucket of each
(dtype, device) is small (1 MiB) so that the first allreduce starts early in backward, and the
others are capped (25 MiB). The cap is Horovod's fusion threshold, in bytes, and is read from
``GPUCOMM_FUSION_THRESHOLD`` (or ``HOROVOD_FUSION_THRESHOLD``); as in Horovod, 0 turns fusion off
(one tensor per bucket) and a tensor larger than the cap gets a bucket of its own. Code
arguments win over the environment. Bucket indices follow the order in which buckets become
ready, and every rank computes the same plan from the same parameter list, so buckets can be
launched strictly in index order on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..settings import FUSION_FIRST_BUCKET, FUSION_THRESHOLD

__all__ = [
    "DEFAULT_FIRST_BUCKET_BYTES", "DEFAULT_BUCKET_CAP_BYTES", "THRESHOLD_ENV", "FIRST_BUCKET_ENV", "FusionLimits",
    "fusion_limits", "Bucket", "plan_buckets", "plan_by_readiness", "plan_groups",
]

log = logging.getLogger("gpucomm.fusion")

DEFAULT_FIRST_BUCKET_BYTES = 1 << 20
DEFAULT_BUCKET_CAP_BYTES = 25 << 20
THRESHOLD_ENV = FUSION_THRESHOLD.names  # first one set wins
FIRST_BUCKET_ENV = FUSION_FIRST_BUCKET.names[0]


# ---------------------------------------------------------------------------------------------
# limits


@dataclass(frozen=True)
class FusionLimits:
    """Byte limits of a plan: the first bucket of each (dtype, device), and every other bucket."""

    first_bucket_bytes: int
    bucket_cap_bytes: int


def _byte_count(value: Any, source: str) -> int:
    """An argument's byte count (the environment's go through ``settings``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{source} must be an int number of bytes, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{source}={value} is negative; use a byte count >= 0 (0 turns fusion off).")
    return value


def fusion_limits(*, first_bucket_bytes: int | None = None, bucket_cap_bytes: int | None = None,
                  env: Mapping[str, str] | None = None) -> FusionLimits:
    """Resolve the limits: arguments, then the environment, then the defaults (1 MiB, 25 MiB).

    The cap comes from ``bucket_cap_bytes``, else ``GPUCOMM_FUSION_THRESHOLD``, else
    ``HOROVOD_FUSION_THRESHOLD``; the first bucket from ``first_bucket_bytes``, else
    ``GPUCOMM_FUSION_FIRST_BUCKET``, else 1 MiB. The first bucket never exceeds the cap, so a
    threshold below 1 MiB (or 0) applies to every bucket.
    """
    if bucket_cap_bytes is not None:
        cap = _byte_count(bucket_cap_bytes, "bucket_cap_bytes")
    else:
        cap = FUSION_THRESHOLD.read(env, DEFAULT_BUCKET_CAP_BYTES)
    if first_bucket_bytes is not None:
        first = _byte_count(first_bucket_bytes, "first_bucket_bytes")
    else:
        first = FUSION_FIRST_BUCKET.read(env, DEFAULT_FIRST_BUCKET_BYTES)
    return FusionLimits(first_bucket_bytes=min(first, cap), bucket_cap_bytes=cap)


# ---------------------------------------------------------------------------------------------
# planning


@dataclass(frozen=True)
class Bucket:
    """One fused group: ``param_indices[j]`` (an index into the planned list) sits at element
    ``offsets[j]`` of the flat buffer and has ``numels[j]`` elements; ``numel`` is the total."""

    index: int
    param_indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_buckets(params: Sequence[torch.Tensor], *, first_bucket_bytes: int | None = None,
                 bucket_cap_bytes: int | None = None, env: Mapping[str, str] | None = None) -> list[Bucket]:
    """Group ``params`` (tensors: parameters or their gradients) into buckets; see the module doc.

    A parameter joins the open bucket of its (dtype, device) unless that would take the bucket
    over its limit; then the bucket closes and a new one opens with the cap as its limit.
    Buckets are numbered by their first (= latest) parameter, so bucket 0 holds the last
    parameters, which backward finishes first.
    """
    limits = fusion_limits(first_bucket_bytes=first_bucket_bytes, bucket_cap_bytes=bucket_cap_bytes, env=env)
    open_: dict[tuple[torch.dtype, torch.device], list] = {}  # key -> [first position, limit, bytes, indices]
    closed: list[list] = []
    seen_keys: set[tuple[torch.dtype, torch.device]] = set()
    for position, index in enumerate(range(len(params) - 1, -1, -1)):
        p = params[index]
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"plan_buckets: params[{index}] is a {type(p).__name__}, not a torch.Tensor")
        key = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        bucket = open_.get(key)
        if bucket is not None and bucket[2] + nbytes > bucket[1]:
            closed.append(open_.pop(key))
            bucket = None
        if bucket is None:
            limit = limits.bucket_cap_bytes if key in seen_keys else limits.first_bucket_bytes
            seen_keys.add(key)
            bucket = open_[key] = [position, limit, 0, []]
        bucket[2] += nbytes
        bucket[3].append(index)
    closed.extend(open_.values())
    closed.sort(key=lambda b: b[0])
    plan = []
    for number, (_, _, _, indices) in enumerate(closed):
        numels = tuple(params[i].numel() for i in indices)
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += n
        first = params[indices[0]]
        plan.append(Bucket(number, tuple(indices), tuple(offsets), numels, total, first.dtype, first.device))
    return plan


def plan_by_readiness(params: Sequence[torch.Tensor], ready_us: Sequence[float | None], *,
                      bucket_cap_bytes: int | None = None, gap_fraction: float = 0.05, min_bucket_bytes: int = 64 << 10,
                      env: Mapping[str, str] | None = None) -> list[Bucket]:
    """Buckets cut where backward pauses, from the times the gradients became ready in a step that
    was watched (``ready_us[i]`` for ``params[i]``; None: never seen, taken as ready last).

    Parameters are taken in the order their gradients arrived; a bucket closes when it reaches the
    cap (DDP's rule: the parameter that crosses it stays in), or when the next gradient arrives
    later than ``gap_fraction`` of the whole backward span after this one and the bucket holds at
    least ``min_bucket_bytes``: its allreduce then runs during the pause instead of waiting for
    gradients that come much later. So the gradients of the last, cheap-to-compute layers never
    hold back those of the expensive ones, and the tail left after backward stays small. One dtype
    and device is required (else ``plan_buckets``)."""
    if len({(p.dtype, p.device) for p in params}) > 1 or len(ready_us) != len(params):
        return plan_buckets(params, bucket_cap_bytes=bucket_cap_bytes, env=env)
    cap = fusion_limits(bucket_cap_bytes=bucket_cap_bytes, env=env).bucket_cap_bytes
    last = max((t for t in ready_us if t is not None), default=0.0)
    order = sorted(range(len(params)), key=lambda i: (ready_us[i] if ready_us[i] is not None else last, -i))
    times = [ready_us[i] if ready_us[i] is not None else last for i in order]
    gap = gap_fraction * (times[-1] - times[0]) if times else 0.0
    groups, current, size = [], [], 0
    for k, i in enumerate(order):
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        pause = k + 1 < len(order) and times[k + 1] - times[k] > gap and size >= min_bucket_bytes
        if size >= cap or pause or k + 1 == len(order):
            groups.append(current)
            current, size = [], 0
    plan = []
    for number, indices in enumerate(groups):
        numels = tuple(params[i].numel() for i in indices)
        offsets = tuple(sum(numels[:j]) for j in range(len(numels)))
        first = params[indices[0]]
        plan.append(Bucket(number, tuple(indices), offsets, numels, sum(numels), first.dtype, first.device))
    return plan


def plan_groups(trainable: Sequence[torch.Tensor], groups: Any) -> list[Bucket]:
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
        plans.append(Bucket(number, tuple(ids), offsets, numels, sum(numels), first.dtype, first.device))
    return plans
