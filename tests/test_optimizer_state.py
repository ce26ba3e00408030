"""``hvd.broadcast_optimizer_state`` leaves zero gradients, as Horovod's does (horovod/torch/functions.py:
on a rank whose optimizer has no state, it sets ``p.grad`` to zeros for every parameter that requires
grad, steps the wrapped optimizer and never clears them), so a script that reads ``p.grad`` right
after the broadcast works unchanged."""

from __future__ import annotations

from tests.harness import run_ranks
from tests.ranks import optimizer_state_scenarios as sc


def test_zero_gradients_left_where_there_was_no_state():
    root, other = run_ranks(sc.gradients_after_broadcast, 2)
    zeros = {"0.weight": 0.0, "0.bias": 0.0, "1.weight": 0.0, "1.bias": None}
    assert root["fresh"] == zeros
    assert other["fresh"] == {**zeros, "1.weight": 24.0}  # rank 1's own gradient is kept
    assert root["norm_works"] and other["norm_works"]
    assert root["root_had_state"] == [False] * 4  # root had state: nothing set there
    assert other["root_had_state"] == [True, True, True, False]  # rank 1 had none: zeros (not the frozen one)
