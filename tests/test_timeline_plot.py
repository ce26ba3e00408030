"""The timeline picture stays readable for a real model: the default (summary) view draws one lane
per phase and per fusion bucket and lists the busiest ops, whatever the number of tensors; the
per-tensor view (one row per op name) stays available."""

from __future__ import annotations

import json

import pytest

from gpucomm.timeline import Timeline
from gpucomm.timeline.cli import _parse_args, main
from gpucomm.timeline.plot import render
from gpucomm.timeline.summary import MAX_LANES, phase_of

N_TENSORS = 161  # ResNet-50's gradient tensors
N_BUCKETS = 6
STEPS = 3
STEP_US = 100_000
MAX_WIDTH_PX, MAX_HEIGHT_PX = 2000, 2500


def _write_resnet_like(path: str) -> dict[str, float]:
    """A ResNet-50-sized trace through the real writer: per step a backward pass, 161 per-tensor
    allreduces (negotiation with 2 rank ticks, QUEUE, NCCL_ALLREDUCE), 6 fusion buckets (pack,
    negotiate, allreduce, unpack), an inline coordinator reduce and an op with an unknown label.
    Returns each name's busy time (ms): its spans never overlap, so durations add up."""
    busy: dict[str, float] = {}

    def spent(name: str, us: float) -> None:
        busy[name] = busy.get(name, 0.0) + us / 1000.0

    with Timeline(path, mark_cycles=True) as tl:
        for step in range(STEPS):
            t = step * STEP_US
            tl.mark_cycle(t)
            tl.span("DistributedOptimizer.backward", "BACKWARD", t, t + 60_000)
            for k in range(N_TENSORS):
                _allreduce(tl, f"allreduce.param.{k:03d}", t + 300 * k, 100 + 3 * k, spent)
            for b in range(N_BUCKETS):
                name, s = f"DistributedOptimizer.bucket.{b}", t + 5_000 + 10_000 * b
                tl.span(name, "MEMCPY_IN_FUSION_BUFFER", s, s + 200)
                _allreduce(tl, name, s + 200, 2_000 + 500 * b, spent)
                tl.span(name, "MEMCPY_OUT_FUSION_BUFFER", t + 80_000 + 300 * b, t + 80_200 + 300 * b)
                spent(name, 400)
            tl.op_start("allreduce.metric", "allreduce", t + 90_000)  # as Tracer.inline_op writes it
            tl.span("allreduce.metric", "COORDINATOR_REDUCE", t + 90_000, t + 90_000)
            tl.op_end("allreduce.metric", "float32", [1], t + 90_000)
            tl.span("custom.op", "MYSTERY_PHASE", t + 95_000, t + 95_100)
            spent("custom.op", 100)
    return busy


def _allreduce(tl: Timeline, name: str, start: float, op_us: float, spent) -> None:
    """Negotiation [start, start+50] with ticks from ranks 0 and 1, then the op with QUEUE (10 µs)
    and NCCL_ALLREDUCE inside, from start+50 for ``op_us``."""
    tl.negotiate_start(name, "allreduce", start)
    tl.negotiate_rank_ready(name, 0, start + 10)
    tl.negotiate_rank_ready(name, 1, start + 40)
    tl.negotiate_end(name, start + 50)
    tl.op_start(name, "allreduce", start + 50)
    tl.activity_start(name, "QUEUE", start + 50)
    tl.activity_end(name, start + 60)
    tl.activity_start(name, "NCCL_ALLREDUCE", start + 60)
    tl.activity_end(name, start + 50 + op_us)
    tl.op_end(name, "float32", [64, 64], start + 50 + op_us)
    spent(name, 50 + op_us)


@pytest.fixture(scope="module")
def resnet_trace(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("timeline") / "resnet.json")
    return path, _write_resnet_like(path)


@pytest.fixture(scope="module")
def summary_render(resnet_trace, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("png") / "summary.png")
    return render(resnet_trace[0], out, title="ResNet-50-like, 161 tensors")


def _assert_sane_png(summary: dict) -> None:
    width, height = summary["image_px"]
    assert 600 <= width <= MAX_WIDTH_PX and 300 <= height <= MAX_HEIGHT_PX, summary["image_px"]
    with open(summary["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_default_view_summarises_161_tensors_in_few_lanes(summary_render):
    s = summary_render
    assert s["view"] == "summary"
    assert s["n_names"] == N_TENSORS + N_BUCKETS + 3  # + backward, metric, custom.op
    assert s["n_rows"] == len(s["rows"]) <= MAX_LANES
    assert s["rows"] == ["backward pass", "pack", "negotiate", "op in flight", "wait / queue", "collective",
                         "coordinator reduce", "unpack", "other"] + [f"bucket {b}" for b in range(N_BUCKETS)]
    _assert_sane_png(s)
    assert s["min_font_px"] >= 9, s["min_font_px"]


def test_png_size_matches_what_render_reports(summary_render):
    import matplotlib.image

    height, width = matplotlib.image.imread(summary_render["png"]).shape[:2]
    assert (width, height) == tuple(summary_render["image_px"])


def test_the_busiest_ops_are_named_with_their_time(summary_render, resnet_trace):
    busy = resnet_trace[1]
    expected = sorted(busy, key=lambda name: (-busy[name], name))[:10]
    top = summary_render["top"]
    assert [t["name"] for t in top] == expected
    for t in top:
        assert t["busy_ms"] == pytest.approx(busy[t["name"]], abs=0.01)
        assert t["n_ops"] == STEPS
        line = next((label for label in summary_render["labels"] if t["name"] in label), None)
        assert line is not None, f"{t['name']} is not labelled in the picture"
        assert f"{t['busy_ms']:.3f} ms" in line
    assert "DistributedOptimizer.backward" not in [t["name"] for t in top]  # a reference, not an op


def test_per_tensor_view_keeps_one_row_per_name(resnet_trace, tmp_path):
    s = render(resnet_trace[0], str(tmp_path / "tensors.png"), view="tensors")
    assert s["view"] == "tensors" and s["n_hidden_rows"] == 0
    assert s["n_rows"] == s["n_names"] == len(set(s["rows"])) == N_TENSORS + N_BUCKETS + 3
    assert "allreduce.param.160" in s["rows"] and "DistributedOptimizer.bucket.5" in s["rows"]
    assert s["min_font_px"] >= 9


def test_summary_height_does_not_grow_with_the_tensor_count(summary_render, tmp_path):
    path = str(tmp_path / "small.json")
    _write_small(path)
    small = render(path, str(tmp_path / "small.png"))
    assert small["n_rows"] == 5 and small["image_px"][1] <= summary_render["image_px"][1]


def test_many_buckets_share_lanes_and_stay_under_the_limit(tmp_path):
    records = []
    for b in range(200):
        pid = b + 1
        records += [{"name": "process_name", "ph": "M", "pid": pid,
                     "args": {"name": f"DistributedOptimizer.bucket.{b}"}},
                    {"ph": "B", "name": "ALLREDUCE", "ts": 10 * b, "pid": pid},
                    {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": 10 * b + 1, "pid": pid},
                    {"ph": "E", "ts": 10 * b + 8, "pid": pid}, {"ph": "E", "ts": 10 * b + 9, "pid": pid}]
    path = tmp_path / "buckets.json"
    path.write_text(json.dumps(records))
    s = render(str(path), str(tmp_path / "buckets.png"))
    assert s["n_rows"] <= MAX_LANES
    buckets = [r for r in s["rows"] if r.startswith("bucket")]
    assert buckets[0] == "buckets 0-3" and buckets[-1] == "buckets 196-199" and len(buckets) == 50
    _assert_sane_png(s)
    assert s["min_font_px"] >= 9


def test_unknown_labels_go_to_the_other_lane(tmp_path):
    records = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "weird"}},
               {"ph": "B", "name": "SOMETHING_NEW", "ts": 0, "pid": 1},
               {"ph": "B", "name": 42, "ts": 1, "pid": 1},  # not even a string
               {"ph": "E", "ts": 2, "pid": 1}, {"ph": "E", "ts": 3, "pid": 1},
               {"ph": "X", "name": "", "ts": 5, "dur": 4, "pid": 2}]
    path = tmp_path / "weird.json"
    path.write_text(json.dumps(records))
    s = render(str(path), str(tmp_path / "weird.png"))
    assert s["rows"] == ["other"] and s["n_names"] == 2
    assert [t["name"] for t in s["top"]] == ["pid 2", "weird"]  # busy 4 µs, then 3 µs
    assert phase_of("NCCL_ALLGATHER") == "collective" and phase_of("GLOO_BROADCAST") == "collective"
    assert phase_of("NEGOTIATE_BROADCAST") == "negotiate" and phase_of("ALLREDUCE") == "op"


def test_a_file_still_being_written_renders(resnet_trace, tmp_path):
    text = open(resnet_trace[0]).read()
    cut = text.index('"NCCL_ALLREDUCE"', len(text) // 2) + 5  # mid-record, no closing "]"
    path = tmp_path / "partial.json"
    path.write_text(text[:cut])
    s = render(str(path), str(tmp_path / "partial.png"))
    assert s["open_spans"] > 0 and s["n_rows"] <= MAX_LANES and s["min_font_px"] >= 9
    _assert_sane_png(s)


def test_window_ranks_only_what_is_inside(resnet_trace, tmp_path):
    s = render(resnet_trace[0], str(tmp_path / "step.png"), window_ms=(95.0, 95.1))
    assert [t["name"] for t in s["top"]] == ["custom.op"]
    # the counts still cover the whole trace: per step 4 spans per tensor, 6 per bucket, backward,
    # the inline op's 2 and custom.op's 1
    assert s["n_spans"] == STEPS * (4 * N_TENSORS + 6 * N_BUCKETS + 1 + 2 + 1)


def test_render_rejects_an_unknown_view(resnet_trace, tmp_path):
    with pytest.raises(ValueError, match="view must be one of"):
        render(resnet_trace[0], str(tmp_path / "x.png"), view="rows")


def _write_small(path: str) -> None:
    with Timeline(path) as tl:
        tl.span("DistributedOptimizer.backward", "BACKWARD", 0, 1000)
        for k in range(5):
            _allreduce(tl, f"allreduce.param.{k}", 100 * k, 50, lambda *_: None)


@pytest.mark.parametrize("flags, drawn", [([], "5 lanes for 6 ops"), (["--per-tensor"], "6 rows")])
def test_cli_view_options(tmp_path, capsys, flags, drawn):
    path, out = str(tmp_path / "small.json"), tmp_path / "cli.png"
    _write_small(path)
    assert main([path, "-o", str(out), "--top", "3"] + flags) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"rendered {drawn}, 66 records (21 spans, 10 rank ticks)") and str(out) in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_view_flag_spells_the_same_choice():
    assert _parse_args(["t.json", "-o", "t.png", "--view", "tensors"]).view == "tensors"
    assert _parse_args(["t.json", "-o", "t.png", "--per-tensor"]).view == "tensors"
    assert _parse_args(["t.json", "-o", "t.png"]).view == "summary"
