"""nccl-tests for gpucomm: allreduce, allgather, broadcast, alltoall and reducescatter swept over sizes,
with gpucomm, raw CuPy NCCL and torch.distributed side by side in the same job.

    gpucomm-run -np 2 python benchmarks/collectives.py --device cpu                  # Gloo, 8 B .. 4 MiB
    gpucomm-run -np 8 python benchmarks/collectives.py -b 8 -e 1G -f 2               # one GPU per rank
    gpucomm-run -np 2 --single-gpu-test python benchmarks/collectives.py -e 64M      # 2 ranks share a GPU
    gpucomm-run --mpi -np 2 python benchmarks/collectives.py --device cpu --cpu-operations mpi  # CPU on MPI

``--cpu-operations mpi|gloo`` sets gpucomm's CPU transport (``GPUCOMM_CPU_OPERATIONS``; MPI needs an MPI
launcher); torch.distributed stays on Gloo, and the summary and JSON (``env.cpu_operations``) count the
collectives gpucomm ran on each transport.

Every table is nccl-tests' own (``src/common.cu``): size (B), count (elements), type, redop, root, then
time (us), algbw, busbw (GB/s, 1e9 B) and #wrong for the out-of-place and the in-place call, and a footer
with the number of wrong results and the average bus bandwidth. Sizes, counts and bandwidths use
nccl-tests' definitions (STYLE.md section 5):

    collective     size column (S)            count column      busbw = algbw * ...
    allreduce      count * elsize             count             2(n-1)/n
    allgather      sendcount * n * elsize     sendcount         (n-1)/n
    reducescatter  recvcount * n * elsize     recvcount         (n-1)/n
    alltoall       count * n * elsize         count per peer    (n-1)/n
    broadcast      count * elsize             count             1

with algbw = S / time. Sizes that leave no element per rank are skipped (nccl-tests prints them as 0).

Timing follows nccl-tests' BenchTime: -w warm-up calls at the largest and the smallest size, then per
size one untimed call, a barrier, and -n calls back to back (pipelined; -z 1 waits for completion and
runs a barrier after each call) timed with CUDA events on the current stream (GPU) or the host clock
(CPU, where every call already returns complete). The time is per call and, as nccl-tests' default
``-a 1``, averaged over ranks (0: rank 0's, 2: the minimum, 3: the maximum), so every rank holds the
same table; rank 0 prints it. Checking (-c 1) then refills the buffers, runs the call once, and counts
the elements that differ from the expected result on every rank; #wrong is the sum over ranks.
Inputs are small integers chosen per operation so every result is exact in every dtype (see
``input_values`` in collbench/inputs.py); only ``avg`` on floating types gets a tolerance of (n+1)
ulps, since an average may be computed by scaling each input by 1/n, which rounds.

Implementations:
  gpucomm  ``import gpucomm.torch as hvd``: out-of-place is the function that returns a new tensor
           (hvd.allreduce, hvd.allgather, hvd.broadcast, hvd.alltoall, hvd.reducescatter), in-place the
           ``_`` form (hvd.allreduce_, hvd.broadcast_). Horovod has no in-place allgather, alltoall or
           reducescatter, so those columns read N/A rather than timing the out-of-place path again under
           an in-place label, which would make the in-place comparison with nccl/torch meaningless.
  nccl     a ``cupy.cuda.nccl.NcclCommunicator`` of its own (unique id shared with
           hvd.broadcast_object) called with data_ptr()s on torch's current stream: the floor that
           gpucomm's Python dispatch adds to. CUDA only.
  torch    torch.distributed on its own default group (NCCL on CUDA, Gloo on CPU). It has only in-place
           allreduce and broadcast, so their out-of-place form is what a user writes: copy, then call.
In-place alltoall is N/A for every implementation: none has one (nccl-tests times its aliased
send/recv but reports #wrong as N/A, since the result is undefined).

Defaults: -b 8, -e 32M on CUDA and 4M on CPU (Gloo over loopback on a small machine; the full CPU sweep
then takes tens of seconds), -f 2, -w 5, -n 20, -d float, -o sum, -r 0, -c 1, -z 0, -a 1.
``--quick`` is a tiny sweep for tests (8 B .. 64 KiB by 8x, -w 1 -n 2). Writes ``--json`` (every row,
every implementation, the environment) and ``--plot`` (busbw against size, one line per implementation,
one panel per collective), by default under bench-out/. Exits 1 when any result is wrong, as nccl-tests does, and 2 when the
requested device or implementation is unavailable or a flag is out of range (one line on stderr).

Every table's JSON entry carries ``counters``: the gpucomm counters (``hvd.stats()``) that its timed calls
moved (0 for the anchors' tables, by construction); ``env.gpucomm_counters`` sums gpucomm's and names the
counters this gpucomm does not have, and the summary prints the ones that moved, so a run shows which path
gpucomm's calls took (the control round, the inline path, events, fast synchronous ops). In the
single-GPU test mode (ranks share one GPU; NCCL crosses loopback sockets) the run sets
``NCCL_SOCKET_NTHREADS`` and ``NCCL_NSOCKS_PERTHREAD`` before NCCL starts, unless already set (values and
why: benchmarks/anchors.py), for gpucomm, raw NCCL and torch.distributed alike, and records them in
``env.nccl_sockets``.

The closing summary averages busbw per table; at 1 rank, where nccl-tests' factor makes busbw 0 for
every collective but broadcast, it (and the plot) use algbw instead. A table with no rows (every case
skipped, or no size with an element per rank) reads n/a with the reason, and implementations left out
of a default run (raw NCCL on CPU, torch.distributed without Gloo/NCCL) are listed as not measured.

This file is the entry point; the shared driver (sizes, inputs, timing, rows, printing, JSON, plot) and
one module per implementation live in benchmarks/collbench/ (its __init__ lists them).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch

import gpucomm.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
import anchors  # noqa: E402
from collbench import cli  # noqa: E402
from collbench.environment import (  # noqa: E402
    counter_record, cpu_transport, device_record, environment)
from collbench.impl_choice import make_impls, not_measured  # noqa: E402
from collbench.printing import preamble, say  # noqa: E402
from collbench.report import report, report_interrupted  # noqa: E402
from collbench.results import Table  # noqa: E402
from collbench.sizes import sweep  # noqa: E402
from collbench.sweep_loop import run_sweep  # noqa: E402

# The names other code reads from this file by path (tests/test_collectives_bench.py, the busbw factor in
# tests/test_verify_gpu.py), kept where they were before the driver moved to collbench/.
from collbench.expected import count_wrong, expected_result, tolerance  # noqa: E402,F401
from collbench.inputs import DTYPES, OPS, make_input  # noqa: E402,F401
from collbench.plot import write_plot  # noqa: E402,F401
from collbench.printing import format_time, table_footer  # noqa: E402,F401
from collbench.results import Result, Row, median_tables  # noqa: E402,F401
from collbench.results_json import write_json  # noqa: E402,F401
from collbench.sizes import COLLECTIVES, Layout, bandwidth, busbw_factor, layout, parse_size  # noqa: E402,F401
from collbench.summary import ratio_lines, summary_lines, summary_metric  # noqa: E402,F401


def build_parser() -> argparse.ArgumentParser:
    """The command line, with this docstring as its --help text."""
    return cli.build_parser(description=__doc__)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags as given (defaults that depend on the device are filled by ``cli.validate``)."""
    return build_parser().parse_args(argv)


def pick_device(args: argparse.Namespace) -> torch.device:
    """After ``hvd.init()``: the GPU gpucomm pinned for this rank, or the CPU with its cores shared
    among the ranks on this host."""
    if args.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    return torch.device("cpu")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep; 0 when every result is right, 1 when any is wrong, 2 for a request that cannot run,
    130 after an interruption."""
    args = parse_args(argv)
    try:
        cli.validate(args)
    except cli.UsageError as e:
        print(f"collectives.py: error: {e}", file=sys.stderr)
        return 2
    if args.cpu_operations != "auto":
        os.environ["GPUCOMM_CPU_OPERATIONS"] = args.cpu_operations
    sockets = anchors.tune_sockets()  # before NCCL starts: gpucomm's, raw NCCL's and torch's all read them
    hvd.init()
    device = pick_device(args)
    if args.root >= hvd.size() or args.root < -1:
        if hvd.rank() == 0:
            print(f"collectives.py: error: -r {args.root} is not a rank of this {hvd.size()}-rank job; give 0.."
                  f"{hvd.size() - 1}, or -1 for every root", file=sys.stderr)
        hvd.shutdown()
        return 2
    devices = hvd.allgather_object(device_record(device), name="bench.devices")
    impls = make_impls(args.impls, device)
    sizes = sweep(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    say("# gpucomm collectives benchmark (nccl-tests tables)", *preamble(args, devices))
    if sockets["single_gpu_test"]:
        say(f"# {anchors.socket_text(sockets)}")
    tables: list[Table] = []
    finished = run_sweep(tables, impls, sizes, args, device)
    env = environment(device, impls, devices)
    env["not_measured"] = not_measured(args.impls, device.type)
    env["cpu_operations"] = cpu_transport(args.cpu_operations)
    env["nccl_sockets"] = sockets
    env["gpucomm_counters"] = counter_record(tables)
    env["interrupted"] = not finished
    if not finished:
        report_interrupted(tables, env, args)
    for impl in reversed(impls):
        impl.close()
    if hvd.rank() == 0:
        report(tables, env, args)
    hvd.barrier()  # a failing exit status on another rank would make the launcher stop rank 0 mid-write
    hvd.shutdown()
    return 1 if sum(t.errors for t in tables) else 0


if __name__ == "__main__":
    sys.exit(main())
