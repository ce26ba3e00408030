"""NCCL path: what can be checked without a GPU (unique-id bootstrap, clear errors), and the full
op suite on a GPU (``pytest -m gpu``): 1 rank, and 2 ranks sharing one GPU in single-GPU test mode."""

from __future__ import annotations

import threading

import pytest
import torch

from gpucomm.backends.base import BackendOp
from gpucomm.backends.nccl import NcclBackend, _tables, connect_at_init, nccl_module, nccl_version
from gpucomm.errors import CollectiveError
from gpucomm.bootstrap.rendezvous import RendezvousClient, RendezvousServer
from tests.ranks import collective_checks as checks
from tests.harness import run_ranks

nccl = nccl_module()
needs_nccl = pytest.mark.skipif(nccl is None, reason="CuPy's NCCL bindings are not installed")
HAS_GPU = torch.cuda.is_available() and nccl is not None
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU, CUDA torch and CuPy's NCCL")


@needs_nccl
def test_dtype_and_op_tables_cover_everything_we_reduce():
    dtypes, ops = _tables(nccl)
    assert dtypes[torch.bfloat16] == nccl.NCCL_BFLOAT16 and dtypes[torch.float16] == nccl.NCCL_FLOAT16
    assert set(ops) == set(BackendOp) and ops[BackendOp.AVG] == nccl.NCCL_AVG
    from gpucomm.dataplane.requests import REDUCIBLE

    assert all(dt in dtypes for dt in REDUCIBLE)
    assert nccl_version() > 20000


@needs_nccl
def test_unique_id_travels_through_the_store_intact():
    secret = b"x" * 32
    with RendezvousServer(secret, "127.0.0.1", 0) as server:
        got = {}

        def rank(r):
            c = RendezvousClient("127.0.0.1", server.port, secret)
            if r == 0:
                c.set("nccl/uid", bytes(nccl.get_unique_id()))
            got[r] = c.get("nccl/uid", 10)

        threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
    assert len(got[0]) == 128 and got[0] == got[1] == got[2]


@needs_nccl
@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU error path")
def test_communicator_without_gpu_fails_with_a_hint():
    with pytest.raises(CollectiveError, match="NCCL_DEBUG=INFO"):
        NcclBackend(bytes(nccl.get_unique_id()), 0, 1, 0)


def test_peers_connect_when_the_communicator_is_created(caplog, monkeypatch):
    """NCCL >= 2.22 connects lazily inside the first collective, a host call that blocks until the
    peers reach it: a bucket launched in backward on one rank and at synchronize() on another then
    hangs the job (seen on an H100, NCCL 2.28.9). gpucomm asks for connections at creation unless
    the user chose otherwise, and then says what that risks."""
    env: dict[str, str] = {}
    assert connect_at_init(env) and env == {"NCCL_RUNTIME_CONNECT": "0"}
    empty = {"NCCL_RUNTIME_CONNECT": " "}  # NCCL ignores an empty value: as unset (gpucomm-run does the same)
    assert connect_at_init(empty) and empty == {"NCCL_RUNTIME_CONNECT": "0"}
    import gpucomm.backends.nccl as nccl_backend

    monkeypatch.setattr(nccl_backend, "_connect_warned", False)
    mine = {"NCCL_RUNTIME_CONNECT": "1"}
    with caplog.at_level("WARNING", logger="gpucomm.nccl"):
        assert not connect_at_init(mine)
        assert not connect_at_init(mine)
    assert mine == {"NCCL_RUNTIME_CONNECT": "1"}  # the user's choice stands
    assert caplog.text.count("can then hang the job") == 1, caplog.text  # said once per process


def test_the_communicator_asks_for_connections_before_nccl_creates_it():
    import inspect

    source = inspect.getsource(NcclBackend.__init__)
    assert source.index("connect_at_init()") < source.index("NcclCommunicator(")


SINGLE_GPU = {"GPUCOMM_SINGLE_GPU_TEST": "1"}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("check", [checks.check_allreduce, checks.check_data_movement, checks.check_reducescatter,
                                   checks.check_autograd], ids=lambda f: f.__name__)
def test_nccl_op_suite(size, check):
    run_ranks(check, size, args=("cuda",), env=SINGLE_GPU, timeout=600)


@pytest.mark.gpu
@gpu
def test_nccl_async_poll_and_barrier():
    run_ranks(checks.check_async_and_barrier, 2, args=("cuda",), env=SINGLE_GPU, timeout=300)
