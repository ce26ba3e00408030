"""``ElasticSampler``: one epoch's sample order, sharded over the ranks, re-sharded when they change.

Progress is one number, ``processed_num``: how many samples of this epoch's order the job as a
whole has finished. Shards are strided (rank r takes the r-th, (r+size)-th, ... of the remaining
samples), so after k full batches on every rank the processed samples are exactly the first
k·batch·size of the remaining order, whatever the size was. A re-partition therefore needs only the
epoch and that count: the rest of the order is dealt out again among the current ranks.

Unlike Horovod's, this sampler never pads: Horovod repeats up to size-1 samples so that every shard
has the same length; here no sample is repeated or dropped within an epoch, and shard lengths
differ by one at most. When the epoch's last round has fewer samples than there are ranks, some
ranks get one batch fewer: end the epoch's loop with ``hvd.join()`` (Horovod's answer to uneven
data), or choose a dataset length and batch size for which that round is full.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sized

import torch.utils.data

from ..submission import current_job, job_initialized


def _rank_and_size() -> tuple[int, int]:
    """(rank, size) of the current job; (0, 1) when gpucomm is not initialized (one process, as
    ``init()`` without a launcher would make it). Read at every re-partition."""
    if not job_initialized():
        return 0, 1
    world = current_job().world
    return world.rank, world.size


class ElasticSampler(torch.utils.data.Sampler):
    """Shards ``dataset``'s indices over the ranks and re-shards the unprocessed rest of the epoch
    when the job is re-formed (Horovod's ``hvd.elastic.ElasticSampler``).

    Use it as Horovod documents: track it in a ``TorchState``, call ``record_batch`` after each
    batch, and ``set_epoch`` at the end of each epoch (not the start: a restarted epoch must not
    forget what it processed). ``seed`` must be the same on every rank."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.rank = 0
        self.num_replicas = 1
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []  # this rank's shard of remaining_indices
        self._order_key: tuple | None = None
        self._order: list[int] = []
        self.reset()

    @property
    def num_samples(self) -> int:
        """Samples in this rank's shard."""
        return len(self.indices)

    @property
    def total_size(self) -> int:
        """Samples left in the epoch, over every rank (no padding)."""
        return len(self.remaining_indices)

    @property
    def processed_indices(self) -> set[int]:
        """The dataset indices the job has finished this epoch."""
        return set(self._epoch_order()[: self.processed_num])

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: a new order (when shuffling), nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every rank finished a batch of ``batch_size`` samples (call it on every rank alike; the
        iteration under way is not changed, the next re-partition starts after these samples)."""
        del batch_idx  # progress is a count; kept for Horovod's signature
        self.processed_num = min(self.processed_num + batch_size * self.num_replicas, len(self.dataset))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take over ``state_dict``'s epoch and progress and re-partition the rest for this job."""
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Re-partition the samples not yet processed this epoch among the current job's ranks."""
        self.rank, self.num_replicas = _rank_and_size()
        self.remaining_indices = self._epoch_order()[self.processed_num :]
        self.indices = self.remaining_indices[self.rank :: self.num_replicas]

    def _epoch_order(self) -> list[int]:
        # The same order as Horovod's for a given seed and epoch; kept until the epoch changes, so
        # a re-partition within an epoch does not shuffle again.
        key = (len(self.dataset), self.shuffle, self.seed, self.epoch)
        if key != self._order_key:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed + self.epoch).shuffle(order)
            self._order_key, self._order = key, order
        return self._order

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
