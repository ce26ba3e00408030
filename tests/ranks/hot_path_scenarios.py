"""Rank-side bodies of the hot-path tests: what the counters (``hvd.stats()``) show about the fixed
schedule, the response cache and a one-rank job, and the layout checks of DistributedOptimizer."""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.nn as nn

import gpucomm.torch as hvd
from gpucomm import job as jobs
from tests.ranks.optimizer_scenarios import batch, half, make_model, max_rel_diff

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def steady_state_steps(steps: int = 20) -> dict:
    """A model in several buckets: after two warm-up steps, ``steps`` more add no control round;
    the result still equals one process on the full batch."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    before, buckets = None, 0
    for s in range(steps + 2):
        if s == 2:  # after the first step the buckets were cut again once, where backward pauses
            before, buckets = hvd.stats(), len(opt._buckets.buckets)
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
        opt.step()
        ref_opt.zero_grad()
        used = n * (x.shape[0] // n)  # the samples the ranks' equal parts cover
        nn.functional.mse_loss(ref(x[:used]), y[:used]).backward()
        ref_opt.step()
    delta = _delta(before, hvd.stats())
    diff = max_rel_diff(model, ref)
    hvd.shutdown()
    return {"delta": delta, "buckets": buckets, "diff": diff}


def cached_cycle(ops: int = 50) -> dict:
    """One cycle of ``ops`` named async allreduces, first uncached, then all response-cache hits."""
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    cycles = []
    for _ in range(2):
        hvd.barrier()
        before = hvd.stats()
        handles = [hvd.allreduce_async(torch.full((4,), float(i + r)), name=f"cycle.{i}", op=hvd.Sum)
                   for i in range(ops)]
        outs = [hvd.synchronize(h) for h in handles]
        cycles.append(_delta(before, hvd.stats()))
        for i, out in enumerate(outs):
            assert out.tolist() == [n * i + n * (n - 1) / 2] * 4, (i, out)
    hvd.shutdown()
    return {"uncached": cycles[0], "cached": cycles[1]}


def one_rank_inline() -> dict:
    """A one-rank job: collectives of every kind, a barrier, join and an optimizer step, with no
    control plane, no control thread and no control round."""
    hvd.init()
    job = jobs.current()
    before = hvd.stats()
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    assert torch.equal(hvd.allreduce(x, name="a"), x)
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0), x * 2)
    assert torch.equal(hvd.allreduce(torch.tensor([7, 9]), op=hvd.Average), torch.tensor([7, 9]))
    assert torch.equal(hvd.allgather(x, name="g"), x)
    assert torch.equal(hvd.broadcast(x, 0, name="b"), x)
    out, received = hvd.alltoall(x, splits=[3])
    assert torch.equal(out, x) and received.tolist() == [3]
    assert torch.equal(hvd.reducescatter(x, op=hvd.Sum), x)
    assert torch.equal(hvd.synchronize(hvd.allreduce_async_(x.clone(), name="async")), x)
    assert [t.tolist() for t in hvd.grouped_allreduce([x, x[0]], op=hvd.Sum)] == [x.tolist(), x[0].tolist()]
    hvd.barrier()
    assert hvd.join() == 0
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    nn.functional.mse_loss(model(batch(0)[0]), batch(0)[1]).backward()
    opt.step()
    delta = _delta(before, hvd.stats())
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("gpucomm"))
    no_controller = job.controller is None
    hvd.shutdown()
    return {"delta": delta, "threads": threads, "no_controller": no_controller}


def cached_op_forms(x: torch.Tensor) -> dict:
    """One named (so cached after the first call) op of each form on ``x``."""
    return {
        "allreduce": lambda: hvd.allreduce(x, name="c.ar"),
        "allreduce_": lambda: hvd.allreduce_(x, name="c.ar_"),
        "allreduce_async": lambda: hvd.synchronize(hvd.allreduce_async(x, name="c.ara")),
        "broadcast": lambda: hvd.broadcast(x, 0, name="c.bc"),
        "allgather": lambda: hvd.allgather(x, name="c.ag"),
    }


def python_calls_per_cached_op() -> dict:
    """Python function calls (sys.setprofile 'call' events) of one cached op in a one-rank job."""
    hvd.init()
    forms = cached_op_forms(torch.ones(1024))
    from overhead import python_calls  # benchmarks/overhead.py: the same count the benchmark prints

    calls = {}
    for form, fn in forms.items():
        for _ in range(3):
            fn()
        calls[form] = python_calls(fn)
    hvd.shutdown()
    return calls


def trainable_set_changes(steps: int = 6) -> dict:
    """Freeze the middle layer after step 1 and unfreeze it after step 3 (on every rank): each change
    re-verifies the layout once (so does the end of the first, watched step, which cuts the buckets
    where backward pauses); the steps in between send no control message; training equals one
    process on the full batch with the same freezing."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    checks, rounds = [], []
    for s in range(steps):
        for m in (model, ref):
            m[2].weight.requires_grad_(not 2 <= s < 4)
        before = hvd.stats()
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
        opt.step()
        after = hvd.stats()
        checks.append(after["layout_checks"] - before["layout_checks"])
        rounds.append(after["control_rounds"] - before["control_rounds"])
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    diff = max_rel_diff(model, ref)
    hvd.shutdown()
    return {"checks": checks, "rounds": rounds, "diff": diff}


def in_place_prescale() -> dict:
    """In-place allreduces with a prescale, small (reduced by the coordinator) and large (Gloo): the
    prescale is applied once; a mismatch leaves the caller's tensor as it was."""
    hvd.init()
    r = hvd.rank()
    out = {}
    for numel in (4, 8192):
        x = torch.ones(numel)
        hvd.allreduce_(x, op=hvd.Sum, prescale_factor=0.5, name=f"pre.{numel}")
        out[numel] = x[:2].tolist()
    y = torch.ones(3 if r == 0 else 5)
    try:
        hvd.allreduce_(y, op=hvd.Sum, prescale_factor=0.5, name="pre.mismatch")
    except RuntimeError:
        out["after_mismatch"] = sorted(set(y.tolist()))
    hvd.shutdown()
    return out


def mismatched_bucket_layout() -> str:
    """Rank 1 plans other buckets (its own GPUCOMM_FUSION_THRESHOLD): every rank refuses at construction."""
    hvd.init()
    if hvd.rank() == 1:
        os.environ["GPUCOMM_FUSION_THRESHOLD"] = "64"  # a tiny cap: one parameter per bucket
    model = make_model()
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    except ValueError as e:
        message = str(e)
    else:
        message = ""
    hvd.shutdown()
    return message
