"""The GPU data plane made right by construction (issue 25), shown where a CPU can show it: the
threads that may touch CUDA select the rank's GPU, a failed job aborts its communicators and a
healthy one destroys them only at collective points, every NCCL call of a device follows one order
(sparse reductions on the fixed schedule), channels_last gradients travel without a copy, done
events are pooled, a steady-state step touches no control object, and the stack-facing helpers
(CuPy's default stream, CuPy < 14's unique ids) behave. GPU-only checks are in test_gpu_data_plane.py."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.ranks import data_plane_scenarios as sc
from tests.cuda_standins import stand_in_cuda
from tests.harness import run_ranks


# -- 1. every thread that touches CUDA selects the rank's GPU ----------------------------------------

def test_gpucomm_threads_select_the_ranks_gpu_before_any_work():
    results = run_ranks(sc.threads_select_the_device, 2)
    for rank, seen in enumerate(results):
        threads = {name for name, _ in seen["selected"]}
        assert {ordinal for _, ordinal in seen["selected"]} == {3 + rank}, seen  # never another GPU
        assert "gpucomm-control" in threads, (rank, seen)
    assert "gpucomm-join-stand-in" in {name for name, _ in results[1]["selected"]}, results[1]  # rank 1 joined first
    assert [seen["last"] for seen in results] == [0, 0]


# -- 2. failure aborts, success destroys ---------------------------------------------------------------

def test_a_failed_job_aborts_its_nccl_communicators_at_once_and_never_destroys_them():
    for rank, seen in enumerate(run_ranks(sc.communicators_on_failure, 2, args=(True,))):
        assert "rank 1 fails on purpose" in seen["error"], (rank, seen)
        assert seen["before_shutdown"] == ["abort"], (rank, seen)  # the control plane's failure path
        assert seen["all"] == ["abort"], (rank, seen)  # shutdown never destroys it afterwards


def test_a_healthy_job_destroys_its_communicators_at_shutdown():
    for seen in run_ranks(sc.communicators_on_failure, 2, args=(False,)):
        assert seen["before_shutdown"] == [] and seen["all"] == ["destroy"], seen


def test_nccl_backend_lifecycle_first_ending_stands():
    aborted = sc.recording_backend(0, 2)
    aborted.abort()
    aborted.destroy()
    aborted.abort()
    assert aborted.comm.calls == ["abort"] and aborted.state == "aborted"
    destroyed = sc.recording_backend(0, 2)
    destroyed.destroy()
    destroyed.abort()  # the watchdog's late abort after a destroy: nothing
    assert destroyed.comm.calls == ["destroy"] and destroyed.state == "destroyed"
    racing = sc.recording_backend(0, 2)
    threads = [threading.Thread(target=racing.abort) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert racing.comm.calls == ["abort"]


def test_data_plane_aborts_on_failure_and_destroys_on_success():
    from gpucomm.dataplane.groups import Group
    from gpucomm.dataplane.plane import DataPlane
    from gpucomm.errors import CollectiveError

    def plane_with(n: int):
        plane = DataPlane(0, 5.0)
        backends = [sc.recording_backend(0, 2) for _ in range(n)]
        for i, backend in enumerate(backends):
            plane.register(Group(i, range(2), 0, lambda g: None, lambda g, b=backend: b)).nccl()
        return plane, backends

    plane, backends = plane_with(3)
    plane.fail(CollectiveError("rank 1 died"))
    assert [b.comm.calls for b in backends] == [["abort"]] * 3  # at once, before any shutdown
    plane.close(failed=True)
    assert [b.comm.calls for b in backends] == [["abort"]] * 3  # never destroyed afterwards
    plane, backends = plane_with(2)
    plane.close(failed=False)
    assert [b.comm.calls for b in backends] == [["destroy"]] * 2


def test_a_failure_aborts_while_an_issue_is_blocked_inside_nccl():
    """Before: ``DataPlane.fail`` failed the issue orders first, which takes each order's lock; a thread
    issuing a negotiated collective holds that lock while NCCL's host call waits for a peer (lazy
    connection), and only the abort that came after would free it: both hung. Now the orders stop
    without their locks, the abort frees the call, then the queued handles fail."""
    import torch

    from gpucomm.dataplane.plane import DataPlane
    from gpucomm.errors import CollectiveError

    plane = DataPlane(0, 5.0, order_cpu=True)
    aborted, blocked = threading.Event(), threading.Event()

    class BlockedInNccl:  # a group whose communicator's host call returns only once it is aborted
        id = 0

        def nccl_if_created(self):
            return self

        def abort_nccl(self):
            aborted.set()

        def close(self, abort=False):
            pass

    plane.register(BlockedInNccl())
    order = plane.order(torch.device("cpu"))
    issued_after = []

    def blocking_issue():
        blocked.set()
        aborted.wait(300)  # (a guard for this test only: NCCL itself would wait for good)

    issuing = threading.Thread(target=order.agreed, args=(None, blocking_issue), daemon=True)
    issuing.start()
    assert blocked.wait(30)
    failing = threading.Thread(target=plane.fail, args=(CollectiveError("rank 1 died"),), daemon=True)
    failing.start()
    try:
        failing.join(30)  # a hang guard: with the abort reached, fail() returns at once
        assert aborted.is_set() and not failing.is_alive(), "fail() and the issuing thread are deadlocked"
    finally:
        aborted.set()  # whatever happened: let the blocked call go
    issuing.join(30)
    assert not issuing.is_alive()
    order.agreed(None, lambda: issued_after.append(1))  # agreed after the failure: never issued
    assert issued_after == []


def test_a_launch_that_fails_because_another_thread_aborted_names_the_abort():
    """Before: a schedule launch checked the job's failure only before calling NCCL; an abort by the
    watchdog or the control plane during the call made NCCL fail with "invalid argument", and that, with
    the network hint, is what the backward hook raised instead of the failure that caused the abort."""
    import torch

    from gpucomm.dataplane.plane import DataPlane
    from gpucomm.dataplane.requests import Request
    from gpucomm.dataplane.schedule import Schedule
    from gpucomm.errors import CollectiveError
    from gpucomm.reduce_op import ReduceOp

    class Group:
        id = 0

        def nccl_if_created(self):
            return None

        def close(self, abort=False):
            pass

    plane = DataPlane(0, 5.0)
    schedule = Schedule(Group(), plane)

    def aborted_meanwhile(request, meta):
        plane.fail(CollectiveError("rank 1 died: its process exited with code 9"))
        raise RuntimeError("NCCL error: invalid argument (run with NCCL_DEBUG=WARN for details)")

    schedule._executor = aborted_meanwhile
    t = torch.ones(4)
    request = Request("allreduce", "bucket.0", [t], outputs=[t], op=ReduceOp.SUM, device=t.device, set_id=0)
    with pytest.raises(CollectiveError, match="rank 1 died"):
        schedule.launch(request)
    schedule._executor = lambda request, meta: (_ for _ in ()).throw(ValueError("a local mistake"))
    plane2 = DataPlane(0, 5.0)
    healthy = Schedule(Group(), plane2)
    healthy._executor = schedule._executor
    with pytest.raises(ValueError, match="a local mistake"):  # no failure: the error is the launch's own
        healthy.launch(Request("allreduce", "bucket.1", [t], outputs=[t], op=ReduceOp.SUM, device=t.device,
                               set_id=0))


def test_garbage_collection_never_releases_an_optimizers_communicator():
    for seen in run_ranks(sc.optimizer_schedules_outlive_garbage_collection, 2):
        assert seen["after_gc"] == seen["before"], seen  # the collected optimizer's schedule stays
        assert seen["after_close"] == seen["before"] and seen["closed"], seen  # close() releases it
        assert "was closed" in seen["closed_error"], seen


# -- 3. one order per device: sparse reductions on the fixed schedule ---------------------------------

@pytest.mark.parametrize("size", [2, 3])
def test_sparse_gradient_steps_send_no_control_message(size):
    for rank, seen in enumerate(run_ranks(sc.sparse_steps_negotiate_nothing, size)):
        assert seen["sparse"] == ["emb.weight"], seen
        steady = seen["deltas"][2:]  # step 0: the ranks agree what is sparse; step 1: the new layout
        assert all(d["negotiated"] == 0 and d["control_rounds"] == 0 for d in steady), (rank, seen["deltas"])
        assert all(d["collectives"] > 0 for d in steady), (rank, seen["deltas"])
        assert seen["same"], rank


@pytest.mark.parametrize("size", [2, 3])
def test_one_issue_order_on_every_rank(size):
    """Negotiated and scheduled collectives, issued through the same rule the GPU path follows
    (GPUCOMM_ISSUE_ORDER=all applies it to CPU tensors): the same sequence on every rank."""
    results = run_ranks(sc.issue_sequence, size, args=(size - 1,), env={"GPUCOMM_ISSUE_ORDER": "all"})
    reference = results[0]["issued"]
    assert any(name.startswith("DistributedOptimizer.bucket") for name in reference), reference
    assert any(name.startswith("allreduce.early") for name in reference), reference
    for rank, seen in enumerate(results):
        assert seen["issued"] == reference, (rank, seen["issued"], reference)
        assert seen["same"], rank
    early, bucket = reference.index("allreduce.early.1"), reference.index("DistributedOptimizer.bucket.0", 
                                                                         reference.index("allreduce.metric.0"))
    assert early < bucket  # submitted before the step: issued before the step's buckets


# -- 5. channels_last gradients: no copy -------------------------------------------------------------

def test_channels_last_gradients_are_packed_and_unpacked_in_place():
    contiguous = run_ranks(sc.copies_per_step, 2, args=(False,))
    channels_last = run_ranks(sc.copies_per_step, 2, args=(True,))
    for a, b in zip(contiguous, channels_last):
        assert b["layout_kept"], b
        assert b["copying"] == a["copying"], (a["copying"], b["copying"])  # not one copy more


# -- a steady-state step touches no control object ---------------------------------------------------

def test_a_pack_reads_contiguous_gradients_as_they_are_and_views_the_others():
    """``gradients_as_they_are``: the gradients themselves (no view made per gradient) only when every
    parameter trains and has a dense contiguous gradient; else None, and each is viewed on its own."""
    import torch

    from gpucomm.dataplane.grad_layout import gradients_as_they_are

    ps = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    assert gradients_as_they_are(ps) is None  # no gradients yet
    for p in ps:
        p.grad = torch.randn_like(p)
    got = gradients_as_they_are(ps)
    assert got is not None and all(g is p.grad for g, p in zip(got, ps))
    ps[0].grad = torch.randn(4, 3).t()  # the right shape, not contiguous
    assert gradients_as_they_are(ps) is None
    ps[0].grad = torch.randn(3, 4)
    ps[1].requires_grad_(False)  # frozen since the layout was agreed: sent as zeros, by send_view
    assert gradients_as_they_are(ps) is None
    ps[1].requires_grad_(True)
    ps[1].grad = torch.randn(5).to_sparse()
    assert gradients_as_they_are(ps) is None


def test_a_steady_state_step_calls_nothing_of_the_control_plane():
    for seen in run_ranks(sc.control_calls_in_steady_steps, 2):
        assert seen["control"] == [], seen["control"]
        assert any(name.startswith("schedule.py:") for name in seen["dataplane"]), seen["dataplane"]


# -- 4. Communicator on CuPy's default stream ----------------------------------------------------------

def test_stream_handles_of_every_kind():
    cupy = pytest.importorskip("cupy")
    from gpucomm.communicator import stream_handle

    assert stream_handle(cupy.cuda.Stream.null) == 0  # CuPy's default stream: ptr 0, no cuda_stream
    assert stream_handle(0) == 0 and stream_handle(0x7F00) == 0x7F00

    class TorchLike:  # what torch.cuda.Stream exposes (no GPU here to make a real one)
        cuda_stream = 0x1234

    assert stream_handle(TorchLike()) == 0x1234
    with pytest.raises(TypeError, match="stream"):
        stream_handle("stream 3")


# -- 8. CuPy < 14's unique ids -------------------------------------------------------------------------

def test_unique_ids_of_cupy_13_and_14():
    from gpucomm.backends.nccl import unique_id_bytes, unique_id_for_cupy

    raw = bytes(range(256))[::2]  # 128 bytes, half of them >= 128
    cupy13 = tuple(b - 256 if b > 127 else b for b in raw)  # CuPy 13: a tuple of signed chars
    assert unique_id_bytes(cupy13) == raw
    assert unique_id_bytes(raw) == raw
    assert unique_id_for_cupy(raw, 13) == cupy13
    assert unique_id_for_cupy(raw, 14) == raw


def test_this_cupys_unique_id_round_trips():
    from gpucomm.backends.nccl import cupy_major, nccl_module, unique_id_bytes, unique_id_for_cupy

    nccl = nccl_module()
    if nccl is None:
        pytest.skip("CuPy's NCCL bindings are not installed")
    uid = nccl.get_unique_id()
    raw = unique_id_bytes(uid)
    assert len(raw) == 128
    assert unique_id_for_cupy(raw, cupy_major()) == (bytes(uid) if isinstance(uid, bytes) else tuple(uid))


# -- 6. done events: pooled, retired by the watchdog once finished and waited for --------------------

class _Request:
    set_id = 0

    def describe(self) -> str:
        return "allreduce 'x'"


cuda = stand_in_cuda  # the fixture, under the name these tests use


def test_done_events_return_to_the_pool_once_finished_and_waited_for(cuda):
    from gpucomm.dataplane.events import EventPool
    from gpucomm.dataplane.watchdog import NcclWatchdog

    pool = EventPool()
    watchdog = NcclWatchdog(0, 60.0, pool, health=lambda set_id: None, fail=lambda text: None)
    try:
        cuda.hold = True
        first, second = pool.record(5, 0), pool.record(5, 0)
        release_first = watchdog.watch(first, 0, _Request(), 5)
        release_second = watchdog.watch(second, 0, _Request(), 5)
        release_first()  # waited for, not finished: still the GPU's
        watchdog.check()
        assert len(pool) == 0
        cuda.finish_all()
        watchdog.check()  # finished: the first goes back, the second is not waited for yet
        assert pool._free == {0: [first]}
        release_second()
        assert pool._free == {0: [first, second]} and watchdog.retired == 2
    finally:
        watchdog.close()


def test_a_new_event_is_made_only_while_every_earlier_one_is_still_in_flight(cuda):
    """Seen on an H100 (2026-11-27): steady steps made new CUDA events because the previous step's
    done event, finished and waited for, went back to the pool only at the watchdog's next tick or
    after the new event was taken. The pool now asks the watchdog to retire what finished first."""
    from gpucomm.counters import COUNTERS
    from gpucomm.dataplane.events import EventPool
    from gpucomm.dataplane.watchdog import NcclWatchdog

    pool = EventPool()
    watchdog = NcclWatchdog(0, 60.0, pool, health=lambda set_id: None, fail=lambda text: None)
    try:
        cuda.hold = True
        earlier = pool.record(5, 0)
        watchdog.watch(earlier, 0, _Request(), 5)()  # issued and waited for
        cuda.finish_all()  # the GPU finished it; no tick of the watchdog since
        made = COUNTERS.cuda_events_created
        assert pool.record(5, 0) == earlier  # reused, not made
        assert COUNTERS.cuda_events_created == made and watchdog.retired == 1
    finally:
        watchdog.close()


def test_the_watchdog_reports_an_overdue_collective(cuda):
    from gpucomm.dataplane.events import EventPool
    from gpucomm.dataplane.watchdog import NcclWatchdog

    failures: list[str] = []
    pool = EventPool()
    watchdog = NcclWatchdog(1, 0.0, pool, health=lambda set_id: None, fail=failures.append)
    try:
        cuda.hold = True
        watchdog.watch(pool.record(5, 0), 0, _Request(), 5)
        watchdog.check()
    finally:
        watchdog.close()
    assert len(failures) == 1 and "allreduce 'x' did not finish within 0 s" in failures[0], failures


def test_every_executor_records_done_events_from_the_pool():
    """The schedule's executor used to make a new CUDA event per bucket per step: every executor
    now takes the data plane's pool and watchdog (no other way to build one)."""
    import inspect

    from gpucomm.dataplane.executor import Executor

    params = inspect.signature(Executor).parameters
    assert "pool_done_events" not in params
    assert params["events"].default is inspect.Parameter.empty and params["watch"].default is inspect.Parameter.empty


# -- review findings, each a regression test ------------------------------------------------------

def test_a_joined_rank_stands_in_for_steps_and_negotiated_work_alike():
    """The stand-in step used to wait on bucket 0 inside its step, while the zeros for the other
    rank's negotiated allreduce waited for that step to end: both ranks hung (with the ordering on)."""
    for seen in run_ranks(sc.join_while_others_train_with_negotiated_work, 2, env={"GPUCOMM_ISSUE_ORDER": "all"},
                          timeout=90):
        assert seen["last"] == 0, seen
    results = run_ranks(sc.join_while_others_train_with_negotiated_work, 2, env={"GPUCOMM_ISSUE_ORDER": "all"})
    assert results[0]["metrics"] == [1.0, 1.0, 1.0]  # rank 1's zeros


def test_negotiated_collectives_are_not_kept_alive_without_optimizer_steps():
    for seen in run_ranks(sc.negotiated_handles_are_not_kept, 2, env={"GPUCOMM_ISSUE_ORDER": "all"}):
        assert seen["kept"] == 0 and seen["alive"] == 0, seen


def test_a_rank_without_sparse_gradients_still_launches_inside_a_step():
    results = run_ranks(sc.sparse_without_gradients_on_one_rank, 2, env={"GPUCOMM_ISSUE_ORDER": "all"})
    for rank, seen in enumerate(results):
        assert seen["in_step"] and all(seen["in_step"]), (rank, seen["in_step"])
        assert seen["same"], rank


def test_releasing_while_the_watchdog_fails_aborts(cuda):
    """The watchdog clears what it watched when it finds a hung collective, before the job's failure is
    recorded: a release in that window (an optimizer's close on another thread) drained "nothing in
    flight" and destroyed a communicator whose kernel hangs. Here the release runs exactly there."""
    from gpucomm.dataplane.groups import Group
    from gpucomm.dataplane.plane import DataPlane

    released = {}

    def report(text: str) -> None:  # the control plane hears of it: the failure is not recorded yet
        plane.release(group)
        released["calls"] = list(backend.comm.calls)

    plane = DataPlane(0, 0.0, report=report)
    backend = sc.recording_backend(0, 2)
    group = plane.register(Group(5, range(2), 0, lambda g: None, lambda g: backend))
    group.nccl()
    cuda.hold = True
    plane.watchdog.watch(plane.events.record(5, 0), 0, _Request(), 5)
    plane.watchdog.check()
    assert released["calls"] == ["abort"], released


def test_a_released_group_takes_no_more_collectives():
    from gpucomm.dataplane.groups import Group
    from gpucomm.errors import CollectiveError

    group = Group(3, range(2), 0, lambda g: None, lambda g: sc.recording_backend(0, 2))
    group.nccl()
    group.close()
    with pytest.raises(CollectiveError, match="released"):
        group.nccl()


def test_stop_survives_rank_0s_link_closing_underneath_it():
    assert run_ranks(sc.stop_while_rank_0s_link_closes, 2) == ["rank 0", "ok"]


@pytest.mark.parametrize("widen", [False, True])
def test_bfloat16_reductions_on_gloo_with_and_without_its_kernels(widen):
    """torch 2.1's Gloo cannot reduce bfloat16 ("Invalid scalar type"); there gpucomm reduces a float32
    copy and lands the result in the bfloat16 tensor. Both paths give the same values, through Gloo."""
    for r in run_ranks(sc.bf16_reductions, 2, args=(widen,), timeout=120):
        assert r["sum"] == [4.0] and r["sum_dtype"] == "torch.bfloat16", r
        assert r["scattered"] == [1.5] and r["scattered_shape"] == [2, 1 << 13], r
        assert r["averaged"] == [2.0] and r["gloo"] >= 3, r


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_device_search_for_a_non_finite_gradient_runs_on_every_torch_claimed(dtype):
    """The finite check's GPU search (``finite.first_bad_on_device``), run here on CPU tensors: it names
    the first bad piece on every torch the package claims (``_foreach_norm`` takes ``dtype`` only from
    torch 2.4; torch 2.1 raised TypeError on every GPU step), and float16 values whose sum passes 65504
    are not reported."""
    from gpucomm.dataplane.finite import first_bad_on_device

    big = 60000.0 if dtype == torch.float16 else 1e30
    pieces = [torch.full((4,), big, dtype=dtype), torch.ones(3, dtype=dtype), torch.ones(2, dtype=dtype)]
    index = torch.tensor([0, 2, 3])  # piece 1 of 4 was empty
    out = torch.zeros(1, dtype=dtype)
    first_bad_on_device(pieces, index, 4, out, 100)
    assert float(out) == 0.0  # all finite (the float16 norm is taken in float32)
    pieces[2][1] = float("nan")
    pieces[1][0] = float("inf")
    first_bad_on_device(pieces, index, 4, out, 100)
    assert float(out) == 3.0  # 1 + position 2: the first bad piece
    first_bad_on_device(pieces, index, 4, out, 2)
    assert float(out) == 2.0  # capped at the limit


def test_a_dropped_optimizers_step_opener_stops_being_run_and_counted():
    """A by-order optimizer registers a step opener (held weakly); one dropped without close() leaves a
    dead entry, which the next negotiated submission's ``open_steps`` drops, so submissions go back
    to reading one 0."""
    import gc

    from gpucomm.dataplane.plane import DataPlane

    plane = DataPlane(0, 5.0)
    calls = []

    class Optimizer:
        def open_before_negotiated(self):
            calls.append(self)

    kept, dropped = Optimizer(), Optimizer()
    schedule_a, schedule_b = object(), object()
    plane.set_step_opener(schedule_a, kept.open_before_negotiated)
    plane.set_step_opener(schedule_b, dropped.open_before_negotiated)
    assert plane.step_openers == 2
    plane.open_steps()
    assert calls == [kept, dropped]
    calls.clear()
    del dropped
    gc.collect()
    plane.open_steps()
    assert calls == [kept] and plane.step_openers == 1
    plane.set_step_opener(schedule_a, None)
    assert plane.step_openers == 0
    plane.close(failed=False)
