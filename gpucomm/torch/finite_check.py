"""Non-finite gradients caught where they start (``DistributedOptimizer(check_finite=...)``).

One rank's NaN or Inf gradient, once averaged, makes every rank's weights non-finite, and neither
Horovod nor DDP says so. With the check on, every bucket's allreduce carries one more value per
rank: rank ``r`` writes, at position ``r`` of the bucket's tail, 1 + the index of the first
parameter of the bucket whose gradient holds a non-finite value on that rank (0: all finite), and
every other rank writes 0 there; the sum then tells every rank, in the same step and with no extra
collective, which ranks went non-finite and in which parameter. The value is computed while the
bucket is filled: by the pack kernel itself where one runs (a cast for compression: one flag per
piece, the data read once), else by one read of the bucket (``gpucomm.dataplane.finite``: on CPU one
sum over the buffer, with a per-parameter search only when that sum is not finite; on GPU one norm
per parameter in one multi-tensor launch and a few ops on those values, no host sync). Reading the
slots is a host sync on a GPU in ``"raise"`` mode only (it must raise before the step); the other
modes read them one step later, when the copy to the host has finished, so the report of step N
comes with step N + 1.

Modes: ``"raise"`` (every rank raises, naming the step, the ranks and the parameters), ``"warn"``
(rank 0 of the set warns at every non-finite step; training goes on) and the default ``"auto"``
(no setting and no argument: the first non-finite step warns the same way, the later ones are
logged at INFO), so that a NaN never spreads silently; ``GPUCOMM_CHECK_FINITE=0`` turns the check
off. When AMP's ``GradScaler`` is in use, its overflow steps are expected (it skips them and lowers
the scale): they are reported at INFO and counted, never raised.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..settings import CHECK_FINITE
from .submission import FiniteSlots, exact_limit

log = logging.getLogger("gpucomm")

ENV = "GPUCOMM_CHECK_FINITE"
MODES = ("raise", "warn")
DEFAULT_MODE = "auto"  # neither asked nor refused: the first non-finite step warns, naming it; later ones log


def resolve_mode(check_finite: Any) -> str | None:
    """The check's mode from ``check_finite`` (True = "raise", False = off; None: ``GPUCOMM_CHECK_FINITE``,
    and when that is unset too, ``DEFAULT_MODE``: a NaN never spreads silently by default)."""
    if check_finite is None:
        mode = CHECK_FINITE.read(None, DEFAULT_MODE)  # refuses what is not a mode, naming the variable
        return None if mode == "off" else mode
    elif check_finite is True:
        return "raise"
    elif check_finite is False:
        return None
    else:
        value, source = str(check_finite).strip().lower(), f"check_finite={check_finite!r}"
    if value not in MODES and value != DEFAULT_MODE:
        raise ValueError(f"{source} is not a mode of the finite check: use 'raise' (stop every rank, naming the rank "
                         f"and parameter), 'warn' (report every non-finite step and continue), 'auto' (the default: "
                         f"warn at the first, then log), or off (False / 0).")
    return value


@dataclass(frozen=True)
class Finding:
    """A rank whose gradients went non-finite in a step: the first such parameter it reported."""

    rank: int  # the global rank
    bucket: int
    param: int  # index within the bucket; -1 when beyond the slot's exact range
    name: str


def active_grad_scaler() -> Any:
    """A ``torch.amp.GradScaler`` in use in this process (enabled and scaling), or None. Looked for
    only when a non-finite gradient was found, so it costs nothing in a healthy step."""
    try:
        from torch.amp import GradScaler  # noqa: PLC0415
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    for obj in gc.get_objects():
        if isinstance(obj, GradScaler):
            try:
                if obj.is_enabled() and getattr(obj, "_scale", None) is not None:
                    return obj
            except Exception:  # noqa: BLE001 - a half-built scaler is not in use
                continue
    return None


def describe(step: int, findings: Sequence[Finding], mode: str = "raise") -> str:
    """The report every rank gives for one step (``mode``: the check's, which the advice follows)."""
    first, others = findings[0], findings[1:]
    what = f"rank {first.rank} in parameter '{first.name}' (bucket {first.bucket})"
    also = "".join(f"; also rank {f.rank} in '{f.name}'" for f in others)
    return (f"DistributedOptimizer: a non-finite gradient (NaN or Inf) in step {step}: first on {what}{also}. Averaged, "
            f"it makes every rank's gradients non-finite, and the optimizer step would corrupt the weights on every "
            f"rank. Likely causes: the loss diverged (learning rate too high), a bad batch on that rank (check its "
            f"data), or fp16 overflow (use torch.amp.GradScaler, or bfloat16). {ADVICE[mode]}")


ADVICE = {
    "raise": "check_finite='warn' (GPUCOMM_CHECK_FINITE=warn) reports and continues.",
    "warn": "check_finite='raise' (GPUCOMM_CHECK_FINITE=raise) stops every rank at such a step.",
    "auto": ("The check is on by default and warns once: later non-finite steps are logged at INFO; "
             "GPUCOMM_CHECK_FINITE=warn warns at each, =raise stops every rank, =0 turns it off."),
}


__all__ = ["DEFAULT_MODE", "ENV", "Finding", "FiniteSlots", "MODES", "active_grad_scaler", "describe", "exact_limit",
           "resolve_mode"]  # FiniteSlots, exact_limit: the data plane's
