"""Whether a gradient-hook backward of this process is in flight, for the threads that wait meanwhile.

While a DistributedOptimizer's backward runs, autograd calls gpucomm's gradient hooks on its own
threads (one per device; a CPU backward runs on the calling thread). A thread that busy-polls in
Python (the control plane's spin before it sleeps in ``select``) takes the GIL back after every
poll and so delays those hooks, and with them the launch of every bucket. Waiters read
``backward_running()`` and sleep instead of spinning while it is true.

The reducer calls ``backward_started()`` at a step's first gradient hook and ``backward_ended()``
from autograd's final callback. One process-wide count, so that several optimizers, or backwards
on several threads, overlap correctly; it never goes below zero, so an end without a start (after
``reset_backward()``, or a callback that ran twice) cannot hide the next backward.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
# backwards started and not yet ended, as its one element: a spin loop keeps a reference and reads
# ``BACKWARDS[0]`` on every poll, with no function call and no lock (a stale read costs one poll)
BACKWARDS: list[int] = [0]


def backward_started() -> None:
    """A gradient-hook backward began (its first hook ran): waiters stop spinning until it ends."""
    with _lock:
        BACKWARDS[0] += 1


def backward_ended() -> None:
    """A backward counted by ``backward_started()`` ended (autograd's final callback ran); an
    end without a start is ignored (the count never goes below zero)."""
    with _lock:
        BACKWARDS[0] = max(0, BACKWARDS[0] - 1)


def backward_running() -> bool:
    """True while any gradient-hook backward of this process is in flight (a loop that asks on
    every iteration reads ``BACKWARDS[0]`` instead)."""
    return BACKWARDS[0] > 0


def reset_backward() -> None:
    """Forget every backward in flight: for a step abandoned without autograd's final callback
    (backward raised after its first hook), whose count would otherwise keep waiters from
    spinning for the rest of the process, and for tests."""
    with _lock:
        BACKWARDS[0] = 0


__all__ = ["BACKWARDS", "backward_ended", "backward_running", "backward_started", "reset_backward"]
