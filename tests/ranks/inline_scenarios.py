"""Rank-side scenarios for ``tests/test_inline.py``: small CPU collectives answered by the coordinator."""

from __future__ import annotations

import torch

import gpucomm.torch as hvd


def small_moves() -> dict[str, int]:
    """Broadcasts (every root, in and out of place) and allgathers (uneven rows, 0-d, bool) of a
    few bytes, checked; returns this rank's counters and how many such collectives it ran."""
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    hvd.stats(reset=True)
    moves = 0
    for root in range(n):
        x = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * r
        assert torch.equal(hvd.broadcast(x, root, name=f"b{root}"), torch.arange(6.0).reshape(2, 3).double() + 10 * root)
        y = torch.full((3,), r, dtype=torch.bfloat16)
        assert hvd.broadcast_(y, root, name=f"bi{root}") is y and y.tolist() == [root] * 3
        moves += 2
    got = hvd.allgather(torch.full((r + 1, 2), r, dtype=torch.int32), name="rows")
    assert got.tolist() == [[q, q] for q in range(n) for _ in range(q + 1)], got
    assert hvd.allgather(torch.tensor(r % 2 == 0), name="flags").tolist() == [q % 2 == 0 for q in range(n)]
    assert hvd.allgather(torch.tensor(float(r)), name="scalar").tolist() == [float(q) for q in range(n)]
    moves += 3
    counts = hvd.stats()
    hvd.shutdown()
    return {"moves": moves, "inline_moves": counts["inline_moves"], "gloo_collectives": counts["gloo_collectives"]}
