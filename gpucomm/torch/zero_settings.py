"""What ``ZeroRedundancyOptimizer`` accepts: the optimizer classes it can shard (elementwise,
closure-free: ``ELEMENTWISE``, ``check_elementwise``, ``check_closure_free``) and the settings it
was given beyond ``DistributedOptimizer``'s arguments (``ZeroSettings``).

Why refuse up front: ZeRO shards parameters flat (a rank may step part of a tensor) and steps each
shard once per step after one reduction, so an optimizer that mixes elements or re-evaluates the
loss inside its step would silently train differently.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
               torch.optim.Rprop)


def check_closure_free(optimizer_class: type) -> None:
    """Refuse an optimizer class whose ``step`` needs a closure (LBFGS): it re-evaluates the loss
    and its gradients several times inside one step, and a shard's step cannot run the model's
    forward and backward, nor reduce the gradients again, for every rank in between."""
    try:
        closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"ZeroRedundancyOptimizer: {optimizer_class.__name__}.step needs a closure (it re-evaluates the loss "
            f"and its gradients inside one step), which a sharded step cannot give it: each rank steps only its "
            f"shard, after the gradients were reduced once. Use {optimizer_class.__name__} with "
            f"hvd.DistributedOptimizer, or a closure-free optimizer (SGD, Adam, AdamW, ...) with "
            f"ZeroRedundancyOptimizer. An optional closure (torch's step(closure=None)) is run before the step, "
            f"as torch's optimizers run it.")


def check_elementwise(optimizer_class: type, elementwise: bool | None) -> None:
    """Refuse an optimizer class whose step is not known to treat every element on its own (a flat
    shard would change its result), unless the caller says it does."""
    if elementwise or (elementwise is None and issubclass(optimizer_class, ELEMENTWISE)):
        return
    raise ValueError(
        f"ZeroRedundancyOptimizer: {optimizer_class.__name__} is not known to update each element of a parameter on "
        f"its own, and gpucomm's ZeRO shards parameters flat (a rank may step part of a tensor), which would change "
        f"the result of an optimizer that mixes elements (per-tensor norms, factored moments, line searches). Use an "
        f"elementwise optimizer ({', '.join(c.__name__ for c in ELEMENTWISE)}), pass elementwise=True if "
        f"{optimizer_class.__name__} is elementwise, or use hvd.DistributedOptimizer.")


@dataclass(frozen=True)
class ZeroSettings:
    """What ``ZeroRedundancyOptimizer`` was given beyond DistributedOptimizer's arguments."""

    optimizer_class: type
    defaults: dict
    overlap_with_forward: Any = None  # nn.Module: its forward waits for the parameter allgathers, else step() does


__all__ = ["ELEMENTWISE", "ZeroSettings", "check_closure_free", "check_elementwise"]
