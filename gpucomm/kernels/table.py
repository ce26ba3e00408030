"""Chunk tables: the per-layout device arrays that drive the pack kernel, built once and cached.

A table has one int64 row ``(src address, dst address, element count)`` per piece of at most
``CHUNK_ELEMS`` elements (see ``specs.py`` for why pieces). It depends only on the addresses, the
element counts and the two element sizes, so the cache key is exactly that: direction, element
sizes, the flat buffer's address and the tensors' ``data_ptr()`` and ``numel()`` tuples. When a
gradient is reallocated (``zero_grad(set_to_none=True)``), its address changes, the key misses
and a fresh table is built; the old one ages out of a small LRU.

On CUDA the rows go host -> pinned -> device with a non-blocking copy on the launch stream, so
building a table never synchronises the host. A bucket whose gradients moved (``BoundCopy``) writes
its new rows over its table in place when every launch that read it was on the same stream
(``Table.rewrite``): stream order puts the upload after those launches and before the next one. A
table first used on another stream makes that stream wait for the upload and is ``record_stream``-ed
there, so the caching allocator cannot hand its memory out while a kernel may still read it. In the
simulator the NumPy rows are the "device" array: kernels read them through their host address.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Hashable

import numpy as np
import torch

from .devicefns import SIMULATOR

__all__ = ["CHUNK_ELEMS", "RowPlan", "Staging", "Table", "TableCache", "chunk_rows"]

# Elements per piece. 1024 gives a 25 MiB float32 bucket ~6k rows, i.e. ~6k warps each with eight
# 128-byte loads in flight: enough to saturate HBM3/HBM3e (see specs.py). Halving it doubles the
# table for little gain; doubling it starves buckets of a few MiB. The simulator uses small pieces
# (300 = one 8-wide step of 256 plus a 44-element tail) so that the small tensors it can afford to
# run still exercise the splitting, the unrolled loop and the tail loop.
CHUNK_ELEMS = 300 if SIMULATOR else 1024


def chunk_rows(src_addrs: np.ndarray, dst_addrs: np.ndarray, numels: np.ndarray,
               src_itemsize: int, dst_itemsize: int, chunk: int) -> np.ndarray:
    """Rows ``(src address, dst address, count)`` splitting each tensor into ``chunk``-element pieces.

    Zero-length tensors get no row. All arrays are int64 (user-space addresses are below 2**63).
    """
    return RowPlan(numels, chunk).rows(src_addrs, dst_addrs, src_itemsize, dst_itemsize)


class RowPlan:
    """The address-free part of a table, fixed by the tensors' element counts: each row's tensor, its
    first element within that tensor and its element count. Rows for any addresses are then a few
    vectorized additions, so a bucket whose gradients were reallocated (``zero_grad(set_to_none=True)``)
    gets its new table without the checks and splitting a new layout pays."""

    __slots__ = ("tensor", "start", "count", "numels")

    def __init__(self, numels: np.ndarray, chunk: int) -> None:
        numels = np.asarray(numels, dtype=np.int64)
        pieces = -(-numels // chunk)  # ceil; 0 for empty tensors
        nrows = int(pieces.sum())
        self.numels = tuple(int(n) for n in numels)
        self.tensor = np.repeat(np.arange(len(numels)), pieces)
        first_row = np.cumsum(pieces) - pieces
        self.start = (np.arange(nrows, dtype=np.int64) - first_row[self.tensor]) * chunk
        self.count = np.minimum(chunk, numels[self.tensor] - self.start) if nrows else np.empty(0, dtype=np.int64)

    def rows(self, src_addrs: np.ndarray, dst_addrs: np.ndarray, src_itemsize: int, dst_itemsize: int) -> np.ndarray:
        rows = np.empty((len(self.tensor), 3), dtype=np.int64)
        if len(self.tensor):
            rows[:, 0] = src_addrs[self.tensor] + self.start * src_itemsize
            rows[:, 1] = dst_addrs[self.tensor] + self.start * dst_itemsize
            rows[:, 2] = self.count
        return rows

    def rebase(self, rows: np.ndarray, column: int, addrs: np.ndarray, itemsize: int) -> np.ndarray:
        """A copy of ``rows`` whose ``column`` (0: sources, 1: destinations) points into tensors at ``addrs``."""
        return self.repoint(rows.copy(), column, addrs, itemsize)

    def repoint(self, rows: np.ndarray, column: int, addrs: np.ndarray, itemsize: int) -> np.ndarray:
        """``rows`` itself, its ``column`` now pointing into tensors at ``addrs``."""
        if len(self.tensor):
            np.add(addrs[self.tensor], self.start * itemsize, out=rows[:, column])
        return rows


class Staging:
    """A small ring of pinned host buffers for uploading one bucket's tables. A slot is reused only once
    the upload that last read it has finished (normally long before: a step later), so writing a new
    table never races a pending copy, and no table pays for allocating pinned memory."""

    __slots__ = ("_slots", "_next")

    def __init__(self, shape: tuple[int, int], slots: int = 3) -> None:
        self._slots = [[torch.empty(shape, dtype=torch.int64).pin_memory(), None] for _ in range(slots)]
        self._next = 0

    def take(self) -> list:
        """The next slot ``[pinned tensor, upload event or None]``, its last upload finished."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot[1] is not None:
            slot[1].synchronize()  # done long ago in steady state: returns at once
        return slot


class Table:
    """One layout's rows, resident where the kernel reads them, plus the launch grid."""

    __slots__ = ("rows", "nrows", "address", "grid", "_device_rows", "_pinned", "_ready", "_streams")

    def __init__(self, rows: np.ndarray, grid: int, device: torch.device, stream: Any,
                 staging: Staging | None = None) -> None:
        self.rows = rows
        self.nrows = len(rows)
        self.grid = grid
        self._device_rows = self._pinned = self._ready = None
        self._streams: set[int] = set()
        if SIMULATOR or device.type != "cuda":
            self.address = rows.ctypes.data
            return
        slot = staging.take() if staging is not None else None
        if slot is None:
            self._pinned = torch.from_numpy(rows).pin_memory()  # kept: the copy below reads it later
        else:
            self._pinned = slot[0]
            self._pinned.numpy()[...] = rows
        with torch.cuda.stream(stream):  # allocate and upload in the launch stream's order
            self._device_rows = torch.empty(rows.shape, dtype=torch.int64, device=device)
            self._device_rows.copy_(self._pinned, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(stream)
        if slot is not None:
            slot[1] = self._ready
            self._pinned = None  # the ring owns it; the event says when it may be written again
        self._streams.add(stream.cuda_stream)
        self.address = self._device_rows.data_ptr()

    def rewritable(self, stream: Any) -> bool:
        """Whether new rows may go over this table in place, on ``stream``: in the simulator and on the CPU
        (the kernel reads ``rows`` itself, and runs before the call returns), or on a GPU when every
        launch that read the table was queued on ``stream`` (then an upload queued there comes after
        them all, and the launches after it read the new rows)."""
        if self._device_rows is None:
            return True
        return stream is not None and self._streams == {stream.cuda_stream}

    def rewrite(self, stream: Any, staging: Staging, current: bool = False) -> None:
        """Upload ``rows`` (changed in place by the caller) over the table where the kernel reads it, in
        ``stream``'s order, through the bucket's pinned ring (``rewritable`` must hold): no allocation and
        no new launch; the host waits only when it runs more than the ring's three uploads ahead of the
        GPU (``Staging.take``). Each upload records an event of its own: a slot's event is never shared, so
        waiting on a table's ``_ready`` always means that table's last upload is done. ``current``:
        ``stream`` is the current stream of the table's device, where the copy goes without a context."""
        if self._device_rows is None:
            return
        slot = staging.take()
        slot[0].numpy()[...] = self.rows
        with contextlib.nullcontext() if current else torch.cuda.stream(stream):
            self._device_rows.copy_(slot[0], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        slot[1] = self._ready = ready  # the slot is written again once this upload has read it

    def use_on(self, stream: Any, *companions: torch.Tensor) -> None:
        """Make ``stream`` safe to read this table, and the ``companions`` made on the upload's stream
        before it (a checked layout's flags and row map): wait for the upload, keep the memory alive."""
        if self._device_rows is None or stream.cuda_stream in self._streams:
            return
        stream.wait_event(self._ready)
        self._device_rows.record_stream(stream)
        for tensor in companions:
            tensor.record_stream(stream)
        self._streams.add(stream.cuda_stream)


class TableCache:
    """A thread-safe cache of layouts, evicting the least recently used beyond ``capacity``.

    A hit costs one dict lookup (hashing the key's address and size tuples) and stamps the entry
    with a counter; the O(capacity) search for the stalest entry happens only on insertion, so
    the hot path never pays for the LRU bookkeeping that ``OrderedDict.move_to_end`` would
    (a second hash of the key).
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._entries: dict[Hashable, list] = {}  # key -> [last use, value]
        self._clock = itertools.count()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> Any:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        entry[0] = next(self._clock)
        return entry[1]

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._entries[key] = [next(self._clock), value]
            while len(self._entries) > self.capacity:
                stalest = min(self._entries, key=lambda k: self._entries[k][0])
                del self._entries[stalest]

    def values(self) -> list:
        with self._lock:
            return [entry[1] for entry in self._entries.values()]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)
