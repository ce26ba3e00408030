"""ZeRO's parameter allgathers in flight, and the forward hooks that overlap them with the next
forward (``ZeroRedundancyOptimizer(overlap_with_forward=model)``).

``step()`` launches each bucket's allgather of the updated parameters, first layers first. With
``overlap_with_forward``, they are left in flight and each module's forward (or the model's
``state_dict()``) waits only for the buckets that hold its parameters; code that reads the
parameters elsewhere first calls ``wait_parameters()``. Without it, ``step()`` waits for them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class ForwardOverlap:
    """Waiting for the parameter allgathers, and the model's hooks that wait, merged over
    ``DistributedOptimizer``'s methods (``zero_steps.sharded_steps``: ``self`` is the optimizer)."""

    def wait_parameters(self) -> None:
        """Write every parameter the last ``step()`` gathered (with ``overlap_with_forward``, before
        reading parameters outside the model's forward and ``state_dict()``)."""
        self._wait_parameters()

    def _wait_parameters(self, upto: int | None = None) -> None:
        """Write the gathered parameters of the allgathers in flight (those launched up to position
        ``upto``, or all) into the parameters."""
        count = len(self._gathers) if upto is None else min(upto + 1, len(self._gathers))
        for handle, bucket in self._gathers[:count]:
            outs, _ = handle.wait()
            bucket.write_parameters(outs[0])
        self._gathers = self._gathers[count:]

    def _hook_model(self, model: torch.nn.Module) -> None:
        """Each module's forward (and the model's ``state_dict()``) waits for the allgathers holding its
        parameters."""
        me = weakref.ref(self)

        def before_forward(module: torch.nn.Module, _inputs: Any) -> None:
            opt = me()
            if opt is None or not opt._gathers:
                return
            mine = set(module.parameters(recurse=False))
            last = max((k for k, (_, b) in enumerate(opt._gathers) if mine.intersection(b.params)), default=-1)
            if last >= 0:
                opt._wait_parameters(last)

        def before_state_dict(*_args: Any, **_kwargs: Any) -> None:
            opt = me()
            if opt is not None:
                opt._wait_parameters()

        for module in model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(before_forward)
        model.register_state_dict_pre_hook(before_state_dict)

    def _settle_parameters(self) -> None:
        """(``zero_grad``, ``close``) The parameters gathered by the last step are written."""
        self._wait_parameters()


__all__ = ["ForwardOverlap"]
