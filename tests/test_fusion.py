"""Bucket planning, fusion limits from code and environment, grow-only buffers, and the CPU
pack/unpack path (torch ops) with the kernels' contract."""

from __future__ import annotations


import pytest
import torch

from gpucomm.dataplane.buffers import FusionBuffers
from gpucomm.dataplane.bucket_copy import KERNELS_ENV, pack_bucket, unpack_bucket
from gpucomm.dataplane.fusion import Bucket, FusionLimits, fusion_limits, plan_buckets
from tests.harness import PYTHON, run
from tests.kernels.reference import assert_same_bits, random_values, reference, special_values

MiB = 1 << 20
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INTS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
CASTS = [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
         (torch.float16, torch.float32), (torch.bfloat16, torch.float32)]


# -- limits -------------------------------------------------------------------------------------


def test_default_limits_are_ddps():
    assert fusion_limits(env={}) == FusionLimits(first_bucket_bytes=1 * MiB, bucket_cap_bytes=25 * MiB)


@pytest.mark.parametrize("env,want", [
    ({"GPUCOMM_FUSION_THRESHOLD": "67108864"}, FusionLimits(MiB, 64 * MiB)),
    ({"HOROVOD_FUSION_THRESHOLD": "33554432"}, FusionLimits(MiB, 32 * MiB)),
    ({"GPUCOMM_FUSION_THRESHOLD": "4194304", "HOROVOD_FUSION_THRESHOLD": "1"}, FusionLimits(MiB, 4 * MiB)),
    ({"GPUCOMM_FUSION_THRESHOLD": " ", "HOROVOD_FUSION_THRESHOLD": "2097152"}, FusionLimits(MiB, 2 * MiB)),
    ({"HOROVOD_FUSION_THRESHOLD": "524288"}, FusionLimits(524288, 524288)),  # first bucket never above the cap
    ({"HOROVOD_FUSION_THRESHOLD": "0"}, FusionLimits(0, 0)),  # Horovod: 0 disables fusion
    ({"GPUCOMM_FUSION_FIRST_BUCKET": "65536"}, FusionLimits(65536, 25 * MiB)),
    ({"GPUCOMM_FUSION_THRESHOLD": "1_048_576 "}, FusionLimits(MiB, MiB)),
], ids=["gpucomm", "horovod", "gpucomm-wins", "blank-ignored", "small-cap", "zero", "first-env", "underscores"])
def test_limits_from_the_environment(env, want):
    assert fusion_limits(env=env) == want


def test_arguments_win_over_the_environment():
    env = {"GPUCOMM_FUSION_THRESHOLD": "1", "GPUCOMM_FUSION_FIRST_BUCKET": "1"}
    assert fusion_limits(first_bucket_bytes=2048, bucket_cap_bytes=4096, env=env) == FusionLimits(2048, 4096)
    assert fusion_limits(bucket_cap_bytes=4096, env={}) == FusionLimits(4096, 4096)


@pytest.mark.parametrize("value", ["abc", "-5", "1.5", "64MB", "1e6"])
def test_bad_threshold_env_names_the_variable(value):
    with pytest.raises(ValueError, match=r"HOROVOD_FUSION_THRESHOLD='.*' (is not a whole number of bytes|is out of "
                                         r"range); set a whole number of bytes >= 0"):
        fusion_limits(env={"HOROVOD_FUSION_THRESHOLD": value})
    with pytest.raises(ValueError, match=r"GPUCOMM_FUSION_FIRST_BUCKET"):
        fusion_limits(env={"GPUCOMM_FUSION_FIRST_BUCKET": value})


@pytest.mark.parametrize("kwargs,error", [
    ({"bucket_cap_bytes": -1}, ValueError), ({"first_bucket_bytes": -8}, ValueError),
    ({"bucket_cap_bytes": 1.5}, TypeError), ({"bucket_cap_bytes": True}, TypeError),
])
def test_bad_threshold_arguments(kwargs, error):
    with pytest.raises(error, match="bytes|byte count"):
        fusion_limits(env={}, **kwargs)


# -- planning -----------------------------------------------------------------------------------


def _f32(n: int, device: str = "cpu") -> torch.Tensor:
    return torch.empty(n, dtype=torch.float32, device=device)


def _check_plan_covers(params, plan: list[Bucket]) -> None:
    seen = [i for b in plan for i in b.param_indices]
    assert sorted(seen) == list(range(len(params)))
    for number, b in enumerate(plan):
        assert b.index == number
        assert all(params[i].dtype == b.dtype and params[i].device == b.device for i in b.param_indices)
        assert b.numels == tuple(params[i].numel() for i in b.param_indices)
        assert list(b.offsets) == [sum(b.numels[:j]) for j in range(len(b.numels))]
        assert b.numel == sum(b.numels) and b.nbytes == b.numel * b.dtype.itemsize


def test_buckets_take_parameters_in_reverse_order_small_first_then_capped():
    params = [_f32(25) for _ in range(10)]  # 100 bytes each
    plan = plan_buckets(params, first_bucket_bytes=200, bucket_cap_bytes=450, env={})
    _check_plan_covers(params, plan)
    assert [b.param_indices for b in plan] == [(9, 8), (7, 6, 5, 4), (3, 2, 1, 0)]
    assert [b.nbytes for b in plan] == [200, 400, 400]


def test_default_plan_puts_one_mib_first():
    params = [_f32(128 * 1024) for _ in range(60)]  # 512 KiB each
    plan = plan_buckets(params, env={})
    _check_plan_covers(params, plan)
    assert plan[0].param_indices == (59, 58) and plan[0].nbytes == MiB
    assert all(b.nbytes <= 25 * MiB for b in plan) and plan[1].nbytes == 25 * MiB


def test_one_dtype_and_device_per_bucket_each_with_its_own_first_bucket():
    params = []
    for k in range(8):
        params.append(_f32(25))
        params.append(torch.empty(50, dtype=torch.float16))
        params.append(_f32(25, device="meta"))
    plan = plan_buckets(params, first_bucket_bytes=100, bucket_cap_bytes=300, env={})
    _check_plan_covers(params, plan)
    keys = {(b.dtype, b.device) for b in plan}
    assert keys == {(torch.float32, torch.device("cpu")), (torch.float16, torch.device("cpu")),
                    (torch.float32, torch.device("meta"))}
    for key in keys:
        sizes = [b.nbytes for b in plan if (b.dtype, b.device) == key]
        assert sizes == [100, 300, 300, 100]
    # numbered by readiness: the bucket holding the last parameter comes first
    firsts = [max(b.param_indices) for b in plan]
    assert firsts == sorted(firsts, reverse=True)


def test_a_tensor_above_the_cap_gets_a_bucket_of_its_own():
    params = [_f32(10), _f32(1000), _f32(10), _f32(10)]
    plan = plan_buckets(params, first_bucket_bytes=100, bucket_cap_bytes=100, env={})
    _check_plan_covers(params, plan)
    assert [b.param_indices for b in plan] == [(3, 2), (1,), (0,)]


def test_threshold_zero_means_one_tensor_per_bucket():
    params = [_f32(3), torch.empty(0), _f32(1), _f32(2)]
    plan = plan_buckets(params, env={"HOROVOD_FUSION_THRESHOLD": "0"})
    assert [b.param_indices for b in plan] == [(3,), (2,), (1,), (0,)]


def test_plans_are_deterministic_and_type_checked():
    params = [torch.empty(n, dtype=dt) for n, dt in zip(range(1, 40), [torch.float32, torch.bfloat16, torch.int64] * 13)]
    assert plan_buckets(params, first_bucket_bytes=64, bucket_cap_bytes=256, env={}) == \
        plan_buckets(list(params), first_bucket_bytes=64, bucket_cap_bytes=256, env={})
    assert plan_buckets([], env={}) == []
    with pytest.raises(TypeError, match=r"params\[1\] is a int"):
        plan_buckets([_f32(1), 5], env={})


# -- buffers ------------------------------------------------------------------------------------


def test_buffers_grow_only_per_device_dtype_and_slot():
    buffers = FusionBuffers()
    a = buffers.get("cpu", torch.float32, 100)
    assert a.shape == (100,) and a.dtype == torch.float32
    assert buffers.get("cpu", torch.float32, 40).data_ptr() == a.data_ptr()
    b = buffers.get("cpu", torch.float32, 200)
    assert b.numel() == 200
    assert buffers.get(torch.device("cpu"), torch.float32, 150).data_ptr() == b.data_ptr()  # no shrink
    other_slot = buffers.get("cpu", torch.float32, 10, slot=1)
    other_dtype = buffers.get("cpu", torch.bfloat16, 10)
    assert len({b.data_ptr(), other_slot.data_ptr(), other_dtype.data_ptr()}) == 3
    assert buffers.nbytes() == 200 * 4 + 10 * 4 + 10 * 2
    assert buffers.get("cpu", torch.float32, 0).numel() == 0
    with pytest.raises(ValueError, match="numel must be >= 0"):
        buffers.get("cpu", torch.float32, -1)
    buffers.clear()
    assert buffers.nbytes() == 0


# -- CPU pack / unpack ---------------------------------------------------------------------------


def _tensors(dtype, gen):
    ts = [random_values(dtype, n, gen) for n in (7, 0, 1, 300)]
    ts.insert(1, random_values(dtype, 12, gen).reshape(3, 4))
    if dtype.is_floating_point:
        ts.append(special_values(dtype))
    return ts


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_cpu_roundtrip_is_bit_exact(dtype):
    ts = _tensors(dtype, torch.Generator().manual_seed(1))
    total = sum(t.numel() for t in ts)
    buffer = torch.zeros(total + 4, dtype=dtype)
    packed = pack_bucket(ts, buffer)
    assert packed.data_ptr() == buffer.data_ptr() and packed.numel() == total
    assert_same_bits(packed, torch.cat([t.reshape(-1) for t in ts]))
    assert torch.count_nonzero(buffer[total:]) == 0
    outs = [torch.empty_like(t) for t in ts]
    unpack_bucket(buffer, outs)
    for t, out in zip(ts, outs):
        assert_same_bits(out, t)


@pytest.mark.parametrize("src,wire", [(dt, dt) for dt in FLOATS] + CASTS, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_cpu_scale_and_cast_follow_the_contract(src, wire, scale):
    """cast(x * scale) with the product in float32 (float64 for float64): what the kernels compute."""
    ts = _tensors(src, torch.Generator().manual_seed(2))
    flat_src = torch.cat([t.reshape(-1) for t in ts])
    buffer = torch.empty(flat_src.numel(), dtype=wire)
    assert_same_bits(pack_bucket(ts, buffer, scale=scale), reference(flat_src, wire, scale))
    before = buffer.clone()
    outs = [torch.empty_like(t) for t in ts]
    unpack_bucket(buffer, outs, scale=scale)
    assert_same_bits(buffer, before)  # unpack never scales the buffer in place
    assert_same_bits(torch.cat([o.reshape(-1) for o in outs]), reference(before, src, scale))


def test_float16_overflow_and_bfloat16_ties():
    x = torch.tensor([65504.0, 65519.99, 65520.0, -1e6, 2.0**-25, 3 * 2.0**-26], dtype=torch.float32)
    half = pack_bucket([x], torch.empty(6, dtype=torch.float16))
    assert half.tolist()[:4] == [65504.0, 65504.0, float("inf"), float("-inf")]
    assert half[4].item() == 0.0 and half[5].item() == 2.0**-24
    ties = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8])  # halfway between bfloat16 neighbours
    assert pack_bucket([ties], torch.empty(2, dtype=torch.bfloat16)).tolist() == [1.0, 1 + 2 * 2.0**-7]


def test_cpu_unpack_into_parameters_that_require_grad():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    unpack_bucket(torch.arange(7, dtype=torch.float32), params, scale=2.0)
    assert params[0].tolist() == [0.0, 2.0, 4.0] and params[1].flatten().tolist() == [6.0, 8.0, 10.0, 12.0]
    assert pack_bucket(params, torch.empty(7)).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0]


@pytest.mark.parametrize("call,error,match", [
    (lambda: pack_bucket([torch.ones(4, 4).t()], torch.empty(16)), ValueError, r"srcs\[0\] is not contiguous"),
    (lambda: pack_bucket([torch.ones(2), torch.ones(2, dtype=torch.float64)], torch.empty(4)), ValueError, "one dtype"),
    (lambda: pack_bucket([torch.ones(5)], torch.empty(4)), ValueError, "dst holds 4 elements but the srcs need 5"),
    (lambda: unpack_bucket(torch.empty(4), [torch.ones(5)]), ValueError, "src holds 4 elements"),
    (lambda: pack_bucket([torch.ones(2, dtype=torch.int64)], torch.empty(2, dtype=torch.int64), scale=0.5),
     ValueError, "scale != 1 needs a floating dtype"),
    (lambda: unpack_bucket(torch.empty(2, dtype=torch.float16), [torch.ones(2, dtype=torch.bfloat16)]),
     ValueError, "no pack kernel converts float16 to bfloat16"),
    (lambda: pack_bucket([torch.ones(2, device="meta")], torch.empty(2)), ValueError, "is on meta but dst is on cpu"),
    (lambda: pack_bucket(torch.ones(2), torch.empty(2)), TypeError, "got one tensor"),
], ids=["noncontig", "mixed-dtypes", "dst-small", "src-small", "int-scale", "unsupported-cast", "devices", "one-tensor"])
def test_cpu_path_rejects_what_the_kernels_reject(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_cpu_empty_lists_and_zero_length():
    assert pack_bucket([], torch.empty(3)).numel() == 0
    unpack_bucket(torch.empty(3), [])
    assert pack_bucket([torch.empty(0)], torch.empty(0), scale=2.0).numel() == 0


def test_cpu_path_does_not_import_numba():
    code = ("import sys, torch; from gpucomm.dataplane import bucket_copy, fusion; "
            "bucket_copy.unpack_bucket(bucket_copy.pack_bucket([torch.ones(3)], torch.empty(3), scale=2.0), [torch.empty(3)]); "
            "fusion.plan_buckets([torch.ones(3)]); from gpucomm.dataplane.bucket_copy import BucketCopy; "
            "c = BucketCopy(pack_scale=2.0); f = torch.empty(3); c.pack([torch.ones(3)], f); c.unpack(f, [torch.empty(3)]); "
            "assert 'numba' not in sys.modules, 'numba was imported'")
    result = run([PYTHON, "-c", code], timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and CUDA torch")
def test_gpu_torch_fallback_matches_kernels(monkeypatch):
    ts = [t.cuda() for t in _tensors(torch.float32, torch.Generator().manual_seed(3))]
    total = sum(t.numel() for t in ts)
    kernel = pack_bucket(ts, torch.empty(total, dtype=torch.bfloat16, device="cuda"), scale=0.5)
    monkeypatch.setenv(KERNELS_ENV, "0")
    torch_ops = pack_bucket(ts, torch.empty(total, dtype=torch.bfloat16, device="cuda"), scale=0.5)
    assert_same_bits(kernel.cpu(), torch_ops.cpu())
