"""Rank-side bodies of tests/test_data_plane.py: the data plane's threads, communicators, issue
order and gradient layouts, shown on CPU ranks (the same code the GPU path runs)."""

from __future__ import annotations

import gc
import sys
import threading
import time

import torch
import torch.nn as nn

import gpucomm.torch as hvd
from gpucomm import job as jobs
from gpucomm.bootstrap import devices


# -- every thread that may touch CUDA selects this rank's GPU first ------------------------------

def threads_select_the_device() -> dict:
    """Pretend this rank was pinned to GPU ``3 + rank`` (a bus id of its own) and record which
    threads select which device; then run what starts gpucomm's threads: collectives (the control
    thread) and a join while the other rank still steps a DistributedOptimizer (the stand-in)."""
    import os

    rank = int(os.environ["GPUCOMM_RANK"])
    selected: list[tuple[str, int]] = []
    gpu = devices.GpuInfo(rank, f"0000:{0x10 + rank:02x}:00.0", f"GPU-test-{rank}", "Test GPU", 1 << 30)
    pinned = devices.PinnedDevice(gpu, 3 + rank)
    real_pin, real_select = devices.pin_local_gpu, getattr(devices, "select_device", None)
    devices.pin_local_gpu = lambda *a, **k: pinned
    devices.select_device = lambda ordinal: selected.append((threading.current_thread().name, ordinal))
    try:
        hvd.init()
        r = hvd.rank()
        hvd.allreduce(torch.ones(3), name="warm")
        model = nn.Linear(4, 2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        if r == 0:
            for _ in range(2):
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
        last = hvd.join()
        hvd.shutdown()
    finally:
        devices.pin_local_gpu = real_pin
        if real_select is not None:
            devices.select_device = real_select
    return {"selected": selected, "last": last}


# -- failure aborts, success destroys --------------------------------------------------------------

class RecordingComm:
    """Stands in for CuPy's ``NcclCommunicator`` on a CPU rank (no NCCL can run here): records the
    lifecycle calls the backend makes on it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def abort(self) -> None:
        self.calls.append("abort")

    def destroy(self) -> None:
        self.calls.append("destroy")

    def check_async_error(self) -> None:
        pass


def recording_backend(rank: int, size: int):
    from gpucomm.backends.nccl import NcclBackend

    backend = object.__new__(NcclBackend)  # its CuPy communicator cannot be made without a GPU
    backend.rank, backend.size, backend.device = rank, size, 0
    backend._state, backend._state_lock = "live", threading.Lock()
    backend.comm = RecordingComm()
    return backend


def communicators_on_failure(fail: bool) -> dict:
    """A job whose data plane holds an NCCL communicator (recording); with ``fail``, rank 1 reports
    a failure mid-job (as an uncaught exception does) and every rank learns it from the control
    plane. Returns the calls each rank's communicator got before shutdown and in all."""
    from gpucomm.dataplane.groups import Group

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    job = jobs.current()
    backend = recording_backend(r, n)
    group = job.data.register(Group(77, range(n), r, lambda g: job.cpu, lambda g: backend))
    group.nccl()  # created, as the first CUDA collective on the set would
    hvd.allreduce(torch.ones(2), name="before")
    error = ""
    if fail:
        if r == 1:
            job.controller.report_failure("rank 1 fails on purpose")
        try:
            for i in range(200):
                hvd.allreduce(torch.ones(2), name=f"after.{i}")
        except hvd.HorovodInternalError as e:
            error = str(e)
    before_shutdown = list(backend.comm.calls)  # the control plane's failure path, before any shutdown
    hvd.shutdown()
    return {"before_shutdown": before_shutdown, "all": backend.comm.calls, "error": error}


def optimizer_schedules_outlive_garbage_collection() -> dict:
    """An optimizer that is garbage-collected keeps its schedule's communicator (released only at a
    collective point); ``close()`` releases it."""
    hvd.init()
    job = jobs.current()

    def make() -> torch.optim.Optimizer:  # model and optimizer unreachable once it returns (but a cycle)
        model = nn.Linear(3, 1)
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    opt = make()
    before = len(job._schedules)
    del opt
    gc.collect()
    after_gc = len(job._schedules)
    model = nn.Linear(3, 1)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    group = opt2._schedule.group
    opt2.close()
    closed = group.nccl_if_created() is None and group._cpu is None
    after_close = len(job._schedules)
    opt2_closed_error = ""
    try:
        opt2.step()
    except ValueError as e:
        opt2_closed_error = str(e)
    hvd.shutdown()
    return {"before": before, "after_gc": after_gc, "after_close": after_close, "closed": closed,
            "closed_error": opt2_closed_error}


# -- sparse gradients ride the fixed schedule ------------------------------------------------------

def sparse_steps_negotiate_nothing(steps: int = 4) -> dict:
    """After the step in which the ranks agree which gradients are sparse, a step with a sparse
    embedding gradient sends no control message: its reduction is on the fixed schedule."""
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    emb, head = nn.Embedding(20, 4, sparse=True), nn.Linear(4, 1)
    params = list(emb.parameters()) + list(head.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                   named_parameters=[("emb.weight", emb.weight)] + list(head.named_parameters()))
    deltas = []
    for s in range(steps):
        before = hvd.stats()
        opt.zero_grad()
        idx = torch.tensor([(s + r) % 20, (3 * s + 2 * r) % 20])
        head(emb(idx)).sum().backward()
        opt.step()
        after = hvd.stats()
        deltas.append({k: after[k] - before[k] for k in ("negotiated", "control_rounds", "collectives")})
    weight = emb.weight.detach().clone()
    every = hvd.allgather_object(weight)
    hvd.shutdown()
    return {"deltas": deltas, "same": all(torch.equal(every[0], w) for w in every),
            "sparse": sorted(opt._parameter_names[p] for p in opt._sparse.reduced)}


# -- a steady-state step touches no control object ---------------------------------------------------

def control_calls_in_steady_steps(steps: int = 5) -> dict:
    """Profile the rank's own thread through steady-state steps (after two warm-up steps): the
    functions called from gpucomm/control/ (none expected) and from gpucomm/dataplane/."""
    hvd.init()
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())

    def step(s: int) -> None:
        opt.zero_grad()
        model(torch.full((4, 16), float(s))).sum().backward()
        opt.step()

    for s in range(2):
        step(s)
    seen: dict[str, set] = {"control": set(), "dataplane": set()}

    def profile(frame, event, arg) -> None:
        if event == "call":
            path = frame.f_code.co_filename.replace("\\", "/")
            for part in seen:
                if f"/gpucomm/{part}/" in path:
                    seen[part].add(f"{path.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        for s in range(steps):
            step(s + 2)
    finally:
        sys.setprofile(None)
    hvd.shutdown()
    return {k: sorted(v) for k, v in seen.items()}


# -- gradients in channels_last travel without a copy -------------------------------------------------

def copies_per_step(channels_last: bool, device: str = "cpu", steps: int = 3) -> dict:
    """A conv net whose buckets are fused (on CPU through fp16 compression: pack and unpack, as on
    GPU), contiguous or channels_last; counts the copying aten ops of the last step (backward, pack,
    allreduce, unpack) and checks the averaged gradients keep their layout."""
    from torch.utils._python_dispatch import TorchDispatchMode

    hvd.init()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    compression = hvd.Compression.fp16 if device == "cpu" else hvd.Compression.none
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=compression)
    x = torch.randn(2, 3, 10, 10, device=device) + hvd.rank()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    counted = None
    for s in range(steps):
        opt.zero_grad()
        loss = model(x).sum()
        if s == steps - 1:
            counted = Count()
            with counted:
                loss.backward()
                opt.synchronize()
        else:
            loss.backward()
            opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
    conv = model[0].weight
    layout_kept = conv.grad.stride() == conv.stride()
    hvd.shutdown()
    copying = {k: v for k, v in counted.ops.items() if k in ("clone", "contiguous", "copy_", "empty_strided", "empty")}
    return {"copying": copying, "layout_kept": layout_kept}


# -- the one-order rule, exercised on CPU (GPUCOMM_ISSUE_ORDER=all) ------------------------------------

def issue_sequence(unused_on_rank: int, device: str = "cpu", steps: int = 3) -> dict:
    """Records, per rank, the sequence in which the data plane issues collectives (negotiated and
    scheduled alike), through a training loop that mixes them as real scripts do: an async
    allreduce submitted before backward and waited after the step, a synchronous metric allreduce
    between backward and step, a parameter unused on one rank only (so its bucket is complete at
    different points on different ranks), a sparse embedding, and a SyncBatchNorm whose backward
    runs a negotiated allreduce in the middle of backward."""
    from gpucomm.dataplane.executor import Executor

    hvd.init()
    r = hvd.rank()
    issued: list[str] = []
    real_call = Executor.__call__

    def recording_call(self, req, meta):
        issued.append(req.name)
        return real_call(self, req, meta)

    Executor.__call__ = recording_call
    try:
        torch.manual_seed(0)
        emb = nn.Embedding(10, 4, sparse=True).to(device)
        body = nn.Sequential(nn.Linear(4, 6), hvd.SyncBatchNorm(6), nn.ReLU(), nn.Linear(6, 2)).to(device)
        spare = nn.Linear(4, 2).to(device)  # unused on rank ``unused_on_rank``
        named = [("emb.weight", emb.weight)] + [(f"body.{k}", v) for k, v in body.named_parameters()] \
            + [(f"spare.{k}", v) for k, v in spare.named_parameters()]
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.05), named_parameters=named)
        for s in range(steps):
            opt.zero_grad()
            # large enough not to ride the control round (small CPU allreduces do; CUDA ones never)
            pending = hvd.allreduce_async(torch.full((5000,), float(r), device=device), name=f"early.{s}")
            h = emb(torch.tensor([s % 10, (s + r + 1) % 10, 4], device=device))
            out = body(h).sum()
            if r != unused_on_rank:
                out = out + spare(h).sum()
            out.backward()
            metric = hvd.allreduce(out.detach().expand(5000).contiguous(), name=f"metric.{s}")[0]
            opt.step()
            hvd.synchronize(pending)
        weights = [p.detach().cpu() for _, p in named]
        every = hvd.allgather_object(weights)
        same = all(all(torch.allclose(a, b) for a, b in zip(every[0], theirs)) for theirs in every)
    finally:
        Executor.__call__ = real_call
    hvd.shutdown()
    return {"issued": [name for name in issued if not name.startswith("allgather.noname")],
            "same": same, "metric": float(metric)}


# -- GPU only ------------------------------------------------------------------------------------------

def kernels_compiled_when_built() -> dict:
    """A CUDA model: the fusion kernels are compiled when DistributedOptimizer is built, and the first
    backward compiles nothing more."""
    from gpucomm import kernels

    hvd.init()
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    built = sorted(kernels.status()["compiled"])
    opt.zero_grad()
    model(torch.randn(8, 32, device="cuda")).sum().backward()
    opt.step()
    torch.cuda.synchronize()
    after = sorted(kernels.status()["compiled"])
    hvd.shutdown()
    return {"built": built, "after_step": after}


def events_per_step(steps: int = 12) -> dict:
    """CUDA events made per steady-state step (pooled: none) and done events retired. Each step ends
    with the host waiting for the GPU, as a loop that reads its loss does: a host that runs ahead
    has more collectives in flight than the warm-up had, and each of those rightly takes a new event
    (seen on an H100 in single-GPU test mode, where an allreduce takes ~13 ms over loopback)."""
    hvd.init()
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x = torch.randn(16, 64, device="cuda")
    before = None
    for s in range(steps):
        if s == 4:
            torch.cuda.synchronize()
            time.sleep(0.5)  # the watchdog retires what finished
            before = hvd.stats()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        torch.cuda.synchronize()  # the loss read back: the host waits for the step
    time.sleep(0.5)
    after = hvd.stats()
    retired = jobs.current().data.watchdog.retired
    hvd.shutdown()
    return {"created": after["cuda_events_created"] - before["cuda_events_created"], "retired": retired,
            "collectives": after["collectives"] - before["collectives"]}


def cuda_job_failure(steps: int = 50) -> dict:
    """Rank 1 fails mid-training on CUDA; every rank's NCCL communicators are aborted (never destroyed)."""
    hvd.init()
    r = hvd.rank()
    before = hvd.stats()  # the counters are process-wide: a pooled worker's earlier jobs counted too
    model = nn.Linear(16, 16).cuda()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    error = ""
    start = time.monotonic()
    try:
        for s in range(steps):
            if s == 3 and r == 1:
                jobs.current().controller.report_failure("rank 1 fails on purpose")
            opt.zero_grad()
            model(torch.randn(4, 16, device="cuda")).sum().backward()
            opt.step()
            hvd.allreduce(torch.ones(4, device="cuda"), name=f"cuda.{s}")
    except hvd.HorovodInternalError as e:
        error = str(e)
    seconds = time.monotonic() - start
    counts = hvd.stats()
    hvd.shutdown()
    final = hvd.stats()
    return {"error": error, "aborts": counts["nccl_aborts"] - before["nccl_aborts"],
            "destroys": final["nccl_destroys"] - before["nccl_destroys"], "seconds": seconds}


def contexts_per_gpu() -> dict:
    """Train a step, join, and shut down on this rank's GPU (one per rank), then list the GPUs on
    which this process holds a CUDA context, by NVML."""
    import os

    import pynvml

    hvd.init()
    r = hvd.rank()
    model = nn.Linear(8, 8).cuda()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    if r == 0:
        opt.zero_grad()
        model(torch.randn(2, 8, device="cuda")).sum().backward()
        opt.step()
    hvd.join()
    hvd.allreduce(torch.ones(2, device="cuda"), name="last")
    mine = torch.cuda.current_device()
    torch.cuda.synchronize()
    pynvml.nvmlInit()
    try:
        on = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            if os.getpid() in pids:
                on.append(pynvml.nvmlDeviceGetPciInfo(handle).busId)
    finally:
        pynvml.nvmlShutdown()
    bus = jobs.current().device.gpu.pci_bus_id
    hvd.shutdown()
    return {"mine": mine, "bus": bus, "contexts_on": [devices.normalize_bus_id(b) for b in on]}


def communicator_on_cupy_default_stream() -> list[float]:
    """gpucomm.Communicator on CuPy arrays with CuPy's default stream."""
    import cupy

    from gpucomm.communicator import Communicator

    comm = Communicator()
    x = cupy.full((4,), float(comm.rank + 1), dtype=cupy.float32)
    out = comm.allreduce(x, stream=cupy.cuda.Stream.null)
    result = cupy.asnumpy(out).tolist()
    hvd.shutdown()
    return result


def timeline_gpu_timer_device(path: str) -> dict:
    """Rank 0 on the second GPU (local ranks swapped): the timeline's GPU timer, made by whichever
    thread issues rank 0's first traced CUDA collective, must sit on rank 0's GPU."""
    import os

    rank = int(os.environ["GPUCOMM_RANK"])
    os.environ["GPUCOMM_LOCAL_RANK"] = str(1 - rank)
    hvd.init()
    hvd.start_timeline(path) if hvd.rank() == 0 else None
    for i in range(3):
        hvd.allreduce(torch.ones(1024, device="cuda"), name=f"traced.{i}")
    torch.cuda.synchronize()
    job = jobs.current()
    timer = job.tracer._gpu if job.tracer is not None else None
    seen = {"mine": torch.cuda.current_device(),
            "timer": None if timer is None else timer.device.index,
            "anchor": None if timer is None else timer._anchor_stream.device.index}
    hvd.stop_timeline() if hvd.rank() == 0 else None
    hvd.shutdown()
    return seen


def join_while_others_train_with_negotiated_work(steps: int = 3) -> dict:
    """Rank 1 joins at once; rank 0 trains a DistributedOptimizer and runs a negotiated allreduce
    (5000 floats: not reduced inline) each step: the joined rank's zeros for both must be issued in
    an order that lets both complete."""
    hvd.init()
    r = hvd.rank()
    model = nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    metrics = []
    if r == 0:
        for s in range(steps):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            metrics.append(float(hvd.allreduce(torch.ones(5000), name=f"metric.{s}", op=hvd.Sum)[0]))
    last = hvd.join()
    hvd.shutdown()
    return {"last": last, "metrics": metrics}


def negotiated_handles_are_not_kept(ops: int = 100) -> dict:
    """A job that runs negotiated collectives and never steps an optimizer keeps none of them alive."""
    import weakref

    hvd.init()
    refs = []
    for i in range(ops):
        t = torch.full((5000,), float(i))
        refs.append(weakref.ref(t))
        hvd.allreduce(t, name=f"op.{i}")
        del t
    gc.collect()
    order = jobs.current().data.order(torch.device("cpu"))
    kept = len(order._submitted) if order is not None else -1
    alive = sum(1 for ref in refs if ref() is not None)
    hvd.shutdown()
    return {"kept": kept, "alive": alive}


def sparse_without_gradients_on_one_rank(steps: int = 3) -> dict:
    """An optimizer whose only parameters are sparse embeddings: on rank 1 no hook fires (it has no
    batch for them), yet its reductions go out inside a step, as rank 0's do."""
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), named_parameters=emb.named_parameters())
    job = jobs.current()
    seen = []
    real_launch = opt._schedule.launch

    def launch(request, meta=None, **kw):
        seen.append(opt._schedule.in_step)
        return real_launch(request, meta, **kw)

    opt._schedule.launch = launch
    for s in range(steps):
        opt.zero_grad()
        if r == 0 or s == 0:  # after the first step (when the ranks agree it is sparse) rank 1 has no batch
            emb(torch.tensor([s, s + 1])).sum().backward()
        opt.step()
    weight = emb.weight.detach().clone()
    every = hvd.allgather_object(weight)
    hvd.shutdown()
    del job
    return {"in_step": seen, "same": all(torch.equal(every[0], w) for w in every)}


def stop_while_rank_0s_link_closes() -> str:
    """Issue 26, item 8: ``Controller.stop()`` used to test ``_link`` outside the progress lock while
    the reader (holding it) cleared ``_link`` when rank 0's connection closed; stop() then sent on None.
    Here the reader's clearing happens exactly in that window."""
    hvd.init()
    controller = jobs.current().controller
    if hvd.rank() == 0:
        hvd.barrier()
        hvd.shutdown()
        return "rank 0"
    hvd.barrier()
    errors = []

    def stop() -> None:
        try:
            controller.stop()
        except Exception as e:  # noqa: BLE001 - the race's symptom, reported to the test
            errors.append(f"{type(e).__name__}: {e}")

    with controller._lock:  # the reader holds it while it handles rank 0's closed connection
        t = threading.Thread(target=stop)
        t.start()
        time.sleep(0.3)  # stop() is past its first look at _link and waits for the lock
        link, controller._link = controller._link, None
        link.sock.close()
    t.join(10)
    hvd.shutdown()
    return "; ".join(errors) or "ok"


# -- bfloat16 reductions where Gloo has none (torch 2.1) ------------------------------------------

def bf16_reductions(widen: bool) -> dict:
    """A bfloat16 allreduce and reduce-scatter, large enough for the data plane; with ``widen`` they
    take the float32 path torch 2.1's Gloo needs (forced here on any torch)."""
    from gpucomm.backends import gloo

    native = gloo.GLOO_REDUCES_BF16
    if widen:
        gloo.GLOO_REDUCES_BF16 = False
    try:
        return _bf16_reductions()
    finally:
        gloo.GLOO_REDUCES_BF16 = native  # this process serves later tests (the harness's rank pool)


def _bf16_reductions() -> dict:
    hvd.init()
    rank = hvd.rank()
    x = torch.full((1 << 15,), 1.5 + rank, dtype=torch.bfloat16)
    summed = hvd.allreduce(x, op=hvd.Sum, name="bf16.sum")
    scattered = hvd.reducescatter(torch.full((4, 1 << 13), 0.5 * (rank + 1), dtype=torch.bfloat16), op=hvd.Sum,
                                  name="bf16.rs")
    async_handle = hvd.allreduce_async_(torch.full((1 << 15,), 2.0, dtype=torch.bfloat16), op=hvd.Average,
                                        name="bf16.async")
    averaged = hvd.synchronize(async_handle)
    stats = hvd.stats()
    hvd.shutdown()
    return {"sum": sorted(set(summed.float().tolist())), "sum_dtype": str(summed.dtype),
            "scattered": sorted(set(scattered.float().reshape(-1).tolist())), "scattered_shape": list(scattered.shape),
            "averaged": sorted(set(averaged.float().tolist())), "gloo": stats["gloo_collectives"]}



def syncs_in_steady_steps(steps: int = 3, warmup: int = 3) -> dict:
    """The synchronizing CUDA calls (torch's sync debug mode: ``benchmarks/sync_check.py``) that gpucomm
    makes in steady-state DistributedOptimizer steps, the finite check at its default, several buckets:
    a step must only queue its work. The steps end with no host wait inside the recorded window, which
    closes with one deliberate sync made here (``control``: proof that the recorder sees them)."""
    import importlib.util
    import os

    # benchmarks/ is no package and stays off sys.path (this worker is pooled): the module by its path
    where = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                         "sync_check.py")
    spec = importlib.util.spec_from_file_location("gpucomm_bench_sync_check", where)
    sync_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync_check)

    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 14 * 14, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    x, y = torch.randn(8, 3, 16, 16, device="cuda"), torch.randint(0, 10, (8,), device="cuda")

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    before = hvd.stats()
    package = os.path.dirname(os.path.dirname(os.path.abspath(hvd.__file__)))  # .../gpucomm
    with sync_check.SyncRecorder(package) as recorder:
        for _ in range(steps):
            step()
        torch.ones(1, device="cuda").item()  # the control: one sync, made here, that the recorder must see
    torch.cuda.synchronize()
    control = sum(1 for _, frames in recorder.records if frames and frames[-1].endswith("(syncs_in_steady_steps)"))
    after = hvd.stats()
    buckets = len(opt._buckets.buckets)
    hvd.shutdown()
    return {"ours": [frames[-6:] for _, frames in recorder.ours()], "lines": dict(recorder.by_line(recorder.ours())),
            "all": len(recorder.records), "control": control, "buckets": buckets,
            "collectives": after["collectives"] - before["collectives"]}
