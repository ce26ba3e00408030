"""Helpers built on the collectives: parameter and object broadcast, object allgather."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ..errors import CollectiveError
from ..process_sets import ProcessSet, global_process_set
from .collectives import broadcast_, broadcast_async_
from .submission import current_job, execute, set_id, synchronize

try:  # cloudpickle handles lambdas and local classes, as Horovod's helpers do
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - optional
    _pickler = pickle


def broadcast_parameters(params, root_rank: int) -> None:
    """Overwrite every rank's parameters with root's: ``params`` is a ``state_dict()``-like dict
    (broadcast in sorted key order) or a list of tensors or ``(name, tensor)`` pairs."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"broadcast_parameters: invalid params of type {type(params).__name__}; pass a dict "
                         f"(e.g. model.state_dict()) or a list of tensors or (name, tensor) tuples.")
    handles = []
    with torch.no_grad():  # overwriting parameters on purpose, as an optimizer step does
        for name, p in items:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"broadcast_parameters: entry {name!r} is a {type(p).__name__}, not a tensor.")
            handles.append(broadcast_async_(p, root_rank, name))
    for h in handles:
        synchronize(h)


def _to_bytes_tensor(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    _pickler.dump(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Root's ``obj`` on every rank of ``process_set`` (pickled, two broadcasts: size then bytes)."""
    named = name is not None
    name = name or type(obj).__name__
    rank = current_job().world.rank
    if rank == root_rank:
        data = _to_bytes_tensor(obj)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    try:
        broadcast_(size, root_rank, name + ".sz", process_set)
    except CollectiveError as e:
        if named:
            raise
        raise CollectiveError(
            f"{e} (hvd.broadcast_object named this broadcast after the object's type, '{name}', as Horovod does: "
            f"every rank must pass an object of the root's type, or the same name=. A rank other than the root "
            f"that passes None, as in `obj if hvd.rank() == 0 else None`, names it 'NoneType'.)") from e
    if rank != root_rank:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, name + ".t", process_set)
    return obj if rank == root_rank else pickle.loads(data.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's ``obj``, as a list indexed by rank (in ``process_set``)."""
    name = name or type(obj).__name__
    set_id(process_set)
    data = _to_bytes_tensor(obj)
    gathered, rows_per_tensor = execute("allgather", [data], name, process_set=process_set)
    outs, rows = gathered[0], rows_per_tensor[0]
    result, pos = [], 0
    for n in rows:
        result.append(pickle.loads(outs[pos : pos + n].numpy().tobytes()))
        pos += n
    return result


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: torch.nn.Module | None = None) -> None:
    """Give every rank root's optimizer state and hyper-parameters (``lr``, momentum buffers, Adam
    moments, step counts, ...): root's ``state_dict()`` is broadcast and loaded on the others, so
    every rank ends with root's state, whatever it had (none, or for other parameters).

    An optimizer that has no state yet on root gets it first, as Horovod creates it: one step of
    the wrapped optimizer (never a DistributedOptimizer's synchronizing step) on zero gradients for
    every parameter that requires grad; sparse zeros for ``SparseAdam``, and for ``SGD`` on the
    parameters of ``model``'s sparse embeddings (``model`` is only used for that). Root's parameters
    are put back as they were, so weight decay cannot move them. As in Horovod, on every rank whose
    optimizer had no state, each parameter that requires grad and had no gradient is left with a
    zero gradient (a script that reads ``p.grad`` right after works unchanged); gradients that
    existed are kept (Horovod overwrites them with zeros).

    An optimizer whose state is sharded across ranks (``hvd.ZeroRedundancyOptimizer``: it has
    ``consolidate_state_dict``) holds no per-rank copy to send: its shards are left as they are and
    only root's hyper-parameters are broadcast."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state: its state holds closures' history that does "
                         "not transfer between processes; broadcast the model and start LBFGS fresh on every rank.")
    rt = current_job()
    if is_sharded(optimizer):
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        groups = broadcast_object(groups, root_rank, name="broadcast_optimizer_state.groups")
        for group, options in zip(optimizer.param_groups, groups):
            group.update(options)
        return
    had_none = not any(optimizer.state.values())
    sparse = _sparse_parameters(optimizer, model)
    blob = None
    if rt.world.rank == root_rank:
        if had_none:
            _create_state(optimizer, sparse)
        buf = io.BytesIO()
        torch.save(_to_cpu(optimizer.state_dict()), buf)
        blob = buf.getvalue()
    blob = broadcast_object(blob, root_rank, name="broadcast_optimizer_state")
    if rt.world.rank != root_rank:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
        optimizer.load_state_dict(state)  # casts state to each parameter's device and dtype
    if had_none:
        for p in _parameters(optimizer):
            if p.requires_grad and p.grad is None:
                p.grad = _zero_gradient(p, p in sparse)


_WRAPPERS = __name__.rsplit(".", 1)[0] + "."  # DistributedOptimizer's classes (Adasum's too) come from gpucomm.torch


def is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    """True for an optimizer whose state is sharded across ranks (``hvd.ZeroRedundancyOptimizer``,
    torch's too): its ``state_dict()`` gathers the full state, it has ``consolidate_state_dict``."""
    return callable(getattr(optimizer, "consolidate_state_dict", None))


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _sparse_parameters(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> set[torch.Tensor]:
    """The parameters whose zero gradient is sparse: all for ``SparseAdam``, for ``SGD`` those of
    ``model``'s sparse embeddings (0-dim parameters never)."""
    if isinstance(optimizer, torch.optim.SparseAdam):
        return {p for p in _parameters(optimizer) if p.dim() > 0}
    if model is None or not isinstance(optimizer, torch.optim.SGD):
        return set()
    embeddings = {id(p) for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                  and m.sparse for p in m.parameters(recurse=False)}
    return {p for p in _parameters(optimizer) if id(p) in embeddings and p.dim() > 0}


def _zero_gradient(p: torch.Tensor, sparse: bool) -> torch.Tensor:
    zeros = torch.zeros_like(p)
    return zeros.to_sparse(1) if sparse else zeros


def _create_state(optimizer: torch.optim.Optimizer, sparse: set[torch.Tensor]) -> None:
    """One local step of the wrapped optimizer on zero gradients (Horovod's way to create state),
    leaving parameters and gradients as they were."""
    params = _parameters(optimizer)
    kept = [(p, p.detach().clone(), p.grad) for p in params]
    try:
        for p in params:
            if p.requires_grad:
                p.grad = _zero_gradient(p, p in sparse)
        if type(optimizer).__module__.startswith(_WRAPPERS):  # a DistributedOptimizer: its wrapped class's step
            super(type(optimizer), optimizer).step()
        else:
            optimizer.step()
    finally:
        with torch.no_grad():
            for p, data, grad in kept:
                p.copy_(data)
                p.grad = grad


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
