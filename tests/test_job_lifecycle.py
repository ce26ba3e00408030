"""init/shutdown, topology queries, re-init, argument errors, and failures that must not hang."""

from __future__ import annotations

import importlib.util

import time

import psutil
import pytest
import torch

import gpucomm.torch as hvd
from gpucomm.bootstrap.rendezvous import RendezvousServer
from tests.ranks import lifecycle_scenarios as sc
from tests.harness import RankFailure, run_ranks


def test_queries_before_init_raise_value_error():
    for query in (hvd.size, hvd.rank, hvd.local_size, hvd.local_rank, hvd.cross_size, hvd.cross_rank):
        with pytest.raises(ValueError, match="has not been initialized"):
            query()
    with pytest.raises(ValueError, match="has not been initialized"):
        hvd.allreduce(torch.ones(2))
    assert hvd.is_initialized() is False


def test_build_queries_work_before_init():
    assert isinstance(hvd.nccl_built(), int)
    assert hvd.gloo_built() is True
    assert hvd.mpi_built() is (importlib.util.find_spec("mpi4py") is not None)  # the mpi extra
    assert hvd.mpi_enabled() is False and hvd.gloo_enabled() is False
    with pytest.raises(ValueError, match="MPI is not enabled in this job"):
        hvd.mpi_threads_supported()
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)


def test_single_process_without_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "GPUCOMM_RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    hvd.init()
    try:
        assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == (0, 1, 0, 1, 0, 1)
        assert torch.equal(hvd.allreduce(torch.arange(3.0)), torch.arange(3.0))
        assert torch.equal(hvd.allgather(torch.ones(2, 2)), torch.ones(2, 2))
    finally:
        hvd.shutdown()


def test_topology_and_shutdown_state():
    out = run_ranks(sc.topology, 3)
    assert [o[:6] for o in out] == [(r, 3, r, 3, 0, 1) for r in range(3)]
    assert all(o[6] is True and o[7] is False for o in out)


def test_reinit_after_shutdown():
    assert run_ranks(sc.reinit_three_times, 2) == [[1.0, 3.0, 5.0]] * 2


def test_bad_arguments_raise_clear_errors_without_issuing():
    errors = run_ranks(sc.bad_arguments, 2)[0]
    joined = "\n".join(errors)
    for fragment in ("contiguous", "not supported", "Adasum", "supersedes average", "root_rank", "divide evenly",
                     "must hold 2", "sum to 5", "at least one dimension", "unknown handle", "one device"):
        assert fragment in joined, (fragment, joined)


def test_mismatched_allgather_raises_on_every_rank():
    messages = run_ranks(sc.mismatched_allgather_shapes, 2)
    for m in messages:
        assert "Mismatched ALLGATHER" in m and "rank" in m


def test_failing_rank_reports_its_traceback():
    with pytest.raises(RankFailure) as info:
        run_ranks(sc.raise_on_rank_one, 2, timeout=60)
    assert "boom from rank one" in str(info.value) and "--- rank 1 ---" in str(info.value)


def test_hanging_rank_is_killed_and_reaped():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RankFailure, match="did not finish"):  # killed at the 8 s deadline, not left to wait forever
        run_ranks(sc.wait_forever, 2, timeout=8)
    time.sleep(0.2)
    leftover = {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE} - before
    assert not leftover, leftover


def test_missing_rank_is_named_at_init():
    with pytest.raises(RankFailure) as info:
        run_ranks(sc.init_and_report, 3, ranks=[0, 2], env={"GPUCOMM_START_TIMEOUT": "3"}, timeout=60)
    text = str(info.value)
    assert "ranks [1] never arrived" in text, text


def test_wrong_secret_fails_init_clearly():
    with RendezvousServer(b"the-real-secret-of-this-job!", "127.0.0.1", 0) as server:
        env = {"GPUCOMM_RENDEZVOUS_PORT": str(server.port), "GPUCOMM_START_TIMEOUT": "5"}
        with pytest.raises(RankFailure, match="job secret"):
            run_ranks(sc.init_and_report, 2, env=env, timeout=60)


def test_framework_neutral_communicator_on_numpy_arrays():
    run_ranks(sc.numpy_communicator, 2)
