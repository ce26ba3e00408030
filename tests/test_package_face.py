"""A light package face: each import below runs in a fresh interpreter and must not load what its
first call does not need (the launcher never loads torch, CuPy or Numba; ``import gpucomm.torch``
leaves the job's machinery, the optimizer and the timeline for ``hvd.init()`` and first use)."""

from __future__ import annotations

import json

import pytest

from tests.harness import PYTHON, run

HEAVY = ("torch", "cupy", "numba", "numpy", "matplotlib")


def _modules_after(statement: str) -> set[str]:
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    r = run([PYTHON, "-c", code], timeout=120)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.splitlines()[-1]))


@pytest.mark.parametrize("statement", [
    "import gpucomm",
    "import gpucomm.runner.cli",  # gpucomm-run
    "import gpucomm.runner.remote",  # the ssh-side wrapper
    "from gpucomm.runner.cli import build_parser; build_parser().parse_args(['-np', '2', 'true'])",
    "import gpucomm.bootstrap.world, gpucomm.bootstrap.rendezvous, gpucomm.reduce_op, gpucomm.process_sets",
])
def test_launcher_and_package_face_import_nothing_heavy(statement):
    loaded = _modules_after(statement)
    assert not [m for m in HEAVY if m in loaded], sorted(m for m in loaded if m.split(".")[0] in HEAVY)[:10]


def test_gpucomm_torch_loads_the_job_machinery_only_at_init():
    loaded = _modules_after("import gpucomm.torch")
    later = ("gpucomm.job.state", "gpucomm.job.setup", "gpucomm.control.controller", "gpucomm.control.hub",
             "gpucomm.dataplane.executor", "gpucomm.torch.optimizer", "gpucomm.timeline.writer", "gpucomm.kernels.packing",
             "numba", "cupy", "matplotlib")
    assert not [m for m in later if m in loaded], [m for m in later if m in loaded]
    assert "torch" in loaded  # the front works on torch tensors


def test_lazy_names_resolve():
    loaded = _modules_after("import gpucomm, gpucomm.torch as hvd; "
                            "assert callable(gpucomm.stats) and hvd.stats is gpucomm.stats; "
                            "assert hvd.DistributedOptimizer.__name__ == 'DistributedOptimizer'; "
                            "assert gpucomm.Communicator.__name__ == 'Communicator'")
    assert "gpucomm.torch.optimizer" in loaded


def test_dir_lists_the_lazy_names_before_their_first_use():
    """Tab completion and API discovery by ``dir()`` see ``ZeroRedundancyOptimizer`` and the other lazily
    loaded names at once (issue 38), and listing them loads nothing."""
    loaded = _modules_after("import gpucomm, gpucomm.torch as hvd, gpucomm.kernels as k; "
                            "names = dir(hvd); "
                            "assert {'ZeroRedundancyOptimizer', 'DistributedOptimizer', 'init', 'allreduce'} <= set(names), names; "
                            "assert names == sorted(names); "
                            "assert 'stats' in dir(gpucomm) and 'pack' in dir(k), (dir(gpucomm), dir(k))")
    assert "gpucomm.torch.optimizer" not in loaded and "numba" not in loaded


def test_horovods_mpi_ops_module_name_holds_the_jobs_basics_too():
    """``from horovod.torch.mpi_ops import rank`` (and init, shutdown, the local and cross ranks, the
    ``*_built``/``*_enabled`` checks, ProcessSet, HorovodInternalError, Compression) keeps working with the
    import line changed (issue 38): the very objects ``gpucomm.torch`` exports."""
    import gpucomm.torch as hvd
    from gpucomm.torch import mpi_ops

    for name in mpi_ops.BASICS:
        assert getattr(mpi_ops, name) is getattr(hvd, name), name
        assert name in mpi_ops.__all__, name
    assert {"init", "shutdown", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
            "is_initialized", "start_timeline", "stop_timeline", "mpi_built", "nccl_built", "gloo_enabled",
            "ProcessSet", "global_process_set", "HorovodInternalError", "Compression"} <= set(mpi_ops.BASICS)
    assert all(hasattr(mpi_ops, name) for name in mpi_ops.__all__)


def test_horovods_mpi_ops_module_name_holds_the_collectives_horovod_defines_there():
    """``from horovod.torch.mpi_ops import allreduce`` (and the other differentiable collectives,
    which Horovod defines in mpi_ops.py) must keep working with the import line changed."""
    import gpucomm.torch as hvd
    from gpucomm.torch import mpi_ops

    for name in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "grouped_allreduce",
                 "grouped_allgather", "grouped_reducescatter", "allreduce_async", "broadcast_", "synchronize", "poll",
                 "join", "barrier", "Average", "Sum", "Adasum"):
        assert getattr(mpi_ops, name) is getattr(hvd, name), name
        assert name in mpi_ops.__all__, name


def test_dir_of_gpucomm_torch_lists_every_name_of_horovods_api():
    """``dir(gpucomm.torch)`` holds every public name of ``horovod.torch`` 0.28.1 (the list kept in
    tests/horovod_torch_api.py), lazily loaded ones included, before any of them is touched."""
    from tests.horovod_torch_api import HOROVOD_TORCH, MPI_OPS_ONLY

    res = run([PYTHON, "-c", "import json, gpucomm.torch as hvd; print(json.dumps(dir(hvd)))"], timeout=120)
    assert res.returncode == 0, res.stderr
    listed = set(json.loads(res.stdout.splitlines()[-1]))
    wanted = {n for n in (*HOROVOD_TORCH, *MPI_OPS_ONLY) if "." not in n}  # "Compression.fp16": an attribute
    assert len(wanted) > 60 and sorted(wanted - listed) == [], sorted(wanted - listed)


def test_mpi_ops_has_every_public_name_of_horovods_mpi_ops():
    from gpucomm.torch import mpi_ops
    from tests.horovod_torch_api import MPI_OPS_NAMES

    assert len(MPI_OPS_NAMES) == 74
    assert [n for n in MPI_OPS_NAMES if n not in mpi_ops.__all__ or not hasattr(mpi_ops, n)] == []
    assert mpi_ops.num_rank_is_power_2(8) and not mpi_ops.num_rank_is_power_2(6) and not mpi_ops.num_rank_is_power_2(0)
    handle = mpi_ops.get_average_backwards_compatibility_fun(mpi_ops)
    assert handle(None, False) == mpi_ops.Sum and handle(None, None) == mpi_ops.Average
    with pytest.raises(ValueError, match="supersedes average"):
        handle(mpi_ops.Sum, True)
    mpi_ops.check_installed_version("torch", "2.13.0")  # installed: nothing to say
    with pytest.raises(ImportError, match="not installed"):
        mpi_ops.check_installed_version("no-such-framework", "1.0", exception=RuntimeError("x"))
    import torch

    assert mpi_ops.gpu_available("horovod.torch") == (torch.cuda.is_available() and mpi_ops.nccl_built() > 0)
    assert mpi_ops.gpu_available("horovod.tensorflow") is False


def test_horovods_autograd_classes_take_horovods_apply_arguments():
    """``HorovodAllreduce.apply(tensor, average, name, op, prescale, postscale, process_set)`` and the
    other seven, called as Horovod's own code calls them, give values and gradients (2 ranks)."""
    from tests.harness import run_ranks
    from tests.ranks import parity_scenarios

    results = run_ranks(parity_scenarios.horovod_autograd_classes, 2, timeout=120)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["allreduce"] == [3.0, 3.0] and r["allreduce_grad"] == [2.0, 2.0], r
        assert r["grouped"] == [[2.0], [3.0]], r  # averaged, then postscale 2
        assert r["allgather"] == [0.0, 1.0] and r["broadcast"] == [0.0], r
        assert r["reducescatter"] == [2.0] and r["alltoall_splits"] == [1, 1], r


def test_the_torch_bounds_are_the_range_ci_tests():
    """pyproject's torch bounds, the README's support table and CI's torch steps name one range: the
    lower bound is the oldest torch CI installs, the upper bound lies just above the newest."""
    import re

    from tests.harness import ROOT

    # (a regular expression, not tomllib: this file runs on Python 3.10 in CI's oldest-torch step)
    low, high = re.search(r'^\s*"torch>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text(), re.M).groups()
    steps = dict(re.findall(r"^torch_range_step (\w+) [\d.]+ ([\d.]+)", (ROOT / ".ci" / "run").read_text(), re.M))
    assert steps["oldest"].startswith(low + ".") or steps["oldest"] == low, (steps, low)
    newest = tuple(map(int, steps["newest"].split(".")))
    assert newest[:2] == (int(high.split(".")[0]), int(high.split(".")[1]) - 1), (steps, high)
    readme = (ROOT / "README.md").read_text()
    assert f"torch {steps['oldest']}–{steps['newest']}" in readme
