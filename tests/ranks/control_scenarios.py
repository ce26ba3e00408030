"""Rank-side scenarios for the control-plane tests (module-level so spawn can import them).

Each function runs in one rank process; it asserts what the rank can check by itself and returns
what the test compares across ranks (messages, timings, parameters). ``main`` runs one of them as
a plain script, for the tests that need a rank to die the way a real process dies.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Callable

import torch

import gpucomm.torch as hvd
from gpucomm import job as jobs

BIG = 6000  # float32 elements: over the 16 KiB inline limit, so these allreduces use the data plane


def _raises(exc: type[BaseException], call: Callable[[], Any]) -> tuple[float, str]:
    """``call()`` must raise ``exc``; returns (seconds it took, message)."""
    t0 = time.monotonic()
    try:
        call()
    except exc as e:
        return time.monotonic() - t0, str(e)
    raise AssertionError(f"{getattr(call, '__name__', call)} did not raise {exc.__name__}")


def _sum_check(name: str, numel: int = 3, **kw) -> None:
    """A correct allreduce: proof that the job still works."""
    n, r = hvd.size(), hvd.rank()
    got = hvd.allreduce(torch.full((numel,), float(r + 1)), op=hvd.Sum, name=name, **kw)
    assert torch.equal(got, torch.full((numel,), n * (n + 1) / 2)), (name, got)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _capture(logger: str) -> _Records:
    handler = _Records()
    logging.getLogger(logger).addHandler(handler)
    return handler


# ---------------------------------------------------------------------------------------------
# 1. ranks that disagree


def mismatches() -> dict[str, tuple[float, str, str]]:
    """Rank 1 differs from the others in one field per case; every rank gets the error."""
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    odd = r == 1
    cases = {
        "shape": lambda: hvd.allreduce(torch.ones(3 if odd else 2), name="shape"),
        "shape-big": lambda: hvd.allreduce(torch.ones(BIG + 1 if odd else BIG), name="shape-big"),
        "dtype": lambda: hvd.allreduce(torch.ones(2, dtype=torch.float64 if odd else torch.float32), name="dtype"),
        "op": lambda: hvd.allreduce(torch.ones(2), name="op", op=hvd.Max if odd else hvd.Sum),
        "root": lambda: hvd.broadcast(torch.ones(2), root_rank=1 if odd else 0, name="root"),
        "prescale": lambda: hvd.allreduce(torch.ones(2), name="prescale", prescale_factor=2.0 if odd else 1.0),
        "postscale-big": lambda: hvd.allreduce(torch.ones(BIG), name="postscale-big",
                                               postscale_factor=0.5 if odd else 1.0),
        "splits": lambda: hvd.alltoall(torch.ones(2 * n), splits=[2] * n if odd else None, name="splits"),
        "count": lambda: hvd.grouped_allreduce([torch.ones(2)] * (2 if odd else 1), name="count"),
    }
    out = {}
    for what, call in cases.items():
        t0 = time.monotonic()
        try:
            call()
        except RuntimeError as e:
            out[what] = (time.monotonic() - t0, type(e).__name__, str(e))
        else:
            raise AssertionError(f"{what}: the mismatched collective did not raise on rank {r}")
        _sum_check(f"after.{what}")  # the job keeps working
        _sum_check(f"after.{what}.big", BIG)
    hvd.shutdown()
    return out


def duplicate_name() -> str | None:
    """Rank 0 submits a second 'dup' while the first is in flight; only rank 0 is told. Rank 1
    submits its 'dup' only after the 'go' allreduce, so the first 'dup' is surely still pending."""
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    submit = lambda: hvd.allreduce_async(torch.full((3,), float(r + 1)), name="dup", op=hvd.Sum)  # noqa: E731
    h = submit() if r != 1 else None
    message = None
    if r == 0:
        assert not hvd.poll(h), "rank 1 has not submitted 'dup' yet: it must still be in flight"
        _, message = _raises(ValueError, lambda: hvd.allreduce_async(torch.ones(3), name="dup"))
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="go").item() == n
    if r == 1:
        h = submit()
    assert hvd.synchronize(h).tolist() == [n * (n + 1) / 2] * 3  # the first one completes
    # once synchronized, the name is free again
    assert hvd.allreduce(torch.ones(3), name="dup", op=hvd.Sum).tolist() == [float(n)] * 3
    hvd.shutdown()
    return message


# ---------------------------------------------------------------------------------------------
# 2. order and the response cache


def out_of_order() -> None:
    """Ranks submit the same async ops in different orders and synchronize them in other orders;
    'b' and 'c' have the same shape and go through Gloo, so running them in a different order on
    different ranks would swap their results."""
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    names = ["a", "b", "c", "d"]
    numel = {"a": 3, "b": BIG, "c": BIG, "d": 5}
    orders = [names, names[::-1], ["b", "d", "a", "c"]]
    for round_ in range(3):  # the later rounds are response-cache hits
        order = orders[(r + round_) % len(orders)]
        handles = {nm: hvd.allreduce_async(torch.full((numel[nm],), 100.0 * names.index(nm) + r), name=nm,
                                           op=hvd.Sum) for nm in order}
        grouped = hvd.grouped_allreduce_async([torch.full((2,), float(r)), torch.full((BIG,), 1.0)], name="grouped",
                                              op=hvd.Sum)
        for nm in orders[(r + round_ + 1) % len(orders)]:
            want = 100.0 * names.index(nm) * n + n * (n - 1) / 2
            got = hvd.synchronize(handles[nm])
            assert torch.equal(got, torch.full((numel[nm],), want)), (round_, nm, got[:4])
        small, big = hvd.synchronize(grouped)
        assert small.tolist() == [n * (n - 1) / 2] * 2 and torch.equal(big, torch.full((BIG,), float(n)))
    hvd.shutdown()


def cache_bursts() -> dict[str, list[int]]:
    """Two bursts of 100 named async allreduces, with and without the coordinator-side reduction;
    returns the request frames each burst cost this rank. Then cached names whose request changes:
    an allgather with new first dimensions, an allreduce with a mismatched shape on one call."""
    frames: dict[str, list[int]] = {}
    for inline in ("16384", "0"):
        os.environ["GPUCOMM_INLINE_BYTES"] = inline
        hvd.init()
        n, r = hvd.size(), hvd.rank()
        ctl = jobs.current().controller
        frames[inline] = []
        for burst in range(2):
            hvd.barrier()
            before = hvd.stats()["control_rounds"]
            handles = [hvd.allreduce_async(torch.full((4,), float(i + r + burst)), name=f"burst.{i}", op=hvd.Sum)
                       for i in range(100)]
            outs = [hvd.synchronize(h) for h in handles]
            frames[inline].append(hvd.stats()["control_rounds"] - before)
            # white-box: every name is now in this rank's response cache, so the next burst sends hits
            assert sum(1 for _, name in ctl._cache.keys() if name.startswith("allreduce.burst.")) == 100
            for i, out in enumerate(outs):
                want = n * (i + burst) + n * (n - 1) / 2
                assert out.tolist() == [want] * 4, (inline, burst, i, out)
        # a cached allgather whose first dimensions change between calls gets the new ones
        for step in range(4):
            rows = [(q + step) % 3 for q in range(n)]
            got = hvd.allgather(torch.full((rows[r], 2), float(r)), name="rows")
            assert got.tolist() == [[float(q)] * 2 for q in range(n) for _ in range(rows[q])], (inline, step, got)
        # a cached name used with a mismatched shape fails everywhere, then works again
        for step in range(4):
            numel = 3 if step != 2 or r != 1 else 4
            try:
                got = hvd.allreduce(torch.full((numel,), float(r)), op=hvd.Sum, name="cached")
            except RuntimeError as e:
                assert step == 2 and "rank 1 sent [4]" in str(e), (step, e)
            else:
                assert step != 2 and got.tolist() == [n * (n - 1) / 2] * 3, (step, got)
        hvd.shutdown()
    return frames


# ---------------------------------------------------------------------------------------------
# 3. the stall inspector


def stall_shutdown() -> dict[str, Any]:
    """Every rank but 1 submits allreduce 'forgotten'; rank 1 never does. The stall inspector
    warns after 1 s and turns the stall into an error after 3 s."""
    logs = _capture("gpucomm.control")
    hvd.init()
    r = hvd.rank()
    hvd.barrier()
    out: dict[str, Any] = {}
    if r != 1:
        out["elapsed"], out["error"] = _raises(RuntimeError, lambda: hvd.allreduce(torch.ones(2), name="forgotten"))
    else:
        ctl = jobs.current().controller
        deadline = time.monotonic() + 20
        while ctl.failure() is None:  # rank 1 is not waiting on anything: it learns in the background
            assert time.monotonic() < deadline, "the stall shutdown never reached rank 1"
            time.sleep(0.05)
        _, out["error"] = _raises(RuntimeError, lambda: hvd.allreduce(torch.ones(2), name="next"))
    # every later collective fails too, with the same cause
    _, out["later"] = _raises(RuntimeError, lambda: hvd.allreduce(torch.ones(2), name="later"))
    out["warnings"] = [rec.getMessage() for rec in logs.records if rec.levelno == logging.WARNING]
    hvd.shutdown()
    return out


def stall_warning_then_recover() -> dict[str, Any]:
    """Rank 1 submits 'forgotten' 2.5 s late: the warning is logged and the job then finishes."""
    logs = _capture("gpucomm.control")
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    hvd.barrier()
    if r == 1:
        time.sleep(2.5)
    got = hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum, name="forgotten")
    assert got.tolist() == [n * (n + 1) / 2] * 2
    _sum_check("after")
    warnings = [rec.getMessage() for rec in logs.records if rec.levelno == logging.WARNING]
    hvd.shutdown()
    return {"sum": got[0].item(), "warnings": warnings}


def stall_timeout_names_missing_rank() -> str | None:
    """GPUCOMM_TIMEOUT=3: rank 1 waits on 'late' for rank 0, which submits it only after 4 s;
    rank 1's timeout error names rank 0 (learned from the coordinator's stall reports)."""
    hvd.init()
    r = hvd.rank()
    hvd.barrier()
    message = None
    if r == 0:
        time.sleep(4.0)
        got = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="late")  # rank 1's request is still pending
        assert got.tolist() == [2.0, 2.0]
    else:
        _, message = _raises(RuntimeError, lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum, name="late"))
        assert "within 3 s" in message, message  # the 3 s GPUCOMM_TIMEOUT fired, not another limit
    _sum_check("after")  # rank 1's 'late' completes in the background once rank 0 submits it
    hvd.shutdown()
    return message


# ---------------------------------------------------------------------------------------------
# 4. join


def join_uneven_steps() -> int:
    """Rank r runs 3 + r steps, then joins; ranks that joined contribute zeros."""
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    for k in range(3 + r):
        active = [q for q in range(n) if 3 + q > k]
        scale = float(k + 1)
        # Sum of rank-dependent values: the joined ranks' zeros drop out exactly
        want_sum = scale * sum(q + 1 for q in active)
        for name, numel in (("small", 3), ("big", BIG)):
            got = hvd.allreduce(torch.full((numel,), scale * (r + 1)), op=hvd.Sum, name=f"sum.{name}")
            assert torch.equal(got, torch.full((numel,), want_sum)), (k, name, got[:3])
        # Average still divides by the full size: x * active / size (exact in integers: x = 6(k+1))
        x = 6 * (k + 1)
        want_avg = x * len(active) // n
        for name, numel in (("small", 3), ("big", BIG)):
            got = hvd.allreduce(torch.full((numel,), x, dtype=torch.int64), op=hvd.Average, name=f"avg.{name}")
            assert torch.equal(got, torch.full((numel,), want_avg, dtype=torch.int64)), (k, name, got[:3])
        got = hvd.reducescatter(torch.full((2 * n, 2), x, dtype=torch.int64), op=hvd.Average, name="rs")
        assert torch.equal(got, torch.full((2, 2), want_avg, dtype=torch.int64)), (k, got)
        small, big = hvd.grouped_allreduce([torch.full((2,), scale * (r + 1)), torch.full((BIG,), x, dtype=torch.int64)],
                                           op=hvd.Sum, name="grouped")
        assert small.tolist() == [want_sum] * 2 and torch.equal(big, torch.full((BIG,), x * len(active))), (k, small)
    last = hvd.join()
    # after every rank joined, nobody stands in any more
    _sum_check("after.small")
    _sum_check("after.big", BIG)
    hvd.shutdown()
    return last


def join_then_data_movement() -> tuple[int, dict[str, str]]:
    """Rank 0 joins at once; the others try what cannot run with a joined rank, then join."""
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    errors: dict[str, str] = {}
    if r == 0:
        last = hvd.join()
    else:
        cases = {
            "allgather": lambda: hvd.allgather(torch.ones(2, 1), name="g"),
            "broadcast": lambda: hvd.broadcast(torch.ones(2), root_rank=1, name="b"),
            "alltoall": lambda: hvd.alltoall(torch.ones(2 * n), name="t"),
            "min": lambda: hvd.allreduce(torch.ones(2), op=hvd.Min, name="m"),
        }
        for kind, call in cases.items():
            _, errors[kind] = _raises(RuntimeError, call)
        got = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="s")  # Sum still runs, with rank 0's zeros
        assert got.tolist() == [n - 1.0] * 2, got
        last = hvd.join()
    # the joined rank keeps working afterwards
    got = hvd.allgather(torch.full((1,), float(r)), name="g")
    assert got.tolist() == [float(q) for q in range(n)], got
    _sum_check("after")
    hvd.shutdown()
    return last, errors


def early_join_under_stall_shutdown() -> int:
    """Rank 0 runs out of data at once and joins; the others keep training for 5 s (past
    GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS=3) with rank 0 standing in, then join. Nothing is stalled:
    rank 0 did what a rank without data must do, and the others make progress all along."""
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    if r != 0:
        for step in range(10):
            got = hvd.allreduce(torch.full((3,), float(step)), op=hvd.Sum, name="step")
            assert got.tolist() == [step * (n - 1.0)] * 3, got
            time.sleep(0.5)
    last = hvd.join()
    hvd.shutdown()
    return last


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def train_uneven_then_join() -> tuple[int, list[list]]:
    """Rank r trains on 4 + r batches, then joins; the last rank to join broadcasts the model."""
    hvd.init()
    r = hvd.rank()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(4 + r):
        x, y = _batch(r, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    params = [p.detach().tolist() for p in model.parameters()]  # plain lists: tensors would not outlive the rank
    hvd.shutdown()
    return last, params


def reference_training(steps: dict[int, int], size: int, members: list[int] | None = None) -> list[torch.Tensor]:
    """What the training above must produce: at each step, the gradients of the ranks that still
    have data, summed and divided by the number of ranks taking part (joined ranks count as zeros)."""
    members = list(range(size)) if members is None else members
    model = _model()
    for step in range(max(steps.values())):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for q in members:
            if step >= steps[q]:
                continue
            model.zero_grad()
            x, y = _batch(q, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad
        with torch.no_grad():
            for g, p in zip(grads, model.parameters()):
                p -= 0.1 * g / len(members)
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------
# 5. process sets (3 ranks)


def static_process_sets() -> dict[str, Any]:
    """Sets [0, 2], [1] and [1, 2] registered at init; each works among its members while the
    others do something else; then ranks 1 and 2 train with DistributedOptimizer on [1, 2]."""
    even, solo, pair = hvd.ProcessSet([2, 0]), hvd.ProcessSet([1]), hvd.ProcessSet([1, 2])
    hvd.init(process_sets=[even, solo, pair])
    r = hvd.rank()
    out: dict[str, Any] = {}
    assert (even.process_set_id, solo.process_set_id, pair.process_set_id) == (1, 2, 3)
    assert even.ranks == [0, 2] and even.size() == 2
    assert even.included() == (r != 1) and even.rank() == {0: 0, 2: 1}.get(r)
    if r in (0, 2):
        got = hvd.allreduce(torch.full((3,), float(r + 1)), op=hvd.Sum, name="shared", process_set=even)
        assert got.tolist() == [4.0] * 3, got
        got = hvd.allreduce(torch.full((BIG,), float(r + 1)), op=hvd.Average, name="big", process_set=even)
        assert torch.equal(got, torch.full((BIG,), 2.0)), got[:3]
        got = hvd.allgather(torch.full((r // 2 + 1, 2), float(r)), name="g", process_set=even)
        assert got.tolist() == [[0.0, 0.0], [2.0, 2.0], [2.0, 2.0]], got
        got = hvd.broadcast(torch.full((2,), float(r)), root_rank=2, name="b", process_set=even)  # a global rank
        assert got.tolist() == [2.0, 2.0], got
        got = hvd.alltoall(torch.tensor([float(r), float(r) + 0.5]), process_set=even)
        assert got.tolist() == ([0.0, 2.0] if r == 0 else [0.5, 2.5]), got
        hvd.barrier(process_set=even)
        _, out["root_not_member"] = _raises(ValueError, lambda: hvd.broadcast(torch.ones(1), root_rank=1,
                                                                               process_set=even))
    else:
        # meanwhile rank 1 runs its own set's collectives, one under the same name
        got = hvd.allreduce(torch.full((3,), 5.0), op=hvd.Sum, name="shared", process_set=solo)
        assert got.tolist() == [5.0] * 3, got
        hvd.barrier(process_set=solo)
        _, out["non_member"] = _raises(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=even))
        _, out["non_member_barrier"] = _raises(ValueError, lambda: hvd.barrier(process_set=even))
    _sum_check("global")  # the global set is unaffected
    _, out["add_static"] = _raises(ValueError, lambda: hvd.add_process_set([0, 1]))
    # DistributedOptimizer on [1, 2]: the coordinator's rank is not a member
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    if r == 0:
        outside = hvd.DistributedOptimizer(sgd, model.named_parameters(), process_set=pair)  # Horovod: local steps
        x, y = _batch(r, 0)
        outside.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        outside.step()  # no collective: ranks 1 and 2 never see it
        out["optimizer_non_member"] = type(outside).__name__
    else:
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), process_set=pair)
        for step in range(3):
            x, y = _batch(r, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        hvd.barrier(process_set=pair)
        out["params"] = [p.detach().tolist() for p in model.parameters()]
    hvd.barrier()
    hvd.shutdown()
    return out


def dynamic_process_sets() -> dict[str, str]:
    hvd.init(process_sets="dynamic")
    n, r = hvd.size(), hvd.rank()
    out: dict[str, str] = {}
    ps = hvd.add_process_set([1, 0])
    assert isinstance(ps, hvd.ProcessSet) and ps.process_set_id == 1 and ps.ranks == [0, 1], ps
    assert ps.included() == (r in (0, 1))
    if r in (0, 1):
        got = hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum, name="pair", process_set=ps)
        assert got.tolist() == [3.0, 3.0], got
        got = hvd.allreduce(torch.full((BIG,), float(r + 1)), op=hvd.Sum, name="pair.big", process_set=ps)
        assert torch.equal(got, torch.full((BIG,), 3.0))
    # the same ranks again (in another order): an error on every rank
    _, out["duplicate"] = _raises(RuntimeError, lambda: hvd.add_process_set(hvd.ProcessSet([1, 0])))
    _, out["global_again"] = _raises(RuntimeError, lambda: hvd.add_process_set(list(range(n))))
    # a set with an operation in flight cannot be removed
    h = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="busy", process_set=ps) if r == 0 else None
    _, out["busy"] = _raises(RuntimeError, lambda: hvd.remove_process_set(ps))
    assert ps.process_set_id == 1, "a failed removal leaves the set registered"
    if r == 1:
        hvd.allreduce(torch.ones(2), op=hvd.Sum, name="busy", process_set=ps)
    if r == 0:
        assert hvd.synchronize(h).tolist() == [2.0, 2.0]
    assert hvd.remove_process_set(ps) is True
    assert ps.process_set_id is None and ps.included() is None
    _, out["removed"] = _raises(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=ps))
    assert hvd.remove_process_set(ps) is False
    _, out["remove_global"] = _raises(ValueError, lambda: hvd.remove_process_set(hvd.global_process_set))
    # a new set gets a fresh id; barrier on it among its members
    tail = hvd.add_process_set(hvd.ProcessSet([1, 2]))
    assert tail.process_set_id == 2
    if r in (1, 2):
        hvd.barrier(process_set=tail)
        got = hvd.allreduce(torch.full((2,), float(r)), op=hvd.Sum, name="pair", process_set=tail)
        assert got.tolist() == [3.0, 3.0], got
    _sum_check("global")
    hvd.shutdown()
    return out


# ---------------------------------------------------------------------------------------------
# 6. a rank that dies (run as a script by ``main``, so an uncaught exception is really uncaught)


def dies_while_others_wait(mode: str, dying: str = "1") -> None:
    """Rank ``dying`` dies (``exit``: os._exit(3); ``raise``: an uncaught ValueError) while the
    others wait in an allreduce that needs it. The others print what they saw as one JSON line."""
    hvd.init()
    r = hvd.rank()
    hvd.barrier()
    if r == int(dying):
        time.sleep(0.5)  # the others are waiting by now
        if mode == "exit":
            os._exit(3)
        raise ValueError(f"rank {r} gave up")
    elapsed, message = _raises(RuntimeError, lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum, name="waiting"))
    later_elapsed, later = _raises(RuntimeError, lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum, name="later"))
    print(json.dumps({"rank": r, "elapsed": elapsed, "error": message, "later_elapsed": later_elapsed,
                      "later": later}), flush=True)
    hvd.shutdown()


def shutdown_while_others_wait(leaver: int = 1) -> dict[str, Any] | None:
    """Rank ``leaver`` shuts gpucomm down cleanly while the others wait on an allreduce it never submits
    (rank 0, the coordinator, keeps its process and serves on until the others shut down too)."""
    hvd.init()
    r = hvd.rank()
    hvd.barrier()
    if r == leaver:
        time.sleep(0.5)
        hvd.shutdown()
        return None
    elapsed, message = _raises(RuntimeError, lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum, name="waiting"))
    hvd.shutdown()
    return {"elapsed": elapsed, "error": message}


def main(argv: list[str]) -> None:
    globals()[argv[0]](*argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])


def left_after_submitting() -> str | None:
    """Rank 0 submits an allreduce, then shuts gpucomm down without waiting for it (its own handle fails);
    rank 1 submits the same allreduce later: it can never run, and must say why at once."""
    hvd.init()
    if hvd.rank() == 0:
        hvd.allreduce_async(torch.ones(2), name="orphan")
        time.sleep(0.5)  # the request has reached the coordinator
        hvd.shutdown()
        return None
    time.sleep(1.0)
    try:
        hvd.allreduce(torch.ones(2), name="orphan")
        outcome = "ran"
    except Exception as e:  # noqa: BLE001 - the error is the result
        outcome = str(e)
    hvd.shutdown()
    return outcome
