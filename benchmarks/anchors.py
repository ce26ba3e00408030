"""The fair anchors every GPU training benchmark measures beside gpucomm, in the same job, interleaved
(issue 35): DDP at its defaults, DDP at its best, and the same steps with no communication at all; and
the settings that make those comparisons fair (the round order, the NCCL socket transport of the
single-GPU test mode, the one-rank reducer). No torch here: ``verify_gpu.py`` reads these names
without importing it.

Variants, as the JSON names them:

    gpucomm      hvd.DistributedOptimizer (at 1 rank with GPUCOMM_ONE_RANK_REDUCER=1 unless asked not to:
                 hooks, buckets and schedule run at size 1, as DDP's reducer does)
    ddp-default  DistributedDataParallel at its defaults (gradient_as_bucket_view=False, static_graph=False)
    ddp-best     DistributedDataParallel at its best: gradient_as_bucket_view=True, static_graph=True
    no-comm      the same model and optimizer with no wrapper and no communication: the floor

Both DDP variants keep one change from DDP's defaults: no buffer broadcast before each forward, since
gpucomm (like Horovod) leaves BatchNorm buffers per rank; every variant then moves the same bytes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from bench_stats import spread  # noqa: E402

GPUCOMM, DDP_DEFAULT, DDP_BEST, NO_COMM = "gpucomm", "ddp-default", "ddp-best", "no-comm"
ANCHORS = (DDP_DEFAULT, DDP_BEST, NO_COMM)
DDP_KINDS = (DDP_DEFAULT, DDP_BEST)
# keywords each DDP variant adds to DistributedDataParallel(...), beside device_ids and the buffer switch
DDP_OPTIONS: dict[str, dict[str, bool]] = {
    DDP_DEFAULT: {"gradient_as_bucket_view": False, "static_graph": False},
    DDP_BEST: {"gradient_as_bucket_view": True, "static_graph": True},
}
TARGET_ADDED_RATIO = 0.5  # issue 35: gpucomm adds at most half of what DDP at its best adds over the floor

# -- the one-rank reducer ----------------------------------------------------------------------------

REDUCER_VAR = "GPUCOMM_ONE_RANK_REDUCER"


def ask_one_rank_reducer(on: bool, env: MutableMapping[str, str] | None = None) -> None:
    """Before ``hvd.init()``: ask gpucomm to run its reducer at size 1 (``on``) or not. It only matters in
    a one-rank job; set either way so a caller's setting cannot leak into the other mode."""
    env = os.environ if env is None else env
    env[REDUCER_VAR] = "1" if on else "0"


def gpucomm_label(ranks: int, reducer_on: bool) -> str:
    """How the gpucomm variant is shown: at 1 rank it says whether its reducer ran."""
    if ranks > 1:
        return GPUCOMM
    return f"{GPUCOMM}-reducer-{'on' if reducer_on else 'off'}"


def reducer_record(ranks: int, on: bool, counts: Mapping[str, int]) -> dict[str, Any]:
    """What a run says about the one-rank reducer: whether it applies (1 rank), was asked for, the
    variable as set, and (1 rank) whether gpucomm's counters over its timed steps show the reducer ran."""
    one = ranks == 1
    return {"applies": one, "asked": one and on, "variable": f"{REDUCER_VAR}={'1' if on else '0'}",
            "verified": reducer_ran(counts) if one else None, "counters": dict(counts)}


def reducer_line(record: Mapping[str, Any]) -> str | None:
    """The line a benchmark prints about the one-rank reducer (None when the job has several ranks)."""
    if not record["applies"]:
        return None
    if not record["asked"]:
        return "one-rank reducer: off (--one-rank-reducer off): gpucomm's optimizer does nothing at size 1"
    if record["verified"]:
        return f"one-rank reducer: on ({record['variable']}); gpucomm's counters show its reducer ran"
    return (f"one-rank reducer: asked ({record['variable']}) but gpucomm's timed steps moved no schedule, "
            "collective or bucket counter: this gpucomm does not run its reducer at size 1, so its figures are the "
            "no-op optimizer's")


# counters of hvd.stats() a benchmark records for gpucomm's timed steps; read with .get(name, 0), so a
# gpucomm that does not have a counter yet (or any more) reads 0 instead of failing
COUNTERS = ("collectives", "bytes", "control_rounds", "negotiated", "cache_hits", "inline_reductions", "inline_moves",
            "gloo_collectives", "mpi_collectives", "schedule_steps", "issue_deferred", "kernel_fallbacks",
            "cuda_events_created", "grad_bucket_views", "grad_bucket_packs",
            "grad_bucket_unpacks", "grad_steps_by_order", "grad_order_changes", "cuda_event_records", "cuda_stream_waits", "cuda_event_queries", "sync_fast_ops",
            "local_ops")
REDUCER_EVIDENCE = ("schedule_steps", "collectives", "grad_bucket_views", "grad_bucket_packs", "local_ops")


def counter_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, int]:
    """``after - before`` of every counter in COUNTERS (0 for a counter either side lacks)."""
    return {name: int(after.get(name, 0)) - int(before.get(name, 0)) for name in COUNTERS}


def add_counts(total: MutableMapping[str, int], delta: Mapping[str, int]) -> None:
    for name, value in delta.items():
        total[name] = total.get(name, 0) + value


def reducer_ran(delta: Mapping[str, int]) -> bool:
    """Whether gpucomm's timed steps went through its reducer (any schedule, collective or bucket
    counter moved): at 1 rank, the proof that GPUCOMM_ONE_RANK_REDUCER took effect."""
    return any(delta.get(name, 0) > 0 for name in REDUCER_EVIDENCE)


# -- NCCL's socket transport in the single-GPU test mode ---------------------------------------------

# Ranks that share one GPU (gpucomm-run --single-gpu-test) talk through NCCL's socket transport over
# loopback. NCCL's docs (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html, sections
# NCCL_SOCKET_NTHREADS and NCCL_NSOCKS_PERTHREAD) describe the two knobs: CPU helper threads per
# connection (1..16) and sockets per helper thread, with NCCL_SOCKET_NTHREADS * NCCL_NSOCKS_PERTHREAD at
# most 64; more threads buy socket throughput for CPU. NCCL's own source (src/transport/net_socket.cc,
# ncclNetSocketGetNsockNthread) picks them from the NIC's PCI vendor file, and ``lo`` has none: on
# loopback NCCL spawns no helper thread and pushes every byte through one socket from its proxy thread.
# 4 threads x 4 sockets (16 sockets per connection, well inside the 64) lets loopback carry several
# streams at once on a machine with a handful of cores per rank, so the transport no longer buries the
# difference between the variants.
SOCKET_VARS = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}
MAX_SOCKET_THREADS, MAX_SOCKETS = 16, 64
SINGLE_GPU_VAR = "GPUCOMM_SINGLE_GPU_TEST"
_TRUE = ("1", "true", "yes", "on")


def single_gpu_test(env: Mapping[str, str] | None = None) -> bool:
    """Whether this job's ranks share one GPU (``GPUCOMM_SINGLE_GPU_TEST``, set by gpucomm-run --single-gpu-test)."""
    env = os.environ if env is None else env
    return env.get(SINGLE_GPU_VAR, "").strip().lower() in _TRUE


def socket_env(user_env: Mapping[str, str]) -> dict[str, str]:
    """The socket settings to add for a single-GPU-test job: SOCKET_VARS, less those ``user_env`` already sets."""
    return {k: v for k, v in SOCKET_VARS.items() if not user_env.get(k)}


def tune_sockets(env: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """Before NCCL starts (before ``hvd.init()``): in the single-GPU test mode, set NCCL's socket threads
    and sockets per thread unless the user set them. Returns the record the benchmark prints and writes:
    the values in force and who chose them."""
    env = os.environ if env is None else env
    if not single_gpu_test(env):
        return {"single_gpu_test": False, "values": None, "set_by": None, "problems": []}
    added = socket_env(env)
    env.update(added)
    values = {k: env[k] for k in SOCKET_VARS}
    set_by = {len(SOCKET_VARS): "this benchmark", 0: "the environment (the user or verify_gpu.py)"}.get(
        len(added), "the environment and this benchmark")
    return {"single_gpu_test": True, "values": values, "set_by": set_by, "problems": socket_problems(values)}


def socket_problems(values: Mapping[str, str]) -> list[str]:
    """What NCCL would change in these settings, each with the fix (empty when they are valid)."""
    try:
        threads, per_thread = int(values["NCCL_SOCKET_NTHREADS"]), int(values["NCCL_NSOCKS_PERTHREAD"])
    except (KeyError, ValueError):
        return [f"NCCL_SOCKET_NTHREADS / NCCL_NSOCKS_PERTHREAD are not integers ({dict(values)}); unset them "
                f"to get {SOCKET_VARS}"]
    problems = []
    if not 1 <= threads <= MAX_SOCKET_THREADS:
        problems.append(f"NCCL_SOCKET_NTHREADS={threads}: NCCL takes 1..{MAX_SOCKET_THREADS}")
    if threads * per_thread > MAX_SOCKETS:
        problems.append(f"NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD = {threads * per_thread} > {MAX_SOCKETS}: "
                        "NCCL lowers NCCL_NSOCKS_PERTHREAD; choose values whose product is at most 64")
    return problems


def socket_text(record: Mapping[str, Any]) -> str:
    """One line for a benchmark's output."""
    if not record.get("single_gpu_test"):
        return "NCCL socket settings: untouched (ranks do not share a GPU, or no NCCL)"
    values = ", ".join(f"{k}={v}" for k, v in record["values"].items())
    notes = "; ".join(record.get("problems") or [])
    return f"NCCL socket settings (single-GPU test mode, loopback): {values} (set by {record['set_by']})" + (
        f"; WARNING: {notes}" if notes else "")


# -- the order of the variants in each round ----------------------------------------------------------


def williams_rows(n: int) -> list[list[int]]:
    """A Williams design for ``n`` variants: rows in which every variant takes every position equally
    often and follows every other variant equally often (n rows for even n, 2n for odd n), so neither a
    position in the round nor what ran just before (a warm cache, a cold one, another variant's
    allocator state or threads) is charged to one variant."""
    if n < 1:
        raise ValueError(f"williams_rows: need at least one variant, got {n}")
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(v + shift) % n for v in first] for shift in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def round_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The variant order of each round: the Williams rows of ``names``, cycled."""
    rows = williams_rows(len(names))
    return [[names[i] for i in rows[r % len(rows)]] for r in range(rounds)]


def balanced_rounds(n: int) -> int:
    """Rounds that make the order balanced: a multiple of this."""
    return len(williams_rows(n))


def balance_note(n: int, rounds: int) -> str | None:
    """None when ``rounds`` balances ``n`` variants, else what to pass to get it."""
    need = balanced_rounds(n)
    if rounds % need == 0:
        return None
    return (f"{rounds} rounds do not balance the order of {n} variants (each first equally often, each after "
            f"each other equally often): use a multiple of {need}")


# -- summaries -----------------------------------------------------------------------------------------


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> dict[str, Any]:
    """Round-by-round ratios num[r] / den[r] (rounds where den is 0 are left out) and their spread:
    a ratio taken inside one round, where both ran back to back, is what interleaving protects."""
    ratios = [a / b for a, b in zip(num, den) if b]
    return {"round_ratios": ratios, **spread(ratios)}


def added_over_floor(rounds: Mapping[str, Sequence[float]], floor: str = NO_COMM) -> dict[str, dict[str, Any]]:
    """Per variant, what it adds to the floor's per-step figure, round by round (the same round's
    floor), with the spread: the cost of the wrapper and its communication alone."""
    base = rounds[floor]
    return {v: spread([a - b for a, b in zip(per_round, base)]) for v, per_round in rounds.items() if v != floor}


def added_ratio(added: Mapping[str, Mapping[str, Any]], ours: str = GPUCOMM, theirs: str = DDP_BEST) -> float | None:
    """median added(ours) / median added(theirs): issue 35's figure (target <= TARGET_ADDED_RATIO); None
    when either is missing or DDP added nothing measurable (<= 0)."""
    a, b = (added.get(ours) or {}).get("median"), (added.get(theirs) or {}).get("median")
    if a is None or b is None or b <= 0:
        return None
    return a / b


__all__ = ["ANCHORS", "COUNTERS", "DDP_BEST", "DDP_DEFAULT", "DDP_KINDS", "DDP_OPTIONS", "GPUCOMM", "NO_COMM",
           "REDUCER_VAR", "SOCKET_VARS", "TARGET_ADDED_RATIO", "add_counts", "added_over_floor", "added_ratio",
           "ask_one_rank_reducer", "balance_note", "balanced_rounds", "counter_delta", "gpucomm_label", "paired_ratios",
           "reducer_line", "reducer_ran", "reducer_record", "round_orders", "single_gpu_test", "socket_env",
           "socket_problems", "socket_text", "spread", "tune_sockets", "williams_rows"]
