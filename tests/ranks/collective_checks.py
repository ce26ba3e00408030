"""Rank-side checks of every collective against references computed locally.

Each rank can rebuild any rank's input (inputs are a function of rank, dtype and shape), so each
check computes the exact expected result itself. Run through tests.harness.run_ranks, on CPU (Gloo)
or CUDA (NCCL).
"""

from __future__ import annotations

import time

import torch

import gpucomm.torch as hvd
from gpucomm.dataplane.requests import MOVABLE, REDUCIBLE

SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (0,)]
OPS = {"avg": hvd.Average, "sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}


def make(rank: int, shape, dtype, device="cpu", salt: int = 0) -> torch.Tensor:
    """Rank-specific values small enough that sums and products stay exact in every dtype."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * len(shape) + salt)
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype.is_floating_point:
        t = torch.randint(-3, 4, shape, generator=g).to(dtype) * 0.5
    elif dtype == torch.uint8:
        t = torch.randint(0, 4, shape, generator=g).to(dtype)
    else:
        t = torch.randint(-3, 4, shape, generator=g).to(dtype)
    return t.to(device)


def reference_reduce(tensors: list[torch.Tensor], op, pre: float = 1.0, post: float = 1.0) -> torch.Tensor:
    wide = [t.double() * pre for t in tensors]
    stack = torch.stack(wide) if wide[0].dim() else torch.stack([w.reshape(1) for w in wide]).reshape(len(wide))
    if op in (hvd.Average, hvd.Sum):
        out = stack.sum(0) * post / (len(tensors) if op == hvd.Average else 1)
    elif op == hvd.Min:
        out = stack.min(0).values * post
    elif op == hvd.Max:
        out = stack.max(0).values * post
    else:
        out = stack.prod(0) * post
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype.is_floating_point:
        tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(got.dtype, 1e-6)
        assert torch.allclose(got.double(), want.double(), rtol=tol, atol=tol), f"{what}: {got} != {want}"
    else:
        assert torch.equal(got, want.to(got.dtype)), f"{what}: {got} != {want}"


def _int_scaled(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What integer tensors hold after scaling: float64 then truncation."""
    return exact.to(dtype) if not dtype.is_floating_point else exact


def check_allreduce(device: str = "cpu") -> int:
    hvd.init()
    n, r, count = hvd.size(), hvd.rank(), 0
    for dtype in REDUCIBLE:
        for shape in SHAPES:
            for op_name, op in OPS.items():
                if dtype == torch.uint8 and op_name == "prod":
                    continue
                x = make(r, shape, dtype, device)
                want = reference_reduce([make(q, shape, dtype) for q in range(n)], op)
                got = hvd.allreduce(x, op=op, name=f"ar.{dtype}.{shape}.{op_name}")
                assert_close(got, _int_scaled(want, dtype), f"allreduce {op_name} {dtype} {shape}")
                assert torch.equal(x.cpu(), make(r, shape, dtype)), "out-of-place allreduce modified its input"
                y = x.clone()
                assert hvd.allreduce_(y, op=op) is y
                assert_close(y, _int_scaled(want, dtype), f"allreduce_ {op_name} {dtype} {shape}")
                count += 2
    # scale factors, async forms, deprecated average flag
    x = make(r, (4, 3), torch.float32, device)
    want = reference_reduce([make(q, (4, 3), torch.float32) for q in range(n)], hvd.Sum, 2.0, 0.25)
    assert_close(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), want, "scaled allreduce")
    xi = make(r, (5,), torch.int32, device)
    wi = reference_reduce([make(q, (5,), torch.int32) for q in range(n)], hvd.Sum, 1.0, 0.5).to(torch.int32)
    assert_close(hvd.allreduce(xi, op=hvd.Sum, postscale_factor=0.5), wi, "int postscale truncates")
    h = hvd.allreduce_async(x, average=False)
    assert_close(hvd.synchronize(h), reference_reduce([make(q, (4, 3), torch.float32) for q in range(n)], hvd.Sum),
                 "average=False")
    y = x.clone()
    h = hvd.allreduce_async_(y, op=hvd.Max)
    assert hvd.synchronize(h) is y
    # grouped, mixed dtypes
    shapes = [(3,), (2, 2), (5,)]
    dtypes = [torch.float32, torch.int64, torch.float32]
    group = [make(r, s, d, device, salt=i) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    outs = hvd.grouped_allreduce(group, op=hvd.Sum)
    for i, (s, d) in enumerate(zip(shapes, dtypes)):
        want = reference_reduce([make(q, s, d, salt=i) for q in range(n)], hvd.Sum)
        assert_close(outs[i], want, f"grouped allreduce {i}")
    copies = [g.clone() for g in group]
    assert hvd.grouped_allreduce_(copies, op=hvd.Sum)[0] is copies[0]
    assert_close(copies[2], reference_reduce([make(q, (5,), torch.float32, salt=2) for q in range(n)], hvd.Sum), "grouped_")
    hvd.shutdown()
    return count


def check_data_movement(device: str = "cpu") -> int:
    hvd.init()
    n, r, count = hvd.size(), hvd.rank(), 0
    for dtype in MOVABLE:
        # allgather with a different first dimension on every rank (rank 0 sends none)
        x = make(r, (r, 3), dtype, device)
        got = hvd.allgather(x)
        assert_close(got, torch.cat([make(q, (q, 3), dtype) for q in range(n)]), f"allgather {dtype}")
        s = make(r, (), dtype, device)
        assert_close(hvd.allgather(s), torch.stack([make(q, (), dtype) for q in range(n)]), f"allgather 0-d {dtype}")
        for root in range(n):
            x = make(r, (2, 3), dtype, device)
            assert_close(hvd.broadcast(x, root), make(root, (2, 3), dtype), f"broadcast root {root} {dtype}")
            assert torch.equal(x.cpu(), make(r, (2, 3), dtype)), "out-of-place broadcast modified its input"
            hvd.broadcast_(x, root)
            assert_close(x, make(root, (2, 3), dtype), f"broadcast_ root {root} {dtype}")
        # alltoall: rank r sends (q + r) % 3 rows to rank q
        splits = [(q + r) % 3 for q in range(n)]
        x = make(r, (sum(splits), 2), dtype, device)
        out, received = hvd.alltoall(x, splits=splits)
        want_parts = []
        for q in range(n):
            theirs = [(p + q) % 3 for p in range(n)]
            start = sum(theirs[:r])
            want_parts.append(make(q, (sum(theirs), 2), dtype)[start : start + theirs[r]])
        assert_close(out, torch.cat(want_parts), f"alltoall {dtype}")
        assert received.tolist() == [(r + q) % 3 for q in range(n)], received
        even = make(r, (2 * n, 3), dtype, device)
        got = hvd.alltoall(even)
        assert_close(got, torch.cat([make(q, (2 * n, 3), dtype)[2 * r : 2 * r + 2] for q in range(n)]), "alltoall equal")
        count += 4 + 2 * n
    # a large allgather, uneven and with an empty rank: on Gloo in a small group it runs as one broadcast per rank
    big = make(r, (r * 70000, 4), torch.float32, device)
    assert_close(hvd.allgather(big), torch.cat([make(q, (q * 70000, 4), torch.float32) for q in range(n)]),
                 "large uneven allgather")
    # grouped allgather
    outs = hvd.grouped_allgather([make(r, (r + 1,), torch.float32, device), make(r, (1, 2), torch.int64, device)])
    assert_close(outs[0], torch.cat([make(q, (q + 1,), torch.float32) for q in range(n)]), "grouped allgather 0")
    assert_close(outs[1], torch.cat([make(q, (1, 2), torch.int64) for q in range(n)]), "grouped allgather 1")
    hvd.shutdown()
    return count


def check_reducescatter(device: str = "cpu") -> int:
    hvd.init()
    n, r, count = hvd.size(), hvd.rank(), 0
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        for rows in (n, 2 * n + 1, 1, 5):
            for op_name in ("avg", "sum", "min", "max"):
                op = OPS[op_name]
                x = make(r, (rows, 2), dtype, device)
                got = hvd.reducescatter(x, op=op)
                full = _int_scaled(reference_reduce([make(q, (rows, 2), dtype) for q in range(n)], op), dtype)
                base, extra = divmod(rows, n)
                mine = base + (1 if r < extra else 0)
                start = r * base + min(r, extra)
                assert_close(got, full[start : start + mine], f"reducescatter {op_name} {dtype} rows={rows}")
                count += 1
    outs = hvd.grouped_reducescatter([make(r, (n, 2), torch.float32, device), make(r, (n + 1,), torch.float32, device)],
                                     op=hvd.Sum)
    assert_close(outs[0], reference_reduce([make(q, (n, 2), torch.float32) for q in range(n)], hvd.Sum)[r : r + 1],
                 "grouped reducescatter")
    hvd.shutdown()
    return count


def check_async_and_barrier(device: str = "cpu") -> None:
    hvd.init()
    r = hvd.rank()
    big = torch.ones(1 << 20, device=device)
    hvd.barrier()
    if device != "cpu":  # the first CUDA collective creates the NCCL communicator, which waits for every rank
        hvd.allreduce(torch.ones(1, device=device), name="warm-up")
    if r == 1:
        time.sleep(1.0)  # rank 0's operation cannot finish before rank 1 joins
    h = hvd.allreduce_async(big, op=hvd.Sum, name="late")
    if r == 0:
        assert hvd.poll(h) is False, "poll must be False while a peer has not joined"
    deadline = time.monotonic() + 30
    while not hvd.poll(h):
        assert time.monotonic() < deadline, "operation never completed"
        time.sleep(0.001)
    assert torch.equal(hvd.synchronize(h).cpu(), torch.full((1 << 20,), float(hvd.size())))
    try:
        hvd.synchronize(h)
    except ValueError as e:
        assert "unknown handle" in str(e)
    else:
        raise AssertionError("synchronize of a consumed handle must raise")
    # many async operations in flight at once complete in order
    handles = [hvd.allreduce_async(torch.full((3,), float(i), device=device), op=hvd.Sum) for i in range(50)]
    for i, h in enumerate(handles):
        assert hvd.synchronize(h).cpu().tolist() == [i * hvd.size()] * 3
    # allgathers (which first exchange shapes) and allreduces interleaved stay ordered
    hs = [hvd.allgather_async(torch.full((r + 1,), float(i), device=device)) if i % 2 else
          hvd.allreduce_async(torch.full((2,), float(i), device=device), op=hvd.Sum) for i in range(10)]
    for i, h in enumerate(hs):
        out = hvd.synchronize(h).cpu()
        if i % 2:
            assert out.tolist() == [float(i)] * sum(q + 1 for q in range(hvd.size()))
        else:
            assert out.tolist() == [i * hvd.size()] * 2
    for _ in range(3):
        hvd.barrier()
    hvd.shutdown()


def check_autograd(device: str = "cpu") -> None:
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    x = torch.ones(4, 2, device=device, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * 2).sum().backward()
    assert torch.equal(x.grad.cpu(), torch.full((4, 2), 2.0 * n)), x.grad  # backward is a Sum-allreduce too
    x = torch.ones(r + 1, 3, device=device, requires_grad=True)
    (hvd.allgather(x) * (r + 1)).sum().backward()
    avg = sum(q + 1 for q in range(n)) / n
    assert torch.allclose(x.grad.cpu(), torch.full((r + 1, 3), avg)), x.grad  # Average-allreduce, own rows
    x = torch.ones(3, device=device, requires_grad=True)
    hvd.broadcast(x, 0).sum().backward()
    assert torch.equal(x.grad.cpu(), torch.full((3,), 1.0 if r == 0 else 0.0)), x.grad
    x = torch.arange(2.0 * n, device=device, requires_grad=True)
    out = hvd.alltoall(x)
    (out * (r + 1)).sum().backward()
    assert torch.equal(x.grad.cpu(), torch.tensor([q + 1.0 for q in range(n) for _ in range(2)])), x.grad
    for op, want in ((hvd.Sum, float(n)), (hvd.Average, 1.0)):
        x = torch.ones(2 * n, device=device, requires_grad=True)
        hvd.reducescatter(x, op=op).sum().backward()
        assert torch.equal(x.grad.cpu(), torch.full((2 * n,), want)), (op, x.grad)
    xs = [torch.ones(2, device=device, requires_grad=True), torch.ones(3, device=device, requires_grad=True)]
    sum(o.sum() for o in hvd.grouped_allreduce(xs, op=hvd.Average)).backward()
    assert torch.equal(xs[1].grad.cpu(), torch.ones(3))
    c = torch.ones(4, device=device, requires_grad=True)
    hvd.allreduce(c, compression=hvd.Compression.fp16, op=hvd.Sum).sum().backward()
    assert c.grad.dtype == torch.float32 and torch.equal(c.grad.cpu(), torch.full((4,), float(n)))
    hvd.shutdown()
