"""A distributed optimizer on a rank outside its ``process_set`` (``DistributedOptimizer`` and
``ZeroRedundancyOptimizer`` alike): as in Horovod it registers no hooks, ``synchronize()`` has
nothing to wait for and ``step()`` is the wrapped optimizer's local step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch

from .parameters import parameter_names


class OutsideProcessSet(torch.optim.Optimizer):
    """A ``DistributedOptimizer`` on a rank outside its ``process_set``: as in Horovod it registers no
    hooks, ``synchronize()`` has nothing to wait for and ``step()`` is the wrapped optimizer's local step."""

    def __init__(self, params: Any, named_parameters: Iterable | None, backward_passes_per_step: int) -> None:
        super(self.__class__, self).__init__(params)
        self._parameter_names = parameter_names(named_parameters, [p for g in self.param_groups for p in g["params"]])
        self._passes = backward_passes_per_step
        self._delay: dict = {}
        self._synchronized = False
        self._should_synchronize = True

    def synchronize(self) -> None:
        self._synchronized = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def close(self) -> None:
        """Nothing to release: a rank outside the process set holds no communicator."""


def outside_steps() -> dict:
    """``OutsideProcessSet``'s methods (its ``__init__`` too), for a dynamic class's namespace."""
    return {k: v for k, v in OutsideProcessSet.__dict__.items() if k != "__module__"}


__all__ = ["OutsideProcessSet", "outside_steps"]
