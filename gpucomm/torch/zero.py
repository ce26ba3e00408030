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
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from ..dataplane.bucket_kinds import Bucket  # the bucket class ZeRO's reduce-scattered buckets extend
from ..errors import CollectiveError
from ..reduce_op import ReduceOp
from .submission import (BucketSettings, MakeBuckets, PlannedBucket, Request, current_job, layout_of, send_view,
                         standard_buckets, view_in_order)
from .functions import allgather_object
from .parameters import STEP_AFTER_SYNC_WARNING

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
               torch.optim.Rprop)


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
    return "; ".join("[" + ", ".join(f"{k}={v}" for k, v in sorted(g.items())) + "]" for g in groups)


def check_closure_free(optimizer_class: type) -> None:
    """Refuse an optimizer class whose ``step`` needs a closure (LBFGS): it re-evaluates the loss
    and its gradients several times inside one step, and a shard's step cannot run the model's
    forward and backward, nor reduce the gradients again, for every rank in between."""
    try:
        closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"ZeroRedundancyOptimizer: {optimizer_class.__name__}.step needs a closure (it re-evaluates the loss "
            f"and its gradients inside one step), which a sharded step cannot give it: each rank steps only its "
            f"shard, after the gradients were reduced once. Use {optimizer_class.__name__} with "
            f"hvd.DistributedOptimizer, or a closure-free optimizer (SGD, Adam, AdamW, ...) with "
            f"ZeroRedundancyOptimizer. An optional closure (torch's step(closure=None)) is run before the step, "
            f"as torch's optimizers run it.")


def check_elementwise(optimizer_class: type, elementwise: bool | None) -> None:
    """Refuse an optimizer class whose step is not known to treat every element on its own (a flat
    shard would change its result), unless the caller says it does."""
    if elementwise or (elementwise is None and issubclass(optimizer_class, ELEMENTWISE)):
        return
    raise ValueError(
        f"ZeroRedundancyOptimizer: {optimizer_class.__name__} is not known to update each element of a parameter on "
        f"its own, and gpucomm's ZeRO shards parameters flat (a rank may step part of a tensor), which would change "
        f"the result of an optimizer that mixes elements (per-tensor norms, factored moments, line searches). Use an "
        f"elementwise optimizer ({', '.join(c.__name__ for c in ELEMENTWISE)}), pass elementwise=True if "
        f"{optimizer_class.__name__} is elementwise, or use hvd.DistributedOptimizer.")


@dataclass(frozen=True)
class ZeroSettings:
    """What ``ZeroRedundancyOptimizer`` was given beyond DistributedOptimizer's arguments."""

    optimizer_class: type
    defaults: dict
    overlap_with_forward: Any = None  # nn.Module: its forward waits for the parameter allgathers, else step() does


# ---------------------------------------------------------------------------------------------
# one bucket's partition


@dataclass(frozen=True)
class Piece:
    """Part of a parameter in a rank's shard: elements ``[start, start + length)`` of the bucket's
    ``param``-th parameter (in its travel order) sit at ``at`` in the shard."""

    param: int
    start: int
    length: int
    at: int


@dataclass
class Segment:
    """A run of pieces of one param group in a rank's shard: the tensor the wrapped optimizer steps
    (a view of the shard's values), at ``start`` in the shard."""

    group: int
    start: int
    length: int
    pieces: list[Piece]
    tensor: torch.Tensor | None = None  # this rank's segments only


@dataclass
class BucketShard:
    """The partition of one planned bucket over ``size`` ranks: each rank owns ``per_rank`` elements
    (the last padded); the reduce-scattered buffer holds, per rank, its part then ``tail`` elements
    (bucket 0's training flag, the finite check's slots)."""

    plan: PlannedBucket
    params: list[torch.Tensor]
    size: int
    rank: int
    tail: int
    group_of: dict  # parameter -> its param group's index
    per_rank: int = 0
    segments: list[Segment] = field(default_factory=list)  # this rank's
    values: torch.Tensor | None = None  # this rank's part of the parameter values

    def __post_init__(self) -> None:
        self.per_rank = max(1, math.ceil(self.plan.numel / self.size))
        self.segments = self.segments_of(self.rank)
        self.values = torch.zeros(self.per_rank, dtype=self.plan.dtype, device=self.plan.device)
        for segment in self.segments:
            segment.tensor = self.values[segment.start : segment.start + segment.length]

    @property
    def chunk(self) -> int:
        return self.per_rank + self.tail

    def pieces_of(self, rank: int) -> list[Piece]:
        begin = rank * self.per_rank
        end = min(begin + self.per_rank, self.plan.numel)
        pieces = []
        for j, (offset, n) in enumerate(zip(self.plan.offsets, self.plan.numels)):
            lo, hi = max(offset, begin), min(offset + n, end)
            if lo < hi:
                pieces.append(Piece(j, lo - offset, hi - lo, lo - begin))
        return pieces

    def segments_of(self, rank: int) -> list[Segment]:
        """``rank``'s pieces, consecutive ones of one param group joined."""
        segments: list[Segment] = []
        for piece in self.pieces_of(rank):
            group = self.group_of[self.params[piece.param]]
            last = segments[-1] if segments else None
            if last is not None and last.group == group and last.start + last.length == piece.at:
                last.pieces.append(piece)
                last.length += piece.length
            else:
                segments.append(Segment(group, piece.at, piece.length, [piece]))
        return segments

    def spans(self, offset: int, n: int) -> list[tuple[int, int, int]]:
        """Where elements ``[offset, offset + n)`` of the bucket go in the reduce-scattered buffer:
        ``(buffer position, position in the parameter, length)`` per rank's part they touch."""
        spans, e = [], offset
        while e < offset + n:
            k, within = divmod(e, self.per_rank)
            length = min(self.per_rank - within, offset + n - e)
            spans.append((k * self.chunk + within, e - offset, length))
            e += length
        return spans

    def flat(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s elements in travel order: a view when its memory is one dense block, else a copy."""
        view = view_in_order(p, p, layout_of(p))
        return view if view is not None else p.detach().reshape(-1)

    def frozen(self) -> list[tuple[Segment, Piece]]:
        """This rank's pieces of parameters frozen since the layout was agreed (``requires_grad_(False)``)."""
        return [(s, piece) for s in self.segments for piece in s.pieces if not self.params[piece.param].requires_grad]

    def refresh_values(self) -> None:
        """This rank's part of the parameters, read from the parameters themselves."""
        with torch.no_grad():
            for segment in self.segments:
                for piece in segment.pieces:
                    source = self.flat(self.params[piece.param])
                    self.values[piece.at : piece.at + piece.length].copy_(source[piece.start : piece.start + piece.length])

    def write_parameters(self, gathered: torch.Tensor) -> None:
        """Every rank's part (``gathered``: the ranks' parts in order) into the parameters."""
        with torch.no_grad():
            for p, offset, n in zip(self.params, self.plan.offsets, self.plan.numels):
                source = gathered[offset : offset + n]
                view = view_in_order(p, p, layout_of(p))
                if view is not None:
                    view.copy_(source)
                else:
                    p.copy_(source.view(p.shape))

    def gather_request(self, set_id: int) -> tuple[Request, dict]:
        request = Request("allgather", f"ZeroRedundancyOptimizer.params.{self.plan.index}", [self.values],
                          device=self.plan.device, set_id=set_id)
        return request, {"rows": [[self.per_rank] * self.size]}


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


# ---------------------------------------------------------------------------------------------
# the shards of one layout, and the full state dict


class Shards:
    """The shards of one layout on this rank: its segments in the wrapped optimizer's order, that
    optimizer (``optim``; None when this rank's part is empty), and how every rank's local state maps
    to the full state dict. ``params``/``param_groups``: the ZeroRedundancyOptimizer's (every
    parameter, by index); ``size == 1``: no shards, the wrapped optimizer steps the parameters."""

    def __init__(self, settings: ZeroSettings, params: Sequence[torch.Tensor], param_groups: Sequence[dict],
                 plans: Sequence[PlannedBucket], trainable: Sequence[torch.Tensor], size: int, rank: int,
                 tails: Sequence[int]) -> None:
        self.params = list(params)
        self.index = {p: i for i, p in enumerate(self.params)}
        self.group_of = {p: g for g, group in enumerate(param_groups) for p in group["params"]}
        self.size, self.rank = size, rank
        self.buckets = [BucketShard(plan, [trainable[i] for i in plan.param_indices], size, rank, tail, self.group_of)
                        for plan, tail in zip(plans, tails)] if size > 1 else []
        options = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
        if size == 1:
            groups = [{**o, "params": list(g["params"])} for o, g in zip(options, param_groups)]
        else:
            mine = self.owners(rank)
            groups = [{**o, "params": [s.tensor for s, _ in mine if s.group == gi]} for gi, o in enumerate(options)]
        self.optim = settings.optimizer_class(groups, **settings.defaults) if any(g["params"] for g in groups) else None

    def owners(self, rank: int) -> list[tuple[Segment, BucketShard]]:
        """``rank``'s segments (with their buckets) in its wrapped optimizer's index order: group by
        group, bucket order within a group (this rank's own segments hold its tensors)."""
        pairs = [(s, b) for b in self.buckets for s in (b.segments if rank == self.rank else b.segments_of(rank))]
        return sorted(pairs, key=lambda pair: pair[0].group)  # stable

    def local_state(self) -> dict:
        """This rank's wrapped optimizer's state (CPU tensors), by its local index."""
        if self.optim is None:
            return {}
        return {i: {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in s.items()}
                for i, s in self.optim.state_dict()["state"].items()}

    def assemble(self, every: Sequence[dict]) -> dict:
        """The full state (by parameter index) from every rank's ``local_state()``."""
        if self.size == 1:
            return dict(every[0])
        full: dict[int, dict] = {}
        for rank, local in enumerate(every):
            for i, (segment, bucket) in enumerate(self.owners(rank)):
                state = local.get(i)
                if not state:
                    continue
                for piece in segment.pieces:
                    p = bucket.params[piece.param]
                    entry = full.setdefault(self.index[p], {})
                    for key, value in state.items():
                        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == segment.length:
                            target = entry.get(key)
                            if target is None:
                                target = entry[key] = torch.zeros(p.numel(), dtype=value.dtype)
                            at = piece.at - segment.start
                            target[piece.start : piece.start + piece.length].copy_(value[at : at + piece.length])
                        elif key not in entry:  # a copy: optimizers update step counts in place
                            entry[key] = value.clone() if torch.is_tensor(value) else value
        for i, entry in full.items():  # flat, in travel order -> the parameter's shape and memory layout
            p = self.params[i]
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == p.numel() and p.dim() != 1:
                    shaped = torch.empty_strided(p.shape, layout_of(p), dtype=value.dtype)
                    shaped.as_strided((p.numel(),), (1,)).copy_(value)
                    entry[key] = shaped
        return full

    def load(self, full: dict) -> None:
        """This rank's part of ``full`` (by parameter index) into its wrapped optimizer."""
        if self.optim is None:
            return
        if self.size == 1:  # the wrapped optimizer holds every parameter, in the same order
            self.optim.load_state_dict(self._local_dict(dict(full)))
            return
        local = {}
        for i, (segment, bucket) in enumerate(self.owners(self.rank)):
            entries = [(piece, full.get(self.index[bucket.params[piece.param]])) for piece in segment.pieces]
            if not any(entry for _, entry in entries):
                continue
            state: dict[str, Any] = {}
            for piece, entry in entries:
                p = bucket.params[piece.param]
                for key, value in (entry or {}).items():
                    if per_element(value, p, key):
                        target = state.get(key)
                        if target is None:
                            target = state[key] = torch.zeros(segment.length, dtype=value.dtype)
                        flat = travel_order(value.detach().cpu(), p)
                        at = piece.at - segment.start
                        target[at : at + piece.length].copy_(flat[piece.start : piece.start + piece.length])
                    elif key not in state:  # a copy: one tensor shared by two states would count twice
                        state[key] = value.detach().clone() if torch.is_tensor(value) else value
            local[i] = state
        self.optim.load_state_dict(self._local_dict(local))

    def _local_dict(self, state: dict) -> dict:
        groups, at = [], 0
        for group in self.optim.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(at, at + n))})
            at += n
        return {"state": state, "param_groups": groups}

    def state_bytes(self) -> int:
        """Bytes of tensors in this rank's optimizer state."""
        if self.optim is None:
            return 0
        return sum(v.numel() * v.element_size() for s in self.optim.state.values() for v in s.values()
                   if torch.is_tensor(v))


def travel_order(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``value`` (shaped like ``p``) flat, in the order ``p``'s elements travel (its memory order)."""
    laid_out = torch.empty_strided(p.shape, layout_of(p), dtype=value.dtype)
    laid_out.copy_(value)
    return laid_out.as_strided((p.numel(),), (1,))


@contextlib.contextmanager
def keeping_frozen(shards: Shards, scalars: dict) -> Iterator[None]:
    """The wrapped optimizer's step leaves the elements of parameters frozen since the layout was
    agreed as they were, values and per-element state (DistributedOptimizer hands them no gradient,
    so its optimizer skips them); their segments step the other elements. Their per-parameter state
    (step counts), shared with those elements, is kept in ``scalars`` by parameter index for the full
    state. Only the step in which a parameter was frozen has any: the next layout leaves it out."""
    kept = []
    for bucket in shards.buckets:
        for segment, piece in bucket.frozen():
            at = piece.at - segment.start
            state = shards.optim.state.get(segment.tensor, {})
            moments = {k: v[at : at + piece.length].clone() for k, v in state.items()
                       if torch.is_tensor(v) and v.dim() == 1 and v.numel() == segment.length}
            scalars.setdefault(shards.index[bucket.params[piece.param]], {
                k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items() if k not in moments})
            kept.append((segment, at, piece.length, segment.tensor[at : at + piece.length].clone(), moments))
    yield
    with torch.no_grad():
        for segment, at, length, values, moments in kept:
            segment.tensor[at : at + length].copy_(values)
            state = shards.optim.state.get(segment.tensor, {})
            for key, value in moments.items():
                state[key][at : at + length].copy_(value)


def per_element(value: Any, p: torch.Tensor, key: str) -> bool:
    """A state value with one element per parameter element (a moment), as opposed to one per
    parameter (a step count): shaped like the parameter (for a 0-dim parameter, anything but
    ``step``)."""
    return torch.is_tensor(value) and value.shape == p.shape and (p.dim() > 0 or key != "step")


# ---------------------------------------------------------------------------------------------
# the optimizer's methods over DistributedOptimizer's


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
                      settings: BucketSettings) -> list[Bucket]:
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
        if self._size == 1:
            return standard_buckets(plans, trainable, settings)
        return [ShardedBucket(b.plan, b.params, b.plan.dtype, settings, b) for b in self._shards.buckets]

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

    def wait_parameters(self) -> None:
        """Write every parameter the last ``step()`` gathered (with ``overlap_with_forward``, before
        reading parameters outside the model's forward and ``state_dict()``)."""
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

    def _wait_parameters(self, upto: int | None = None) -> None:
        """Write the gathered parameters of the allgathers in flight (those launched up to position
        ``upto``, or all) into the parameters."""
        count = len(self._gathers) if upto is None else min(upto + 1, len(self._gathers))
        for handle, bucket in self._gathers[:count]:
            outs, _ = handle.wait()
            bucket.write_parameters(outs[0])
        self._gathers = self._gathers[count:]

    def _hook_model(self, model: torch.nn.Module) -> None:
        """Each module's forward (and the model's ``state_dict()``) waits for the allgathers holding its
        parameters."""
        me = weakref.ref(self)

        def before_forward(module: torch.nn.Module, _inputs: Any) -> None:
            opt = me()
            if opt is None or not opt._gathers:
                return
            mine = set(module.parameters(recurse=False))
            last = max((k for k, (_, b) in enumerate(opt._gathers) if mine.intersection(b.params)), default=-1)
            if last >= 0:
                opt._wait_parameters(last)

        def before_state_dict(*_args: Any, **_kwargs: Any) -> None:
            opt = me()
            if opt is not None:
                opt._wait_parameters()

        for module in model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(before_forward)
        model.register_state_dict_pre_hook(before_state_dict)

    def stand_in_until_all_joined(self) -> None:
        """A joined rank steps its shard on the others' averaged gradients (its own count as zeros)
        and takes part in the parameter allgathers, until every rank has joined."""
        while self._buckets.stand_in_step(write=True):
            self._shard_step()
        self._wait_parameters()

    def _settle_parameters(self) -> None:
        """(``zero_grad``, ``close``) The parameters gathered by the last step are written."""
        self._wait_parameters()

    # -- the state dict ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The full state dict (the wrapped class's format over every parameter), gathered from every
        rank: a collective, unless ``consolidate_state_dict(to=r)`` ran since the last step (then rank
        ``r`` returns what it gathered, and the other ranks raise, as torch's do)."""
        if self._consolidated_to is not None:
            if self._consolidated is None:
                raise RuntimeError(f"ZeroRedundancyOptimizer.state_dict(): the state was consolidated to rank "
                                   f"{self._consolidated_to} (consolidate_state_dict(to={self._consolidated_to})), "
                                   f"not to this rank. Call state_dict() on rank {self._consolidated_to}, or call "
                                   f"state_dict() on every rank without consolidating to gather it everywhere.")
            return self._consolidated
        return self._full_state_dict(self._gather())

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state for rank ``to`` (a collective: call it on every rank); until the next
        step, ``state_dict()`` on that rank returns it (torch's ``ZeroRedundancyOptimizer`` contract)."""
        full = self._gather()
        self._consolidated_to = to
        self._consolidated = self._full_state_dict(full) if current_job().world.rank == to else None

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict (from any world size, or from the plain optimizer class): the
        hyper-parameters at once, each rank's part of the state at the next step."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(g["params"]) for saved, g in zip(groups, self.param_groups)):
            raise ValueError("ZeroRedundancyOptimizer.load_state_dict: the state dict's parameter groups do not match "
                             "this optimizer's (number of groups, or of parameters in a group). Load a state dict "
                             "saved from the same model and optimizer parameter groups.")
        if self._buckets.in_flight:
            try:
                self._reduce_step()  # finish what is in flight; the caller's next step starts anew
            except CollectiveError:
                pass  # the job broke (an elastic restore follows): nothing in flight is worth keeping
        self._reset_step()
        # the k-th saved parameter is this optimizer's k-th (torch's rule), whatever index it was saved under
        position = {int(saved): k for k, saved in enumerate(i for g in groups for i in g["params"])}
        self._pending = {position[int(i)]: v for i, v in state_dict["state"].items()}
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._consolidated, self._consolidated_to = None, None

    def _take_pending(self) -> dict:
        pending, self._pending = self._pending, None
        return pending

    def _gather(self) -> dict:
        """The full state by parameter index, from every rank's shard (a collective in a job of
        several ranks); a full state loaded but not yet handed out is that state."""
        self._wait_parameters()
        if self._pending is not None:  # every rank loaded it (load_state_dict is called on every rank)
            return dict(self._pending)
        shards = self._shards
        if self._size == 1:
            return shards.assemble([shards.local_state()])
        self._state_calls += 1
        every = allgather_object((shards.local_state(), self._frozen_scalars), name=f"ZeroRedundancyOptimizer.state."
                                 f"{self._schedule.number}.{self._state_calls}", process_set=self._process_set)
        full = {**self._parked, **shards.assemble([local for local, _ in every])}
        for _, frozen in every:  # the owners of a just-frozen parameter's pieces kept its step counts
            for i, scalars in frozen.items():
                if i in full:
                    full[i].update(scalars)
        return full

    def _full_state_dict(self, full: dict) -> dict:
        groups, at = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(at, at + n))})
            at += n
        return {"state": dict(sorted(full.items())), "param_groups": groups}

    def state_bytes(self) -> int:
        """Bytes of tensors in this rank's optimizer state (its shard's)."""
        return self._shards.state_bytes() if self._shards is not None else 0



def sharded_steps() -> dict:
    """``ShardedSteps``' methods, for a dynamic class's namespace (over DistributedOptimizer's)."""
    return {k: v for k, v in ShardedSteps.__dict__.items() if not k.startswith("__")}


__all__ = ["ELEMENTWISE", "BucketShard", "Piece", "Segment", "ShardedBucket", "ShardedSteps", "Shards", "ZeroSettings",
           "check_closure_free", "check_elementwise", "per_element", "plain_option", "sharded_steps", "travel_order"]
