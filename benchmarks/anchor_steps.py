"""The torch half of anchors.py: the anchor variants' models (DDP at its defaults and at its best, the
plain local copy) and the clock every training benchmark times its steps with, so that every variant is
built from the same weights and measured the same way.

Timing a block of steps: the previous work is finished first (``torch.cuda.synchronize``); wall time
(``perf_counter``) and the process's CPU time (``time.process_time``: every thread of the process, so
NCCL's proxy and socket threads, autograd's worker threads, gpucomm's and DDP's own threads count) run
over the same interval, which ends when the GPU has finished the block's work. The main thread's CPU
time inside that closing synchronize is taken out: ``cudaDeviceSynchronize`` spins by default, and that
spin is waiting for the GPU, not work; the other threads' CPU during the wait stays in.
"""

from __future__ import annotations

import copy
import gc
import inspect
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from anchors import DDP_OPTIONS  # noqa: E402


def no_buffer_sync() -> dict[str, bool]:
    """DDP's keyword that turns off its per-forward buffer broadcast: gpucomm, like Horovod, leaves
    BatchNorm buffers per rank, so every variant then moves the same bytes (the gradients) and nothing
    else. Newer torch renamed ``broadcast_buffers`` to ``forward_sync_buffers`` and warns about the old name."""
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def ddp_keywords(kind: str) -> dict[str, bool]:
    """Every keyword a DDP variant (``ddp-default`` or ``ddp-best``) passes beside ``device_ids``."""
    if kind not in DDP_OPTIONS:
        raise ValueError(f"unknown DDP variant {kind!r}: choose from {', '.join(DDP_OPTIONS)}")
    return {**DDP_OPTIONS[kind], **no_buffer_sync()}


def build_ddp(model: torch.nn.Module, kind: str, device: torch.device) -> torch.nn.parallel.DistributedDataParallel:
    """``model`` wrapped by DDP as variant ``kind`` (on the default process group)."""
    device_ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **ddp_keywords(kind))


def copies(base: torch.nn.Module, n: int, device: torch.device) -> list[torch.nn.Module]:
    """``n`` copies of ``base`` on ``device``, checked to hold the same weights: every variant starts
    from the same point."""
    out = [copy.deepcopy(base).to(device) for _ in range(n)]
    reference = base.state_dict()
    for i, model in enumerate(out):
        for name, value in model.state_dict().items():
            if not torch.equal(value.cpu(), reference[name]):
                raise RuntimeError(f"copy {i} of the model differs from the original in {name}: every variant must "
                                   "start from the same weights (is the model's construction random after seeding?)")
    return out


def barrier(device: torch.device) -> None:
    """Every rank here before the next block starts (the no-communication steps let ranks drift apart)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def freeze_heap() -> None:
    """After the warm-up: collect, then leave every object alive now (modules, models, optimizer state)
    out of later collections (``gc.freeze``), so a collection inside a timed block is as short as it can
    be, whichever variant's garbage triggers it. ``thaw_heap`` undoes it."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    gc.unfreeze()


def settle(device: torch.device) -> None:
    """Before a timed block, untimed: the GPU idle and a full garbage collection, so no variant pays
    for a collection that another variant's garbage triggered."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    gc.collect()


def _wait_for_gpu(device: torch.device) -> float:
    """Synchronize; the main thread's CPU seconds spent in it (spinning), to take out of the CPU time."""
    if device.type != "cuda":
        return 0.0
    t0 = time.thread_time()
    torch.cuda.synchronize(device)
    return time.thread_time() - t0


def time_block(step: Callable[[], None], n: int, device: torch.device) -> tuple[float, float]:
    """Wall and process-CPU seconds of ``n`` calls of ``step``, the GPU work they queued included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        step()
    spin = _wait_for_gpu(device)
    t1, c1 = time.perf_counter(), time.process_time()
    return t1 - t0, max(0.0, c1 - c0 - spin)


def time_steps(step: Callable[[], None], n: int, device: torch.device) -> list[tuple[float, float]]:
    """``n`` steps timed one by one: [(wall s, CPU s)] per step."""
    return [time_block(step, 1, device) for _ in range(n)]


def job_rounds(every: Sequence[dict[str, list[list[tuple[float, float]]]]]) -> tuple[dict[str, list[float]],
                                                                                     dict[str, list[float]]]:
    """Every rank's [(wall, CPU)] per variant, round and step (from allgather) as the job's per-round
    figures: each step's wall time is the slowest rank's (the job moves at its pace), its CPU time the
    ranks' mean (a cost every process pays); a round's figure is the median of its steps."""
    import statistics  # noqa: PLC0415

    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for name, rounds in every[0].items():
        wall[name], cpu[name] = [], []
        for r in range(len(rounds)):
            steps = range(len(rounds[r]))
            wall[name].append(statistics.median(max(rank[name][r][s][0] for rank in every) for s in steps))
            cpu[name].append(statistics.median(sum(rank[name][r][s][1] for rank in every) / len(every) for s in steps))
    return wall, cpu


__all__ = ["barrier", "build_ddp", "copies", "ddp_keywords", "freeze_heap", "job_rounds", "no_buffer_sync", "settle",
           "thaw_heap", "time_block", "time_steps"]
