"""Rank functions for tests/test_adasum.py (module level, so the rank pool can import them).

Every rank regenerates every rank's data from a seed, so each can compute the expected result
itself with ``numpy_adasum``: an independent NumPy transcription of Horovod's Adasum
(``horovod/common/ops/adasum/adasum.h``), one pair at a time.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import gpucomm.torch as hvd

TINY = np.sqrt(sys.float_info.min)  # Horovod: a side whose squared norm is below this keeps coefficient 1


def numpy_adasum(per_rank: list) -> np.ndarray:
    """Horovod's Adasum of one tensor given by every rank (rank order), in float64: level 1 combines
    ranks (0,1), (2,3), ...; each next level combines neighbouring results, the lower ranks' as ``a``."""
    level = [np.asarray(x, dtype=np.float64).reshape(-1) for x in per_rank]
    shape = np.asarray(per_rank[0]).shape
    while len(level) > 1:
        combined = []
        for a, b in zip(level[0::2], level[1::2]):
            dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
            ca = 1.0 - dot / (2.0 * aa) if aa >= TINY else 1.0
            cb = 1.0 - dot / (2.0 * bb) if bb >= TINY else 1.0
            combined.append(ca * a + cb * b)
        level = combined
    return level[0].reshape(shape)


def _tensors(seed: int, size: int) -> dict[str, list[np.ndarray]]:
    """Every rank's inputs: several dtypes and shapes, a tensor that is zero on rank 0 only, one
    that is zero everywhere, and a 0-d tensor."""
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("w", "b", "h", "z", "allzero", "s")}
    for r in range(size):
        rng = np.random.default_rng(seed * 1000 + r)
        out["w"].append(rng.normal(size=(3, 4)).astype(np.float32))
        out["b"].append(rng.normal(size=5).astype(np.float64))
        out["h"].append(rng.normal(size=7).astype(np.float16))
        out["z"].append(np.zeros(4, np.float32) if r == 0 else rng.normal(size=4).astype(np.float32))
        out["allzero"].append(np.zeros(6, np.float32))
        out["s"].append(np.asarray(rng.normal(), dtype=np.float64))
    return out


TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3}


def _close(got: torch.Tensor, expected: np.ndarray, what: str) -> None:
    assert not torch.isnan(got).any(), f"{what}: NaN in {got}"
    np.testing.assert_allclose(got.detach().cpu().double().numpy(), expected, rtol=TOL[got.dtype],
                               atol=TOL[got.dtype], err_msg=what)


def allreduce_forms(seed: int, device: str = "cpu") -> dict:
    """Every allreduce form with op=Adasum against the NumPy reference; Horovod's properties
    (orthogonal inputs add up, parallel ones average); autograd; the errors Horovod raises."""
    ps = hvd.ProcessSet([0])
    hvd.init(process_sets=[ps])
    rank, size = hvd.rank(), hvd.size()
    dev = torch.device(device)
    data = _tensors(seed, size)
    expected = {k: numpy_adasum(v) for k, v in data.items()}

    def mine(key: str) -> torch.Tensor:
        return torch.from_numpy(np.array(data[key][rank])).to(dev)

    # out of place, sync: the input is left alone
    w = mine("w")
    _close(hvd.allreduce(w, op=hvd.Adasum, name="w"), expected["w"], "allreduce")
    _close(w, data["w"][rank].astype(np.float64), "allreduce input untouched")
    # async with poll: fp16
    handle = hvd.allreduce_async(mine("h"), op=hvd.Adasum, name="h")
    while not hvd.poll(handle):
        pass
    _close(hvd.synchronize(handle), expected["h"], "allreduce_async fp16")
    # in place, sync and async; the zero-norm side keeps coefficient 1
    b = mine("b")
    assert hvd.allreduce_(b, op=hvd.Adasum, name="b") is b
    _close(b, expected["b"], "allreduce_")
    z = mine("z")
    hvd.synchronize(hvd.allreduce_async_(z, op=hvd.Adasum, name="z"))
    _close(z, expected["z"], "allreduce_async_ with a zero tensor on rank 0")
    # Horovod's integer code, prescale and postscale
    scaled = hvd.allreduce(mine("w"), op=2, prescale_factor=0.5, postscale_factor=3.0)
    _close(scaled, expected["w"] * 1.5, "allreduce op=2 with prescale 0.5 and postscale 3")

    # one fused group of several dtypes: dot products per tensor, not over the group
    keys = ["w", "b", "h", "z", "allzero", "s"]
    for got, k in zip(hvd.grouped_allreduce([mine(k) for k in keys], op=hvd.Adasum, name="g"), keys):
        _close(got, expected[k], f"grouped_allreduce {k}")
        assert got.dtype == mine(k).dtype and got.shape == mine(k).shape, k
    outs = hvd.synchronize(hvd.grouped_allreduce_async([mine(k) for k in keys], op=hvd.Adasum))
    for got, k in zip(outs, keys):
        _close(got, expected[k], f"grouped_allreduce_async {k}")
    inputs = [mine(k) for k in keys]
    for got, t, k in zip(hvd.grouped_allreduce_(inputs, op=hvd.Adasum), inputs, keys):
        assert got is t
        _close(t, expected[k], f"grouped_allreduce_ {k}")
    inputs = [mine(k) for k in keys]
    hvd.synchronize(hvd.grouped_allreduce_async_(inputs, op=hvd.Adasum))
    for t, k in zip(inputs, keys):
        _close(t, expected[k], f"grouped_allreduce_async_ {k}")

    # Horovod's own checks: orthogonal vectors add up, parallel vectors average
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(4 * size, size)))
    orth = hvd.allreduce(torch.from_numpy(q[:, rank].copy()).to(dev), op=hvd.Adasum)
    _close(orth, q.sum(axis=1), "orthogonal inputs: Adasum is the sum")
    v, c = rng.normal(size=9), rng.normal(size=size) + 3.0
    par = hvd.allreduce(torch.from_numpy(c[rank] * v).to(dev), op=hvd.Adasum)
    _close(par, c.mean() * v, "parallel inputs: Adasum is the average")

    # autograd: the gradient is the Adasum of the incoming gradients (Horovod's backward)
    x = mine("w").requires_grad_(True)
    weights = [np.random.default_rng(seed + 7 + r).normal(size=(3, 4)) for r in range(size)]
    y = hvd.allreduce(x, op=hvd.Adasum, name="grad")
    (y * torch.from_numpy(weights[rank]).float().to(dev)).sum().backward()
    _close(x.grad, numpy_adasum(weights), "allreduce backward")

    errors = _errors_of({
        "int": lambda: hvd.allreduce(torch.ones(3, dtype=torch.int32, device=dev), op=hvd.Adasum),
        "reducescatter": lambda: hvd.reducescatter(torch.ones(2 * size, device=dev), op=hvd.Adasum),
        "process_set": lambda: hvd.allreduce(torch.ones(3, device=dev), op=hvd.Adasum, process_set=ps),
        "optimizer_process_set": lambda: hvd.DistributedOptimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), op=hvd.Adasum, process_set=ps),
    })
    total = hvd.allreduce(torch.ones(1, device=dev), op=hvd.Sum).item()  # still in step after the errors
    hvd.shutdown()
    return {"errors": errors, "total": total}


def _errors_of(calls: dict) -> dict:
    """``(exception type name, message)`` of each call, or None where it did not raise."""
    errors = {}
    for what, call in calls.items():
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the test checks the type and message
            errors[what] = (type(e).__name__, str(e))
        else:
            errors[what] = None
    return errors


def non_power_of_two() -> dict:
    """Every Adasum entry point refuses a job whose size is not a power of two, on every rank, and
    the job carries on."""
    hvd.init()
    t = torch.ones(3)
    calls = {
        "allreduce": lambda: hvd.allreduce(t, op=hvd.Adasum),
        "allreduce_async": lambda: hvd.allreduce_async(t, op=hvd.Adasum),
        "allreduce_": lambda: hvd.allreduce_(t.clone(), op=hvd.Adasum),
        "allreduce_async_": lambda: hvd.allreduce_async_(t.clone(), op=hvd.Adasum),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([t, t], op=hvd.Adasum),
        "grouped_allreduce_async": lambda: hvd.grouped_allreduce_async([t], op=hvd.Adasum),
        "grouped_allreduce_": lambda: hvd.grouped_allreduce_([t.clone()], op=hvd.Adasum),
        "grouped_allreduce_async_": lambda: hvd.grouped_allreduce_async_([t.clone()], op=hvd.Adasum),
        "DistributedOptimizer": lambda: hvd.DistributedOptimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), op=hvd.Adasum),
    }
    errors = _errors_of(calls)
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    hvd.shutdown()
    return {"errors": errors, "total": total}


# ---------------------------------------------------------------------------------------------
# the delta optimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    model.unused = torch.nn.Parameter(torch.ones(2))  # never gets a gradient: its delta is zero
    return model


def _batch(seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 10_000 + step * 100 + rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def _reference(seed: int, size: int, steps: int, passes: int) -> list[np.ndarray]:
    """One process plays every rank: each rank's own SGD (its momentum stays its own) steps from
    the shared weights on its batch; the weights then move by the NumPy Adasum of the deltas."""
    models = [_model() for _ in range(size)]
    opts = [_sgd(m) for m in models]
    for step in range(steps):
        start = [p.detach().clone() for p in models[0].parameters()]
        deltas = []
        for r, (m, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            for k in range(passes):
                _loss(m, _batch(seed, r, step * passes + k)).backward()
            opt.step()
            deltas.append([(p.detach() - s).numpy() for p, s in zip(m.parameters(), start)])
        with torch.no_grad():
            for i, s in enumerate(start):
                new = s + torch.from_numpy(numpy_adasum([d[i] for d in deltas])).to(s.dtype)
                for m in models:
                    list(m.parameters())[i].copy_(new)
    return [p.detach().numpy().copy() for p in models[0].parameters()]


def delta_optimizer(seed: int, steps: int = 3) -> dict:
    """``DistributedOptimizer(op=Adasum)`` is Horovod's delta optimizer: the same weights as the
    single-process reference, with one and with two backward passes per step; plus its guards."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict = {}
    for passes in (1, 2):
        model = _model()
        opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), op=hvd.Adasum,
                                       backward_passes_per_step=passes)
        out["isinstance"] = isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
        for step in range(steps):
            opt.zero_grad()
            for k in range(passes):
                _loss(model, _batch(seed, rank, step * passes + k)).backward()
            opt.step()
        expected = _reference(seed, size, steps, passes)
        for (name, p), e in zip(model.named_parameters(), expected):
            np.testing.assert_allclose(p.detach().numpy(), e, rtol=1e-5, atol=1e-6,
                                       err_msg=f"passes={passes} {name}")
        out[f"weights{passes}"] = [p.detach().numpy().tolist() for p in model.parameters()]

    guards = {}
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), op=hvd.Adasum)
    _loss(model, _batch(seed, rank, 0)).backward()
    for what, call in {"zero_grad": opt.zero_grad,
                       "twice": lambda: _loss(model, _batch(seed, rank, 1)).backward(),
                       "skip_synchronize": lambda: opt.skip_synchronize().__enter__()}.items():
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the test checks the type and message
            guards[what] = (type(e).__name__, str(e))
        else:
            guards[what] = None
    opt.step()
    out["guards"] = guards
    hvd.shutdown()
    return out


def single_rank_optimizer() -> list:
    """At size 1 ``DistributedOptimizer(op=Adasum)`` is the wrapped optimizer's local step (Horovod)."""
    hvd.init()
    model, ref = _model(), _model()
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), op=hvd.Adasum)
    ref_opt = _sgd(ref)
    for step in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _loss(m, _batch(0, 0, step)).backward()
            o.step()
    hvd.shutdown()
    return [float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters())]
