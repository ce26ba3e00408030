"""Large CPU result tensors, recycled once their caller has let go of them.

An out-of-place collective returns a new tensor. On the CPU a new tensor of a few MiB is fresh
memory: glibc maps every block of 32 MiB or more (and smaller ones once freed to the system) with
``mmap`` and unmaps it at ``free``, so the collective's first write into it takes a page fault per
4 KiB page, each a kernel entry that also zeroes the page. For 32 MiB that is 8,192 faults, about
11 ms here: more than a whole copy of the data, and a pass over memory that the transport itself
does not need (``torch.distributed`` callers pass buffers they reuse). ``ResultBuffers`` keeps
the storage of the large results it handed out and gives one back out again once nothing but the
pool refers to it (the caller dropped the tensor and every view of it), so a loop of out-of-place
collectives reuses warm memory, as torch's caching allocator does on GPUs.

Only CPU results of at least ``MIN_BYTES`` go through the pool; at most ``MAX_KEPT`` storages of at
most ``MAX_KEPT_BYTES`` in all are kept (a result too large for that is allocated plainly). Where
torch does not expose a storage's reference count, every result is allocated plainly.
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

import torch

MIN_BYTES = 1 << 20  # smaller results are cheap to allocate (malloc's heap, no fresh mapping)
MAX_KEPT = 4  # storages kept for reuse
MAX_KEPT_BYTES = 256 << 20  # ... and their total size

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # references to a StorageImpl (torch >= 1.13)


class ResultBuffers:
    """A pool of CPU result storages; ``empty`` is ``torch.empty`` on reused memory when it can be."""

    def __init__(self, *, min_bytes: int = MIN_BYTES, max_kept: int = MAX_KEPT,
                 max_kept_bytes: int = MAX_KEPT_BYTES) -> None:
        self._min, self._max_kept, self._max_bytes = min_bytes, max_kept, max_kept_bytes
        self._kept: list[torch.UntypedStorage] = []  # least recently handed out first
        self._lock = threading.Lock()

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor of ``shape`` and ``dtype`` that nothing else refers to."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self._min or _use_count is None:
            return torch.empty(shape, dtype=dtype)
        storage = self._take(nbytes)
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))

    def _take(self, nbytes: int) -> torch.UntypedStorage:
        """A kept storage of ``nbytes`` to ``2 * nbytes`` bytes that only the pool refers to, else a
        new one (kept when the limits allow)."""
        with self._lock:
            for i, storage in enumerate(self._kept):
                if nbytes <= storage.nbytes() <= 2 * nbytes and _use_count(storage._cdata) == 1:
                    self._kept.append(self._kept.pop(i))
                    return storage
            storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
            if nbytes <= self._max_bytes:
                self._kept.append(storage)
                while len(self._kept) > self._max_kept or sum(s.nbytes() for s in self._kept) > self._max_bytes:
                    self._kept.pop(0)  # the pool lets go; a caller still holding it keeps it alive
            return storage

    def kept_bytes(self) -> int:
        """Bytes of the storages the pool holds (in use by callers or free)."""
        with self._lock:
            return sum(s.nbytes() for s in self._kept)

    def clear(self) -> None:
        """Let go of every kept storage (callers keep theirs)."""
        with self._lock:
            self._kept.clear()


__all__ = ["MAX_KEPT", "MAX_KEPT_BYTES", "MIN_BYTES", "ResultBuffers"]
