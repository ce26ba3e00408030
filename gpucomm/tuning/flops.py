"""An analytic ``Profile`` from a model's architecture, for devices we do not have.

The model runs forward once on PyTorch's ``meta`` device (shapes only, no data, no time), with a
hook on every leaf module recording the order it ran in, its floating-point work and the bytes it
moves. Each module's time is a roofline, ``max(flops / flops_per_s, bytes / bytes_per_s)``:
convolutions and linear layers cost ``2 x MACs`` forward and twice that backward (input and
weight gradients; the first layer computes no input gradient), the other layers (BatchNorm, ReLU,
pooling) move their input and output once forward and twice backward. Backward visits the modules
in reverse forward order, and a module's parameters are ready once its backward is done. Only the
ratio ``flops_per_s / bytes_per_s`` shapes the profile: ``scaled`` then stretches it to a measured
or published single-device step time.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .profile import Profile

__all__ = ["analytic_profile", "layer_costs"]


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(v) for v in x)
    return 0


def _macs(module: torch.nn.Module, inputs, output) -> int:
    if isinstance(module, torch.nn.Conv2d):
        k = module.kernel_size[0] * module.kernel_size[1] * (module.in_channels // module.groups)
        return output.numel() * k
    if isinstance(module, torch.nn.Linear):
        return output.numel() * module.in_features
    return 0


def layer_costs(model: torch.nn.Module, sample_shape: Sequence[int], batch_size: int) -> list[dict]:
    """Per leaf module in forward order: ``name``, forward ``flops`` and ``bytes`` (activations and
    weights), measured on the meta device."""
    records: list[dict] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(module, inputs, output) -> None:
        flops = 2 * _macs(module, inputs, output)
        weights = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        records.append({"name": names[module], "module": module, "flops": flops,
                        "bytes": _nbytes(inputs) + _nbytes(output) + weights})

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        meta = model.to("meta")
        meta.train()
        with torch.no_grad():
            meta(torch.empty(batch_size, *sample_shape, device="meta"))
    finally:
        for h in handles:
            h.remove()
    return records


def analytic_profile(model: torch.nn.Module, sample_shape: Sequence[int], batch_size: int, *, name: str,
                     flops_per_s: float, bytes_per_s: float, step_s: float | None = None,
                     update_bytes_per_param: int = 0) -> Profile:
    """The profile of one step of ``model`` (moved to the meta device: pass a copy you can spare)
    on a device with ``flops_per_s`` and ``bytes_per_s`` (module doc). ``step_s``: scale the whole
    step to it. ``update_bytes_per_param``: bytes the optimizer moves per parameter byte (e.g. 3 for
    plain SGD: read weight and gradient, write weight; 0 leaves the update out)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    owner = {id(p): n for n, p in named}
    records = layer_costs(model, sample_shape, batch_size)
    first_weighted = next((i for i, r in enumerate(records) if r["flops"]), None)
    fwd_total, ready = 0.0, {}
    bwd_times = []
    for i, r in enumerate(records):
        fwd = max(r["flops"] / flops_per_s, r["bytes"] / bytes_per_s)
        fwd_total += fwd
        grad_factor = 1 if i == first_weighted else 2
        bwd_times.append(max(grad_factor * r["flops"] / flops_per_s, 2 * r["bytes"] / bytes_per_s))
    t = 0.0
    for r, bt in zip(reversed(records), reversed(bwd_times)):
        t += bt
        for p in r["module"].parameters(recurse=False):
            if id(p) in owner:
                ready[owner[id(p)]] = t
    backward = t
    param_bytes = sum(p.numel() * p.element_size() for _, p in named)
    update = update_bytes_per_param * param_bytes / bytes_per_s
    prof = Profile(model=name, batch_size=batch_size, names=[n for n, _ in named],
                   sizes=[p.numel() * p.element_size() for _, p in named],
                   ready_s=[ready.get(n, backward) for n, _ in named], forward_s=fwd_total, backward_s=backward,
                   update_s=update, device=f"analytic: {flops_per_s / 1e12:.3g} TFLOP/s, {bytes_per_s / 1e9:.3g} GB/s",
                   source="analytic: roofline per layer on the meta device",
                   extra={"forward_flops": sum(r["flops"] for r in records)})
    return prof.scaled(step_s) if step_s is not None else prof
