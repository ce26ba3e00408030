"""Rank-side bodies of the hooks-by-arrival-order tests (importable by spawned ranks).

A model whose backward order can be swapped (``Swap``: ``a(x) + b(x)`` or ``b(x) + a(x)``; autograd hands
the gradients of the branch created last over first), all in one bucket, so that the bucket's last
gradient in the recorded order can come before the others.
"""

from __future__ import annotations

import threading

import torch
import torch.nn as nn

import gpucomm.torch as hvd
from gpucomm.torch.parameters import TWICE_ERROR, ZERO_GRAD_ERROR
from tests.ranks.finite_scenarios import COMPRESSIONS
from tests.ranks.optimizer_scenarios import IN, OUT, batch, half, max_rel_diff, no_sync_step

HIDDEN = 8


class Swap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(IN, HIDDEN), nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(x) + self.a(x) if self.swap else self.a(x) + self.b(x)
        return self.head(torch.tanh(h))


def _step(model: Swap, opt: torch.optim.Optimizer, s: int, rank: int, size: int, set_to_none: bool = True) -> None:
    x, y = batch(s)
    opt.zero_grad(set_to_none=set_to_none)
    nn.functional.mse_loss(model(half(x, rank, size)), half(y, rank, size)).backward()
    opt.step()


def _reference(swaps: list[bool]) -> Swap:
    model = Swap()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s, swap in enumerate(swaps):
        model.swap = swap
        _step(model, opt, s, 0, 1)
    return model


def _counts() -> tuple[int, int]:
    stats = hvd.stats()
    return stats["grad_steps_by_order"], stats["grad_order_changes"]


def order_changes_match_full_batch(set_to_none: bool) -> dict:
    """Steps in one order, then in the other, then back: a step whose order changed is launched at
    synchronize (complete), the order is recorded again, and the result matches the full batch."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = Swap()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    assert len(opt._buckets.buckets) == 1, "the test wants one bucket (GPUCOMM_FUSION_THRESHOLD)"
    swaps = [False, False, False, True, True, True, False, False]
    per_step, hooked = [], []
    for s, swap in enumerate(swaps):
        model.swap = swap
        before = _counts()
        _step(model, opt, s, r, n, set_to_none)
        after = _counts()
        per_step.append((after[0] - before[0], after[1] - before[1]))
        hooked.append(opt._by_order)
    diff = max_rel_diff(model, _reference(swaps))
    hvd.shutdown()
    return {"per_step": per_step, "hooked": hooked, "diff": diff}


def _by_order(steps: int = 2) -> tuple[Swap, torch.optim.Optimizer, int, int]:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = Swap()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for s in range(steps):
        _step(model, opt, s, r, n)
    assert opt._by_order, "hooked by arrival order after a recorded step"
    return model, opt, r, n


def twice_by_order() -> dict:
    """Gradients that come twice in a step, by arrival order: through a last hook (raised in backward, as
    Horovod's), or only through the others' C hooks (raised at synchronize); then back to per-gradient
    hooks, and training goes on."""
    model, opt, r, n = _by_order()
    x, y = batch(5)
    seen = {}
    loss = nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n))
    loss.backward(retain_graph=True)
    try:
        loss.backward()
        seen["last_hook"] = None
    except AssertionError as e:  # autograd hands a hook's AssertionError back as it is
        seen["last_hook"] = str(e)
    opt.synchronize()  # said once already: not again
    seen["after_last_hook"] = opt._by_order
    with opt.skip_synchronize():
        opt.step()
    for s in range(6, 8):
        _step(model, opt, s, r, n)
    seen["again"] = opt._by_order
    # the head's gradients twice (the head comes first in backward: none of its parameters is the bucket's last)
    opt.zero_grad()
    h = torch.tanh(model.a(half(x, r, n)) + model.b(half(x, r, n)))
    nn.functional.mse_loss(model.head(h), half(y, r, n)).backward()
    model.head(h.detach()).sum().backward()
    try:
        opt.synchronize()
        seen["c_hooks"] = None
    except AssertionError as e:
        seen["c_hooks"] = str(e)
    seen["after_c_hooks"] = opt._by_order
    with opt.skip_synchronize():
        opt.step()
    _step(model, opt, 9, r, n)  # and training goes on
    seen["steps"] = opt._steps
    hvd.shutdown()
    seen["twice"] = TWICE_ERROR
    return seen


def zero_grad_after_partial_backward() -> dict:
    """By arrival order, a backward that reached no bucket's last gradient opens the step (through the
    bucket's first) and still refuses ``zero_grad`` before the step (Horovod's guard); a ``no_sync``
    pass does not count."""
    model, opt, r, n = _by_order()
    x, y = batch(5)
    seen = {}
    opt.zero_grad()
    with opt.no_sync():
        model.head(torch.ones(2, HIDDEN)).sum().backward()  # the head only: no bucket's last gradient
    opt.zero_grad()  # allowed: only no_sync's local accumulation happened
    model.head(torch.ones(2, HIDDEN)).sum().backward()
    seen["opened"] = opt._step_opened  # by the bucket's first gradient: a negotiated op now waits for the step
    try:
        opt.zero_grad()
        seen["refused"] = None
    except AssertionError as e:
        seen["refused"] = str(e)
    opt.step()
    hvd.shutdown()
    seen["expected"] = ZERO_GRAD_ERROR
    return seen


def no_sync_and_passes_by_order(steps: int = 5) -> dict:
    """``no_sync`` passes by arrival order average the accumulated sum (against the full batch); then
    ``set_backward_passes_per_step(2)`` goes back to per-gradient hooks and two passes make a step."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = Swap()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref = Swap()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    hooked = []
    for s in range(steps):
        no_sync_step(model, opt, s, r, n)
        hooked.append(opt._by_order)
        _step(ref, ref_opt, s, 0, 1)
    seen = {"hooked": hooked, "diff": max_rel_diff(model, ref)}
    opt.set_backward_passes_per_step(2)
    seen["after_passes"] = opt._by_order
    for s in range(steps, steps + 2):
        x, y = batch(s)
        opt.zero_grad()
        for part in range(2):
            nn.functional.mse_loss(model(half(half(x, r, n), part, 2)), half(half(y, r, n), part, 2)).div(2).backward()
        opt.step()
        _step(ref, ref_opt, s, 0, 1)
    seen["diff_passes"] = max_rel_diff(model, ref)
    seen["by_order_steps"] = hvd.stats()["grad_steps_by_order"]
    hvd.shutdown()
    return seen




def negotiated_op_after_middle_gradients_only() -> dict:
    """By arrival order, rank 1's backward reaches only gradients in the middle of the bucket's recorded
    order (C hooks: no Python hook opens the step), rank 0's the whole model; both then submit a negotiated
    allreduce before ``step()``. Rank 1's submission opens its step first, so the allreduce is placed
    after the step's bucket on both ranks (run with GPUCOMM_ISSUE_ORDER=all: the CUDA rule on CPU tensors).
    Before, rank 1 issued it ahead of the bucket and rank 0 after: on NCCL, a deadlock."""
    model, opt, r, n = _by_order()
    x, y = batch(5)
    opt.zero_grad()
    if r == 0:
        nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
    else:  # b's gradients only: neither the bucket's first (the head's) nor its last (a's)
        model.b(half(x, r, n)).sum().backward()
    seen = {"opened_by_backward": opt._step_opened}
    # the opener, run on another thread than the training loop's, opens nothing: from there it cannot tell
    # whether a backward still runs (a flush would then average zeros for the gradients still to come)
    elsewhere = threading.Thread(target=opt._open_before_negotiated)
    elsewhere.start()
    elsewhere.join(10)
    seen["opened_elsewhere"] = opt._step_opened
    deferred = hvd.stats()["issue_deferred"]
    total = hvd.allreduce(torch.full((3,), float(r + 1)), op=hvd.Sum, name="after_backward")
    seen["opened"] = opt._step_opened
    seen["deferred"] = hvd.stats()["issue_deferred"] - deferred  # it waited for the step's end
    opt.step()
    seen["sum"] = total.tolist()
    _step(model, opt, 6, r, n)  # and training goes on
    seen["steps"] = opt._steps
    # after step(), with hooks by order: a collective opens nothing (no gradient of the next step came yet)
    deferred = hvd.stats()["issue_deferred"]
    hvd.allreduce(torch.ones(1), name="after_step")
    seen["after_step"] = (opt._by_order, opt._step_opened, hvd.stats()["issue_deferred"] - deferred)
    hvd.shutdown()
    return seen


class Lookup(nn.Module):
    """An embedding (its ``sparse`` flag switchable between steps) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(12, HIDDEN), nn.Linear(HIDDEN, OUT)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids).sum(1)))


def _lookup_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, 12, (8, 3), generator=g), torch.randn(8, OUT, generator=g)


SPARSE_FROM = 3  # the embedding's gradient turns sparse at this step, after hooks by arrival order are on


def gradient_turning_sparse_by_order(compression: str) -> dict:
    """An embedding whose gradient is dense in the first steps (hooks by arrival order turn on) and sparse
    from step ``SPARSE_FROM``: its C hook cannot see that, the bucket averages it densely, and it must reach
    the wrapped optimizer sparse as it came (SparseAdam refuses dense ones); hooks then go back to one per
    gradient. Weights match one process on the whole batch. ``compression`` (``COMPRESSIONS``) chooses the
    bucket kind: copied into its bucket as the hooks fire (none), packed at launch (fp16), compressed one
    gradient at a time (a user compressor)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model, reference = Lookup(), Lookup()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=COMPRESSIONS[compression])
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    per_step = []
    for s in range(6):
        model.emb.sparse = reference.emb.sparse = s >= SPARSE_FROM
        ids, y = _lookup_batch(s)
        by_order = opt._by_order
        opt.zero_grad()
        nn.functional.mse_loss(model(half(ids, r, n)), half(y, r, n)).backward()
        opt.synchronize()
        per_step.append((by_order, model.emb.weight.grad.is_sparse))
        with opt.skip_synchronize():
            opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(ids), y).backward()
        ref_opt.step()
    seen = {"per_step": per_step, "diff": max_rel_diff(model, reference),
            "bucket": type(opt._buckets.buckets[0]).__name__}
    hvd.shutdown()
    return seen


def sparse_parameter_unfrozen() -> dict:
    """A sparse embedding frozen when the optimizer is built and unfrozen after two steps: its first
    gradient is averaged on its own at that step's end (``reduce_once``), and reaches the wrapped optimizer
    sparse, as it came; then it trains in the buckets. Weights match one process on the whole batch."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model, reference = Lookup(), Lookup()
    for m in (model, reference):
        m.emb.sparse = True
        m.emb.weight.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    handed: list[bool | None] = []
    for s in range(5):
        if s == 2:
            model.emb.weight.requires_grad_(True)
            reference.emb.weight.requires_grad_(True)
        ids, y = _lookup_batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(half(ids, r, n)), half(y, r, n)).backward()
        opt.synchronize()
        g = model.emb.weight.grad
        handed.append(None if g is None else g.is_sparse)
        with opt.skip_synchronize():
            opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(ids), y).backward()
        ref_opt.step()
    seen = {"handed": handed, "diff": max_rel_diff(model, reference)}
    hvd.shutdown()
    return seen
