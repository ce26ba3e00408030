"""Grow-only fusion buffers: the flat buffers a bucket is packed into, kept across steps so that a
steady training loop allocates nothing."""

from __future__ import annotations

import threading

import torch

__all__ = ["FusionBuffers"]


class FusionBuffers:
    """Grow-only flat buffers, one per (device, dtype, slot).

    ``get`` returns the first ``numel`` elements of the slot's buffer, reallocating only when a
    larger size is asked for, so a steady training loop allocates nothing. Buffers of one slot
    are reused by every bucket that asks for it: that is safe when those uses are ordered (one
    communication stream on a GPU); buckets in flight at the same time (e.g. asynchronous Gloo
    work on the CPU) need distinct slots. A buffer replaced by a larger one is freed by torch's
    caching allocator in the order of the stream it was allocated on.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device | str, dtype: torch.dtype, numel: int, *, slot: int = 0) -> torch.Tensor:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if numel < 0:
            raise ValueError(f"FusionBuffers.get: numel must be >= 0, got {numel}")
        key = (device, dtype, slot)
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < numel:
                buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
            return buffer[:numel]

    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()
