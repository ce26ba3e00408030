"""Every kernel variant compiles to PTX for sm_90 and links to a cubin, with no GPU.

Runs in the normal pytest process (not under NUMBA_ENABLE_CUDASIM, where ``compile_ptx`` does not
exist). Needs NVRTC/NVVM/nvJitLink from ``numba-cuda[cu13]``: skips with that fix only when one of
those libraries is missing; any other compile error fails (``toolchain.py``).
"""

from __future__ import annotations

import os
import re

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("compile suite: numba is in simulator mode (NUMBA_ENABLE_CUDASIM=1), where compile_ptx does not "
                "exist; run this file without it", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gpucomm import kernels  # noqa: E402

if kernels.SIMULATOR:
    pytest.skip("numba is in simulator mode in this process", allow_module_level=True)

from gpucomm.kernels import launch, packing, table  # noqa: E402
from tests.kernels.toolchain import toolchain_missing  # noqa: E402

from gpucomm.kernels.specs import FINISHERS  # noqa: E402

CC = (9, 0)
NAMES = sorted(kernels.KERNELS)
SPECS = {**kernels.KERNELS, **FINISHERS}
_ptx_cache: dict[str, str] = {}


_PROBLEM = toolchain_missing()  # any compile error other than a missing library fails this module
pytestmark = pytest.mark.skipif(bool(_PROBLEM), reason=(
    f"cannot compile CUDA kernels on this machine ({_PROBLEM[:160]}); install the toolkit pieces with "
    "pip install 'numba-cuda[cu13]'"))


def ptx_of(name: str) -> str:
    if name not in _ptx_cache:
        _ptx_cache[name] = launch.compile_ptx(SPECS[name], CC)
    return _ptx_cache[name]


def entry_params(ptx: str) -> list[str]:
    """The ``.param`` types of the (single) ``.entry`` in ``ptx``."""
    entries = re.findall(r"\.entry\s+\S+\s*\((.*?)\)", ptx, re.S)
    assert len(entries) == 1, f"expected one kernel entry, found {len(entries)}"
    return re.findall(r"\.param\s+\.(\w+)", entries[0])


def link_sm90(ptx: str) -> tuple[bytes, str]:
    """(sm_90 cubin, ptxas info log) through nvJitLink, as the driver-less build path."""
    from cuda.bindings import nvjitlink  # noqa: PLC0415

    handle = nvjitlink.create(2, ["-arch=sm_90", "-verbose"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "pack.ptx")
        try:
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError:
            log = bytearray(nvjitlink.get_error_log_size(handle))
            nvjitlink.get_error_log(handle, log)
            raise AssertionError(log.decode(errors="replace")) from None
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
        info = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, info)
        return bytes(cubin), info.decode(errors="replace")
    finally:
        nvjitlink.destroy(handle)


@pytest.mark.parametrize("name", NAMES + sorted(FINISHERS))
def test_kernel_compiles_and_links_for_sm90(name):
    ptx = ptx_of(name)
    assert ".target sm_90" in ptx
    cubin, info = link_sm90(ptx)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
    # occupancy: 256-thread blocks need <= 32 registers for 2048 threads per SM; allow 40 (75%)
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", info)]
    assert registers and max(registers) <= 40, info
    assert "0 bytes spill stores, 0 bytes spill loads" in info, info


@pytest.mark.parametrize("name", NAMES + sorted(FINISHERS))
def test_no_float64_instructions_outside_float64_kernels(name):
    lines = [line.strip() for line in ptx_of(name).splitlines() if ".f64" in line]
    if SPECS[name].uses_float64:
        assert lines, "the float64 kernel should compute in float64"
    else:
        assert not lines, f"{name} has float64 instructions (a stray Python float?): {lines[:5]}"


@pytest.mark.parametrize("name", NAMES)
def test_parameter_block_is_three_scalars(name):
    """table address, row count, scale (and, for a checked pack, the flags' address): nothing per
    tensor, so no limit on the tensor count."""
    scale = "f64" if kernels.KERNELS[name].uses_float64 else "f32"
    flags = ["u64"] if kernels.KERNELS[name].checked else []
    assert entry_params(ptx_of(name)) == ["u64", "u64", scale, *flags]


@pytest.mark.parametrize("name", sorted(FINISHERS))
def test_a_finisher_takes_five_scalars_and_meets_in_shared_memory(name):
    """(flags, row-to-tensor map, row count, slot address, limit): nothing per tensor; the rows' minimum
    meets in one shared-memory atomic, and the flags and the map are read through global accesses."""
    body = ptx_of(name)
    assert entry_params(body) == ["u64"] * 5
    assert re.search(r"atom\.shared\.min\.s32", body), "the first flagged tensor meets in shared memory"
    generic = re.findall(r"^\s*(?:ld|st)\.(?:u|s|b|f)\d+\b", body, re.M)
    assert not generic and "ld.global" in body and "st.global" in body, generic[:3]
    assert ".local" not in body, "the finisher spills to local memory"


def test_every_checked_pack_has_a_finisher_for_its_buffer():
    from gpucomm.kernels.specs import select_finisher

    for slot in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        spec = select_finisher(slot)
        assert spec.dst_itemsize == slot.itemsize and spec.name in FINISHERS
        assert spec.uses_float64 == (slot == torch.float64)
    with pytest.raises(ValueError, match="floating"):
        select_finisher(torch.int32)


def test_every_floating_pack_has_a_checked_twin():
    """The finite check runs in the pack kernel for every conversion a DistributedOptimizer's bucket
    can pack (same dtype, scaled or not; the casts to float16 and bfloat16)."""
    floats = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    pairs = [(dt, dt) for dt in floats] + [(torch.float32, torch.float16), (torch.float32, torch.bfloat16)]
    for src, dst in pairs:
        for scaled in (False, True):
            spec = kernels.select_kernel(src, dst, scaled, checked=True)
            assert spec.checked and spec.name.endswith("_checked"), spec.name
            plain = kernels.select_kernel(src, dst, scaled)
            assert (spec.src_itemsize, spec.dst_itemsize, spec.scale_type) == (
                plain.src_itemsize, plain.dst_itemsize, plain.scale_type), spec.name
    with pytest.raises(ValueError, match="floating"):
        kernels.select_kernel(torch.int32, torch.int32, False, checked=True)


@pytest.mark.parametrize("name", NAMES)
def test_data_moves_through_global_loads_and_stores(name):
    """Addresses are cast through addrspace(1): no generic ld/st (slower, and a sign the cast was lost)."""
    body = ptx_of(name)
    generic = re.findall(r"^\s*(?:ld|st)\.(?:u|s|b|f)\d+\b", body, re.M)
    assert not generic, f"generic memory accesses in {name}: {generic[:3]}"
    assert "ld.global" in body and "st.global" in body
    assert ".local" not in body, "the kernel spills to local memory"


def test_launch_arguments_do_not_grow_with_the_tensor_count(monkeypatch):
    """A layout of 2 tensors and one of 2,000 launch the same kernel with the same three scalars."""
    calls = []
    monkeypatch.setattr(packing, "_check_runnable", lambda direction, device: None)
    monkeypatch.setattr(launch, "grid_for", lambda nrows, device: 1)
    monkeypatch.setattr(launch, "compile_kernel", lambda spec, device: None)  # PTX is checked below
    monkeypatch.setattr(launch.Launch, "__call__", lambda self, stream: calls.append(self))
    kernels.clear_cache()
    for count in (2, 2000):
        srcs = [torch.ones(3) for _ in range(count)]
        kernels.pack(srcs, torch.empty(3 * count), scale=0.5)
    kernels.clear_cache()
    two, many = calls
    assert two.spec is many.spec and two.grid == many.grid
    assert (two.nrows, many.nrows) == (2, 2000)
    assert [type(a) for a in two._args] == [type(a) for a in many._args] and len(two._args) == 3
    assert len(entry_params(ptx_of(two.spec.name))) == 3


def test_table_rows_are_int64_address_triples():
    rows = table.chunk_rows(np.array([1 << 40], dtype=np.int64), np.array([1 << 41], dtype=np.int64),
                            np.array([table.CHUNK_ELEMS + 1], dtype=np.int64), 4, 2, table.CHUNK_ELEMS)
    assert rows.dtype == np.int64 and rows.shape == (2, 3)
    assert rows.tolist() == [[1 << 40, 1 << 41, table.CHUNK_ELEMS],
                             [(1 << 40) + 4 * table.CHUNK_ELEMS, (1 << 41) + 2 * table.CHUNK_ELEMS, 1]]
