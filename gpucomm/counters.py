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
    cuda_events_created: int = 0  # CUDA events made because the pool had none free (steady state: 0 per step)
    issue_deferred: int = 0  # agreed CUDA collectives that waited for an optimizer step's launches (one order per device)
    nccl_aborts: int = 0  # NCCL communicators aborted (the job failed)
    nccl_destroys: int = 0  # NCCL communicators destroyed (a healthy job's shutdown, an optimizer's close)
    nonfinite_steps: int = 0  # optimizer steps in which the finite check found a NaN/Inf gradient on some rank
    nonfinite_skipped: int = 0  # ... of which AMP's GradScaler was in use (it skips them: reported, not raised)
    autotune_trials: int = 0  # bucket plans the autotuner tried (besides the plan in use)
    autotune_recuts: int = 0  # re-cuts of an optimizer's buckets by the autotuner (trials and the final choice)
    autotune_done: int = 0  # autotune trials finished (each ends with the fastest plan measured kept)


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
