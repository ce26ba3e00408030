"""Rank-side bodies of the PowerSGD tests (``tests/test_powersgd.py``).

Small models (a few matrices worth compressing, biases that are not), a few steps each. The exact
checks use a rank no smaller than every matrix's smaller side: then P spans the whole row space, the
approximation is the average itself, and PowerSGD must reproduce uncompressed averaging (the two
phases, the scaling, the error feedback and the buckets' plumbing are all exercised)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import gpucomm.torch as hvd
from gpucomm.errors import NonFiniteGradientError
from gpucomm.torch.powersgd import PowerSGDBucket

IN, HIDDEN, OUT, BATCH = 12, 10, 6, 8


def device_of(device: str) -> torch.device:
    """``"cuda"``: this rank's GPU (``hvd.init`` pinned it)."""
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT)).to(device=device, dtype=dtype)


def batch(step: int, rank: int, dtype: torch.dtype = torch.float32,
          device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(BATCH, IN, generator=g).to(device=device, dtype=dtype),
            torch.randn(BATCH, OUT, generator=g).to(device=device, dtype=dtype))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, passes: int = 1,
          dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Train ``steps``; the parameters after each step."""
    seen = []
    device = next(model.parameters()).device
    for s in steps:
        opt.zero_grad()
        for k in range(passes):
            x, y = batch(s * passes + k, hvd.rank(), dtype, device)
            ((model(x) - y) ** 2).mean().backward()  # mse_loss has no CPU bfloat16 kernel in torch 2.1
        opt.step()
        seen.append(flat(model))
    return seen


def wrap(model: nn.Module, compression, passes: int = 1, kind: str = "sgd", **kw) -> torch.optim.Optimizer:
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if kind == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.01))
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                    backward_passes_per_step=passes, **kw)


def exact_rank_and_identical_ranks(device: str = "cpu") -> dict:
    """Full rank: PowerSGD equals uncompressed averaging (Average with a predivide factor, Sum,
    accumulation, the fp16 wire, a bfloat16 model); low rank: every rank holds the same parameters
    after every step, steady steps send no control message, and the counters show the factors' bytes."""
    hvd.init()
    size, out = hvd.size(), {}
    device = device_of(device)
    full = HIDDEN  # >= every matrix's smaller side
    cases = {"average": ({}, 1, torch.float32), "sum": ({"op": hvd.Sum}, 1, torch.float32),
             "passes": ({}, 2, torch.float32), "fp16_wire": ({}, 1, torch.float32),
             "bf16_model": ({}, 1, torch.bfloat16)}
    for name, (kw, passes, dtype) in cases.items():
        wire = hvd.Compression.fp16 if name == "fp16_wire" else hvd.Compression.none
        plain, low = make_model(dtype=dtype, device=device), make_model(dtype=dtype, device=device)
        if name == "sum":  # Sum: no predivide (refused with Sum)
            kw = {}
            opts = [wrap(plain, hvd.Compression.none, passes, op=hvd.Sum),
                    wrap(low, hvd.Compression.powersgd(rank=full, start_iter=1, min_compression_rate=0, wire=wire),
                         passes, op=hvd.Sum)]
        else:
            opts = [wrap(plain, hvd.Compression.none, passes, **kw),
                    wrap(low, hvd.Compression.powersgd(rank=full, start_iter=1, min_compression_rate=0, wire=wire),
                         passes, gradient_predivide_factor=2.0, **kw)]
        a = train(plain, opts[0], range(4), passes, dtype)
        b = train(low, opts[1], range(4), passes, dtype)
        out[name] = max(float((x - y).abs().max() / x.abs().max()) for x, y in zip(a, b))
        assert any(isinstance(bk, PowerSGDBucket) for bk in opts[1]._buckets.buckets), name
    # low rank, with check_finite on (its slots ride P's allreduce): identical on every rank after every step
    model = make_model(1, device=device)
    opt = wrap(model, hvd.Compression.powersgd(rank=1, start_iter=2, min_compression_rate=0), kind="adam",
               check_finite="raise")
    kinds = sorted({type(b).__name__ for b in opt._buckets.buckets})
    seen = train(model, opt, range(3))  # 2 uncompressed steps, then compressed (and the first re-cut)
    before = hvd.stats()
    seen += train(model, opt, range(3, 7))
    after = hvd.stats()
    out["control_rounds"] = after["control_rounds"] - before["control_rounds"]
    out["bytes_per_step"] = (after["bytes"] - before["bytes"]) / 4
    out["collectives_per_step"] = (after["collectives"] - before["collectives"]) / 4
    out["buckets"] = [(type(b).__name__, b.plan.numel) for b in opt._buckets.buckets]
    everyone = hvd.allgather_object(seen, name="powersgd.seen")
    out["identical"] = all(torch.equal(x, y) for theirs in everyone for x, y in zip(everyone[0], theirs))
    out["kinds"] = kinds
    out["size"] = size
    hvd.shutdown()
    return out


def state_and_elastic() -> dict:
    """The state dict carries Q, the errors and the step count; a fresh optimizer takes Q and the
    count, not another owner's errors; TorchState's commit and restore bring everything back."""
    hvd.init()
    out = {}
    settings = dict(rank=2, start_iter=1, min_compression_rate=0)
    model = make_model(2)
    opt = wrap(model, hvd.Compression.powersgd(**settings), kind="adam")
    train(model, opt, range(3))
    sd = opt.state_dict()["powersgd"]
    out["iteration"] = sd["iteration"]
    out["has_q_and_error"] = (sorted(sd["q"]) == [0, 2, 4] and sorted(sd["error"]) == [0, 2, 4]
                              and all(e.abs().sum() > 0 for e in sd["error"].values()))
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)
    committed = copy.deepcopy(opt.state_dict()["powersgd"])  # the state dict holds the live tensors
    after_commit = train(model, opt, range(3, 5))
    state.restore()
    restored = opt.state_dict()["powersgd"]
    out["restore_exact"] = (restored["iteration"] == committed["iteration"] and all(
        torch.equal(restored[k][i], committed[k][i]) for k in ("q", "error") for i in committed[k]))
    again = train(model, opt, range(3, 5))
    out["replay_equal"] = all(torch.equal(x, y) for x, y in zip(after_commit, again))
    # another optimizer (another owner) loading this state: Q and the count, its own (no) errors
    other_model = make_model(2)
    other = wrap(other_model, hvd.Compression.powersgd(**settings), kind="adam")
    other.load_state_dict(opt.state_dict())
    theirs = other.state_dict()["powersgd"]
    out["foreign_load"] = (theirs["iteration"] == opt.state_dict()["powersgd"]["iteration"] and theirs["error"] == {}
                           and sorted(theirs["q"]) == [0, 2, 4])
    # rank 0's state broadcast to the others: their Q and count become rank 0's
    hvd.broadcast_optimizer_state(other, root_rank=0)
    q = other.state_dict()["powersgd"]["q"]
    everyone = hvd.allgather_object(q, name="powersgd.q")
    out["q_alike"] = all(torch.equal(everyone[0][i], theirs_q[i]) for theirs_q in everyone for i in everyone[0])
    hvd.shutdown()
    return out


def join_and_nonfinite() -> dict:
    """hvd.join with PowerSGD (the joined rank stands in for both phases and keeps Q and the step
    count in step), then a NaN in a compressed matrix's gradient raises on every rank naming it."""
    hvd.init()
    r, out = hvd.rank(), {}
    model = make_model(3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.powersgd(rank=1, start_iter=1, min_compression_rate=0),
                                   check_finite="raise")
    train(model, opt, range(2 + (2 if r == 0 else 0)))  # rank 0 trains two more steps than the others
    out["last"] = hvd.join()
    state = opt.state_dict()["powersgd"]
    everyone = hvd.allgather_object(state, name="powersgd.join.state")
    out["q_alike"] = all(theirs["iteration"] == state["iteration"] and all(
        torch.equal(theirs["q"][i], everyone[0]["q"][i]) for i in everyone[0]["q"]) for theirs in everyone)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # the joined rank did not step meanwhile
    seen = train(model, opt, range(10, 12))  # everyone trains again
    everyone = hvd.allgather_object(seen, name="powersgd.join")
    out["identical_after_join"] = all(torch.equal(x, y) for theirs in everyone for x, y in zip(everyone[0], theirs))
    x, y = batch(20, r)
    opt.zero_grad()
    if r == 1:  # a NaN in a compressed matrix's gradient, as backward produces it
        model[2].weight.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])),
                                                            torch.tensor(float("nan"))))
    nn.functional.mse_loss(model(x), y).backward()
    try:
        opt.step()
        out["nonfinite"] = None
    except NonFiniteGradientError as e:
        out["nonfinite"] = [(f.rank, f.name) for f in e.findings]
    hvd.shutdown()
    return out


def uncalled_powersgd(steps: int = 3) -> dict:
    """``compression=hvd.Compression.powersgd`` (the class, not a call): PowerSGD with its defaults."""
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=hvd.Compression.powersgd)
    for s in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
    out = {"steps": steps, "kinds": sorted({type(b).__name__ for b in opt._buckets.buckets})}
    hvd.shutdown()
    return out


def late_flush_during_the_second_phase(steps: int = 3) -> dict:
    """A flush that comes late: a waiter on another thread took the list of open steps (each step's flush)
    before the training step ended, and calls it once synchronize() has opened PowerSGD's second-phase step.
    Simulated here by calling the optimizer's flush right after that step opens: it must leave the step
    open (before, it ended it, and the rest of the second phase went out outside any step) and training
    must go on as without it."""
    hvd.init()
    model = make_model(3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.powersgd(rank=1, start_iter=1, min_compression_rate=0))
    schedule = opt._schedule
    real = schedule.begin_step
    seen = {"second_phase_steps": 0, "open_after_late_flush": []}

    def begin_step(flush):
        opened = not schedule.in_step
        real(flush)
        if opened and getattr(flush, "__func__", None) is not type(opt)._flush_step:  # the second phase's step
            seen["second_phase_steps"] += 1
            opt._flush_step()  # the late flush
            seen["open_after_late_flush"].append(schedule.in_step)

    schedule.begin_step = begin_step
    params = train(model, opt, range(steps))
    seen["params"] = params[-1].tolist()
    hvd.shutdown()
    return seen
