"""CPU collectives on MPI (gpucomm's MPI data plane, and raw mpi4py as its anchor) beside torch's Gloo
(``torch.distributed`` in the same processes), interleaved, at 64 KiB, 1 MiB and 32 MiB.

    mpiexec -n 2 python benchmarks/mpi_vs_gloo.py [--json mpi_vs_gloo.json] [--quick]
    gpucomm-run --mpi -np 2 python benchmarks/mpi_vs_gloo.py

Each round runs every implementation once per collective and size, in turn (so machine noise hits
all of them), each call after a barrier; the table shows median times over the rounds and bus
bandwidth (nccl-tests' convention: allreduce moves 2(p-1)/p of the buffer per rank; allgather,
reducescatter and alltoall (p-1)/p; broadcast all of it). "size" is the whole buffer: allreduce's
and broadcast's tensor, allgather's output, reducescatter's input, alltoall's send and receive.
Also times a bfloat16 allreduce three ways (the backend's user-defined MPI op; through float32 with
raw mpi4py; Gloo) and writes everything as JSON. The issue's goal: allreduce of 32 MiB on 2 ranks of
one host, MPI data plane >= 1.3x Gloo's bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_stats import fmt, ratio, spread, write_json  # noqa: E402
from torch_group import all_gather_into, gloo_collectives  # noqa: E402

from gpucomm.backends.base import BackendOp  # noqa: E402
from gpucomm.backends.gloo import GLOO_REDUCES_BF16  # noqa: E402
from gpucomm.backends.mpi import mpi_world  # noqa: E402

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
IMPLS = ("gpucomm-mpi", "mpi4py", "gloo")
TIMEOUT = 300.0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,1M,32M", help="buffer sizes (K, M suffixes: KiB, MiB)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smoke run: 64K and 1M, 2 rounds, 1 warm-up")
    ap.add_argument("--json", default="mpi_vs_gloo.json")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.rounds, args.warmup = "64K,1M", 2, 1
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    return args


def parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    return int(text[:-1] if text[-1].upper() in "KMG" else text) * scale


def label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def bus_factor(kind: str, p: int) -> float:
    return {"allreduce": 2 * (p - 1) / p, "broadcast": 1.0}.get(kind, (p - 1) / p)


class Bench:
    """The three implementations of each collective on one set of buffers."""

    def __init__(self, kind: str, nbytes: int, backend, raw, MPI, pg, gloo_has: dict[str, bool],
                 dtype: torch.dtype = torch.float32) -> None:
        p, rank = backend.size, backend.rank
        self.gloo_has = gloo_has
        n = nbytes // torch.tensor([], dtype=dtype).element_size()
        n -= n % p
        self.kind, self.p, self.n = kind, p, n
        self.backend, self.raw, self.MPI, self.pg = backend, raw, MPI, pg
        self.a = torch.rand(n).to(dtype)
        self.b = torch.empty(n, dtype=dtype)
        self.part = torch.rand(n // p).to(dtype)
        self.small = torch.empty(n // p, dtype=dtype)
        self.rank = rank
        mpi_type = {torch.float32: MPI.FLOAT, torch.bfloat16: MPI.UINT16_T}[dtype]
        buf = lambda t: [MPI.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size()), t.numel(), mpi_type]  # noqa: E731
        self.buf = buf
        self.mpi_type = mpi_type

    def gpucomm_mpi(self) -> None:
        b, k = self.backend, self.kind
        if k == "allreduce":
            w = b.allreduce(self.a, self.a, op=BackendOp.SUM)
        elif k == "allgather":
            w = b.allgather(self.part, self.b)
        elif k == "broadcast":
            w = b.broadcast(self.a, self.a, root=0)
        elif k == "alltoall":
            c = [self.n // self.p] * self.p
            w = b.alltoall(self.a, self.b, c, c)
        else:
            w = b.reducescatter(self.a, self.small, op=BackendOp.SUM)
        w.wait(TIMEOUT)

    def mpi4py(self) -> None:
        c, MPI, k, buf = self.raw, self.MPI, self.kind, self.buf
        if k == "allreduce":
            c.Allreduce(MPI.IN_PLACE, buf(self.a), MPI.SUM)
        elif k == "allgather":
            c.Allgather(buf(self.part), [buf(self.b)[0], self.n // self.p, self.mpi_type])
        elif k == "broadcast":
            c.Bcast(buf(self.a), 0)
        elif k == "alltoall":
            c.Alltoall([buf(self.a)[0], self.n // self.p, self.mpi_type], [buf(self.b)[0], self.n // self.p, self.mpi_type])
        else:
            c.Reduce_scatter_block([buf(self.a)[0], self.n // self.p, self.mpi_type], buf(self.small), MPI.SUM)

    def gloo(self) -> None:
        k, pg = self.kind, self.pg
        if k == "allreduce":
            dist.all_reduce(self.a, group=pg)
        elif k == "allgather":
            all_gather_into(self.b, self.part, self.gloo_has["allgather"], group=pg)
        elif k == "broadcast":
            dist.broadcast(self.a, 0, group=pg)
        elif k == "alltoall":
            dist.all_to_all_single(self.b, self.a, group=pg)
        else:
            dist.reduce_scatter_tensor(self.small, self.a, group=pg)

    def run(self, impl: str) -> None:
        {"gpucomm-mpi": self.gpucomm_mpi, "mpi4py": self.mpi4py, "gloo": self.gloo}[impl]()


def timed(fn, raw, MPI) -> float:
    """One call after a barrier; the slowest rank's time is the collective's."""
    raw.Barrier()
    t0 = time.perf_counter()
    fn()
    return raw.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def bf16_through_float32(raw, MPI, t: torch.Tensor) -> None:
    """The other way to reduce bfloat16 with MPI: widen to float32, reduce, narrow (2x the bytes)."""
    wide = t.float()
    raw.Allreduce(MPI.IN_PLACE, [MPI.buffer.fromaddress(wide.data_ptr(), wide.numel() * 4), wide.numel(), MPI.FLOAT],
                  MPI.SUM)
    t.copy_(wide)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    backend = mpi_world(timeout=TIMEOUT, label="bench")
    from mpi4py import MPI  # noqa: PLC0415 - initialized by mpi_world

    raw = MPI.COMM_WORLD.Dup()
    rank, p = backend.rank, backend.size
    if p < 2:
        sys.exit("mpi_vs_gloo: start it with at least 2 ranks under an MPI launcher (mpiexec -n 2 python "
                 "benchmarks/mpi_vs_gloo.py, or gpucomm-run --mpi -np 2 ...)")
    port = raw.bcast(None if rank else _free_port(), root=0)
    store = dist.TCPStore("127.0.0.1", port, p, rank == 0, timeout=datetime.timedelta(seconds=60))
    host = socket.gethostname()
    hosts = raw.allgather(host)
    if len(set(hosts)) > 1:
        store = dist.TCPStore(raw.bcast(host if rank == 0 else None, root=0), port, p, rank == 0,
                              timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=p, timeout=datetime.timedelta(seconds=TIMEOUT))
    pg = dist.group.WORLD
    gloo_has = gloo_collectives(pg)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cases = [(kind, size, torch.float32) for size in sizes for kind in KINDS]
    cases.append(("allreduce", max(sizes), torch.bfloat16))
    times: dict[tuple, dict[str, list[float]]] = {}
    for kind, size, dtype in cases:
        bench = Bench(kind, size, backend, raw, MPI, pg, gloo_has, dtype)
        impls = dict.fromkeys(IMPLS)
        if dtype == torch.bfloat16:
            impls = {"gpucomm-mpi": None, "mpi4py-via-float32": None, "gloo": None}
        if (kind == "reducescatter" and not gloo_has["reducescatter"]) or (dtype == torch.bfloat16
                                                                           and not GLOO_REDUCES_BF16):
            del impls["gloo"]  # this torch's Gloo cannot (torch 2.1: no reduce-scatter, no bfloat16 sums): n/a
        samples: dict[str, list[float]] = {i: [] for i in impls}
        for r in range(args.warmup + args.rounds):
            for impl in impls:
                fn = (lambda: bf16_through_float32(raw, MPI, bench.a)) if impl == "mpi4py-via-float32" else \
                    (lambda impl=impl: bench.run(impl))
                t = timed(fn, raw, MPI)
                if r >= args.warmup:
                    samples[impl].append(t)
        times[(kind, size, str(dtype).replace("torch.", ""))] = samples
    if rank == 0:
        report(args, times, p, hosts, MPI)
    dist.destroy_process_group()
    backend.close()
    raw.Free()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(args: argparse.Namespace, times: dict, p: int, hosts: list[str], MPI) -> None:
    rows, results = [], []
    for (kind, size, dtype), samples in times.items():
        med = {impl: statistics.median(v) for impl, v in samples.items()}
        bw = {impl: size * bus_factor(kind, p) / t / 1e9 if t > 0 else None for impl, t in med.items()}
        mpi_impl = "gpucomm-mpi"
        result = {"kind": kind, "bytes": size, "dtype": dtype, "ranks": p,
                  "seconds": {impl: spread(v) for impl, v in samples.items()},
                  "bus_gb_s": bw, "ratio_bw_gpucomm_mpi_over_gloo": ratio(bw[mpi_impl], bw.get("gloo")),
                  "ratio_time_gpucomm_mpi_over_raw_mpi4py": ratio(med[mpi_impl], med.get("mpi4py"))}
        results.append(result)
        rows.append((kind, label(size), dtype, med, bw, result["ratio_bw_gpucomm_mpi_over_gloo"]))
    library = MPI.Get_library_version().strip().splitlines()[0]
    print(f"# MPI vs Gloo, {p} ranks on {len(set(hosts))} host(s); {library}; torch {torch.__version__}; "
          f"{args.rounds} rounds (median), interleaved")
    print(f"{'collective':<14}{'size':>8} {'dtype':<9}" + "".join(f"{i + ' ms':>22}" for i in IMPLS)
          + f"{'MPI/Gloo bw':>13}")
    for kind, size_label, dtype, med, bw, r in rows:
        cells = []
        for impl in IMPLS:
            name = impl if impl in med else "mpi4py-via-float32" if impl == "mpi4py" else impl
            t = med.get(name)
            cells.append(f"{fmt(t * 1e3 if t is not None else None, '.3f')} ({fmt(bw.get(name), '.2f')} GB/s)")
        print(f"{kind:<14}{size_label:>8} {dtype:<9}" + "".join(f"{c:>22}" for c in cells) + f"{fmt(r, '.2f'):>12}x")
    goal = next((x for x in results if x["kind"] == "allreduce" and x["dtype"] == "float32"
                 and x["bytes"] == 32 << 20), None)
    if goal is not None:
        r = goal["ratio_bw_gpucomm_mpi_over_gloo"]
        print(f"# goal: allreduce 32 MiB float32, MPI data plane / Gloo bandwidth = {fmt(r, '.2f')}x (target >= 1.3x): "
              f"{'met' if r is not None and r >= 1.3 else 'NOT met'}")
    print("# bfloat16 row: mpi4py column = widen to float32, MPI_Allreduce, narrow (raw mpi4py)")
    write_json(args.json, {"benchmark": "mpi_vs_gloo", "ranks": p, "hosts": sorted(set(hosts)), "mpi": library,
                           "torch": torch.__version__, "python": platform.python_version(), "rounds": args.rounds,
                           "warmup": args.warmup, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                           "results": results})
    print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
