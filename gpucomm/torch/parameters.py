"""What every DistributedOptimizer of gpucomm's checks and says alike (the bucketed one, Adasum's
delta optimizer, the one on a rank outside its process set): Horovod's guard messages, the
parameter names, the cross-rank comparison of parameter lists, and the shared step logic."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch

TWICE_ERROR = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
               "Increase backward_passes_per_step to accumulate gradients locally.")
ZERO_GRAD_ERROR = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                   "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
STEP_AFTER_SYNC_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                           "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                           "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                           "your code.")


def describe_param(entry) -> str:
    if entry is None:
        return "missing"
    name, shape, dtype, requires_grad = entry
    return f"{name!r} {shape} {dtype}" + ("" if requires_grad else " (frozen)")


def check_passes(passes: int) -> None:
    if not isinstance(passes, int) or passes <= 0:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {passes!r}.")


def parameter_names(named_parameters, params_in_order: list[torch.Tensor]) -> dict[torch.Tensor, str]:
    """Map each optimizer parameter to its name, validating ``named_parameters`` as Horovod does."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params_in_order)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                         "model.named_parameters().")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    by_id = {id(p): n for n, p in named}
    unnamed = [p for p in params_in_order if id(p) not in by_id]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         f"Python object ids: {', '.join(str(id(p)) for p in unnamed)}. Pass "
                         f"model.named_parameters() of the model whose parameters the optimizer holds.")
    return {p: by_id[id(p)] for p in params_in_order}


def check_same_parameters(reference: list, theirs: list, rank: int, who: str = "DistributedOptimizer") -> None:
    """Raise on every rank when ``rank``'s parameter list differs from rank 0's, naming the first
    difference (``who``: the optimizer the user built, named in the error)."""
    if theirs == reference:
        return
    for i in range(max(len(theirs), len(reference))):
        a = reference[i] if i < len(reference) else None
        b = theirs[i] if i < len(theirs) else None
        if a != b:
            raise ValueError(
                f"{who}: ranks disagree on the parameters to average. Parameter #{i} is "
                f"{describe_param(a)} on rank 0 but {describe_param(b)} on rank {rank} (name, shape, "
                f"dtype, requires_grad). Every rank must build the same model and pass its parameters in "
                f"the same order; otherwise ranks would average unrelated tensors or wait for each other "
                f"forever. Likely causes: rank-dependent model construction, a different model config or "
                f"checkpoint on some ranks, or parameters frozen on only some ranks.")


class SharedSteps:
    """Horovod's ``skip_synchronize``, ``set_backward_passes_per_step`` and ``step``, as every
    distributed optimizer class of gpucomm has them (its ``synchronize`` does the rest). Mixed into
    the dynamic optimizer classes through their namespaces."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Average every ``passes`` backward passes (gradients accumulate locally in between)."""
        check_passes(passes)
        by_order = getattr(self, "_by_order", False)  # (DistributedOptimizer hooked by arrival order)
        if getattr(self, "_step_opened", False) or (by_order and self._gradients_came()):
            raise ValueError(
                f"set_backward_passes_per_step({passes}) was called after this step's gradients were handed over "
                f"for averaging (backward() ran its last pass of the step): the count would start again for "
                f"gradients already sent, and the next backward's would be dropped. Call it before backward() or "
                f"after optimizer.step() (or synchronize()).")
        if by_order and passes != 1:  # hooks by arrival order count one pass: every gradient's own hook again
            self._hook_every_gradient()
        self._passes = passes
        self._delay = dict.fromkeys(self._delay, passes)

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(STEP_AFTER_SYNC_WARNING)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)


def shared_steps() -> dict:
    """``SharedSteps``' methods, for a dynamic class's namespace."""
    return {k: v for k, v in SharedSteps.__dict__.items() if not k.startswith("__")}


__all__ = ["STEP_AFTER_SYNC_WARNING", "SharedSteps", "TWICE_ERROR", "ZERO_GRAD_ERROR", "check_passes",
           "check_same_parameters", "describe_param", "parameter_names", "shared_steps"]
