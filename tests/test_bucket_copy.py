"""BucketCopy: the fusion kernels while they can run, else torch ops decided once; the lean torch
path (few launches) has the kernels' numerics."""

from __future__ import annotations

import logging
import os

import pytest
import torch

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("checks the no-GPU fallback; numba is in simulator mode here", allow_module_level=True)

from gpucomm.counters import COUNTERS  # noqa: E402
from gpucomm.dataplane.bucket_copy import BucketCopy, TorchCopy  # noqa: E402
from gpucomm.kernels import CASTS, availability  # noqa: E402
from tests.kernels.reference import assert_same_bits, random_values, reference, special_values  # noqa: E402

COMBOS = [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.bfloat16, torch.bfloat16),
          (torch.float16, torch.float16), *CASTS]


@pytest.fixture(autouse=True)
def fresh_decision():
    availability.reset()
    yield
    availability.reset()


def _tensors(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (1,), (0,), (7, 2, 2), (40,)]
    ts = [random_values(dtype, int(torch.tensor(s).prod()), gen).reshape(s) for s in shapes]
    return ts + [special_values(dtype)]


@pytest.mark.parametrize("lean", [True, False], ids=["foreach", "cpu-one-pass"])
@pytest.mark.parametrize("src,wire", COMBOS, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.125, 3.0])
def test_torch_paths_follow_the_contract(src, wire, scale, lean):
    ts = _tensors(src)
    total = sum(t.numel() for t in ts)
    flat = torch.full((total + 2,), 9, dtype=wire)
    TorchCopy("pack", scale, lean=lean)(ts, flat)
    assert_same_bits(flat[:total], reference(torch.cat([t.reshape(-1) for t in ts]), wire, scale))
    assert torch.all(flat[total:] == 9), "pack wrote past the packed elements"
    before = flat.clone()
    outs = [torch.full_like(t, 7) for t in ts]
    copy = TorchCopy("unpack", scale, lean=lean)
    for _ in range(2):  # the second call reuses the views built by the first
        copy(outs, flat)
    assert torch.equal(flat.view(torch.uint8), before.view(torch.uint8)), "unpack changed the fusion buffer"
    offset = 0
    for t, out in zip(ts, outs):
        assert_same_bits(out.reshape(-1), reference(flat[offset:offset + t.numel()], src, scale))
        offset += t.numel()


def test_a_kernel_failure_warns_once_falls_back_once_and_is_counted(caplog, monkeypatch):
    """Kernels forced on CPU tensors with no GPU and no simulator cannot run: the first copy settles
    on torch ops for the process; later copies do not try the kernels again."""
    from gpucomm.kernels import bound

    tries = []
    real_call = bound.BoundCopy.__call__
    monkeypatch.setattr(bound.BoundCopy, "__call__", lambda self, *a: (tries.append(1), real_call(self, *a))[1])
    before = COUNTERS.kernel_fallbacks
    ts = _tensors(torch.float32)
    total = sum(t.numel() for t in ts)
    copy = BucketCopy(pack_scale=0.5, unpack_scale=4.0, kernels=True)
    with caplog.at_level(logging.WARNING, logger="gpucomm.kernels"):
        for _ in range(10):
            flat = torch.empty(total, dtype=torch.bfloat16)
            copy.pack(ts, flat)
            outs = [torch.empty_like(t) for t in ts]
            copy.unpack(flat, outs)
    assert len(tries) == 1, "the kernels were tried again after the process gave them up"
    assert COUNTERS.kernel_fallbacks - before == 1
    warnings = [r for r in caplog.records if "fusion kernels cannot run" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "need a GPU" in warnings[0].getMessage() and "GPUCOMM_FUSION_KERNELS=0" in warnings[0].getMessage()
    status = availability.status()
    assert status["decided"] and not status["usable"] and "KernelUnavailableError" in status["reason"]
    assert_same_bits(flat, reference(torch.cat([t.reshape(-1) for t in ts]), torch.bfloat16, 0.5))
    offset = 0
    for t, out in zip(ts, outs):
        assert_same_bits(out.reshape(-1), reference(flat[offset:offset + t.numel()], torch.float32, 4.0))
        offset += t.numel()


def test_argument_errors_are_raised_not_taken_for_unavailable_kernels():
    copy = BucketCopy(kernels=True)
    with pytest.raises(ValueError, match="not contiguous"):
        copy.pack([torch.ones(4, 4).t()], torch.empty(16))
    assert availability.status()["usable"], "an argument error must not turn the kernels off"
    with pytest.raises(ValueError, match="dst holds 2 elements but the srcs need 3"):
        TorchCopy("pack", lean=True)([torch.ones(3)], torch.empty(2))


@pytest.mark.parametrize("direction", ["pack", "unpack"])
def test_the_lean_torch_copy_follows_the_tensors_shapes_from_call_to_call(direction):
    """A bucket sends its gradients as they are (N-d) on one step and as flat views on another (a
    parameter without a gradient): the lean path's cached views of one buffer follow the shapes."""
    copy = TorchCopy(direction, 0.5, lean=True)
    flat = torch.randn(20)
    for shapes in (((3, 4), (8,)), ((12,), (8,)), ((1, 12), (2, 4)), ((3, 4), (8,))):
        tensors = [torch.randn(s) for s in shapes]
        copy(tensors, flat)
        packed = torch.cat([t.reshape(-1) for t in tensors])
        if direction == "pack":
            assert torch.equal(flat, packed * 0.5), shapes
        else:
            assert torch.equal(packed, flat * 0.5), shapes
