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
