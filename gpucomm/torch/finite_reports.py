"""``DistributedOptimizer``'s reports of the finite check: the slots each bucket's reduction
carried (``finite_check.py`` says how they are written) decoded into findings (the rank and the
parameter whose gradient first went NaN or Inf), kept in ``last_nonfinite``, and raised, warned
or logged by mode, the same on every rank in the same step.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from ..counters import COUNTERS
from ..errors import NonFiniteGradientError
from . import finite_check
from .submission import current_job

log = logging.getLogger("gpucomm")


class FiniteReports:
    """Decoding and reporting the finite check's slots, for ``DistributedSteps`` (merged into its
    namespace: ``self`` is the optimizer)."""

    def _report_checks(self, reports: list, buckets: Any = None) -> None:
        """The finite check's reports, per step (``GradientBuckets.finish``; on a GPU outside "raise"
        mode, an earlier step's arriving now): decoded against ``buckets`` (default: the current
        layout), kept in ``last_nonfinite`` and reported."""
        for step, slots in reports:
            findings = self._findings(slots, buckets or self._buckets)
            if findings:
                self.last_nonfinite = findings
                self._report_nonfinite(findings, step)

    def _drain_checks(self) -> None:
        """Report what the finite check still has on its way to the host (a GPU's last step), before
        the buckets it refers to are replaced or released."""
        buckets = getattr(self, "_buckets", None)
        if buckets is not None and self._finite is not None:
            self._report_checks(buckets.check_reports(wait=True), buckets)

    def _findings(self, reports: list[tuple[int, int, int]], buckets: Any) -> list[finite_check.Finding]:
        """The finite check's slots, decoded: each reporting rank's first non-finite parameter, the
        earliest in backward order first (the same list on every rank)."""
        findings = []
        for index, bucket_index, value in reports:
            bucket = buckets.buckets[bucket_index]
            param = value - 1 if value - 1 < len(bucket.params) else -1
            limit = finite_check.exact_limit(bucket.wire_dtype or torch.float32)
            if value >= limit and len(bucket.params) > limit:
                param = -1  # the slot's dtype cannot say which of the later parameters
            name = self._parameter_names[bucket.params[param]] if param >= 0 else \
                f"#{limit - 1} or later of bucket {bucket_index}"
            findings.append(finite_check.Finding(self._ranks[index], bucket_index, param, name))
        return sorted(findings, key=lambda f: (f.bucket, f.param if f.param >= 0 else 1 << 62, f.rank))

    def _report_nonfinite(self, findings: list[finite_check.Finding], step: int) -> None:
        """Raise or warn on every rank (the same step, the same findings); AMP's GradScaler in use:
        its overflow steps are expected (it skips them), so only report them. The default mode
        warns at the first non-finite step and logs the later ones at INFO."""
        COUNTERS.nonfinite_steps += 1
        text = finite_check.describe(step, findings, self._check_mode)
        if finite_check.active_grad_scaler() is not None:
            COUNTERS.nonfinite_skipped += 1
            log.info("%s (torch.amp.GradScaler is in use: it skips this step and lowers its scale; not raised)", text)
            return
        if self._check_mode == "raise":
            raise NonFiniteGradientError(text, step, findings)
        first = not self._warned_nonfinite
        self._warned_nonfinite = True
        if self._ranks[0] == current_job().world.rank and (self._check_mode == "warn" or first):
            warnings.warn(text, RuntimeWarning, stacklevel=4)
        elif self._check_mode == "auto" and self._ranks[0] == current_job().world.rank:
            log.info("%s", text)
        else:
            log.debug("%s", text)
