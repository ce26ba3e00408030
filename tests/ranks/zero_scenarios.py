"""Rank-side bodies of the ZeRO tests (``tests/test_zero.py``): ``hvd.ZeroRedundancyOptimizer``
against ``DistributedOptimizer`` with the same optimizer, on the same data, in the same job."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import gpucomm.torch as hvd

IN, HIDDEN, OUT, GLOBAL_BATCH = 7, 13, 3, 12  # odd sizes: shards of uneven sizes, parameters straddling ranks


def make_model(seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 5), nn.Tanh(),
                         nn.Linear(5, OUT)).to(device)


def groups(model: nn.Module) -> list[dict]:
    """Weights with weight decay, biases without (param groups interleave within every bucket)."""
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]


def names(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Named parameters in the optimizer's order (weights, then biases)."""
    named = list(model.named_parameters())
    return [x for x in named if x[0].endswith("weight")] + [x for x in named if x[0].endswith("bias")]


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def my_part(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[0] // hvd.size()
    return t[hvd.rank() * n:(hvd.rank() + 1) * n]


def values(model: nn.Module) -> torch.Tensor:
    """The parameters, read through ``state_dict()`` (with overlap_with_forward it waits for the gathers)."""
    return torch.cat([v.detach().reshape(-1).cpu() for v in model.state_dict().values()])


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, passes: int = 1) -> list[torch.Tensor]:
    """Each rank trains on its part of the global batch (equal parts: the average is the full-batch gradient)."""
    seen = []
    device = next(model.parameters()).device
    for s in steps:
        opt.zero_grad()
        for k in range(passes):
            x, y = (my_part(t).to(device) for t in global_batch(s * passes + k))
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        seen.append(values(model))
    return seen


def zero(net: nn.Module, **kw) -> torch.optim.Optimizer:
    return hvd.ZeroRedundancyOptimizer(groups(net), torch.optim.AdamW, named_parameters=names(net), lr=0.01, **kw)


def plain(net: nn.Module, **kw) -> torch.optim.Optimizer:
    return hvd.DistributedOptimizer(torch.optim.AdamW(groups(net), lr=0.01), named_parameters=names(net), **kw)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return float((values(a) - values(b)).abs().max())


def state_diff(a: dict, b: dict) -> float:
    assert sorted(a["state"]) == sorted(b["state"]), (sorted(a["state"]), sorted(b["state"]))
    worst = 0.0
    for i, entry in b["state"].items():
        assert sorted(a["state"][i]) == sorted(entry)
        for key, value in entry.items():
            assert a["state"][i][key].shape == value.shape, (i, key)
            worst = max(worst, float((a["state"][i][key].float().cpu() - value.float().cpu()).abs().max()))
    return worst


def equals_distributed_optimizer(device: str = "cpu") -> dict:
    """ZeRO-1 (with and without overlap_with_forward: the forward waits for the gathered parameters) against
    DistributedOptimizer + AdamW: parameters, full state, memory, a layer frozen midway (the shards are
    cut again, the state moved), accumulation, no control message in steady state, consolidation."""
    hvd.init()
    out = {"size": hvd.size()}
    device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    ref = make_model(device=device)
    dref = plain(ref)
    models = {"zero": make_model(device=device), "zero_model": make_model(device=device)}
    opts = {"zero": zero(models["zero"]), "zero_model": zero(models["zero_model"], overlap_with_forward=models["zero_model"])}
    train(ref, dref, range(2))
    for name in models:
        train(models[name], opts[name], range(2))
    before = hvd.stats()
    seen = {name: train(models[name], opts[name], range(2, 5)) for name in models}
    after = hvd.stats()
    out["control_rounds"] = after["control_rounds"] - before["control_rounds"]
    train(ref, dref, range(2, 5))
    out["params"] = {name: max_diff(models[name], ref) for name in models}
    everyone = hvd.allgather_object(seen["zero_model"], name="zero.seen")
    out["identical"] = all(torch.equal(x, y) for theirs in everyone for x, y in zip(everyone[0], theirs))
    full_bytes = sum(v.numel() * v.element_size() for s in dref.state_dict()["state"].values() for v in s.values()
                     if torch.is_tensor(v) and v.dim() > 0)
    mine = sum(v.numel() * v.element_size() for s in opts["zero"].optim.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)
    out["state_bytes"] = (mine, full_bytes)
    full = opts["zero"].state_dict()  # gathered on every rank
    out["state"] = state_diff(full, dref.state_dict())
    local = torch.optim.AdamW(groups(make_model()), lr=0.5)  # the full state loads into the plain class
    local.load_state_dict(full)
    out["loads_into_plain"] = local.param_groups[0]["lr"] == 0.01 and len(local.state) == len(full["state"])
    # a layer frozen on every rank: a new layout, new shards, the state moved over
    for m in (ref, *models.values()):
        m[2].weight.requires_grad_(False)
    for name in models:
        train(models[name], opts[name], range(5, 8))
    train(ref, dref, range(5, 8))
    out["after_freeze"] = {name: max_diff(models[name], ref) for name in models}
    # torch's consolidation: rank 0 gets the state, the others are told where it went
    opts["zero"].consolidate_state_dict(to=0)
    try:
        consolidated = opts["zero"].state_dict()
        out["consolidated"] = state_diff(consolidated, dref.state_dict())
    except RuntimeError as e:
        out["consolidated"] = "to rank 0" in str(e) and "not to this rank" in str(e)
    # accumulation over two passes
    a, b = make_model(4, device), make_model(4, device)
    za, db = zero(a, backward_passes_per_step=2), plain(b, backward_passes_per_step=2)
    train(a, za, range(3), passes=2)
    train(b, db, range(3), passes=2)
    out["passes"] = max_diff(a, b)
    hvd.shutdown()
    return out


def checkpoint(folder: str, phase: str, steps: int = 6, saved_at: int = 3) -> list[torch.Tensor] | bool:
    """``save``: train ``saved_at`` steps and write a checkpoint with gpucomm's helper; ``resume``
    (another world size): load it and train to ``steps``; the parameters after each step."""
    hvd.init()
    path = os.path.join(folder, "zero.pt")
    model = make_model()
    opt = zero(model)
    if phase == "save":
        train(model, opt, range(saved_at))
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "size": hvd.size()}
        wrote = hvd.save_checkpoint(state, path)
        hvd.barrier()
        hvd.shutdown()
        return wrote
    loaded = torch.load(path, weights_only=False)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    seen = train(model, opt, range(saved_at, steps))
    hvd.shutdown()
    return seen


def single_process_reference(steps: int = 6) -> list[torch.Tensor]:
    """The same training in one process on the whole global batch (torch's AdamW)."""
    model = make_model()
    opt = torch.optim.AdamW(groups(model), lr=0.01)
    seen = []
    for s in range(steps):
        x, y = global_batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        seen.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return seen


def join_elastic_and_broadcast() -> dict:
    """hvd.join (the joined rank steps its shard on the others' gradients and takes part in the
    gathers, so every rank still holds the same parameters), TorchState commit/restore, and
    broadcast_optimizer_state (hyper-parameters only: the state is sharded)."""
    hvd.init()
    r, out = hvd.rank(), {}
    model = make_model(2)
    opt = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, named_parameters=model.named_parameters(),
                                      lr=0.01 if r == 0 else 0.5)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["lr"] = opt.param_groups[0]["lr"]
    train(model, opt, range(2 + (2 if r == 0 else 0)))  # rank 0 trains two more steps
    out["last"] = hvd.join()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather_object(params, name="zero.join")
    out["identical_after_join"] = all(torch.equal(everyone[0], theirs) for theirs in everyone)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)
    committed = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt.state_dict())
    first = train(model, opt, range(10, 12))
    state.restore()
    out["restored_params"] = torch.equal(committed[0], torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    again = train(model, opt, range(10, 12))
    out["replay_equal"] = all(torch.equal(x, y) for x, y in zip(first, again))
    out["bytes"] = opt.state_bytes()
    # Horovod's clipping pattern: synchronize, clip by the global norm, step without synchronizing
    a, b = make_model(5), make_model(5)
    za, db = zero(a), plain(b)
    norms = []
    for s in range(3):
        for net, opt_, clip in ((a, za, za.clip_grad_norm_),
                                (b, db, lambda m: nn.utils.clip_grad_norm_(b.parameters(), m))):
            x, y = (my_part(t) for t in global_batch(s))
            opt_.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt_.synchronize()
            norms.append(float(clip(0.05)))
            with opt_.skip_synchronize():
                opt_.step()
    out["clip_norms"] = max(abs(x - y) for x, y in zip(norms[::2], norms[1::2]))
    out["clip_active"] = min(norms) > 0.05  # every step was clipped
    out["clipped"] = max_diff(a, b)
    hvd.shutdown()
    return out


def disagreeing_ranks(what: str) -> str:
    """Rank 1 builds its ZeroRedundancyOptimizer unlike rank 0 (``what``: "class", "lr" or "params");
    returns the error every rank raises at construction."""
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    cls = torch.optim.Adam if what == "class" and r == 1 else torch.optim.SGD
    lr = 0.2 if what == "lr" and r == 1 else 0.1
    named = list(model.named_parameters())
    if what == "params" and r == 1:
        named = named[::-1]
    try:
        opt = hvd.ZeroRedundancyOptimizer([p for _, p in named], cls, named_parameters=named, lr=lr)
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()  # the options are agreed at the first step (after a broadcast_optimizer_state, if any)
        message = ""
    except ValueError as e:
        message = str(e)
    hvd.shutdown()
    return message
