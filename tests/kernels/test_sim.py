"""The pack/unpack kernels run in Numba's CUDA simulator on CPU tensors, bit-exact against torch.

Run in its own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/kernels/test_sim.py``
(numba fixes simulator mode when it is imported). Sizes stay small: every simulated thread is a
Python thread.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("simulator suite: run it in its own process with NUMBA_ENABLE_CUDASIM=1 set in the environment "
                "(numba chooses simulator mode at import)", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gpucomm import kernels  # noqa: E402
from gpucomm.dataplane import bucket_copy  # noqa: E402
from gpucomm.kernels import launch, packing, table  # noqa: E402
from tests.kernels.reference import (  # noqa: E402
    BF16_EDGE_BITS, assert_same_bits, f32_from_bits, random_values, reference, special_values)

if not kernels.SIMULATOR:
    pytest.skip("numba was imported before NUMBA_ENABLE_CUDASIM=1 took effect; run this file in a fresh process",
                allow_module_level=True)

CHUNK = table.CHUNK_ELEMS
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INTS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@pytest.fixture(autouse=True)
def fresh_cache():
    kernels.clear_cache()
    yield
    kernels.clear_cache()


@pytest.fixture
def launches(monkeypatch):
    """Counts kernel launches made by pack/unpack."""
    calls = []
    real = launch.Launch.__call__

    def counting(self, stream):
        calls.append((self.spec.name, self.nrows, self.grid))
        return real(self, stream)

    monkeypatch.setattr(launch.Launch, "__call__", counting)
    return calls


def _sizes(gen: torch.Generator, count: int, high: int) -> list[int]:
    sizes = torch.randint(0, high, (count,), generator=gen).tolist()
    return sizes + [0, 1, 2 * CHUNK + 1]  # an empty tensor, a scalar, one spanning three pieces


def _roundtrip(srcs, wire_dtype, pack_scale=1.0, unpack_scale=1.0):
    """Pack ``srcs`` into a wire buffer (with a guard tail) and unpack into fresh tensors; check both."""
    total = sum(t.numel() for t in srcs)
    wire = torch.zeros(total + 3, dtype=wire_dtype)
    kernels.pack(srcs, wire, scale=pack_scale)
    want_wire = reference(torch.cat([t.reshape(-1) for t in srcs]), wire_dtype, pack_scale)
    assert_same_bits(wire[:total], want_wire)
    assert torch.count_nonzero(wire[total:]) == 0, "pack wrote past the packed elements"
    outs = [torch.full_like(t, 7) for t in srcs]
    kernels.unpack(wire, outs, scale=unpack_scale)
    offset = 0
    for t, out in zip(srcs, outs):
        assert_same_bits(out.reshape(-1), reference(wire[offset:offset + t.numel()], t.dtype, unpack_scale))
        offset += t.numel()
    return wire, outs


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_random_layouts_copy_bit_exact(dtype):
    gen = torch.Generator().manual_seed(hash(str(dtype)) % 2**31)
    srcs = [random_values(dtype, n, gen).reshape(-1) for n in _sizes(gen, 6, 90)]
    srcs.insert(2, random_values(dtype, 12, gen).reshape(3, 4))  # any shape, packed in memory order
    _, outs = _roundtrip(srcs, dtype)
    for t, out in zip(srcs, outs):
        assert_same_bits(out, t)


@pytest.mark.parametrize("seed", range(12))
def test_random_mixed_layouts(seed):
    """Random tensor counts and sizes (mostly tiny, some spanning pieces), some as views into a shared
    base at random offsets, a random supported wire dtype and scale."""
    gen = torch.Generator().manual_seed(1000 + seed)
    pairs = [(dt, dt) for dt in FLOATS] + list(kernels.CASTS)
    src_dtype, wire_dtype = pairs[int(torch.randint(len(pairs), (1,), generator=gen))]
    count = int(torch.randint(1, 40, (1,), generator=gen))
    base = random_values(src_dtype, 4 * CHUNK, gen)
    srcs = []
    for _ in range(count):
        n = int(torch.randint(0, 3 * CHUNK if torch.rand(1, generator=gen) < 0.2 else 9, (1,), generator=gen))
        if torch.rand(1, generator=gen) < 0.3:
            start = int(torch.randint(0, base.numel() - n + 1, (1,), generator=gen))
            srcs.append(base[start:start + n])
        else:
            srcs.append(random_values(src_dtype, n, gen))
    scale = [1.0, 0.5, float(torch.rand(1, generator=gen)) * 4 - 2][seed % 3]
    _roundtrip(srcs, wire_dtype, pack_scale=scale, unpack_scale=1.0)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("scale", [0.5, 1 / 3, -3.0])
def test_scaled_same_dtype(dtype, scale):
    gen = torch.Generator().manual_seed(7)
    srcs = [random_values(dtype, n, gen) for n in (33, 0, 129)] + [special_values(dtype)]
    _roundtrip(srcs, dtype, pack_scale=scale, unpack_scale=1 / scale)


@pytest.mark.parametrize("src,wire", kernels.CASTS, ids=lambda dt: str(dt).replace("torch.", ""))
@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_casts_with_edge_values(src, wire, scale):
    """NaN/inf/-0, max values, float16 overflow to inf, subnormals, and bfloat16 ties, both ways."""
    gen = torch.Generator().manual_seed(11)
    srcs = [special_values(src), random_values(src, 301, gen), torch.empty(0, dtype=src)]
    _roundtrip(srcs, wire, pack_scale=scale, unpack_scale=scale)


def test_bfloat16_rounds_to_nearest_even_exactly():
    """The kernel's bfloat16 bits equal torch's for ties, near-ties, overflow and subnormals."""
    x = f32_from_bits([b for b in BF16_EDGE_BITS if (b & 0x7FFFFFFF) <= 0x7F800000])  # no NaN: bits compared raw
    wire = torch.empty(x.numel(), dtype=torch.bfloat16)
    kernels.pack([x], wire)
    assert torch.equal(wire.view(torch.int16), x.bfloat16().view(torch.int16))
    assert wire.view(torch.int16)[0].item() == 0x3F80 and wire.view(torch.int16)[1].item() == 0x3F82  # ties to even
    nan = torch.empty(1, dtype=torch.bfloat16)
    kernels.pack([f32_from_bits([0xFF800001])], nan)  # a signalling, negative NaN
    assert nan.view(torch.int16).item() == 0x7FC0


def test_every_bfloat16_and_float16_widens_exactly():
    """All 65,536 bit patterns of each half type unpack to float32 exactly (scaled by 2 as well)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for half in (torch.bfloat16, torch.float16):
        flat = bits.view(half)
        for scale in (1.0, 2.0):
            out = torch.empty(flat.numel(), dtype=torch.float32)
            kernels.unpack(flat, [out], scale=scale)
            assert_same_bits(out, reference(flat, torch.float32, scale))


def test_slices_with_offset_data_pointers():
    """Views into bigger tensors (odd offsets, zero-length) pack from and unpack into their own elements only."""
    base = torch.arange(1000, dtype=torch.float32)
    srcs = [base[5:9], base[3:3], base[101:400], base[999:], base.view(10, 100)[2, 7:50]]
    flat_base = torch.zeros(800)
    flat = flat_base[3:]  # the flat buffer itself starts at an offset
    kernels.pack(srcs, flat, scale=2.0)
    total = sum(t.numel() for t in srcs)
    assert torch.equal(flat[:total], torch.cat(srcs) * 2.0)
    assert torch.count_nonzero(flat_base[:3]) == 0 and torch.count_nonzero(flat[total:]) == 0
    out_base = torch.full((1000,), -1.0)
    outs = [out_base[1:5], out_base[7:7], out_base[10:309], out_base[500:501], out_base[600:643]]
    kernels.unpack(flat, outs, scale=0.5)
    for src, out in zip(srcs, outs):
        assert torch.equal(out, src)
    assert int((out_base != -1).sum()) == total, "unpack wrote outside the destination views"


def test_one_huge_tensor_beside_many_tiny_is_split_evenly(launches):
    gen = torch.Generator().manual_seed(3)
    huge = torch.randn(40 * CHUNK + 17, generator=gen)
    tiny = [torch.randn(int(n), generator=gen) for n in torch.randint(1, 4, (120,), generator=gen)]
    srcs = tiny[:60] + [huge] + tiny[60:]
    wire = torch.empty(sum(t.numel() for t in srcs), dtype=torch.bfloat16)
    kernels.pack(srcs, wire)
    assert_same_bits(wire, torch.cat(srcs).bfloat16())
    assert len(launches) == 1
    (layout,) = packing._CACHE.values()
    rows = layout.table.rows
    assert rows[:, 2].max() <= CHUNK and rows[:, 2].min() >= 1
    assert len(rows) == 120 + 41  # one row per tiny tensor, ceil(n / CHUNK) for the huge one
    assert rows[:, 2].sum() == wire.numel()


def test_chunk_rows_cover_every_element_once():
    gen = np.random.default_rng(5)
    numels = gen.integers(0, 3 * CHUNK, 50)
    src = np.cumsum(gen.integers(1, 10, 50)) * 1_000_000
    dst = (np.cumsum(numels) - numels) * 2 + 64
    rows = table.chunk_rows(src, dst, numels, 4, 2, CHUNK)
    covered = {}
    for s, d, n in rows:
        t = int(np.searchsorted(src, s, side="right") - 1)
        first = (s - src[t]) // 4
        assert d == dst[t] + first * 2 and 1 <= n <= CHUNK
        covered.setdefault(t, []).append((first, n))
    for t, n in enumerate(numels):
        spans = sorted(covered.get(t, []))
        assert sum(k for _, k in spans) == n and all(a + k == b for (a, k), (b, _) in zip(spans, spans[1:]))


def test_one_launch_whatever_the_tensor_count(launches):
    srcs = [torch.full((k % 3,), float(k)) for k in range(300)]
    wire = torch.empty(sum(t.numel() for t in srcs))
    kernels.pack(srcs, wire)
    kernels.unpack(wire, [torch.empty_like(t) for t in srcs])
    assert len(launches) == 2
    assert torch.equal(wire, torch.cat(srcs))
    kernels.pack([], wire)
    kernels.pack([torch.empty(0), torch.empty(0)], wire)
    kernels.unpack(wire, [])
    assert len(launches) == 2  # nothing to copy: no launch


def test_table_cache_hits_and_refreshes_when_a_tensor_moves(launches):
    srcs = [torch.randn(50), torch.randn(300), torch.randn(7)]
    wire = torch.empty(400)
    kernels.pack(srcs, wire)
    kernels.pack(srcs, wire)
    assert kernels.cache_info()["misses"] == 1 and kernels.cache_info()["hits"] == 1
    srcs[1].mul_(3)  # new values, same addresses: the cached table is still right
    kernels.pack(srcs, wire)
    assert torch.equal(wire[:357], torch.cat(srcs))
    old = srcs[1]
    srcs[1] = torch.randn(300)  # a reallocated gradient: a new address (old is kept alive, so it must differ)
    assert srcs[1].data_ptr() != old.data_ptr()
    kernels.pack(srcs, wire)
    assert torch.equal(wire[:357], torch.cat(srcs))
    assert kernels.cache_info()["misses"] == 2
    kernels.pack(srcs[:2] + [torch.randn(6)], wire)  # same addresses but a different size is a new layout
    assert kernels.cache_info()["misses"] == 3


def test_validate_false_trusts_a_known_layout_but_checks_a_new_one():
    base = torch.arange(16, dtype=torch.float32)
    wire = torch.empty(16)
    kernels.pack([base], wire, validate=False)
    transposed = base.view(4, 4).t()  # same address and size as base, but strided
    with pytest.raises(ValueError, match="not contiguous"):
        kernels.pack([transposed], wire)
    kernels.pack([transposed], wire, validate=False)  # the caller vouched for it: memory order
    assert torch.equal(wire, base)
    with pytest.raises(ValueError, match="not contiguous"):
        kernels.pack([transposed, torch.ones(1)], torch.empty(17), validate=False)  # a new layout: full check


def test_a_shorter_view_of_a_known_flat_buffer_is_rejected():
    srcs = [torch.ones(10)]
    buffer = torch.empty(10)
    kernels.pack(srcs, buffer)
    with pytest.raises(ValueError, match="dst holds 5 elements but the srcs need 10"):
        kernels.pack(srcs, buffer[:5])


def test_fusion_cpu_path_matches_the_kernels():
    """gpucomm.dataplane.bucket_copy's torch-ops path and the kernels agree bit for bit (NaN as NaN)."""
    gen = torch.Generator().manual_seed(13)
    for src, wire_dtype in [(torch.float32, torch.float32), *kernels.CASTS, (torch.bfloat16, torch.bfloat16)]:
        srcs = [special_values(src), random_values(src, 77, gen)]
        for scale in (1.0, 0.125, 10.0):
            n = sum(t.numel() for t in srcs)
            a, b = torch.empty(n, dtype=wire_dtype), torch.empty(n, dtype=wire_dtype)
            kernels.pack(srcs, a, scale=scale)
            bucket_copy.torch_pack(srcs, b, scale)
            assert_same_bits(a, b)
            outs_k, outs_t = [torch.empty_like(t) for t in srcs], [torch.empty_like(t) for t in srcs]
            kernels.unpack(a, outs_k, scale=scale)
            bucket_copy.torch_unpack(a, outs_t, scale)
            for x, y in zip(outs_k, outs_t):
                assert_same_bits(x, y)


@pytest.mark.parametrize("call,match", [
    (lambda: kernels.pack([torch.ones(4, 4).t()], torch.empty(16)), r"srcs\[0\] is not contiguous"),
    (lambda: kernels.unpack(torch.empty(16), [torch.ones(4), torch.ones(4, 4)[:, 1]]), r"dsts\[1\] is not contiguous"),
    (lambda: kernels.pack([torch.ones(4)], torch.empty(8)[::2]), r"dst must be a contiguous"),
    (lambda: kernels.pack([torch.ones(4), torch.ones(3)], torch.empty(6)), r"dst holds 6 elements but the srcs need 7"),
    (lambda: kernels.unpack(torch.empty(2), [torch.ones(3)]), r"src holds 2 elements but the dsts need 3"),
    (lambda: kernels.pack([torch.ones(2), torch.ones(2, dtype=torch.float64)], torch.empty(4)), r"share one dtype"),
    (lambda: kernels.pack([torch.ones(2)], torch.empty(2, dtype=torch.int32)), r"no pack kernel converts float32 to int32"),
    (lambda: kernels.pack([torch.ones(2, dtype=torch.float16)], torch.empty(2, dtype=torch.bfloat16)), r"float16 to bfloat16"),
    (lambda: kernels.pack([torch.ones(2, dtype=torch.int32)], torch.empty(2, dtype=torch.int32), scale=2), r"scale != 1 needs a floating"),
    (lambda: kernels.pack([torch.ones(2), "x"], torch.empty(4)), r"srcs\[1\] is a str, not a torch.Tensor"),
    (lambda: kernels.pack([torch.ones(2)], [0.0, 0.0]), r"dst must be a torch.Tensor"),
    (lambda: kernels.pack([torch.ones(2, device="meta")], torch.empty(2)), r"srcs\[0\] is on meta but dst is on cpu"),
    (lambda: kernels.pack([torch.ones(2, device="meta")], torch.empty(2, device="meta")), r"simulator .* needs CPU tensors"),
], ids=["noncontig-src", "noncontig-dst", "noncontig-flat", "dst-too-small", "src-too-small", "mixed-dtypes",
        "float-to-int", "f16-to-bf16", "int-scale", "not-a-tensor", "flat-not-a-tensor", "mixed-devices", "sim-needs-cpu"])
def test_bad_arguments_raise_clear_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_empty_and_zero_length_work():
    kernels.pack([], torch.empty(0))
    kernels.unpack(torch.empty(0), [])
    kernels.pack([torch.empty(0), torch.empty(0, 3)], torch.empty(0))
    kernels.unpack(torch.empty(5), [torch.empty(0)], scale=2.0)
    out = torch.zeros(3)
    kernels.pack((t for t in [torch.ones(0), torch.ones(3)]), out)  # any iterable
    assert torch.equal(out, torch.ones(3))


def test_bucket_copy_uses_the_kernels_and_matches_the_torch_fallback():
    """BucketCopy through the kernels (bound layout) and its few-launch torch fallback agree bit for bit."""
    from gpucomm.dataplane.bucket_copy import BucketCopy, TorchCopy
    from gpucomm.kernels import availability

    availability.reset()
    gen = torch.Generator().manual_seed(21)
    for src, wire_dtype in [(torch.float32, torch.float32), (torch.float64, torch.float64), *kernels.CASTS,
                            (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]:
        srcs = [special_values(src), random_values(src, 45, gen), random_values(src, CHUNK + 3, gen)]
        n = sum(t.numel() for t in srcs)
        for scale in (1.0, 0.125):
            copy = BucketCopy(pack_scale=scale, unpack_scale=1 / scale if scale != 1.0 else 1.0, kernels=True)
            a, b = torch.empty(n, dtype=wire_dtype), torch.empty(n, dtype=wire_dtype)
            for _ in range(2):  # the second call runs on the bound layout
                copy.pack(srcs, a)
            TorchCopy("pack", scale, lean=True)(srcs, b)
            assert_same_bits(a, b)
            outs_k, outs_t = [torch.empty_like(t) for t in srcs], [torch.empty_like(t) for t in srcs]
            copy.unpack(a, outs_k)
            TorchCopy("unpack", 1 / scale if scale != 1.0 else 1.0, lean=True)(outs_t, a)
            for x, y in zip(outs_k, outs_t):
                assert_same_bits(x, y)
    status = availability.status()
    assert status["usable"] and status["decided"] and status["fallback_copies"] == 0


def test_bound_copy_rebuilds_only_for_new_addresses(launches):
    from gpucomm.kernels.bound import BoundCopy

    copy = BoundCopy("pack", 2.0)
    srcs = [torch.randn(5), torch.randn(CHUNK + 1)]
    flat = torch.empty(CHUNK + 6)
    copy(srcs, flat)
    copy(srcs, flat)
    assert len(copy._layouts) == 1 and len(launches) == 2
    layout = copy._layout
    old = list(srcs)
    srcs[0] = torch.randn(5)  # a new gradient: a new address, written over the table (no new layout)
    copy(srcs, flat)
    assert copy._layout is layout and list(copy._layouts) == [copy._key]  # the old address set is gone
    assert torch.equal(flat, torch.cat(srcs) * 2)
    copy(old, flat)  # back to the first addresses: written over again, not read from a stale table
    assert torch.equal(flat, torch.cat(old) * 2) and len(launches) == 4
    with pytest.raises(ValueError, match="dst holds 3 elements"):
        copy(srcs, flat[:3])


@pytest.mark.parametrize("direction", ["pack", "unpack"])
@pytest.mark.parametrize("checked", [False, True])
def test_bound_copy_repoints_its_table_when_only_addresses_change(direction, checked):
    """zero_grad(set_to_none=True) reallocates a bucket's gradients every step: the same counts and dtype
    at new addresses re-point the table (no full check, no new split); anything else is checked in full."""
    from gpucomm.counters import COUNTERS
    from gpucomm.kernels.bound import BoundCopy

    if checked and direction == "unpack":
        pytest.skip("only a pack checks")
    copy = BoundCopy(direction, 0.5, checked=checked)
    sizes = [5, CHUNK + 1, 0, 2 * CHUNK + 7]
    flat = torch.randn(sum(sizes) + 3)
    out = torch.full((1,), -1.0) if checked else None
    built, rebased, rewritten = COUNTERS.kernel_tables_built, COUNTERS.kernel_tables_rebased, \
        COUNTERS.kernel_tables_rewritten
    for step in range(5):
        tensors = [torch.randn(n) for n in sizes]  # fresh tensors: new addresses every step
        if checked and step == 3:
            tensors[3][CHUNK + 2] = float("nan")
        if direction == "pack":
            copy(tensors, flat, check_out=out)
            torch.testing.assert_close(flat[:sum(sizes)], torch.cat(tensors) * 0.5, rtol=0, atol=0, equal_nan=True)
            if checked:
                assert float(out) == (4.0 if step == 3 else 0.0), step
        else:
            copy(tensors, flat)
            assert torch.equal(torch.cat(tensors), flat[:sum(sizes)] * 0.5), step
    assert COUNTERS.kernel_tables_built - built == 1
    assert COUNTERS.kernel_tables_rebased - rebased == 4
    assert COUNTERS.kernel_tables_rewritten - rewritten == 4  # the simulator has no second stream: in place
    # a different count at a new address is no rebase: checked in full (and refused if wrong)
    with pytest.raises(ValueError, match="not contiguous"):
        copy([torch.randn(n) for n in sizes[:3]] + [torch.randn(2, 2 * CHUNK + 7).t()], flat)


# Python calls ('call' events in gpucomm's own files, the simulated kernel body aside) of one BoundCopy call
# whose gradients moved (zero_grad(set_to_none=True), a rebase), measured: 8 plain, 12 checked (the
# finisher's launch; before it, 11 and six torch ops), whatever the tensor count; the new rows go over the
# table (no new table, launch, flags or layout). Before: 31 for 8
# tensors and 111 for 48 (two generator steps per tensor), then 13 and 19 with a new table each time. The
# guard: no work per tensor in Python, and at most this many calls per rebase.
MAX_CALLS_PER_REBASE = 16


@pytest.mark.parametrize("checked", [False, True])
def test_a_rebase_makes_no_python_call_per_tensor(checked):
    import sys

    from gpucomm.kernels.bound import BoundCopy

    package = os.path.dirname(os.path.dirname(os.path.abspath(kernels.__file__))) + os.sep
    kernel_bodies = tuple(os.path.join(package, "kernels", f) for f in ("devicefns.py", "specs.py"))
    counts = []
    for count in (8, 48):
        sizes = [(7 * i) % 50 + 1 for i in range(count)]
        flat = torch.zeros(sum(sizes))
        out = torch.zeros(1) if checked else None
        copy = BoundCopy("pack", 1.0, checked=checked)
        copy([torch.randn(n) for n in sizes], flat, check_out=out)  # the first layout: checked in full
        fresh = [torch.randn(n) for n in sizes]
        calls = []

        def profile(frame, event, arg):
            name = frame.f_code.co_filename
            if event == "call" and name.startswith(package) and not name.startswith(kernel_bodies):
                calls.append(frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            copy(fresh, flat, check_out=out)
        finally:
            sys.setprofile(None)
        assert torch.equal(flat, torch.cat(fresh))
        counts.append(len(calls))
    assert counts[0] == counts[1] and counts[0] <= MAX_CALLS_PER_REBASE, (counts, calls)


def test_bound_copy_checks_a_flat_buffer_of_another_dtype_or_layout_in_full():
    """The same flat address with another dtype or strides is no rebase: a new kernel, or a refusal."""
    from gpucomm.kernels.bound import BoundCopy

    copy = BoundCopy("pack")
    buf = torch.zeros(40)
    copy([torch.ones(10)], buf[:10])
    with pytest.raises(ValueError, match="contiguous"):
        copy([torch.ones(10)], buf[::2])
    buf.zero_()  # (the first call's float32 ones)
    half = buf.view(torch.float16)[:10]
    copy([torch.ones(10)], half)  # float32 -> float16: the casting kernel, ten halves written, no more
    assert torch.equal(half, torch.ones(10, dtype=torch.float16))
    assert torch.equal(buf.view(torch.float16)[10:], torch.zeros(70, dtype=torch.float16))


def test_a_bucket_copy_compiles_its_kernels_when_prepared_not_at_its_first_copy():
    """DistributedOptimizer prepares each fused bucket's copy when it is built, so the first backward
    compiles nothing (0.2-1 s per variant on a GPU). A variant no other test of this process used:
    float32 gradients into a bfloat16 wire (bf16 compression), scaled both ways."""
    from gpucomm.dataplane.bucket_copy import BucketCopy

    pack_spec = kernels.select_kernel(torch.float32, torch.bfloat16, True)
    unpack_spec = kernels.select_kernel(torch.bfloat16, torch.float32, True)
    copy = BucketCopy(pack_scale=0.5, unpack_scale=0.25, kernels=True)
    copy.prepare(torch.float32, torch.bfloat16, torch.device("cpu"))
    compiled = set(launch.compiled_names())
    assert {pack_spec.name, unpack_spec.name} <= compiled, compiled
    grads = [torch.randn(37), torch.randn(5, 3)]
    flat = torch.empty(52, dtype=torch.bfloat16)
    copy.pack(grads, flat)
    assert set(launch.compiled_names()) == compiled  # the copy compiled nothing more
    assert_same_bits(flat[:37], (grads[0] * 0.5).bfloat16())


CHECKED_PAIRS = [(dt, dt) for dt in FLOATS] + [(torch.float32, torch.float16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("src, wire", CHECKED_PAIRS, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("seed", range(3))
def test_checked_pack_finds_the_first_tensor_holding_inf_or_nan(src, wire, scale, seed):
    """The checked pack copies exactly as the plain one and writes 0 or 1 + the first bad tensor's
    index, whatever piece of whatever tensor holds the Inf or NaN (or none does)."""
    from gpucomm.kernels.bound import BoundCopy

    gen = torch.Generator().manual_seed(seed * 31 + FLOATS.index(src))
    sizes = [int(n) for n in torch.randint(0, 3 * CHUNK, (7,), generator=gen)] + [0, 1]
    # all finite, also once packed (random float32 beyond 65504 would overflow a float16 wire: that is a
    # finding of its own, tested below)
    bound = 6e4 if wire == torch.float16 else None
    srcs = [random_values(src, n, gen).reshape(-1).nan_to_num(0.0, 1.0, -1.0).clamp(-bound, bound) if bound else
            random_values(src, n, gen).reshape(-1).nan_to_num(0.0, 1.0, -1.0) for n in sizes]
    copy = BoundCopy("pack", scale, checked=True)
    wire_buf = torch.zeros(sum(sizes) + 1, dtype=wire)
    out = torch.full((1,), -1.0)
    copy(srcs, wire_buf, check_out=out)
    assert float(out) == 0.0
    assert_same_bits(wire_buf[:sum(sizes)], reference(torch.cat(srcs), wire, scale))
    for bad_tensor, value in ((5, float("nan")), (3, float("-inf")), (8, float("inf"))):
        if sizes[bad_tensor] == 0:
            continue
        poisoned = [t.clone() for t in srcs]
        at = int(torch.randint(sizes[bad_tensor], (1,), generator=gen))
        poisoned[bad_tensor][at] = value
        later = next((i for i in range(bad_tensor + 1, len(sizes)) if sizes[i]), None)
        if later is not None:  # a later tensor too: the first one is named
            poisoned[later][0] = float("nan")
        copy(poisoned, wire_buf, check_out=out)
        assert float(out) == bad_tensor + 1, (bad_tensor, at, float(out))
        assert_same_bits(wire_buf[:sum(sizes)], reference(torch.cat(poisoned), wire, scale))
        copy(srcs, wire_buf, check_out=out)  # the flags are cleared for the next call
        assert float(out) == 0.0


def test_a_checked_pack_finishes_in_one_more_launch_and_no_torch_op(launches):
    """The slot value comes from one finisher launch after the pack (which also clears the flags for the
    next pack): no torch op at all, where finding the first flagged tensor took six (the flags' zeroing,
    then five small ops: on a GPU about 50 us of host time per bucket and step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from gpucomm.kernels.bound import BoundCopy

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    copy = BoundCopy("pack", 1.0, checked=True)
    flat, out = torch.zeros(3 * CHUNK + 8), torch.full((1,), -1.0)
    srcs = [torch.randn(n) for n in (CHUNK + 5, 3, 2 * CHUNK)]
    copy(srcs, flat, check_out=out)  # binds the layout (checked in full)
    for poisoned in (None, 2, 0):
        tensors = [t.clone() for t in srcs]  # new addresses: a rebase each time, as after zero_grad()
        if poisoned is not None:
            tensors[poisoned][-1] = float("nan")
        launches.clear()
        with Ops() as seen:
            copy(tensors, flat, check_out=out)
        assert seen.ops == [], seen.ops
        assert [name for name, _, _ in launches] == ["copy_f32_checked", "finish_checked_f32"], launches
        assert float(out) == (0.0 if poisoned is None else poisoned + 1.0)
        assert torch.equal(flat.view(torch.int32), torch.cat(tensors).view(torch.int32))  # NaN too


def test_a_slot_the_finisher_cannot_write_is_refused_before_the_pack_runs(launches):
    """A review's finding: an integer slot (or one on another device) failed in the finisher after the pack
    had flagged a NaN, so the flags stayed set and the next, clean pack reported a non-finite tensor. The
    slot is checked before anything is launched, and a clean pack then reports nothing."""
    from gpucomm.kernels.bound import BoundCopy

    copy = BoundCopy("pack", 1.0, checked=True)
    flat = torch.zeros(2 * CHUNK + 5)
    poisoned = [torch.randn(CHUNK + 5), torch.randn(CHUNK)]
    poisoned[1][3] = float("nan")
    for slot in (torch.zeros(1, dtype=torch.int32), torch.zeros(2)):
        launches.clear()
        with pytest.raises(ValueError, match="one floating element on the buffer's device"):
            copy(poisoned, flat, check_out=slot)
        assert launches == []
    out = torch.full((1,), -1.0)
    copy([torch.randn(CHUNK + 5), torch.randn(CHUNK)], flat, check_out=out)
    assert float(out) == 0.0
    copy(poisoned, flat)  # no slot: the pack's flags are still cleared by the finisher
    copy([torch.randn(CHUNK + 5), torch.randn(CHUNK)], flat, check_out=out)
    assert float(out) == 0.0


def test_checked_pack_flags_a_cast_that_overflows():
    """65504 is the largest float16: 1e5 packs to Inf, and that is what travels."""
    from gpucomm.kernels.bound import BoundCopy

    srcs = [torch.ones(10), torch.tensor([3.0, 1e5, 2.0])]
    out = torch.zeros(1)
    BoundCopy("pack", 1.0, checked=True)(srcs, torch.zeros(13, dtype=torch.float16), check_out=out)
    assert float(out) == 2.0


def test_checked_pack_caps_the_index_at_the_slots_exact_range():
    from gpucomm.kernels.bound import BoundCopy

    srcs = [torch.ones(1) for _ in range(300)]
    srcs[290][0] = float("nan")
    out = torch.zeros(1, dtype=torch.bfloat16)
    BoundCopy("pack", 1.0, checked=True)(srcs, torch.zeros(300), check_out=out, check_limit=256)
    assert float(out) == 256.0


@pytest.mark.parametrize("src, wire", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                       (torch.bfloat16, torch.bfloat16)], ids=str)
def test_bucket_copy_checked_kernels_and_torch_fallback_agree(src, wire, monkeypatch):
    from gpucomm.dataplane.bucket_copy import BucketCopy
    from gpucomm.kernels import availability

    gen = torch.Generator().manual_seed(11)
    srcs = [random_values(src, n, gen).reshape(-1).nan_to_num(0.0, 1.0, -1.0).clamp(-6e4, 6e4) for n in (5, 700, 0, 33)]
    srcs[3][7] = float("nan")
    results = {}
    for kernels_on in (True, False):
        availability.reset()
        copy = BucketCopy(pack_scale=0.5, kernels=kernels_on, check_finite=True)
        flat = torch.zeros(sum(t.numel() for t in srcs), dtype=wire)
        out = torch.zeros(1)
        copy.pack(srcs, flat, check_out=out)
        results[kernels_on] = (flat, float(out))
    assert results[True][1] == results[False][1] == 4.0
    assert_same_bits(results[True][0], results[False][0])


def test_a_checked_layout_rebased_onto_a_table_of_its_own_gets_its_own_row_map(monkeypatch):
    """A review's finding: a rebase that cannot write over its table (another stream read it) made a new table
    but kept the old layout's row map, uploaded on the old stream: a stream waiting on the new table's ready
    event was not ordered after that upload, nor kept it alive. The new layout now has its own flags and row
    map, made on its stream before its table (and so covered by its ready event), equal to the old ones."""
    from gpucomm.kernels.bound import BoundCopy

    copy = BoundCopy("pack", 1.0, checked=True)
    flat, out = torch.zeros(2 * CHUNK + 7), torch.full((1,), -1.0)
    srcs = [torch.randn(n) for n in (CHUNK + 4, 3, CHUNK)]
    copy(srcs, flat, check_out=out)  # binds the layout (checked in full)
    base = copy._layout
    monkeypatch.setattr(table.Table, "rewritable", lambda self, stream: False)  # as if read on another stream
    fresh = [t.clone() for t in srcs]
    fresh[1][0] = float("inf")
    copy(fresh, flat, check_out=out)
    rebased = copy._layout
    assert rebased is not base and rebased.table is not base.table
    assert rebased.finite.row_tensor is not base.finite.row_tensor and rebased.finite.flags is not base.finite.flags
    assert torch.equal(rebased.finite.row_tensor, base.finite.row_tensor)
    assert float(out) == 2.0 and torch.equal(flat.view(torch.int32), torch.cat(fresh).view(torch.int32))
    assert not rebased.finite.flags.any()  # the finisher cleared them for the next pack
