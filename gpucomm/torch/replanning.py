"""``DistributedOptimizer``'s buckets cut again while training: once, after the first watched
step, where backward pauses (rank 0's gradient arrival times: ``fusion.plan_by_readiness``, on
CPU), and then by the autotuner (``autotune.py``), which this drives: it starts it, tells it each
step's end, and lends it the optimizer's schedule to time allreduces and agree on plans.

Every re-cut is a layout agreed across ranks like the first (``layout_agreement.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..counters import COUNTERS
from ..errors import CollectiveError
from .autotune import Autotuner
from .compression import wire_of
from .functions import allgather_object, broadcast_object
from .submission import current_job, fused_wire

log = logging.getLogger("gpucomm")


class Replanning:
    """The first re-cut and the autotuner's driving, for ``DistributedSteps`` (merged into its
    namespace: ``self`` is the optimizer)."""

    def _replan(self) -> bool:
        """After a step's reduction: the first re-cut where backward paused (True: the layout was
        agreed just now), or the autotuner's turn."""
        if self._watch is not None and not self._tuner_watches:
            return self._cut_where_backward_pauses()
        if self._autotune is not None:
            self._autotune_step()
        return False

    def _cut_where_backward_pauses(self) -> bool:
        """After the watched step: take rank 0's gradient arrival times and agree on buckets cut at
        its pauses (and on any change of the trainable set). False if a rank has joined meanwhile:
        every training rank then gets the same refusal from the coordinator and keeps the buckets
        it has (the joined rank stands in with those)."""
        watched, self._watch = self._watch, None
        start = min(watched.values(), default=0.0)
        mine = [None if p not in watched else (watched[p] - start) * 1e6 for p in self._params]
        root = current_job().group(self._set_id).ranks[0]
        try:
            self._ready_us = broadcast_object(mine, root_rank=root, name=f"DistributedOptimizer.ready.{self._schedule.number}",
                                              process_set=self._process_set)
        except CollectiveError as e:
            if "already called join()" not in str(e):
                raise
            return False
        self._adopt_new_layout()
        return True

    def _autotune_step(self) -> None:
        """A step ended: start the autotuner after the first re-cut, or tell it the step's end."""
        if self._tuner is None:
            self._tuner = self._new_tuner()
            if self._tuner is None:
                self._autotune = None
            return
        if not self._tuner.done:
            self._tuner.step_done(time.perf_counter())

    def _new_tuner(self) -> Autotuner | None:
        dense = self._dense
        kinds = {(p.dtype, p.device) for p in dense}
        if len(kinds) != 1:
            log.warning("gpucomm autotune: skipped: this optimizer's gradients have %d dtypes/devices (%s); the "
                        "planner cuts one kind of fusion buffer. Cast the model to one dtype, or leave autotune off.",
                        len(kinds), ", ".join(f"{d} on {v}" for d, v in sorted(kinds, key=str)) or "none")
            return None
        dtype, device = next(iter(kinds))
        wire = fused_wire(dtype, wire_of(self._compression)(dtype)) or dtype
        sizes = [p.numel() * wire.itemsize for p in dense]
        job = current_job()
        probes = iter(range(1 << 30))

        def time_allreduce(nbytes: int) -> float:
            buffer = torch.zeros(max(1, nbytes // wire.itemsize), dtype=wire, device=device)
            start = time.perf_counter()
            self._buckets.allreduce_now([buffer], f"DistributedOptimizer.autotune.{self._schedule.number}.probe."
                                                  f"{next(probes)}")
            return time.perf_counter() - start

        def gather(obj: Any, tag: str) -> list:
            return allgather_object(obj, name=f"DistributedOptimizer.autotune.{self._schedule.number}.{tag}."
                                              f"{self._layouts}", process_set=self._process_set)

        return Autotuner(self._autotune, sizes, cpu=device.type == "cpu", writes_log=self._ranks[0] == job.world.rank,
                         watch=self._watch_for_tuner, ready_times=self._tuner_ready_times,
                         time_allreduce=time_allreduce, gather=gather, adopt=self._recut, current_plan=self._plan_now)

    def _watch_for_tuner(self) -> None:
        self._watch, self._tuner_watches = {}, True

    def _tuner_ready_times(self) -> list[float | None]:
        """When each dense gradient arrived in the watched step (seconds from the first), then stop watching."""
        watched, self._watch, self._tuner_watches = self._watch or {}, None, False
        start = min(watched.values(), default=0.0)
        return [watched[p] - start if p in watched else None for p in self._dense]

    def _plan_now(self) -> list[list[int]]:
        index = {p: i for i, p in enumerate(self._dense)}
        return [[index[p] for p in b.params] for b in self._buckets.buckets]

    def _recut(self, plan: list[list[int]]) -> None:
        """Adopt the autotuner's ``plan`` (agreed across ranks like every layout)."""
        self._planned = plan
        self._drain_checks()  # the old layout's reports still on their way, decoded against it
        before = set(self._trainable)
        self._buckets = self._agree_on_layout(current_job())
        self._average_added(before)  # a layer unfrozen or a group added in this step: its gradients too
        COUNTERS.autotune_recuts += 1
