"""Large CPU results on warm memory (``gpucomm/dataplane/results.py``): a result's storage is handed
out again only once its caller holds no tensor or view of it, within the pool's limits."""

from __future__ import annotations

import torch

from gpucomm.dataplane.results import ResultBuffers

MIB = 1 << 20


def test_a_released_result_is_reused_and_a_held_one_never():
    pool = ResultBuffers(min_bytes=MIB)
    a = pool.empty((MIB // 4,), torch.float32)
    where = a.data_ptr()
    b = pool.empty((MIB // 4,), torch.float32)  # ``a`` is still held: new memory
    assert b.data_ptr() != where
    view = a[10:20]
    del a
    c = pool.empty((MIB // 4,), torch.float32)  # a view keeps ``a``'s storage in use
    assert c.data_ptr() not in (where, b.data_ptr())
    del view, c
    d = pool.empty((MIB // 8, 2), torch.float32)  # same bytes, another shape: the oldest free storage
    assert d.data_ptr() == where
    d.fill_(1.0)
    assert d.shape == (MIB // 8, 2) and d.sum().item() == MIB // 4


def test_small_results_and_the_limits():
    pool = ResultBuffers(min_bytes=MIB, max_kept=2, max_kept_bytes=4 * MIB)
    small = pool.empty((10,), torch.float64)
    assert small.shape == (10,) and pool.kept_bytes() == 0  # below min_bytes: plain torch.empty
    big = pool.empty((5 * MIB,), torch.uint8)  # over max_kept_bytes alone: not kept
    assert pool.kept_bytes() == 0 and big.numel() == 5 * MIB
    held = [pool.empty((MIB,), torch.uint8) for _ in range(3)]  # at most two kept
    assert pool.kept_bytes() == 2 * MIB
    del held
    again = pool.empty((MIB,), torch.uint8)
    assert pool.kept_bytes() == 2 * MIB and again.numel() == MIB
    pool.clear()
    assert pool.kept_bytes() == 0


def test_a_much_smaller_result_does_not_take_a_large_storage():
    pool = ResultBuffers(min_bytes=MIB)
    large = pool.empty((4 * MIB,), torch.uint8)
    where = large.data_ptr()
    del large
    assert pool.empty((MIB,), torch.uint8).data_ptr() != where  # more than twice its size: left for a larger one
    assert pool.empty((3 * MIB,), torch.uint8).data_ptr() == where
