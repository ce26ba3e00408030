"""benchmarks/collectives.py: nccl-tests' tables for gpucomm and torch.distributed on 2 CPU ranks, and
the pieces they rest on (nccl-tests' sizes and bus-bandwidth factors, exact inputs, the #wrong check)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
import torch

from tests.launcher_util import PYTHON, ROOT, launcher_cmd, run


def _load_bench():
    spec = importlib.util.spec_from_file_location("collectives_bench", ROOT / "benchmarks" / "collectives.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_bench()

PREFIX = "[0]<stdout>:"
HEADER = re.compile(r"^# Collective (\w+), implementation (\w+):")
FIELD = r"\s+(\S+)"
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)" + FIELD * 8 + r"\s*$")
FACTORS_2 = {"allreduce": 1.0, "allgather": 0.5, "reducescatter": 0.5, "alltoall": 0.5, "broadcast": 1.0}


def parse_tables(stdout: str) -> dict[tuple[str, str], dict]:
    """Rank 0's tables: {(collective, impl): {"rows": [...], "footer": [...]}}."""
    tables: dict[tuple[str, str], dict] = {}
    current = None
    for raw in stdout.splitlines():
        if not raw.startswith(PREFIX):
            continue
        line = raw[len(PREFIX):]
        m = HEADER.match(line)
        if m:
            current = tables.setdefault((m.group(1), m.group(2)), {"rows": [], "footer": []})
            continue
        if current is None:
            continue
        m = ROW.match(line)
        if m:
            g = m.groups()
            current["rows"].append({"size": int(g[0]), "count": int(g[1]), "type": g[2], "redop": g[3],
                                    "root": int(g[4]), "oop": g[5:9], "ip": g[9:13]})
        elif line.startswith("# Out of bounds values") or line.startswith("# Avg bus bandwidth"):
            current["footer"].append(line)
    return tables


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives")
    js, png = out / "bench.json", out / "bench.png"
    r = run(launcher_cmd("-np", "2", PYTHON, "benchmarks/collectives.py", "--device", "cpu", "--quick",
                         "--json", str(js), "--plot", str(png)), timeout=120)
    return r, js, png


def test_quick_cpu_sweep_prints_nccl_tests_tables_with_no_wrong_results(quick_run):
    r, _, _ = quick_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.leftovers == []
    assert "[1]<stdout>" not in r.stdout  # only rank 0 prints
    tables = parse_tables(r.stdout)
    assert set(tables) == {(c, i) for c in bench.COLLECTIVES for i in ("gpucomm", "torch")}
    for (coll, impl), t in tables.items():
        assert len(t["rows"]) == 5, (coll, impl, t["rows"])  # 8 B .. 64 KiB by 8x
        for row in t["rows"]:
            assert row["oop"][3] == "0", (coll, impl, row)
            has_in_place = coll != "alltoall" and (impl == "torch" or coll in ("allreduce", "broadcast"))
            assert row["ip"][3] == ("0" if has_in_place else "N/A"), (coll, impl, row)
            assert row["redop"] == ("sum" if coll in ("allreduce", "reducescatter") else "none")
            assert row["root"] == (0 if coll == "broadcast" else -1)
            per_rank = 1 if coll in ("allreduce", "broadcast") else 2
            assert row["size"] == row["count"] * 4 * per_rank, (coll, row)  # float; nccl-tests' size column
        assert t["footer"][0] == "# Out of bounds values : 0 OK"
        assert re.fullmatch(r"# Avg bus bandwidth    : [0-9.e+-]+", t["footer"][1]), t["footer"]
    assert f"{PREFIX}# Out of bounds values (all tables) : 0 OK" in r.stdout


def test_busbw_is_algbw_times_nccl_tests_factor(quick_run):
    r, js, _ = quick_run
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(js.read_text())
    assert doc["env"]["ranks"] == 2 and doc["env"]["device"] == "cpu" and doc["env"]["torch"] == torch.__version__
    assert len(doc["tables"]) == 10 and all(t["out_of_bounds"] == 0 for t in doc["tables"])
    printed = parse_tables(r.stdout)
    for (coll, impl), table in printed.items():
        rows = [x for x in doc["results"] if (x["collective"], x["impl"]) == (coll, impl)]
        assert [x["bytes"] for x in rows] == [row["size"] for row in table["rows"]]
        factor = FACTORS_2[coll]
        for x in rows:
            for place in ("out_of_place", "in_place"):
                res = x[place]
                if res:  # {} where the place does not apply
                    assert res["busbw"] == pytest.approx(res["algbw"] * factor, rel=1e-12)
                    assert res["wrong"] == 0
        # the printed row carries the same numbers (2 decimals, time as nccl-tests formats it)
        last, shown = rows[-1]["out_of_place"], table["rows"][-1]["oop"]
        assert float(shown[1]) == pytest.approx(last["algbw"], abs=0.006)
        assert float(shown[2]) == pytest.approx(last["busbw"], abs=0.006)
        assert float(shown[0]) == pytest.approx(last["time_us"], rel=0.01, abs=0.01)


def test_json_and_png_are_written(quick_run):
    r, js, png = quick_run
    assert r.returncode == 0, r.stderr[-3000:]
    assert js.is_file() and f"# wrote {js}" in r.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot skipped: matplotlib is not installed" in r.stdout
        return
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
