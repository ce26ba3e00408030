"""What this process's gpucomm has done, counted: the figures tests and benchmarks read to prove a
fast path is taken (``hvd.stats()``).

One process-wide ``Counters`` object; the hot paths add to its fields directly (an attribute
increment, no lock: a rare lost update under thread races only undercounts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class Counters:
    """Monotonic counts since the process started (or since ``stats(reset=True)``)."""

    control_rounds: int = 0  # request frames this rank sent to the coordinator (rank 0: rounds it ran itself)
    negotiated: int = 0  # operations this rank submitted to the control plane
    cache_hits: int = 0  # ... of which travelled as a response-cache bit instead of a full request
    inline_reductions: int = 0  # small CPU allreduces the coordinator reduced inside the control round
    inline_moves: int = 0  # small CPU broadcasts and allgathers the coordinator completed inside the control round
    collectives: int = 0  # data-plane collectives issued (backend calls: Gloo works / NCCL launches)
    bytes: int = 0  # bytes those collectives sent from this rank (input sizes)
    gloo_collectives: int = 0  # ... of which CPU collectives on Gloo (the CPU transport in use: GPUCOMM_CPU_OPERATIONS)
    mpi_collectives: int = 0  # ... of which CPU collectives on MPI
    schedule_steps: int = 0  # DistributedOptimizer steps run on a fixed schedule (no control messages)
    layout_checks: int = 0  # cross-rank verifications of an optimizer's parameters and buckets
    elastic_resets: int = 0  # times hvd.elastic.run left a job and joined the launcher's next round
    kernel_fallbacks: int = 0  # times this process gave up the fusion kernels for torch ops (at most once; see gpucomm.kernels.status())
    kernel_tables_built: int = 0  # fusion-kernel tables built from a layout checked in full (steady state: 0 per step)
    kernel_tables_rebased: int = 0  # ... re-pointed at a bucket's reallocated gradients (zero_grad(set_to_none=True))
    kernel_tables_rewritten: int = 0  # ... of which written over the table in place (same stream: no new table)
    cuda_events_created: int = 0  # CUDA events made because the pool had none free (steady state: 0 per step)
    cuda_event_records: int = 0  # CUDA events the data plane recorded (a step: one per bucket launch, one at its end)
    cuda_stream_waits: int = 0  # CUDA stream waits on an event the data plane enqueued
    cuda_event_queries: int = 0  # CUDA event queries (the watchdog's, poll(), the pool's reclaim)
    grad_bucket_views: int = 0  # gradient buckets launched with every gradient already in the buffer (no copy)
    grad_bucket_packs: int = 0  # gradient buckets packed into their fusion buffer at launch (a copy)
    grad_bucket_unpacks: int = 0  # gradient buckets unpacked out of their fusion buffer (a copy)
    grad_steps_by_order: int = 0  # optimizer steps launched by one Python hook per bucket (its last gradient's in a recorded order)
    grad_order_changes: int = 0  # ... steps in which that order did not hold (launched at synchronize; the order is recorded again)
    sync_fast_ops: int = 0  # synchronous CUDA ops launched on the caller's own stream (no comm stream, no event round trip)
    local_ops: int = 0  # collectives of a one-rank job computed in place or as a copy (no backend call)
    warmup_steps: int = 0  # zero-filled passes of an optimizer's layout at a collective point (NCCL connects lazily)
    step_waits_reported: int = 0  # optimizer steps whose host transfers blocked long enough to be told to rank 0
    issue_deferred: int = 0  # agreed CUDA collectives that waited for an optimizer step's launches (one order per device)
    nccl_aborts: int = 0  # NCCL communicators aborted (the job failed)
    nccl_destroys: int = 0  # NCCL communicators destroyed (a healthy job's shutdown, an optimizer's close)
    nonfinite_steps: int = 0  # optimizer steps in which the finite check found a NaN/Inf gradient on some rank
    nonfinite_skipped: int = 0  # ... of which AMP's GradScaler was in use (it skips them: reported, not raised)
    autotune_trials: int = 0  # bucket plans the autotuner tried (besides the plan in use)
    autotune_recuts: int = 0  # re-cuts of an optimizer's buckets by the autotuner (trials and the final choice)
    autotune_done: int = 0  # autotune trials finished (each ends with the fastest plan measured kept)
    spin_skipped_backward: int = 0  # control-round waits that did not poll, or stopped, as a gradient-hook backward ran


COUNTERS = Counters()


def stats(reset: bool = False) -> dict[str, int]:
    """This process's counters as a dict (see ``Counters`` for each field's meaning).

    ``reset=True`` returns the counts and sets them back to zero."""
    snapshot = asdict(COUNTERS)
    if reset:
        for f in fields(Counters):
            setattr(COUNTERS, f.name, 0)
    return snapshot


__all__ = ["COUNTERS", "Counters", "stats"]
