"""Helpers built on the collectives: parameter and object broadcast, object allgather."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from .. import job as jobs
from ..process_sets import ProcessSet, global_process_set
from .collectives import broadcast_, broadcast_async_
from .submission import execute, set_id, synchronize

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
    name = name or type(obj).__name__
    rank = jobs.current().world.rank
    if rank == root_rank:
        data = _to_bytes_tensor(obj)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    broadcast_(size, root_rank, name + ".sz", process_set)
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
    parameters of ``model``'s sparse embeddings (``model`` is only used for that). Parameters and
    gradients are put back as they were, so weight decay cannot move root's parameters."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state: its state holds closures' history that does "
                         "not transfer between processes; broadcast the model and start LBFGS fresh on every rank.")
    rt = jobs.current()
    blob = None
    if rt.world.rank == root_rank:
        if not any(optimizer.state.values()):
            _create_state(optimizer, model)
        buf = io.BytesIO()
        torch.save(_to_cpu(optimizer.state_dict()), buf)
        blob = buf.getvalue()
    blob = broadcast_object(blob, root_rank, name="broadcast_optimizer_state")
    if rt.world.rank != root_rank:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
        optimizer.load_state_dict(state)  # casts state to each parameter's device and dtype


_WRAPPERS = __name__.rsplit(".", 1)[0] + "."  # DistributedOptimizer's classes (Adasum's too) come from gpucomm.torch


def _create_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """One local step of the wrapped optimizer on zero gradients (Horovod's way to create state),
    leaving parameters and gradients as they were."""
    sparse_ids = set() if model is None else {
        id(p) for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)}
    all_sparse = isinstance(optimizer, torch.optim.SparseAdam)
    sgd = isinstance(optimizer, torch.optim.SGD)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    kept = [(p, p.detach().clone(), p.grad) for p in params]
    try:
        for p in params:
            if p.requires_grad:
                zeros = torch.zeros_like(p)
                sparse = p.dim() > 0 and (all_sparse or (sgd and id(p) in sparse_ids))
                p.grad = zeros.to_sparse(1) if sparse else zeros
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
