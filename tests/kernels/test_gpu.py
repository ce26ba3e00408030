"""The kernels on a real GPU: bit-exact against torch, one launch per call, stream order.

``pytest -m gpu tests/kernels/test_gpu.py`` on a machine with CUDA; skipped without one.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("GPU suite: numba is in simulator mode (NUMBA_ENABLE_CUDASIM=1)", allow_module_level=True)

import torch  # noqa: E402

from tests.kernels.reference import assert_same_bits, random_values, reference, special_values  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and CUDA torch")]

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INTS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@pytest.fixture(params=["driver", "core", "numba"])
def launch_mode(request, monkeypatch):
    """Run each test through every launch path; a path that fell back to the next one fails."""
    from gpucomm.kernels import launch  # noqa: PLC0415

    monkeypatch.setenv("GPUCOMM_KERNEL_LAUNCH", request.param)
    monkeypatch.setattr(launch, "_broken", set())
    launch._modes.clear()
    yield request.param
    assert launch.launch_mode() == request.param, f"the {request.param} launch path fell back to another"
    launch._modes.clear()


def _layout(dtype, gen, specials=True):
    sizes = [0, 1, 31, 32, 33, 4095, 4096, 4097, 100_003, 3]
    ts = [random_values(dtype, n, gen) for n in sizes]
    if specials and dtype.is_floating_point:
        ts.append(special_values(dtype))
    return [t.cuda() for t in ts]


def _check(srcs, wire_dtype, pack_scale, unpack_scale):
    from gpucomm import kernels  # noqa: PLC0415

    total = sum(t.numel() for t in srcs)
    wire = torch.zeros(total + 5, dtype=wire_dtype, device="cuda")
    kernels.pack(srcs, wire, scale=pack_scale)
    outs = [torch.empty_like(t) for t in srcs]
    kernels.unpack(wire, outs, scale=unpack_scale)
    torch.cuda.synchronize()
    cpu_srcs = [t.cpu() for t in srcs]
    want = reference(torch.cat([t.reshape(-1) for t in cpu_srcs]), wire_dtype, pack_scale)
    assert_same_bits(wire[:total].cpu(), want)
    assert torch.count_nonzero(wire[total:]) == 0
    offset = 0
    for t, out in zip(cpu_srcs, outs):
        assert_same_bits(out.cpu().reshape(-1), reference(want[offset:offset + t.numel()], t.dtype, unpack_scale))
        offset += t.numel()


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_copy_matches_torch(launch_mode, dtype):
    _check(_layout(dtype, torch.Generator().manual_seed(1)), dtype, 1.0, 1.0)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_scaled_copy_matches_torch(launch_mode, dtype):
    _check(_layout(dtype, torch.Generator().manual_seed(2)), dtype, 0.125, 3.0)


@pytest.mark.parametrize("src,wire", [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                      (torch.float16, torch.float32), (torch.bfloat16, torch.float32)],
                         ids=["f32-f16", "f32-bf16", "f16-f32", "bf16-f32"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_casts_match_torch(launch_mode, src, wire, scale):
    _check(_layout(src, torch.Generator().manual_seed(3)), wire, scale, scale)


def test_one_launch_per_call():
    from gpucomm import kernels  # noqa: PLC0415

    srcs = [torch.randn(int(n), device="cuda") for n in torch.randint(1, 50, (1000,))] + [torch.randn(1 << 22, device="cuda")]
    wire = torch.empty(sum(t.numel() for t in srcs), device="cuda", dtype=torch.bfloat16)
    kernels.pack(srcs, wire)  # compile and build the table outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        kernels.pack(srcs, wire, scale=0.5)
        kernels.unpack(wire, srcs, scale=2.0)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels_run = [n for n in names if "pack_kernel" in n]
    assert len(kernels_run) == 2, names


def test_stream_order_on_a_non_default_stream():
    """pack/unpack run on the given stream (and by default on the current one), after earlier work there."""
    from gpucomm import kernels  # noqa: PLC0415

    side = torch.cuda.Stream()
    src = torch.zeros(1 << 20, device="cuda")
    wire = torch.zeros(1 << 20, device="cuda")
    out = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the fill
        src.fill_(3.0)
    kernels.pack([src], wire, stream=side)  # explicit stream
    with torch.cuda.stream(side):
        kernels.unpack(wire, [out], scale=2.0)  # the current stream
    side.synchronize()
    assert torch.all(wire == 3.0) and torch.all(out == 6.0)


def test_cached_table_is_safe_on_a_second_stream():
    from gpucomm import kernels  # noqa: PLC0415

    kernels.clear_cache()
    srcs = [torch.randn(5000, device="cuda"), torch.randn(3, device="cuda")]
    wire = torch.empty(5003, device="cuda")
    torch.cuda.synchronize()  # srcs were filled on the default stream; a and b below do not wait for it
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(a):
        torch.cuda._sleep(100_000_000)
        kernels.pack(srcs, wire, stream=a)  # builds and uploads the table on a (behind the sleep)
    out = torch.empty(5003, device="cuda")
    kernels.pack(srcs, out, stream=b)  # a different flat buffer: another layout, its own table
    kernels.pack(srcs, wire, stream=b)  # a's layout on stream b: must wait for a's upload, not race it
    torch.cuda.synchronize()
    assert torch.equal(wire, torch.cat(srcs)) and torch.equal(out, torch.cat(srcs))
    assert kernels.cache_info()["hits"] == 1


def test_fusion_gpu_and_cpu_paths_agree():
    from gpucomm.dataplane import bucket_copy  # noqa: PLC0415

    gen = torch.Generator().manual_seed(4)
    cpu = [random_values(torch.float32, n, gen) for n in (10, 0, 70_000)] + [special_values(torch.float32)]
    gpu = [t.cuda() for t in cpu]
    total = sum(t.numel() for t in cpu)
    for wire_dtype in (torch.float32, torch.float16, torch.bfloat16):
        a = bucket_copy.pack_bucket(gpu, torch.empty(total, dtype=wire_dtype, device="cuda"), scale=0.25)
        b = bucket_copy.pack_bucket(cpu, torch.empty(total, dtype=wire_dtype), scale=0.25)
        assert_same_bits(a.cpu(), b)


@pytest.mark.parametrize("src,wire", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                      (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)], ids=str)
def test_bucket_copy_kernels_and_torch_fallback_agree(launch_mode, src, wire, monkeypatch):
    """The optimizer's per-bucket copy: bound kernels, and the torch fallback chosen by GPUCOMM_FUSION_KERNELS=0."""
    from gpucomm.dataplane import bucket_copy  # noqa: PLC0415
    from gpucomm.dataplane.bucket_copy import BucketCopy  # noqa: PLC0415
    from gpucomm.kernels import availability  # noqa: PLC0415

    availability.reset()
    gen = torch.Generator().manual_seed(8)
    srcs = _layout(src, gen)
    total = sum(t.numel() for t in srcs)
    results = {}
    for path in ("kernels", "torch"):
        monkeypatch.setenv(bucket_copy.KERNELS_ENV, "1" if path == "kernels" else "0")
        copy = BucketCopy(pack_scale=0.5, unpack_scale=0.25)
        flat = torch.empty(total, dtype=wire, device="cuda")
        outs = [torch.empty_like(t) for t in srcs]
        for _ in range(3):  # the later calls run on the bound layout
            copy.pack(srcs, flat)
            copy.unpack(flat, outs)
        torch.cuda.synchronize()
        results[path] = (flat.cpu(), [o.cpu() for o in outs])
    assert_same_bits(results["kernels"][0], results["torch"][0])
    for a, b in zip(results["kernels"][1], results["torch"][1]):
        assert_same_bits(a, b)
    assert availability.status()["usable"], availability.status()


def test_bound_copy_follows_reallocated_gradients():
    from gpucomm.kernels import BoundCopy  # noqa: PLC0415

    copy = BoundCopy("pack", 2.0)
    flat = torch.empty(6000, device="cuda")
    for step in range(5):  # new tensors every step, as after zero_grad(set_to_none=True)
        srcs = [torch.full((1000,), float(step), device="cuda"), torch.randn(5000, device="cuda")]
        copy(srcs, flat)
        torch.cuda.synchronize()
        assert torch.equal(flat, torch.cat(srcs) * 2)


@pytest.mark.parametrize("checked", [False, True])
def test_a_table_rewritten_in_place_is_read_in_stream_order(checked):
    """A bucket whose gradients move every step gets its new rows written over its table, in the launch
    stream's order (``Table.rewrite``): with the host ahead of the GPU (a sleep queued first; the pinned
    ring lets it run three rewrites ahead), every step's pack must still read that step's tensors, and the
    finite check flag that step's NaN only."""
    from gpucomm.counters import COUNTERS  # noqa: PLC0415
    from gpucomm.kernels import BoundCopy  # noqa: PLC0415

    copy = BoundCopy("pack", 2.0, checked=checked)
    sizes = [1000, 5000, 3]
    flat = torch.empty(sum(sizes), device="cuda")
    steps, outs, slots, seen = 12, [], [], []
    previous = [torch.zeros(n, device="cuda") for n in sizes]
    copy(previous, flat, check_out=torch.zeros(1, device="cuda"))
    torch.cuda.synchronize()
    built, rewritten = COUNTERS.kernel_tables_built, COUNTERS.kernel_tables_rewritten
    torch.cuda._sleep(300_000_000)  # the GPU is busy: the first uploads and launches below queue behind it
    for step in range(steps):
        # allocated while the previous step's tensors still live: new addresses every step, as gradients get
        # when zero_grad(set_to_none=True) frees them only after backward made the next ones
        srcs = [torch.full((n,), float(step + i), device="cuda") for i, n in enumerate(sizes)]
        del previous
        if checked and step == 7:
            srcs[1][4321] = float("nan")
        seen.append(tuple(t.data_ptr() for t in srcs))
        slot = torch.full((1,), -1.0, device="cuda")
        copy(srcs, flat, check_out=slot if checked else None)
        outs.append(flat.clone())  # queued after this step's pack, before the next step's upload
        slots.append(slot)
        previous = srcs
    torch.cuda.synchronize()
    assert all(a != b for a, b in zip(seen, seen[1:])), "the tensors did not move: nothing was rewritten"
    assert COUNTERS.kernel_tables_built == built  # no table built: every step wrote over the same one
    assert COUNTERS.kernel_tables_rewritten - rewritten == steps
    for step, out in enumerate(outs):
        for i, piece in enumerate(torch.split(out.cpu(), sizes)):
            value = float(step + i) * 2
            if checked and step == 7 and i == 1:
                assert torch.isnan(piece[4321]) and torch.all(piece[:4321] == value), step
            else:
                assert torch.all(piece == value), (step, i, piece[:4])
        if checked:
            assert float(slots[step]) == (2.0 if step == 7 else 0.0), (step, float(slots[step]))


def test_a_table_read_on_a_second_stream_is_not_written_over():
    """Once another stream launched from a bucket's table, a move of its tensors builds a new table: an
    upload over it on the default stream could land before the other stream's launch reads it. Here the
    side stream's unpack (behind a sleep) must still write into its own tensors, not the moved ones."""
    from gpucomm.counters import COUNTERS  # noqa: PLC0415
    from gpucomm.kernels import BoundCopy  # noqa: PLC0415

    copy = BoundCopy("unpack")
    flat = torch.full((4000,), 5.0, device="cuda")
    first = [torch.zeros(4000, device="cuda")]
    copy(first, flat)
    torch.cuda.synchronize()
    assert torch.all(first[0] == 5.0)
    first[0].zero_()
    flat.fill_(7.0)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(300_000_000)
        copy(first, flat)  # the same layout, launched on the side stream (behind the sleep): into first
    rewritten, rebased = COUNTERS.kernel_tables_rewritten, COUNTERS.kernel_tables_rebased
    second = [torch.zeros(4000, device="cuda")]
    copy(second, flat)  # moved tensors on the default stream, no wait for the side stream: a new table
    assert COUNTERS.kernel_tables_rebased - rebased == 1 and COUNTERS.kernel_tables_rewritten == rewritten
    torch.cuda.synchronize()
    assert torch.all(first[0] == 7.0) and torch.all(second[0] == 7.0)  # each launch read its own rows
