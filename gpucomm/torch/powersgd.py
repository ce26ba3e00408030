"""PowerSGD in ``DistributedOptimizer``'s buckets (``compression=hvd.Compression.powersgd(...)``).

PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019; the algorithm PyTorch DDP's
``powerSGD_hook`` runs) replaces the allreduce of a gradient matrix M (n x m: a weight viewed as
``shape[0] x rest``) by two allreduces of thin factors, one power-iteration step:

1. M := gradient + this rank's error from the last step (error feedback);
2. P := M Q, allreduced (every rank's P summed), then orthogonalised (its columns orthonormal);
3. Q := M^T P, allreduced and scaled as the gradients are (averaged, or summed);
4. the gradient becomes P Q^T, and this rank's error M - P Q^T (in the units of its own
   contribution) is kept for the next step; Q is kept too, as the next step's start (warm start).

So a matrix costs (n + m) * rank elements on the wire instead of n * m. Q is the same on every rank
(it is an allreduce result, or its seeded start), P is orthogonalised from the same allreduced
values on every rank, so every rank computes the same gradient, bit for bit on like machines.

How it runs here: each planned bucket is split into its matrices worth compressing (a
``PowerSGDBucket``) and the rest (biases, norms, small matrices: an ordinary bucket of the kind
the wire dtype gives, ``buckets.standard_bucket``). A ``PowerSGDBucket`` is a two-phase bucket:
its P allreduce (all its matrices' P in one buffer, with bucket 0's training flag and the finite
check's slots in the tail) is launched while backward runs, like any bucket; ``finish`` launches
its Q allreduce as soon as its P is back (``buckets.GradientBuckets.finish``). Every collective
sits on the optimizer's fixed schedule; nothing is negotiated in steady state.

The first ``start_iter`` steps are averaged uncompressed (the same buckets send the gradients
themselves, one phase), as DDP does. The state (each matrix's Q and this rank's error, and the
step count) is kept per parameter, so re-cut buckets keep it; ``PowerSGDState.state_dict`` is
saved with the optimizer's ``state_dict()``. Errors are this rank's own: a state dict another
process wrote (a checkpoint, rank 0's state broadcast to the others) restores Q and the step count,
while each rank keeps its own errors (none in a fresh process).
"""

from __future__ import annotations

import uuid
from typing import Sequence

import torch

from ..dataplane.bucket_kinds import Bucket  # the bucket class PowerSGD's buckets extend
from .compression import NoneCompressor, PowerSGD
from .submission import (BucketSettings, MakeBuckets, PlannedBucket, gradient_targets, gradient_to_send,
                         standard_bucket, sub_plan)

HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the factors are computed and the error kept in: float32 for half-precision
    gradients (a low-rank product and a running error lose too much in 8 or 11 bits), else the
    gradient's own."""
    return torch.float32 if dtype in HALF else dtype


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """``p`` (rows x rank, rows >= rank) with orthonormal columns spanning the same space: the Q of
    its reduced QR decomposition (Householder: well defined for rank-deficient input, e.g. an
    all-zero gradient, where Gram-Schmidt divides by zero)."""
    return torch.linalg.qr(p, mode="reduced").Q


class PowerSGDState:
    """What PowerSGD keeps between steps for one optimizer: per compressed parameter its warm-start Q
    (columns x rank, the same on every rank) and this rank's error (rows x columns), and the number
    of steps synchronized (before ``start_iter``: uncompressed). ``params``: the optimizer's
    parameters in order (the state dict indexes them so); ``size``: the ranks the gradients are
    averaged over."""

    def __init__(self, settings: PowerSGD, params: Sequence[torch.Tensor]) -> None:
        self.settings = settings
        self.params = list(params)
        self.index = {p: i for i, p in enumerate(self.params)}
        self.iteration = 0
        self.q: dict[torch.Tensor, torch.Tensor] = {}
        self.error: dict[torch.Tensor, torch.Tensor] = {}
        self.owner = uuid.uuid4().hex  # whose errors ``error`` holds: this optimizer's, in this process

    @property
    def compressing(self) -> bool:
        """This step sends low-rank factors (False during the first ``start_iter`` steps)."""
        return self.iteration >= self.settings.start_iter

    def step_done(self) -> None:
        self.iteration += 1

    def matrix(self, p: torch.Tensor) -> tuple[int, int, int] | None:
        """``(rows, columns, rank)`` of ``p``'s gradient as PowerSGD compresses it, or None when it
        is not worth compressing (fewer than 2 dimensions, or saving less than
        ``min_compression_rate``): DDP's rule."""
        if p.dim() < 2 or not p.dtype.is_floating_point or p.numel() == 0:
            return None
        rows = p.shape[0]
        cols = p.numel() // rows
        rank = min(rows, cols, self.settings.rank)
        if rows * cols < self.settings.min_compression_rate * (rows + cols) * rank:
            return None
        return rows, cols, rank

    def warm_q(self, p: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
        """``p``'s Q: kept from the last step, or drawn from a generator seeded with the settings'
        seed and ``p``'s index (the same on every rank, whatever order the buckets run in)."""
        q = self.q.get(p)
        if q is None:
            _, cols, rank = shape
            generator = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + self.index[p])
            q = torch.randn(cols, rank, generator=generator, dtype=torch.float32)
            q = self.q[p] = q.to(device=p.device, dtype=compute_dtype(p.dtype))
        return q

    def state_dict(self) -> dict:
        """Q and error of each parameter by its index in the optimizer, the step count, and whose
        errors they are."""
        return {"iteration": self.iteration, "owner": self.owner,
                "q": {self.index[p]: q for p, q in self.q.items()},
                "error": {self.index[p]: e for p, e in self.error.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Take the step count and every Q from ``state``; the errors only when this optimizer wrote
        them (an elastic restore, a checkpoint reloaded by the same process): another rank's or
        another process's errors are theirs to send, so this rank keeps its own."""
        self.iteration = int(state["iteration"])
        self.q = {}
        for i, q in state.get("q", {}).items():
            p = self.params[int(i)]
            self.q[p] = q.detach().to(device=p.device, dtype=compute_dtype(p.dtype)).clone()
        if state.get("owner") == self.owner:
            self.error = {}
            for i, e in state.get("error", {}).items():
                p = self.params[int(i)]
                self.error[p] = e.detach().to(device=p.device, dtype=compute_dtype(p.dtype)).clone()


class PowerSGDBucket(Bucket):
    """The compressed matrices of one planned bucket: P in the first phase, Q in the second (see
    the module doc); during the first ``start_iter`` steps, the gradients themselves in one phase.
    ``wire``: the dtype P and Q travel in; ``size``: the ranks the gradients are averaged over."""

    def __init__(self, plan: PlannedBucket, params: list[torch.Tensor], wire: torch.dtype, settings: BucketSettings,
                 state: PowerSGDState, size: int) -> None:
        super().__init__(plan, params, wire, settings)
        self.state, self.size = state, size
        self.name = f"DistributedOptimizer.powersgd.{plan.index}"
        self.shapes = [state.matrix(p) for p in params]
        self.compute = compute_dtype(plan.dtype)
        self.p_offsets, self.q_offsets = [], []
        p_total = q_total = 0
        for rows, cols, rank in self.shapes:
            self.p_offsets.append(p_total)
            self.q_offsets.append(q_total)
            p_total += rows * rank
            q_total += cols * rank
        self.p_total, self.q_total = p_total, q_total
        self.compressed = False  # this step sends factors (else the gradients themselves)
        self.first_numel = 0  # elements before the tail in this step's first phase
        self.full: torch.Tensor | None = None  # this step's first-phase buffer
        self.ms: list[torch.Tensor] = []  # each matrix's M (gradient + error); becomes the next error
        self.ps: list[torch.Tensor] = []  # each matrix's orthogonalised P

    # -- phase one -------------------------------------------------------------------------------
    def _begin(self) -> int:
        """Decide this step's form (the same on every rank: the step count is) and return the
        first phase's element count before the tail."""
        self.compressed = self.state.compressing
        self.first_numel = self.p_total if self.compressed else self.plan.numel
        return self.first_numel

    def fill(self) -> list[torch.Tensor]:
        settings, state = self.settings, self.state
        numel = self._begin()
        full = settings.buffers.get(self.plan.device, self.wire_dtype, numel + self.tail(), slot=self.plan.index)
        grads = [gradient_to_send(p) for p in self.params]
        scale = settings.prescale * settings.postscale  # P is averaged too: no overflow on a half-precision wire
        with torch.no_grad():
            if not self.compressed:
                for g, offset, n in zip(grads, self.plan.offsets, self.plan.numels):
                    full[offset : offset + n].copy_(g.view(-1) if scale == 1.0 else g.view(-1) * scale)
            else:
                self.ms = []
                for p, g, shape, offset in zip(self.params, grads, self.shapes, self.p_offsets):
                    rows, cols, rank = shape
                    m = state.error.get(p)
                    if m is None:
                        m = state.error[p] = g.view(rows, cols).to(self.compute, copy=True)
                    else:
                        m.add_(g.view(rows, cols))  # the error becomes M in place (no allocation)
                    self.ms.append(m)
                    product = torch.matmul(m, state.warm_q(p, shape))
                    full[offset : offset + rows * rank].view(rows, rank).copy_(product.mul_(scale))
            self._fill_tail(full, numel, grads)
        self.full, self.in_flight = full, grads
        return [full]

    def _fill_tail(self, full: torch.Tensor, numel: int, grads: list[torch.Tensor]) -> None:
        if self.first:
            full[numel : numel + 1].fill_(1)  # the training flag
        check = self.settings.check
        if check is not None:
            at = numel + self.first
            slots = full[at : at + check.size]
            slots.zero_()
            self.checks = slots
            check.search(grads, slots[check.rank : check.rank + 1])

    def zeros(self) -> list[torch.Tensor]:
        numel = self._begin()
        return [torch.zeros(numel + self.tail(), dtype=self.wire_dtype, device=self.plan.device)]

    def training_flag(self, result: list[torch.Tensor]) -> torch.Tensor:
        return result[0][self.first_numel]

    # -- phase two -------------------------------------------------------------------------------
    def second_phase(self, result: list[torch.Tensor]) -> list[torch.Tensor] | None:
        if not self.compressed:
            return None
        reduced, settings = result[0], self.settings
        q_full = settings.buffers.get(self.plan.device, self.wire_dtype, self.q_total, slot=-1 - self.plan.index)
        self.ps = []
        with torch.no_grad():
            for m, shape, p_at, q_at in zip(self.ms, self.shapes, self.p_offsets, self.q_offsets):
                rows, cols, rank = shape
                p = orthogonalize(reduced[p_at : p_at + rows * rank].view(rows, rank).to(self.compute))
                self.ps.append(p)
                q = torch.matmul(m.t(), p)
                if settings.prescale != 1.0:
                    q.mul_(settings.prescale)
                q_full[q_at : q_at + cols * rank].view(cols, rank).copy_(q)
        return [q_full]

    def second_zeros(self) -> list[torch.Tensor] | None:
        if not self.compressed:
            return None
        return [torch.zeros(self.q_total, dtype=self.wire_dtype, device=self.plan.device)]

    def _keep_q(self, reduced: torch.Tensor) -> list[torch.Tensor]:
        """The reduced Q of each matrix (scaled as the gradients are), kept as its next warm start."""
        post, kept = self.settings.postscale, []
        for p, shape, q_at in zip(self.params, self.shapes, self.q_offsets):
            _, cols, rank = shape
            q = self.state.warm_q(p, shape)
            q.copy_(reduced[q_at : q_at + cols * rank].view(cols, rank))
            if post != 1.0:
                q.mul_(post)
            kept.append(q)
        return kept

    def write_gradients(self, result: list[torch.Tensor]) -> None:
        targets = gradient_targets(self.params)
        with torch.no_grad():
            if not self.compressed:  # the gradients themselves, averaged
                for t, p, offset, n in zip(targets, self.params, self.plan.offsets, self.plan.numels):
                    if t is not None:
                        t.copy_(result[0][offset : offset + n].view(p.shape))
                return
            settings = self.settings
            # the result is scale * (sum over ranks); this rank's share of it, 1 / (scale * size), is
            # what its M is measured against (the average for hvd.Average, a 1/size part for hvd.Sum)
            share = 1.0 / (settings.prescale * settings.postscale * self.size)
            for t, p, m, pm, q in zip(targets, self.params, self.ms, self.ps, self._keep_q(result[0])):
                if t is not None and t.is_contiguous() and t.dtype == self.compute:
                    approx = torch.matmul(pm, q.t(), out=t.view(m.shape))  # straight into p.grad: no temporary
                else:
                    approx = torch.matmul(pm, q.t())
                    if t is not None:
                        t.copy_(approx.view(p.shape))
                m.sub_(approx, alpha=share)  # this rank's error, kept in place for the next step
        self.ms, self.ps = [], []

    def stood_in(self, result: list[torch.Tensor]) -> None:
        if self.compressed:  # a joined rank keeps the warm start in step with the others
            with torch.no_grad():
                self._keep_q(result[0])

    def reset(self) -> None:
        super().reset()
        self.full = None
        self.ms, self.ps = [], []


def powersgd_buckets(state: PowerSGDState, size: int) -> MakeBuckets:
    """Build a layout's buckets for PowerSGD: each planned bucket becomes its uncompressed part (an
    ordinary bucket sent through ``state.settings.wire``) followed by its compressed matrices (a
    ``PowerSGDBucket``), numbered in that order."""
    wire = state.settings.wire

    def make(plans: Sequence[PlannedBucket], trainable: Sequence[torch.Tensor],
             settings: BucketSettings) -> list[Bucket]:
        buckets: list[Bucket] = []
        for plan in plans:
            low = [i for i in plan.param_indices if state.matrix(trainable[i]) is not None]
            plain = [i for i in plan.param_indices if state.matrix(trainable[i]) is None]
            if plain:
                sub = sub_plan(len(buckets), trainable, plain)
                buckets.append(standard_bucket(sub, [trainable[i] for i in plain], settings))
            if low:
                sub = sub_plan(len(buckets), trainable, low)
                factors = plan.dtype if wire is NoneCompressor else wire.wire_dtype
                buckets.append(PowerSGDBucket(sub, [trainable[i] for i in low], factors, settings, state, size))
        return buckets

    return make


__all__ = ["PowerSGDBucket", "PowerSGDState", "compute_dtype", "orthogonalize", "powersgd_buckets"]
