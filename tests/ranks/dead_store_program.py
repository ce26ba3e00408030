"""A rank of a job launched by hand (rank 0 serves the rendezvous store) for tests/test_dead_store.py:
it trains a few steps; rank 0 SIGKILLs itself in the middle of training. The survivors must end
with the cause, not keep retrying the dead store. Each rank prints ``KILLED_AT``/``EXIT_AT`` lines
(wall clock) so the test can print how long they took (never asserted on)."""

from __future__ import annotations

import atexit
import sys
import time

atexit.register(lambda: print(f"EXIT_AT {time.time():.3f}", file=sys.stderr, flush=True))  # runs after gpucomm's

from tests.ranks.killed_training import train_until_killed  # noqa: E402


def main() -> None:
    train_until_killed(victim=0, kill_step=5)


if __name__ == "__main__":
    main()
