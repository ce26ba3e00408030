"""benchmarks/collectives.py, the pieces without a job: nccl-tests' sizes and bus-bandwidth factors,
exact inputs, the #wrong check, and a summary that never fails on empty or 1-rank tables. The sweep
itself runs at 1 and 2 ranks in tests/test_benchmarks_smoke.py."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from tests.harness import PYTHON, ROOT, run


def _load_bench():
    spec = importlib.util.spec_from_file_location("collectives_bench", ROOT / "benchmarks" / "collectives.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_bench()

# -- the pieces, without a job ----------------------------------------------------------------


def test_layout_and_factors_follow_nccl_tests():
    # 4 ranks, 1 MiB of floats (262144 elements)
    assert bench.layout("allreduce", 1 << 20, 4, 4) == bench.Layout(262144, 262144, 262144, 0, 0)
    assert bench.layout("allgather", 1 << 20, 4, 4) == bench.Layout(65536, 262144, 65536, 65536, 0)
    assert bench.layout("reducescatter", 1 << 20, 4, 4) == bench.Layout(262144, 65536, 65536, 0, 65536)
    assert bench.layout("alltoall", 1 << 20, 4, 4) == bench.Layout(262144, 262144, 65536, 0, 0)
    assert [bench.busbw_factor(c, 8) for c in ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast")] \
        == [1.75, 0.875, 0.875, 0.875, 1.0]
    # algbw counts the whole buffer: allgather of 65536 floats per rank on 4 ranks in 1 ms
    assert bench.bandwidth("allgather", 65536, 4, 4, 1e-3) == pytest.approx((1.048576, 0.786432))
    assert bench.bandwidth("allreduce", 262144, 4, 4, 1e-3) == pytest.approx((1.048576, 1.572864))
    assert bench.sweep(8, 64, 2, 1) == [8, 16, 32, 64] and bench.sweep(1, 3, 1, 1) == [1, 2, 3]
    assert [bench.parse_size(s) for s in ("8", "64K", "32M", "1G", "1.5k")] == [8, 65536, 32 << 20, 1 << 30, 1536]
    assert bench.format_time(12.345) == "  12.35" and bench.format_time(123.45) == "  123.5"
    assert bench.format_time(12345.6) == "  12346"


def _reduce_in_dtype(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """What a backend computes: the reduction in the wire dtype (avg as sum, then divide)."""
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "min": torch.minimum,
               "max": torch.maximum}[op](acc, t)
    if op == "avg":
        acc = acc / len(tensors) if acc.dtype.is_floating_point else torch.div(acc, len(tensors), rounding_mode="trunc")
    return acc


@pytest.mark.parametrize("dtype_name", list(bench.DTYPES))
@pytest.mark.parametrize("nranks", [2, 3, 8])
def test_inputs_give_exact_results_and_the_check_catches_mutations(dtype_name, nranks):
    dtype, cpu, n = bench.DTYPES[dtype_name], torch.device("cpu"), 1000
    elsize = torch.empty((), dtype=dtype).element_size()
    lay = bench.layout("allreduce", n * elsize, elsize, nranks)
    for op in bench.OPS:
        inputs = [bench.make_input(op, 0, n, r, nranks, dtype, cpu) for r in range(nranks)]
        want = bench.expected_result("allreduce", lay, op, -1, 0, nranks, dtype, cpu)
        tol = bench.tolerance(op, dtype, nranks)
        assert bench.count_wrong(_reduce_in_dtype(op, inputs), want, tol) == 0, op
        assert bench.count_wrong(_reduce_in_dtype(op, inputs[1:]), want, tol) > 0, op  # rank 0 left out
        mutated = want.clone()
        mutated[17] += 1  # wrong expected value: exactly one element off
        assert bench.count_wrong(_reduce_in_dtype(op, inputs), mutated, tol) == 1, op


@pytest.mark.parametrize("coll", ["allgather", "alltoall", "broadcast", "reducescatter"])
def test_misrouted_data_is_counted(coll):
    nranks, dtype, cpu = 4, torch.float16, torch.device("cpu")
    lay = bench.layout(coll, 4096, 2, nranks)
    rank = 2
    want = bench.expected_result(coll, lay, "sum", 1, rank, nranks, dtype, cpu)
    if coll == "allgather":
        got = torch.cat([bench.make_input("none", 0, lay.sendcount, r, nranks, dtype, cpu) for r in range(nranks)])
    elif coll == "alltoall":
        c = lay.paramcount
        sends = [bench.make_input("none", 0, lay.sendcount, r, nranks, dtype, cpu) for r in range(nranks)]
        got = torch.cat([sends[r][rank * c:(rank + 1) * c] for r in range(nranks)])
    elif coll == "broadcast":
        got = bench.make_input("none", 0, lay.sendcount, 1, nranks, dtype, cpu)
    else:
        sends = [bench.make_input("sum", 0, lay.sendcount, r, nranks, dtype, cpu) for r in range(nranks)]
        got = _reduce_in_dtype("sum", sends)[rank * lay.recvcount:(rank + 1) * lay.recvcount]
    assert bench.count_wrong(got, want) == 0
    half = got.numel() // 2
    swapped = torch.cat([got[half:], got[:half]])  # chunks delivered to the wrong place
    assert bench.count_wrong(swapped, want) > half // 2
    assert bench.count_wrong(got[:-1], want) == want.numel()  # wrong size: everything is wrong


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_cuda_without_a_gpu_exits_2_with_one_line():
    r = run([PYTHON, "benchmarks/collectives.py", "--device", "cuda"], timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda needs a CUDA GPU" in lines[0] and "--device cpu" in lines[0], r.stderr


# -- the summary on empty, partial and 1-rank tables -------------------------------------------


def _table(coll: str, impl: str, busbw: list[float], skipped: tuple[str, ...] = ()) -> "bench.Table":
    rows = [bench.Row(8 << i, 2 << i, "float", "sum", -1, bench.Result(10.0, 1.0 + i, bw, 0), None)
            for i, bw in enumerate(busbw)]
    return bench.Table(coll, impl, impl, rows, list(skipped))


def test_summary_of_empty_tables_says_why_instead_of_failing():
    empty = _table("allreduce", "torch", [], ("int32 avg: Gloo's ReduceOp.AVG cannot write an integer result",))
    tiny = _table("allgather", "gpucomm", [])
    full = _table("allreduce", "gpucomm", [1.0, 3.0])
    assert empty.avg_busbw is None and empty.avg_algbw is None and full.avg_busbw == 2.0
    lines = bench.summary_lines([full, empty, tiny], 2, {"nccl": "raw NCCL moves CUDA buffers only"})
    assert lines == [
        "# Summary: avg bus bandwidth (GB/s): allreduce/gpucomm 2, allreduce/torch n/a, allgather/gpucomm n/a",
        "# No rows for allreduce/torch: every case skipped: int32 avg: Gloo's ReduceOp.AVG cannot write an "
        "integer result",
        "# No rows for allgather/gpucomm: no size in the sweep leaves an element per rank (raise -b or -e)",
        "# Not measured: nccl: raw NCCL moves CUDA buffers only",
        "# Out of bounds values (all tables) : 0 OK"]
    assert bench.table_footer(tiny)[1].startswith("# Avg bus bandwidth    : n/a (no rows: no size")
    assert bench.summary_lines([], 2, {})[0] == "# Summary: avg bus bandwidth (GB/s): n/a (no tables were run)"


def test_rounds_merge_into_each_cells_median_time_and_the_ratio_line_compares_like_rows():
    def table(impl, times, wrong=0):
        rows = [bench.Row(32 << 20, 8 << 20, "float", "sum", -1,
                          bench.Result(t, 1e3 / t, 2e3 / t, wrong), None if impl == "gpucomm" else
                          bench.Result(2 * t, 0.5e3 / t, 1e3 / t, 0)) for t in times]
        return bench.Table("allreduce", impl, impl, rows)

    rounds = [[table("gpucomm", [10.0]), table("torch", [40.0])],
              [table("gpucomm", [30.0], wrong=3), table("torch", [20.0])],
              [table("gpucomm", [20.0]), table("torch", [30.0])]]
    ours, theirs = bench.median_tables(rounds)
    cell = ours.rows[0].out_of_place
    assert (cell.time_us, cell.busbw, cell.algbw, cell.wrong) == (20.0, pytest.approx(100.0), pytest.approx(50.0), 3)
    assert ours.rows[0].in_place is None and theirs.rows[0].in_place.time_us == 60.0  # 2x the median 30
    assert theirs.rows[0].out_of_place.busbw == pytest.approx(2e3 / 30)
    (line,) = bench.ratio_lines([ours, theirs], "busbw")
    assert line == "# gpucomm / torch.distributed busbw: allreduce out-of-place 33554432 B 1.50"  # 100 / 66.7
    assert bench.ratio_lines([ours], "busbw") == []  # nothing to compare with
    # torch skipped a case gpucomm ran (Gloo's integer average): rows pair by what they measured, not position
    mine = bench.Table("allreduce", "gpucomm", "g", [
        bench.Row(64, 16, "int32", "avg", -1, bench.Result(1.0, 4.0, 8.0, 0), None),
        bench.Row(64, 16, "int32", "sum", -1, bench.Result(1.0, 4.0, 6.0, 0), None)])
    torch_t = bench.Table("allreduce", "torch", "t", [
        bench.Row(64, 16, "int32", "sum", -1, bench.Result(1.0, 4.0, 3.0, 0), None)])
    assert bench.ratio_lines([mine, torch_t], "busbw") == [
        "# gpucomm / torch.distributed busbw: allreduce out-of-place 64 B int32 sum root -1 2.00"]
    with pytest.raises(ValueError, match="rounds differ"):
        bench.median_tables([[ours], [table("gpucomm", [1.0, 2.0])]])


def test_one_rank_summary_and_plot_use_algbw(tmp_path, capsys):
    one_rank = _table("allreduce", "gpucomm", [0.0, 0.0])  # busbw = algbw x 2(n-1)/n = 0 at 1 rank
    (line, *_) = bench.summary_lines([one_rank], 1, {})
    assert line == ("# Summary: avg algorithm bandwidth (GB/s; at 1 rank nccl-tests' busbw is 0 for all but "
                    "broadcast): allreduce/gpucomm 1.5")
    assert bench.summary_metric(1) == "algbw" and bench.summary_metric(2) == "busbw"
    assert not bench.write_plot(str(tmp_path / "none.png"), [_table("allreduce", "gpucomm", [])], "t")
    assert "plot skipped: no table has a row to draw" in capsys.readouterr().out
    assert not (tmp_path / "none.png").exists()


def test_json_is_strict_when_a_bandwidth_is_infinite(tmp_path):
    import argparse
    import json

    table = _table("allreduce", "gpucomm", [float("inf")])
    bench.write_json(str(tmp_path / "c.json"), [table, _table("allgather", "gpucomm", [])], {"ranks": 2},
                     argparse.Namespace(quick=True))
    doc = json.loads((tmp_path / "c.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert doc["results"][0]["out_of_place"]["busbw"] is None
    assert doc["tables"][1]["avg_busbw"] is None and doc["tables"][1]["empty_reason"].startswith("no size")


def test_an_interrupted_sweep_reports_the_rows_it_measured(tmp_path):
    """Ctrl-C on the launcher: it stops the ranks (SIGTERM), and rank 0 still prints the summary and
    writes the JSON of the tables so far, marked interrupted, then exits 130."""
    import json
    import signal

    from tests.harness import launcher_cmd

    js = tmp_path / "c.json"
    cmd = launcher_cmd("-np", "2", PYTHON, "benchmarks/collectives.py", "--device", "cpu", "--impls", "gpucomm",
                       "--ops", "broadcast,allreduce", "-o", "all", "-b", "8", "-e", "64K", "-f", "8", "-w", "1",
                       "-n", "200", "--json", str(js), "--plot", "")
    # 5 broadcast rows, then 25 allreduce rows (5 ops): the signal comes early in the second table
    r = run(cmd, timeout=180, signal_after=(0.0, signal.SIGINT), wait_for_line="# Collective allreduce")
    assert r.returncode == 130, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.leftovers == [] and "Traceback" not in r.stdout + r.stderr
    assert "[0]<stdout>:# Interrupted: the sweep was stopped; the tables above hold the rows measured before that" \
        in r.stdout
    doc = json.loads(js.read_text())
    assert doc["env"]["interrupted"] is True
    rows = {t["collective"]: t["rows"] for t in doc["tables"]}
    assert rows["broadcast"] == 5 and 0 <= rows["allreduce"] < 25, rows  # stopped inside the allreduce table
