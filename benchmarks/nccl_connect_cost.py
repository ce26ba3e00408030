"""What NCCL_RUNTIME_CONNECT=0 costs per communicator: creation time and GPU memory, against NCCL's
lazy default (issue 35).

gpucomm used to export ``NCCL_RUNTIME_CONNECT=0`` to every process, which makes NCCL >= 2.22 connect
every algorithm's peers (ring, tree, PAT, NVLS buffers, CollNet) while a communicator is created,
for torch's and every other library's communicators too. This measures what that buys and costs.

For each mode (the variable unset: lazy; then ``0``: at creation) it starts ``--ranks`` fresh
processes (NCCL reads the variable once per process), which create ``--communicators`` communicators
one after another, then run on each the collectives a training step runs (allreduce at a few sizes,
reduce-scatter and allgather at the largest) twice. Phases are separated by barriers; between two
barriers every rank reads ``cudaMemGetInfo`` (CuPy's ``runtime.memGetInfo``) for its GPU, so a
phase's memory is the drop in free memory of every GPU in use (each read once), taken by no other
rank meanwhile. Per communicator it reports creation time, the memory creation took, the first
pass's time (where a lazy communicator connects) and memory, and the second pass's time.

Placement: one GPU per rank when there are enough GPUs (NVLink, NVLS on NVSwitch machines);
otherwise every rank shares GPU 0 in gpucomm's single-GPU test mode (``NCCL_HOSTID`` per rank,
sockets), where NVLS and P2P cannot appear. ``--ranks 1`` makes one-rank communicators (nothing to
connect: the floor).

Run: ``python benchmarks/nccl_connect_cost.py [--json nccl_connect_cost.json] [--quick]``;
``--dry-run`` prints the plan and touches no GPU. Without a GPU or CuPy's NCCL it prints one line
on stderr, writes ``{"skipped": <reason>}`` to ``--json`` when given, and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import time
from typing import Any

MODES = {"unset": None, "0": "0"}  # mode name -> NCCL_RUNTIME_CONNECT (None: removed)
VAR = "NCCL_RUNTIME_CONNECT"
MIB = float(1 << 20)
FLOAT_BYTES = 4


# -- the plan ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks per communicator (default 2)")
    p.add_argument("--communicators", type=int, default=4, help="communicators per mode (default 4)")
    p.add_argument("--sizes", default="8,1048576,67108864",
                   help="allreduce sizes in bytes, float32; the largest also for reduce-scatter and allgather")
    p.add_argument("--quick", action="store_true", help="2 communicators, sizes 8 B and 1 MiB")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one mode may take (default 300)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--dry-run", action="store_true", help="print the plan; touch no GPU")
    args = p.parse_args(argv)
    if args.quick:
        args.communicators, args.sizes = 2, "8,1048576"
    if args.ranks < 1 or args.communicators < 1:
        p.error("--ranks and --communicators must be at least 1")
    try:
        args.size_list = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        p.error(f"--sizes takes byte counts separated by commas, got {args.sizes!r}")
    if not args.size_list or args.size_list[0] < FLOAT_BYTES:
        p.error(f"--sizes must hold at least one size of >= {FLOAT_BYTES} bytes (one float32)")
    return args


def collectives(sizes: list[int], ranks: int) -> list[tuple[str, int]]:
    """The step's calls, in order: (kind, float32 elements each rank sends)."""
    calls = [("allreduce", max(1, s // FLOAT_BYTES)) for s in sizes]
    largest = max(1, sizes[-1] // FLOAT_BYTES // ranks) * ranks  # divisible by the ranks
    return calls + [("reducescatter", largest), ("allgather", largest // ranks)]


def placement(ranks: int, gpus: int) -> tuple[str, list[int]]:
    """(description, GPU of each rank)."""
    if gpus >= ranks:
        return "one GPU per rank", list(range(ranks))
    return "all ranks on GPU 0, single-GPU test mode (NCCL_HOSTID per rank, sockets)", [0] * ranks


def describe_plan(args: argparse.Namespace, gpus: int | None) -> list[str]:
    where = placement(args.ranks, gpus)[0] if gpus is not None else "one GPU per rank if there are enough, else GPU 0"
    calls = ", ".join(f"{kind} {n * FLOAT_BYTES} B" for kind, n in collectives(args.size_list, args.ranks))
    return [f"# modes: {', '.join(f'{VAR} {m}' for m in MODES)} (each in {args.ranks} fresh processes)",
            f"# {args.communicators} communicators of {args.ranks} rank(s); placement: {where}",
            f"# per communicator: create; then twice: {calls}",
            "# memory: drop in cudaMemGetInfo free bytes of every GPU in use, read between barriers"]


# -- one rank ---------------------------------------------------------------------------------------

def rank_main(rank: int, size: int, device: int, shared_gpu: bool, mode: str, n_comms: int,
              calls: list[tuple[str, int]], ids: Any, barrier: Any, results: Any) -> None:
    """One rank of one mode; puts its record (or its error) on ``results``."""
    try:
        results.put(run_rank(rank, size, device, shared_gpu, mode, n_comms, calls, ids, barrier))
    except BaseException as e:  # noqa: BLE001 - the parent reports it; the barrier must not wait for us
        barrier.abort()
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def set_environment(rank: int, shared_gpu: bool, mode: str) -> None:
    """Before NCCL loads: the mode's value of the variable, and the single-GPU test variables."""
    if MODES[mode] is None:
        os.environ.pop(VAR, None)
    else:
        os.environ[VAR] = MODES[mode]
    if shared_gpu:
        from gpucomm.bootstrap.devices import apply_single_gpu_test_env  # noqa: PLC0415

        apply_single_gpu_test_env(rank, os.environ)


def run_rank(rank: int, size: int, device: int, shared_gpu: bool, mode: str, n_comms: int,
             calls: list[tuple[str, int]], ids: Any, barrier: Any) -> dict:
    set_environment(rank, shared_gpu, mode)
    import cupy  # noqa: PLC0415 - after the environment is set
    from cupy.cuda import nccl  # noqa: PLC0415

    from gpucomm.backends.nccl import connects_lazily  # noqa: PLC0415

    cupy.cuda.Device(device).use()
    largest = max(n * (size if kind == "allgather" else 1) for kind, n in calls)
    send, recv = cupy.zeros(largest, cupy.float32), cupy.zeros(largest * size, cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.runtime.deviceSynchronize()  # context and buffers exist before the first reading
    if rank == 0:
        uids = [nccl.get_unique_id() for _ in range(n_comms)]
        for _ in range(size - 1):
            ids.put(uids)
    else:
        uids = ids.get(timeout=120)

    free: list[int] = [phase_end(barrier, cupy)]
    record: dict[str, Any] = {"rank": rank, "device": device, "nccl_version": nccl.get_version(),
                              "connects_lazily": connects_lazily(), "create_s": [], "first_pass_s": [],
                              "second_pass_s": []}
    comms = []
    for uid in uids:
        t0 = time.perf_counter()
        comms.append(nccl.NcclCommunicator(size, uid, rank))
        record["create_s"].append(time.perf_counter() - t0)
        free.append(phase_end(barrier, cupy))
    for key in ("first_pass_s", "second_pass_s"):
        for comm in comms:
            t0 = time.perf_counter()
            run_calls(comm, nccl, calls, size, send, recv, stream)
            stream.synchronize()
            record[key].append(time.perf_counter() - t0)
            free.append(phase_end(barrier, cupy))
    for comm in comms:
        comm.destroy()
    record["free_bytes"] = free
    return record


def phase_end(barrier: Any, cupy: Any) -> int:
    """Free bytes of this rank's GPU, read while no rank is in a phase (between two barriers)."""
    cupy.cuda.runtime.deviceSynchronize()
    barrier.wait()
    free = int(cupy.cuda.runtime.memGetInfo()[0])
    barrier.wait()
    return free


def run_calls(comm: Any, nccl: Any, calls: list[tuple[str, int]], size: int, send: Any, recv: Any,
              stream: Any) -> None:
    """One pass of the step's calls on ``comm`` (zeros: only connections and timing matter)."""
    s, r, st = send.data.ptr, recv.data.ptr, stream.ptr
    for kind, n in calls:
        if kind == "allreduce":
            comm.allReduce(s, r, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, st)
        elif kind == "reducescatter":
            comm.reduceScatter(s, r, n // size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, st)
        else:
            comm.allGather(s, r, n, nccl.NCCL_FLOAT32, st)


# -- the parent ---------------------------------------------------------------------------------------

def run_mode(mode: str, args: argparse.Namespace, devices: list[int], shared_gpu: bool) -> dict:
    """Every rank's record for one mode, or {"error": ...}."""
    ctx = mp.get_context("spawn")
    ids, results, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(args.ranks)
    calls = collectives(args.size_list, args.ranks)
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, devices[r], shared_gpu, mode, args.communicators,
                                                 calls, ids, barrier, results), daemon=True)
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    records, deadline = [], time.monotonic() + args.timeout
    try:
        while len(records) < args.ranks and time.monotonic() < deadline:
            try:
                records.append(results.get(timeout=1.0))
            except queue.Empty:  # look again until the deadline, unless every rank is gone
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r['rank']}: {r['error']}" for r in records if "error" in r]
    if errors or len(records) < args.ranks:
        missing = args.ranks - len(records)
        return {"error": "; ".join(errors) or f"{missing} rank(s) did not report within {args.timeout:g} s"}
    return {"ranks": sorted(records, key=lambda r: r["rank"])}


def summarize(records: list[dict], n_comms: int) -> dict:
    """Per communicator: slowest rank's times; memory as the drop in free bytes summed over the GPUs
    in use, each GPU read by its lowest rank. ``free_bytes`` holds, per rank, the reading before
    anything, after each creation, after each first pass, after each second pass."""
    readers = {}
    for r in records:
        readers.setdefault(r["device"], r)
    frees = [r["free_bytes"] for r in readers.values()]

    def used(i: int) -> float:  # MiB taken between reading i-1 and reading i
        return sum(f[i - 1] - f[i] for f in frees) / MIB

    def slowest(key: str) -> list[float]:
        return [max(r[key][c] for r in records) for c in range(n_comms)]

    per = {"create_s": slowest("create_s"), "create_mib": [used(1 + c) for c in range(n_comms)],
           "first_pass_s": slowest("first_pass_s"), "first_pass_mib": [used(1 + n_comms + c) for c in range(n_comms)],
           "second_pass_s": slowest("second_pass_s")}
    out: dict[str, Any] = {"per_communicator": per}
    for key, values in per.items():
        out[f"{key}_median"] = statistics.median(values)
    out["total_mib_per_communicator"] = out["create_mib_median"] + out["first_pass_mib_median"]
    out["connects_lazily"] = sorted({bool(r["connects_lazily"]) for r in records})
    return out


def print_summary(doc: dict) -> None:
    print(f"# NCCL {doc['nccl_version']}, {doc['ranks']} rank(s), {doc['communicators']} communicators, "
          f"{doc['placement']}")
    print(f"{'mode':<24} {'create_s':>9} {'create_MiB':>11} {'1st_pass_s':>11} {'1st_MiB':>9} {'2nd_pass_s':>11} "
          f"{'MiB/comm':>9}")
    for mode, m in doc["modes"].items():
        name = f"{VAR}={'(unset)' if MODES[mode] is None else MODES[mode]}"
        if "error" in m:
            print(f"{name:<24} failed: {m['error']}")
            continue
        s = m["summary"]
        print(f"{name:<24} {s['create_s_median']:>9.3f} {s['create_mib_median']:>11.1f} "
              f"{s['first_pass_s_median']:>11.3f} {s['first_pass_mib_median']:>9.1f} "
              f"{s['second_pass_s_median']:>11.4f} {s['total_mib_per_communicator']:>9.1f}")
    print("# medians over communicators; times of the slowest rank; MiB summed over the GPUs in use")


def unavailable() -> tuple[str | None, int]:
    """(why this machine cannot run it, or None; its GPU count)."""
    from gpucomm.backends.nccl import nccl_module  # noqa: PLC0415 - loads CuPy

    if nccl_module() is None:
        return ("needs a CUDA GPU and CuPy's NCCL bindings, which do not load here; on a GPU machine "
                "pip install 'gpucomm[cuda12]' or '[cuda13]'"), 0
    import cupy  # noqa: PLC0415

    try:
        gpus = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - no driver, no device
        return f"needs a CUDA GPU, and CUDA reports none ({e}); run it on a GPU machine", 0
    return (None, gpus) if gpus else ("needs a CUDA GPU, and CUDA reports none; run it on a GPU machine", 0)


def skip(reason: str, json_path: str | None) -> int:
    print(f"nccl_connect_cost: skipped: {reason}", file=sys.stderr)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"benchmark": "nccl_connect_cost", "skipped": reason, "modes": {}}, f, indent=1)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print("\n".join(describe_plan(args, None)))
        return 0
    reason, gpus = unavailable()
    if reason:
        return skip(reason, args.json)
    where, devices = placement(args.ranks, gpus)
    shared_gpu = args.ranks > 1 and len(set(devices)) < args.ranks
    print("\n".join(describe_plan(args, gpus)))
    doc: dict[str, Any] = {"benchmark": "nccl_connect_cost", "ranks": args.ranks, "communicators": args.communicators,
                           "placement": where, "gpus": gpus, "sizes": args.size_list,
                           "python": platform.python_version(), "calls": collectives(args.size_list, args.ranks),
                           "modes": {}, "nccl_version": None}
    for mode in MODES:
        result = run_mode(mode, args, devices, shared_gpu)
        if "ranks" in result:
            doc["nccl_version"] = result["ranks"][0]["nccl_version"]
            result["summary"] = summarize(result["ranks"], args.communicators)
        doc["modes"][mode] = result
    print_summary(doc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all("error" not in m for m in doc["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
