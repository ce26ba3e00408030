"""NCCL path: what can be checked without a GPU (unique-id bootstrap, clear errors), and the full
op suite on a GPU (``pytest -m gpu``): 1 rank, and 2 ranks sharing one GPU in single-GPU test mode."""

from __future__ import annotations

import threading

import pytest
import torch

from gpucomm.backends.base import BackendOp
from gpucomm.backends.nccl import (NcclBackend, _tables, c_strtoll, connects_lazily, nccl_conf_files, nccl_int_setting,
                                   nccl_module, nccl_version)
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


# -- NCCL_RUNTIME_CONNECT: read the way NCCL reads it, never written (issue 35) -------------------

NCCL_2_28 = 22809
NO_FILES: tuple[str, ...] = ()


@pytest.mark.parametrize("raw, value", [
    ("0", 0), ("1", 1), (" 0", 0), ("\t1", 1), ("0x0", 0), ("0x10", 16), ("00", 0), ("010", 8), ("09", 0),
    ("1abc", 1), ("abc", 0), (" ", 0), ("-1", -1), ("+1", 1), ("- 1", 0), ("0x", 0), ("0b1", 0), ("1e3", 1),
    ("9223372036854775807", (1 << 63) - 1), ("-9223372036854775808", -(1 << 63)),
])
def test_integers_parse_as_strtoll_with_base_0(raw, value):
    assert c_strtoll(raw) == (value, False)
    assert nccl_int_setting(raw, 7) == value


def libc_strtoll():
    """glibc's ``strtoll(s, NULL, 0)`` through ctypes as (value, errno), or None where there is none."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    fn = libc.strtoll
    fn.restype, fn.argtypes = ctypes.c_longlong, [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]

    def call(text: str) -> tuple[int, int]:
        ctypes.set_errno(0)
        value = fn(text.encode(), None, 0)
        return value, ctypes.get_errno()

    return call


def test_the_parse_agrees_with_the_c_library():
    import random

    strtoll = libc_strtoll()
    if strtoll is None:
        pytest.skip("no C library found through ctypes")
    rng = random.Random(35)
    alphabet = " \t\n\v\f\r+-0x0X178F9afgzb"
    samples = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 8))) for _ in range(3000)]
    samples += ["9" * 19, "9" * 20, "-" + "9" * 20, "0x" + "f" * 16, "0x7" + "f" * 15, "-0x8" + "0" * 15, "0" * 30 + "7"]
    for text in samples:
        value, errno = strtoll(text)
        assert c_strtoll(text) == (value, errno != 0), repr(text)


@pytest.mark.parametrize("raw", [None, "", "9223372036854775808", "-9223372036854775809", "0xffffffffffffffff"])
def test_unset_empty_or_out_of_range_is_the_default(raw):
    assert nccl_int_setting(raw, 7) == 7


@pytest.mark.parametrize("value, lazy", [
    (None, True), ("", True), ("1", True), ("-1", True), ("1abc", True), ("99999999999999999999", True),
    ("0", False), (" 0", False), ("0x0", False), ("00", False), ("abc", False), (" ", False), ("0abc", False),
])
def test_runtime_connect_follows_nccls_own_parse(value, lazy):
    """NCCL reads ``strtoll(value, NULL, 0)`` and only an overflow falls back to the default: a
    value that is not a number (``abc``, a lone space) is 0 there, so connections are made at init,
    where the old ``== "0"`` test after ``strip()`` said lazy (or, for a space, set 0 itself)."""
    env = {} if value is None else {"NCCL_RUNTIME_CONNECT": value}
    assert connects_lazily(env, NCCL_2_28, conf_files=NO_FILES) is lazy
    assert env == ({} if value is None else {"NCCL_RUNTIME_CONNECT": value})  # read, never written


@pytest.mark.parametrize("cumem, lazy", [
    (None, True), ("-2", True), ("1", True), ("2", True), ("0", False), ("-1", False), ("-3", False),
    ("4294967296", False),  # 1 << 32: NCCL keeps it in a C int, where it is 0
])
def test_runtime_connect_needs_cumem(cumem, lazy):
    env = {} if cumem is None else {"NCCL_CUMEM_ENABLE": cumem}
    assert connects_lazily(env, NCCL_2_28, conf_files=NO_FILES) is lazy


def test_nccl_before_2_22_or_none_at_all_connects_at_init():
    assert not connects_lazily({}, 22105, conf_files=NO_FILES)
    assert not connects_lazily({}, 0, conf_files=NO_FILES)
    assert connects_lazily({}, 22203, conf_files=NO_FILES)


def test_configuration_files_count_where_the_environment_is_silent(tmp_path):
    user, system = tmp_path / "user.conf", tmp_path / "system.conf"
    user.write_text("# NCCL_RUNTIME_CONNECT=1\nNCCL_RUNTIME_CONNECT = 1\nNCCL_RUNTIME_CONNECT=0\n"
                    "NCCL_RUNTIME_CONNECT=1\n")
    system.write_text("NCCL_RUNTIME_CONNECT=1\n")
    files = [str(user), str(system)]
    assert not connects_lazily({}, NCCL_2_28, conf_files=files)  # the first line naming it exactly wins
    assert connects_lazily({}, NCCL_2_28, conf_files=files[1:])
    assert connects_lazily({"NCCL_RUNTIME_CONNECT": ""}, NCCL_2_28, conf_files=files)  # set, even empty: env wins
    assert connects_lazily({}, NCCL_2_28, conf_files=[str(tmp_path / "missing"), str(system)])
    env = {"NCCL_CONF_FILE": str(user), "HOME": "/nowhere"}
    assert nccl_conf_files(env, NCCL_2_28) == [str(user), "/etc/nccl.conf"]
    assert not connects_lazily(env, NCCL_2_28)  # NCCL_CONF_FILE named it


def test_an_external_env_plugin_answers_for_nccl_so_lazy_is_assumed():
    env = {"NCCL_RUNTIME_CONNECT": "0", "NCCL_ENV_PLUGIN": "site"}
    assert connects_lazily(env, NCCL_2_28, conf_files=NO_FILES)
    assert not connects_lazily(env, 22803, conf_files=NO_FILES)  # before 2.28.7 there was no env plugin
    assert not connects_lazily(dict(env, NCCL_ENV_PLUGIN="NONE"), NCCL_2_28, conf_files=NO_FILES)


def test_gpucomm_no_longer_asks_for_connections_at_init():
    import gpucomm.backends.nccl as nccl_backend

    assert not hasattr(nccl_backend, "connect_at_init")


def test_gpucomm_run_leaves_nccl_runtime_connect_to_the_user():
    """The launcher used to export NCCL_RUNTIME_CONNECT=0 to every rank, CPU-only jobs and torch's
    own communicators included; a rank now sees exactly what the user's environment holds."""
    from gpucomm.runner.cli import build_parser, tunables_env
    from gpucomm.runner.hosts import HostSlots, assign_slots
    from gpucomm.runner.worker_env import worker_env

    args = build_parser().parse_args(["-np", "2", "python", "x.py"])
    for user in ({}, {"NCCL_RUNTIME_CONNECT": " "}, {"NCCL_RUNTIME_CONNECT": "1"}):
        tunables = tunables_env(args, dict(user))
        assert "NCCL_RUNTIME_CONNECT" not in tunables, tunables
        slot = assign_slots([HostSlots("h", 2)], 2)[1]
        env = worker_env(dict(user), slot, tunables, remote=False, rendezvous_addr="a", rendezvous_port=1,
                         secret=b"k" * 16, run_id="r")
        assert env.get("NCCL_RUNTIME_CONNECT") == user.get("NCCL_RUNTIME_CONNECT")


def init_on_a_pretend_gpu() -> str | None:
    """A rank's body: ``hvd.init()`` with this rank pinned to a GPU (stood in for, as on a GPU
    machine) and no NCCL_RUNTIME_CONNECT in the environment; what the variable is afterwards."""
    import os

    import gpucomm.torch as hvd
    from gpucomm.bootstrap import devices

    os.environ.pop("NCCL_RUNTIME_CONNECT", None)
    gpu = devices.GpuInfo(0, "0000:10:00.0", "GPU-test-0", "Test GPU", 1 << 30)
    devices.pin_local_gpu = lambda *a, **k: devices.PinnedDevice(gpu, 0)
    devices.select_device = lambda ordinal: None
    hvd.init()
    try:
        return os.environ.get("NCCL_RUNTIME_CONNECT")
    finally:
        hvd.shutdown()


def test_job_setup_leaves_nccl_runtime_connect_unset():
    """``hvd.init()`` on a GPU used to set NCCL_RUNTIME_CONNECT=0 for the whole process."""
    assert run_ranks(init_on_a_pretend_gpu, 1, fresh=True, timeout=120) == [None]


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
