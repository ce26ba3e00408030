"""Rank-side bodies of the CUDA-path tests on a machine without a GPU: the data plane's CUDA calls are
counting stand-ins (``tests.cuda_standins``) that let CPU tensors take the CUDA path, and NCCL is a
stand-in over the job's Gloo transport, so a real job runs every line of the CUDA path between the
front and the backend call, with real results, and the counters say what it cost."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

import torch
import torch.nn as nn

import gpucomm.torch as hvd
from gpucomm.backends.gloo import GlooDevice, gloo_group
from gpucomm.backends.local import SelfBackend
from gpucomm.dataplane import cuda_calls
from gpucomm.job import state as job_state
from tests.cuda_standins import NcclOverCpu, StandInCuda
from tests.ranks.hot_path_scenarios import cached_op_forms
from tests.ranks.optimizer_scenarios import batch, half, make_model, max_rel_diff

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
from overhead import python_calls  # noqa: E402  benchmarks/overhead.py: the count the benchmark prints


def _nccl_over_cpu(client, key: str, rank: int, size: int, device_ordinal: int, timeout: float) -> NcclOverCpu:
    """``create_nccl``'s stand-in: a communicator of ``size`` ranks over Gloo on the same store keys."""
    cpu = SelfBackend() if size == 1 else gloo_group(client, key + "/standin/", rank, size, timeout=timeout,
                                                     device=GlooDevice(hostname="127.0.0.1"))
    return NcclOverCpu(cpu, size)


@contextlib.contextmanager
def cuda_path() -> Iterator[StandInCuda]:
    """Inside: CPU tensors take the data plane's CUDA path with stand-in CUDA calls and NCCL (undone
    after, for the harness's pooled processes)."""
    stand_in = StandInCuda(cpu_is_gpu=True)
    previous = cuda_calls.install(stand_in)
    create, device, gpu = job_state.create_nccl, job_state.Job._cuda_device, job_state.Job._gpu_of_rank
    job_state.create_nccl = _nccl_over_cpu
    job_state.Job._cuda_device = lambda self: torch.device("cpu")
    job_state.Job._gpu_of_rank = lambda self: 0  # the stand-in numbers every device 0
    try:
        yield stand_in
    finally:
        job_state.create_nccl, job_state.Job._cuda_device, job_state.Job._gpu_of_rank = create, device, gpu
        cuda_calls.install(previous)


def job_state_of_current():
    """The initialized job (what the data plane's watchdog hangs off)."""
    from gpucomm import job as jobs

    return jobs.current()


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def _twins() -> tuple:
    """A model wrapped in a DistributedOptimizer and its copy with plain SGD (one process, full batch)."""
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    return model, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.05)


def _reference_step(ref: nn.Module, ref_opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, n: int) -> None:
    """The step the ranks' equal parts of the batch make together, in one process."""
    ref_opt.zero_grad()
    used = n * (x.shape[0] // n)
    nn.functional.mse_loss(ref(x[:used]), y[:used]).backward()
    ref_opt.step()


def one_rank_calls() -> dict:
    """Python calls per cached synchronous op of a one-rank job on the CUDA path (no NCCL at all)."""
    with cuda_path():
        hvd.init()
        x = torch.ones(1024)
        forms = cached_op_forms(x)
        forms["broadcast_"] = lambda: hvd.broadcast_(x, 0, name="c.bc_")
        calls = {}
        before = hvd.stats()
        for form, fn in forms.items():
            for _ in range(3):
                fn()
            calls[form] = python_calls(fn)
        delta = _delta(before, hvd.stats())
        hvd.shutdown()
    return {"calls": calls, "delta": delta}


def sync_op_on_callers_stream(ops: int = 20) -> dict:
    """A 2-rank job's synchronous allreduces on the CUDA path: each on the caller's own stream (no
    ready event, no stream wait, one done event for the watchdog); an async one keeps its handle
    and its comm-stream round trip. Python calls of the data plane's part (agreed -> result)."""
    with cuda_path() as stand_in:
        hvd.init()
        r = hvd.rank()
        x = torch.full((4096,), float(r + 1))
        for _ in range(3):
            hvd.allreduce(x, name="sync.ar", op=hvd.Sum)
        before = hvd.stats()
        for _ in range(ops):
            out = hvd.allreduce(x, name="sync.ar", op=hvd.Sum)
        sync = _delta(before, hvd.stats())
        before = hvd.stats()
        for _ in range(ops):
            out_async = hvd.synchronize(hvd.allreduce_async(x, name="async.ar", op=hvd.Sum))
        asynchronous = _delta(before, hvd.stats())
        calls = python_calls(lambda: hvd.allreduce(x, name="sync.ar", op=hvd.Sum))
        value, value_async = float(out[0]), float(out_async[0])
        hvd.shutdown()
        waits = list(stand_in.waits)
    return {"sync": sync, "async": asynchronous, "calls": calls, "value": value, "value_async": value_async,
            "waits": len(waits)}


class _Calls:
    """Python calls attributed to the innermost of some wrapped methods or scoped functions (a hook's
    own work, apart from the bucket launches it triggers), counted over one step, with the names of
    the functions called outside gpucomm (``foreign``: e.g. torch's ``Tensor.__hash__``)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.entries: dict[str, int] = {}
        self.foreign: dict[str, int] = {}
        self.total = 0  # every Python call while profiling (the scoped and wrapped ones' and all others)
        self._stack: list[str] = []
        self._scopes: dict[Any, str] = {}  # code object -> name: calls inside a frame running it count for it
        self._frames: list[Any] = []  # the scoped frames open now (innermost last)

    def scope(self, function: Any, name: str) -> None:
        """Count the calls made inside ``function`` (a plain function: hooks bound at registration cannot
        be wrapped afterwards) under ``name``."""
        self._scopes[function.__code__] = name
        self.calls[name] = self.entries[name] = 0

    def wrap(self, owner: object, name: str) -> None:
        real = getattr(owner, name)
        self.calls[name] = self.entries[name] = 0

        def counted(*args, **kwargs):
            self.entries[name] += 1
            self._stack.append(name)
            try:
                return real(*args, **kwargs)
            finally:
                self._stack.pop()

        setattr(owner, name, counted)

    def profile(self, frame, event, arg) -> None:
        if event == "return":
            if self._frames and frame is self._frames[-1]:
                self._frames.pop()
                self._stack.pop()
            return
        if event != "call":
            return
        self.total += 1
        code = frame.f_code
        if self._stack and code.co_name != "counted":
            self.calls[self._stack[-1]] += 1
            if os.sep + "gpucomm" + os.sep not in code.co_filename:
                key = f"{self._stack[-1]}: {os.path.basename(code.co_filename)}:{code.co_name}"
                self.foreign[key] = self.foreign.get(key, 0) + 1
        name = self._scopes.get(code)
        if name is not None:
            self.entries[name] += 1
            self._stack.append(name)
            self._frames.append(frame)

    def per_entry(self, name: str) -> float:
        return self.calls[name] / max(1, self.entries[name])


def training_steps(steps: int = 6, views: str = "1", set_to_none: bool = True) -> dict:
    """A 2-rank DistributedOptimizer on the CUDA path (stand-ins), several buckets: the counters of
    each step (copies, event records, stream waits), the Python calls of a hook and of a bucket
    launch, and the result against one process on the full batch."""
    os.environ["GPUCOMM_GRADIENT_VIEWS"] = views
    try:
        with cuda_path() as stand_in:
            hvd.init()
            r, n = hvd.rank(), hvd.size()
            model, opt, ref, ref_opt = _twins()
            buckets = opt._buckets
            kinds = sorted({type(b).__name__ for b in buckets.buckets})
            counting = _Calls()
            per_step = []
            for s in range(steps):
                last = s == steps - 1
                if last:  # the last step: Python calls of each hook and of each bucket launch
                    by_order = opt._by_order  # hooked by arrival order: a Python hook per bucket only
                    counting.scope(type(opt)._last_hook if by_order else type(opt)._hook, "hook")
                    ready = "last_arrived" if by_order else "gradient_ready"
                    counting.wrap(opt._buckets, ready)
                    counting.wrap(opt._buckets, "_launch")
                before = hvd.stats()
                x, y = batch(s)
                opt.zero_grad(set_to_none=set_to_none)
                loss = nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n))
                if last:
                    stand_in.hold = True  # its events stay in flight until the step is over
                    sys.setprofile(counting.profile)
                try:
                    loss.backward()
                finally:
                    sys.setprofile(None)
                if last:  # the step's done event, recorded when backward ended: watched before any wait
                    watched = len(job_state_of_current().data.watchdog)
                opt.step()
                if last:
                    stand_in.hold = False
                    stand_in.finish_all()
                d = _delta(before, hvd.stats())
                per_step.append({k: d[k] for k in ("grad_bucket_views", "grad_bucket_packs", "grad_bucket_unpacks",
                                                   "cuda_event_records", "cuda_stream_waits", "cuda_events_created",
                                                   "collectives", "control_rounds", "grad_steps_by_order",
                                                   "grad_order_changes")})
                _reference_step(ref, ref_opt, x, y, n)
            grads_are_views = all(p.grad is v for b in opt._buckets.buckets for p, v in zip(b.params, b.views)) \
                if kinds == ["ViewBucket"] else None
            diff = max_rel_diff(model, ref)
            result = {"kinds": kinds, "buckets": len(opt._buckets.buckets), "per_step": per_step, "diff": diff,
                      "hook_calls": counting.per_entry(ready), "hooks": counting.entries[ready],
                      "hook_own_calls": counting.per_entry("hook"), "hook_entries": counting.entries["hook"],
                      "foreign_calls": dict(counting.foreign),
                      "launch_calls": counting.per_entry("_launch"), "launches": counting.entries["_launch"],
                      "grads_are_views": grads_are_views, "watched_after_backward": watched,
                      "by_order": by_order, "backward_calls": counting.total,
                      "params": sum(len(b.params) for b in opt._buckets.buckets)}
            hvd.shutdown()
            result["stand_in_calls"] = dict(stand_in.calls)
            return result
    finally:
        os.environ.pop("GPUCOMM_GRADIENT_VIEWS", None)


def replaced_gradients_are_rebound(steps: int = 4) -> dict:
    """Views bound and zeroed in place (``opt.zero_grad(set_to_none=False)``: nothing packed), then
    ``model.zero_grad()`` (set_to_none) replaces every gradient: the next step packs them once (one
    copy per bucket) and binds the views again."""
    with cuda_path():
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        model, opt, ref, ref_opt = _twins()
        packs = []
        for s in range(steps):
            x, y = batch(s)
            if s == 2:
                model.zero_grad()  # torch's: every p.grad becomes None
            else:
                opt.zero_grad(set_to_none=False)
            before = hvd.stats()
            nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
            opt.step()
            packs.append(hvd.stats()["grad_bucket_packs"] - before["grad_bucket_packs"])
            _reference_step(ref, ref_opt, x, y, n)
        bound = all(p.grad is v for b in opt._buckets.buckets for p, v in zip(b.params, b.views))
        opt.zero_grad(set_to_none=False)
        zeroed = all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())
        still_bound = all(p.grad is v for b in opt._buckets.buckets for p, v in zip(b.params, b.views))
        diff = max_rel_diff(model, ref)
        hvd.shutdown()
    return {"packs": packs, "bound": bound, "zeroed": zeroed, "still_bound": still_bound, "diff": diff,
            "buckets": len(opt._buckets.buckets)}


def _started(lr: float) -> tuple:
    """``hvd.init()``, then this rank, the size, the small model and its DistributedOptimizer (SGD)."""
    hvd.init()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters())
    return hvd.rank(), hvd.size(), model, opt


def trace_launch() -> list:
    """(debugging) The Python calls of one bucket launch on the CUDA path."""
    with cuda_path():
        r, n, model, opt = _started(lr=0.05)
        names: list = []
        for s in range(3):
            x, y = batch(s)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n))
            if s == 2:
                real = opt._buckets._launch

                def traced(bucket):
                    def prof(frame, event, arg):
                        if event == "call":
                            names.append(f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_code.co_name}")
                    sys.setprofile(prof)
                    try:
                        real(bucket)
                    finally:
                        sys.setprofile(None)
                opt._buckets._launch = traced
            loss.backward()
            opt.step()
        hvd.shutdown()
    return names


def one_rank_reducer_steps(steps: int = 4) -> dict:
    """A one-rank job's DistributedOptimizer (CPU): with GPUCOMM_ONE_RANK_REDUCER=1 it runs hooks,
    buckets and a one-rank schedule every step (as DDP runs its reducer at size 1); the result is
    plain SGD's either way."""
    hvd.init()
    model, opt, ref, ref_opt = _twins()
    before = hvd.stats()
    for s in range(steps):
        x, y = batch(s)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    d = _delta(before, hvd.stats())
    diff = max_rel_diff(model, ref)
    hvd.shutdown()
    return {"steps": steps, "schedule_steps": d["schedule_steps"], "collectives": d["collectives"], "diff": diff}


def backward_marked() -> dict:
    """While a DistributedOptimizer's backward runs, ``activity.backward_running()`` says so (read from
    inside a gradient hook); after the step it does not."""
    from gpucomm.dataplane import activity

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    seen: list[bool] = []
    last = list(model.parameters())[0]
    handle = last.register_post_accumulate_grad_hook(lambda p: seen.append(activity.backward_running()))
    x, y = batch(0)
    opt.zero_grad()
    nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
    opt.step()
    after = activity.backward_running()
    handle.remove()
    hvd.shutdown()
    return {"during": bool(seen) and all(seen), "after": after}


def cpu_views(steps: int = 4, set_to_none: bool = False) -> dict:
    """CPU float32 gradients live in their buckets: after the first step ``p.grad`` is a view of the
    fusion buffer; ``opt.zero_grad(set_to_none=False)`` zeroes it in place and no step copies a
    gradient again; the default ``zero_grad()`` frees them and each step packs each bucket once."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model, opt, ref, ref_opt = _twins()
    packs = 0
    for s in range(steps):
        x, y = batch(s)
        before = hvd.stats()["grad_bucket_packs"]
        opt.zero_grad(set_to_none=set_to_none)
        nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
        opt.step()
        if s > 0:
            packs += hvd.stats()["grad_bucket_packs"] - before
        _reference_step(ref, ref_opt, x, y, n)
    views = all(p.grad is v for b in opt._buckets.buckets for p, v in zip(b.params, b.views))
    diff = max_rel_diff(model, ref)
    hvd.shutdown()
    return {"views": views, "packs_after_first": packs, "steps": steps, "buckets": len(opt._buckets.buckets),
            "diff": diff}


def default_check_on_the_cuda_path(steps: int = 5, nan_step: int = 2) -> dict:
    """The default finite check on the CUDA path (stand-ins): rank 1's gradient goes NaN at step
    ``nan_step`` (1-based); every rank learns it one step later, with no host sync."""
    import warnings

    from gpucomm.errors import NonFiniteGradientError  # noqa: F401 - the default mode never raises

    with cuda_path() as stand_in:
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        model = make_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=[(f"{k}", v) for k, v in model.named_parameters()])
        opt._finite.budget = None  # every step searched, whatever this busy machine's timing (the budget has its own test)
        reported_at, findings, poisoned = None, [], [False]
        first = list(model.parameters())[0]  # "0.weight": rank 1's NaN starts there, inside backward
        first.register_hook(lambda g: g.clone().fill_(float("nan")) if poisoned[0] else g)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in range(1, steps + 1):
                x, y = batch(s)
                opt.zero_grad()
                poisoned[0] = s == nan_step and r == 1
                nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
                opt.step()
                if opt.last_nonfinite and reported_at is None:
                    reported_at = s
                    findings = [[f.rank, f.name] for f in opt.last_nonfinite]
        ours = [w for w in caught if "non-finite gradient" in str(w.message)]
        out = {"mode": opt._check_mode, "kinds": sorted({type(b).__name__ for b in opt._buckets.buckets}),
               "steps": steps, "nan_step": nan_step, "reported_at": reported_at, "findings": findings,
               "warnings": len(ours), "read_later": stand_in.calls["read_later"],
               "host_syncs": stand_in.calls["read_now"]}
        hvd.shutdown()
    return out


def shutdown_from_another_thread() -> dict:
    """``hvd.shutdown()`` called from a thread other than ``init``'s (Ray Train's actor thread does this):
    the threads in which the job selected its GPU while closing."""
    import threading

    with cuda_path():
        hvd.init()
        job = job_state_of_current()
        selected: list[int] = []
        select = job.select_device

        def recording() -> None:
            selected.append(threading.get_ident())
            select()

        job.select_device = recording
        closer = threading.Thread(target=hvd.shutdown, name="not-init")
        closer.start()
        closer.join(60)
        return {"closer": closer.ident, "alive": closer.is_alive(), "selected_in": selected}


def report_on_its_way_when_the_job_re_forms() -> dict:
    """The default finite check on the CUDA path (stand-ins): rank 1's gradient goes NaN in the last
    step before the job re-forms (``hvd.shutdown()``, then ``hvd.init()``, as elastic training does),
    so that step's report is still on its way to the host; the optimizer's next step, in the new job,
    must still report it, decoded against the layout that produced it."""
    import warnings

    with cuda_path():
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        model = make_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=[(f"{k}", v) for k, v in model.named_parameters()])
        opt._finite.budget = None  # every step searched
        poisoned = [False]
        first = list(model.parameters())[0]
        first.register_hook(lambda g: g.clone().fill_(float("nan")) if poisoned[0] else g)
        seen = []
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            for s in range(1, 4):
                if s == 3:  # the job re-forms between step 2 and step 3
                    hvd.shutdown()
                    hvd.init()
                x, y = batch(s)
                opt.zero_grad()
                poisoned[0] = s == 2 and r == 1
                nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
                opt.step()
                seen.append([[f.rank, f.name] for f in opt.last_nonfinite or []])
        hvd.shutdown()
    return {"seen": seen}


def tensor_on_another_gpu() -> dict:
    """The CUDA path (stand-ins): after a first op on this rank's GPU, the stand-in says every tensor
    lies on GPU 1; an op and a DistributedOptimizer must then refuse them with a clear error on the
    caller's thread, before any collective (both ranks do the same, so none waits for the other)."""
    with cuda_path() as stand_in:
        hvd.init()
        first = float(hvd.allreduce(torch.ones(3), name="first")[0])  # this rank's GPU: 0
        stand_in.index = lambda device: 1
        errors = {}
        try:
            hvd.allreduce(torch.ones(3), name="elsewhere")
        except ValueError as e:
            errors["op"] = str(e)
        model = make_model()
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
        except ValueError as e:
            errors["optimizer"] = str(e)
        stand_in.index = lambda device: 0
        after = float(hvd.allreduce(torch.ones(3), name="after")[0])
        hvd.shutdown()
    return {"first": first, "after": after, **errors}


class _ConnectingNccl(NcclOverCpu):
    """A communicator whose first allreduce blocks inside its host call, as NCCL (>= 2.22) blocks
    while it connects a peer that never comes, until the communicator is aborted."""

    def __init__(self, cpu, size: int) -> None:
        super().__init__(cpu, size)
        import threading

        self.aborted = threading.Event()
        self.returned = threading.Event()

    def allreduce(self, send, recv, *, op, stream=None) -> None:
        self.aborted.wait(120)
        self.returned.set()
        raise RuntimeError("NCCL error: remote process exited or there was a network error (stand-in)")

    def abort(self) -> None:
        self.aborted.set()


def host_call_blocked_inside_nccl() -> dict:
    """The CUDA path (stand-ins): the job's first allreduce blocks inside its host call on every rank
    (NCCL connecting a peer lazily); the watchdog must fail the job within the timeout, naming the
    call, abort the communicator (which frees the call), and the caller's wait must raise that."""
    import time as _time

    made: list = []

    def create(client, key, rank, size, device_ordinal, timeout):
        made.append(_ConnectingNccl(gloo_group(client, key + "/standin/", rank, size, timeout=timeout,
                                               device=GlooDevice(hostname="127.0.0.1")), size))
        return made[-1]

    with cuda_path():
        job_state.create_nccl = create
        hvd.init()
        start = _time.monotonic()
        error = ""
        try:
            hvd.allreduce(torch.ones(3), name="stuck")
        except hvd.HorovodInternalError as e:
            error = str(e)
        seconds = _time.monotonic() - start
        returned = bool(made) and made[0].returned.wait(10)
        hvd.shutdown()
    return {"error": error, "seconds": seconds, "returned": returned}


def predivide_split_on_the_cuda_path(set_to_none: bool) -> list:
    """The CUDA path (stand-ins) with the default finite check, ``gradient_predivide_factor=4`` at 2 ranks:
    each rank's gradient is 6 float32 subnormal units. Horovod's split, x 1/4 before the sum and x 4/2
    after, gives 8 units (1.5 rounds to 2 before the sum); dividing by 2 before the sum gives 6."""
    from tests.ranks.optimizer_scenarios import TINY

    with cuda_path():
        hvd.init()
        p = nn.Parameter(torch.zeros(5))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), named_parameters=[("p", p)],
                                       gradient_predivide_factor=4.0)
        seen = []
        for _ in range(2):
            opt.zero_grad(set_to_none=set_to_none)
            (p * torch.full((5,), 6 * TINY)).sum().backward()
            opt.synchronize()
            seen.append([v / TINY for v in p.grad.tolist()])
            with opt.skip_synchronize():
                opt.step()
        hvd.shutdown()
    return seen


def no_step_wait_reported_on_the_cuda_path(steps: int = 4) -> dict:
    """The CUDA path (stand-ins) with ``schedule.BLOCKED_AFTER`` at 0: a step's wait is a stream wait, never
    a blocked host transfer, so no step may be reported to rank 0 as waiting, however far apart the steps."""
    import time as _time

    from gpucomm.dataplane import schedule

    saved, schedule.BLOCKED_AFTER = schedule.BLOCKED_AFTER, 0.0
    try:
        with cuda_path():
            r, n, model, opt = _started(lr=0.01)
            before = hvd.stats()["step_waits_reported"]
            for s in range(steps):
                x, y = batch(s)
                opt.zero_grad()
                nn.functional.mse_loss(model(half(x, r, n)), half(y, r, n)).backward()
                opt.step()
                _time.sleep(0.2)
            reported = hvd.stats()["step_waits_reported"] - before
            hvd.shutdown()
    finally:
        schedule.BLOCKED_AFTER = saved
    return {"reported": reported}
