"""Rank-side checks of the MPI data plane, run by ``tests/test_mpi_backend.py`` under a real
``mpiexec``/``mpirun``: ``python tests/ranks/mpi_backend_program.py SCENARIO``. Every rank computes every
rank's input itself, so each result is checked against a reference on the spot; a failed check
raises (the launcher then stops the job with a non-zero code). Each scenario prints ``OK <name>``
lines on success."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from gpucomm.backends.base import BackendOp  # noqa: E402
from gpucomm.errors import CollectiveError  # noqa: E402

TIMEOUT = 60.0
REDUCIBLE = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
             torch.float64)
MOVABLE = REDUCIBLE + (torch.bool, torch.int16, torch.complex128)  # complex128: 16-byte elements
OPS = (BackendOp.SUM, BackendOp.MIN, BackendOp.MAX, BackendOp.PRODUCT, BackendOp.AVG)


def data(rank: int, n: int, dtype: torch.dtype, op: BackendOp | None = None) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, so every reduction is exact in every dtype (products
    of 3 values in 1..3 stay below bfloat16's 8 significant bits)."""
    i = torch.arange(n, dtype=torch.int64)
    if dtype == torch.bool:
        return (i + rank) % 3 == 0
    if op is BackendOp.PRODUCT:
        v = (i * 5 + rank * 7) % 3 + 1
    elif dtype == torch.uint8:
        v = (i * 7 + rank * 13) % 11
    else:
        v = (i * 7 + rank * 13) % 11 - 3
    return v.to(dtype) if dtype != torch.complex128 else torch.complex(v.double(), -v.double())


def reference(size: int, n: int, dtype: torch.dtype, op: BackendOp) -> torch.Tensor:
    parts = [data(r, n, dtype, op) for r in range(size)]
    acc = parts[0].clone()
    for p in parts[1:]:
        if op in (BackendOp.SUM, BackendOp.AVG):
            acc = acc + p
        elif op is BackendOp.PRODUCT:
            acc = acc * p
        elif op is BackendOp.MIN:
            acc = torch.minimum(acc, p)
        else:
            acc = torch.maximum(acc, p)
    return acc / size if op is BackendOp.AVG else acc.to(dtype)


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got[:8].tolist()} ({got.dtype}, {tuple(got.shape)}), want "
                             f"{want[:8].tolist()} ({want.dtype}, {tuple(want.shape)})")


def say(text: str) -> None:
    """One line in one write (ranks share the launcher's stdout)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def done(work) -> None:
    work.wait(TIMEOUT)


# ---------------------------------------------------------------------------------------------


def collectives(b) -> int:
    """Every collective, dtype and op, in place and out of place, even and uneven."""
    rank, size, count = b.rank, b.size, 0
    n = 37  # not a multiple of anything in particular
    for dtype in REDUCIBLE:
        for op in OPS:
            if op is BackendOp.AVG and not dtype.is_floating_point:
                continue
            want = reference(size, n, dtype, op)
            x = data(rank, n, dtype, op)
            out = torch.empty_like(x)
            done(b.allreduce(x, out, op=op))
            check(out, want, f"allreduce {op.value} {dtype} out of place")
            check(x, data(rank, n, dtype, op), f"allreduce {op.value} {dtype}: send left unchanged")
            done(b.allreduce(x, x, op=op))
            check(x, want, f"allreduce {op.value} {dtype} in place")
            # reducescatter: rank r gets part r
            whole = torch.cat([data(rank, n, dtype, op)] * size)
            want_part = torch.cat([want] * size)[rank * n:(rank + 1) * n]
            part = torch.empty(n, dtype=dtype)
            done(b.reducescatter(whole, part, op=op))
            check(part, want_part, f"reducescatter {op.value} {dtype} out of place")
            inplace = whole[rank * n:(rank + 1) * n]
            done(b.reducescatter(whole, inplace, op=op))
            check(inplace, want_part, f"reducescatter {op.value} {dtype} in place")
            count += 4
    wrap = torch.full((5,), 200 + rank, dtype=torch.uint8)
    done(b.allreduce(wrap, wrap, op=BackendOp.SUM))
    check(wrap, torch.full((5,), sum(200 + r for r in range(size)) % 256, dtype=torch.uint8), "uint8 sum wraps")
    for dtype in MOVABLE:
        parts = [data(r, n, dtype) for r in range(size)]
        # allgather, equal parts
        recv = torch.empty(n * size, dtype=dtype)
        done(b.allgather(parts[rank], recv))
        check(recv, torch.cat(parts), f"allgather {dtype} out of place")
        recv = torch.zeros(n * size, dtype=dtype)
        recv[rank * n:(rank + 1) * n] = parts[rank]
        done(b.allgather(recv[rank * n:(rank + 1) * n], recv))
        check(recv, torch.cat(parts), f"allgather {dtype} in place")
        # allgatherv: rank r sends (r * 2) % 5 elements (rank 0 sends none)
        counts = [(r * 2) % 5 for r in range(size)]
        mine = parts[rank][: counts[rank]]
        recv = torch.empty(sum(counts), dtype=dtype)
        done(b.allgather(mine, recv, recv_counts=counts))
        check(recv, torch.cat([parts[r][: counts[r]] for r in range(size)]), f"allgatherv {dtype} out of place")
        recv = torch.zeros(sum(counts), dtype=dtype)
        at = sum(counts[:rank])
        recv[at:at + counts[rank]] = mine
        done(b.allgather(recv[at:at + counts[rank]], recv, recv_counts=counts))
        check(recv, torch.cat([parts[r][: counts[r]] for r in range(size)]), f"allgatherv {dtype} in place")
        # broadcast from every root
        for root in range(size):
            out = torch.zeros(n, dtype=dtype)
            done(b.broadcast(parts[rank], out, root=root))
            check(out, parts[root], f"broadcast {dtype} from {root} out of place")
            buf = parts[rank].clone()
            done(b.broadcast(buf, buf, root=root))
            check(buf, parts[root], f"broadcast {dtype} from {root} in place")
        # alltoall, uneven: rank r sends (r + 2 s) % 4 elements to rank s (some send none)
        sends = [[(r + 2 * s) % 4 for s in range(size)] for r in range(size)]
        def chunk(src: int, dst: int) -> torch.Tensor:  # what src sends dst
            return data(src * 10 + dst, sends[src][dst], dtype)
        send = torch.cat([chunk(rank, s) for s in range(size)])
        recv_counts = [sends[r][rank] for r in range(size)]
        recv = torch.empty(sum(recv_counts), dtype=dtype)
        done(b.alltoall(send, recv, sends[rank], recv_counts))
        check(recv, torch.cat([chunk(r, rank) for r in range(size)]), f"alltoallv {dtype} out of place")
        # alltoall in place (equal counts)
        k = 3
        buf = torch.cat([data(rank * 10 + s, k, dtype) for s in range(size)])
        done(b.alltoall(buf, buf, [k] * size, [k] * size))
        check(buf, torch.cat([data(r * 10 + rank, k, dtype) for r in range(size)]), f"alltoall {dtype} in place")
        count += 8 + 2 * size
    empty = torch.empty(0)
    done(b.allreduce(empty, empty, op=BackendOp.SUM))
    done(b.barrier())
    return count


def floats(b) -> None:
    """Random floats: the sum matches a float64 reference, and every rank holds the same bits."""
    rank, size = b.rank, b.size
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        gen = [torch.Generator().manual_seed(1000 + r) for r in range(size)]
        parts = [torch.randn(100_003, generator=g).to(dtype) for g in gen]
        want = torch.stack([p.double() for p in parts]).sum(0)
        x = parts[rank].clone()
        done(b.allreduce(x, x, op=BackendOp.SUM))
        err = ((x.double() - want).abs() / (want.abs() + 1)).max().item()
        if err > tol:
            raise AssertionError(f"{dtype} sum off by {err} (tolerance {tol})")
        every = torch.empty(x.numel() * size, dtype=dtype)
        done(b.allgather(x, every))
        rows = every.view(size, -1).view(torch.int16 if dtype != torch.float32 else torch.int32)
        if not all(torch.equal(rows[0], rows[r]) for r in range(size)):
            raise AssertionError(f"{dtype} allreduce: ranks hold different bits")
    say(f"OK floats rank {rank}")


def groups(world) -> None:
    """A process subset, in reverse order, created by its members only; a duplicate of the world."""
    from gpucomm.backends.mpi import mpi_group  # noqa: PLC0415

    rank, size = world.rank, world.size
    members = list(reversed(range(size)))[: max(2, size - 1)]  # size 2: [1, 0]; size 3: [2, 1]
    if rank in members:
        g = mpi_group(world, members, rank, label="test/subset")
        assert (g.rank, g.size) == (members.index(rank), len(members)), (g.rank, g.size)
        x = torch.tensor([float(rank + 1)])
        done(g.allreduce(x, x, op=BackendOp.SUM))
        check(x, torch.tensor([float(sum(m + 1 for m in members))]), "subset allreduce")
        y = torch.tensor([rank * 100])
        done(g.broadcast(y, y, root=0))  # group rank 0 = world rank members[0]
        check(y, torch.tensor([members[0] * 100]), "subset broadcast from its rank 0")
        g.close()
    try:
        mpi_group(world, [0], 0 if rank else 1)
        raise AssertionError("mpi_group accepted a rank that is not this process")
    except ValueError as e:
        assert "only members" in str(e), e
    done(world.barrier())
    say(f"OK groups rank {rank}")


def independent(world) -> None:
    """Two communicators over the same ranks progress independently: rank 0 issues and waits on A
    then B, the others B then A (blocking collectives on one thread would deadlock)."""
    a, b = world, world.dup("test/dup")
    rank, size = a.rank, a.size
    assert (b.rank, b.size) == (rank, size)
    x, y = torch.tensor([1.0 + rank]), torch.tensor([10.0 * (rank + 1)])
    if rank == 0:
        wa = a.allreduce(x, x, op=BackendOp.SUM)
        done(wa)  # completes although the other ranks issue on b first
        wb = b.allreduce(y, y, op=BackendOp.SUM)
    else:
        wb = b.allreduce(y, y, op=BackendOp.SUM)
        time.sleep(0.2)
        wa = a.allreduce(x, x, op=BackendOp.SUM)
    done(wa)
    done(wb)
    check(x, torch.tensor([float(sum(1 + r for r in range(size)))]), "dup: world allreduce")
    check(y, torch.tensor([float(sum(10 * (r + 1) for r in range(size)))]), "dup: duplicate allreduce")
    b.close()
    say(f"OK independent rank {rank}")


def threads(world) -> None:
    """Two threads issue 200 collectives each, on two communicators, at once."""
    other = world.dup("test/threads")
    rank, size, errors = world.rank, world.size, []

    def run(b, offset: float) -> None:
        try:
            for i in range(200):
                x = torch.full((1 + i % 7,), offset + i + rank)
                w = b.allreduce(x, x, op=BackendOp.SUM) if i % 3 else b.allgather(x, torch.empty(x.numel() * size))
                done(w)
                if i % 3:
                    check(x, torch.full_like(x, size * (offset + i) + sum(range(size))), f"thread {offset} op {i}")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(b, off)) for b, off in ((world, 0.0), (other, 1000.0))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(TIMEOUT)
    if errors or any(t.is_alive() for t in ts):
        raise AssertionError(f"threads: {errors or 'still running'}")
    other.close()
    say(f"OK threads rank {rank}")


def timeout_scenario(world) -> None:
    """Rank 1 never joins an allreduce: rank 0's wait raises a CollectiveError naming it after the
    timeout, later calls fail at once, and at exit rank 0 aborts the MPI job."""
    if world.rank == 1:
        time.sleep(3)
        say("rank 1 leaves without joining")
        return
    if world.rank != 0:
        return
    x = torch.ones(1000)
    failed = {"cause": None}
    work = world.allreduce(x, x, op=BackendOp.SUM)
    t0 = time.monotonic()
    try:
        work.wait(0.5, lambda: failed["cause"])
        raise AssertionError("the allreduce completed without rank 1")
    except CollectiveError as e:
        text = str(e)
        assert "allreduce of 1000 float32 (sum)" in text and "did not complete within 0.5 s" in text, text
        assert "MPI_Abort" in text, text
    try:
        world.allreduce(x, x, op=BackendOp.SUM)
        raise AssertionError("a broken communicator took more work")
    except CollectiveError as e:
        assert "broken" in str(e), e
    say(f"OK timeout rank 0 after {time.monotonic() - t0:.1f} s")


def failed_elsewhere(world) -> None:
    """``failed()`` turning truthy releases a wait at once with its cause."""
    if world.rank != 0:
        time.sleep(1.0)
    x = torch.ones(3)
    if world.rank == 0:
        work = world.barrier()
        try:
            work.wait(TIMEOUT, lambda: "rank 9 exploded")
            say("barrier completed before the failure was seen")
        except CollectiveError as e:
            assert "rank 9 exploded" in str(e), e
            say("OK failed-elsewhere rank 0")
        work.wait(TIMEOUT)  # the barrier itself still completes once the others arrive
    else:
        done(world.barrier())
    done(world.allreduce(x, x, op=BackendOp.SUM))


def thread_level() -> None:
    """MPI initialized by the program at a lower thread level: load_mpi refuses, saying why."""
    import mpi4py  # noqa: PLC0415

    mpi4py.rc.thread_level = "serialized"
    from mpi4py import MPI  # noqa: PLC0415

    from gpucomm.backends.mpi import MpiUnavailable, load_mpi  # noqa: PLC0415

    provided = MPI.Query_thread()
    if provided >= MPI.THREAD_MULTIPLE:
        say("SKIP thread level: the library provides MPI_THREAD_MULTIPLE even when asked for less")
        return
    try:
        load_mpi()
        raise AssertionError("load_mpi accepted MPI_THREAD_SERIALIZED")
    except MpiUnavailable as e:
        text = str(e)
        assert "MPI_THREAD_SERIALIZED" in text and "needs MPI_THREAD_MULTIPLE" in text, text
        assert "GPUCOMM_CPU_OPERATIONS=gloo" in text, text
        say(f"OK thread level: {text}")


def mismatch() -> None:
    """Started by Open MPI's mpirun with mpi4py pointing at MPICH: refused before MPI_Init."""
    from gpucomm.backends.cpu_operations import explain_cpu_operations  # noqa: PLC0415
    from gpucomm.backends.mpi import MpiUnavailable, load_mpi  # noqa: PLC0415

    try:
        load_mpi()
        raise AssertionError("load_mpi initialized another launcher's library")
    except MpiUnavailable as e:
        assert "Open MPI's launcher" in str(e) and "MPICH's library" in str(e) and "MPI4PY_MPIABI" in str(e), e
    choice = explain_cpu_operations(os.environ)
    assert choice.name == "gloo" and "MPI4PY_MPIABI" in choice.reason, choice
    say(f"OK mismatch: {choice.reason}")


def choose() -> None:
    from gpucomm.backends.cpu_operations import explain_cpu_operations  # noqa: PLC0415

    choice = explain_cpu_operations(os.environ)
    say(f"CHOICE {choice.name}: {choice.reason}")


def main() -> None:
    scenario = sys.argv[1]
    if scenario == "thread_level":
        return thread_level()
    if scenario == "mismatch":
        return mismatch()
    if scenario == "choose":
        return choose()
    from gpucomm.backends.mpi import mpi_world  # noqa: PLC0415

    torch.set_num_threads(1)
    world = mpi_world(timeout=TIMEOUT)
    if scenario == "all":
        count = collectives(world)
        say(f"OK collectives rank {world.rank} of {world.size}: {count} checks")
        floats(world)
        groups(world)
        independent(world)
        threads(world)
    elif scenario == "timeout":
        timeout_scenario(world)
    elif scenario == "failed":
        failed_elsewhere(world)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    if scenario != "timeout":
        world.close()


if __name__ == "__main__":
    main()
