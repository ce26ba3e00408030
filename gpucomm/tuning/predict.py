"""A profile and a collective cost curve in, a predicted data-parallel step out.

``predict_step`` runs the step model (``step.simulate``) with a bucket plan: the exact optimum
(``optimal.optimal_plan``), gpucomm's default fixed buckets, DDP's, or buckets given by the caller.
``scaling_efficiency`` is the single-device step over the predicted one (weak scaling: every rank
keeps its batch, so samples/s grow with the ranks times the efficiency).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .optimal import optimal_plan
from .policies import capped_buckets
from .profile import Profile
from .step import Overheads, StepPrediction, simulate

__all__ = ["Prediction", "predict_step", "scaling_efficiency", "PLANS"]

PLANS = ("optimal", "gpucomm", "ddp")


@dataclass(frozen=True)
class Prediction:
    """The predicted step and the plan it used (buckets of parameter indices, launch order)."""

    plan: str
    step: StepPrediction
    buckets: tuple[tuple[int, ...], ...]

    def samples_per_s(self, batch_size: int, ranks: int) -> float:
        """The job's throughput: every rank does ``batch_size`` samples per step."""
        return batch_size * ranks / self.step.step_s


def predict_step(profile: Profile, cost: Callable[[int], float], *, plan: str | Sequence[Sequence[int]] = "optimal",
                 overheads: Overheads = Overheads(), first_bytes: int = 1 << 20, cap_bytes: int = 25 << 20,
                 processor: str = "dedicated") -> Prediction:
    """Predict ``profile``'s step on a job whose allreduce costs ``cost(nbytes)`` seconds.

    ``plan``: ``"optimal"`` (the exact best contiguous plan in ready order), ``"gpucomm"``
    (``fusion.plan_buckets``'s rule with ``first_bytes`` / ``cap_bytes``), ``"ddp"`` (DDP's rule),
    or a list of buckets of parameter indices. ``processor``: ``"dedicated"`` (GPUs) or
    ``"shared"`` (CPU ranks whose cores all compute; ``step.py``)."""
    if isinstance(plan, str):
        if plan == "optimal":
            buckets = [list(b) for b in optimal_plan(profile.ready_s, profile.sizes, cost, overheads=overheads,
                                                     processor=processor).buckets]
        elif plan in ("gpucomm", "ddp"):
            buckets = capped_buckets(profile.sizes, first_bytes=first_bytes, cap_bytes=cap_bytes, rule=plan)
        else:
            raise ValueError(f"predict_step: plan={plan!r}; use one of {', '.join(PLANS)} or a list of buckets.")
        name = plan
    else:
        buckets, name = [list(b) for b in plan], "given"
    step = simulate(profile.ready_s, profile.sizes, buckets, cost, overheads=overheads, forward_s=profile.forward_s,
                    backward_s=profile.backward_s, update_s=profile.update_s, processor=processor)
    return Prediction(name, step, tuple(tuple(b) for b in buckets))


def scaling_efficiency(single_step_s: float, step_s: float) -> float:
    """Weak-scaling efficiency: one device's step time over the data-parallel step time."""
    if not (single_step_s > 0 and step_s > 0):
        raise ValueError(f"scaling_efficiency: step times must be > 0 (got {single_step_s}, {step_s}).")
    return single_step_s / step_s
