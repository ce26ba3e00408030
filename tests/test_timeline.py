"""Timeline writer (Horovod's Chrome-trace format), renderer, overlap helper and CLI.

Real files in tmp_path and the real writer thread throughout; the disk-error case runs a child
process under a real file-size limit (RLIMIT_FSIZE), so the OS itself makes the write fail."""

from __future__ import annotations

import gc
import json
import importlib.util
import os
import sys
import textwrap
import threading
import time
from collections import Counter

import pytest

from gpucomm.timeline import GpuActivities, Timeline, dtype_name, main, shape_str
from gpucomm.timeline.plot import busy_ms, load_trace, overlap_ms, read_records, render
from tests.harness import PYTHON, Result, run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HANG_GUARD_S = 30.0  # how long a test waits for the writer thread before calling it stuck: never a measure


def _records(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _events(records: list[dict]) -> list[dict]:
    """The records after the two header records."""
    return records[2:]


def _pid_names(records: list[dict]) -> dict[int, str]:
    return {r["pid"]: r["args"]["name"] for r in records
            if r.get("ph") == "M" and r["name"] == "process_name" and "name" in r["args"]}


def _run(args: list[str]) -> Result:
    return run([PYTHON, *args], timeout=120)


@pytest.fixture
def timeline(tmp_path):
    tl = Timeline(str(tmp_path / "timeline.json"))
    yield tl
    tl.close()


# -- writer: format ------------------------------------------------------------------------------


def test_header_records_and_wall_clock_of_ts_zero(tmp_path):
    before_us = time.time_ns() // 1000
    tl = Timeline(str(tmp_path / "t.json"))
    after_us = time.time_ns() // 1000
    try:
        assert tl.flush()
        records = _records(tl.path)
        start = tl.start_time_since_epoch_us
        assert records == [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": start}},
            {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},
        ]
        assert before_us <= start <= after_us
        # ts is µs since that wall-clock instant: start + now_us() tracks the wall clock. Bracketed by
        # wall-clock reads, so a descheduled test cannot fail it; the 50 ms only absorbs the two clocks'
        # rate difference (NTP slew) and the constructor's gap between its two clock reads, itself at
        # most after_us - before_us.
        wall_before = time.time_ns() / 1000
        tracked = start + tl.now_us()
        wall_after = time.time_ns() / 1000
        assert wall_before - 50_000 <= tracked <= wall_after + (after_us - before_us) + 50_000
    finally:
        tl.close()


def test_each_name_gets_the_next_pid_with_name_and_sort_index(timeline):
    for name in ("allreduce.a", "broadcast.b", "allreduce.a", 'odd "name"\\x'):
        timeline.activity_start(name, "QUEUE", 1.0)
        timeline.activity_end(name, 2.0)
    assert timeline.flush()
    meta = [r for r in _events(_records(timeline.path)) if r["ph"] == "M"]
    assert meta == [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.a"}},
        {"name": "process_sort_index", "ph": "M", "pid": 1, "args": {"sort_index": 1}},
        {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "broadcast.b"}},
        {"name": "process_sort_index", "ph": "M", "pid": 2, "args": {"sort_index": 2}},
        {"name": "process_name", "ph": "M", "pid": 3, "args": {"name": 'odd "name"\\x'}},
        {"name": "process_sort_index", "ph": "M", "pid": 3, "args": {"sort_index": 3}},
    ]


def test_op_sequence_matches_horovods_records_exactly(timeline):
    name = "allreduce.test_allreduce"
    timeline.negotiate_start(name, "allreduce", 10)
    timeline.negotiate_rank_ready(name, 0, 11)
    timeline.negotiate_rank_ready(name, 1, 12.4)
    timeline.negotiate_end(name, 13)
    timeline.op_start(name, "allreduce", 14)
    timeline.activity_start(name, "QUEUE", 15)
    timeline.activity_end(name, 16)
    timeline.activity_start(name, "NCCL_ALLREDUCE", 16.6)
    timeline.activity_end(name, 20)
    timeline.op_end(name, "float32", "[17, 17]", 21)
    assert timeline.flush()
    events = [r for r in _events(_records(timeline.path)) if r["ph"] != "M"]
    assert events == [
        {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 10, "pid": 1},
        {"ph": "X", "name": "0", "ts": 11, "pid": 1, "dur": 0},
        {"ph": "X", "name": "1", "ts": 12, "pid": 1, "dur": 0},
        {"ph": "E", "ts": 13, "pid": 1},
        {"ph": "B", "name": "ALLREDUCE", "ts": 14, "pid": 1},
        {"ph": "B", "name": "QUEUE", "ts": 15, "pid": 1},
        {"ph": "E", "ts": 16, "pid": 1},
        {"ph": "B", "name": "NCCL_ALLREDUCE", "ts": 17, "pid": 1},
        {"ph": "E", "ts": 20, "pid": 1},
        {"ph": "E", "ts": 21, "pid": 1, "args": {"dtype": "float32", "shape": "[17, 17]"}},
    ]
    assert all(isinstance(e["ts"], int) for e in events)  # integer µs, as Horovod writes
    assert '"tid"' not in open(timeline.path).read()


def test_op_end_formats_torch_dtypes_and_sizes():
    torch = pytest.importorskip("torch")
    assert dtype_name(torch.float32) == "float32" and dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name("int64") == "int64"
    assert shape_str(torch.Size([17, 17])) == "[17, 17]" and shape_str(()) == "[]" and shape_str("[3]") == "[3]"


def test_default_timestamps_come_from_the_steady_clock(timeline):
    lo = timeline.now_us()
    timeline.op_start("allreduce.x", "allreduce")
    time.sleep(0.002)
    timeline.op_end("allreduce.x", "float16", [3])
    hi = timeline.now_us()
    assert timeline.flush()
    b, e = [r for r in _events(_records(timeline.path)) if r["ph"] in "BE"]
    assert lo - 1 <= b["ts"] <= e["ts"] <= hi + 1
    assert e["ts"] - b["ts"] >= 1900
    assert e["args"] == {"dtype": "float16", "shape": "[3]"}


def test_span_writes_a_pair_at_the_given_times(timeline):
    timeline.span("DistributedOptimizer.backward", "BACKWARD", 100.0, 2500.0, args={"step": 3})
    timeline.span("DistributedOptimizer.backward", "BACKWARD", 3000.0, 3100.0)
    assert timeline.flush()
    events = [r for r in _events(_records(timeline.path)) if r["ph"] != "M"]
    assert events == [
        {"ph": "B", "name": "BACKWARD", "ts": 100, "pid": 1, "args": {"step": 3}},
        {"ph": "E", "ts": 2500, "pid": 1},
        {"ph": "B", "name": "BACKWARD", "ts": 3000, "pid": 1},
        {"ph": "E", "ts": 3100, "pid": 1},
    ]


@pytest.mark.parametrize("mark_cycles", [True, False])
def test_cycle_markers_only_when_enabled(tmp_path, mark_cycles):
    with Timeline(str(tmp_path / "t.json"), mark_cycles=mark_cycles) as tl:
        tl.mark_cycle(5)
        tl.mark_cycle()
        tl.op_start("allreduce.x", "allreduce", 6)
        tl.op_end("allreduce.x", "float32", [1], 7)
    cycles = [r for r in _records(tl.path) if r.get("name") == "CYCLE_START"]
    if mark_cycles:
        assert cycles[0] == {"ph": "i", "name": "CYCLE_START", "ts": 5, "s": "g"}
        assert len(cycles) == 2 and "pid" not in cycles[1]
    else:
        assert cycles == []


def test_a_malformed_event_is_dropped_not_fatal(timeline, caplog):
    timeline.op_start("allreduce.x", "allreduce", float("nan"))  # round(nan) raises in the writer
    timeline.op_start("allreduce.y", "allreduce", 3)
    assert timeline.flush()
    records = _records(timeline.path)
    assert [r for r in _events(records) if r["ph"] == "B"] == [{"ph": "B", "name": "ALLREDUCE", "ts": 3, "pid": 1}]
    assert _pid_names(records) == {1: "allreduce.y"}  # the dropped event left no orphan row
    assert any("malformed event" in r.getMessage() for r in caplog.records)


# -- writer: file validity, flushing, threads ------------------------------------------------------


def test_file_is_valid_json_after_every_flush_while_open(timeline):
    for round_ in range(4):
        name = f"allreduce.r{round_}"
        timeline.op_start(name, "allreduce", 10 * round_)
        timeline.op_end(name, "float32", [round_], 10 * round_ + 5)
        assert timeline.flush()
        with open(timeline.path, "rb") as f:
            raw = f.read()
        assert raw.endswith(b"}\n]")
        records = json.loads(raw)
        assert len(records) == 2 + 4 * (round_ + 1)
        assert _pid_names(records)[round_ + 1] == name


def test_events_reach_the_file_without_flush(timeline):
    """The writer thread writes by itself (no flush(), no close()). How soon (about one 50 ms wake-up
    period) is measured by benchmarks/timeline_cost.py; the deadline here only stops a hang."""
    timeline.op_start("allreduce.test_allreduce", "allreduce")
    start = time.monotonic()
    while time.monotonic() - start < HANG_GUARD_S:
        if "allreduce.test_allreduce" in open(timeline.path).read():
            break
        time.sleep(0.01)
    else:
        pytest.fail(f"an event did not reach the file within {HANG_GUARD_S:g} s without flush(); "
                    "the writer thread is not writing periodically")
    assert json.loads(open(timeline.path).read())


def test_many_threads_give_valid_json_and_balanced_spans_per_pid(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), mark_cycles=True)
    n_threads, n_ops = 8, 400

    def worker(k: int) -> None:
        for i in range(n_ops):
            name = f"allreduce.t{k}.{i % 3}"
            tl.negotiate_start(name, "allreduce")
            tl.negotiate_rank_ready(name, k)
            tl.negotiate_end(name)
            tl.op_start(name, "allreduce")
            tl.activity_start(name, "QUEUE")
            tl.activity_end(name)
            tl.activity_start(name, "NCCL_ALLREDUCE")
            tl.activity_end(name)
            tl.op_end(name, "float32", [i])
            tl.mark_cycle()
            if i % 97 == 0:
                assert tl.flush()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tl.close()
    records = _records(tl.path)
    names = _pid_names(records)
    assert sorted(names) == list(range(0 + 1, n_threads * 3 + 1))
    depth: dict[int, int] = {}
    last_ts: dict[int, int] = {}
    begins = 0
    for r in records:
        if r["ph"] not in ("B", "E"):
            continue
        pid = r["pid"]
        depth[pid] = depth.get(pid, 0) + (1 if r["ph"] == "B" else -1)
        assert depth[pid] >= 0, f"E without B on {names[pid]}"
        assert r["ts"] >= last_ts.get(pid, 0), "one thread's events on a pid went back in time"
        last_ts[pid] = r["ts"]
        begins += r["ph"] == "B"
    assert set(depth.values()) == {0}
    assert begins == n_threads * n_ops * 4
    assert sum(r["ph"] == "X" for r in records) == n_threads * n_ops
    assert sum(r.get("name") == "CYCLE_START" for r in records) == n_threads * n_ops


def test_close_is_idempotent_and_later_calls_are_ignored(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), mark_cycles=True)
    tl.op_start("allreduce.x", "allreduce", 1)
    tl.op_end("allreduce.x", "float32", [2], 2)
    tl.close()
    content = open(tl.path, "rb").read()
    assert tl.closed and len(_records(tl.path)) == 2 + 4
    tl.close()
    tl.negotiate_start("allreduce.y", "allreduce")
    tl.negotiate_rank_ready("allreduce.y", 0)
    tl.negotiate_end("allreduce.y")
    tl.op_start("allreduce.y", "allreduce")
    tl.activity_start("allreduce.y", "QUEUE")
    tl.activity_end("allreduce.y")
    tl.op_end("allreduce.y", "float32", [1])
    tl.span("b", "BACKWARD", 0, 1)
    tl.mark_cycle()
    assert tl.flush(timeout=0.5)
    tl.close()
    assert open(tl.path, "rb").read() == content
    assert not tl._queue  # ignored, not queued forever (the hot path would leak after close)
    assert not tl._thread.is_alive()


def test_missing_directory_is_reported_at_construction(tmp_path):
    path = tmp_path / "no_such_dir" / "t.json"
    with pytest.raises(OSError) as err:
        Timeline(str(path))
    assert str(path) in str(err.value) and "does not exist" in str(err.value)


def test_directory_as_path_is_reported_at_construction(tmp_path):
    with pytest.raises(OSError) as err:
        Timeline(str(tmp_path))
    assert str(tmp_path) in str(err.value) and "directory" in str(err.value)


def test_empty_path_is_a_value_error():
    with pytest.raises(ValueError, match="non-empty"):
        Timeline("")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_full_disk_at_construction_is_an_oserror():
    with pytest.raises(OSError, match="cannot write the timeline header to '/dev/full'"):
        Timeline("/dev/full")


_DISK_ERROR_CHILD = textwrap.dedent("""
    import json, logging, resource, signal, sys
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    from gpucomm.timeline import Timeline
    assert "matplotlib" not in sys.modules, "importing gpucomm.timeline imported matplotlib"
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # exceeding the limit -> EFBIG, not a kill
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    tl = Timeline(sys.argv[1])
    tl.op_start("allreduce.small", "allreduce", 1)
    tl.op_end("allreduce.small", "float32", [1], 2)
    print("first flush", tl.flush())
    for i in range(5000):
        tl.activity_start("allreduce.big", "NCCL_ALLREDUCE")
        tl.activity_end("allreduce.big")
    print("second flush", tl.flush(), "closed", tl.closed)
    tl.op_start("allreduce.after", "allreduce")  # must be a silent no-op
    tl.close()
    print("done")
""")


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE/SIGXFSZ semantics are Linux's")
def test_disk_error_in_writer_warns_once_keeps_valid_file_and_never_raises(tmp_path):
    # the child also checks that importing gpucomm.timeline leaves matplotlib unimported
    path = tmp_path / "t.json"
    proc = _run(["-c", _DISK_ERROR_CHILD, str(path)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["first flush True", "second flush False closed True", "done"]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("gpucomm.timeline:")]
    assert len(warnings) == 1 and "cannot write to the timeline file" in warnings[0], proc.stderr
    records = _records(path)  # cut back to the last complete write
    assert list(_pid_names(records).values()) == ["allreduce.small"]
    assert os.path.getsize(path) < 64 * 1024


def _profiled(fn) -> tuple[Counter, Counter]:
    """Run ``fn`` under ``sys.setprofile`` (this thread only) and count what it called: Python
    functions by name, and C functions (builtins: I/O, locks, formatting, clocks) by name. The cyclic
    garbage collector is paused meanwhile, so a finalizer of some other object it happens to collect
    (a suspended generator's close, say) is not counted as the code's own work."""
    python_calls: Counter = Counter()
    c_calls: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is not fn.__code__:
            python_calls[frame.f_code.co_name] += 1
        elif event == "c_call" and arg is not sys.setprofile:
            c_calls[arg.__name__] += 1

    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if was_enabled:
            gc.enable()
    return python_calls, c_calls


def test_writer_hot_path_only_enqueues(tmp_path):
    """An event call does two Python calls (the method and ``_put``), one clock read and one deque
    append: no formatting, no lock, no write. Counted, not timed (the time per call, beside a bare
    deque append, is benchmarks/timeline_cost.py's); the writer sleeps through the calls, and the
    file holds only its header until flush() wakes it."""
    n = 2_000
    with Timeline(str(tmp_path / "t.json"), flush_interval_s=3600) as tl:
        header_bytes = os.path.getsize(tl.path)

        def events():
            for _ in range(n):
                tl.activity_start("allreduce.x", "NCCL_ALLREDUCE")
                tl.activity_end("allreduce.x")

        python_calls, c_calls = _profiled(events)
        assert python_calls == Counter({"activity_start": n, "activity_end": n, "_put": 2 * n})
        assert c_calls == Counter({"perf_counter_ns": 2 * n, "append": 2 * n})
        assert os.path.getsize(tl.path) == header_bytes  # nothing written by the calls themselves
        assert tl.flush(timeout=30)
    assert len(_records(tl.path)) == 2 + 2 + 2 * n


# -- GPU activities --------------------------------------------------------------------------------


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda_available(), reason="checks the no-CUDA error; this machine has CUDA")
def test_gpu_activities_without_cuda_say_what_to_use_instead(timeline):
    pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match="needs a CUDA device.*activity_start/activity_end"):
        GpuActivities(timeline)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("reanchor_s", [5.0, 0.0])
def test_gpu_activities_time_real_cuda_work(tmp_path, reanchor_s):
    import torch

    tl = Timeline(str(tmp_path / "gpu.json"))
    gpu = GpuActivities(tl, reanchor_s=reanchor_s)
    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    names = ["allreduce.a", "allreduce.b"]  # a fused pair: identical activity records
    ops_started = tl.now_us()
    for _ in range(3):  # enqueued back to back: the host runs ahead of the GPU
        trace = gpu.trace(names, "allreduce")
        torch.cuda._sleep(1_000_000)  # ~0.5-1 ms of GPU time on current parts
        trace.step("QUEUE")
        y = x @ x
        trace.step("NCCL_ALLREDUCE")
        y.add_(1)
        trace.step("MEMCPY_OUT_FUSION_BUFFER")
        trace.submit("float32", x.shape)
    torch.cuda.synchronize()
    done = tl.now_us()
    gpu.close()
    tl.close()
    trace = load_trace(tl.path)
    for n in names:
        spans = [s for s in trace.spans if s.process == n]
        ops = sorted((s for s in spans if s.depth == 0), key=lambda s: s.start_us)
        acts = sorted((s for s in spans if s.depth == 1), key=lambda s: s.start_us)
        assert [s.label for s in ops] == ["ALLREDUCE"] * 3
        assert [s.label for s in acts] == ["QUEUE", "NCCL_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"] * 3
        for a, b in zip(ops, ops[1:]):  # the finalizer keeps the host-ahead ops from overlapping
            assert a.end_us <= b.start_us
        for a, b in zip(acts, acts[1:]):
            assert a.end_us <= b.start_us + 1  # integer µs rounding
        for k, op in enumerate(ops):
            assert all(op.start_us <= a.start_us <= a.end_us <= op.end_us for a in acts[3 * k:3 * k + 3])
        assert ops_started - 1 <= ops[0].start_us and ops[-1].end_us <= done + 200
        assert all(s.end_us - s.start_us > 50 for s in acts if s.label == "QUEUE")
    assert trace.open_spans == 0 and trace.unmatched_ends == 0
    assert all(r.get("ph") != "E" or r.get("args", {}).get("shape") in (None, "[2048, 2048]")
               for r in read_records(tl.path))


# -- renderer ------------------------------------------------------------------------------------


def _write_synthetic(path: str, *, close: bool = True, open_op: bool = False) -> Timeline:
    """3 allreduces (negotiation with 2 rank ticks, QUEUE + NCCL_ALLREDUCE) and a backward span,
    at known times (µs): op k runs [1000k + 100, 1000k + 900]."""
    tl = Timeline(path, mark_cycles=True)
    tl.span("DistributedOptimizer.backward", "BACKWARD", 0, 3000)
    for k in range(3):
        name, t = f"allreduce.w{k}", 1000 * k
        tl.mark_cycle(t)
        tl.negotiate_start(name, "allreduce", t + 10)
        tl.negotiate_rank_ready(name, 0, t + 20)
        tl.negotiate_rank_ready(name, 1, t + 30)
        tl.negotiate_end(name, t + 40)
        tl.op_start(name, "allreduce", t + 100)
        tl.activity_start(name, "QUEUE", t + 100)
        tl.activity_end(name, t + 200)
        tl.activity_start(name, "NCCL_ALLREDUCE", t + 200)
        tl.activity_end(name, t + 900)
        tl.op_end(name, "float32", [4], t + 900)
    if open_op:
        tl.op_start("allreduce.open", "allreduce", 3500)
        tl.activity_start("allreduce.open", "NCCL_ALLREDUCE", 3600)
    if close:
        tl.close()
    else:
        assert tl.flush()
    return tl


def _assert_png(path) -> None:
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == PNG_SIGNATURE and os.path.getsize(path) > 5000


@pytest.mark.parametrize("view, rows", [
    ("tensors", ["DistributedOptimizer.backward", "allreduce.w0", "allreduce.w1", "allreduce.w2"]),
    ("summary", ["backward pass", "negotiate", "op in flight", "wait / queue", "collective"])])
def test_render_draws_a_png_and_counts_what_it_drew(tmp_path, view, rows):
    trace_path = str(tmp_path / "t.json")
    _write_synthetic(trace_path)
    out = str(tmp_path / "t.png")
    summary = render(trace_path, out, title="synthetic", view=view)
    _assert_png(out)
    assert summary["rows"] == rows and summary["n_rows"] == len(rows)
    assert summary["spans"] == {"BACKWARD": 1, "NEGOTIATE_ALLREDUCE": 3, "ALLREDUCE": 3, "QUEUE": 3,
                                "NCCL_ALLREDUCE": 3}
    assert summary["n_spans"] == 13 and summary["n_markers"] == 6 and summary["n_instants"] == 3
    assert summary["n_records"] == 2 + (2 + 2) + 3 * (1 + 2 + 4 + 6)  # header, backward, 3 ops
    assert summary["open_spans"] == 0
    assert summary["time_range_ms"] == (0.0, 3.0)


def test_rows_follow_sort_index_and_depths_follow_nesting():
    records = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "late"}},
        {"name": "process_sort_index", "ph": "M", "pid": 1, "args": {"sort_index": 9}},
        {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "early"}},
        {"name": "process_sort_index", "ph": "M", "pid": 2, "args": {"sort_index": 1}},
        {"ph": "B", "name": "ALLREDUCE", "ts": 0, "pid": 1},
        {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": 5, "pid": 1},
        {"ph": "B", "name": "ALLGATHER", "ts": 1, "pid": 2},
        {"ph": "B", "name": "BROADCAST", "ts": 20, "pid": 2},  # the host's next op ...
        {"ph": "E", "ts": 2, "pid": 2},  # ... written before a finalizer's end of the first
        {"ph": "E", "ts": 7, "pid": 1},
        {"ph": "E", "ts": 9, "pid": 1},
        {"ph": "E", "ts": 25, "pid": 2},
        {"ph": "E", "ts": 26, "pid": 2},  # no open B: counted, not drawn
    ]
    trace = load_trace(records)
    assert [trace.name_of(p) for p in trace.rows()] == ["early", "late"]
    spans = {(s.process, s.label): (s.start_us, s.end_us, s.depth) for s in trace.spans}
    assert spans == {("late", "ALLREDUCE"): (0, 9, 0), ("late", "GLOO_ALLREDUCE"): (5, 7, 1),
                     ("early", "ALLGATHER"): (1, 2, 0), ("early", "BROADCAST"): (20, 25, 0)}
    assert trace.unmatched_ends == 1


@pytest.mark.parametrize("damage", ["no_bracket", "comma_bracket", "trailing_comma", "cut_record"])
def test_reader_accepts_a_file_that_is_still_being_written(tmp_path, damage):
    trace_path = str(tmp_path / "t.json")
    _write_synthetic(trace_path)
    text = open(trace_path).read()
    body = text.rstrip()[:-1].rstrip()  # without the closing "]"
    damaged = {"no_bracket": body, "comma_bracket": body + ",]", "trailing_comma": body + ",\n",
               "cut_record": body + ',\n{"ph": "B", "name": "NCCL_ALL'}[damage]
    with pytest.raises(json.JSONDecodeError):
        json.loads(damaged)
    (tmp_path / "d.json").write_text(damaged)
    assert read_records(str(tmp_path / "d.json")) == json.loads(text)


def test_render_an_open_trace_with_unfinished_ops(tmp_path):
    trace_path = str(tmp_path / "t.json")
    tl = _write_synthetic(trace_path, close=False, open_op=True)
    try:
        text = open(trace_path).read()
        (tmp_path / "open.json").write_text(text.rstrip()[:-1])  # as if caught mid-write
        out = str(tmp_path / "open.png")
        summary = render(str(tmp_path / "open.json"), out, view="tensors")
        _assert_png(out)
        assert summary["open_spans"] == 2 and summary["n_rows"] == 5
        assert summary["spans"]["NCCL_ALLREDUCE"] == 4 and summary["spans"]["ALLREDUCE"] == 4
        assert summary["time_range_ms"] == (0.0, 3.6)
        unfinished = [s for s in load_trace(str(tmp_path / "open.json")).spans if not s.closed]
        assert sorted((s.label, s.start_us, s.end_us) for s in unfinished) == [
            ("ALLREDUCE", 3500, 3600), ("NCCL_ALLREDUCE", 3600, 3600)]
    finally:
        tl.close()


def _training_trace(path: str, steps: int) -> None:
    """Per step: a cycle mark, a backward span, and 8 bucket allreduces with three activities each
    (33 spans, 67 records per step; 20 more: the header and 9 names' metadata): the trace
    benchmarks/timeline_cost.py renders, written by its own function."""
    spec = importlib.util.spec_from_file_location("timeline_cost", os.path.join(REPO, "benchmarks", "timeline_cost.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.BUCKETS == 8
    bench.write_training_trace(path, steps)


# Python calls one more record may cost a render: reading it, drawing its share of a collection. About 15
# today; one matplotlib artist per span (ax.add_patch of a Rectangle, then drawing it) costs some 700
# calls, about 340 per record, which this bound refuses.
RENDER_CALLS_PER_RECORD = 40


def test_render_work_grows_by_a_few_calls_per_record(tmp_path):
    """Drawing uses one collection per colour, so a larger trace costs a few Python calls more per
    record, not an artist per span. Counted over two trace sizes (the difference cancels the fixed
    cost of a figure); the render time of a 33k-record trace is benchmarks/timeline_cost.py's."""
    calls, summaries = [], []
    _training_trace(str(tmp_path / "warm.json"), 2)
    render(str(tmp_path / "warm.json"), str(tmp_path / "warm.png"))  # matplotlib's imports and set-up
    for steps in (100, 300):
        trace_path = str(tmp_path / f"steps{steps}.json")
        _training_trace(trace_path, steps)
        box = {}
        python_calls, _ = _profiled(lambda: box.update(render(trace_path, str(tmp_path / f"steps{steps}.png"))))
        calls.append(sum(python_calls.values()))
        summaries.append(box)
        assert box["n_spans"] == steps * (1 + 8 * 4) and box["n_records"] == 20 + steps * 67
    per_record = (calls[1] - calls[0]) / (summaries[1]["n_records"] - summaries[0]["n_records"])
    assert per_record < RENDER_CALLS_PER_RECORD, f"{per_record:.0f} Python calls per added record"
    zoom = render(str(tmp_path / "steps300.json"), str(tmp_path / "zoom.png"), window_ms=(0.0, 10.0))
    _assert_png(tmp_path / "zoom.png")
    assert zoom["n_spans"] == summaries[1]["n_spans"]  # the summary always covers the whole trace


def test_render_rejects_a_reversed_window(tmp_path):
    trace_path = str(tmp_path / "t.json")
    _write_synthetic(trace_path)
    with pytest.raises(ValueError, match="start <= end"):
        render(trace_path, str(tmp_path / "t.png"), window_ms=(2.0, 1.0))


def test_render_an_empty_timeline(tmp_path):
    path = str(tmp_path / "empty.json")
    Timeline(path).close()
    summary = render(path, str(tmp_path / "empty.png"))
    _assert_png(tmp_path / "empty.png")
    assert summary["n_rows"] == 0 and summary["n_records"] == 2 and summary["time_range_ms"] == (0.0, 0.0)


# -- overlap helper --------------------------------------------------------------------------------


@pytest.fixture
def overlap_trace(tmp_path):
    """Backward passes [1000, 5000] and [8000, 9000] µs; bucket NCCL activities [3500, 5500],
    [4500, 4800] (concurrent with the first) and [8500, 10000]."""
    path = str(tmp_path / "overlap.json")
    with Timeline(path) as tl:
        tl.span("DistributedOptimizer.backward", "BACKWARD", 1000, 5000)
        tl.span("DistributedOptimizer.backward", "BACKWARD", 8000, 9000)
        for name, op, act in (("DistributedOptimizer.bucket.0", (3000, 6000), (3500, 5500)),
                              ("DistributedOptimizer.bucket.1", (4400, 4900), (4500, 4800)),
                              ("DistributedOptimizer.bucket.0", (8400, 10100), (8500, 10000))):
            tl.op_start(name, "allreduce", op[0])
            tl.activity_start(name, "NCCL_ALLREDUCE", act[0])
            tl.activity_end(name, act[1])
            tl.op_end(name, "float32", [8], op[1])
    return path


def test_overlap_of_bucket_allreduces_with_backward(overlap_trace):
    trace = load_trace(overlap_trace)
    backward = "DistributedOptimizer.backward"
    nccl = ("DistributedOptimizer.bucket.*", "NCCL_ALLREDUCE")
    # [3500, 5000] + [8500, 9000]; bucket.1's [4500, 4800] lies inside and is not counted twice
    assert overlap_ms(trace, backward, nccl) == pytest.approx(2.0)
    assert overlap_ms(trace, nccl, backward) == pytest.approx(2.0)
    assert busy_ms(trace, nccl) == pytest.approx(2.0 + 1.5)
    assert busy_ms(trace, backward) == pytest.approx(5.0)
    # a bare process glob takes every label: op spans [3000, 6000] and [8400, 10100] too
    assert overlap_ms(overlap_trace, backward, "DistributedOptimizer.bucket.*") == pytest.approx(2.0 + 0.6)
    assert overlap_ms(trace, backward, ("DistributedOptimizer.bucket.1", "*")) == pytest.approx(0.5)
    assert overlap_ms(trace, backward, "no.such.op") == 0.0
    assert overlap_ms(trace, "DistributedOptimizer.bucket.0", "DistributedOptimizer.bucket.1") == pytest.approx(0.5)


# -- CLI -----------------------------------------------------------------------------------------


def test_cli_renders_and_prints_a_summary(tmp_path):
    trace_path = str(tmp_path / "t.json")
    _write_synthetic(trace_path)
    out = tmp_path / "cli.png"
    proc = _run(["-m", "gpucomm.timeline", trace_path, "-o", str(out), "--title", "CLI"])
    assert proc.returncode == 0, proc.stderr
    # the default (summary) view: phase lanes backward, negotiate, op, wait/queue, collective
    assert proc.stdout.startswith("rendered 5 lanes for 4 ops, 45 records (13 spans, 6 rank ticks), 3.000 ms")
    assert str(out) in proc.stdout
    _assert_png(out)


def test_cli_missing_file_exits_2_with_one_line(tmp_path):
    missing = str(tmp_path / "missing.json")
    proc = _run(["-m", "gpucomm.timeline", missing, "-o", str(tmp_path / "x.png")])
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and missing in lines[0] and lines[0].startswith("python -m gpucomm.timeline: error:")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("content", ["", "not json at all", '{"a": 1}', "[1, 2]"])
def test_cli_invalid_file_exits_2(tmp_path, capsys, content):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main([str(bad), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err
    assert not (tmp_path / "x.png").exists()


def test_cli_requires_an_output(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "t.json")])
    assert exc.value.code == 2 and "-o/--output" in capsys.readouterr().err


def test_the_gpu_timer_is_made_on_the_collectives_own_device(tmp_path, monkeypatch):
    """Issue 25, defect 9: the timeline's GPU timer was made with no device, on whichever GPU the
    tracing thread had current (the control thread's: GPU 0), not rank 0's. It now takes the
    collective's stream's device. (The GPU test of this needs two GPUs.)"""
    import torch

    from gpucomm.timeline import tracer as tracer_module

    made: list = []

    class FakeActivities:
        def __init__(self, timeline, device=None, **_):
            made.append(device)

        def trace(self, name, kind, stream=None):
            return (name, kind, stream)

        def close(self):
            pass

    class Stream:
        device = torch.device("cuda", 1)

    monkeypatch.setattr(tracer_module, "GpuActivities", FakeActivities)
    tracer = tracer_module.Tracer(str(tmp_path / "timeline.json"))
    try:
        tracer.gpu_op("allreduce.x", "allreduce", Stream())
        tracer.gpu_op("allreduce.y", "allreduce", Stream())
    finally:
        tracer.close()
    assert made == [torch.device("cuda", 1)]  # made once, on the stream's GPU


# -- the cost figures, measured where a time may vary -------------------------------------------------


def _numbers(doc, where: str = "") -> list[tuple[str, float]]:
    """Every number in ``doc`` with its path (the strict parse above already refused NaN and infinities)."""
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in _numbers(v, f"{where}.{k}")]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in _numbers(v, f"{where}[{i}]")]
    return [(where, doc)] if isinstance(doc, (int, float)) and not isinstance(doc, bool) else []


def test_timeline_cost_benchmark_reports_each_figure_beside_its_anchor(tmp_path):
    """benchmarks/timeline_cost.py holds the times these tests no longer bound. Its smoke run is
    checked for what it measured and printed, never for how long anything took."""
    out = tmp_path / "timeline_cost.json"
    r = _run([os.path.join(REPO, "benchmarks", "timeline_cost.py"), "--quick", "--calls", "200", "--rounds", "2",
              "--latency-rounds", "2", "--steps", "3", "--json", str(out)])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for prefix in ("hot path: ", "event to file without flush(): ", "render of 221 records (99 spans): "):
        assert any(line.startswith(prefix) for line in lines), (prefix, r.stdout)
    doc = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    hot, latency, rendered = doc["hot_path"], doc["latency"], doc["render"]
    assert hot["event_calls_per_round"] == 200 and len(hot["us_per_call"]) == len(hot["floor_us_per_call"]) == 2
    assert len(latency["ms"]) == 2 and latency["flush_interval_ms"] == 50.0
    assert (rendered["n_records"], rendered["n_spans"], len(rendered["render_s"]), len(rendered["parse_s"])) == \
        (221, 99, 1, 1)
    assert [p for p, v in _numbers(doc) if v < 0] == []
