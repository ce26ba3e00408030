"""Which of a bucket's pieces holds an Inf or NaN: the finite check's path where the checked pack
kernels do not run (CPU buffers, the torch-ops fallback on a GPU, a user compressor's tensors). The
result is written into a 1-element tensor, in the slot encoding of ``FiniteSlots`` (the front's ``finite_check``):
0 if all finite, else 1 + the first such piece's index (capped).

* CPU: one sum over the data (a vectorised pass, the cheapest reduction torch has there; Inf and
  NaN propagate), then, only when that sum is not finite, a search piece by piece. A sum of finite
  values that overflows finds no piece and reports nothing.
* GPU: device ops and no host sync: an L1 norm per piece in float32 (one multi-tensor launch; Inf
  and NaN propagate), then a few tiny ops on one value per piece. Finite gradients whose absolute
  values sum past 3.4e38 in one tensor would be reported too.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

from ..backends.base import torch_at_least

__all__ = ["AUTO_BUDGET", "FiniteSlots", "FirstNonFinite", "exact_limit", "first_bad_on_device"]

AUTO_BUDGET = 0.005  # the default mode's search costs at most this share of the step, on average


class FirstNonFinite:
    """Repeats the search over pieces of the same sizes step after step (on a GPU, the indices of
    each layout's non-empty pieces are uploaded once, then kept)."""

    __slots__ = ("_layouts",)

    def __init__(self) -> None:
        self._layouts: dict[tuple, tuple[list[int], torch.Tensor]] = {}

    def __call__(self, pieces: Sequence[torch.Tensor], out: torch.Tensor, limit: int,
                 whole: torch.Tensor | None = None) -> None:
        """``out`` (1 element) := 0 if every piece is finite, else min(1 + first bad index, ``limit``).
        ``whole``: the pieces' data as one tensor, when they are consecutive parts of one (one sum)."""
        if out.device.type == "cpu":
            out.fill_(_first_bad_on_host(pieces, limit, whole))
            return
        key = (out.device, *(t.numel() for t in pieces))
        layout = self._layouts.get(key)
        if layout is None:
            kept = [i for i, t in enumerate(pieces) if t.numel()]  # an empty piece has no norm, nor Inf
            layout = self._layouts[key] = (kept, torch.tensor(kept, dtype=torch.int64, device=out.device))
        kept, index = layout
        if not kept:
            out.zero_()
            return
        first_bad_on_device([pieces[i] for i in kept], index, len(pieces), out, limit)


# ``torch._foreach_norm`` takes ``dtype`` from torch 2.4 on; before, each piece is cast first
_NORM_TAKES_DTYPE = torch_at_least(2, 4)


def first_bad_on_device(kept: Sequence[torch.Tensor], index: torch.Tensor, count: int, out: torch.Tensor,
                        limit: int) -> None:
    """The device search over the non-empty pieces ``kept`` (``index``: their positions among ``count``
    pieces, on ``out``'s device): device ops only, no host sync. Norms in float32, float64 for float64
    pieces (torch refuses a narrowing dtype; a float16 sum would overflow at 65504 and report finite
    gradients as non-finite)."""
    wide = torch.float64 if kept[0].dtype == torch.float64 else torch.float32
    if _NORM_TAKES_DTYPE:
        norms = torch._foreach_norm(list(kept), 1, dtype=wide)
    else:  # torch < 2.4: one cast per piece (a copy), then the norms
        norms = torch._foreach_norm([t.to(wide) for t in kept], 1)
    bad = ~torch.isfinite(torch.stack(norms))
    first = torch.where(bad, index, count).min()
    out.copy_(torch.where(first < count, (first + 1).clamp(max=limit), 0).reshape(out.shape))


def _first_bad_on_host(pieces: Sequence[torch.Tensor], limit: int, whole: torch.Tensor | None) -> int:
    if whole is not None:
        totals = [whole] if whole.numel() else []
    else:
        totals = [t for t in pieces if t.numel()]
    if all(math.isfinite(float(_sum(t))) for t in totals):
        return 0
    for i, t in enumerate(pieces):
        if t.numel() and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return min(i + 1, limit)
    return 0  # a sum of finite values overflowed: nothing is Inf or NaN


def _sum(t: torch.Tensor) -> torch.Tensor:
    return t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum()


def exact_limit(dtype: torch.dtype) -> int:
    """The largest integer ``dtype`` holds exactly with all smaller ones (the slot values' ceiling)."""
    if dtype == torch.bfloat16:
        return 256
    if dtype == torch.float16:
        return 2048
    if dtype.is_floating_point:
        return 1 << 24 if dtype == torch.float32 else 1 << 53
    return torch.iinfo(dtype).max


class FiniteSlots:
    """The finite check as a DistributedOptimizer's buckets run it: this rank's index ``rank`` among
    the ``size`` ranks of the set (its slot in every bucket's tail), and the search used where the
    checked pack kernels do not run (CPU view buckets, torch ops, a user compressor). ``mode``: the
    front's ("raise", "warn" or "auto"), carried for its report.

    ``budget`` (the default mode's: ``AUTO_BUDGET``): the share of the step the search may cost, on
    average. The search's own host time is measured against the steps' (``step_done``); while it fits,
    every step is searched, else the steps are searched in turn, as often as the budget allows (a
    token bucket), so a model whose gradients take long to read (a large MLP on a CPU) pays at most
    that share and a non-finite gradient, which stays non-finite once it reached the weights, is
    still reported within a few steps. A rank that skips a step writes 0 ("nothing found") into its
    slot: ranks need not agree on which steps they search. None: every step (the explicit modes)."""

    def __init__(self, mode: str, rank: int, size: int, budget: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.mode, self.rank, self.size = mode, rank, size
        self.deferred = mode != "raise"  # a GPU's slots are read a step later, with no host sync
        self.budget, self._clock = budget, clock
        self._search = FirstNonFinite()
        self._searching = True  # this step's buckets are searched
        self._spent = 0.0  # host seconds the search took this step
        self._cost = 0.0  # ... in the last step searched
        self._credit = 0.0  # seconds of search the budget has paid for so far
        self._last_step: float | None = None  # when the last step ended
        self.searched_steps = self.skipped_steps = 0

    def search(self, pieces: Sequence[torch.Tensor], out: torch.Tensor, whole: torch.Tensor | None = None) -> None:
        """``out`` := this rank's slot value for a bucket made of ``pieces`` (``whole``: their data as
        one tensor, when consecutive; see ``FirstNonFinite``); 0 when this step is not searched."""
        if not self._searching:
            out.zero_()
            return
        start = self._clock()
        self._search(pieces, out, self.limit(out.dtype), whole)
        self._spent += self._clock() - start

    def step_done(self) -> None:
        """A step's buckets were all filled: account for what the search cost and decide whether the
        next step is searched (always without a budget)."""
        now = self._clock()
        step = now - self._last_step if self._last_step is not None else None
        self._last_step = now
        if self._searching:
            self.searched_steps += 1
            self._cost = self._spent
        else:
            self.skipped_steps += 1
        self._spent = 0.0
        if self.budget is None or step is None:
            self._searching = True
            return
        self._credit = min(self._credit + self.budget * step, self._cost + self.budget * step)  # no hoarding
        self._searching = self._credit >= self._cost
        if self._searching:
            self._credit -= self._cost

    @staticmethod
    def limit(dtype: torch.dtype) -> int:
        return exact_limit(dtype)
