"""Scaling rules of ``gpucomm.dataplane.requests.scale_`` (pre/post scale factors and integer averages)."""

from __future__ import annotations

import torch

from gpucomm.dataplane.requests import scale_


def test_integer_average_divides_exactly():
    # 49 * (1/49) is 0.9999999999999999 in float64; an average of 49 equal ranks must still give 1
    for n in (3, 7, 49, 97):
        t = torch.tensor([n, -n, 2 * n, n + 1], dtype=torch.int32)
        scale_(t, 1.0 / n)
        assert t.tolist() == [1, -1, 2, 1]


def test_integer_scale_truncates_like_horovod():
    t = torch.tensor([10, 7, -7], dtype=torch.int64)
    scale_(t, 2.5)
    assert t.tolist() == [25, 17, -17]


def test_half_types_scale_through_float32_on_cpu():
    t = torch.tensor([1.5, -3.0], dtype=torch.bfloat16)
    scale_(t, 0.5)
    assert t.tolist() == [0.75, -1.5]
