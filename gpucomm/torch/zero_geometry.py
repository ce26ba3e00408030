"""ZeRO's shard geometry: how one planned bucket is cut over the ranks (``BucketShard``), and
which pieces of which parameters each rank's part holds (``Piece``, joined per param group into
the ``Segment``s the wrapped optimizer steps).

Partitioning is flat, per bucket: a bucket of ``n`` elements is cut into N equal parts of
``ceil(n / N)`` elements (the last padded), rank ``r`` owning part ``r``; a parameter may straddle
two ranks. Elements are counted in the order they travel (each parameter's memory order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .submission import PlannedBucket, Request, layout_of, view_in_order


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


__all__ = ["BucketShard", "Piece", "Segment"]
