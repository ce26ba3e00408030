"""Small CPU collectives riding the control round (``gpucomm/dataplane/inline.py``): what each rank
sends for a broadcast or an allgather, the coordinator's answer, and each rank's result, without
processes; then a real 2-rank job: small broadcasts and allgathers complete in the control round
(no Gloo call), and the same collectives still run on Gloo when ``GPUCOMM_INLINE_BYTES=0``."""

from __future__ import annotations

import torch

from gpucomm.control.coordinator import Coordinator
from gpucomm.control.negotiation import descriptor_of
from gpucomm.dataplane.inline import GATHER_LIMIT, combine_inline, inline_result, payload_of
from gpucomm.dataplane.requests import Request
from tests.harness import run_ranks
from tests.ranks import collective_checks as checks
from tests.ranks import inline_scenarios as sc


def _broadcast(rank: int, root: int) -> Request:
    return Request("broadcast", "broadcast.b", [torch.arange(6.0).reshape(2, 3) + 10 * rank], root=root,
                   outputs=[torch.empty(2, 3)])


def test_a_broadcast_root_sends_its_tensor_and_the_others_nothing():
    assert payload_of(_broadcast(1, 1), 1024, 1) == (torch.arange(6.0) + 10).numpy().tobytes()
    assert payload_of(_broadcast(0, 1), 1024, 0) == b""
    assert payload_of(_broadcast(0, 1), 16, 0) is None  # over the limit: the data plane runs it, on every rank
    assert payload_of(Request("broadcast", "b", [torch.ones(2)], device=torch.device("cuda", 0)), 1024, 0) is None


def test_the_coordinator_answers_a_broadcast_with_the_roots_bytes():
    requests = [_broadcast(r, 2) for r in range(3)]
    c = Coordinator(3, reduce_inline=combine_inline)
    for r in range(2):
        assert c.submit(r, [("req", 0, "broadcast.b", descriptor_of(requests[r]), payload_of(requests[r], 1024, r))]) == []
    [(ranks, response)] = c.submit(2, [("req", 0, "broadcast.b", descriptor_of(requests[2]),
                                        payload_of(requests[2], 1024, 2))])
    assert ranks == (0, 1, 2) and response[0] == "run"
    for r in range(3):
        got = inline_result(requests[r], response[5], {})[0]
        assert got is requests[r].outputs[0] and torch.equal(got, torch.arange(6.0).reshape(2, 3) + 20)


def test_an_allgather_answer_joins_the_ranks_rows_in_order():
    tensors = [torch.full((r, 2), r, dtype=torch.int16) for r in range(3)]  # rank 0 sends none
    requests = [Request("allgather", "allgather.g", [t]) for t in tensors]
    answer = combine_inline(descriptor_of(requests[0]), [payload_of(q, 1024, r) for r, q in enumerate(requests)], 3)
    outs, rows = inline_result(requests[1], answer, {"rows": [[0, 1, 2]]})
    assert rows == [[0, 1, 2]] and outs[0].dtype == torch.int16
    assert outs[0].tolist() == [[1, 1], [2, 2], [2, 2]]
    scalars = [Request("allgather", "allgather.s", [torch.tensor(r * 1.5)]) for r in range(2)]
    answer = combine_inline(descriptor_of(scalars[0]), [payload_of(q, 64, r) for r, q in enumerate(scalars)], 2)
    assert inline_result(scalars[0], answer, {"rows": [[1, 1]]})[0][0].tolist() == [0.0, 1.5]
    grouped = [Request("allgather", "allgather.two", [torch.full((r + 1,), float(r)), torch.full((1, 2), r)])
               for r in range(2)]
    answer = combine_inline(descriptor_of(grouped[0]), [payload_of(q, 64, r) for r, q in enumerate(grouped)], 2)
    outs, _ = inline_result(grouped[0], answer, {"rows": [[1, 2], [1, 1]]})
    assert outs[0].tolist() == [0.0, 1.0, 1.0] and outs[1].tolist() == [[0, 0], [1, 1]]
    big = descriptor_of(Request("allgather", "allgather.big", [torch.ones(1)]))
    assert combine_inline(big, [b"x" * (GATHER_LIMIT // 2 + 1)] * 2, 2) is None  # too large a result: data plane


def test_small_broadcasts_and_allgathers_complete_in_the_control_round():
    for seen in run_ranks(sc.small_moves, 2, timeout=90):
        assert seen["gloo_collectives"] == 0 and seen["inline_moves"] == seen["moves"] > 0, seen


def test_the_same_collectives_run_on_gloo_without_the_inline_path():
    run_ranks(checks.check_data_movement, 2, timeout=120, env={"GPUCOMM_INLINE_BYTES": "0"})
