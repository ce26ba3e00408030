"""A registered process set as the data plane sees it: its members in order, this rank's index in
it, and its backends, built on first use (the CPU backend: a Gloo group on the rendezvous store or an
MPI communicator; an NCCL
communicator from a unique id the set's first member publishes). Every member reaches the first
use of a set in the same collective, so lazy construction is safe.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from ..errors import CollectiveError


class Group:
    """One registered set as the data plane sees it."""

    def __init__(self, set_id: int, ranks: Sequence[int], my_rank: int, make_cpu: Callable[["Group"], Any],
                 make_nccl: Callable[["Group"], Any]) -> None:
        self.id, self.ranks = set_id, tuple(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(my_rank) if my_rank in self.ranks else -1
        self._make_cpu, self._make_nccl = make_cpu, make_nccl
        self._cpu = self._nccl = None
        self._closed = False
        self._lock = threading.Lock()

    def index_of(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

    def cpu_backend(self):
        """The set's backend for CPU tensors (Gloo or MPI, as the job's transport), created on first use."""
        with self._lock:
            if self._cpu is None:
                self._check_open()
                self._cpu = self._make_cpu(self)
            return self._cpu

    def nccl(self):
        """The set's NCCL backend for CUDA tensors, created on first use."""
        with self._lock:
            if self._nccl is None:
                self._check_open()
                self._nccl = self._make_nccl(self)
            return self._nccl

    def _check_open(self) -> None:
        if self._closed:  # a new backend under the same store keys would pair with nothing
            raise CollectiveError(f"process set {self.id}'s communicators were released (the set was removed, its "
                                  f"optimizer closed, or gpucomm shut down); it takes no more collectives.")

    def nccl_if_created(self):
        """The NCCL backend if a collective has created it (the watchdog must not create one)."""
        return self._nccl

    def abort_nccl(self) -> None:
        """The job failed: abort the NCCL communicator now (kernels waiting for a dead peer end);
        it is never destroyed after that. Takes no lock: a thread may hold ``_lock`` while it
        creates the communicator, and an abort must not wait for that."""
        nccl = self._nccl
        if nccl is not None:
            nccl.abort()

    def close(self, *, abort: bool = False) -> None:
        """Release the backends: destroyed at a collective point of a healthy job, aborted once it
        has failed (``abort``: do not wait for transfers in flight)."""
        with self._lock:
            if self._nccl is not None:
                self._nccl.close(abort=abort)
            if self._cpu is not None:
                self._cpu.close(abort=abort)
            self._cpu = self._nccl = None
            self._closed = True


__all__ = ["Group"]
