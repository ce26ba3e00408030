"""What gpucomm's control plane costs and what it buys, on CPU ranks: small-op latency beside a raw
torch ``ProcessGroupGloo``, control rounds of an async burst, and how fast a mismatch becomes an error.

    gpucomm-run -np 2 python benchmarks/control_plane.py [--json control_plane.json]
    python benchmarks/control_plane.py --mismatch-exit [--np 2] [--json mismatch_exit.json]

**Latency** of one allreduce of 1 float32 element (``op=Sum``, zeros, so nothing overflows):

* ``named``: ``hvd.allreduce_(t, name="lat")``. After the first call the name is in the response
  cache, and the coordinator reduces the 4 bytes itself in the same round trip (inline path,
  ``GPUCOMM_INLINE_BYTES``, default 16 KiB).
* ``unnamed``: ``hvd.allreduce_(t)``: a fresh name each call, so a full request every time.
* ``named_dataplane``: ``named`` with the inline path off (``GPUCOMM_INLINE_BYTES=0``): negotiated by
  the coordinator, then reduced by Gloo. The setting is read at ``hvd.init()``, so every round runs
  two gpucomm generations in the same processes: ``hvd.init()`` with the default, the measurements,
  ``hvd.shutdown()``, then ``hvd.init()`` with ``GPUCOMM_INLINE_BYTES=0``, this one, ``hvd.shutdown()``.
* ``raw_gloo``: ``ProcessGroupGloo.allreduce`` on its own TCPStore, no gpucomm in the path (measured
  in both generations).
* ``barrier``: ``hvd.barrier()``: one pure control round, no data.
* ``named_4097`` / ``raw_gloo_4097``: 4097 elements (16388 B, just above the 16 KiB inline limit),
  so gpucomm's default configuration takes the data plane: gpucomm beside raw Gloo at that size.

Variants run interleaved: ``--rounds`` rounds, each a block of ``--iters`` ops per variant, in an
order rotated every round. Two statistics, both on the slowest rank (an op is done when its last
rank returns): the loop average (block time / ops in the block, the OSU/nccl-tests convention;
median over blocks) and per-op median, p10 and p90 (op i's time = max over ranks of op i's time).

**Burst**: 100 x ``allreduce_async(torch.ones(1) * i, name=f"burst.{i}")`` then ``synchronize`` of
all; control rounds = ``controller.frames_sent`` growth (request frames sent to the coordinator),
max over ranks. First burst of a generation (names not cached) and repeats (cached), with 1 element
(inline), with 5000 elements (20000 B > 16 KiB: Gloo) and with 1 element in the inline-off
generation. Requests submitted without a wait leave at most ``GPUCOMM_CYCLE_TIME`` (1 ms) after the
first of them, so the rounds follow the time it takes to submit the burst ("submit ms").

**Mismatch**: rank r allreduces shape [r + 1]; time from the call to the ``RuntimeError`` on each
rank (caught, the job goes on); not measured at 1 rank (one rank cannot disagree with itself).
``--mismatch-exit`` instead launches ``benchmarks/mismatch_exit.py`` (at least 2 ranks, ``--np``)
(which does not catch it) under gpucomm-run and measures, by wall clock (``time.time()``), launch to
every rank's process ending, and the mismatched call to each rank's process ending (rank processes
are watched with psutil), and checks that every rank reported the error and ended within
``--exit-limit`` (2 s) of the call; it exits 1 otherwise. "call->last atexit" is the
call to the last rank's final atexit hook (error raised, traceback printed, gpucomm shut down); the
rest of "call->rank exit" is the interpreter's own teardown (torch's modules, about 0.4 s here).

Rank 0 prints tables and writes JSON (``--json``). ``--quick`` is a smoke run (1 round of 20 ops per
variant, bursts of 10, one mismatch; ``--mismatch-exit``: one launch). Figures that could not be
measured read n/a in the table and null in the JSON. Counts out of range exit 2 with one line. In
``--mismatch-exit`` mode Ctrl-C stops the launch under way, prints what finished and exits 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when loaded by path
from cpu_allreduce import raw_gloo_group  # noqa: E402
from bench_jobs import stop_group  # noqa: E402
from bench_stats import fmt, median, percentile, ratio, scaled, write_json  # noqa: E402

import gpucomm  # noqa: E402
import gpucomm.job  # noqa: E402
import gpucomm.torch as hvd  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABOVE_INLINE = 4097  # float32 elements: 16388 B, just over the default 16 KiB inline limit
BURST_DATAPLANE_NUMEL = 5000  # 20000 B: a burst that goes through Gloo under the default limit
INLINE_ENV = "GPUCOMM_INLINE_BYTES"
# variant -> (generation, what it compares with)
VARIANTS = {
    "named": ("default", "raw_gloo"),
    "unnamed": ("default", "raw_gloo"),
    "named_dataplane": ("inline_off", "raw_gloo"),
    "barrier": ("default", "raw_gloo"),
    "raw_gloo": ("both", None),
    "named_4097": ("default", "raw_gloo_4097"),
    "raw_gloo_4097": ("default", None),
}
BURSTS = ("inline_1", "dataplane_5000", "inline_off_1")
# counts: the full run, and --quick (a smoke run of a few seconds)
FULL = {"rounds": 5, "iters": 400, "warmup": 50, "burst_ops": 100, "burst_repeats": 5, "mismatch_repeats": 3,
        "exit_repeats": 3}
QUICK = {"rounds": 1, "iters": 20, "warmup": 2, "burst_ops": 10, "burst_repeats": 1, "mismatch_repeats": 1,
         "exit_repeats": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    ap.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL['rounds']})")
    ap.add_argument("--iters", type=int, help=f"ops per variant and round (default {FULL['iters']})")
    ap.add_argument("--warmup", type=int, help=f"untimed ops per variant and generation (default {FULL['warmup']})")
    ap.add_argument("--burst-ops", type=int, help=f"async ops per burst (default {FULL['burst_ops']})")
    ap.add_argument("--burst-repeats", type=int,
                    help=f"cached bursts per kind and round, after the uncached one (default {FULL['burst_repeats']})")
    ap.add_argument("--mismatch-repeats", type=int, help=f"mismatches per round (default {FULL['mismatch_repeats']})")
    ap.add_argument("--json", default="control_plane.json", metavar="PATH", help="results (default %(default)s)")
    ap.add_argument("--mismatch-exit", action="store_true",
                    help="instead: launch benchmarks/mismatch_exit.py under gpucomm-run and time the exit "
                         "(run this mode with plain python, not under a launcher)")
    ap.add_argument("--np", type=int, default=2, help="--mismatch-exit: ranks (default %(default)s)")
    ap.add_argument("--exit-repeats", type=int, help=f"--mismatch-exit: launches (default {FULL['exit_repeats']})")
    ap.add_argument("--exit-limit", type=float, default=2.0, metavar="S",
                    help="--mismatch-exit: every rank must be gone this soon after the mismatched call, else the "
                         "run fails (default %(default)s)")
    ap.add_argument("--launch-timeout", type=float, default=60.0, metavar="S",
                    help="--mismatch-exit: a launch that runs longer is killed and reported as a hang")
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.rounds, args.iters, args.burst_ops, args.np, args.exit_repeats) < 1 or \
            min(args.warmup, args.burst_repeats, args.mismatch_repeats) < 0:
        ap.error("counts must be positive (--warmup, --burst-repeats, --mismatch-repeats: not negative)")
    if args.mismatch_exit and args.np < 2:
        ap.error(f"--mismatch-exit --np {args.np}: a shape mismatch needs at least 2 ranks; give --np 2 or more")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        ap.error(f"--json {args.json}: its folder does not exist")
    return args


# ---------------------------------------------------------------------------------------------- in-job


@dataclasses.dataclass
class Local:
    """This rank's raw measurements (gathered to every rank at the end)."""

    blocks: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # variant -> block seconds
    ops: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # variant -> per-op seconds, in order
    frames: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # variant -> frames_sent per block
    bursts: dict[str, list[dict]] = dataclasses.field(default_factory=dict)  # kind -> [{cached, frames, s}]
    mismatch: list[float] = dataclasses.field(default_factory=list)  # seconds from call to error
    mismatch_errors: list[str] = dataclasses.field(default_factory=list)


def frames_sent() -> int | None:
    """Request frames this rank has sent to the coordinator; None in a 1-rank job, which gpucomm runs
    with no control plane."""
    controller = gpucomm.job.current().controller
    return None if controller is None else controller.frames_sent


def frames_since(before: int | None) -> int | None:
    after = frames_sent()
    return None if before is None or after is None else after - before


def control_config() -> dict[str, Any]:
    """The settings this generation runs with (None where this gpucomm does not say)."""
    job = gpucomm.job.current()
    config = job.controller.config if job.controller is not None else getattr(job, "control", None)
    if config is None:
        return {"inline_bytes": None, "cycle_time_ms": None}
    return {"inline_bytes": config.inline_bytes, "cycle_time_ms": config.cycle_time * 1e3}


def run_block(fn: Callable[[], Any], n: int) -> tuple[float, list[float], int | None]:
    """``n`` calls of ``fn``: (block seconds, seconds of each call, request frames sent meanwhile)."""
    per = [0.0] * n
    clock = time.perf_counter
    frames = frames_sent()
    start = clock()
    for i in range(n):
        t0 = clock()
        fn()
        per[i] = clock() - t0
    total = clock() - start
    return total, per, frames_since(frames)


def latency_variants(generation: str, pg, opts) -> dict[str, Callable[[], Any]]:
    one, above = torch.zeros(1), torch.zeros(ABOVE_INLINE)

    def raw(t: torch.Tensor) -> Callable[[], Any]:
        return lambda: pg.allreduce([t], opts).wait()

    if generation == "inline_off":
        return {"named_dataplane": lambda: hvd.allreduce_(one, name="lat", op=hvd.Sum), "raw_gloo": raw(one)}
    return {
        "named": lambda: hvd.allreduce_(one, name="lat", op=hvd.Sum),
        "unnamed": lambda: hvd.allreduce_(one, op=hvd.Sum),
        "barrier": hvd.barrier,
        "raw_gloo": raw(one),
        "named_4097": lambda: hvd.allreduce_(above, name="lat_4097", op=hvd.Sum),
        "raw_gloo_4097": raw(above),
    }


def burst(prefix: str, numel: int, n: int) -> tuple[int | None, float, float]:
    """One burst of ``n`` async allreduces (Horovod's default op, Average): (frames sent, seconds to
    submit them all, seconds until all are synchronized)."""
    hvd.barrier()  # start together; the barrier's own frame is counted before the burst
    frames = frames_sent()
    t0 = time.perf_counter()
    handles = [hvd.allreduce_async(torch.ones(numel) * i, name=f"{prefix}.{i}") for i in range(n)]
    submitted = time.perf_counter() - t0
    outs = [hvd.synchronize(h) for h in handles]
    seconds = time.perf_counter() - t0
    sent = frames_since(frames)
    wrong = [i for i, o in enumerate(outs) if not torch.all(o == i)]
    if wrong:
        raise AssertionError(f"burst {prefix}: wrong averages for ops {wrong[:5]}")
    return sent, submitted, seconds


def mismatch_once() -> tuple[float, str]:
    """Rank r allreduces shape [r + 1]: seconds from the call to the RuntimeError, and its text."""
    t = torch.zeros(hvd.rank() + 1)
    hvd.barrier()
    t0 = time.perf_counter()
    try:
        hvd.allreduce_(t, name="mismatch", op=hvd.Sum)
    except RuntimeError as e:
        return time.perf_counter() - t0, str(e)
    raise AssertionError("a mismatched-shape allreduce returned instead of raising")


def generation(name: str, rnd: int, args: argparse.Namespace, pg, opts, local: Local) -> dict[str, Any]:
    """One gpucomm generation of one round: init with its inline setting, measure, shut down."""
    os.environ[INLINE_ENV] = "0" if name == "inline_off" else str(args.default_inline)
    hvd.init()
    config = control_config()
    variants = latency_variants(name, pg, opts)
    for fn in variants.values():  # warm-up: caches filled, Gloo pairs connected
        for _ in range(args.warmup):
            fn()
    order = list(variants)
    k = rnd % len(order)
    for v in order[k:] + order[:k]:
        hvd.barrier()
        total, per, frames = run_block(variants[v], args.iters)
        local.blocks.setdefault(v, []).append(total)
        local.ops.setdefault(v, []).extend(per)
        if frames is not None:
            local.frames.setdefault(v, []).append(frames)
    kinds = [("inline_off_1", "burst", 1)] if name == "inline_off" else \
        [("inline_1", "burst", 1), ("dataplane_5000", f"burst{BURST_DATAPLANE_NUMEL}", BURST_DATAPLANE_NUMEL)]
    for kind, prefix, numel in kinds:
        for rep in range(1 + args.burst_repeats):  # the first one is not cached yet in this generation
            frames, submitted, seconds = burst(prefix, numel, args.burst_ops)
            local.bursts.setdefault(kind, []).append({"cached": rep > 0, "frames": frames, "submit_s": submitted,
                                                      "seconds": seconds})
    if name == "default" and hvd.size() > 1:
        for _ in range(args.mismatch_repeats):
            seconds, text = mismatch_once()
            local.mismatch.append(seconds)
            local.mismatch_errors.append(text)
        hvd.barrier()
    hvd.shutdown()
    return config


def summarize(every: list[Local], args: argparse.Namespace) -> dict[str, Any]:
    """Job-level numbers from every rank's measurements (the slowest rank, op by op and block by block);
    a figure with no measurements behind it is None."""
    latency = {v: latency_summary(every, v, args.iters) for v in VARIANTS}
    ratios = {}
    for v, (_, ref) in VARIANTS.items():
        if ref is not None:
            ratios[v] = {"vs": ref, "loop_avg": ratio(latency[v]["loop_avg_us"], latency[ref]["loop_avg_us"]),
                         "median": ratio(latency[v]["median_us"], latency[ref]["median_us"])}
    bursts = {kind: burst_summary(every, kind) for kind in BURSTS}
    notes = []
    if all(not r.frames for r in every):
        notes.append("control rounds n/a: a 1-rank job has no control plane (gpucomm runs its collectives inline)")
    return {"latency": latency, "ratios": ratios, "bursts": bursts, "mismatch": mismatch_summary(every, args),
            "notes": notes}


def slowest(every: list[Local], series: Callable[[Local], list[float]]) -> list[float]:
    """Element-wise maximum over ranks of one series (each rank measured the same count)."""
    n = min(len(series(r)) for r in every)
    return [max(series(r)[i] for r in every) for i in range(n)]


def latency_summary(every: list[Local], v: str, iters: int) -> dict[str, Any]:
    blocks = [b / iters for b in slowest(every, lambda r: r.blocks.get(v, []))]
    ops = sorted(slowest(every, lambda r: r.ops.get(v, [])))
    frames = [f / iters for f in slowest(every, lambda r: r.frames.get(v, []))]
    return {"generation": VARIANTS[v][0], "blocks": len(blocks), "ops": len(ops),
            "loop_avg_us": scaled(median(blocks), 1e6), "loop_avg_blocks_us": [b * 1e6 for b in blocks],
            "median_us": scaled(median(ops), 1e6), "p10_us": scaled(percentile(ops, 0.1), 1e6),
            "p90_us": scaled(percentile(ops, 0.9), 1e6), "control_rounds_per_op": median(frames)}


def burst_summary(every: list[Local], kind: str) -> dict[str, Any]:
    """Uncached and cached bursts of one kind, each run's figures the slowest rank's."""
    n = min(len(r.bursts.get(kind, [])) for r in every)
    runs = [[r.bursts[kind][i] for r in every] for i in range(n)]
    rows = [{"cached": rs[0]["cached"], "frames": max_or_none(x["frames"] for x in rs),
             "submit_s": max(x["submit_s"] for x in rs), "seconds": max(x["seconds"] for x in rs)} for rs in runs]
    out = {}
    for label, cached in (("uncached", False), ("cached", True)):
        sel = [x for x in rows if x["cached"] == cached]
        counted = [x["frames"] for x in sel if x["frames"] is not None]
        if sel:
            out[label] = {"bursts": len(sel), "rounds_median": median(counted),
                          "rounds_max": max(counted, default=None), "rounds_all": [x["frames"] for x in sel],
                          "ms_median": scaled(median(x["seconds"] for x in sel), 1e3),
                          "submit_ms_median": scaled(median(x["submit_s"] for x in sel), 1e3),
                          "submit_ms_all": [x["submit_s"] * 1e3 for x in sel]}
    return out


def max_or_none(values: Iterable[int | None]) -> int | None:
    """The largest value, or None when any is None (not counted on some rank)."""
    values = list(values)
    return None if None in values else max(values)


def mismatch_summary(every: list[Local], args: argparse.Namespace) -> dict[str, Any]:
    per_rank = [{"rank": i, "median_ms": scaled(median(r.mismatch), 1e3), "max_ms": max(r.mismatch) * 1e3}
                for i, r in enumerate(every) if r.mismatch]
    not_measured = None
    if len(every) < 2:
        not_measured = "a shape mismatch needs at least 2 ranks"
    elif args.mismatch_repeats == 0:
        not_measured = "--mismatch-repeats 0"
    return {"repeats": len(every[0].mismatch), "per_rank": per_rank, "not_measured": not_measured,
            "error": every[0].mismatch_errors[0] if every[0].mismatch_errors else None,
            "all_errors_name_shapes": all("shape" in e.lower() for r in every for e in r.mismatch_errors)}


def table(result: dict[str, Any]) -> list[str]:
    a = result["args"]
    gen = result["generations"]
    lines = [f"# control plane on {result['ranks']} CPU ranks: {a['rounds']} interleaved rounds x {a['iters']} ops per "
             f"variant; inline limit {fmt(gen['default']['inline_bytes'])} B (the named_dataplane "
             f"generation: {fmt(gen['inline_off']['inline_bytes'])} B); cycle time "
             f"{fmt(gen['default']['cycle_time_ms'], 'g')} ms; load average (1 min) "
             f"{result['loadavg_1min']['before']:.2f} before, {result['loadavg_1min']['after']:.2f} after",
             "# latency of one allreduce of 1 x float32 (4097 for *_4097), slowest rank; loop avg = block time / ops",
             f"{'variant':>16} {'loop avg us':>11} {'median us':>10} {'p10':>8} {'p90':>8} {'rounds/op':>9} "
             f"{'vs':>14} {'ratio avg':>9} {'ratio med':>9}"]
    for v, s in result["latency"].items():
        r = result["ratios"].get(v)
        tail = (f"{r['vs']:>14} {fmt(r['loop_avg'], '.2f'):>9} {fmt(r['median'], '.2f'):>9}" if r
                else f"{'':>14} {'':>9} {'':>9}")
        lines.append(f"{v:>16} {fmt(s['loop_avg_us'], '.1f'):>11} {fmt(s['median_us'], '.1f'):>10} "
                     f"{fmt(s['p10_us'], '.1f'):>8} {fmt(s['p90_us'], '.1f'):>8} "
                     f"{fmt(s['control_rounds_per_op'], '.3f'):>9} {tail}")
    lines.append(f"# burst of {a['burst_ops']} async allreduces then synchronize: control rounds (request frames, "
                 "max over ranks)")
    lines.append(f"{'burst':>16} {'uncached':>9} {'cached med':>10} {'cached max':>10} {'uncached ms':>11} "
                 f"{'cached ms':>9} {'submit ms':>9}")
    for kind, b in result["bursts"].items():
        u, c = b.get("uncached", {}), b.get("cached", {})
        lines.append(f"{kind:>16} {fmt(u.get('rounds_median'), 'g'):>9} {fmt(c.get('rounds_median'), 'g'):>10} "
                     f"{fmt(c.get('rounds_max'), 'g'):>10} {fmt(u.get('ms_median'), '.2f'):>11} "
                     f"{fmt(c.get('ms_median'), '.2f'):>9} {fmt(c.get('submit_ms_median'), '.2f'):>9}")
    lines += mismatch_lines(result["mismatch"])
    lines += [f"# note: {n}" for n in result.get("notes", [])]
    return lines


def mismatch_lines(m: dict[str, Any]) -> list[str]:
    if m.get("not_measured"):
        return [f"# mismatched shapes: not measured ({m['not_measured']})"]
    if not m["per_rank"]:
        return ["# mismatched shapes: n/a (no rank recorded a mismatch)"]
    per = ", ".join(f"rank {p['rank']} {fmt(p['median_ms'], '.2f')} ms (max {p['max_ms']:.2f})" for p in m["per_rank"])
    return [f"# mismatched shapes ([r + 1] on rank r), call to RuntimeError, median of {m['repeats']}: {per}",
            f"#   error: {m['error']}"]


def in_job(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    args.default_inline = os.environ.get(INLINE_ENV, "").strip() or str(16 << 10)
    hvd.init()
    pg, store = raw_gloo_group()
    opts = torch.distributed.AllreduceOptions()
    opts.reduceOp = torch.distributed.ReduceOp.SUM
    hvd.shutdown()
    local, generations = Local(), {}
    load_before = os.getloadavg()  # other work on the machine shows in the tails: recorded beside them
    for rnd in range(args.rounds):
        for name in (("default", "inline_off") if rnd % 2 == 0 else ("inline_off", "default")):
            generations[name] = generation(name, rnd, args, pg, opts, local)
    os.environ[INLINE_ENV] = args.default_inline
    hvd.init()
    every = hvd.allgather_object(local, name="control_plane.results")
    if hvd.rank() == 0:
        result = {"benchmark": "control_plane", "ranks": hvd.size(), "torch": torch.__version__,
                  "gpucomm": gpucomm.__version__, "threads_per_rank": torch.get_num_threads(),
                  "loadavg_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
                  "generations": generations, "args": {k: v for k, v in vars(args).items() if k != "default_inline"},
                  **summarize(every, args)}
        print("\n".join(table(result)))
        write_json(args.json, result)
        print(f"wrote {args.json}")
    hvd.barrier()
    del pg, store
    hvd.shutdown()


# ---------------------------------------------------------------------------------------------- --mismatch-exit


def _watch_ranks(launcher: subprocess.Popen, script: str, deadline: float) -> dict[int, float]:
    """Poll the launcher's process tree: pid -> wall time at which each rank process was seen gone."""
    import psutil  # noqa: PLC0415  (a test dependency; only this mode needs it)

    seen: dict[int, psutil.Process] = {}
    gone: dict[int, float] = {}
    try:
        root = psutil.Process(launcher.pid)
    except psutil.NoSuchProcess:
        return gone
    while time.monotonic() < deadline:
        try:
            for child in root.children(recursive=True):
                if child.pid not in seen:
                    try:
                        if any(script in part for part in child.cmdline()):
                            seen[child.pid] = child
                    except psutil.Error:
                        pass
        except psutil.Error:
            pass
        for pid, proc in seen.items():
            if pid in gone:
                continue
            try:
                alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                alive = False
            if not alive:
                gone[pid] = time.time()
        if launcher.poll() is not None:
            now = time.time()
            for pid in seen:
                gone.setdefault(pid, now)
            return gone
        time.sleep(0.005)
    return gone


def launch_mismatch(np_: int, timeout: float) -> dict[str, Any]:
    """One gpucomm-run of mismatch_exit.py; wall-clock times of the call and of every exit."""
    script = os.path.join(ROOT, "benchmarks", "mismatch_exit.py")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "gpucomm.runner", "-np", str(np_), sys.executable, script]
    out: dict[str, str] = {}
    t_launch = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    reader = threading.Thread(target=lambda: out.update(zip(("stdout", "stderr"), proc.communicate())), daemon=True)
    reader.start()
    try:
        gone = _watch_ranks(proc, "mismatch_exit.py", time.monotonic() + timeout)
    except KeyboardInterrupt:  # the job runs in its own session: Ctrl-C did not reach it
        stop_group(proc)
        raise
    hung = proc.poll() is None
    if hung:
        stop_group(proc)
    proc.wait()
    t_end = time.time()
    reader.join(10)
    stdout, stderr = out.get("stdout", ""), out.get("stderr", "")
    calls = {int(r): float(t) for r, t in re.findall(r"^\[(\d+)\]<stdout>:MISMATCH_CALL (\S+) pid=\d+", stdout, re.M)}
    pids = {int(p): int(r) for r, p in re.findall(r"^\[(\d+)\]<stdout>:MISMATCH_CALL \S+ pid=(\d+)", stdout, re.M)}
    exits = {int(r): float(t) for r, t in re.findall(r"^\[(\d+)\]<stdout>:RANK_EXIT (\S+)", stdout, re.M)}
    errored = sorted({int(r) for r in re.findall(r"^\[(\d+)\]<stderr>:\S*CollectiveError: Mismatched ALLREDUCE",
                                                 stderr, re.M)})
    process_end = {pids[pid]: t for pid, t in gone.items() if pid in pids}
    call = min(calls.values()) if calls else None
    return {
        "returncode": proc.returncode, "hung": hung, "ranks_called": sorted(calls), "ranks_with_error": errored,
        "launch_to_call_s": call - t_launch if call else None,
        "launch_to_all_ranks_exited_s": max(process_end.values()) - t_launch if len(process_end) == np_ else None,
        "launch_to_launcher_exit_s": t_end - t_launch,
        "call_to_rank_exit_hook_s": {r: exits[r] - calls[r] for r in sorted(exits) if r in calls},
        "call_to_rank_process_end_s": {r: process_end[r] - calls[r] for r in sorted(process_end) if r in calls},
        "call_to_launcher_exit_s": t_end - call if call else None,
        "not_reached": "NOT_REACHED" in stdout,
        "stderr_tail": stderr[-2000:] if (hung or len(errored) < np_) else "",
    }


def mismatch_exit(args: argparse.Namespace) -> None:
    if os.environ.get("GPUCOMM_RANK") or os.environ.get("RANK"):
        raise SystemExit("--mismatch-exit launches its own gpucomm-run job: run it with plain python, not under "
                         "a launcher")
    runs: list[dict[str, Any]] = []
    interrupted = False
    try:
        for _ in range(args.exit_repeats):
            runs.append(launch_mismatch(args.np, args.launch_timeout))
    except KeyboardInterrupt:
        interrupted = True
    result = exit_summary(runs, args)
    result["interrupted"] = interrupted
    print("\n".join(exit_table(result)))
    write_json(args.json, result)
    print(f"wrote {args.json}")
    if interrupted:
        raise SystemExit(130)
    if not result["ok"]:
        raise SystemExit(1)


def exit_summary(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The verdict and medians over the launches that finished (None where there are none)."""
    def med(key: str) -> float | None:
        return median(r[key] for r in runs if r[key] is not None)

    # a launch where some rank was never seen ending counts as never ending (None: no bound)
    worst = [max(r["call_to_rank_process_end_s"].values()) if len(r["call_to_rank_process_end_s"]) == args.np
             else None for r in runs]
    ended = [w for w in worst if w is not None]
    ok = bool(runs) and all(not r["hung"] and r["returncode"] != 0 and r["ranks_with_error"] == list(range(args.np))
                            and len(r["call_to_rank_process_end_s"]) == args.np and not r["not_reached"]
                            for r in runs) \
        and len(ended) == len(runs) and max(ended) < args.exit_limit
    return {"benchmark": "mismatch_exit", "ranks": args.np, "launches": len(runs), "limit_s": args.exit_limit,
            "ok": ok, "launch_to_all_ranks_exited_s_median": med("launch_to_all_ranks_exited_s"),
            "launch_to_launcher_exit_s_median": med("launch_to_launcher_exit_s"),
            "call_to_last_rank_exit_s_median": median(ended) if len(ended) == len(runs) else None,
            "call_to_last_rank_exit_s_max": max(ended) if ended and len(ended) == len(runs) else None,
            "call_to_launcher_exit_s_median": med("call_to_launcher_exit_s"), "runs": runs}


def exit_table(result: dict[str, Any]) -> list[str]:
    runs, limit = result["runs"], result["limit_s"]
    lines = [f"# mismatched allreduce left uncaught, {result['ranks']} ranks under gpucomm-run, {len(runs)} launches "
             "(wall clock, time.time())",
             f"{'launch':>6} {'rc':>3} {'ranks w/ error':>14} {'launch->call s':>14} {'launch->ranks gone s':>20} "
             f"{'call->last atexit s':>19} {'call->rank exit s (each rank)':>30} {'call->launcher exit s':>21}"]
    for i, r in enumerate(runs):
        each = " ".join(f"{t:.3f}" for t in r["call_to_rank_process_end_s"].values()) or "-"
        hook = max(r["call_to_rank_exit_hook_s"].values(), default=None)
        lines.append(f"{i:>6} {r['returncode']:>3} {str(r['ranks_with_error']):>14} "
                     f"{fmt(r['launch_to_call_s'], '.3f'):>14} {fmt(r['launch_to_all_ranks_exited_s'], '.3f'):>20} "
                     f"{fmt(hook, '.3f'):>19} {each:>30} {fmt(r['call_to_launcher_exit_s'], '.3f'):>21}")
    if not runs:
        lines.append("no launch finished: n/a")
    lines.append(f"every rank raised the error and exited within {limit:g} s of the call: "
                 f"{'yes' if result['ok'] else 'NO'} (slowest rank: median "
                 f"{fmt(result['call_to_last_rank_exit_s_median'], '.3f')} s, "
                 f"max {fmt(result['call_to_last_rank_exit_s_max'], '.3f')} s)")
    if result.get("interrupted"):
        lines.append(f"interrupted: {len(runs)} launch(es) finished before Ctrl-C")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.mismatch_exit:
        mismatch_exit(args)
    else:
        in_job(args)


if __name__ == "__main__":
    main()
