"""Autotune: a DistributedOptimizer's buckets chosen from measured costs, then kept only if faster.

Horovod's ``--autotune`` samples fusion thresholds and cycle times by Bayesian search over dozens of
steps. Here the step model (``gpucomm.tuning``) proposes and measured steps decide:

1. warm-up: ``warmup`` steps run untimed on the current plan;
2. the current plan is timed for ``steps`` steps; the last of them is *watched* (when each
   gradient became ready, as the optimizer's hooks see it);
3. the job's own collective cost is measured: allreduces of a few sizes on the optimizer's
   schedule, timed on every rank, fitted to ``alpha + bytes / beta`` (``tuning.fit_alpha_beta``);
4. candidates: the plan in use (the cut at backward's pauses, ``fusion.plan_by_readiness``, after
   the first step) and the exact best contiguous cut of the ready order (``tuning.optimal_plan``),
   for a processor of its own beside compute (GPUs) and, on CPU, for a processor that computes
   too. The candidates are timed interleaved: ``ROUNDS`` rounds, each adopting every candidate in
   turn (the layout is agreed across ranks, as every re-cut is) for one warm-up step and a share
   of ``steps`` timed steps, so that a load that drifts during the trial (seen on CPU: 8 % between
   blocks of steps) weighs on every candidate alike instead of deciding for one;
5. the job's step time of a plan is its slowest rank's median over its rounds; the fastest plan
   is kept, the one in use unless another is at least 2 % faster (``MIN_GAIN``: within noise, no
   churn). Steady state then sends no control message again.

Every rank takes the same decision from the same gathered numbers (ready times from the set's
first rank, the slowest rank's costs and step times), so the layouts always agree. The trial log
(``GPUCOMM_AUTOTUNE_LOG`` / ``HOROVOD_AUTOTUNE_LOG`` / ``gpucomm-run --autotune-log-file``) is a
CSV written by the set's first rank. Settings: ``GPUCOMM_AUTOTUNE`` / ``HOROVOD_AUTOTUNE`` (on),
``..._AUTOTUNE_WARMUP_SAMPLES`` (default 3 steps), ``..._AUTOTUNE_STEPS_PER_SAMPLE`` (default 10).
"""

from __future__ import annotations

import atexit
import csv
import functools
import logging
import statistics
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Mapping, Sequence

from ..counters import COUNTERS
from ..settings import AUTOTUNE, AUTOTUNE_LOG, AUTOTUNE_STEPS_PER_SAMPLE, AUTOTUNE_WARMUP_SAMPLES
from ..tuning import AlphaBeta, FitError, Overheads, fit_alpha_beta, medians, optimal_plan, simulate

log = logging.getLogger("gpucomm")
# What the trial does and decides, said at the default log level by the set's first rank
# (``logs.configure_logging`` lets this logger's INFO through when no level was chosen).
progress = logging.getLogger("gpucomm.autotune")

CALIBRATION_REPEATS = 3
MIN_GAIN = 0.02  # a plan replaces the one in use only if its step is at least this much shorter
ROUNDS = 4  # interleaved rounds (an even number: ABC CBA ABC CBA puts a steady drift on each alike)
MOST_CANDIDATES = 3  # the plan in use, the model's, and (on CPU) the shared-processor model's
SMALLEST_PROBE = 64 << 10
LARGEST_PROBE = 64 << 20

Plan = list[list[int]]  # buckets of indices into the optimizer's dense gradient list, in launch order


@dataclass(frozen=True)
class AutotuneSettings:
    """How long each trial runs, and where the trial log goes (None: no log)."""

    warmup: int = 3
    steps: int = 10
    log_path: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "AutotuneSettings | None":
        """The settings when autotune is on in ``env`` (default: this process's), else None."""
        if not AUTOTUNE.read(env, False):
            return None
        return cls(AUTOTUNE_WARMUP_SAMPLES.read(env, 3), AUTOTUNE_STEPS_PER_SAMPLE.read(env, 10), AUTOTUNE_LOG.read(env))


def trial_steps(warmup: int, steps: int, candidates: int) -> int:
    """How many training steps a trial of ``candidates`` plans (the one in use among them) takes,
    counted as ``Autotuner`` takes them: the warm-up, the current plan timed (one step more: the
    first is timed from the end of the one before it), then, with more than one plan, ``ROUNDS``
    interleaved rounds of ``per_round`` timed steps per plan and one agreement step per switch."""
    total = warmup + steps + 1
    if candidates > 1:
        per_round = max(2, -(-steps // ROUNDS))
        total += 1 + ROUNDS * candidates * per_round + ROUNDS * (candidates - 1)
    return total


@dataclass
class Candidate:
    """One plan on trial: its name, buckets, the model's predicted step (seconds of the part the
    plan changes: backward and communication) and the step time measured on this rank."""

    name: str
    plan: Plan
    predicted_s: float | None = None
    measured_s: float | None = None
    job_s: float | None = None  # the slowest rank's median (what decides)


@dataclass
class Outcome:
    """What the trial found: every candidate, the cost fit, and the plan kept."""

    candidates: list[Candidate] = field(default_factory=list)
    cost: AlphaBeta | None = None
    chosen: str = "current"


class Autotuner:
    """Drives one trial. The optimizer calls ``step_done(now)`` after every ``synchronize()``; the
    tuner acts through the callbacks it was given, always at the same step on every rank:

    - ``watch()``: record when each gradient becomes ready during the next step;
    - ``ready_times() -> list[float | None]``: seconds from the first gradient, in dense order;
    - ``time_allreduce(nbytes) -> float``: seconds of one allreduce of ``nbytes`` on the schedule;
    - ``gather(obj, tag) -> list``: ``obj`` from every rank of the set (a collective);
    - ``adopt(plan)``: re-cut the buckets (a collective: the layout is agreed across ranks);
    - ``current_plan() -> Plan``: the buckets in use.

    ``sizes``: bytes of each dense gradient as it travels; ``cpu``: the gradients live on CPU (then
    the shared-processor model is tried too); ``writes_log``: this rank writes the trial log."""

    def __init__(self, settings: AutotuneSettings, sizes: Sequence[int], *, cpu: bool, writes_log: bool,
                 watch: Callable[[], None], ready_times: Callable[[], list[float | None]],
                 time_allreduce: Callable[[int], float], gather: Callable[[Any, str], list],
                 adopt: Callable[[Plan], None], current_plan: Callable[[], Plan]) -> None:
        self.settings, self.sizes, self.cpu, self.writes_log = settings, list(sizes), cpu, writes_log
        self._watch, self._ready_times, self._time_allreduce = watch, ready_times, time_allreduce
        self._gather, self._adopt, self._current_plan = gather, adopt, current_plan
        self.outcome = Outcome()
        self.done = False
        self.steps_seen = 0
        most = MOST_CANDIDATES if cpu else MOST_CANDIDATES - 1
        self._say("started on %d gradients (%s); the trial takes %d to %d training steps: %d warm-up, %d timed "
                  "on the plan in use, then each plan the model proposes timed in %d interleaved rounds. Steady "
                  "state after it sends no control message.", len(self.sizes), _size_text(sum(self.sizes)),
                  trial_steps(settings.warmup, settings.steps, 1), trial_steps(settings.warmup, settings.steps, most),
                  settings.warmup, settings.steps, ROUNDS)
        self._trial = self._run()
        next(self._trial)  # up to its first wait for a step
        if writes_log:  # a script that ends before the trial decides is told so, not left guessing
            self._at_exit = functools.partial(_say_if_unfinished, weakref.ref(self))
            atexit.register(self._at_exit)

    def step_done(self, now: float) -> None:
        """One training step finished (``synchronize()`` returned) at ``now`` (seconds, perf_counter)."""
        if self.done:
            return
        self.steps_seen += 1
        try:
            self._trial.send(now)
        except StopIteration:
            self.done = True
            if self.writes_log:
                atexit.unregister(self._at_exit)

    # -- the trial -----------------------------------------------------------------------------
    def _run(self) -> Generator[None, float, None]:
        yield from self._steps(self.settings.warmup)
        current = Candidate("current", self._current_plan())
        current.measured_s = yield from self._timed(watch_last=True)
        ready = self._ready_times()
        samples = self._calibrate()
        gathered = self._gather({"ready": ready, "samples": samples}, "measured")
        ready_s = _ready_seconds(gathered[0]["ready"])
        cost = self._fit([g["samples"] for g in gathered])
        self.outcome.cost = cost
        candidates = [current] + self._proposals(ready_s, cost, current.plan)
        for c in candidates:
            c.predicted_s = self._predict(ready_s, cost, c.plan)
        self._say("measured: collective cost %.1f us + bytes / %.2f GB/s (allreduces of %s on every rank); the "
                  "plan in use: %d buckets, %.2f ms a step. %s", cost.alpha_s * 1e6, cost.bandwidth_Bps / 1e9,
                  _plural(len({n for n, _ in samples}), "size"), len(current.plan), current.measured_s * 1e3,
                  "The model proposes nothing else: the plan in use is kept." if len(candidates) == 1 else
                  f"Timing {len(candidates)} plans ({', '.join(f'{c.name}: {len(c.plan)} buckets' for c in candidates)})"
                  f" over the next {trial_steps(self.settings.warmup, self.settings.steps, len(candidates)) - self.steps_seen} steps.")
        in_use = current
        if len(candidates) > 1:
            timed: dict[int, list[float]] = {k: [] for k in range(len(candidates))}
            per_round = max(2, -(-self.settings.steps // ROUNDS))
            last = None  # the end of the step before the next timed one, when known
            for r in range(ROUNDS):
                # every round starts with the candidate the last one ended on: one re-cut fewer
                order = list(range(len(candidates)))
                if r % 2:
                    order.reverse()
                for k in order:
                    c = candidates[k]
                    if c is not in_use:
                        self._adopt(c.plan)
                        COUNTERS.autotune_trials += 1
                        in_use = c
                        last = yield from self._steps(1)  # the first step after a re-cut carries the agreement
                    times, last = yield from self._times(per_round, last=last)
                    timed[k] += times
            for k, c in enumerate(candidates):
                c.measured_s = statistics.median(timed[k])
        medians_by_rank = self._gather([c.measured_s for c in candidates], "decided")
        for k, c in enumerate(candidates):
            c.job_s = max(rank[k] for rank in medians_by_rank)
        best = min(candidates[1:], key=lambda c: c.job_s, default=current)
        if not best.job_s < current.job_s * (1 - MIN_GAIN):  # within noise of the plan in use: keep it
            best = current
        self.outcome.candidates, self.outcome.chosen = candidates, best.name
        if in_use is not best:
            self._adopt(best.plan)
        COUNTERS.autotune_done += 1
        self._report()

    def unfinished(self) -> str | None:
        """Why the trial has not decided yet (steps taken of how many), or None once it has."""
        if self.done:
            return None
        return (f"the trial saw {self.steps_seen} of the {trial_steps(self.settings.warmup, self.settings.steps, 1)} "
                f"to {trial_steps(self.settings.warmup, self.settings.steps, MOST_CANDIDATES)} steps it needs and "
                "decided nothing: the buckets stayed as they were. Train longer, or shorten the trial with "
                "GPUCOMM_AUTOTUNE_WARMUP_SAMPLES / GPUCOMM_AUTOTUNE_STEPS_PER_SAMPLE (gpucomm-run "
                "--autotune-warmup-samples / --autotune-steps-per-sample)")

    def say_if_unfinished(self) -> None:
        """Warn that the trial decided nothing, if so (called at exit: a script that ends early)."""
        why = self.unfinished()
        if why is not None:
            progress.warning("gpucomm autotune: the job ended before the trial finished: %s.", why)

    def _steps(self, n: int) -> Generator[None, float, float | None]:
        now = None
        for _ in range(n):
            now = yield
        return now

    def _timed(self, watch_last: bool = False) -> Generator[None, float, float]:
        """The median step of ``steps`` steps (the first timed from the step before it)."""
        times, _ = yield from self._times(self.settings.steps, watch_last=watch_last)
        return statistics.median(times)

    def _times(self, n: int, *, watch_last: bool = False,
               last: float | None = None) -> Generator[None, float, tuple[list[float], float]]:
        """The durations of the next ``n`` steps, and when the last one ended. The first is timed
        from ``last`` (the end of the step before it), or, unknown, from the end of the next step."""
        if last is None:
            last = yield
        times = []
        for k in range(n):
            if watch_last and k == n - 1:
                self._watch()
            now = yield
            times.append(now - last)
            last = now
        return times, last

    def _calibrate(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of allreduces on the schedule: powers of 4 from 64 KiB up to the
        gradients' total (at most 64 MiB), ``CALIBRATION_REPEATS`` each, the first of each size
        discarded as warm-up."""
        total = sum(self.sizes)
        sizes, n = [], SMALLEST_PROBE
        while n < min(total, LARGEST_PROBE):
            sizes.append(n)
            n *= 4
        sizes.append(max(min(total, LARGEST_PROBE), 4))
        out = []
        for nbytes in sizes:
            self._time_allreduce(nbytes)
            out += [(nbytes, self._time_allreduce(nbytes)) for _ in range(CALIBRATION_REPEATS)]
        return out

    def _fit(self, per_rank: list[list[tuple[int, float]]]) -> AlphaBeta:
        """At each size the slowest rank's median, fitted to alpha + bytes/beta."""
        slowest: dict[float, float] = {}
        for samples in per_rank:
            for nbytes, seconds in medians(samples):
                slowest[nbytes] = max(seconds, slowest.get(nbytes, 0.0))
        try:
            return fit_alpha_beta(sorted(slowest.items()))
        except FitError:  # one size only (tiny models): the line through it and the origin
            nbytes, seconds = max(slowest.items())
            return AlphaBeta(0.0, max(nbytes, 1.0) / seconds)

    def _proposals(self, ready_s: list[float], cost: AlphaBeta, current: Plan) -> list[Candidate]:
        """The model's plans that differ from the current one (and from each other)."""
        proposals = [Candidate("model", [list(b) for b in optimal_plan(ready_s, self.sizes, cost).buckets])]
        if self.cpu:
            shared = optimal_plan(ready_s, self.sizes, cost, processor="shared")
            proposals.append(Candidate("model-shared-cpu", [list(b) for b in shared.buckets]))
        seen = [current]
        out = []
        for c in proposals:
            if c.plan not in seen:
                seen.append(c.plan)
                out.append(c)
        return out

    def _predict(self, ready_s: list[float], cost: AlphaBeta, plan: Plan) -> float:
        processor = "shared" if self.cpu else "dedicated"
        return simulate(ready_s, self.sizes, plan, cost, overheads=Overheads(), processor=processor).step_s

    def _say(self, message: str, *args: Any) -> None:
        """Tell the user: at the default log level on the set's first rank, in the debug log elsewhere."""
        (progress.info if self.writes_log else log.debug)("gpucomm autotune: " + message, *args)

    def _report(self) -> None:
        o = self.outcome
        text = "; ".join(f"{c.name}: {len(c.plan)} buckets, {c.job_s * 1e3:.2f} ms measured"
                         + (f", {c.predicted_s * 1e3:.2f} ms of backward+communication predicted"
                            if c.predicted_s is not None else "") for c in o.candidates)
        chosen = next(c for c in o.candidates if c.name == o.chosen)
        self._say("done after %d steps: kept %s, %d buckets (%s); collective cost %.1f us + bytes / %.2f GB/s",
                  self.steps_seen, o.chosen, len(chosen.plan), text, o.cost.alpha_s * 1e6, o.cost.bandwidth_Bps / 1e9)
        if self.writes_log and self.settings.log_path:
            write_log(self.settings.log_path, o, self.sizes)


def _size_text(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:.1f} KiB"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _say_if_unfinished(tuner_ref: "weakref.ref[Autotuner]") -> None:
    tuner = tuner_ref()
    if tuner is not None:
        tuner.say_if_unfinished()


def write_log(path: str, outcome: Outcome, sizes: Sequence[int]) -> None:
    """The trial as CSV: one row per candidate plan."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["candidate", "buckets", "largest_bucket_bytes", "predicted_backward_comm_ms", "measured_step_ms",
                    "chosen", "alpha_us", "bandwidth_GBps"])
        for c in outcome.candidates:
            largest = max((sum(sizes[i] for i in b) for b in c.plan), default=0)
            w.writerow([c.name, len(c.plan), largest,
                        f"{c.predicted_s * 1e3:.3f}" if c.predicted_s is not None else "",
                        f"{c.job_s * 1e3:.3f}", int(c.name == outcome.chosen),
                        f"{outcome.cost.alpha_s * 1e6:.2f}", f"{outcome.cost.bandwidth_Bps / 1e9:.4f}"])


def _ready_seconds(ready: list[float | None]) -> list[float]:
    """Ready times with the gradients never seen taken as ready last."""
    last = max((t for t in ready if t is not None), default=0.0)
    return [t if t is not None else last for t in ready]


__all__ = ["AutotuneSettings", "Autotuner", "Candidate", "Outcome", "write_log"]
