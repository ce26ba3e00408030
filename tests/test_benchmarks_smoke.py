"""Every script in benchmarks/ at its smallest setting on CPU, as a real job: it exits as documented,
prints its summary, writes parseable JSON and leaves no process behind. The GPU-only ones end with
one line saying a GPU is needed. Each run is checked for structure and counts only: this machine is
shared, so nothing here bounds a measured time or rate; at most it is finite, not negative, or in an
order that holds by construction (p10 <= median <= p90).

The runs are started together when the first test asks for one, two at a time (a run is mostly
interpreter and job start-up, so two overlap well on two cores), and each test waits for its own;
verify_gpu.py's summary-only mode reads the JSON the collectives and training runs wrote.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpucomm.backends.base import torch_at_least
from tests.steps import require_step
from tests.harness import PYTHON, launcher_cmd, run

PREFIX = "[0]<stdout>:"
TIMEOUT = 180.0  # a hang detector: every run here takes a few seconds
WORKERS = 2  # runs at a time
NO_GPU = "needs a CUDA GPU"


@dataclass(frozen=True)
class Case:
    """One benchmark run: ``argv`` after the interpreter, ``{out}`` standing for the run's folder."""

    id: str
    argv: tuple[str, ...]
    json: str  # the JSON file the run writes, relative to its folder
    summary: str  # a line of the summary, as printed (without the rank prefix)
    ranks: int | None = None  # None: plain python (the script starts its own jobs, or none)
    needs: tuple[str, ...] = ()  # runs whose outputs this one reads

    def command(self, out: Path) -> list[str]:
        argv = [a.replace("{out}", str(out)) for a in self.argv]
        if self.ranks is None:
            return [PYTHON, *argv]
        return launcher_cmd("-np", str(self.ranks), PYTHON, *argv)


def _collectives(ranks: int) -> Case:
    return Case(f"collectives-{ranks}", ("benchmarks/collectives.py", "--device", "cpu", "--quick",
                                          "--json", "{out}/collectives.json", "--plot", "{out}/collectives.png"),
                "collectives.json", "# Summary: avg ", ranks)


# the longest runs first, so that two workers finish together
CASES = {c.id: c for c in [
    _collectives(2),
    # mismatch_exit.py fails on purpose; its driver times it (the limit only catches a hang)
    Case("mismatch_exit", ("benchmarks/control_plane.py", "--mismatch-exit", "--quick", "--exit-limit", "60",
                           "--json", "{out}/mismatch_exit.json"), "mismatch_exit.json", "every rank raised the error"),
    Case("timeline_overhead", ("benchmarks/timeline_overhead.py", "--quick", "--out", "{out}"),
         "timeline_overhead.json", "timeline overhead: ", 2),
    Case("control_plane", ("benchmarks/control_plane.py", "--quick", "--json", "{out}/control_plane.json"),
         "control_plane.json", "# burst of 10 async allreduces", 2),
    _collectives(1),
    Case("train", ("benchmarks/train.py", "--device", "cpu", "--quick", "--models", "cnn", "--rounds", "4",
                   "--steps-per-round", "1", "--warmup", "1", "--json", "{out}/train.json",
                   "--plot", "{out}/train.png"), "train.json", "throughput, cnn: gpucomm-reducer-", 1),
    Case("optimizer_vs_ddp-2", ("benchmarks/optimizer_vs_ddp.py", "--quick", "--model", "cnn",
                                "--json", "{out}/optimizer_vs_ddp.json"),
         "optimizer_vs_ddp.json", "ratio gpucomm / ddp-best: ", 2),
    Case("optimizer_vs_ddp-1", ("benchmarks/optimizer_vs_ddp.py", "--quick", "--model", "cnn", "--floor",
                                "--zero-grad", "keep-views", "--json", "{out}/optimizer_vs_ddp.json"),
         "optimizer_vs_ddp.json", "ratio gpucomm-reducer-", 1),
    Case("autotune", ("benchmarks/autotune.py", "--quick", "--model", "cnn", "--json", "{out}/autotune.json"),
         "autotune.json", "autotune vs best fixed cap", 2),
    Case("finite_check", ("benchmarks/finite_check.py", "--quick", "--model", "cnn", "--json", "{out}/finite_check.json"),
         "finite_check.json", "  checked / plain: ", 2),
    Case("compression_memory", ("benchmarks/compression_memory.py", "--quick", "--json", "{out}/compression_memory.json"),
         "compression_memory.json", "# ZeRO-1 (Adam): cnn", 2),
    Case("powersgd_accuracy", ("benchmarks/powersgd_accuracy.py", "--quick", "--json", "{out}/powersgd_accuracy.json"),
         "powersgd_accuracy.json", "resnet8  PowerSGD - uncompressed: ", 2),
    Case("startup", ("benchmarks/startup.py", "--quick", "--sizes", "1", "--launchers", "gpucomm-run",
                     "--json", "{out}/startup.json"), "startup.json", "Start-up to first completed allreduce"),
    Case("overhead-2", ("benchmarks/overhead.py", "--device", "cpu", "--quick", "--json", "{out}/overhead.json"),
         "overhead.json", "# gpucomm host overhead per cached op: 2 rank(s)", 2),
    Case("overhead-1", ("benchmarks/overhead.py", "--device", "cpu", "--quick", "--json", "{out}/overhead.json"),
         "overhead.json", "# gpucomm host overhead per cached op: 1 rank(s)", 1),
    Case("collectives-rounds", ("benchmarks/collectives.py", "--device", "cpu", "--quick", "-R", "2", "--ops",
                                "allreduce,broadcast", "-e", "64", "--json", "{out}/collectives.json", "--plot", ""),
         "collectives.json", "# gpucomm / torch.distributed busbw: ", 2),
    Case("cpu_allreduce", ("benchmarks/cpu_allreduce.py", "--quick", "--json", "{out}/cpu_allreduce.json"),
         "cpu_allreduce.json", "gpucomm / raw gloo small-op latency: ", 1),
    Case("pack_bw", ("benchmarks/pack_bw.py", "--quick", "--json", "{out}/pack_bw.json"), "pack_bw.json", "# target "),
    Case("step_profile", ("benchmarks/step_profile.py", "--device", "cpu", "--model", "cnn", "--warmup", "1",
                          "--steps", "2", "--rounds", "2", "--top", "3", "--one-rank-reducer",
                          "--json", "{out}/step_profile.json"),
         "step_profile.json", "# issue ms per step (the host queueing a step", 1),
    Case("reducer_host_cost-2", ("benchmarks/reducer_host_cost.py", "--quick", "--json", "{out}/reducer_host_cost.json"),
         "reducer_host_cost.json", "gpucomm's added wall time / DDP's: ", 2),
    Case("verify_gpu", ("benchmarks/verify_gpu.py", "--summarize-only", "--out", "{out}"), "summary.json",
         "# gpucomm GPU verification, summary of the results in ", needs=("collectives-1", "collectives-2", "train")),
]}
# verify_gpu.py's plan names the files it summarizes
VERIFY_INPUTS = {"collectives-1": "collectives_1.json", "collectives-2": "collectives_2.json", "train": "train_1.json"}


@dataclass
class Run:
    case: Case
    out: Path
    returncode: int
    stdout: str
    stderr: str
    leftovers: list[str]

    def doc(self) -> Any:
        """The JSON the run wrote, parsed strictly: NaN and Infinity are not JSON."""
        path = self.out / self.case.json
        assert path.is_file(), f"{self.case.id}: no {path}\n{self.tail()}"
        return json.loads(path.read_text(), parse_constant=_reject_constant)

    def rank0(self) -> list[str]:
        """Rank 0's stdout lines without the prefix (all lines for a plain-python run)."""
        lines = self.stdout.splitlines()
        if self.case.ranks is None:
            return lines
        return [line[len(PREFIX):] for line in lines if line.startswith(PREFIX)]

    def tail(self) -> str:
        return f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} in JSON: a benchmark must write null for a figure it could not measure")


class Runs:
    """The selected cases, run ``WORKERS`` at a time in submission order, dependencies first."""

    def __init__(self, factory: pytest.TempPathFactory, wanted: list[str]) -> None:
        self.factory = factory
        self.pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="bench")
        self.futures: dict[str, Future[Run]] = {}
        for case_id in wanted:
            self.submit(case_id)

    def submit(self, case_id: str) -> Future[Run]:
        if case_id not in self.futures:
            # dependencies are queued first, so a worker never waits on a run no worker has taken
            needs = [self.submit(n) for n in CASES[case_id].needs]
            out = self.factory.mktemp(case_id)
            self.futures[case_id] = self.pool.submit(self._run, CASES[case_id], out, needs)
        return self.futures[case_id]

    def get(self, case_id: str) -> Run:
        return self.submit(case_id).result()

    @staticmethod
    def _run(case: Case, out: Path, needs: list[Future[Run]]) -> Run:
        for need in needs:
            done = need.result()
            if case.id == "verify_gpu":
                shutil.copy(done.out / done.case.json, out / VERIFY_INPUTS[done.case.id])
        r = run(case.command(out), timeout=TIMEOUT)
        return Run(case, out, r.returncode, r.stdout, r.stderr, r.leftovers)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def selected_cases(session: pytest.Session) -> list[str]:
    """The case ids of this module's tests that this session will run (all, unless -k narrows them)."""
    return [item.callspec.params["case_id"] for item in session.items
            if item.path == Path(__file__) and "case_id" in getattr(getattr(item, "callspec", None), "params", {})]


@pytest.fixture(scope="module")
def bench_runs(request, tmp_path_factory):
    require_step(request.config, "e2e")
    runs = Runs(tmp_path_factory, selected_cases(request.session))
    yield runs
    runs.close()


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def expected_returncode(case: Case) -> int:
    return 2 if case.id == "pack_bw" and not gpu_available() else 0  # pack_bw: 2 = skipped, documented


def non_finite_numbers(doc: Any, where: str = "") -> list[str]:
    """Paths of every number in ``doc`` that is not finite (strict parsing already refuses NaN)."""
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in non_finite_numbers(v, f"{where}.{k}")]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in non_finite_numbers(v, f"{where}[{i}]")]
    if isinstance(doc, float) and not math.isfinite(doc):
        return [where]
    return []


@pytest.mark.e2e
@pytest.mark.parametrize("case_id", list(CASES))
def test_benchmark_runs_and_reports(bench_runs, case_id):
    r = bench_runs.get(case_id)
    assert r.returncode == expected_returncode(r.case), r.tail()
    assert r.leftovers == [], r.leftovers
    assert "Traceback" not in r.stdout + r.stderr, r.tail()
    if r.case.ranks and r.case.ranks > 1:
        assert "[1]<stdout>" not in r.stdout, "only rank 0 reports"
    doc = r.doc()
    assert non_finite_numbers(doc) == []  # e.g. 1e999 parses as inf
    if r.returncode == 0:
        assert any(line.startswith(r.case.summary) for line in r.rank0()), r.tail()
    CHECKS[case_id](r, doc)


# -- what each run must show, beyond the common checks --------------------------------------------

HEADER = re.compile(r"^# Collective (\w+), implementation (\w+):")
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)" + r"\s+(\S+)" * 8 + r"\s*$")
COLLECTIVES = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
FACTORS_2 = {"allreduce": 1.0, "allgather": 0.5, "reducescatter": 0.5, "alltoall": 0.5, "broadcast": 1.0}
PNG = b"\x89PNG\r\n\x1a\n"


def parse_tables(lines: list[str]) -> dict[tuple[str, str], dict]:
    """Rank 0's nccl-tests tables: {(collective, impl): {"rows": [...], "footer": [...]}}."""
    tables: dict[tuple[str, str], dict] = {}
    current = None
    for line in lines:
        m = HEADER.match(line)
        if m:
            current = tables.setdefault((m.group(1), m.group(2)), {"rows": [], "footer": []})
        elif current is not None and (m := ROW.match(line)):
            g = m.groups()
            current["rows"].append({"size": int(g[0]), "count": int(g[1]), "redop": g[3], "root": int(g[4]),
                                    "oop": g[5:9], "ip": g[9:13]})
        elif current is not None and line.startswith(("# Out of bounds values :", "# Avg bus bandwidth")):
            current["footer"].append(line)
    return tables


def check_collectives_rounds(r: Run, doc: dict) -> None:
    lines = r.rank0()
    assert [ln for ln in lines if ln.startswith("# round ")] == ["# round 1 of 2", "# round 2 of 2"]
    assert "# Median of 2 interleaved rounds (time per call; bandwidths from that time)" in lines
    assert [(t["collective"], t["impl"]) for t in doc["tables"]] == [(c, i) for c in ("allreduce", "broadcast")
                                                                    for i in ("gpucomm", "torch")]
    assert all(len([x for x in doc["results"] if (x["collective"], x["impl"]) == (t["collective"], t["impl"])])
               == 2 for t in doc["tables"])  # --quick -e 64: 8 and 64 B, once each: the medians, not every round
    (ratios,) = [ln for ln in lines if ln.startswith("# gpucomm / torch.distributed busbw: ")]
    assert ratios.count("allreduce out-of-place") == 2 and ratios.count("broadcast in-place") == 2


def check_collectives(r: Run, doc: dict) -> None:
    n = r.case.ranks
    tables = parse_tables(r.rank0())
    assert set(tables) == {(c, i) for c in COLLECTIVES for i in ("gpucomm", "torch")}
    # torch 2.1's Gloo has no reduce-scatter: the anchor's table says so and has no row
    (torch_rs,) = [t for t in doc["tables"] if (t["collective"], t["impl"]) == ("reducescatter", "torch")]
    anchor_rs = not torch_rs["skipped"]
    assert anchor_rs or not torch_at_least(2, 13), torch_rs  # the torch CI runs the suite on has one
    if not anchor_rs:
        assert torch_rs["rows"] == 0 and "has no reduce-scatter" in torch_rs["skipped"][0], torch_rs
        assert tables.pop(("reducescatter", "torch"))["rows"] == []
        doc = {**doc, "tables": [t for t in doc["tables"] if t is not torch_rs]}
    for (coll, impl), t in tables.items():
        assert len(t["rows"]) == 5, (coll, impl, t["rows"])  # --quick: 8 B .. 64 KiB by 8x
        for row in t["rows"]:
            has_in_place = coll != "alltoall" and (impl == "torch" or coll in ("allreduce", "broadcast"))
            assert row["oop"][3] == "0" and row["ip"][3] == ("0" if has_in_place else "N/A"), (coll, impl, row)
            assert row["redop"] == ("sum" if coll in ("allreduce", "reducescatter") else "none")
            assert row["root"] == (0 if coll == "broadcast" else -1)
            per_rank = 1 if coll in ("allreduce", "broadcast") else n
            assert row["size"] == row["count"] * 4 * per_rank, (coll, row)  # float; nccl-tests' size column
        assert t["footer"][0] == "# Out of bounds values : 0 OK"
    lines = r.rank0()
    assert "# Out of bounds values (all tables) : 0 OK" in lines
    assert any(line.startswith("# Not measured: nccl: raw NCCL moves CUDA buffers only") for line in lines)
    # which gpucomm counters its timed calls moved: gpucomm's tables only, every counter named (0 if unknown)
    for t in doc["tables"]:
        assert {"collectives", "control_rounds", "sync_fast_ops", "local_ops"} <= set(t["counters"]), t
        assert any(t["counters"].values()) == (t["impl"] == "gpucomm"), t  # the anchors never touch gpucomm
    ran = doc["env"]["gpucomm_counters"]["timed_calls"]
    # one rank computes where the data lies (local_ops); more ranks call the transport or ride the control round
    assert ran["collectives"] + ran["inline_reductions"] + ran["inline_moves"] + ran["local_ops"] > 0, ran
    assert doc["env"]["nccl_sockets"]["single_gpu_test"] is False
    assert any(line.startswith("# gpucomm counters moved by its timed calls (every table, rank 0): ")
               for line in lines)
    assert doc["env"]["ranks"] == n and doc["env"]["device"] == "cpu" and "nccl" in doc["env"]["not_measured"]
    assert len(doc["tables"]) == (10 if anchor_rs else 9)
    assert all(t["out_of_bounds"] == 0 and t["rows"] == 5 for t in doc["tables"])
    assert all(t["avg_algbw"] >= 0 and t["avg_busbw"] >= 0 for t in doc["tables"])
    for x in doc["results"]:
        for res in (x["out_of_place"], x["in_place"]):  # {} where the place does not apply
            if res:
                factor = FACTORS_2[x["collective"]] if n == 2 else (1.0 if x["collective"] == "broadcast" else 0.0)
                assert res["wrong"] == 0 and res["time_us"] >= 0
                assert res["busbw"] == pytest.approx(res["algbw"] * factor, rel=1e-12)
    printed, last = tables[("allreduce", "gpucomm")]["rows"][-1]["oop"], doc["results"][4]["out_of_place"]
    assert doc["results"][4]["collective"] == "allreduce"
    assert float(printed[1]) == pytest.approx(last["algbw"], abs=0.006)  # the table prints what the JSON holds
    assert (r.out / "collectives.png").read_bytes()[:8] == PNG
    if n == 1:  # busbw is 0 by definition at 1 rank: the summary says algbw instead
        assert any("avg algorithm bandwidth" in line and "allreduce/gpucomm " in line for line in lines)


VARIANTS = ["gpucomm", "ddp-default", "ddp-best", "no-comm"]


def _ordered(record: dict, span: str, mid: str, quartiles: str) -> bool:
    """range[0] <= quartiles[0] <= median <= quartiles[1] <= range[1] (inclusive quartiles: by construction)."""
    (low, high), (q1, q3) = record[span], record[quartiles]
    return low <= q1 <= record[mid] <= q3 <= high


def _reducer_checked(doc: dict, lines: list[str], ranks: int) -> None:
    """The one-rank reducer: asked at 1 rank, its label says whether gpucomm's counters show it ran
    (it may not, before gpucomm runs its reducer at size 1), and the run says so in a line."""
    rec = doc["one_rank_reducer"]
    assert rec["applies"] == (ranks == 1) and rec["asked"] == (ranks == 1), rec
    if ranks == 1:
        assert rec["variable"] == "GPUCOMM_ONE_RANK_REDUCER=1" and isinstance(rec["verified"], bool), rec
        assert doc["labels"]["gpucomm"] == f"gpucomm-reducer-{'on' if rec['verified'] else 'off'}"
        assert any(line.startswith("one-rank reducer: ") for line in lines)
    else:
        assert rec["verified"] is None and doc["labels"]["gpucomm"] == "gpucomm"


def _added_checked(added: dict) -> None:
    """Every variant but the floor has its added wall and CPU time; gpucomm's share of ddp-best's is there."""
    for kind in ("wall_s", "cpu_s"):
        assert set(added[kind]) == {"gpucomm", "ddp-default", "ddp-best"}, added
        assert all(isinstance(x["median"], float) for x in added[kind].values())
    assert set(added["gpucomm_vs_ddp_best"]) == {"wall_s", "cpu_s"} and added["target"] == 0.5


def check_train(r: Run, doc: dict) -> None:
    assert doc["benchmark"] == "train" and doc["ranks"] == 1 and doc["device"] == "cpu" and doc["rounds"] == 4
    m = doc["models"]["cnn"]
    assert list(m["variants"]) == VARIANTS  # DDP exists at world size 1 too, and the floor is always there
    for v in m["variants"].values():
        assert len(v["round_samples_per_s_per_device"]) == 4 and v["samples_per_s_per_device"] > 0
        assert len(v["round_cpu_seconds"]) == 4 and v["wall_s_per_step"] > 0 and v["cpu_s_per_step"] >= 0
        lo, hi = v["per_device_range"]
        assert lo <= v["per_device_quartiles"][0] <= v["per_device_quartiles"][1] <= hi  # inclusive quartiles
    assert set(m["ratios"]) == {"vs_ddp_best", "vs_ddp_default", "vs_no_comm"} and m["scaling_efficiency"] is None
    for key, ratios in m["ratios"].items():
        assert set(ratios) == set(VARIANTS) and all(len(x["round_ratios"]) == 4 for x in ratios.values()), key
    assert m["ratio_gpucomm_vs_ddp_best"] == m["ratios"]["vs_ddp_best"]["gpucomm"]
    assert m["ratios"]["vs_ddp_best"]["ddp-best"]["round_ratios"] == [1.0] * 4
    assert set(m["vs_no_comm"]) == {"gpucomm", "ddp-default", "ddp-best"}
    _added_checked(m["added_over_floor"])
    assert doc["ddp_options"]["ddp-best"]["gradient_as_bucket_view"] and doc["ddp_options"]["ddp-best"]["static_graph"]
    assert not doc["ddp_options"]["ddp-default"]["gradient_as_bucket_view"]
    assert doc["nccl_sockets"]["single_gpu_test"] is False and doc["notes"] == []  # 4 rounds balance 4 variants
    assert [sorted(o) for o in doc["round_orders"]] == [sorted(VARIANTS)] * 4
    lines = r.rank0()
    _reducer_checked(doc, lines, 1)
    assert "1-rank run: pass its JSON as --baseline to an N-rank run with the same flags for scaling efficiency" \
        in lines
    assert any(line.startswith("added over no-comm, cnn, wall / CPU ms per step: gpucomm") for line in lines)
    assert (r.out / "train.png").read_bytes()[:8] == PNG


def check_optimizer_vs_ddp(r: Run, doc: dict) -> None:
    n = r.case.ranks
    assert doc["benchmark"] == "optimizer_vs_ddp" and doc["ranks"] == n and doc["model"] == "cnn"
    assert list(doc["variants"]) == VARIANTS and doc["rounds"] == 4 and doc["balanced"] is True
    for name, v in doc["variants"].items():
        assert v["wall_s_per_step"] > 0 and v["cpu_s_per_step"] >= 0, (name, v)
        assert len(v["round_wall_s"]) == len(v["round_cpu_s"]) == 4, (name, v)
        assert _ordered(v, "wall_range", "wall_s_per_step", "wall_quartiles"), (name, v)
        assert _ordered(v, "cpu_range", "cpu_s_per_step", "cpu_quartiles"), (name, v)
    assert doc["median_step_s"] == {k: v["wall_s_per_step"] for k, v in doc["variants"].items()}
    assert doc["cpu_s_per_step"] == {k: v["cpu_s_per_step"] for k, v in doc["variants"].items()}
    assert doc["ratio"] == doc["ratios"]["vs_ddp_best"]["gpucomm"] > 0 and doc["no_comm_floor_ratio"] > 0
    for key in ("vs_ddp_best", "vs_ddp_default"):
        assert set(doc["ratios"][key]) == set(VARIANTS)
        assert len(doc["round_ratios"][key]["gpucomm"]["round_ratios"]) == 4
    _added_checked(doc["added_over_floor"])
    assert [sorted(o) for o in doc["round_orders"]] == [sorted(VARIANTS)] * 4
    assert [o[0] for o in doc["round_orders"]] == VARIANTS  # each variant first once in 4 rounds
    counts = doc["gpucomm_counters"]["gpucomm"]
    assert {"collectives", "schedule_steps", "grad_bucket_views", "sync_fast_ops", "local_ops"} <= set(counts)
    if n > 1:  # its gradients went through Gloo (the counters prove which transport carried them)
        assert counts["gloo_collectives"] > 0 and doc["transport_collectives"]["gpucomm"]["gloo"] > 0
    lines = r.rank0()
    zero_grad = "keep-views" if n == 1 else "free"  # the one-rank run keeps the views (--zero-grad keep-views)
    assert doc["zero_grad"] == zero_grad and f"zero_grad: {zero_grad} (" in "\n".join(lines), doc["zero_grad"]
    if n == 1:  # zero_grad() zeroed the gradients in their buckets: no timed step packed one
        assert counts["grad_bucket_packs"] == 0 and counts["grad_bucket_views"] > 0, counts
    _reducer_checked(doc, lines, n)
    assert doc["nccl_sockets"]["single_gpu_test"] is False
    assert "NCCL socket settings: untouched (ranks do not share a GPU, or no NCCL)" in lines
    assert any(line.startswith("added over the no-comm floor, wall / CPU ms per step") for line in lines)
    assert any(line.startswith("ratio gpucomm") and " / ddp-default: " in line for line in lines)
    header = next(line for line in lines if line.startswith("variant "))
    assert "wall ms/step" in header and "CPU ms/step" in header and "vs ddp-best" in header


def check_autotune(r: Run, doc: dict) -> None:
    assert doc["benchmark"] == "autotune" and doc["ranks"] == 2 and doc["model"] == "cnn" and doc["transport"] == "Gloo"
    assert set(doc["median_step_s"]) == {"cap 1", "cap 25", "default", "autotune", "ddp"}
    assert all(v > 0 for v in doc["median_step_s"].values()) and doc["best_fixed_cap"] in ("cap 1", "cap 25")
    assert doc["trial"][0]["candidate"] == "current" and sum(int(t["chosen"]) for t in doc["trial"]) == 1
    assert set(doc["explanation"]["plans"]) == {"autotune (model's plan, shared processor)", "ddp (25 MiB buckets)"}


def check_finite_check(r: Run, doc: dict) -> None:
    assert doc["ranks"] == 2 and doc["model"] == "cnn" and set(doc["step_s"]) == {"checked", "plain"}
    assert all(v > 0 for v in doc["step_s"].values()) and doc["ratio_checked_vs_plain"] > 0
    assert doc["counters"]["nonfinite_steps"] == 0 and doc["counters"]["schedule_steps"] > 0


def check_control_plane(r: Run, doc: dict) -> None:
    assert doc["benchmark"] == "control_plane" and doc["ranks"] == 2
    assert doc["generations"]["default"]["inline_bytes"] == 16 << 10
    assert doc["generations"]["inline_off"]["inline_bytes"] == 0
    lat = doc["latency"]
    assert set(lat) == {"named", "unnamed", "named_dataplane", "barrier", "raw_gloo", "named_4097", "raw_gloo_4097"}
    for name, s in lat.items():
        # raw Gloo runs in both generations of the one round; the others in one
        assert s["blocks"] == (2 if name == "raw_gloo" else 1) and s["ops"] == 20 * s["blocks"], (name, s)
        stats = [s["p10_us"], s["median_us"], s["p90_us"]]
        assert stats == sorted(stats) and stats[0] >= 0, (name, s)  # order statistics of one sample
        if name.startswith("raw_gloo"):
            assert s["control_rounds_per_op"] == 0, (name, s)  # raw Gloo never talks to the coordinator
        else:
            assert s["control_rounds_per_op"] >= 1, (name, s)  # a blocking op is at least one round
    assert set(doc["bursts"]) == {"inline_1", "dataplane_5000", "inline_off_1"}
    for kind, b in doc["bursts"].items():
        assert b["uncached"]["bursts"] == 1 and b["cached"]["bursts"] == 1, (kind, b)
        # 10 async ops: at least one control round, and never more than a few per op
        assert all(1 <= x <= 2 * 10 + 2 for x in b["uncached"]["rounds_all"] + b["cached"]["rounds_all"]), (kind, b)
    m = doc["mismatch"]
    assert m["repeats"] == 1 and [p["rank"] for p in m["per_rank"]] == [0, 1] and m["not_measured"] is None
    assert "Mismatched ALLREDUCE" in m["error"] and "rank 0 sent [1]; rank 1 sent [2]" in m["error"]


def check_cpu_allreduce(r: Run, doc: dict) -> None:
    assert doc["benchmark"] == "cpu_allreduce" and doc["ranks"] == 1
    for name in ("gpucomm", "raw_gloo"):
        s = doc["summary"][name]
        assert s["small_ops"] == 20 and s["large_ops"] == 2, s  # --quick: every iteration timed once
        assert all(v >= 0 for v in s.values()), s


def check_overhead(r: Run, doc: dict) -> None:
    n = r.case.ranks
    assert doc["benchmark"] == "overhead" and doc["ranks"] == n and doc["device"] == "cpu"
    forms = ("allreduce", "allreduce_", "allreduce_async", "broadcast", "allgather")
    assert set(doc["summary"]) == set(forms)
    for impl in ("gpucomm", "raw_gloo", "torch.distributed"):
        for form in forms:
            x = doc["results"][impl][form]
            stats = [x["us_p10"], x["us_median"], x["us_p90"]]
            assert len(x["samples_us"]) == 2 and stats == sorted(stats), (impl, form, x)  # order statistics
            assert x["python_calls"] >= (1 if impl == "gpucomm" else 0), (impl, form, x)
    if n == 1:  # nothing to agree on: no control round at all
        assert doc["control_rounds"] == 0, doc["control_rounds"]
    else:  # one round per synchronous op or barrier, never more
        assert 0 < doc["control_rounds"] <= 2 * doc["gpucomm_ops"], doc["control_rounds"]


def check_startup(r: Run, doc: dict) -> None:
    assert doc["benchmark"] == "startup" and doc["repeats"] == 1 and not doc["interrupted"]
    assert [(x["launcher"], x["ranks"]) for x in doc["results"]] == [("gpucomm-run", 1)]
    for x in doc["results"]:
        assert x["failures"] == [] and len(x["first_allreduce_s"]) == 1 and isinstance(x["median_first_allreduce_s"], float)


def check_timeline_overhead(r: Run, doc: dict) -> None:
    assert doc["benchmark"] == "timeline_overhead" and doc["ranks"] == 2 and doc["model"] == "convnet"
    assert doc["steps_per_mode"] == 2 and all(isinstance(doc["step_ms"][k], float) for k in ("off_median", "on_median"))
    # the default limits split convnet into the head (first bucket, <= 1 MiB) and the rest
    assert list(doc["buckets"].values()) == [1029024, 2602240]
    last = doc["last_timeline"]
    assert last["steps"] == 2 and last["open_optimizer_spans"] == 0 and doc["unreadable_timelines"] == []
    assert [b["path"] for b in last["buckets"]] == ["GLOO_ALLREDUCE", "GLOO_ALLREDUCE"]
    assert all(b["reductions"] == 2 for b in last["buckets"])
    assert 0 <= last["overlap_ms"] <= min(last["backward_ms"], last["gloo_allreduce_busy_ms"]) + 1e-9
    for key in ("png", "png_step"):
        assert Path(doc[key]).read_bytes()[:8] == PNG
    assert (r.out / "timeline.0.json").is_file()


def check_mismatch_exit(r: Run, doc: dict) -> None:
    assert doc["benchmark"] == "mismatch_exit" and doc["ok"] is True and doc["limit_s"] == 60
    (launch,) = doc["runs"]
    assert launch["returncode"] != 0 and not launch["hung"] and not launch["not_reached"]
    assert launch["ranks_called"] == [0, 1] and launch["ranks_with_error"] == [0, 1]
    assert set(launch["call_to_rank_process_end_s"]) == {"0", "1"}
    assert set(launch["call_to_rank_exit_hook_s"]) == {"0", "1"}  # error raised, gpucomm shut down, then exit


def check_pack_bw(r: Run, doc: dict) -> None:
    if r.returncode == 0:  # a GPU machine
        assert doc["rows"] and set(doc["targets"]) and any(line.startswith("# target ") for line in r.rank0())
        return
    assert r.stdout == "" and r.stderr.strip().count("\n") == 0, r.tail()  # one line
    assert r.stderr.startswith(f"pack_bw: skipped: {NO_GPU}")
    assert doc["skipped"].startswith(NO_GPU) and doc["rows"] == []


def check_step_profile(r: Run, doc: dict) -> None:
    assert set(doc["cpu_ms_per_step"]) == set(doc["issue_ms_per_step"]) == {"gpucomm", "plain"}
    assert all(v > 0 for v in doc["issue_ms_per_step"].values()) and len(doc["issue_ms_rounds"]["plain"]) == 2
    assert doc["sync_calls"] is None  # torch's sync debug mode needs CUDA
    assert doc["profiles"]["gpucomm"]["gpucomm_calls_per_step"] > 0  # the one-rank reducer ran its hooks
    assert doc["gpucomm_counters_per_step"]["collectives"] > 0


def check_verify_gpu(r: Run, doc: dict) -> None:
    steps = {s["name"]: s for s in doc["steps"]}
    assert steps["gpu tests"]["status"] == "no results" and steps["gpu tests"]["figures"] == []
    one, two = steps["collectives 1 rank(s)"], steps["collectives 2 rank(s)"]
    assert one["status"] == two["status"] == "results found"
    # the 1-rank sweep compares algbw (its busbw is 0 by definition), the 2-rank one busbw; both stop at 64 KiB
    largest = "at 32768 B (the largest size; none >= 1 MiB): "
    for step, metric in ((one, "algbw"), (two, "busbw")):
        assert step["figures"] == ["#wrong over all collectives and sizes: 0",
                                   "allreduce gpucomm/nccl: not measured (raw NCCL moves CUDA buffers only; use "
                                   "--device cuda (or leave nccl out on CPU))", step["figures"][2]], step
        assert step["figures"][2].startswith(f"allreduce {metric} gpucomm/torch {largest}"), step
    train = steps["train 1 rank"]["figures"]
    assert re.match(r"cnn: samples/s gpucomm-reducer-o(n|ff) [0-9.]+ \| ddp-default [0-9.]+ \| ddp-best [0-9.]+ \| "
                    r"no-comm [0-9.]+$", train[0]), train
    assert re.match(r"cnn: gpucomm / ddp-best [0-9.]+ \(round quartiles [0-9.]+-[0-9.]+\), / ddp-default [0-9.]+, "
                    r"/ no-comm [0-9.]+$", train[2]), train
    assert train[-1].startswith("one-rank reducer: asked (GPUCOMM_ONE_RANK_REDUCER=1), ")
    assert all(not f.startswith("(could not summarize") for s in doc["steps"] for f in s["figures"])
    assert (r.out / "summary.txt").read_text().startswith("# gpucomm GPU verification, summary of the results in ")


def check_compression_memory(r: Run, doc: dict) -> None:
    assert doc["ranks"] == 2 and doc["quick"] and set(doc["compression"]) == set(doc["zero"]) == {"cnn"}
    entries = {e["config"]: e for e in doc["compression"]["cnn"]}
    assert list(entries) == ["none", "fp16", "powersgd r1", "powersgd r4"]
    for e in entries.values():
        assert e["gpucomm"]["control_rounds"] == 0  # the fixed schedule, also with two phases
        # the same algorithms send the same bytes, but for gpucomm's bucket 0's 4-byte training flag and, under
        # the default finite check, one slot per rank (at most 4 bytes each) in every bucket
        extra = e["gpucomm"]["bytes_per_step"] - e["ddp"]["bytes_per_step"]
        assert 0 <= extra <= 4 + 4 * doc["ranks"] * e["gpucomm"]["collectives_per_step"], e
    none = entries["none"]["gpucomm"]["bytes_per_step"]
    assert entries["fp16"]["gpucomm"]["bytes_per_step"] < none and entries["powersgd r1"]["gpucomm"]["bytes_per_step"] \
        < entries["powersgd r4"]["gpucomm"]["bytes_per_step"] < none
    unsharded, zero, anchor = doc["zero"]["cnn"]
    assert unsharded["config"].startswith("gpucomm Adam") and zero["config"] == "gpucomm ZeRO-1 Adam"
    assert zero["state_bytes_max"] <= unsharded["state_bytes_max"] / 2 + 64  # 1/N, N = 2
    # the shards cover every moment once (Adam's 0-d step counters are per tensor: a few bytes either way)
    assert abs(sum(zero["state_bytes_per_rank"]) - unsharded["state_bytes_max"]) <= 256 and anchor["state_bytes_max"] > 0


def check_powersgd_accuracy(r: Run, doc: dict) -> None:
    assert doc["ranks"] == 2 and doc["quick"] and len(doc["runs"]) == 4
    rows = {(s["task"], s["compression"]): s for s in doc["summary"] if "compression" in s}
    assert set(rows) == {(t, c) for t in ("digits", "resnet8") for c in ("none", "powersgd")}
    for task in ("digits", "resnet8"):
        assert rows[(task, "powersgd")]["bytes_per_step"] < rows[(task, "none")]["bytes_per_step"]
        assert rows[(task, "powersgd")]["control_rounds"] == rows[(task, "none")]["control_rounds"] == 0
        assert all(0 <= a <= 1 for a in rows[(task, "none")]["accuracies"] + rows[(task, "powersgd")]["accuracies"])


def check_reducer_host_cost(r: Run, doc: dict) -> None:
    assert doc["tool"] == "reducer_host_cost" and doc["ranks"] == r.case.ranks and doc["parameters"] == 161
    # gpucomm as users get it, then the same reducer with a Python hook per gradient, beside the anchors
    variants = ["gpucomm", "gpucomm-hook-per-grad", "ddp-default", "ddp-best", "no-comm"]
    assert list(doc["variants"]) == variants and [sorted(o) for o in doc["round_orders"]] == [sorted(variants)] * 4
    for name, v in doc["variants"].items():
        assert v["wall_ms"] > 0 and v["cpu_ms"] >= 0 and v["label"] == name, (name, v)
    assert doc["variants"]["no-comm"]["added_wall_ms"] == 0.0
    assert set(doc["gpucomm_added_over_ddp_added"]) == set(doc["per_gradient_hooks_added_over_ddp_added"]) \
        == {"ddp-default", "ddp-best"}
    assert doc["reducer"]["applies"] is False  # two ranks: the reducer always runs
    # every step reduced every bucket through the schedule, with no control message
    per_step = doc["counters_per_step"]
    assert per_step["schedule_steps"] == 1.0 and per_step["collectives"] >= 1 and "control_rounds" not in per_step


CHECKS: dict[str, Callable[[Run, Any], None]] = {
    "compression_memory": check_compression_memory, "powersgd_accuracy": check_powersgd_accuracy,
    "collectives-1": check_collectives, "collectives-2": check_collectives, "train": check_train,
    "collectives-rounds": check_collectives_rounds,
    "optimizer_vs_ddp-1": check_optimizer_vs_ddp, "optimizer_vs_ddp-2": check_optimizer_vs_ddp,
    "control_plane": check_control_plane, "autotune": check_autotune,
    "finite_check": check_finite_check,
    "cpu_allreduce": check_cpu_allreduce, "overhead-1": check_overhead, "overhead-2": check_overhead,
    "startup": check_startup, "timeline_overhead": check_timeline_overhead,
    "mismatch_exit": check_mismatch_exit, "pack_bw": check_pack_bw, "verify_gpu": check_verify_gpu,
    "step_profile": check_step_profile, "reducer_host_cost-2": check_reducer_host_cost,
}


# -- summaries of the scripts above that have no test file of their own, on empty input ------------


def _load(name: str):
    """A benchmark script as a module, loaded once (benchmarks/ is not a package)."""
    import importlib.util
    import sys

    key = f"smoke_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).resolve().parent.parent / "benchmarks"
                                                      / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def test_summary_helpers_answer_none_for_nothing(tmp_path):
    stats = _load("bench_stats")
    assert stats.median([]) is None and stats.quartiles([1.0]) is None and stats.value_range([]) is None
    assert stats.percentile([], 0.9) is None and stats.ratio(1.0, 0.0) is None and stats.ratio(None, 1.0) is None
    assert stats.quartiles([1.0, 3.0]) == [1.5, 2.5]  # inside the range, even for two values
    assert stats.fmt(None, ".2f") == stats.fmt(float("nan"), ".2f") == "n/a" and stats.fmt(1.234, ".2f") == "1.23"
    stats.write_json(str(tmp_path / "x" / "d.json"), {"a": [float("inf"), 1.0], "b": float("nan")})
    assert json.loads((tmp_path / "x" / "d.json").read_text()) == {"a": [None, 1.0], "b": None}


def test_startup_and_cpu_allreduce_and_pack_bw_summaries_of_nothing(capsys):
    startup = _load("startup")
    assert startup.cell([], []) == "not measured" and startup.cell([], ["timed out after 1 s"]) == "failed"
    assert startup.cell([2.0], ["exit status 1: boom"]).endswith(" 1 failed")
    args = startup.parse_args(["--quick"])
    rows = startup.report(args, ["gpucomm-run"], {"first": {}, "exit": {}}, {("gpucomm-run", 2): ["boom"]})
    assert rows == [{"launcher": "gpucomm-run", "ranks": 2, "first_allreduce_s": [], "exit_s": [],
                     "median_first_allreduce_s": None, "failures": ["boom"]}]
    assert "failed" in capsys.readouterr().out

    cpu = _load("cpu_allreduce")
    empty = cpu.impl_summary({"small": [], "large": []}, 1 << 20)
    assert empty["small_median_us"] is None and empty["large_algbw_GBps"] is None and empty["small_ops"] == 0
    assert [cpu.per_round(10, 4, r) for r in range(4)] == [3, 3, 2, 2] and cpu.per_round(1, 5, 4) == 0

    pack = _load("pack_bw")
    assert pack.targets([], {}) == dict.fromkeys(
        ["pack_unpack_ge_85pct_d2d_64MiB_and_resnet50", "unpack_with_average_ge_85pct_d2d_resnet50",
         "casts_ge_85pct_d2d", "tiny_1000_within_3x_d2d", "resnet50_host_us_per_launch_le_30"], False)


def test_model_check_adds_the_wait_for_the_slower_rank_on_each_step(monkeypatch):
    monkeypatch.setenv("GPUCOMM_FUSION_BY_READINESS", "0")  # model_check sets it at import; keep it undone
    check = _load("model_check")
    from gpucomm.tuning.profile import Profile

    def prof(steps):
        return Profile("m", 1, ["w"], [4], [0.1], 0.1, 0.2, extra={"step_s": steps})

    # medians 1.0 and 1.0, but on two steps of three one rank is slow: the job's median step is 1.2
    assert check.sync_wait([prof([1.0, 1.0, 1.2]), prof([1.2, 1.0, 1.0])]) == pytest.approx(0.2)
    assert check.sync_wait([prof([1.0, 1.1, 1.2]), prof([1.0, 1.1, 1.2])]) == 0.0  # in step: no wait
    assert check.sync_wait([prof([1.0, 1.2, 1.0])]) == 0.0  # one rank waits for nobody
    assert check.sync_wait([prof([1.0]), Profile("m", 1, ["w"], [4], [0.1], 0.1, 0.2)]) == 0.0  # no per-step times


def test_sync_recorder_keeps_each_sync_warnings_stack_and_lets_other_warnings_through(monkeypatch):
    """benchmarks/sync_check.py's plumbing. torch's sync debug mode itself needs CUDA (the GPU test
    tests/test_gpu_data_plane.py uses it for real); here its switch is recorded and the warnings torch would
    raise at a synchronizing call are raised by hand, from two threads."""
    import threading
    import warnings

    import torch

    check = _load("sync_check")
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    package = str(Path(__file__).resolve().parent)  # "ours": this test's frames
    message = f"{check.SYNC_WARNING} (cudaStreamSynchronize)"

    def sync_here() -> None:
        warnings.warn(message, UserWarning)

    others = []
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("default")
        with check.SyncRecorder(package) as recorder:
            for _ in range(3):  # the same line thrice: recorded thrice, not once per location
                sync_here()
            t = threading.Thread(target=sync_here, name="hook-thread")
            t.start()
            t.join()
            warnings.warn("something else", DeprecationWarning)
        others = [str(w.message) for w in outside]
    assert modes == ["warn", 0]  # switched on, then back to what it was
    assert [thread for thread, _ in recorder.records] == ["MainThread"] * 3 + ["hook-thread"]
    assert len(recorder.ours()) == 4 and all("sync_here" in frames[-1] for _, frames in recorder.ours())
    [(line, count)] = recorder.by_line().items()  # the four came from one line, named from the package's parent
    assert count == 4 and line.startswith("tests/test_benchmarks_smoke.py:") and line.endswith("(sync_here)"), line
    assert others == ["something else"]  # not swallowed, and the sync warnings were not shown
    assert check.SyncRecorder("/nowhere").ours() == []


def test_a_sync_recorder_that_cannot_start_changes_no_warning_state():
    import warnings

    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA starts here: the recorder would work")
    check = _load("sync_check")
    filters, shown = list(warnings.filters), warnings.showwarning
    with pytest.raises((AssertionError, RuntimeError)):  # CPU torch: not compiled with CUDA; CUDA torch: no driver
        with check.SyncRecorder("/nowhere"):
            pass
    assert warnings.filters == filters and warnings.showwarning is shown


# -- the fair anchors' pieces (benchmarks/anchors.py), without a job --------------------------------


def test_the_round_order_is_balanced_for_position_and_predecessor():
    anchors = _load("anchors")
    for n in range(1, 7):
        rows = anchors.williams_rows(n)
        assert len(rows) == (n if n % 2 == 0 else 2 * n) == anchors.balanced_rounds(n)
        assert all(sorted(row) == list(range(n)) for row in rows)
        for place in range(n):  # every variant in every place equally often
            assert sorted(row[place] for row in rows) == sorted(list(range(n)) * (len(rows) // n))
        pairs = [(row[i], row[i + 1]) for row in rows for i in range(n - 1)]
        if n > 1:  # every variant right after every other one equally often
            assert len(set(pairs)) == n * (n - 1) and len(pairs) % len(set(pairs)) == 0
            assert all(pairs.count(p) == len(pairs) // (n * (n - 1)) for p in set(pairs))
    names = ["gpucomm", "ddp-default", "ddp-best", "no-comm"]
    assert [o[0] for o in anchors.round_orders(names, 8)] == names * 2
    assert anchors.balance_note(4, 8) is None and "use a multiple of 4" in anchors.balance_note(4, 6)
    assert "use a multiple of 6" in anchors.balance_note(3, 4)  # odd: twice the rows


def test_socket_settings_apply_only_when_ranks_share_a_gpu_and_the_user_wins():
    anchors = _load("anchors")
    env = {}
    assert anchors.tune_sockets(env) == {"single_gpu_test": False, "values": None, "set_by": None, "problems": []}
    assert env == {}  # ranks with a GPU each: NCCL's own choice stays
    env = {"GPUCOMM_SINGLE_GPU_TEST": "1"}
    rec = anchors.tune_sockets(env)
    assert env["NCCL_SOCKET_NTHREADS"] == "4" and env["NCCL_NSOCKS_PERTHREAD"] == "4"
    assert rec["set_by"] == "this benchmark" and rec["problems"] == [] and rec["values"] == anchors.SOCKET_VARS
    assert "NCCL_SOCKET_NTHREADS=4, NCCL_NSOCKS_PERTHREAD=4" in anchors.socket_text(rec)
    env = {"GPUCOMM_SINGLE_GPU_TEST": "1", "NCCL_SOCKET_NTHREADS": "8", "NCCL_NSOCKS_PERTHREAD": "16"}
    rec = anchors.tune_sockets(env)
    assert env["NCCL_SOCKET_NTHREADS"] == "8" and rec["set_by"].startswith("the environment")
    assert len(rec["problems"]) == 1 and "= 128 > 64" in rec["problems"][0]
    assert "WARNING" in anchors.socket_text(rec)
    assert anchors.socket_env({"NCCL_SOCKET_NTHREADS": "2"}) == {"NCCL_NSOCKS_PERTHREAD": "4"}
    assert anchors.socket_problems({"NCCL_SOCKET_NTHREADS": "32", "NCCL_NSOCKS_PERTHREAD": "1"})[0].startswith(
        "NCCL_SOCKET_NTHREADS=32: NCCL takes 1..16")


def test_counters_read_as_zero_when_a_gpucomm_lacks_them_and_the_floor_arithmetic():
    anchors = _load("anchors")
    delta = anchors.counter_delta({"collectives": 2}, {"collectives": 5, "sync_fast_ops": 3})
    assert delta["collectives"] == 3 and delta["sync_fast_ops"] == 3 and delta["grad_bucket_views"] == 0
    assert set(delta) == set(anchors.COUNTERS) and not anchors.reducer_ran(anchors.counter_delta({}, {}))
    assert anchors.reducer_ran({"schedule_steps": 1}) and anchors.reducer_ran({"local_ops": 4})
    env = {}
    anchors.ask_one_rank_reducer(True, env)
    assert env == {"GPUCOMM_ONE_RANK_REDUCER": "1"}
    anchors.ask_one_rank_reducer(False, env)
    assert env == {"GPUCOMM_ONE_RANK_REDUCER": "0"}
    assert anchors.gpucomm_label(1, True) == "gpucomm-reducer-on" and anchors.gpucomm_label(2, False) == "gpucomm"
    rounds = {"gpucomm": [1.2, 1.3], "ddp-best": [1.4, 1.6], "no-comm": [1.0, 1.0]}
    added = anchors.added_over_floor(rounds)
    assert set(added) == {"gpucomm", "ddp-best"} and added["gpucomm"]["median"] == pytest.approx(0.25)
    assert anchors.added_ratio(added) == pytest.approx(0.25 / 0.5)
    assert anchors.added_ratio({"gpucomm": {"median": 0.1}, "ddp-best": {"median": -0.1}}) is None
    paired = anchors.paired_ratios([2.0, 3.0, 1.0], [1.0, 0.0, 2.0])  # a zero round is left out
    assert paired["round_ratios"] == [2.0, 0.5] and paired["median"] == pytest.approx(1.25)
