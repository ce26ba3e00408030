"""Rank-side bodies of the DistributedOptimizer tests (importable by spawned ranks).

Each scenario trains the same small model on its half of a fixed batch and compares the result
with a single-process reference trained on the whole batch, computed in the same process.
"""

from __future__ import annotations

import datetime
import warnings

import torch
import torch.nn as nn

import gpucomm.torch as hvd
from gpucomm.torch.parameters import TWICE_ERROR, ZERO_GRAD_ERROR

BATCH, IN, OUT = 16, 6, 3


def make_model(seed: int = 0, hidden: int = 10) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, OUT))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def half(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n]


def make_opt(kind: str, params, **kw) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, **kw)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01, **kw)
    raise ValueError(kind)


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest element-wise relative difference (the exact-equivalence criterion)."""
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters()):
        p, q = p.detach(), q.detach()
        worst = max(worst, float(((p - q).abs() / (q.abs() + 1e-6)).max()))
    return worst


def max_scaled_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest difference relative to each tensor's magnitude (for lossy compression)."""
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters()):
        p, q = p.detach(), q.detach()
        worst = max(worst, float((p - q).abs().max() / q.abs().max()))
    return worst


def reference(kind: str, steps: int, clip: float | None = None, device: str = "cpu") -> nn.Module:
    model = make_model().to(device)
    opt = make_opt(kind, model.parameters())
    for s in range(steps):
        x, y = (t.to(device) for t in batch(s))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


class DoubleWireCompressor:
    """A user compressor the fusion kernels cannot fuse (float64 on the wire): the unfused path."""

    @staticmethod
    def compress(tensor):
        return tensor.double(), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


def train_matches_full_batch(kind: str, steps: int = 5, compression: str = "none", device: str = "cpu",
                             groups: str | None = None) -> float:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    model = make_model().to(device)
    chosen = None
    if groups == "two":
        chosen = 2
    elif groups == "lists":  # weights together, biases left to buckets of their own
        chosen = [[m.weight for m in model if isinstance(m, nn.Linear)]]
    opt = hvd.DistributedOptimizer(make_opt(kind, model.parameters()), named_parameters=model.named_parameters(),
                                   compression=DoubleWireCompressor if compression == "custom"
                                   else getattr(hvd.Compression, compression), groups=chosen)
    if groups == "lists":
        assert sorted(len(b.params) for b in opt._buckets.buckets) == [1, 1, 1, 3]
    assert isinstance(opt, type(make_opt(kind, model.parameters())))
    assert len(opt._buckets.buckets) > 1, "the test wants several buckets (GPUCOMM_FUSION_THRESHOLD)"
    launches, watched = [], None
    for s in range(steps):
        if opt._buckets is not watched:  # the buckets are cut again after the first (watched) CPU step
            watched = opt._buckets
            original = watched._launch
            watched._launch = lambda b, original=original: (launches.append(b.plan.index), original(b))[1]
        x, y = (t.to(device) for t in batch(s))
        opt.zero_grad()
        nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
        # overlap: every bucket was launched by the hooks during backward, in index order, once
        assert launches == list(range(len(opt._buckets.buckets))), launches
        assert all(b.handle is not None for b in opt._buckets.buckets)
        launches.clear()
        opt.step()
    ref = reference(kind, steps, device=device)
    diff = max_rel_diff(model, ref) if compression in ("none", "custom") else max_scaled_diff(model, ref)
    hvd.shutdown()
    return diff


def _ddp_group():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, hvd.size(), True, wait_for_workers=False) if hvd.rank() == 0 else None
    port = hvd.broadcast_object(store.port if store else None, 0, name="ddp_port")
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, hvd.size(), False)
    dist.init_process_group("gloo", store=store, rank=hvd.rank(), world_size=hvd.size(),
                            timeout=datetime.timedelta(seconds=60))
    return store


def train_matches_ddp(kind: str, steps: int = 5) -> float:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    store = _ddp_group()
    ours, base = make_model(), make_model()
    ddp = DDP(base)
    opt = hvd.DistributedOptimizer(make_opt(kind, ours.parameters()), named_parameters=ours.named_parameters())
    ddp_opt = make_opt(kind, ddp.parameters())
    for s in range(steps):
        x, y = batch(s)
        for model, o in ((ours, opt), (ddp, ddp_opt)):
            o.zero_grad()
            nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
            o.step()
    diff = max_rel_diff(ours, base)
    dist.destroy_process_group()
    del store
    hvd.shutdown()
    return diff


def accumulation_matches_full_batch(kind: str, steps: int = 3) -> float:
    """backward_passes_per_step=2: two quarter batches per rank per step, loss halved."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(kind, model.parameters()), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    for s in range(steps):
        x, y = batch(s)
        xs, ys = half(x, r, n), half(y, r, n)
        opt.zero_grad()
        for part in range(2):
            nn.functional.mse_loss(model(half(xs, part, 2)), half(ys, part, 2)).div(2).backward()
            assert all(b.handle is None for b in opt._buckets.buckets) == (part == 0)  # launched on the 2nd pass only
        opt.step()
    diff = max_rel_diff(model, reference(kind, steps))
    hvd.shutdown()
    return diff


def no_sync_step(model: nn.Module, opt: torch.optim.Optimizer, s: int, r: int, n: int) -> None:
    """Step ``s`` on this rank's half of the batch: a quarter accumulated inside ``no_sync`` (nothing
    launched), the other after it, then the step."""
    x, y = batch(s)
    xs, ys = half(x, r, n), half(y, r, n)
    opt.zero_grad()
    with opt.no_sync():
        nn.functional.mse_loss(model(half(xs, 0, 2)), half(ys, 0, 2)).div(2).backward()
        assert all(b.handle is None for b in opt._buckets.buckets)
    nn.functional.mse_loss(model(half(xs, 1, 2)), half(ys, 1, 2)).div(2).backward()
    opt.step()


def no_sync_matches_full_batch(steps: int = 3) -> float:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt("sgd", model.parameters()), named_parameters=model.named_parameters())
    for s in range(steps):
        no_sync_step(model, opt, s, r, n)
    diff = max_rel_diff(model, reference("sgd", steps))
    hvd.shutdown()
    return diff


def clipping_pattern(steps: int = 4) -> float:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt("sgd", model.parameters()), named_parameters=model.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the documented pattern must not warn
        for s in range(steps):
            x, y = batch(s)
            opt.zero_grad()
            nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
            opt.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with opt.skip_synchronize():
                opt.step()
    diff = max_rel_diff(model, reference("sgd", steps, clip=0.05))
    hvd.shutdown()
    return diff


def misuse_errors() -> None:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt("sgd", model.parameters()), named_parameters=model.named_parameters())
    x, y = batch(0)
    loss = nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n))
    loss.backward(retain_graph=True)
    try:
        opt.zero_grad()
        raise AssertionError("zero_grad between backward and step must raise")
    except AssertionError as e:
        assert str(e) == ZERO_GRAD_ERROR, e
    try:
        loss.backward()
        raise AssertionError("a second backward before step must raise")
    except AssertionError as e:
        assert str(e) == TWICE_ERROR, e
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("optimizer.step() called without optimizer.skip_synchronize()" in str(w.message) for w in caught)
    opt.zero_grad()  # allowed again after step
    # LR schedulers keep working on the wrapped optimizer
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
    opt.step()
    sched.step()
    assert abs(opt.param_groups[0]["lr"] - 0.05) < 1e-12
    # backward_passes_per_step changed after the step's gradients were handed over: refused (the count started
    # again, and a second backward's gradients were dropped silently); before backward it takes effect
    opt.zero_grad()
    nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
    try:
        opt.set_backward_passes_per_step(2)
        raise AssertionError("changing the passes after the gradients were handed over must raise")
    except ValueError as e:
        assert "after this step's gradients were handed over" in str(e), e
    opt.step()
    opt.zero_grad()
    opt.set_backward_passes_per_step(2)
    for _ in range(2):  # two passes, one step
        nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
    opt.step()
    hvd.shutdown()


def frozen_parameters(steps: int = 4) -> dict:
    """First layer frozen from the start, the last layer's bias frozen after step 1, and the middle
    layer unused on rank 1 for one step (its gradient arrives from rank 0 only)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = make_model()
    model[0].weight.requires_grad_(False)
    before_first = model[0].weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    bias_after_freeze = None
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        if s == 1:
            model[4].bias.requires_grad_(False)
            bias_after_freeze = model[4].bias.detach().clone()
        out = model(half(x, r, n))
        nn.functional.mse_loss(out, half(y, r, n)).backward()
        opt.step()
    assert torch.equal(model[0].weight, before_first)
    assert torch.equal(model[4].bias, bias_after_freeze) and model[4].bias.grad is None
    params = [p.detach().clone() for p in model.parameters()]
    everyone = hvd.allgather_object(params)
    same = all(torch.equal(a, b) for a, b in zip(everyone[0], everyone[-1]))
    hvd.shutdown()
    return {"same_on_all_ranks": same}


def unused_parameter_on_one_rank() -> bool:
    """A branch used by rank 0 only: rank 1 contributes zeros, both ranks end identical."""
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    trunk, branch = nn.Linear(IN, OUT), nn.Linear(IN, OUT)
    params = list(trunk.parameters()) + list(branch.parameters())
    names = [(f"trunk.{k}", v) for k, v in trunk.named_parameters()] + \
            [(f"branch.{k}", v) for k, v in branch.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=names)
    x, y = batch(0)
    out = trunk(x) + (branch(x) if r == 0 else 0)
    nn.functional.mse_loss(out, y).backward()
    opt.step()
    everyone = hvd.allgather_object([p.detach().clone() for p in params])
    hvd.shutdown()
    return all(torch.equal(a, b) for a, b in zip(everyone[0], everyone[1]))


def mismatched_models() -> None:
    hvd.init()
    model = make_model(hidden=10 if hvd.rank() == 0 else 11)
    try:
        hvd.DistributedOptimizer(make_opt("sgd", model.parameters()), named_parameters=model.named_parameters())
    except ValueError as e:
        text = str(e)
        assert "Parameter #0 is '0.weight' [10, 6] float32 on rank 0 but '0.weight' [11, 6] float32 on rank 1" in text, text
    else:
        raise AssertionError("mismatched models must raise on every rank")
    hvd.shutdown()


def bad_arguments() -> None:
    hvd.init()
    model = make_model()
    opt = make_opt("sgd", model.parameters())
    checks = [
        (dict(named_parameters=[("a", p) for p in model.parameters()]), "unique"),
        (dict(named_parameters=list(model.named_parameters())[:2]), "were not named"),
        (dict(named_parameters=[p for p in model.parameters()]), "tuples"),
        (dict(backward_passes_per_step=0), "positive integer"),
        (dict(op=hvd.Sum, gradient_predivide_factor=2.0), "gradient_predivide_factor not supported"),
    ]
    for kwargs, words in checks:
        try:
            hvd.DistributedOptimizer(opt, **kwargs)
        except ValueError as e:
            assert words in str(e), (words, str(e))
        else:
            raise AssertionError(f"{kwargs} should raise")
    plain = hvd.DistributedOptimizer(opt, op=hvd.Adasum)  # one rank: Horovod's plain DistributedOptimizer
    assert isinstance(plain, torch.optim.SGD) and hasattr(plain, "synchronize"), type(plain)
    hvd.shutdown()


def broadcast_optimizer_state_scenario() -> dict:
    hvd.init()
    r = hvd.rank()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01 if r == 0 else 0.5, betas=(0.8, 0.9) if r == 0 else (0.5, 0.5))
    if r == 0:  # only root has taken steps: its moments and step counts exist, rank 1's do not
        for s in range(2):
            x, y = batch(s)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    sd = opt.state_dict()
    summary = {"lr": sd["param_groups"][0]["lr"], "betas": tuple(sd["param_groups"][0]["betas"]),
               "steps": [float(v["step"]) for v in sd["state"].values()],
               "exp_avg": [v["exp_avg"].clone() for v in sd["state"].values()]}
    everyone = hvd.allgather_object(summary)
    hvd.shutdown()
    a, b = everyone
    return {"lr": (a["lr"], b["lr"]), "betas": (a["betas"], b["betas"]), "steps": (a["steps"], b["steps"]),
            "moments_equal": len(a["exp_avg"]) > 0 and all(torch.equal(x, y) for x, y in zip(a["exp_avg"], b["exp_avg"]))}


def checkpoint_scenario(folder: str) -> bool:
    import os

    hvd.init()
    path = os.path.join(folder, "ckpt.pt")
    wrote = hvd.save_checkpoint({"rank": hvd.rank(), "w": torch.arange(4)}, path)
    hvd.barrier()
    loaded = torch.load(path)
    hvd.shutdown()
    assert loaded["rank"] == 0 and torch.equal(loaded["w"], torch.arange(4))
    return wrote


TINY = 2.0 ** -149  # float32's smallest subnormal: half of it rounds to zero


def averaging_order(predivide: float, set_to_none: bool, steps: int = 2) -> list[list[float]]:
    """Each rank's gradient is ``TINY`` everywhere; returns the averaged gradients of every step,
    as the optimizer hands them to ``step``. Horovod's order decides the result: the sum first,
    then ``1/size`` (``TINY``); with ``gradient_predivide_factor=size``, the division first (0)."""
    hvd.init()
    p = nn.Parameter(torch.zeros(5))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), named_parameters=[("p", p)],
                                   gradient_predivide_factor=predivide)
    seen = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        (p * torch.full((5,), TINY)).sum().backward()
        opt.synchronize()
        seen.append(p.grad.tolist())
        with opt.skip_synchronize():
            opt.step()
    hvd.shutdown()
    return seen


def group_added_after_wrapping(steps: int = 3) -> dict:
    """A parameter group added with ``add_param_group`` after wrapping (e.g. a backbone unfrozen later)
    is averaged from the next step on, as the others: each rank's gradient of both layers is
    ``rank + 1`` times ones, so the average is 1.5 on every rank."""
    hvd.init()
    r = hvd.rank()
    a, b = nn.Linear(3, 1, bias=False), nn.Linear(3, 1, bias=False)
    hvd.broadcast_parameters({"a": a.weight, "b": b.weight}, root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1),
                                   named_parameters=[("a.weight", a.weight)])
    opt.add_param_group({"params": list(b.parameters()), "lr": 0.1})
    grads = []
    for _ in range(steps):
        opt.zero_grad()
        x = torch.ones(1, 3) * (r + 1)
        (a(x) + b(x)).sum().backward()
        opt.step()
        grads.append([a.weight.grad.tolist(), b.weight.grad.tolist()])
    weights = hvd.allgather(torch.cat([a.weight.detach(), b.weight.detach()]).reshape(1, -1))
    refused = {}
    for label, make in [("powersgd", lambda ps: hvd.DistributedOptimizer(
                            torch.optim.SGD(ps, lr=0.1), compression=hvd.Compression.powersgd(rank=1))),
                        ("adasum", lambda ps: hvd.DistributedOptimizer(torch.optim.SGD(ps, lr=0.1), op=hvd.Adasum))]:
        c, d = nn.Linear(3, 1, bias=False), nn.Linear(3, 1, bias=False)
        other = make(list(c.parameters()))
        try:
            other.add_param_group({"params": list(d.parameters()), "lr": 0.1})
        except ValueError as e:
            refused[label] = str(e)
    hvd.shutdown()
    return {"grads": grads, "same_weights": bool((weights[0] == weights[1]).all()), "refused": refused}


def _wrapped_after_init() -> tuple:
    """``hvd.init()``, then this rank, the small model and its DistributedOptimizer (SGD)."""
    hvd.init()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    return hvd.rank(), model, opt


def one_rank_late_for_a_step() -> str:
    """Rank 1 is stuck outside gpucomm (a sleep past GPUCOMM_TIMEOUT) before its backward while rank 0
    waits in the step's bucket allreduce: rank 0's error (returned) must say what a fixed-schedule step
    needs and the likely causes, not only the transport's own text."""
    import time

    r, model, opt = _wrapped_after_init()
    x, y = batch(0)
    error = ""
    try:
        if r == 1:
            time.sleep(6)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    except Exception as e:  # noqa: BLE001 - the error is the result
        error = str(e)
    try:
        hvd.shutdown()
    except Exception:  # noqa: BLE001 - the job failed: shutdown may report it again
        pass
    return error


def step_wait_warned() -> list[str]:
    """Rank 1 is late (a sleep outside gpucomm, past the stall warning time but within GPUCOMM_TIMEOUT)
    for a step rank 0 already waits in; returns rank 0's stall warnings (the step then completes)."""
    import logging
    import time

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    keep = Keep(level=logging.WARNING)
    logging.getLogger("gpucomm.control").addHandler(keep)
    try:
        r, model, opt = _wrapped_after_init()
        x, y = batch(0)
        for s in range(2):
            if r == 1 and s == 1:
                time.sleep(8)  # past schedule.BLOCKED_AFTER (5 s) and the stall warning time (1 s) after it
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        hvd.shutdown()
    finally:
        logging.getLogger("gpucomm.control").removeHandler(keep)
    return [m for m in seen if "DistributedOptimizer step" in m]


def ran_fewer_steps(leaver: int = 1, linger: float = 4.0) -> str | None:
    """Rank ``leaver`` runs 2 DistributedOptimizer steps, shuts gpucomm down cleanly and keeps its process
    for ``linger`` s; the others run 3. The others' error in step 3 (returned) must name the rank that left
    and the fix (hvd.join()), not a transport's reset or, where no reset comes (MPI), GPUCOMM_TIMEOUT."""
    import time

    hvd.init()
    r = hvd.rank()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    error = None
    try:
        for step in range(2 if r == leaver else 3):
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    except Exception as e:  # noqa: BLE001 - the error is the result
        error = str(e)
    if r == leaver:
        hvd.shutdown()
        time.sleep(linger)  # the process stays: its data connections may stay open too
        return error
    try:
        hvd.shutdown()
    except Exception:  # noqa: BLE001 - the job failed: shutdown may report it again
        pass
    return error


def launches_numbered_alike_when_one_rank_flushes(steps: int = 3) -> dict:
    """Each step, rank 0 polls a negotiated allreduce after its answer arrived (which finishes the open
    DistributedOptimizer step early, a flush) while rank 1 polls at once (no flush): where each rank's steps
    end differs, yet every launch of the schedule must carry the same number on both ranks, since a rank
    that leaves says how many it launched and the others fail exactly the launches beyond that count."""
    import time

    hvd.init()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    schedule = opt._schedule
    stamps = []
    real = schedule.launch

    def launch(request, meta=None, **kwargs):
        handle = real(request, meta, **kwargs)
        stamps.append(request.step)
        return handle

    schedule.launch = launch
    for i in range(steps):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        if hvd.rank() == 0:
            time.sleep(0.3)
        handle = hvd.allreduce_async(torch.ones(1), name=f"metric{i}")
        if hvd.rank() == 0:
            time.sleep(0.3)  # the answer has arrived: the poll finishes the step (a flush)
        hvd.poll(handle)
        opt.step()
        hvd.synchronize(handle)
    record = schedule.launches_record()
    hvd.shutdown()
    return {"stamps": stamps, "record": list(record)}
