"""Rank-side bodies of tests/test_finite_check.py: a rank's gradient goes NaN or Inf on purpose,
and every rank must learn, in the same step, which rank and which parameter."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

import gpucomm.torch as hvd
from gpucomm.errors import NonFiniteGradientError
from gpucomm.torch.compression import Compressor


class _Halves(Compressor):
    """A user compressor the pack kernels cannot fuse (float16 on the wire, by hand)."""

    @staticmethod
    def compress(tensor):
        return tensor.half(), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16, "user": _Halves}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def poison_step(mode, compression: str = "none", bad_rank: int = 1, bad_param: str = "2.weight", bad_step: int = 2,
                value: float = float("nan"), steps: int = 4, device: str = "cpu", scaler: bool = False) -> dict:
    """Train ``steps`` steps; in step ``bad_step`` (1-based), rank ``bad_rank`` turns one element of
    ``bad_param``'s gradient into ``value``. Returns what each rank saw."""
    hvd.init()
    r = hvd.rank()
    model = make_model().to(device)
    named = dict(model.named_parameters())
    kw = {} if mode == "env" else {"check_finite": mode}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                                   compression=COMPRESSIONS[compression], **kw)
    amp = torch.amp.GradScaler(device, init_scale=2.0 ** 4) if scaler else None
    state = {"step": 0}

    def poison(grad):
        if r == bad_rank and state["step"] == bad_step:
            grad = grad.clone()
            grad.view(-1)[1] = value
        return grad

    named[bad_param].register_hook(poison)
    seen = {"raised": None, "warnings": [], "finite_after": None, "findings": None}
    g = torch.Generator().manual_seed(7)
    before = hvd.stats()
    for step in range(1, steps + 1):
        state["step"] = step
        x, y = torch.randn(4, 6, generator=g).to(device), torch.randn(4, 3, generator=g).to(device)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if amp is not None:
                    amp.scale(loss).backward()
                    opt.synchronize()
                    amp.unscale_(opt)
                    with opt.skip_synchronize():
                        amp.step(opt)
                    amp.update()
                else:
                    loss.backward()
                    opt.step()
            seen["warnings"] += [str(w.message) for w in caught if "non-finite gradient" in str(w.message)]
        except NonFiniteGradientError as e:
            seen["raised"] = {"step": step, "message": str(e), "error_step": e.step,
                              "findings": [(f.rank, f.name) for f in e.findings]}
            break
        if opt.last_nonfinite and seen["findings"] is None:
            seen["findings"] = [(f.rank, f.name) for f in opt.last_nonfinite]
    after = hvd.stats()
    seen["finite_after"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    seen["counts"] = {k: after[k] - before[k] for k in ("nonfinite_steps", "nonfinite_skipped", "negotiated")}
    hvd.shutdown()
    return seen


def mismatched_modes() -> str:
    """check_finite on rank 0 only: refused at construction on every rank."""
    hvd.init()
    model = make_model()
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(),
                                 check_finite="raise" if hvd.rank() == 0 else None)
    except ValueError as e:
        return str(e)
    finally:
        hvd.shutdown()
    return ""


def steps_with_and_without_check(check: bool, steps: int = 30) -> dict:
    """Counters of a healthy run: the check adds no collective and no control message."""
    hvd.init()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                                   check_finite="raise" if check else False)
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        if step == 2:
            before = hvd.stats()
        opt.zero_grad()
        model(torch.randn(4, 6, generator=g)).sum().backward()
        opt.step()
    after = hvd.stats()
    hvd.shutdown()
    return {k: after[k] - before[k] for k in ("collectives", "control_rounds", "negotiated", "nonfinite_steps")}
