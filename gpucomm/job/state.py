"""One initialized job in this process: what ``hvd.init()`` built, and the entry point every
collective takes (``submit``).

A one-rank job has nothing to agree on: its collectives run on the caller's thread (no
control plane, no background thread, no negotiation). A larger job negotiates ad-hoc collectives
through ``gpucomm.control``, while DistributedOptimizer buckets bypass it on fixed schedules
(``new_schedule``), each on a group of its own. Both end in the job's data plane
(``gpucomm.dataplane.plane``), which owns the communicators, the CUDA events and the watchdog.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..backends.gloo import GlooBackend, GlooDevice, gloo_group
from ..backends.local import SelfBackend
from ..backends.mpi import MpiBackend, mpi_group
from ..backends.nccl import create_nccl
from ..bootstrap import devices
from ..bootstrap.rendezvous import RendezvousClient, RendezvousError, RendezvousServer
from ..bootstrap.world import World
from ..control.controller import ControlConfig, Controller, ControlLinks, Send
from ..control.coordinator import Coordinator
from ..control.negotiation import CONTROL_KINDS
from ..control.one_rank import OneRankPlane
from ..control.standins import StandIns
from ..dataplane import cuda_calls
from ..dataplane.executor import prepare, release_results
from ..dataplane.groups import Group
from ..dataplane.handles import Handle
from ..dataplane.inline import combine_inline
from ..dataplane.plane import DataPlane
from ..dataplane.requests import Request
from ..dataplane.schedule import Schedule
from ..errors import CollectiveError
from ..timeline.tracer import Tracer
from .elastic import WORKER_VAR, newest_round

log = logging.getLogger("gpucomm")

SHUTDOWN_GRACE = 10.0  # rank 0 keeps serving the store this long for ranks still shutting down
FAILED_SHUTDOWN_GRACE = 1.0  # ... and this long once the job has failed (a stalled or dead rank will not come)


@dataclass
class Job:
    """Everything one initialized job owns in this process."""

    world: World
    client: RendezvousClient
    server: RendezvousServer | None
    prefix: str
    timeout: float
    cpu: GlooBackend | MpiBackend | SelfBackend  # the job's CPU backend (SelfBackend in a one-rank job)
    device: devices.PinnedDevice | None
    hosts: list[str]
    cross_rank: int
    cross_size: int
    control: ControlConfig
    links: ControlLinks = field(default_factory=ControlLinks)
    static_sets: list[tuple[int, ...]] = field(default_factory=list)
    dynamic_sets: bool = False
    elastic_round: int = 0  # the launcher's round this job is (elastic mode), else 0
    new_workers_joined: bool = False  # the round (or one since this worker's last) added workers without the state
    caller_gpu: int | None = None  # the GPU current where hvd.init() was called, if the script had started CUDA
    gloo_device: GlooDevice = field(default_factory=GlooDevice)  # where this rank's Gloo groups listen (setup.py)
    plane: Controller | OneRankPlane = field(init=False)
    data: DataPlane = field(init=False)  # the data plane: communicators, CUDA events, watchdog, issue orders
    groups: dict[int, Group] = field(init=False)
    join_device: int = -1  # hvd.join(device=...): the GPU for zero stand-ins; -1: this rank's GPU
    unnamed: dict = field(default_factory=dict)  # process set id -> counter numbering its unnamed ops
    tracer: Tracer | None = None  # rank 0's timeline while one is recording
    _set_counter: int = 0
    _schedule_counters: dict = field(default_factory=dict)  # process set id -> schedules made on it
    _schedules: list[Schedule] = field(default_factory=list)
    _closed_records: list[tuple[int, int, int]] = field(default_factory=list)  # closed schedules' launch counts
    _removed: list[Group] = field(default_factory=list)  # removed process sets, to release
    _join_parties: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)

    def __post_init__(self) -> None:
        rank, size = self.world.rank, self.world.size
        self.data = DataPlane(rank, self.timeout, tracer=self._current_tracer, select_device=self.select_device,
                              report=self._report_data_failure, in_step=self._step_blocked, departed=self._departed)
        self.groups = {0: self.data.register(Group(0, range(size), rank, lambda g: self.cpu, self._make_nccl))}
        for set_id, ranks in enumerate(self.static_sets, start=1):
            self.groups[set_id] = self.data.register(self._group(set_id, ranks))
        self._coordinator = None
        self._negotiated = size > 1
        # without a pinned GPU (no NVML): the device the script had current at hvd.init() (or, when it had
        # none, the GPU of the first CUDA tensor or parameter handed in: ``check_gpu``)
        self._gpu_lock = threading.Lock()
        self._seen_gpu: int | None = self.caller_gpu if self.device is None else None
        self._gpu_index: int | None = None  # this rank's GPU as the data plane numbers it (``check_gpu``)
        self._execute = self.data.executor(self.group)
        if size == 1:
            self.plane = OneRankPlane(self.timeout, on_done=self._on_done, process_sets=self.static_sets)
            return
        if rank == 0:
            self._coordinator = Coordinator(size, cache_capacity=self.control.cache_capacity,
                                            process_sets=self.static_sets, reduce_inline=combine_inline)
        standins = StandIns(lambda request, meta, keep: self.data.run_unowned(request, meta, self._execute, keep),
                            self._zeros_device, self.data.events)
        self.plane = Controller(rank, size, lambda handle, meta: self.data.run(handle, meta, self._execute),
                                self.control, coordinator=self._coordinator, links=self.links, on_done=self._on_done,
                                standins=standins, tracer=self._current_tracer, on_fail=self._control_failed,
                                select_device=self.select_device)

    def unnamed_name(self, kind: str, set_id: int) -> str:
        """The name of an unnamed operation: numbered per process set, so that operations only a
        set's members run do not shift the numbering of the others' (every member counts alike)."""
        counter = self.unnamed.get(set_id)
        if counter is None:
            counter = self.unnamed[set_id] = itertools.count()
        return f"{kind}.noname.{next(counter)}" if set_id == 0 else f"{kind}.noname.ps{set_id}.{next(counter)}"

    @property
    def on_mpi(self) -> bool:
        """Whether this job's CPU collectives run on MPI (else Gloo, or nothing in a one-rank job)."""
        return isinstance(self.cpu, MpiBackend)

    @property
    def elastic(self) -> bool:
        return self.elastic_round > 0

    def newest_round(self) -> tuple[int, bool]:
        """Elastic mode: the launcher's newest round, and whether hosts were added since this job's
        round (the trained state must then be synced)."""
        return newest_round(self.client, self.world.run_id, self.elastic_round)

    def tell_launcher(self, key_of: Callable[[str, str], str]) -> None:
        """Elastic mode: tell the launcher something about this worker in this round
        (``rounds.holds_key`` / ``rounds.done_key``)."""
        worker = os.environ.get(WORKER_VAR, "")
        self.client.set(key_of(self.world.run_id, worker), str(self.elastic_round).encode())

    @property
    def controller(self) -> Controller | None:
        """The control plane (None in a one-rank job, which needs none)."""
        return self.plane if isinstance(self.plane, Controller) else None

    # -- submitting ------------------------------------------------------------------------------
    def submit(self, request: Request, *, send: Send = Send.CYCLE) -> Handle:
        """Run ``request``: on the caller's thread in a one-rank job, else after negotiation (``Send`` says when
        its request leaves). CUDA requests record a ready event on the caller's stream, looked up
        once here."""
        gpu = cuda_calls.is_gpu(request.device)
        if self.data.step_openers and self._negotiated and (gpu or self.data.orders_cpu) and request.tensors:
            self.data.open_steps()  # before it leaves: its answer may come (and be issued) at once
        if gpu and self._negotiated:
            calls = cuda_calls.calls()
            request.index = calls.index(request.device)
            request.stream = calls.current_stream(request.device)
            if request.index != self._gpu_index:  # the first op, or a tensor on another GPU
                self.check_gpu(request.device, request.describe)
            request.waited_at_once = send is Send.ON_WAIT
            prepare(request)
            if not (request.waited_at_once and request.send is not None and self.tracer is None):
                # launched on a communication stream: it waits for this point of the caller's stream
                request.ready_event = self.data.events.record(request.stream, request.index)
            # else launched on the caller's own stream when agreed (the caller waits meanwhile): no event
        elif request.kind in ("allreduce", "broadcast") and self._negotiated:
            prepare(request)
        handle = self.plane.submit(request, send=send)
        if self._negotiated and (gpu or self.data.orders_cpu) and request.tensors:
            self.data.submitted(handle)  # its device's next optimizer step waits for its agreement
        return handle

    def execute(self, request: Request) -> Any:
        """Run ``request`` and return its result (the synchronous forms): in a one-rank job computed
        at once where its data lies, else submitted to leave at once and waited for."""
        if self._negotiated or request.kind in CONTROL_KINDS:
            return self.submit(request, send=Send.ON_WAIT).wait()
        return self.plane.run_now(request)

    def failure(self) -> CollectiveError | None:
        """Why the job's collectives stopped (a rank failed, a stall shutdown, the NCCL watchdog), if they did."""
        return self.plane.failure() or self.data.failure()

    def _control_failed(self, error: CollectiveError) -> None:
        """The control plane says the job failed: abort the communicators; if rank 0 is gone and it
        served the store, every store call (shutdown's included) gives up at once from now on."""
        self.data.fail(error)
        controller = self.controller
        if controller is not None and controller.coordinator_lost and self.server is None \
                and not self.world.rendezvous_hosted:
            self.client.abandon(f"rank 0, which served it, is gone ({error})")

    def _step_blocked(self, what: str | None) -> None:
        """A DistributedOptimizer step of this rank blocks in a transfer (``what``), or no longer (None):
        rank 0's stall inspector names it (a step is never negotiated)."""
        controller = self.controller
        if controller is not None:
            controller.note_in_step(what)

    def _departed(self) -> dict[int, dict]:
        """The ranks that shut gpucomm down, as rank 0 told this rank (each with the collectives of each fixed
        schedule it launched)."""
        plane = getattr(self, "plane", None)  # (not yet made while the job is being built)
        return plane.departed if isinstance(plane, Controller) else {}

    def _report_data_failure(self, text: str) -> None:
        """The data plane found the job broken (the NCCL watchdog): tell every rank."""
        controller = self.controller
        if controller is not None:
            controller.report_failure(text)

    def select_device(self) -> bool:
        """Make this rank's GPU current in the calling thread; False where it is not known (yet: a rank
        with none pinned adopts one later, ``check_gpu``). Every thread of gpucomm that touches CUDA
        calls this first; one that lives on asks again until it is True."""
        ordinal = self._gpu_of_rank()
        if ordinal is None:
            return False
        devices.select_device(ordinal)
        return True

    def check_gpu(self, device: torch.device, what: Callable[[], str]) -> None:
        """Raise ``ValueError`` when ``device`` is a GPU other than this rank's: the job's NCCL
        communicators live on this rank's GPU, and NCCL refuses memory of another one ("invalid
        argument", on a background thread, after the other ranks have started). ``what()`` names the
        op or parameter. Where this rank's GPU is not known yet (none pinned, none current when the job
        was built), the first GPU handed in (a tensor of the first CUDA op, a parameter of the first
        optimizer) is taken as it: gpucomm's threads select it and its communicators are made there."""
        calls = cuda_calls.calls()
        if not calls.is_gpu(device):
            return
        index = calls.index(device)
        mine = self._gpu_index
        if mine is None:
            # nothing pinned or seen: the caller's tensor names it (a background thread's current device
            # would be GPU 0 on every rank)
            mine = self._gpu_index = self._adopt_gpu(index)
        if index == mine:
            return
        pinned = (f" (gpucomm pinned local rank {self.world.local_rank} to the GPU at PCI bus id "
                  f"{self.device.gpu.pci_bus_id} at hvd.init() and made it current there)" if self.device is not None
                  else "")
        raise ValueError(
            f"{what()}: its tensors are on cuda:{index}, but this rank's GPU is cuda:{mine}{pinned}. The job's NCCL "
            f"communicators live on that GPU, and NCCL cannot use memory of another one. Likely causes: the tensor "
            f"or the model was placed with an explicit device such as 'cuda:{index}', or torch.cuda.set_device() "
            f"was called with another index after hvd.init(). Fix: place it on this rank's GPU, e.g. "
            f"torch.cuda.set_device({mine}) and then .cuda(), or .to('cuda:{mine}').")

    # -- fixed schedules (DistributedOptimizer) --------------------------------------------------
    def new_schedule(self, set_id: int) -> Schedule:
        """A fixed schedule on the members of process set ``set_id``, on a group of its own. Every
        member calls this at the same point (an optimizer's construction), so the numbering, kept
        per set, agrees; the optimizer's cross-rank check verifies it. ``close_schedule`` ends it."""
        number = self._schedule_counters[set_id] = self._schedule_counters.get(set_id, 0) + 1
        base = self.group(set_id)
        where = f"{self.prefix}schedule/{set_id}/{number}/"
        group = Group(set_id, base.ranks, self.world.rank,
                      lambda g: SelfBackend() if g.size == 1 else self._new_cpu_backend(g, where),
                      lambda g: create_nccl(self.client, where + "nccl", g.rank, g.size,
                                            self._cuda_device().index, self.timeout))
        schedule = Schedule(group, self.data, number=number)
        self._schedules.append(schedule)
        return schedule

    def close_schedule(self, schedule: Schedule) -> None:
        """Release a schedule's communicators: its optimizer's explicit close, a collective point
        (never a finalizer: garbage collection runs at a different moment on every rank)."""
        if schedule in self._schedules:
            self._schedules.remove(schedule)
            self._closed_records.append(schedule.launches_record())  # still told at shutdown (a peer may lag)
            schedule.close()

    def add_join_party(self, party: Any) -> None:
        """``party.stand_in_until_all_joined()`` runs while this rank waits in ``hvd.join()``."""
        self._join_parties.add(party)

    def join_parties(self) -> list[Any]:
        return list(self._join_parties)

    # -- timeline (rank 0 writes it) -------------------------------------------------------------
    def _current_tracer(self) -> Tracer | None:
        return self.tracer

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Record a Horovod-format timeline to ``path`` (rank 0; other ranks ignore the call)."""
        if self.world.rank != 0:
            return
        self.stop_timeline()
        tracer = Tracer(path, mark_cycles=mark_cycles)
        self.tracer = tracer
        if self._coordinator is not None:
            self._coordinator.observer = tracer
        log.info("timeline: recording to %s", path)

    def stop_timeline(self) -> None:
        tracer, self.tracer = self.tracer, None
        if self._coordinator is not None:
            self._coordinator.observer = None
        if tracer is not None:
            tracer.close()

    # -- process sets ----------------------------------------------------------------------------
    def group(self, set_id: int) -> Group:
        group = self.groups.get(set_id)
        if group is None:
            raise ValueError(f"process set {set_id} is not registered on this rank (it was removed, or never added).")
        return group

    def _make_nccl(self, group: Group):
        """The NCCL backend of the whole job, created by the first CUDA collective (the same call on
        every rank, since every rank runs collectives in the same order)."""
        return create_nccl(self.client, f"{self.prefix}nccl/uid", self.world.rank, self.world.size,
                           self._cuda_device().index, self.timeout)

    def _group(self, set_id: int, ranks) -> Group:
        return Group(set_id, ranks, self.world.rank,
                     lambda g: SelfBackend() if g.size == 1 else self._new_cpu_backend(g, f"{self.prefix}ps{set_id}/"),
                     lambda g: create_nccl(self.client, f"{self.prefix}nccl/ps{set_id}/uid", g.rank, g.size,
                                           self._cuda_device().index, self.timeout))

    def _new_cpu_backend(self, group: Group, where: str) -> GlooBackend | MpiBackend:
        """A CPU communicator of its own for ``group`` on the job's transport, made by its members
        at the same point (its first collective, or an optimizer's construction); ``where`` is the
        same on every member and names it (store keys for Gloo, the communicator's tag for MPI)."""
        if isinstance(self.cpu, MpiBackend):
            return mpi_group(self.cpu, group.ranks, self.world.rank, label=where + "mpi")
        return gloo_group(self.client, where + "gloo/", group.rank, group.size, timeout=self.timeout,
                          device=self.gloo_device)

    def _on_done(self, kind: str, name: str, value: Any) -> None:
        """Responses that change process sets (applied in response order)."""
        if name.startswith("process_set.add.") and isinstance(value, tuple):
            set_id, ranks = value
            self.groups[set_id] = self.data.register(self._group(set_id, ranks))
        elif name.startswith("process_set.remove.") and isinstance(value, int):
            group = self.groups.pop(value, None)
            if group is not None:  # released by remove_process_set's caller, not here under the control lock
                self._removed.append(group)

    def release_removed_sets(self) -> None:
        """Release the communicators of removed process sets (``remove_process_set`` calls this on
        every rank once the removal is agreed: a collective point)."""
        removed, self._removed = self._removed, []
        for group in removed:
            self.data.release(group)

    def next_set_name(self, what: str) -> str:
        self._set_counter += 1
        return f"process_set.{what}.{self._set_counter}"

    # -- backends --------------------------------------------------------------------------------
    def _cuda_device(self) -> torch.device:
        """This rank's GPU: the pinned one, else (NVML saw none, yet CUDA works) the device that was
        current on the thread that built the job, or the GPU of the first CUDA tensor handed in
        (``check_gpu``, before any communicator is made); only failing both, the calling thread's."""
        ordinal = self._gpu_of_rank()
        if ordinal is None:
            ordinal = self._adopt_gpu(torch.cuda.current_device())
        return torch.device("cuda", ordinal)

    def _adopt_gpu(self, ordinal: int) -> int:
        """This rank's GPU: the one known already, else ``ordinal`` from now on (the first to ask wins,
        whichever thread it is on, so that every caller sees the same one)."""
        with self._gpu_lock:
            known = self._gpu_of_rank()
            if known is None:
                known = self._seen_gpu = ordinal
            return known

    def adopt_caller_gpu(self) -> None:
        """Where this rank's GPU is not known yet and the calling thread uses CUDA, take its current
        device as the rank's (call on the user's thread before work that goes to gpucomm's threads,
        whose own current device would be GPU 0)."""
        if self._gpu_of_rank() is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            self._adopt_gpu(torch.cuda.current_device())

    def _gpu_of_rank(self) -> int | None:
        """This rank's GPU where it is known without asking the calling thread: the pinned one, the one
        current on the thread that built the job, or the first one handed in (``check_gpu``); else None."""
        if self.device is not None:
            return self.device.cuda_ordinal
        return self._seen_gpu

    def _zeros_device(self) -> torch.device:
        return torch.device("cuda", self.join_device) if self.join_device >= 0 else self._cuda_device()

    def nccl(self):
        """The NCCL backend of the whole job (process set 0), created on first use."""
        return self.groups[0].nccl()

    # -- shutdown --------------------------------------------------------------------------------
    def close(self) -> None:
        """End the job: the control plane, every communicator, the store. Any thread may call it
        (``hvd.shutdown`` from Ray Train's actor thread, not the one that ran ``init``): it selects the
        rank's GPU first, so the CUDA work of closing (event queries and destroys) lands on that GPU."""
        try:
            self.select_device()
        except Exception as e:  # noqa: BLE001 - closing matters more than which device is current
            log.debug("selecting the GPU before closing the job: %s", e)
        controller = self.controller
        grace = FAILED_SHUTDOWN_GRACE if self.failure() is not None else SHUTDOWN_GRACE
        if grace == FAILED_SHUTDOWN_GRACE and self.world.rank == 0 and self.world.size > 1:
            log.warning("gpucomm: shutting down after a failure: waiting at most %g s for the other ranks to leave "
                        "(a stalled or dead rank will not)", grace)
        if controller is not None:
            controller.stop((*self._closed_records, *(s.launches_record() for s in self._schedules)))
            if self.world.rank == 0:
                controller.wait_workers_gone(grace)
        else:
            self.plane.close()
        failed = self.failure() is not None
        # every communicator: destroyed once its CUDA work finished, aborted if the job failed (a
        # stopped peer would hold a graceful close until Gloo's timeout, NCCL's forever)
        self.data.close(failed=failed)
        self._schedules.clear()
        self.cpu.close(abort=failed)
        release_results()
        try:
            # after a failure the store's host may be the one that failed: wait for it only as long as for the ranks
            self.client.add(f"{self.prefix}shutdown", 1, within=grace if failed else None)
            if self.server is not None:
                self._wait_for_others_to_leave(grace)
        except RendezvousError as e:
            log.debug("shutdown: store already gone: %s", e)
        if controller is not None:
            controller.close()
        self.stop_timeline()
        self.client.close()
        if self.server is not None:
            self.server.close()

    def _wait_for_others_to_leave(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.client.add(f"{self.prefix}shutdown", 0) >= self.world.size:
                return
            time.sleep(0.01)
        if grace == SHUTDOWN_GRACE:  # after a failure the missing ranks are expected: the failure was reported
            log.warning("gpucomm shutdown: not every rank shut down within %.0f s; closing the rendezvous store "
                        "anyway", grace)


__all__ = ["Job", "SHUTDOWN_GRACE"]
