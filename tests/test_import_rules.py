"""The package's import rules, read from the code (``tests/import_graph.py``; ``lint-imports`` checks
the layers of pyproject.toml on every CI run): no import runs up the layers, no modules import each
other in a circle, no module takes a private name from another (imported or read as an attribute),
and every import inside a function is one of the few listed here with its reason."""

from __future__ import annotations

from tests import import_graph

# (importing module, imported module) -> why the import waits until the function runs
DEFERRED = {
    ("gpucomm.dataplane.bucket_copy", "gpucomm.kernels"): "loads Numba: CPU buckets never need it",
    ("gpucomm.dataplane.bucket_copy", "gpucomm.kernels.bound"): "loads Numba: CPU buckets never need it",
    ("gpucomm.job", "gpucomm.job.setup"): "the job's machinery loads at init(): `import gpucomm.torch` stays light",
    ("gpucomm.kernels.availability", "gpucomm.kernels.compat"): "the NumPy shims for numba-cuda, read when asked",
    ("gpucomm.runner.check_build", "gpucomm.backends.nccl"): "--check-build probes CuPy only when asked",
    ("gpucomm.runner.check_build", "gpucomm.bootstrap.devices"): "--check-build probes NVML only when asked",
    ("gpucomm.runner.check_build", "gpucomm.kernels"): "--check-build probes Numba only when asked",
    ("gpucomm.runner.check_build", "gpucomm.kernels.launch"): "--check-build probes Numba only when asked",
    ("gpucomm.runner.check_build", "gpucomm.kernels.compat"): "--check-build probes Numba only when asked",
    ("gpucomm.scaling.sources", "gpucomm.tuning.measure"): "loads torch: only for a profile measured here",
    ("gpucomm.scaling.sources", "gpucomm.tuning.flops"): "loads torch: only for an analytic profile of a model",
    ("gpucomm.scaling.sources", "gpucomm.scaling.zoo"): "loads torchvision's models: only for --model",
    ("gpucomm.timeline.cli", "gpucomm.timeline.plot"): "loads matplotlib: only for a plot",
    ("gpucomm.torch", "gpucomm.backends.nccl"): "loads CuPy: only for hvd.nccl_built()",
}


def test_no_import_runs_up_the_layers():
    graph = import_graph.build()
    assert not import_graph.upward(graph), [f"{i.source}:{i.line} -> {i.target}" for i in import_graph.upward(graph)]


def test_no_import_cycles_counting_imports_inside_functions():
    assert import_graph.cycles(import_graph.build()) == []


def test_no_module_imports_or_reads_a_private_name_of_another():
    graph = import_graph.build()
    imported = [f"{i.source}:{i.line} <- {i.target}: {i.names}" for i in import_graph.private_names(graph)]
    read = [f"{a.source}:{a.line} reads {a.target}.{a.name}" for a in graph.private_reads]
    assert imported == [] and read == []


def test_every_import_inside_a_function_has_a_reason():
    inner = {(i.source, i.target) for i in import_graph.in_function(import_graph.build())}
    unlisted = sorted(inner - DEFERRED.keys())
    assert not unlisted, (f"imports inside functions without a reason: {unlisted}; import at the top of the module, "
                          f"or add the pair to DEFERRED with why it must wait")
    assert not DEFERRED.keys() - inner, f"listed but gone (remove from DEFERRED): {sorted(DEFERRED.keys() - inner)}"


SEAM = "gpucomm.torch.submission"
BELOW_THE_SEAM = ("gpucomm.job", "gpucomm.control", "gpucomm.dataplane")
EXTENDED = {("gpucomm.torch.zero_bucket", "gpucomm.dataplane.bucket_kinds"): ["Bucket"],
            ("gpucomm.torch.powersgd", "gpucomm.dataplane.bucket_kinds"): ["Bucket"]}


def test_the_torch_front_reaches_the_layers_below_only_through_its_seam():
    """Outside ``torch/submission.py`` the front imports nothing of the job, the control plane or the
    data plane, but the ``Bucket`` class ZeRO's and PowerSGD's buckets extend (issue 35: 16 front
    modules imported them in 31 places before the reducer moved into the data plane)."""
    crossing = [i for i in import_graph.build().imports
                if i.source.startswith("gpucomm.torch") and i.source != SEAM
                and any(i.target == t or i.target.startswith(t + ".") for t in BELOW_THE_SEAM)]
    unexpected = [f"{i.source}:{i.line} -> {i.target} {i.names}" for i in crossing
                  if EXTENDED.get((i.source, i.target)) != sorted(i.names)]
    assert unexpected == [], unexpected


def test_the_analyzer_sees_what_it_must_reject(tmp_path, monkeypatch):
    """A package with each fault once: the analyzer reports each (the rules above can fail)."""
    pkg = tmp_path / "gpucomm"
    for part in ("bootstrap", "job", "torch"):
        (pkg / part).mkdir(parents=True)
        (pkg / part / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "bootstrap" / "low.py").write_text("from ..job import high\n_secret = 1\n")  # upward, and half a cycle
    (pkg / "job" / "high.py").write_text("from ..bootstrap import low\nfrom ..bootstrap.low import _secret\n")
    (pkg / "torch" / "front.py").write_text("def f():\n    from ..job import high\n    high._x\n")
    monkeypatch.setattr(import_graph, "ROOT", tmp_path)
    monkeypatch.setattr(import_graph, "PACKAGE", pkg)
    graph = import_graph.build()
    assert [(i.source, i.target) for i in import_graph.upward(graph)] == [("gpucomm.bootstrap.low", "gpucomm.job.high")]
    assert import_graph.cycles(graph) == [["gpucomm.bootstrap.low", "gpucomm.job.high"]]
    assert [i.names for i in import_graph.private_names(graph)] == [["_secret"]]
    assert [(a.target, a.name) for a in graph.private_reads] == [("gpucomm.job.high", "_x")]
    assert [(i.source, i.target) for i in import_graph.in_function(graph)] == [("gpucomm.torch.front", "gpucomm.job.high")]
