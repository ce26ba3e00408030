"""What the timeline itself costs, each figure beside its anchor:

* the writer's hot path, per event call (``activity_start`` / ``activity_end``), beside its floor: a
  Python function that reads the clock and appends one tuple to a deque, the least any enqueueing
  recorder does;
* how long an event takes to reach the file without ``flush()``, beside the writer's wake-up period
  (50 ms; the design says an event is in the file within about twice that);
* rendering a training-shaped trace (``gpucomm.timeline.plot.render``), per record, beside parsing the
  same file's JSON (``read_records``), the floor of any renderer.

    python benchmarks/timeline_cost.py [--quick] [--json bench-out/timeline_cost.json]

These are the times tests/test_timeline.py used to bound (under 20 us per event call, a 33k-record
render under 10 s). The tests now count the work instead (the calls an event makes, the Python calls a
rendered record costs), which a loaded machine cannot change; the times are measured here, in
interleaved rounds (anchor and timeline in turn, the order alternating), and reported with their
spread, never checked against a limit. Rank-free: one process, no job.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import inspect
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable

import gpucomm
from gpucomm.timeline import Timeline
from gpucomm.timeline.plot import read_records, render

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from bench_stats import fmt, fmt_pair, percentile, ratio, spread, write_json  # noqa: E402

LATENCY_GUARD_S = 30.0  # an event not in the file by then means the writer is not writing: stop, not hang
FULL = {"calls": 20_000, "rounds": 7, "latency_rounds": 20, "render_rounds": 3, "steps": 500}
QUICK = {"calls": 2_000, "rounds": 3, "latency_rounds": 3, "render_rounds": 1, "steps": 20}
BUCKETS = 8  # fusion buckets per training step in the synthetic trace: 33 spans per step


# -- the writer's hot path -------------------------------------------------------------------------


def _floor_put(queue: collections.deque, t0_ns: int, name: str, label: str | None) -> None:
    """The anchor: what an event call cannot do less than (a call, a clock read, one append)."""
    queue.append((0, name, (time.perf_counter_ns() - t0_ns) * 1e-3, label))


def floor_seconds(pairs: int) -> float:
    """Seconds for ``pairs`` start/end pairs through the floor recorder."""
    queue: collections.deque = collections.deque()
    t0 = time.perf_counter_ns()
    start = time.perf_counter()
    for _ in range(pairs):
        _floor_put(queue, t0, "allreduce.x", "NCCL_ALLREDUCE")
        _floor_put(queue, t0, "allreduce.x", None)
    return time.perf_counter() - start


def timeline_seconds(pairs: int, folder: str) -> float:
    """Seconds for ``pairs`` activity_start/activity_end pairs on a live Timeline (writer running)."""
    with Timeline(os.path.join(folder, "hot_path.json")) as tl:
        start = time.perf_counter()
        for _ in range(pairs):
            tl.activity_start("allreduce.x", "NCCL_ALLREDUCE")
            tl.activity_end("allreduce.x")
        return time.perf_counter() - start


def interleaved(rounds: int, first: Callable[[], float],
                second: Callable[[], float]) -> tuple[list[float], list[float]]:
    """Each callable's result per round, the order alternating so neither always runs first."""
    a, b = [], []
    for r in range(rounds):
        if r % 2 == 0:
            a.append(first())
            b.append(second())
        else:
            b.append(second())
            a.append(first())
    return a, b


def hot_path(calls: int, rounds: int, folder: str) -> dict[str, Any]:
    """Per-event-call µs of the timeline and of its floor, per round, with medians and their ratio."""
    pairs = calls // 2
    floor_s, timeline_s = interleaved(rounds, lambda: floor_seconds(pairs), lambda: timeline_seconds(pairs, folder))
    ours = [s / (2 * pairs) * 1e6 for s in timeline_s]
    floor = [s / (2 * pairs) * 1e6 for s in floor_s]
    mine, base = spread(ours), spread(floor)
    return {"event_calls_per_round": 2 * pairs, "us_per_call": ours, "floor_us_per_call": floor,
            "timeline": mine, "floor": base, "ratio_median": ratio(mine["median"], base["median"])}


# -- from an event to the file ---------------------------------------------------------------------


def latency_once(folder: str, k: int) -> float:
    """Seconds from enqueuing one op_start to its name being readable in the file (no flush)."""
    path = os.path.join(folder, f"latency.{k}.json")
    with Timeline(path) as tl:
        name = f"allreduce.latency.{k}"
        needle = name.encode()
        start = time.perf_counter()
        tl.op_start(name, "allreduce")
        while time.perf_counter() - start < LATENCY_GUARD_S:
            with open(path, "rb") as f:
                if needle in f.read():
                    return time.perf_counter() - start
            time.sleep(0.0005)
    raise RuntimeError(f"an event was not in {path} {LATENCY_GUARD_S:g} s after it was recorded, with no flush(): "
                       f"the timeline's writer thread is not writing periodically")


def latency(rounds: int, folder: str) -> dict[str, Any]:
    """Event-to-file ms per round, beside the writer's wake-up period."""
    ms = [latency_once(folder, k) * 1e3 for k in range(rounds)]
    interval_ms = inspect.signature(Timeline).parameters["flush_interval_s"].default * 1e3
    middle = spread(ms)
    return {"ms": ms, "spread": middle, "p90_ms": percentile(sorted(ms), 0.9), "flush_interval_ms": interval_ms,
            "median_over_interval": ratio(middle["median"], interval_ms)}


# -- rendering -------------------------------------------------------------------------------------


def write_training_trace(path: str, steps: int) -> None:
    """A trace shaped like DistributedOptimizer's: per step a cycle mark, a backward span and
    ``BUCKETS`` bucket allreduces with three activities each."""
    with Timeline(path, mark_cycles=True) as tl:
        for step in range(steps):
            t = step * 10_000
            tl.mark_cycle(t)
            tl.span("DistributedOptimizer.backward", "BACKWARD", t, t + 6000)
            for b in range(BUCKETS):
                name, s = f"DistributedOptimizer.bucket.{b}", t + 700 * b
                tl.op_start(name, "allreduce", s)
                for label, a, z in (("MEMCPY_IN_FUSION_BUFFER", 0, 50), ("NCCL_ALLREDUCE", 50, 600),
                                    ("MEMCPY_OUT_FUSION_BUFFER", 600, 650)):
                    tl.activity_start(name, label, s + a)
                    tl.activity_end(name, s + z)
                tl.op_end(name, "float32", [1 << 20], s + 650)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rendering(steps: int, rounds: int, folder: str) -> dict[str, Any]:
    """Seconds to render the trace and to parse its JSON, per round, and both per record (``skipped``,
    with the reason, without matplotlib)."""
    if importlib.util.find_spec("matplotlib") is None:
        return {"skipped": "matplotlib is not installed (pip install matplotlib)"}
    trace = os.path.join(folder, "training.json")
    write_training_trace(trace, steps)
    png = os.path.join(folder, "training.png")
    summary = render(trace, png)  # once untimed: matplotlib's import and first-draw set-up
    parse_s, render_s = interleaved(rounds, lambda: _timed(lambda: read_records(trace)),
                                    lambda: _timed(lambda: render(trace, png)))
    n = summary["n_records"]
    ours, base = spread(render_s), spread(parse_s)
    return {"steps": steps, "n_records": n, "n_spans": summary["n_spans"], "render_s": render_s,
            "parse_s": parse_s, "render": ours, "parse": base,
            "render_us_per_record": ours["median"] / n * 1e6, "parse_us_per_record": base["median"] / n * 1e6,
            "ratio_median": ratio(ours["median"], base["median"])}


# -- report ----------------------------------------------------------------------------------------


def lines(result: dict[str, Any]) -> list[str]:
    """The printed summary: each figure beside its anchor, with its spread."""
    hp, lat, rd = result["hot_path"], result["latency"], result["render"]
    if "skipped" in rd:
        rendered = f"render: not measured: {rd['skipped']}"
    else:
        rendered = (f"render of {rd['n_records']} records ({rd['n_spans']} spans): "
                    f"{fmt(rd['render']['median'], '.2f')} s, {fmt(rd['render_us_per_record'], '.1f')} us per record; "
                    f"parsing its JSON: "
                    f"{fmt(rd['parse']['median'], '.3f')} s, {fmt(rd['parse_us_per_record'], '.2f')} us per record; "
                    f"render / parse {fmt(rd['ratio_median'], '.1f')}")
    return [
        f"# timeline writer hot path, {hp['event_calls_per_round']} event calls x {len(hp['us_per_call'])} rounds "
        f"(median, quartiles)",
        f"hot path: {fmt(hp['timeline']['median'], '.2f')} us per event call "
        f"({fmt_pair(hp['timeline']['quartiles'], '.2f')}); floor (clock read + deque append): "
        f"{fmt(hp['floor']['median'], '.2f')} us ({fmt_pair(hp['floor']['quartiles'], '.2f')}); "
        f"timeline / floor {fmt(hp['ratio_median'], '.2f')}",
        f"event to file without flush(): median {fmt(lat['spread']['median'], '.1f')} ms, p90 "
        f"{fmt(lat['p90_ms'], '.1f')} ms over {len(lat['ms'])} events; writer wake-up period "
        f"{fmt(lat['flush_interval_ms'], '.0f')} ms; median / period {fmt(lat['median_over_interval'], '.2f')}",
        rendered,
    ]


def environment() -> dict[str, Any]:
    """Where the numbers come from: a shared machine's figures are only comparable on that machine."""
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "gpucomm": gpucomm.__version__, "load_average": load}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags; sizes left unset take the full (or, with --quick, the smoke) settings."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, help=f"event calls per hot-path round (default {FULL['calls']})")
    ap.add_argument("--rounds", type=int, help=f"hot-path rounds (default {FULL['rounds']})")
    ap.add_argument("--latency-rounds", type=int, help=f"events timed to the file (default {FULL['latency_rounds']})")
    ap.add_argument("--render-rounds", type=int, help=f"timed renders (default {FULL['render_rounds']})")
    ap.add_argument("--steps", type=int, help=f"training steps in the rendered trace (default {FULL['steps']}: "
                                              f"33,520 records)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: small counts, one render")
    ap.add_argument("--json", default="bench-out/timeline_cost.json", help="results file ('' to skip)")
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.calls // 2, args.rounds, args.latency_rounds, args.render_rounds, args.steps) < 1:
        ap.error("--calls must be at least 2 and the other counts at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure, print each figure beside its anchor, write the JSON."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="timeline_cost.") as folder:
        result = {"benchmark": "timeline_cost", "units": {"us_per_call": "us", "ms": "ms", "render_s": "s"},
                  "env": environment(), "args": vars(args),
                  "hot_path": hot_path(args.calls, args.rounds, folder),
                  "latency": latency(args.latency_rounds, folder),
                  "render": rendering(args.steps, args.render_rounds, folder)}
    for line in lines(result):
        print(line, flush=True)
    if args.json:
        write_json(args.json, result)
        print(f"# wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
