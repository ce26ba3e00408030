"""Measure a model's ``Profile`` on one device: when each gradient is final in a real backward.

Every trainable parameter gets a post-accumulate-grad hook that stamps the time (``perf_counter``
on CPU; a CUDA event on the current stream on GPU, so the stamp is when the GPU got there, not when
the host queued it). A few steps run untimed first; each value of the profile is the median over
the timed steps.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from .profile import Profile

__all__ = ["profile_model", "batch_size_of"]


def batch_size_of(batch: Any) -> int:
    """The leading dimension of the batch's first tensor."""
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise ValueError(f"profile: the batch must be a tensor (or a tuple of tensors) with a batch dimension first, "
                         f"got {type(first).__name__}.")
    return int(first.shape[0])


class _Clock:
    """Host time on CPU, CUDA events on GPU; ``stamp()`` returns a token, ``seconds(a, b)`` the gap."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def stamp(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def profile_model(model: torch.nn.Module, batch: Any, loss_fn: Callable[[Any], torch.Tensor], *, steps: int = 5,
                  warmup: int = 2, optimizer: torch.optim.Optimizer | None = None, name: str = "model") -> Profile:
    """Train ``model`` on ``batch`` for ``warmup + steps`` steps and return the median profile.

    ``model(batch)`` (``model(*batch)`` for a tuple) gives the output, ``loss_fn(output)`` the scalar
    loss; the optimizer defaults to SGD with momentum. The model and batch must already be on the
    device to profile."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"profile_model: steps={steps} must be >= 1 and warmup={warmup} >= 0.")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"profile_model: {name} has no parameter that requires grad; there is nothing to allreduce.")
    device = named[0][1].device
    clock = _Clock(device)
    opt = optimizer or torch.optim.SGD([p for _, p in named], lr=1e-3, momentum=0.9)
    index = {p: i for i, (_, p) in enumerate(named)}
    stamps: dict[int, Any] = {}

    def hook(p: torch.Tensor) -> None:
        stamps.setdefault(index[p], clock.stamp())

    hooks = [p.register_post_accumulate_grad_hook(hook) for _, p in named]
    runs: list[tuple[float, float, float, list[float | None]]] = []
    try:
        for step in range(warmup + steps):
            opt.zero_grad(set_to_none=True)
            stamps.clear()
            clock.settle()
            t0 = clock.stamp()
            out = model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
            loss = loss_fn(out)
            t1 = clock.stamp()
            loss.backward()
            t2 = clock.stamp()
            opt.step()
            t3 = clock.stamp()
            clock.settle()
            if step >= warmup:
                ready = [clock.seconds(t1, stamps[i]) if i in stamps else None for i in range(len(named))]
                runs.append((clock.seconds(t0, t1), clock.seconds(t1, t2), clock.seconds(t2, t3), ready))
    finally:
        for h in hooks:
            h.remove()
    backward = statistics.median(r[1] for r in runs)
    ready_s = []
    for i in range(len(named)):
        seen = [r[3][i] for r in runs if r[3][i] is not None]
        ready_s.append(min(statistics.median(seen), backward) if seen else backward)
    return Profile(model=name, batch_size=batch_size_of(batch), names=[n for n, _ in named],
                   sizes=[p.numel() * p.element_size() for _, p in named], ready_s=ready_s,
                   forward_s=statistics.median(r[0] for r in runs), backward_s=backward,
                   update_s=statistics.median(r[2] for r in runs), device=_describe(device),
                   source=f"measured: median of {steps} steps after {warmup} warm-up",
                   extra={"threads": torch.get_num_threads(), "torch": torch.__version__,
                          "step_s": [r[0] + r[1] + r[2] for r in runs]})  # each timed step, in order


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {torch.get_num_threads()} threads"
