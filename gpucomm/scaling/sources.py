"""Where a profile comes from: a built-in model or ``module:callable`` run on a device, a saved JSON,
or a built-in architecture's analytic profile scaled to a given step time."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from ..tuning.profile import Profile

__all__ = ["load_callable", "measured_profile", "analytic_profile_of"]


def load_callable(spec: str):
    """``module:callable`` (the module importable from the current directory too)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model {spec!r}: write a built-in name or module:callable (e.g. mymodels:build), "
                         "where callable() returns (model, batch, loss_fn).")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({e}); run from the folder that holds it "
                         "or put it on PYTHONPATH.") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--model {spec!r}: {module_name} has no callable {attr!r}.")
    return fn


def measured_profile(spec: str, *, batch_size: int, device: str, steps: int, warmup: int) -> Profile:
    """Run the model on ``device`` and profile it (``tuning.measure.profile_model``)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    from ..tuning.measure import profile_model  # noqa: PLC0415
    from . import zoo  # noqa: PLC0415

    dev = torch.device(device)
    if spec in zoo.MODELS:
        model, shape = zoo.build(spec)
        model = model.to(dev)
        x = torch.randn(batch_size, *shape, device=dev)
        y = torch.randint(0, 1000, (batch_size,), device=dev)
        batch: Any = x

        def loss_fn(out):
            return F.cross_entropy(out, y)
        name = spec
    else:
        made = load_callable(spec)()
        if not (isinstance(made, tuple) and len(made) == 3):
            raise ValueError(f"--model {spec!r}: the callable must return (model, batch, loss_fn), got "
                             f"{type(made).__name__}.")
        model, batch, loss_fn = made
        name = spec
    return profile_model(model, batch, loss_fn, steps=steps, warmup=warmup, name=name)


def analytic_profile_of(name: str, *, batch_size: int, step_s: float, flops_per_s: float,
                        bytes_per_s: float) -> Profile:
    """A built-in architecture's analytic profile (``tuning.flops``) scaled to ``step_s``."""
    import torch  # noqa: PLC0415

    from ..tuning.flops import analytic_profile  # noqa: PLC0415
    from . import zoo  # noqa: PLC0415

    if name not in zoo.MODELS:
        raise ValueError(f"--analytic needs a built-in model ({', '.join(zoo.MODELS)}), not {name!r}: a callable's "
                         "model is profiled by running it.")
    with torch.device("meta"):
        model, shape = zoo.build(name)
    return analytic_profile(model, shape, batch_size, name=name, flops_per_s=flops_per_s,
                            bytes_per_s=bytes_per_s, step_s=step_s)
