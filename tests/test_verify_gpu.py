"""The one-command GPU verification run, checked without a GPU: its plan passes each script's own
argument parser (ResNet-50 with the kernels and with the forced fallback included), it shares one GPU
through the single-GPU test mode, it refuses to run without a GPU, a hanging step is stopped (pytest
with its junit XML still written), and its committed summary (summary.json + summary.md) is built from
result files in the formats the scripts write: real CPU runs of collectives.py, optimizer_vs_ddp.py and
pytest, and files written key for key as pack_bw.py, train.py and a CUDA optimizer_vs_ddp.py write them.
The summary of the CPU smoke runs' JSON is also in tests/test_benchmarks_smoke.py (``--summarize-only``)."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from gpucomm.backends.base import torch_at_least
from tests.harness import PYTHON, ROOT, run

sys.path.insert(0, str(ROOT / "benchmarks"))
import verify_gpu  # noqa: E402

MIB = 1 << 20
NO_GPU = not verify_gpu.gpu_count()


def _load(script: str):
    """A benchmark script as a module (benchmarks/ is not a package), loaded once."""
    name = "verify_plan_" + script.rsplit("/", 1)[-1].removesuffix(".py")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


# -- the plan -------------------------------------------------------------------------------------------


PLAN = ["gpu tests", "pack_bw", "collectives 1 rank(s)", "resnet50 2 ranks kernels", "resnet50 2 ranks packed",
        "resnet50 1 rank reducer-on", "resnet50 1 rank keep-views", "step profile 1 rank", "reducer host cost 1 rank",
        "finite check 2 ranks",
        "collectives 2 rank(s)",
        "train 1 rank", "train 2 ranks", "collectives 4 rank(s)"]
SOCKETS = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}
VARIANTS = ("gpucomm", "ddp-default", "ddp-best", "no-comm")


def _parse_optimizer_vs_ddp(argv: list[str], monkeypatch, capsys):
    """optimizer_vs_ddp.py's own parse_args (it reads sys.argv) on ``argv``; without a GPU its last check,
    --cuda's, stops it, and only then: every flag before it parsed."""
    module = _load("benchmarks/optimizer_vs_ddp.py")
    monkeypatch.setattr(sys, "argv", ["optimizer_vs_ddp.py", *argv])
    monkeypatch.setenv(verify_gpu.KERNELS_ENV, "1")  # its --fusion torch sets 0 here; restored after the test
    # its --zero-grad sets this one in this process: restored after the test too, or the rank processes that the
    # harness starts later in this pytest worker inherit it (a later test's zero_grad() then kept its views)
    monkeypatch.setenv(module.KEEP_VIEWS_VAR, "0")  # (setenv records its absence; a delenv of an absent one would not)
    if not NO_GPU:
        return module.parse_args()
    with pytest.raises(SystemExit) as stop:
        module.parse_args()
    assert stop.value.code == 2 and "--cuda needs a CUDA GPU" in capsys.readouterr().err
    return None


def test_plan_passes_each_scripts_own_parser(tmp_path, monkeypatch, capsys):
    for name in SOCKETS:
        monkeypatch.delenv(name, raising=False)
    steps = verify_gpu.plan(tmp_path, gpus=1, quick=False)
    (tmp_path / "raw").mkdir()  # train.py checks that its --json folder exists
    assert [s.name for s in steps] == PLAN
    assert sum(s.timeout for s in steps[:6]) <= 540  # the most telling steps fit the default budget
    for step in steps[1:]:
        script = next(a for a in step.argv if a.startswith("benchmarks/"))
        argv = step.argv[step.argv.index(script) + 1:]
        assert step.json_path.parent == tmp_path / "raw" and str(step.json_path) in argv
        if script.endswith("optimizer_vs_ddp.py"):
            args = _parse_optimizer_vs_ddp(argv, monkeypatch, capsys)
        else:
            args = _load(script).parse_args(argv)  # SystemExit on a bad flag
        assert args is None or args.json == str(step.json_path)
        n = int(step.argv[step.argv.index("-np") + 1]) if "-np" in step.argv else 1
        assert ("--single-gpu-test" in step.argv) == (n > 1), step.argv  # one GPU: ranks share it
        # ranks that share the GPU get NCCL's socket threads for loopback; the others keep NCCL's defaults
        assert {k: step.env.get(k) for k in SOCKETS} == (SOCKETS if n > 1 else dict.fromkeys(SOCKETS)), step.env
        if "optimizer_vs_ddp.py" in script:  # the balanced order of 4 variants needs a multiple of 4 rounds
            assert int(argv[argv.index("--rounds") + 1]) % 4 == 0
    four = verify_gpu.plan(tmp_path, gpus=4, quick=False)
    assert all("--single-gpu-test" not in s.argv and "NCCL_SOCKET_NTHREADS" not in s.env for s in four)
    monkeypatch.setenv("NCCL_SOCKET_NTHREADS", "2")  # the user's choice wins; the other one is still set
    shared = {s.name: s for s in verify_gpu.plan(tmp_path, gpus=1, quick=False)}["train 2 ranks"]
    assert "NCCL_SOCKET_NTHREADS" not in shared.env and shared.env["NCCL_NSOCKS_PERTHREAD"] == "4"
    assert "-m" in steps[0].argv and "gpu" in steps[0].argv and steps[0].interrupt_first  # pytest -m gpu


def test_the_resnet50_pair_differs_only_in_where_gradients_live(tmp_path, monkeypatch):
    """Gradients living in their buckets (the default) against every bucket packed and unpacked by the
    kernels every step (GPUCOMM_GRADIENT_VIEWS=0): the measurement the default is chosen by."""
    for name in SOCKETS:
        monkeypatch.delenv(name, raising=False)
    by_name = {s.name: s for s in verify_gpu.plan(tmp_path, gpus=1, quick=False)}
    views, packed = by_name["resnet50 2 ranks kernels"], by_name["resnet50 2 ranks packed"]
    free = {"GPUCOMM_ZERO_GRAD_KEEPS_VIEWS": "0"}  # pinned: a caller's setting must not leak in
    assert views.env == {"GPUCOMM_FUSION_KERNELS": "1", "GPUCOMM_GRADIENT_VIEWS": "1", **free, **SOCKETS}
    assert packed.env == {"GPUCOMM_FUSION_KERNELS": "1", "GPUCOMM_GRADIENT_VIEWS": "0", **free, **SOCKETS}
    one = by_name["resnet50 1 rank reducer-on"]  # the one-rank reducer: one GPU of its own, no sockets
    assert one.env == {"GPUCOMM_FUSION_KERNELS": "1", "GPUCOMM_GRADIENT_VIEWS": "1", **free}
    assert one.argv[one.argv.index("-np") + 1] == "1"
    assert one.argv[one.argv.index("--one-rank-reducer") + 1] == "on" and "--single-gpu-test" not in one.argv
    keep = by_name["resnet50 1 rank keep-views"]  # the same run, with zero_grad() keeping the bucket views
    assert keep.env == {**one.env, "GPUCOMM_ZERO_GRAD_KEEPS_VIEWS": "1"}
    assert keep.argv[keep.argv.index("--zero-grad") + 1] == "keep-views"
    assert [a for a in keep.argv if a not in (str(keep.json_path), "--zero-grad", "keep-views")] == \
        [a for a in one.argv if a != str(one.json_path)]
    for step in (views, packed):
        argv = step.argv
        assert argv[argv.index("-np") + 1] == "2" and argv[argv.index("--model") + 1] == "resnet50"
        assert argv[argv.index("--fusion") + 1] == "kernels" and "--cuda" in argv
    assert [a for a in views.argv if a != str(views.json_path)] == [a for a in packed.argv if a != str(packed.json_path)]


def test_dry_run_prints_the_plan_and_creates_nothing(tmp_path, capsys, monkeypatch):
    for name in SOCKETS:
        monkeypatch.delenv(name, raising=False)
    assert verify_gpu.main(["--dry-run", "--out", str(tmp_path / "plan")]) == 0
    out = capsys.readouterr().out
    for name in PLAN:
        assert f"\n{name} " in out, name
    lines = {line.split("  limit")[0].strip(): line for line in out.splitlines()[1:]}
    assert "GPUCOMM_GRADIENT_VIEWS=0" in lines["resnet50 2 ranks packed"]
    assert "--fusion kernels" in lines["resnet50 2 ranks packed"] and "--model resnet50" in lines[
        "resnet50 2 ranks kernels"]
    assert "GPUCOMM_FUSION_KERNELS=1" in lines["resnet50 2 ranks kernels"]
    for name in ("resnet50 2 ranks kernels", "train 2 ranks", "collectives 4 rank(s)"):  # ranks share the GPU
        assert "NCCL_SOCKET_NTHREADS=" in lines[name] and "NCCL_NSOCKS_PERTHREAD=" in lines[name], lines[name]
    assert "NCCL_SOCKET_NTHREADS" not in lines["resnet50 1 rank reducer-on"]
    assert "--one-rank-reducer on" in lines["resnet50 1 rank reducer-on"]
    assert not (tmp_path / "plan").exists()
    assert verify_gpu.main(["--dry-run", "--results"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    folder = Path(re.search(r"output in (\S+)", header)[1])
    assert folder.parent == ROOT / "benchmarks" / "results" and re.match(r"\d{4}-\d\d-\d\d-", folder.name)
    assert not folder.exists()


def test_refuses_to_run_without_a_gpu(tmp_path):
    if not NO_GPU:
        pytest.skip("checks the no-GPU refusal; a GPU is visible here")
    for where in (["--out", str(tmp_path / "out")], ["--results"]):
        before = set((ROOT / "benchmarks" / "results").glob("*"))
        r = run([PYTHON, "benchmarks/verify_gpu.py", *where], timeout=120)
        assert r.returncode == 2 and r.stdout == ""
        (line,) = r.stderr.strip().splitlines()
        assert "no CUDA GPU" in line and "--dry-run" in line
        assert not (tmp_path / "out").exists() and set((ROOT / "benchmarks" / "results").glob("*")) == before


def test_conflicting_flags_are_refused(capsys):
    for argv in (["--out", "x", "--results"], ["--summarize-only", "--results"], ["--dry-run", "--summarize-only"],
                 ["--budget", "0"]):
        with pytest.raises(SystemExit) as stop:
            verify_gpu.parse_args(argv)
        assert stop.value.code == 2
    assert "--summarize-only needs the folder" in capsys.readouterr().err


def test_results_folder_names(tmp_path):
    assert verify_gpu.gpu_slug("NVIDIA H100 80GB HBM3", 1) == "h100-80gb-hbm3"
    assert verify_gpu.gpu_slug("NVIDIA H200", 8) == "8x-h200"
    first = verify_gpu.results_folder("2030-01-02", "h200", tmp_path)
    assert first == tmp_path / "2030-01-02-h200"
    first.mkdir()
    assert verify_gpu.results_folder("2030-01-02", "h200", tmp_path) == first  # no summary yet: reuse it
    (first / "summary.json").write_text("{}")
    assert verify_gpu.results_folder("2030-01-02", "h200", tmp_path) == tmp_path / "2030-01-02-h200-2"
    inside = ROOT / "benchmarks" / "results" / "2030-01-02-h200"
    assert verify_gpu.git_add_line(inside) == ("git add benchmarks/results/2030-01-02-h200/summary.json "
                                               "benchmarks/results/2030-01-02-h200/summary.md")
    assert "outside the checkout" in verify_gpu.git_add_line(tmp_path)


def test_raw_results_are_ignored_and_the_summary_is_not():
    base = "benchmarks/results/2030-01-02-h200/"
    r = run(["git", "check-ignore", "--no-index", base + "raw/gpu_tests.xml", base + "summary.txt",
             base + "summary.json", base + "summary.md"], timeout=60)
    assert r.stdout.split() == [base + "raw/gpu_tests.xml", base + "summary.txt"], r.stderr


# -- running steps ----------------------------------------------------------------------------------------


def test_a_silent_hanging_step_is_stopped_at_its_limit(tmp_path):
    step = verify_gpu.Step("hang", [PYTHON, "-c", "import time; time.sleep(120)"], 1.0)
    verify_gpu.run_step(step, tmp_path, budget_left=100.0)
    assert step.status == "timed out (1 s)"  # a step left to its end would have finished, not timed out


SAMPLE_TESTS = '''
import time
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_passes():
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n == 1, "n is not one\\nsecond line"

def test_skipped():
    pytest.skip("needs something absent")

@pytest.mark.xfail(reason="known")
def test_xfails():
    assert False

def test_errors(broken):
    pass

class TestGroup:
    def test_in_class(self):
        pass
'''


def test_a_stopped_pytest_still_leaves_its_outcomes(tmp_path):
    """The GPU-test step's limit sends SIGINT first: pytest writes its junit XML with what finished."""
    sample = tmp_path / "tests_src" / "test_hangs.py"
    sample.parent.mkdir()
    sample.write_text("import time\n\ndef test_quick():\n    pass\n\ndef test_hangs():\n    time.sleep(300)\n")
    out = tmp_path / "out"
    step = verify_gpu.Step("gpu tests", [PYTHON, "-m", "pytest", str(sample), "-v", "-p", "no:cacheprovider",
                                         "--rootdir", str(sample.parent), "--junitxml",
                                         str(out / "raw" / "gpu_tests.xml")], 8.0, interrupt_first=True)
    verify_gpu.run_step(step, out, budget_left=100.0)
    assert step.status == "timed out (8 s)"
    assert (out / "raw" / "gpu_tests.xml").exists() and step.data["source"] == "junit XML"
    assert [(c["id"].rsplit("::", 1)[-1], c["outcome"]) for c in step.data["cases"]] == [("test_quick", "passed")]


def test_dry_run_and_summary_only_need_no_gpu(tmp_path, capsys):
    assert verify_gpu.main(["--summarize-only", "--out", str(tmp_path)]) == 0  # nothing there yet
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert {s["status"] for s in doc["steps"]} == {"no results"} and all(s["figures"] == [] for s in doc["steps"])
    md = (tmp_path / "summary.md").read_text()
    assert "| NVIDIA driver | not recorded |" in md and md.count("No results") >= 4


def test_an_interrupted_run_summarizes_what_finished(tmp_path, monkeypatch):
    steps = [verify_gpu.Step(f"s{i}", [], 60) for i in range(3)]
    after = []

    def fake_run(step, out, left):
        if step.name == "s1":
            step.status = "interrupted"
            raise KeyboardInterrupt
        step.status = "ok"

    monkeypatch.setattr(verify_gpu, "run_step", fake_run)
    assert verify_gpu.run_steps(steps, tmp_path, 100.0, after_step=lambda: after.append(1)) is False
    assert [s.status for s in steps] == ["ok", "interrupted", "not run (interrupted)"] and after == [1]


# -- junit and pytest logs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample_pytest(tmp_path_factory):
    """A real pytest run over SAMPLE_TESTS: its junit XML and its -v output."""
    where = tmp_path_factory.mktemp("sample")
    (where / "suite").mkdir()
    (where / "suite" / "test_sample.py").write_text(SAMPLE_TESTS)
    r = run([PYTHON, "-m", "pytest", "suite/test_sample.py", "-v", "-p", "no:cacheprovider", "--rootdir",
             str(where), "--junitxml", str(where / "junit.xml")], cwd=where, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr  # some tests fail, on purpose
    return where, r.stdout


EXPECTED_OUTCOMES = {
    "suite/test_sample.py::test_passes": "passed",
    "suite/test_sample.py::test_param[1]": "passed",
    "suite/test_sample.py::test_param[2]": "failed",
    "suite/test_sample.py::test_skipped": "skipped",
    "suite/test_sample.py::test_xfails": "xfailed",
    "suite/test_sample.py::test_errors": "error",
    "suite/test_sample.py::TestGroup::test_in_class": "passed",
}


def test_junit_gives_every_test_its_outcome_and_first_message_line(sample_pytest):
    where, _ = sample_pytest
    parsed = verify_gpu.parse_junit(where / "junit.xml", where)
    assert {c["id"]: c["outcome"] for c in parsed["cases"]} == EXPECTED_OUTCOMES
    messages = {c["id"].rsplit("::", 1)[-1]: c["message"] for c in parsed["cases"]}
    assert "n is not one" in messages["test_param[2]"] and "second line" not in messages["test_param[2]"]
    assert "fixture broke" in messages["test_errors"] and "needs something absent" in messages["test_skipped"]
    assert parsed["counts"] == {"passed": 3, "failed": 1, "error": 1, "skipped": 1, "xfailed": 1}
    assert verify_gpu.summarize_tests(verify_gpu.Step("gpu tests", [], 1, data=parsed)) == [
        "3 passed, 1 failed, 1 errors, 1 skipped, 1 xfailed"]


def test_the_pytest_log_stands_in_when_no_xml_was_written(sample_pytest, tmp_path):
    where, stdout = sample_pytest
    from_log = verify_gpu.parse_pytest_log(stdout)
    assert {c["id"]: c["outcome"] for c in from_log["cases"]} == EXPECTED_OUTCOMES
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "gpu_tests.log").write_text(stdout)
    step = verify_gpu.Step("gpu tests", [], 1)
    verify_gpu.load_results(step, tmp_path)
    lines = verify_gpu.summarize_tests(step)
    assert lines[0] == "3 passed, 1 failed, 1 errors, 1 skipped, 1 xfailed" and "pytest log" in lines[1]
    (tmp_path / "raw" / "gpu_tests.xml").write_text("<testsuites><testsuite")  # cut off while written
    verify_gpu.load_results(step, tmp_path)
    assert "pytest log" in step.data["source"]


# -- the committed summary, from result files in the scripts' formats ---------------------------------------


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    """Real 1-rank CPU runs of collectives.py, optimizer_vs_ddp.py and step_profile.py, the JSON they wrote."""
    where = tmp_path_factory.mktemp("cpu_runs")
    runs = {"collectives": ["benchmarks/collectives.py", "--device", "cpu", "--quick", "--plot", ""],
            "optimizer": ["benchmarks/optimizer_vs_ddp.py", "--quick", "--model", "cnn"],
            "step_profile": ["benchmarks/step_profile.py", "--device", "cpu", "--model", "cnn", "--warmup", "1",
                             "--steps", "2", "--rounds", "2", "--top", "3", "--one-rank-reducer"],
            "reducer_cost": ["benchmarks/reducer_host_cost.py", "--quick"]}
    docs = {}
    for name, argv in runs.items():
        path = where / f"{name}.json"
        r = run([PYTHON, *argv, "--json", str(path)], timeout=180)
        assert r.returncode == 0 and not r.leftovers, r.stdout[-2000:] + r.stderr[-2000:]
        docs[name] = json.loads(path.read_text())
    return docs


def as_cuda_sweep(doc: dict, ranks: int) -> dict:
    """A 1-rank CPU sweep's JSON as a GPU run at ``ranks`` writes it: the same rows with busbw from
    collectives.py's own factor for ``ranks``, plus raw NCCL rows (a CPU sweep has none) at 0.8 x
    gpucomm's time."""
    factor = _load("benchmarks/collectives.py").busbw_factor
    doc = copy.deepcopy(doc)
    doc["env"].update(ranks=ranks, device="cuda", single_gpu_test=ranks > 1, not_measured={})
    for r in doc["results"]:
        for place in ("out_of_place", "in_place"):
            if r[place]:
                r[place]["busbw"] = r[place]["algbw"] * factor(r["collective"], ranks)
    nccl = []
    for r in doc["results"]:
        if r["impl"] == "gpucomm":
            twin = copy.deepcopy(r)
            twin["impl"] = "nccl"
            for place in ("out_of_place", "in_place"):
                if twin[place]:
                    twin[place]["time_us"] *= 0.8
                    twin[place]["algbw"] /= 0.8
                    twin[place]["busbw"] /= 0.8
            nccl.append(twin)
    doc["results"] += nccl
    return doc


STEP_S = {"gpucomm": 0.125, "ddp-default": 0.110, "ddp-best": 0.100, "no-comm": 0.080}
SOCKET_RECORD = {"single_gpu_test": True, "values": SOCKETS, "set_by": "the environment (the user or verify_gpu.py)",
                 "problems": []}


def cuda_optimizer_run(cpu_doc: dict, asked: str | None, *, compiled: list[str], step_s: dict[str, float],
                       ranks: int = 2) -> dict:
    """optimizer_vs_ddp.py's JSON as a ResNet-50 run on GPU writes it: its figures from its own
    summarize() on 4 rounds of ``step_s`` (CPU time half the wall time), ``fusion`` its kernel_status() (run
    here, for its keys) with the kernels compiled on a GPU; at 2 ranks the ranks share the GPU (socket
    settings), at 1 rank the reducer ran (``asked`` None)."""
    module = _load("benchmarks/optimizer_vs_ddp.py")
    doc = copy.deepcopy(cpu_doc)
    wall = {v: [t] * 4 for v, t in step_s.items()}
    labels = {v: v for v in step_s}
    if ranks == 1:
        labels["gpucomm"] = "gpucomm-reducer-on"
    doc.update(model="resnet50", ranks=ranks, device="cuda", batch_size=32, labels=labels,
               **module.summarize(wall, {v: [t / 2 for t in w] for v, w in wall.items()}, labels))
    doc["nccl_sockets"] = SOCKET_RECORD if ranks > 1 else {"single_gpu_test": False, "values": None, "set_by": None,
                                                           "problems": []}
    doc["one_rank_reducer"] = {"applies": ranks == 1, "asked": ranks == 1, "variable": "GPUCOMM_ONE_RANK_REDUCER=1",
                               "verified": True if ranks == 1 else None}
    status = module.kernel_status()
    status.update(path="torch" if asked == "fallback" else "kernels", compiled=compiled,  # "packed": kernels
                  launch="driver" if compiled else None)
    doc["fusion"] = status
    return doc


SYNC_LINE = "gpucomm/dataplane/reducer.py:181(finish)"


def as_cuda_profile(doc: dict) -> dict:
    """A CPU step_profile.py JSON as a GPU run writes it: on CUDA, with the synchronizing calls torch's sync
    debug mode found (one per step through gpucomm, at ``SYNC_LINE``; one in the plain step)."""
    doc = copy.deepcopy(doc)
    doc["device"] = "cuda"
    doc["sync_calls"] = {
        "gpucomm": {"per_step": 2.0, "gpucomm_per_step": 1.0, "gpucomm_lines": [{"line": SYNC_LINE, "per_step": 1.0}],
                    "other_lines": [{"line": "torch/optim/sgd.py:80(step)", "per_step": 1.0}]},
        "plain": {"per_step": 1.0, "gpucomm_per_step": 0.0, "gpucomm_lines": [],
                  "other_lines": [{"line": "torch/optim/sgd.py:80(step)", "per_step": 1.0}]}}
    return doc


def pack_run(device_gbps: float) -> dict:
    """pack_bw.py's JSON, row for row as run_case() writes it (GB/s chosen here), targets by its targets()."""
    module = _load("benchmarks/pack_bw.py")
    share = {"kernel": 0.9, "kernel_api": 0.85, "fallback": 0.6, "cat_split": 0.5, "d2d": 1.0}
    rows = []
    for case, count, wire, nbytes in (("one_64MiB", 1, "float32", 128 * MIB), ("resnet50", 161, "float32", 204448256)):
        for method, part in share.items():
            for op in ("pack", "unpack"):
                gbps = device_gbps * part
                rows.append({"case": case, "tensors": count, "wire": wire, "method": method, "op": op,
                             "gpu_us": nbytes / gbps / 1e3, "bytes": nbytes, "gbps": gbps, "host_us": 12.5,
                             "pct_of_d2d": 100.0 * part})
    costs = {"driver_pack": 12.5, "driver_unpack": 13.0, "driver_ran_as_driver": 1.0}
    return {"benchmark": "pack_bw", "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "python": "3.12.3",
            "iters": 10, "warmup": 3, "rows": rows, "host_costs_us": costs, "targets": module.targets(rows, costs),
            "kernels": {"usable": True, "reason": "", "numpy_shims": [], "launch": "driver"}}


def train_run(ranks: int) -> dict:
    """train.py's JSON as its summarize() and main() write it (summarize() run here on 4 rounds of 5
    steps per variant), for one model."""
    import types

    train = _load("benchmarks/train.py")
    args = train.parse_args(["--device", "cuda", "--models", "resnet50", "--warmup", "3", "--rounds", "4",
                             "--steps-per-round", "5"])
    wall = {v: [5 * 32 / rate] * 4 for v, rate in zip(VARIANTS, (1000.0, 990.0, 1010.0, 1050.0))}
    real = train.hvd
    train.hvd = types.SimpleNamespace(size=lambda: ranks)  # summarize() asks the job's size, and nothing else
    try:
        model = train.summarize(wall, {v: [w / 2 for w in ws] for v, ws in wall.items()}, 25557032, (3, 224, 224),
                                args, None, "resnet50")
    finally:
        train.hvd = real
    labels = {v: v for v in VARIANTS} | ({"gpucomm": "gpucomm-reducer-on"} if ranks == 1 else {})
    reducer = {"applies": ranks == 1, "asked": ranks == 1, "variable": "GPUCOMM_ONE_RANK_REDUCER=1",
               "verified": True if ranks == 1 else None, "counters": {"schedule_steps": 20}}
    return {"benchmark": "train", "ranks": ranks, "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
            "threads_per_rank": 1, "batch_size": 32, "warmup": 3, "rounds": 4, "steps_per_round": 5, "quick": False,
            "torch": "2.11.0+cu130", "gpucomm": "0.1.0", "baseline": None, "notes": [], "labels": labels,
            "nccl_sockets": SOCKET_RECORD if ranks > 1 else {"single_gpu_test": False},
            "one_rank_reducer": reducer, "models": {"resnet50": model}}


@pytest.fixture(scope="module")
def summarized(cpu_runs, sample_pytest, tmp_path_factory):
    """A results folder as a GPU run leaves it (raw/ only), summarized by ``--summarize-only``."""
    out = tmp_path_factory.mktemp("results")
    raw = out / "raw"
    raw.mkdir()
    where, _ = sample_pytest
    (raw / "gpu_tests.xml").write_text((where / "junit.xml").read_text())
    files = {
        "collectives_1.json": as_cuda_sweep(cpu_runs["collectives"], 1),
        "collectives_2.json": as_cuda_sweep(cpu_runs["collectives"], 2),
        "resnet50_2_kernels.json": cuda_optimizer_run(cpu_runs["optimizer"], "kernels",
                                                      compiled=["pack_f32_f32", "unpack_f32_f32"], step_s=STEP_S),
        "resnet50_2_packed.json": cuda_optimizer_run(cpu_runs["optimizer"], "packed",
                                                     compiled=["pack_f32_f32", "unpack_f32_f32"],
                                                     step_s={**STEP_S, "gpucomm": 0.150}),
        "resnet50_1_reducer-on.json": cuda_optimizer_run(cpu_runs["optimizer"], None, compiled=["pack_f32_f32"],
                                                         step_s={**STEP_S, "gpucomm": 0.090}, ranks=1),
        "resnet50_1_keep-views.json": {**cuda_optimizer_run(cpu_runs["optimizer"], None, compiled=["pack_f32_f32"],
                                                            step_s={**STEP_S, "gpucomm": 0.088}, ranks=1),
                                       "zero_grad": "keep-views"},
        "pack_bw.json": pack_run(2000.0),
        "step_profile_1.json": as_cuda_profile(cpu_runs["step_profile"]),
        "reducer_host_cost_1.json": {**cpu_runs["reducer_cost"], "device": "cuda:0"},
        "train_1.json": train_run(1),
        "finite_check_2.json": {"model": "resnet50", "device": "cuda:0", "ranks": 2, "batch_per_rank": 32,
                                "mode": "auto", "step_s": {"checked": 0.0905, "plain": 0.0900},
                                "ratio_checked_vs_plain": 1.0056, "ratio_quartiles": [1.001, 1.009],
                                "cost_pct_of_step": 0.56, "counters": {}, "rounds": 6, "steps_per_round": 4},
        "environment.json": verify_gpu.environment("0123abc"),
    }
    for name, doc in files.items():
        (raw / name).write_text(json.dumps(doc))
    assert verify_gpu.main(["--summarize-only", "--out", str(out)]) == 0
    doc = json.loads((out / "summary.json").read_text())
    return out, doc, (out / "summary.md").read_text(), files


def test_summary_json_holds_every_part(summarized):
    out, doc, _, files = summarized
    assert doc["schema"] == 2 and doc["environment"] == files["environment.json"]
    statuses = {s["name"]: s["status"] for s in doc["steps"]}
    assert statuses == {**{n: "results found" for n in PLAN},
                        "train 2 ranks": "no results", "collectives 4 rank(s)": "no results"}
    tests = {c["id"]: c["outcome"] for c in doc["gpu_tests"]["cases"]}
    assert len(tests) == len(EXPECTED_OUTCOMES) and tests["suite.test_sample::test_param[2]"] == "failed"
    assert set(doc["figures"]) == {"resnet50", "pack_bw", "collectives", "train", "finite_check", "step_profile",
                                   "reducer_host_cost"}
    assert doc["figures"]["finite_check"]["cost_pct_of_step"] == 0.56
    finite = next(s for s in doc["steps"] if s["name"] == "finite check 2 ranks")
    assert "+0.56% of the step" in finite["figures"][0] and "checked (auto)" in finite["figures"][0], finite
    assert [c["ranks"] for c in doc["figures"]["collectives"]] == [1, 2]
    assert sorted(p.name for p in out.iterdir()) == ["raw", "summary.json", "summary.md", "summary.txt"]


def test_the_step_profile_names_the_host_time_added_and_the_lines_that_wait_for_the_gpu(summarized):
    _, doc, md, files = summarized
    run, f = files["step_profile_1.json"], doc["figures"]["step_profile"]
    assert f["cpu_ms_per_step"] == run["cpu_ms_per_step"] and f["issue_ms_per_step"] == run["issue_ms_per_step"]
    assert f["gpucomm_sync_calls_per_step"] == 1.0 and f["gpucomm_sync_lines"][0]["line"] == SYNC_LINE
    assert f["gpucomm_python_calls_per_step"] == run["profiles"]["gpucomm"]["gpucomm_calls_per_step"] > 0
    assert f["counters_per_step"]["collectives"] > 0  # the one-rank reducer ran: its counters moved
    step = next(s for s in doc["steps"] if s["name"] == "step profile 1 rank")
    issue = run["issue_ms_per_step"]
    assert f"added {issue['gpucomm'] - issue['plain']:.2f}" in step["figures"][1], step["figures"]
    assert f"1 through gpucomm ({SYNC_LINE} x1); the plain step's 1" in step["figures"][2], step["figures"]
    assert "Python calls per step in gpucomm: " in step["figures"][3] and "heaviest" in step["figures"][3]
    assert "synchronizing CUDA calls per step" in md


def test_the_reducer_host_cost_shows_each_variants_added_time_beside_ddp_best(summarized):
    _, doc, md, files = summarized
    run, f = files["reducer_host_cost_1.json"], doc["figures"]["reducer_host_cost"]
    assert f["parameters"] == run["parameters"] == 161 and f["device"] == "cuda:0" and f["reducer_ran"] is True
    assert f["variants"]["ddp-best"]["added_wall_ms"] == run["variants"]["ddp-best"]["added_wall_ms"]
    assert f["gpucomm_added_over_ddp_added"] == run["gpucomm_added_over_ddp_added"]
    step = next(s for s in doc["steps"] if s["name"] == "reducer host cost 1 rank")
    share = run["gpucomm_added_over_ddp_added"]["ddp-best"]
    assert f"gpucomm / ddp-best added {share:.2f}" in step["figures"][2], step["figures"]
    assert "one-rank reducer ran" in step["figures"][2] and "161 parameters" in step["figures"][0]
    assert "gpucomm-reducer-on" in step["figures"][1] and "reducer host cost 1 rank" in md


def test_collectives_figures_put_gpucomm_beside_nccl_and_torch(summarized):
    _, doc, md, files = summarized
    sweep = files["collectives_2.json"]
    one, two = doc["figures"]["collectives"]
    assert one["metric"] == "algbw" and two["metric"] == "busbw" and two["single_gpu_test"]
    colls = list(dict.fromkeys(r["collective"] for r in sweep["results"]))
    assert [r["collective"] for r in two["latency_us"]] == colls == [r["collective"] for r in two["bandwidth_gbps"]]
    for coll in colls:
        def cell(impl: str, size: int) -> dict:
            return next(r["out_of_place"] for r in sweep["results"]
                        if (r["collective"], r["impl"], r["bytes"]) == (coll, impl, size))

        sizes = sorted(r["bytes"] for r in sweep["results"] if (r["collective"], r["impl"]) == (coll, "gpucomm"))
        small = next(r for r in two["latency_us"] if r["collective"] == coll)
        large = next(r for r in two["bandwidth_gbps"] if r["collective"] == coll)
        assert (small["bytes"], large["bytes"]) == (sizes[0], sizes[-1])
        if not any((r["collective"], r["impl"]) == (coll, "torch") for r in sweep["results"]):
            # the anchor could not run it (torch 2.1's Gloo has no reduce-scatter): n/a, not a number
            assert coll == "reducescatter" and not torch_at_least(2, 13), coll
            assert small["torch"] is None and large["torch"] is None and small["gpucomm_vs_torch"] is None, small
            assert f"| {coll} | {verify_gpu.size_text(sizes[0])} | {small['gpucomm']:.1f} | {small['nccl']:.1f} | n/a |" \
                in md, md
            continue
        for impl in ("gpucomm", "nccl", "torch"):
            assert small[impl] == cell(impl, sizes[0])["time_us"] and large[impl] == cell(impl, sizes[-1])["busbw"]
        assert small["gpucomm_vs_nccl"] == pytest.approx(small["gpucomm"] / small["nccl"])
        assert large["gpucomm_vs_torch"] == pytest.approx(large["gpucomm"] / large["torch"])
        row = (f"| {coll} | {verify_gpu.size_text(sizes[0])} | {small['gpucomm']:.1f} | {small['nccl']:.1f} | "
               f"{small['torch']:.1f} | {small['gpucomm_vs_nccl']:.3f} | {small['gpucomm_vs_torch']:.3f} |")
        assert row in md, row
    assert "### 2 rank(s), sharing one GPU, NCCL over loopback sockets: #wrong 0" in md
    assert "### 1 rank(s), one GPU each" in md and "algbw GB/s:" in md and "busbw GB/s:" in md


def test_resnet50_rows_prove_which_fusion_path_ran(summarized):
    _, doc, md, _ = summarized
    kernels, packed, one, keep = doc["figures"]["resnet50"]
    assert (kernels["fusion_asked"], kernels["fusion_path"], kernels["compiled_kernels"]) == ("kernels", "kernels", 2)
    assert (packed["fusion_asked"], packed["fusion_path"], packed["compiled_kernels"]) == ("packed", "kernels", 2)
    assert kernels["path_verified"] and packed["path_verified"] and kernels["kernel_fallbacks"] == 0
    assert kernels["gpucomm_images_per_s"] == pytest.approx(2 * 32 / 0.125)
    assert set(kernels["gradient_path"]) >= {"grad_bucket_views", "grad_bucket_packs", "per_step"}
    assert "### resnet50 2 ranks kernels (batch 32 per rank)" in md
    assert ("fusion asked: kernels; path that ran: kernels, kernels compiled 2, kernel_fallbacks 0; as asked: yes"
            in md)
    assert ("fusion asked: packed (GPUCOMM_GRADIENT_VIEWS=0); path that ran: kernels, kernels compiled 2, "
            "kernel_fallbacks 0; as asked: yes") in md


def test_resnet50_figures_stand_beside_both_ddp_anchors_and_the_floor(summarized):
    _, doc, md, _ = summarized
    kernels, _, one, keep = doc["figures"]["resnet50"]
    assert list(kernels["variants"]) == list(VARIANTS)
    g = kernels["variants"]["gpucomm"]
    assert (g["wall_ms"], g["cpu_ms"]) == (pytest.approx(125.0), pytest.approx(62.5))
    assert g["vs_ddp_best"] == pytest.approx(1.25) and g["vs_ddp_default"] == pytest.approx(0.125 / 0.110)
    assert kernels["variants"]["no-comm"]["vs_ddp_best"] == pytest.approx(0.8)
    added = kernels["added_over_floor"]
    assert added["wall_ms"] == pytest.approx({"gpucomm": 45.0, "ddp-default": 30.0, "ddp-best": 20.0})
    assert added["gpucomm_vs_ddp_best_wall"] == pytest.approx(2.25) and added["target"] == 0.5
    # each variant beside its anchors, wall and CPU, in one table per run
    assert "| gpucomm | 125.0 | 125.0-125.0 | 62.5 | 62.5-62.5 | 512 | 1.250 | 1.136 |" in md
    assert "| ddp-best | 100.0 | 100.0-100.0 | 50.0 | 50.0-50.0 | 640 | 1.000 | 0.909 |" in md
    assert "| no-comm | 80.0 | 80.0-80.0 | 40.0 | 40.0-40.0 | 800 | 0.800 | 0.727 |" in md
    assert ("added over no-comm, wall / CPU ms per step: gpucomm 45.0 / 22.5 | ddp-default 30.0 / 15.0 | "
            "ddp-best 20.0 / 10.0; gpucomm / ddp-best added 2.25 wall, 2.25 CPU (target <= 0.5)") in md
    assert "NCCL sockets (ranks share a GPU): NCCL_SOCKET_NTHREADS=4, NCCL_NSOCKS_PERTHREAD=4" in md
    # the one-rank reducer: its own run, its label, its proof, no fusion verdict and no sockets
    assert one["fusion_asked"] is None and one["path_verified"] is None and one["reducer_verified"] is True
    assert one["variants"]["gpucomm"]["label"] == "gpucomm-reducer-on"
    assert one["added_over_floor"]["gpucomm_vs_ddp_best_wall"] == pytest.approx(0.5)
    steps = {s["name"]: s for s in doc["steps"]}
    lines = steps["resnet50 1 rank reducer-on"]["figures"]
    assert steps["resnet50 1 rank reducer-on"]["status"] == "results found"
    assert lines[0] == "wall ms/step: gpucomm-reducer-on 90.0 | ddp-default 110.0 | ddp-best 100.0 | no-comm 80.0"
    assert lines[1] == "CPU ms/step: gpucomm-reducer-on 45.0 | ddp-default 55.0 | ddp-best 50.0 | no-comm 40.0"
    assert "one-rank reducer: asked (GPUCOMM_ONE_RANK_REDUCER=1), ran (gpucomm's counters moved)" in lines
    assert not any(line.startswith(("fusion path", "NCCL sockets")) for line in lines)
    # the same run with zero_grad() keeping the bucket views: said so, beside the counters that prove it
    assert (keep["run"], keep["zero_grad"], one["zero_grad"]) == ("resnet50 1 rank keep-views", "keep-views", "free")
    # the sample's counters packed (it is the default run's, relabelled): the summary says the proof failed
    assert keep["zero_grad_verified"] is False and one["zero_grad_verified"] is None
    assert ("zero_grad: keep-views (benchmarks/optimizer_vs_ddp.py --zero-grad); no timed step packed: NO"
            in steps[keep["run"]]["figures"])
    assert not any(line.startswith("zero_grad") for line in lines)
    two = steps["resnet50 2 ranks kernels"]["figures"]
    assert two[2] == ("gpucomm / ddp-best 1.250 (round quartiles 1.250-1.250), / ddp-default 1.136 "
                      "(round quartiles 1.136-1.136)")
    assert ("NCCL sockets (ranks share a GPU): NCCL_SOCKET_NTHREADS=4, NCCL_NSOCKS_PERTHREAD=4 (set by the "
            "environment (the user or verify_gpu.py))") in two


def test_a_resnet50_run_on_the_wrong_path_is_flagged(cpu_runs):
    step = verify_gpu.Step("resnet50 2 ranks kernels", [], 1)
    # kernels asked, but the run compiled none and gave them up (a broken CUDA Python stack)
    step.data = cuda_optimizer_run(cpu_runs["optimizer"], "kernels", compiled=[], step_s=STEP_S)
    step.data.update(kernel_fallbacks=1)
    step.data["fusion"].update(path="torch", reason="KernelUnavailableError: no driver")
    assert verify_gpu.path_flag(step) == ", fusion path NOT as asked"
    assert verify_gpu.summary_lines(step)[-1] == ("fusion path torch (0 kernels compiled, kernel_fallbacks 1): NOT as "
                                                  "asked; reason: KernelUnavailableError: no driver")
    fallback = verify_gpu.Step("resnet50 2 ranks fallback", [], 1)
    fallback.data = cuda_optimizer_run(cpu_runs["optimizer"], "fallback", compiled=["pack_f32_f32"],
                                       step_s=STEP_S)  # the variable did not reach it
    assert verify_gpu.path_flag(fallback) == ", fusion path NOT as asked"
    cpu = verify_gpu.Step("resnet50 2 ranks kernels", [], 1, data=cpu_runs["optimizer"])  # fusion: null on CPU
    assert verify_gpu.path_flag(cpu) == ", fusion path NOT as asked"


def test_a_one_rank_run_whose_reducer_did_not_run_is_flagged(cpu_runs):
    step = verify_gpu.Step("resnet50 1 rank reducer-on", [], 1)
    step.data = cuda_optimizer_run(cpu_runs["optimizer"], None, compiled=[], step_s=STEP_S, ranks=1)
    assert verify_gpu.path_flag(step) == ""
    step.data["one_rank_reducer"]["verified"] = False  # a gpucomm that ignores GPUCOMM_ONE_RANK_REDUCER
    assert verify_gpu.path_flag(step) == ", reducer NOT run"
    assert ("one-rank reducer: asked (GPUCOMM_ONE_RANK_REDUCER=1), NOT run (no gpucomm counter moved)"
            in verify_gpu.summary_lines(step))
    # the real 1-rank CPU run asked for it too: its JSON says what its gpucomm did
    real = cpu_runs["optimizer"]["one_rank_reducer"]
    assert real["applies"] and real["asked"] and real["variable"] == "GPUCOMM_ONE_RANK_REDUCER=1"
    assert isinstance(real["verified"], bool)


def test_pack_figures_show_each_method_as_a_share_of_d2d(summarized):
    _, doc, md, files = summarized
    pack = doc["figures"]["pack_bw"]
    assert [(r["case"], r["op"]) for r in pack["rows"]] == [("one_64MiB", "pack"), ("one_64MiB", "unpack"),
                                                            ("resnet50", "pack"), ("resnet50", "unpack")]
    assert all(r["kernel_pct_of_d2d"] == pytest.approx(90.0) and r["fallback_pct_of_d2d"] == pytest.approx(60.0)
               for r in pack["rows"])
    assert "| resnet50 | unpack | 2000 | 1800 | 90.0 | 60.0 | 50.0 | 12.5 |" in md
    assert pack["targets"] == files["pack_bw.json"]["targets"]
    assert "| pack_unpack_ge_85pct_d2d_64MiB_and_resnet50 | yes |" in md
    steps = {s["name"]: s["figures"] for s in doc["steps"]}
    assert "one_64MiB pack: 1800 GB/s = 90% of D2D, host 12.5 us" in steps["pack_bw"]


def test_markdown_names_the_machine_the_commit_and_each_failing_test(summarized):
    _, doc, md, _ = summarized
    commit = doc["environment"]["commit"]
    assert f"Commit `{commit['sha']}`" in md and commit["sha"]  # git's, or --commit's in a copy without .git
    assert "## Machine and stack" in md and re.search(r"\| NVIDIA driver \| (n/a \(NVML|\d)", md)
    for package in ("torch", "cupy", "numba", "numba-cuda", "numpy", "nvidia-ml-py", "cuda-bindings", "gpucomm"):
        assert re.search(rf"^\| {re.escape(package)} \| ", md, re.M), package
    assert "| NCCL | " in md
    failing = [line for line in md.splitlines() if "| failed |" in line or "| error |" in line]
    assert any("test_param[2]" in line and "n is not one" in line for line in failing)
    assert any("test_errors" in line and "fixture broke" in line for line in failing)
    assert "| train 2 ranks | no results | n/a | - |" in md
    assert "| 1 | resnet50 | gpucomm-reducer-on | 1000.0 | 32.00 | 16.00 | 0.990 | 1.010 | 0.952 | n/a |" in md
    assert "| 1 | resnet50 | no-comm | 1050.0 | 30.48 | 15.24 | 1.040 | 1.061 | 1.000 | n/a |" in md
    assert "1 rank(s), resnet50: added over no-comm" in md and "one-rank reducer: asked" in md


def test_the_commit_comes_from_git_or_from_the_flag(tmp_path, monkeypatch):
    facts = verify_gpu.commit_facts(None)
    head = run(["git", "rev-parse", "HEAD"], timeout=60).stdout.strip()
    assert facts["sha"] == head and facts["dirty"] in (True, False) and "given" not in facts
    assert verify_gpu.commit_facts("f" * 40)["given"] == "f" * 40  # disagrees with git: both kept
    monkeypatch.setattr(verify_gpu, "ROOT", tmp_path)  # a copied tree without .git
    assert verify_gpu.commit_facts("abc1234") == {"sha": "abc1234", "dirty": None,
                                                  "source": "--commit (no git checkout here)"}
    assert verify_gpu.commit_facts(None)["sha"] is None and "--commit" in verify_gpu.commit_facts(None)["source"]


# -- the one-line figures, on results of every shape -----------------------------------------------


def _collectives(ranks: int, rows: dict[str, dict[int, float]], metric: str = "busbw", **env) -> verify_gpu.Step:
    results = [{"collective": "allreduce", "impl": impl, "bytes": size,
                "out_of_place": {"algbw": bw if metric == "algbw" else 9.0, "busbw": bw if metric == "busbw" else 0.0,
                                 "wrong": 0},
                "in_place": {}}
               for impl, by_size in rows.items() for size, bw in by_size.items()]
    step = verify_gpu.Step(f"collectives {ranks} rank(s)", [], 1)
    step.data = {"env": {"ranks": ranks, **env}, "results": results}
    return step


def test_one_rank_collectives_compare_algbw_not_the_zero_busbw():
    # the bug: at 1 rank every busbw is 0, no ratio survived, and min() of nothing raised
    step = _collectives(1, {"gpucomm": {MIB: 2.0, 4 * MIB: 4.0}, "torch": {MIB: 4.0, 4 * MIB: 5.0}}, metric="algbw")
    assert verify_gpu.summary_lines(step) == [
        "#wrong over all collectives and sizes: 0",
        "allreduce algbw gpucomm/torch at >= 1 MiB: min 0.500, at 4 MiB 0.800 (4 vs 5 GB/s)"]


def test_collectives_summary_without_comparable_rows():
    both_zero = _collectives(2, {"gpucomm": {MIB: 0.0}, "torch": {MIB: 0.0}})
    assert verify_gpu.summary_lines(both_zero)[1] == "allreduce busbw gpucomm/torch: n/a (torch measured 0 GB/s)"
    small = _collectives(2, {"gpucomm": {4096: 1.0, 32768: 2.0}, "torch": {4096: 2.0, 32768: 4.0}},
                         not_measured={"nccl": "raw NCCL moves CUDA buffers only"})
    assert verify_gpu.summary_lines(small)[1:] == [
        "allreduce gpucomm/nccl: not measured (raw NCCL moves CUDA buffers only)",
        "allreduce busbw gpucomm/torch at 32768 B (the largest size; none >= 1 MiB): 0.500 (2 vs 4 GB/s)"]
    assert verify_gpu.summary_lines(_collectives(2, {})) == [
        "#wrong over all collectives and sizes: 0", "allreduce: gpucomm has no out-of-place allreduce rows: n/a"]
    assert verify_gpu.collectives_figures(_collectives(2, {}).data)["latency_us"] == []
    unchecked = _collectives(2, {"gpucomm": {MIB: 1.0}})
    unchecked.data["results"][0]["out_of_place"]["wrong"] = None  # -c 0
    assert verify_gpu.summary_lines(unchecked) == ["#wrong over all collectives and sizes: 0"]
    (row,) = verify_gpu.collectives_figures(unchecked.data)["bandwidth_gbps"]
    assert row["nccl"] is None and row["gpucomm_vs_nccl"] is None  # only gpucomm ran: no ratio, no error


def test_train_and_pack_summaries_of_partial_results():
    step = verify_gpu.Step("train 1 rank", [], 1)
    step.data = {"models": {"cnn": {"variants": {"gpucomm": {"samples_per_s_total": 10.0}}, "ratios": {}}}}
    assert verify_gpu.summary_lines(step) == [
        "cnn: samples/s gpucomm 10.0", "cnn: ms/step gpucomm n/a; CPU ms/step gpucomm n/a",
        "cnn: gpucomm / ddp-best n/a (round quartiles n/a), / ddp-default n/a, / no-comm n/a",
        "cnn: added over no-comm, wall / CPU ms per step: n/a; gpucomm / ddp-best added n/a wall, n/a CPU "
        "(target <= 0.5)"]
    pack = verify_gpu.Step("pack_bw", [], 1)
    pack.data = {"benchmark": "pack_bw", "skipped": "needs a CUDA GPU", "rows": [], "targets": {}}
    assert verify_gpu.summary_lines(pack) == ["skipped: needs a CUDA GPU"]
    assert verify_gpu.pack_figures(pack.data) == {"skipped": "needs a CUDA GPU"}
    assert "Skipped: needs a CUDA GPU" in verify_gpu.markdown({"figures": {"pack_bw": {"skipped": "needs a CUDA GPU"}}})
    tests = verify_gpu.Step("gpu tests", [], 1)
    assert verify_gpu.summary_lines(tests) == []  # no junit XML: the step shows its status only


def test_a_keep_views_run_is_verified_by_its_counters():
    def run(mode, packs, views=40):
        return {"zero_grad": mode, "gpucomm_counters": {"gpucomm": {"grad_bucket_packs": packs,
                                                                    "grad_bucket_views": views}}}
    assert verify_gpu.zero_grad_verified(run("keep-views", 0)) is True
    assert verify_gpu.zero_grad_verified(run("keep-views", 6)) is False  # a timed step packed: not what was asked
    assert verify_gpu.zero_grad_verified(run("keep-views", 0, views=0)) is False
    assert verify_gpu.zero_grad_verified(run("free", 6)) is None and verify_gpu.zero_grad_verified({}) is None
    assert verify_gpu.zero_grad_text({"zero_grad": "keep-views", "zero_grad_verified": True}).endswith(
        "no timed step packed: yes")
    assert verify_gpu.zero_grad_text({"zero_grad": "free"}) == ""
