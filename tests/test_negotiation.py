"""The control plane's pure parts, without processes: what ranks must agree on (``disagreement``),
the coordinator's bookkeeping (ordering, completion, response cache, join, process sets, ranks
that leave, stalls), the stall inspector's configuration and report, and the coordinator-side
reduction of small CPU allreduces against an exact reference."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from gpucomm.control.controller import ControlConfig, stall_report
from gpucomm.control.coordinator import Coordinator, ProtocolError, set_bits
from gpucomm.control.negotiation import Descriptor, descriptor_of, disagreement, joined_disagreement
from gpucomm.dataplane.inline import inline_payload, reduce_inline, write_inline
from gpucomm.dataplane.requests import REDUCIBLE, ReduceOp, Request


def ar(shape=(3,), dtype="float32", op=ReduceOp.SUM, **kw) -> Descriptor:
    return Descriptor("allreduce", dtypes=(dtype,), shapes=(tuple(shape),), op=int(op), **kw)


def req(name: str, d: Descriptor, payload: bytes | None = None, set_id: int = 0) -> tuple:
    return ("req", set_id, name, d, payload)


# =============================================================================================
# disagreement: one message per kind of mismatch, naming the ranks grouped by value


def test_identical_descriptors_agree():
    assert disagreement("allreduce.x", {0: ar(), 1: ar(), 2: ar()}) is None


def test_shape_mismatch_groups_ranks_majority_first():
    msg = disagreement("allreduce.x", {0: ar((3,)), 1: ar((4, 2)), 2: ar((3,))})
    assert msg == ("Mismatched ALLREDUCE 'allreduce.x' tensor shapes: ranks 0, 2 sent [3]; rank 1 sent [4, 2]. "
                   "Every rank must send a tensor of the same shape.")


def test_equal_groups_are_listed_lowest_rank_first():
    msg = disagreement("n", {0: ar((5,)), 1: ar((2,)), 2: ar((5,)), 3: ar((2,))})
    assert "ranks 0, 2 sent [5]; ranks 1, 3 sent [2]" in msg


def test_dtype_mismatch():
    msg = disagreement("n", {0: ar(dtype="float32"), 1: ar(dtype="float64")})
    assert msg == ("Mismatched ALLREDUCE 'n' tensor types: rank 0 sent float32; rank 1 sent float64. "
                   "Every rank must send the same dtype.")


def test_op_mismatch_names_horovod_ops():
    msg = disagreement("n", {0: ar(op=ReduceOp.AVERAGE), 1: ar(op=ReduceOp.MAX), 2: ar(op=ReduceOp.AVERAGE)})
    assert msg == "Mismatched ALLREDUCE 'n' reduction ops: ranks 0, 2 sent hvd.Average; rank 1 sent hvd.Max."


def test_scale_factor_mismatch():
    msg = disagreement("n", {0: ar(prescale=1.0), 1: ar(prescale=2.0), 2: ar(postscale=0.5)})
    assert msg.startswith("Mismatched ALLREDUCE 'n' prescale and/or postscale factors: ")
    assert "rank 0 sent prescale=1, postscale=1" in msg
    assert "rank 1 sent prescale=2, postscale=1" in msg
    assert "rank 2 sent prescale=1, postscale=0.5" in msg


def test_reducescatter_checks_op_and_scales_too():
    rs = Descriptor("reducescatter", dtypes=("float32",), shapes=((4,),), op=int(ReduceOp.AVERAGE))
    assert "reduction ops: rank 0 sent hvd.Average; rank 1 sent hvd.Sum" in disagreement(
        "n", {0: rs, 1: rs._replace(op=int(ReduceOp.SUM))})
    assert "postscale=3" in disagreement("n", {0: rs, 1: rs._replace(postscale=3.0)})


def test_root_mismatch():
    b = Descriptor("broadcast", dtypes=("float32",), shapes=((2,),), root=0)
    msg = disagreement("broadcast.w", {0: b, 1: b._replace(root=2), 2: b})
    assert msg == ("Mismatched BROADCAST 'broadcast.w' root ranks: ranks 0, 2 sent 0; rank 1 sent 2. "
                   "Every rank must name the same root_rank.")


def test_root_is_ignored_for_allreduce():
    # only broadcast negotiates a root; the other kinds carry the default
    assert disagreement("n", {0: ar(root=0), 1: ar(root=1)}) is None


def test_splits_given_on_some_ranks_only():
    a = Descriptor("alltoall", dtypes=("float32",), shapes=((4,),))
    msg = disagreement("alltoall.s", {0: a._replace(splits=(1, 3)), 1: a})
    assert msg == ("Mismatched ALLTOALL 'alltoall.s' splits: rank 0 sent splits; rank 1 sent no splits. "
                   "Pass splits= on every rank or on none.")
    # different splits on every rank are fine: that is what splits are for
    assert disagreement("s", {0: a._replace(splits=(1, 3)), 1: a._replace(shapes=((6,),), splits=(2, 4))}) is None


def test_device_mismatch_comes_with_a_hint():
    msg = disagreement("n", {0: ar(device="cpu"), 1: ar(device="cuda")})
    assert msg.startswith("Mismatched ALLREDUCE 'n' device: rank 0 sent cpu; rank 1 sent cuda.")
    assert "same kind of device" in msg


def test_tensor_count_mismatch():
    two = Descriptor("allreduce", dtypes=("float32", "float32"), shapes=((3,), (3,)))
    msg = disagreement("grouped", {0: ar(), 1: two, 2: two})
    assert msg == "Mismatched ALLREDUCE 'grouped' number of tensors: ranks 1, 2 sent 2; rank 0 sent 1."


def test_grouped_mismatch_names_the_tensor():
    a = Descriptor("allreduce", dtypes=("float32", "int64"), shapes=((3,), (2,)))
    msg = disagreement("g", {0: a, 1: a._replace(shapes=((3,), (5,)))})
    assert "tensor shapes (tensor 1): rank 0 sent [2]; rank 1 sent [5]" in msg
    msg = disagreement("g", {0: a, 1: a._replace(dtypes=("float32", "int32"))})
    assert "tensor types (tensor 1): rank 0 sent int64; rank 1 sent int32" in msg


def test_allgather_allows_dim0_differences_only():
    g = Descriptor("allgather", dtypes=("float32",), shapes=((3, 2),))
    assert disagreement("g", {0: g, 1: g._replace(shapes=((0, 2),)), 2: g._replace(shapes=((7, 2),))}) is None
    msg = disagreement("g", {0: g, 1: g._replace(shapes=((3, 4),)), 2: g})
    assert msg == ("Mismatched ALLGATHER 'g' tensor shapes: ranks 0, 2 sent [3, 2]; rank 1 sent [3, 4]. "
                   "Ranks may differ in the first dimension only.")
    # a different number of dimensions is not a dim-0 difference
    assert "rank 1 sent [3]" in disagreement("g", {0: g, 1: g._replace(shapes=((3,),))})
    # allreduce allows no difference at all
    assert "tensor shapes" in disagreement("r", {0: ar((3, 2)), 1: ar((4, 2))})


def test_kind_mismatch_under_one_name():
    g = Descriptor("allgather", dtypes=("float32",), shapes=((3,),))
    assert disagreement("x", {0: ar(), 1: g}) == "Mismatched ALLREDUCE 'x' operation: rank 0 sent allreduce; rank 1 sent allgather."


def test_first_difference_reported_is_the_most_basic():
    # a rank that differs in both device and shape is told about the device first
    msg = disagreement("n", {0: ar((3,)), 1: ar((4,), device="cuda")})
    assert "device" in msg and "shapes" not in msg


def test_process_set_changes_must_name_the_same_ranks():
    add = Descriptor("add_process_set", ranks=(0, 1))
    assert disagreement("process_set.add.1", {0: add, 1: add, 2: add}) is None
    msg = disagreement("process_set.add.1", {0: add, 1: add._replace(ranks=(0, 2)), 2: add})
    assert "Mismatched add_process_set: ranks 0, 2 sent [0, 1]; rank 1 sent [0, 2]." in msg


def test_joined_disagreement_rules():
    for kind in ("allreduce", "reducescatter"):
        for op in (ReduceOp.SUM, ReduceOp.AVERAGE):
            assert joined_disagreement("n", kind, int(op), [2]) is None
        for op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
            msg = joined_disagreement("n", kind, int(op), [2])
            assert f"op=hvd.{op.name.title()} cannot run: rank 2 already called join()" in msg
    for kind in ("allgather", "broadcast", "alltoall"):
        msg = joined_disagreement("n", kind, 1, [0, 2])
        assert msg.startswith(f"{kind.upper()} 'n' cannot run: ranks 0, 2 already called join()")
    assert joined_disagreement("barrier", "barrier", 1, [1]) is None


# =============================================================================================
# Coordinator: completion and ordering


def test_completes_only_when_every_member_submitted():
    c = Coordinator(3)
    assert c.submit(0, [req("allreduce.a", ar())]) == []
    assert c.submit(2, [req("allreduce.a", ar())]) == []
    out = c.submit(1, [req("allreduce.a", ar())])
    assert out == [((0, 1, 2), ("run", 0, "allreduce.a", 0, {}, None))]
    assert c.pending_names() == []


def test_responses_leave_in_completion_order_once_each():
    c = Coordinator(2, cache_capacity=0)
    assert c.submit(0, [req(n, ar()) for n in ("a", "b", "c")]) == []
    out = c.submit(1, [req(n, ar()) for n in ("c", "a", "b")])
    assert [resp[2] for _, resp in out] == ["c", "a", "b"]
    assert all(dest == (0, 1) and resp[0] == "run" for dest, resp in out)
    assert c.responses == 3
    # an operation completed by a later submission comes after the ones already answered
    assert c.submit(0, [req("d", ar()), req("e", ar())]) == []
    assert [r[2] for _, r in c.submit(1, [req("e", ar())])] == ["e"]
    assert [r[2] for _, r in c.submit(1, [req("d", ar())])] == ["d"]


def test_same_name_twice_in_flight_is_a_protocol_error():
    c = Coordinator(2)
    c.submit(0, [req("a", ar())])
    with pytest.raises(ProtocolError, match="rank 0 submitted 'a' twice"):
        c.submit(0, [req("a", ar())])


def test_unknown_item_and_unknown_process_set_are_protocol_errors():
    c = Coordinator(2)
    with pytest.raises(ProtocolError, match="unknown cache id 7"):
        c.submit(0, [("hit", 7, None)])
    with pytest.raises(ProtocolError, match="process set 4, which does not exist"):
        c.submit(0, [req("a", ar(), set_id=4)])
    with pytest.raises(ProtocolError, match="unknown type 'bogus'"):
        c.submit(0, [("bogus",)])


def test_mismatch_becomes_an_error_response_to_every_member():
    c = Coordinator(2)
    c.submit(0, [req("a", ar((2,)))])
    [(dest, resp)] = c.submit(1, [req("a", ar((3,)))])
    assert dest == (0, 1) and resp[:3] == ("error", 0, "a")
    assert "rank 0 sent [2]; rank 1 sent [3]" in resp[3]
    # the failed name is free again
    c.submit(0, [req("a", ar((2,)))])
    assert c.submit(1, [req("a", ar((2,)))])[0][1][0] == "run"


# =============================================================================================
# Coordinator: response cache


def test_cache_hit_sends_no_meta_when_unchanged():
    c = Coordinator(2)
    c.submit(0, [req("allreduce.a", ar())])
    [(_, first)] = c.submit(1, [req("allreduce.a", ar())])
    assert first == ("run", 0, "allreduce.a", 0, {}, None)
    cache_id = first[3]
    assert c.submit(0, [("hit", cache_id, None)]) == []
    [(dest, second)] = c.submit(1, [("hit", cache_id, None)])
    assert dest == (0, 1) and second == ("bits", 1 << cache_id)  # an unchanged answer is one bit
    # a different name gets the next id
    c.submit(0, [req("allreduce.b", ar())])
    assert c.submit(1, [req("allreduce.b", ar())])[0][1][3] == 1


def test_cache_resends_meta_when_it_changes():
    g = Descriptor("allgather", dtypes=("float32",), shapes=((2, 3),))
    c = Coordinator(2)
    c.submit(0, [req("allgather.g", g)])
    [(_, first)] = c.submit(1, [req("allgather.g", g._replace(shapes=((5, 3),)))])
    assert first[4] == {"rows": [[2, 5]]}
    c.submit(0, [("hit", first[3], None)])
    assert c.submit(1, [("hit", first[3], None)])[0][1] == ("bits", 1 << first[3])
    # rank 0 now sends 4 rows (a fresh request); rank 1 still a hit: the new rows are sent
    c.submit(0, [req("allgather.g", g._replace(shapes=((4, 3),)))])
    [(_, third)] = c.submit(1, [("hit", first[3], None)])
    assert third[3] == first[3] and third[4] == {"rows": [[4, 5]]}


def test_hit_against_a_changed_request_is_still_validated():
    c = Coordinator(2)
    c.submit(0, [req("a", ar((3,)))])
    cache_id = c.submit(1, [req("a", ar((3,)))])[0][1][3]
    c.submit(0, [("hit", cache_id, None)])
    [(_, resp)] = c.submit(1, [req("a", ar((4,)))])  # rank 1 changed its shape; rank 0 did not
    assert resp[0] == "error" and "rank 0 sent [3]; rank 1 sent [4]" in resp[3]


def test_cached_requests_travel_and_answer_as_one_bit_each():
    c = Coordinator(2)
    ids = []
    for name in ("a", "b", "c"):
        c.submit(0, [req(name, ar())])
        ids.append(c.submit(1, [req(name, ar())])[0][1][3])
    bits = sum(1 << i for i in ids)
    assert c.submit(0, [("bits", bits)]) == []
    [(dest, answer)] = c.submit(1, [("bits", bits)])
    assert dest == (0, 1) and answer == ("bits", bits)  # one response for the whole cycle
    assert set_bits(answer[1]) == sorted(ids)


def test_bits_fold_only_runs_for_the_same_ranks():
    c = Coordinator(3, process_sets=[(0, 1)])
    for name, set_id in (("a", 0), ("b", 1)):
        for rank in (0, 1, 2)[: 3 if set_id == 0 else 2]:
            c.submit(rank, [("req", set_id, name, ar()._replace(set_id=set_id), None)])
    c.submit(2, [("bits", 1 << 0)])
    c.submit(0, [("bits", 0b11)])
    out = c.submit(1, [("bits", 0b11)])
    assert out == [((0, 1, 2), ("bits", 1 << 0)), ((0, 1), ("bits", 1 << 1))]


def test_cache_capacity_zero_never_caches():
    c = Coordinator(2, cache_capacity=0)
    for _ in range(2):
        c.submit(0, [req("allreduce.a", ar())])
        assert c.submit(1, [req("allreduce.a", ar())])[0][1] == ("run", 0, "allreduce.a", -1, {}, None)
    with pytest.raises(ProtocolError):
        c.submit(0, [("hit", 0, None)])


def test_cache_capacity_bounds_the_number_of_entries():
    c = Coordinator(2, cache_capacity=1)
    ids = []
    for name in ("a", "b", "a"):
        c.submit(0, [req(name, ar())])
        ids.append(c.submit(1, [req(name, ar())])[0][1][3])
    assert ids == [0, -1, 0]


def test_unnamed_operations_are_never_cached():
    c = Coordinator(2)
    for n in range(3):
        name = f"allreduce.noname.{n}"
        c.submit(0, [req(name, ar())])
        assert c.submit(1, [req(name, ar())])[0][1][3] == -1


def test_control_operations_are_never_cached():
    c = Coordinator(2)
    b = Descriptor("barrier")
    for _ in range(2):
        c.submit(0, [req("barrier", b)])
        assert c.submit(1, [req("barrier", b)]) == [((0, 1), ("done", 0, "barrier", None))]


# =============================================================================================
# Coordinator: join


def test_join_lets_sum_and_average_allreduce_run_with_zeros():
    c = Coordinator(3)
    assert c.submit(1, [req("join", Descriptor("join"))]) == []
    for op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        d = ar(op=op)
        name = f"allreduce.{op.name}"
        assert c.submit(0, [req(name, d)]) == []
        [(dest, resp)] = c.submit(2, [req(name, d)])
        assert dest == (0, 1, 2), "the joined rank takes part in the collective"
        assert resp[0] == "run" and resp[4]["joined"] == (1,) and resp[4]["template"] == d
    rs = Descriptor("reducescatter", dtypes=("float32",), shapes=((6,),), op=int(ReduceOp.AVERAGE))
    c.submit(0, [req("reducescatter.r", rs)])
    assert c.submit(2, [req("reducescatter.r", rs)])[0][1][0] == "run"


def test_join_completes_pending_operations_of_the_others():
    c = Coordinator(2)
    assert c.submit(0, [req("allreduce.a", ar())]) == []
    [(dest, resp)] = c.submit(1, [req("join", Descriptor("join"))])
    assert dest == (0, 1) and resp[:3] == ("run", 0, "allreduce.a") and resp[4]["joined"] == (1,)


@pytest.mark.parametrize("kind", ["allgather", "broadcast", "alltoall"])
def test_join_makes_data_movement_fail(kind):
    c = Coordinator(3)
    c.submit(2, [req("join", Descriptor("join"))])
    d = Descriptor(kind, dtypes=("float32",), shapes=((3,),))
    c.submit(0, [req(f"{kind}.x", d)])
    [(dest, resp)] = c.submit(1, [req(f"{kind}.x", d)])
    assert dest == (0, 1, 2) and resp[0] == "error"
    assert f"{kind.upper()} '{kind}.x' cannot run: rank 2 already called join()" in resp[3]


@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT])
def test_join_makes_min_max_product_fail(op):
    c = Coordinator(2)
    c.submit(0, [req("join", Descriptor("join"))])
    [(_, resp)] = c.submit(1, [req("allreduce.m", ar(op=op))])
    assert resp[0] == "error" and f"op=hvd.{op.name.title()}" in resp[3] and "rank 0 already called join()" in resp[3]


def test_barrier_and_process_set_operations_run_while_a_rank_has_joined():
    c = Coordinator(3, process_sets=[(0, 2)])
    c.submit(2, [req("join", Descriptor("join"))])
    c.submit(0, [req("barrier", Descriptor("barrier"))])
    assert c.submit(1, [req("barrier", Descriptor("barrier"))]) == [((0, 1, 2), ("done", 0, "barrier", None))]
    [(dest, resp)] = c.submit(0, [req("allreduce.s", ar(set_id=1), set_id=1)])
    assert dest == (0, 2) and resp[0] == "run" and resp[4]["joined"] == (2,)


def test_join_returns_last_rank_to_join_and_resets():
    c = Coordinator(3)
    join = Descriptor("join")
    assert c.submit(2, [req("join", join)]) == []
    assert c.submit(0, [req("join", join)]) == []
    assert c.joined == [2, 0]
    assert c.submit(1, [req("join", join)]) == [((0, 1, 2), ("done", 0, "join", 1))]
    assert c.joined == []
    # after the reset nobody stands in any more: an allreduce needs every rank again
    assert c.submit(0, [req("allreduce.after", ar())]) == []
    assert c.submit(1, [req("allreduce.after", ar())]) == []
    [(_, resp)] = c.submit(2, [req("allreduce.after", ar())])
    assert resp[0] == "run" and "joined" not in resp[4]
    # a second round of joins reports its own last rank
    c.submit(1, [req("join", join)])
    c.submit(2, [req("join", join)])
    assert c.submit(0, [req("join", join)]) == [((0, 1, 2), ("done", 0, "join", 0))]


def test_join_with_cache_hits_keeps_the_template():
    c = Coordinator(2)
    c.submit(0, [req("allreduce.a", ar())])
    cache_id = c.submit(1, [req("allreduce.a", ar())])[0][1][3]
    c.submit(1, [req("join", Descriptor("join"))])
    [(_, resp)] = c.submit(0, [("hit", cache_id, None)])
    assert resp[0] == "run" and resp[4]["joined"] == (1,), "meta changed (a rank joined), so it must be sent"


# =============================================================================================
# Coordinator: process sets


def test_operations_on_a_process_set_need_only_its_members():
    c = Coordinator(3, process_sets=[(0, 2)])
    assert c.sets == {0: (0, 1, 2), 1: (0, 2)}
    c.submit(0, [req("allreduce.s", ar(set_id=1), set_id=1)])
    assert c.submit(2, [req("allreduce.s", ar(set_id=1), set_id=1)]) == [
        ((0, 2), ("run", 1, "allreduce.s", 0, {}, None))]


def _all(c: Coordinator, name: str, d: Descriptor, size: int) -> list:
    out = []
    for r in range(size):
        out += c.submit(r, [req(name, d)])
    return out


def test_add_process_set():
    c = Coordinator(3)
    [(dest, resp)] = _all(c, "process_set.add.1", Descriptor("add_process_set", ranks=(0, 2)), 3)
    assert dest == (0, 1, 2) and resp == ("done", 0, "process_set.add.1", (1, (0, 2)))
    assert c.sets[1] == (0, 2)
    # the new set works
    c.submit(0, [req("a", ar(set_id=1), set_id=1)])
    assert c.submit(2, [req("a", ar(set_id=1), set_id=1)])[0][1][0] == "run"


@pytest.mark.parametrize("ranks, why", [
    ((0, 2), "already registered (id 1)"),
    ((2, 0), "already registered (id 1)"),
    ((0, 1, 2), "already registered (id 0)"),
    ((0, 3), "ranks [3] are not ranks of this job (0..2)"),
    ((-1,), "ranks [-1] are not ranks of this job"),
    ((), "needs at least one rank"),
    ((1, 1), "a rank is listed twice"),
])
def test_add_process_set_rejects_duplicates_and_invalid_ranks(ranks, why):
    c = Coordinator(3, process_sets=[(0, 2)])
    [(dest, resp)] = _all(c, "process_set.add.1", Descriptor("add_process_set", ranks=ranks), 3)
    assert dest == (0, 1, 2) and resp[0] == "error" and why in resp[3]
    assert c.sets == {0: (0, 1, 2), 1: (0, 2)}


def test_remove_process_set():
    c = Coordinator(3, process_sets=[(0, 2)])
    [(_, resp)] = _all(c, "process_set.remove.1", Descriptor("remove_process_set", root=1), 3)
    assert resp == ("done", 0, "process_set.remove.1", 1)
    assert 1 not in c.sets
    with pytest.raises(ProtocolError):
        c.submit(0, [req("a", ar(set_id=1), set_id=1)])
    # removing it again, or the global set, is an error on every rank
    [(dest, resp)] = _all(c, "process_set.remove.2", Descriptor("remove_process_set", root=1), 3)
    assert dest == (0, 1, 2) and resp[0] == "error" and "process set id 1: it is not registered" in resp[3]
    [(_, resp)] = _all(c, "process_set.remove.3", Descriptor("remove_process_set", root=0), 3)
    assert resp[0] == "error" and "the global process set cannot be removed" in resp[3]
    assert 0 in c.sets


def test_remove_busy_process_set_is_an_error():
    c = Coordinator(3, process_sets=[(0, 2)])
    c.submit(0, [req("allreduce.busy", ar(set_id=1), set_id=1)])
    [(_, resp)] = _all(c, "process_set.remove.1", Descriptor("remove_process_set", root=1), 3)
    assert resp[0] == "error" and "still has operations in flight (allreduce.busy)" in resp[3]
    assert 1 in c.sets
    c.submit(2, [req("allreduce.busy", ar(set_id=1), set_id=1)])
    [(_, resp)] = _all(c, "process_set.remove.2", Descriptor("remove_process_set", root=1), 3)
    assert resp[0] == "done"


def test_added_set_ids_are_never_reused():
    c = Coordinator(3)
    _all(c, "add.1", Descriptor("add_process_set", ranks=(0, 1)), 3)
    _all(c, "remove.1", Descriptor("remove_process_set", root=1), 3)
    [(_, resp)] = _all(c, "add.2", Descriptor("add_process_set", ranks=(0, 1)), 3)
    assert resp[3] == (2, (0, 1))


# =============================================================================================
# Coordinator: ranks that leave


def test_rank_left_fails_pending_and_later_operations():
    c = Coordinator(3, process_sets=[(0, 2)])
    c.submit(0, [req("allreduce.a", ar())])
    out = c.rank_left(1, "rank 1 exited or crashed")
    assert out == [((0, 1, 2), ("error", 0, "allreduce.a", "ALLREDUCE 'allreduce.a' cannot complete: rank 1 exited "
                                                              "or crashed"))]
    # a later operation that needs rank 1 fails as soon as it is submitted
    [(_, resp)] = c.submit(2, [req("allreduce.b", ar())])
    assert resp[0] == "error" and "rank 1 exited or crashed" in resp[3]
    # a set without rank 1 still works
    c.submit(0, [req("allreduce.s", ar(set_id=1), set_id=1)])
    assert c.submit(2, [req("allreduce.s", ar(set_id=1), set_id=1)])[0][1][0] == "run"


def test_rank_left_fails_a_pending_join():
    c = Coordinator(3)
    c.submit(0, [req("join", Descriptor("join"))])
    [(dest, resp)] = c.rank_left(2, "rank 2 has shut gpucomm down")
    assert dest == (0, 1, 2) and resp[0] == "error" and "join() cannot complete: rank 2 has shut gpucomm down" in resp[3]


def test_a_rank_that_joined_then_left_does_not_block_join():
    c = Coordinator(2)
    c.submit(1, [req("join", Descriptor("join"))])
    assert c.rank_left(1, "rank 1 has shut gpucomm down") == []
    assert c.submit(0, [req("join", Descriptor("join"))]) == [((0, 1), ("done", 0, "join", 0))]


def test_first_reason_a_rank_left_is_kept():
    c = Coordinator(2)
    c.rank_left(1, "first reason")
    c.rank_left(1, "second reason")
    [(_, resp)] = c.submit(0, [req("a", ar())])
    assert "first reason" in resp[3] and "second" not in resp[3]


# =============================================================================================
# Coordinator: stalls, with an injected clock


def test_stalled_reports_old_partial_operations_and_missing_ranks():
    now = [100.0]
    c = Coordinator(3, clock=lambda: now[0])
    c.submit(0, [req("allreduce.forgotten", ar())])
    now[0] = 102.0
    c.submit(2, [req("allreduce.forgotten", ar()), req("allreduce.young", ar())])
    now[0] = 104.0
    assert c.stalled(10.0) == []
    now[0] = 110.5
    assert c.stalled(10.0) == [(0, "allreduce.forgotten", 10.5, [1])]
    assert sorted(s[1] for s in c.stalled(8.0)) == ["allreduce.forgotten", "allreduce.young"]
    young = next(s for s in c.stalled(8.0) if s[1] == "allreduce.young")
    assert young[3] == [0, 1]
    # once complete, nothing is stalled
    c.submit(1, [req("allreduce.forgotten", ar())])
    assert [s[1] for s in c.stalled(0.0)] == ["allreduce.young"]


def test_stalled_counts_joined_ranks_as_present():
    now = [0.0]
    c = Coordinator(3, clock=lambda: now[0])
    c.submit(1, [req("join", Descriptor("join"))])
    c.submit(0, [req("allreduce.a", ar())])  # ranks 0 and 1 (joined) accounted for; waiting on 2
    now[0] = 5.0
    assert {s[1]: s[3] for s in c.stalled(1.0)}["allreduce.a"] == [2]


def test_waiting_in_join_while_the_others_make_progress_is_not_a_stall():
    """A rank that joined waits on purpose while the others finish their data (Horovod keeps JOIN
    out of the stall inspector); reporting it would kill uneven-data training under a stall
    shutdown time."""
    now = [0.0]
    c = Coordinator(2, clock=lambda: now[0])
    c.submit(0, [req("join", Descriptor("join"))])
    for t in range(1, 12):  # rank 1 keeps training for 11 s, rank 0 standing in with zeros
        now[0] = float(t)
        [(_, resp)] = c.submit(1, [req("allreduce.step", ar())])
        assert resp[0] == "run" and resp[4].get("joined") == (0,)
    assert c.stalled(3.0) == []


# =============================================================================================
# stall inspector configuration and report


def test_control_config_defaults():
    cfg = ControlConfig.from_env({}, 42.0)
    assert cfg.timeout == 42.0 and cfg.stall_warning == 60.0 and cfg.stall_shutdown is None
    assert cfg.cycle_time == pytest.approx(0.001) and cfg.cache_capacity == 1024 and cfg.inline_bytes == 16 << 10


def test_control_config_reads_horovod_names_and_prefers_gpucomm_ones():
    hvd_env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20",
               "HOROVOD_CYCLE_TIME": "3.5", "HOROVOD_CACHE_CAPACITY": "0"}
    cfg = ControlConfig.from_env(hvd_env, 1.0)
    assert (cfg.stall_warning, cfg.stall_shutdown, cfg.cache_capacity) == (5.0, 20.0, 0)
    assert cfg.cycle_time == pytest.approx(0.0035)
    both = dict(hvd_env, GPUCOMM_STALL_CHECK_TIME_SECONDS="7", GPUCOMM_CACHE_CAPACITY="9", GPUCOMM_INLINE_BYTES="0")
    cfg = ControlConfig.from_env(both, 1.0)
    assert (cfg.stall_warning, cfg.stall_shutdown, cfg.cache_capacity, cfg.inline_bytes) == (7.0, 20.0, 9, 0)


def test_waiting_callers_poll_only_while_every_local_rank_has_a_core(monkeypatch):
    from gpucomm.control import config as config_module

    monkeypatch.setattr(config_module, "_usable_cores", lambda: 4)
    assert ControlConfig.from_env({}, 1.0, local_size=4).spin == pytest.approx(config_module.DEFAULT_SPIN_US / 1e6)
    assert ControlConfig.from_env({}, 1.0, local_size=5).spin == 0.0  # oversubscribed: the core is the peer's
    assert ControlConfig.from_env({"GPUCOMM_SPIN_US": "0"}, 1.0, local_size=2).spin == 0.0
    assert ControlConfig.from_env({"GPUCOMM_SPIN_US": "40"}, 1.0, local_size=9).spin == pytest.approx(40e-6)
    assert ControlConfig.from_env({}, 1.0).spin == 0.0  # ranks per host unknown: no polling unless asked
    for bad in ("-1", "inf", "nan", "20000"):
        with pytest.raises(ValueError, match="GPUCOMM_SPIN_US"):
            ControlConfig.from_env({"GPUCOMM_SPIN_US": bad}, 1.0, local_size=1)


def test_readable_polls_then_blocks_and_reports_what_is_readable():
    import socket
    import threading

    from gpucomm.control import channel

    a, b = socket.socketpair()
    try:
        assert channel.readable([a], 0.01, spin=0.002) == []  # nothing came: polled, then slept out the rest
        assert channel.readable([a], 0.0, spin=0.002) == []  # no time to wait: no polling either
        b.sendall(b"x")
        assert channel.readable([a], 1.0, spin=0.002) == [a]  # already there: found by the first poll
        a.recv(1)
        late = threading.Timer(0.02, lambda: b.sendall(b"y"))  # arrives after the polling ended
        late.start()
        assert channel.readable([a], 5.0, spin=0.001) == [a]
        late.join()
        assert a.recv(1) == b"y"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("timeout", [None, 0.5, 30.0])  # 30: the control plane's sockets (their timeout is the body's)
def test_recv_exact_reads_a_frame_whole_or_in_pieces_without_losing_the_sockets_timeout(timeout):
    import socket
    import threading
    import time

    from gpucomm.bootstrap.framing import FrameError, recv_exact

    span = timeout or 5.0  # deadlines this far ahead let a socket with a timeout read without switching it
    a, b = socket.socketpair()
    try:
        a.settimeout(timeout)
        b.sendall(b"abcd")
        assert recv_exact(a, 4, time.monotonic() + span) == b"abcd"  # all there at once
        assert recv_exact(a, 0, time.monotonic() + span) == b""
        b.sendall(b"ab")
        later = threading.Timer(0.02, lambda: b.sendall(b"cdef"))
        later.start()
        assert recv_exact(a, 6, time.monotonic() + span) == b"abcdef"  # the rest arrives later
        later.join()
        assert a.gettimeout() == timeout
        with pytest.raises(FrameError, match="not complete in time"):
            recv_exact(a, 3, time.monotonic() + 0.05)  # nothing comes, before a deadline shorter than the timeout
        if timeout is not None and timeout < 1:
            with pytest.raises(FrameError, match="not complete in time"):
                recv_exact(a, 3, time.monotonic() + span)  # nothing comes, waiting in the socket's own timeout
        assert a.gettimeout() == timeout
        b.close()
        with pytest.raises(FrameError, match="connection closed after 0 of 2 bytes"):
            recv_exact(a, 2, time.monotonic() + span)
    finally:
        a.close()
        b.close()


def test_a_control_frame_that_has_arrived_is_read_without_switching_the_sockets_timeout():
    import socket

    from gpucomm.bootstrap.framing import FramedChannel
    from gpucomm.control import channel

    class Counting(socket.socket):
        switches = 0

        def settimeout(self, value):
            Counting.switches += 1
            super().settimeout(value)

    a, b = socket.socketpair()
    reader = Counting(fileno=a.detach())
    try:
        reader.settimeout(channel.BODY_TIMEOUT)  # as the control plane sets its sockets up
        Counting.switches = 0
        ours = FramedChannel(reader, b"k" * 32, b"n" * 16, b"S", 1 << 20)
        theirs = FramedChannel(b, b"k" * 32, b"n" * 16, b"C", 1 << 20)
        for i in range(3):
            channel.send(theirs, [("req", i, "x" * 100)])
            assert channel.recv(ours) == [("req", i, "x" * 100)]
        assert Counting.switches == 0 and reader.gettimeout() == channel.BODY_TIMEOUT
    finally:
        reader.close()
        b.close()


@pytest.mark.parametrize("shutdown", ["10", "5"])
def test_stall_shutdown_must_exceed_the_warning(shutdown):
    with pytest.raises(ValueError, match="must exceed the stall warning time"):
        ControlConfig.from_env({"GPUCOMM_STALL_CHECK_TIME_SECONDS": "10",
                                "GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS": shutdown}, 1.0)
    with pytest.raises(ValueError, match="must exceed"):  # against the default 60 s warning as well
        ControlConfig.from_env({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"}, 1.0)


@pytest.mark.parametrize("flag", ["GPUCOMM_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE"])
def test_stall_check_disable(flag):
    cfg = ControlConfig.from_env({flag: "1", "GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS": "90"}, 1.0)
    assert cfg.stall_warning is None and cfg.stall_shutdown is None
    assert ControlConfig.from_env({flag: "0"}, 1.0).stall_warning == 60.0


@pytest.mark.parametrize("env", [{"GPUCOMM_STALL_CHECK_TIME_SECONDS": "soon"}, {"GPUCOMM_STALL_CHECK_TIME_SECONDS": "0"},
                                 {"GPUCOMM_CACHE_CAPACITY": "-1"}, {"GPUCOMM_CYCLE_TIME": "-2"},
                                 {"GPUCOMM_CYCLE_TIME": "nan"}])
def test_bad_numbers_are_rejected(env):
    with pytest.raises(ValueError, match=next(iter(env))):
        ControlConfig.from_env(env, 1.0)


def test_stall_report_lists_missing_ranks_per_operation():
    text = stall_report([(0, "allreduce.a", 12.4, [1]), (2, "allgather.b", 30.0, [1, 3])], 10.0, None)
    assert "for more than 10 s" in text
    assert "Set GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS" in text
    lines = text.splitlines()
    # the oldest first, with its process set; then each missing rank with its operations
    assert lines[1] == "  allgather.b (process set 2): waiting 30 s for ranks [1, 3]"
    assert lines[2] == "  allreduce.a: waiting 12 s for ranks [1]"
    assert lines[3:] == ["Missing ranks:", "  1: [allgather.b, allreduce.a]", "  3: [allgather.b]"]
    assert "stops with an error after 20 s" in stall_report([(0, "x", 12.0, [1])], 10.0, 20.0)


# =============================================================================================
# reduce_inline: the coordinator's reduction of small CPU allreduces, against an exact reference

SIZES = (2, 3)


def _inputs(dtype: torch.dtype, n: int, shape=(2, 3)) -> list[torch.Tensor]:
    """Per-rank values that stay exact in every dtype, with negatives where the dtype has them."""
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(7 + 31 * r)
        if dtype == torch.uint8:
            t = torch.randint(0, 5, shape, generator=g)
        else:
            t = torch.randint(-4, 5, shape, generator=g)
        if dtype.is_floating_point:
            out.append((t.to(torch.float64) * 0.5).to(dtype))
        else:
            out.append(t.to(dtype))
    return out


def _exact(t: torch.Tensor) -> list[Fraction]:
    return [Fraction(float(v)) for v in t.reshape(-1).tolist()]


def _trunc(x: Fraction) -> int:
    return math.trunc(x)


def _reference(inputs: list[torch.Tensor], op: ReduceOp, pre: float, post: float) -> torch.Tensor:
    """Horovod's rule in exact arithmetic: post * reduce(pre * x) (Average: post/n), integers
    truncated toward zero after each scaling."""
    dtype = inputs[0].dtype
    integer = not dtype.is_floating_point
    n = len(inputs)
    scaled = []
    for t in inputs:
        vals = [Fraction(pre) * v for v in _exact(t)]
        scaled.append([Fraction(_trunc(v)) for v in vals] if integer and pre != 1.0 else vals)
    cols = list(zip(*scaled))
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        red = [sum(c) for c in cols]
    elif op == ReduceOp.MIN:
        red = [min(c) for c in cols]
    elif op == ReduceOp.MAX:
        red = [max(c) for c in cols]
    else:
        red = [math.prod(c) for c in cols]
    factor = Fraction(post) / (n if op == ReduceOp.AVERAGE else 1)
    if factor != 1:
        red = [v * factor for v in red]
        if integer:
            red = [Fraction(_trunc(v)) for v in red]
    values = [float(v) for v in red]
    return torch.tensor(values, dtype=torch.float64).reshape(inputs[0].shape)


def _inline_allreduce(inputs: list[torch.Tensor], op: ReduceOp, pre: float = 1.0, post: float = 1.0,
                      set_size: int | None = None) -> list[torch.Tensor]:
    """Run the inline path as the ranks and the coordinator do: each rank's payload, one
    reduction, each rank decodes the same bytes."""
    requests = [Request("allreduce", "allreduce.x", [t], op=op, prescale=pre, postscale=post) for t in inputs]
    payloads = [inline_payload(r, 1 << 20) for r in requests]
    assert all(p is not None for p in payloads)
    result = reduce_inline(descriptor_of(requests[0]), payloads, set_size or len(inputs))
    return [write_inline(r, result)[0] for r in requests]


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert got.dtype == dtype and got.shape == want.shape, what
    if dtype.is_floating_point:
        tol = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6}.get(dtype, 1e-12)
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol), f"{what}: {got} != {want}"
    else:
        assert torch.equal(got.to(torch.float64), want), f"{what}: {got} != {want}"


@pytest.mark.parametrize("dtype", REDUCIBLE, ids=str)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT],
                         ids=lambda o: o.name)
def test_reduce_inline_matches_reference(dtype, op):
    for n in SIZES:
        inputs = _inputs(dtype, n)
        want = _reference(inputs, op, 1.0, 1.0)
        for got in _inline_allreduce(inputs, op):
            _check(got, want, dtype, f"{op.name} {dtype} n={n}")


@pytest.mark.parametrize("dtype", REDUCIBLE, ids=str)
@pytest.mark.parametrize("pre, post", [(2.0, 1.0), (1.0, 0.5), (1.5, 0.25), (0.5, 3.0)])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MAX], ids=lambda o: o.name)
def test_reduce_inline_scale_factors(dtype, pre, post, op):
    for n in SIZES:
        inputs = _inputs(dtype, n)
        want = _reference(inputs, op, pre, post)
        got = _inline_allreduce(inputs, op, pre, post)[0]
        _check(got, want, dtype, f"{op.name} {dtype} pre={pre} post={post} n={n}")


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64])
def test_integer_average_truncates_toward_zero(dtype):
    # sums -7 and 7 over 2 ranks; -5 and 5 over 3 ranks: floor would give -4 and -2
    got = _inline_allreduce([torch.tensor([-3, 3], dtype=dtype), torch.tensor([-4, 4], dtype=dtype)], ReduceOp.AVERAGE)[0]
    assert got.tolist() == [-3, 3]
    got = _inline_allreduce([torch.tensor([-1, 1], dtype=dtype), torch.tensor([-2, 2], dtype=dtype),
                             torch.tensor([-2, 2], dtype=dtype)], ReduceOp.AVERAGE)[0]
    assert got.tolist() == [-1, 1]


def test_integer_average_over_many_ranks_is_exact():
    # 49 * (1/49) is just below 1 in float64: a naive multiply would truncate the average of ones to 0
    ones = [torch.ones(3, dtype=torch.int32) for _ in range(49)]
    assert _inline_allreduce(ones, ReduceOp.AVERAGE)[0].tolist() == [1, 1, 1]
    assert _inline_allreduce(ones, ReduceOp.SUM, post=1 / 49)[0].tolist() == [1, 1, 1]


def test_reduce_inline_grouped_mixed_dtypes():
    pairs = [[torch.tensor([1.5, -2.0]), torch.tensor([[3, -5]], dtype=torch.int64), torch.tensor([0.5], dtype=torch.bfloat16)],
             [torch.tensor([0.5, 4.0]), torch.tensor([[2, 2]], dtype=torch.int64), torch.tensor([1.0], dtype=torch.bfloat16)]]
    requests = [Request("allreduce", "g", ts, op=ReduceOp.AVERAGE) for ts in pairs]
    result = reduce_inline(descriptor_of(requests[0]), [inline_payload(r, 1 << 20) for r in requests], 2)
    outs = write_inline(requests[1], result)
    assert outs[0].tolist() == [1.0, 1.0]
    assert outs[1].tolist() == [[2, -1]]  # 5/2 -> 2, -3/2 -> -1
    assert outs[2].dtype == torch.bfloat16 and outs[2].tolist() == [0.75]


def test_reduce_inline_in_place_writes_the_callers_tensor():
    xs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])]
    requests = [Request("allreduce", "p", [x], outputs=[x], op=ReduceOp.SUM) for x in xs]
    result = reduce_inline(descriptor_of(requests[0]), [inline_payload(r, 1 << 20) for r in requests], 2)
    assert write_inline(requests[0], result)[0] is xs[0]
    assert xs[0].tolist() == [4.0, 7.0]


def test_inline_payload_only_for_small_cpu_allreduces():
    x = torch.ones(8)
    assert inline_payload(Request("allreduce", "a", [x]), 32) is not None
    assert inline_payload(Request("allreduce", "a", [x]), 31) is None  # 32 bytes over a 31-byte limit
    assert inline_payload(Request("allreduce", "a", [x]), 0) is None
    assert inline_payload(Request("allgather", "a", [x]), 1 << 20) is None


def test_coordinator_reduces_inline_only_when_every_member_sent_its_input():
    inputs = [torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0]), torch.tensor([100.0, 200.0])]
    requests = [Request("allreduce", "allreduce.x", [t], op=ReduceOp.AVERAGE) for t in inputs]
    d = descriptor_of(requests[0])
    c = Coordinator(3, reduce_inline=reduce_inline, cache_capacity=0)
    for r in range(2):
        c.submit(r, [req("allreduce.x", d, inline_payload(requests[r], 1024))])
    [(_, resp)] = c.submit(2, [req("allreduce.x", d, inline_payload(requests[2], 1024))])
    assert resp[0] == "run" and write_inline(requests[0], resp[5])[0].tolist() == [37.0, 74.0]
    # one rank without a payload (its inline limit is 0): the data plane runs it
    for r in range(2):
        c.submit(r, [req("allreduce.x", d, inline_payload(requests[r], 1024))])
    [(_, resp)] = c.submit(2, [req("allreduce.x", d, None)])
    assert resp[0] == "run" and resp[5] is None


def test_coordinator_inline_average_counts_joined_ranks_as_zeros():
    inputs = [torch.tensor([3.0, 6.0]), torch.tensor([6.0, 3.0])]
    requests = [Request("allreduce", "allreduce.x", [t], op=ReduceOp.AVERAGE) for t in inputs]
    d = descriptor_of(requests[0])
    c = Coordinator(3, reduce_inline=reduce_inline)
    c.submit(1, [req("join", Descriptor("join"))])
    c.submit(0, [req("allreduce.x", d, inline_payload(requests[0], 1024))])
    [(dest, resp)] = c.submit(2, [req("allreduce.x", d, inline_payload(requests[1], 1024))])
    assert dest == (0, 1, 2) and write_inline(requests[0], resp[5])[0].tolist() == [3.0, 3.0]  # (3+0+6)/3


def test_two_collective_types_under_one_name_fail_after_the_grace_and_crossed_orders_do_not():
    now = [0.0]
    c = Coordinator(3, clock=lambda: now[0])
    reduce_, gather = Descriptor("allreduce", 0, ("float32",), ((2,),)), Descriptor("allgather", 0, ("float32",), ((2,),))
    # crossed asynchronous orders: both types pending for a moment, then both complete
    assert c.submit(0, [req("allreduce.x", reduce_), req("allgather.x", gather)]) == []
    c.submit(1, [req("allgather.x", gather), req("allreduce.x", reduce_)])
    now[0] = 5.0  # rank 2 is late: ranks that used both types are no mismatch, however long it takes
    assert c.expire_clashes(1.0) == []
    done = c.submit(2, [req("allreduce.x", reduce_), req("allgather.x", gather)])
    assert [resp[0] for _, resp in done] == ["run", "run"]
    # a real mismatch: ranks 0 and 2 allreduce 'm', rank 1 allgathers it
    c.submit(0, [req("allreduce.m", reduce_)])
    c.submit(1, [req("allgather.m", gather)])
    now[0] = 7.0
    assert c.expire_clashes(1.0) == []  # rank 2 has not arrived: it may still settle the question
    c.submit(2, [req("allreduce.m", reduce_)])
    errors = c.expire_clashes(1.0)
    assert {ranks: resp[2] for ranks, resp in errors} == {(0, 2): "allreduce.m", (1,): "allgather.m"}
    assert "under the name 'm': ranks 0, 2 called allreduce; rank 1 called allgather" in errors[0][1][3]
    assert c.submit(0, [req("allreduce.m", reduce_)]) == []  # the name is usable again


def test_every_member_blocked_on_operations_that_lack_another_is_a_deadlock():
    now = [0.0]
    c = Coordinator(2, clock=lambda: now[0])
    d = Descriptor("allreduce", 0, ("float32",), ((2,),))
    c.submit(0, [req("allreduce.a", d)])
    c.submit(1, [req("allreduce.b", d)])
    c.note_blocked(0, (0, "allreduce.a"))
    assert c.deadlocks(0.5) == []  # rank 1 is not blocked: it may still submit 'a'
    c.note_blocked(1, (0, "allreduce.b"))
    assert c.deadlocks(0.5) == []  # both blocked, not yet for the grace
    now[0] = 0.6
    errors = c.deadlocks(0.5)
    assert sorted(ranks for ranks, _ in errors) == [(0,), (1,)]
    assert "rank 0 waits in 'allreduce.a' (submitted by rank 0); rank 1 waits in 'allreduce.b'" in errors[0][1][3]
