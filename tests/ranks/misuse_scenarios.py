"""Rank functions for tests/test_misuse.py (module level, so the rank pool can import them)."""

from __future__ import annotations

import pytest
import torch

import gpucomm.torch as hvd


def check_in_place_collectives_behave_like_torch_in_place_ops() -> None:
    hvd.init()
    # a tensor autograd saved for backward: modifying it in place must make backward raise, as torch does
    w = torch.ones(4, requires_grad=True)
    h = w * 2
    loss = (h * h).sum()  # saves h
    hvd.allreduce_(h, op=hvd.Sum)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # a leaf that requires grad is refused while grad mode is on, on every in-place form
    p = torch.ones(3, requires_grad=True)
    for call in (lambda: hvd.allreduce_(p), lambda: hvd.allreduce_async_(p), lambda: hvd.broadcast_(p, 0),
                 lambda: hvd.broadcast_async_(p, 0), lambda: hvd.grouped_allreduce_([p])):
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
            call()
    with torch.no_grad():  # on purpose, as an optimizer step: allowed, and the version moves
        before = p._version
        hvd.allreduce_(p, op=hvd.Sum)
        assert p._version > before and torch.equal(p, torch.full((3,), float(hvd.size())))
    model = torch.nn.Linear(2, 2)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)  # parameters are leaves: still fine
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.shutdown()


def check_bad_arguments_name_what_is_accepted() -> None:
    hvd.init()
    for bad in (5, None, 2.5):
        with pytest.raises(TypeError, match=r"hvd.allreduce expects a torch.Tensor, got .*torch.tensor\(x\)"):
            hvd.allreduce(bad)
    with pytest.raises(TypeError, match="for several tensors use hvd.grouped_allreduce"):
        hvd.allreduce([torch.ones(1), torch.ones(1)])
    with pytest.raises(TypeError, match="hvd.allgather_object"):
        hvd.allgather({"a": 1})
    with pytest.raises(TypeError, match="expects torch tensors, got int"):
        hvd.allreduce_async(5)
    with pytest.raises(TypeError, match="grouped_allreduce expects a list or tuple"):
        hvd.grouped_allreduce(torch.ones(2))
    for op in (7, -1, "sum"):
        with pytest.raises(ValueError, match=r"is not a reduction op; use hvd.Average \(0\), hvd.Sum \(1\)"):
            hvd.allreduce(torch.ones(2), op=op)
    with pytest.raises(ValueError, match="is not a reduction op"):
        hvd.reducescatter(torch.ones(2 * hvd.size()), op=9)
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(hvd.size())))  # still works
    hvd.shutdown()


def collective_type_clash(ranks_that_gather: tuple[int, ...]) -> dict:
    """Under one name, the ranks in ``ranks_that_gather`` call allgather and the others allreduce."""
    import time

    hvd.init()
    t0 = time.monotonic()
    call = hvd.allgather if hvd.rank() in ranks_that_gather else hvd.allreduce
    try:
        call(torch.ones(2), name="m")
        outcome = "ran"
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        outcome = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    # the same name for both types, asynchronously and in crossed orders, is legal and completes
    first, second = (hvd.allreduce_async, hvd.allgather_async) if hvd.rank() % 2 else \
        (hvd.allgather_async, hvd.allreduce_async)
    handles = [first(torch.ones(2), name="both"), second(torch.ones(2), name="both")]
    crossed = [tuple(hvd.synchronize(h).shape) for h in handles]
    with pytest.raises(TypeError, match="name must be a str"):
        hvd.allreduce(torch.ones(1), name=7)
    with pytest.raises(ValueError, match="default repr"):
        hvd.allreduce(torch.ones(1), name=str(object()))
    hvd.shutdown()
    return {"outcome": outcome, "elapsed": elapsed, "crossed": crossed}


def per_rank_names() -> dict:
    """Each rank names its allreduce after itself (as an object's id or a rank-dependent counter would)."""
    import time

    hvd.init()
    t0 = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2), name=f"grad.{hvd.rank() * 7919}")
        outcome = "ran"
    except Exception as e:  # noqa: BLE001
        outcome = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    # legal: a late rank (only the others are blocked) and asynchronous ops in different orders
    if hvd.rank() == 1:
        time.sleep(2.0)
    late = hvd.allreduce(torch.ones(1), name="late", op=hvd.Sum).item()
    names = ["a", "b"] if hvd.rank() % 2 else ["b", "a"]
    handles = {n: hvd.allreduce_async(torch.ones(1), name=n, op=hvd.Sum) for n in names}
    orders = sorted(hvd.synchronize(handles[n]).item() for n in names)
    hvd.shutdown()
    return {"outcome": outcome, "elapsed": elapsed, "late": late, "orders": orders}


def broadcast_object_of_none() -> str:
    """The root passes a dict, the other rank None (``obj if rank == 0 else None``) with no name: the
    default names differ by type, so the broadcasts can never meet; returns this rank's error."""
    hvd.init()
    try:
        hvd.broadcast_object({"epoch": 3} if hvd.rank() == 0 else None, root_rank=0)
        outcome = "ran"
    except Exception as e:  # noqa: BLE001 - the error is the result
        outcome = str(e)
    hvd.shutdown()
    return outcome
