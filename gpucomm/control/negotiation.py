"""What ranks must agree on before a collective runs, and the error when they do not.

A ``Descriptor`` is the part of a request that every rank sends to the coordinator: small,
picklable, hashable. ``disagreement`` compares the descriptors that the members of a process set
sent for one name and returns the error every rank raises (naming the ranks and the values that
differ), or None when the collective may run.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from ..dataplane.requests import DTYPE_NAMES, Request
from ..reduce_op import ReduceOp

# Kinds that negotiate but move no tensors.
CONTROL_KINDS = ("barrier", "join", "add_process_set", "remove_process_set")


class Descriptor(NamedTuple):
    """One rank's view of one collective: what the coordinator checks and the data plane needs.
    (A named tuple: it is pickled for every uncached request, and tuples pickle fastest.)"""

    kind: str
    set_id: int = 0
    dtypes: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    device: str = "cpu"
    op: int = 1
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = 0
    splits: tuple[int, ...] | None = None
    ranks: tuple[int, ...] | None = None  # add/remove_process_set: the set's global ranks


def descriptor_of(req: Request) -> Descriptor:
    """What ``req``'s rank tells the coordinator about it."""
    tensors = req.tensors
    if len(tensors) == 1:  # the common case, without the generators
        t = tensors[0]
        dtypes: tuple[str, ...] = (DTYPE_NAMES.get(t.dtype) or str(t.dtype),)
        shapes: tuple[tuple[int, ...], ...] = (tuple(t.shape),)
    else:
        dtypes = tuple(DTYPE_NAMES.get(t.dtype) or str(t.dtype) for t in tensors)
        shapes = tuple(tuple(t.shape) for t in tensors)
    return Descriptor(req.kind, req.set_id, dtypes, shapes, req.device.type, int(req.op), req.prescale,
                      req.postscale, req.root, None if req.splits is None else tuple(req.splits), req.ranks)


def _fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _who(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _split_by(values: Mapping[int, object]) -> list[tuple[list[int], object]]:
    """Group ranks by value, largest group first (the majority is listed first)."""
    groups: dict[object, list[int]] = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(value, []).append(rank)
    return sorted(((ranks, value) for value, ranks in groups.items()), key=lambda g: (-len(g[0]), g[0]))


def _describe_groups(values: Mapping[int, object], fmt=str) -> str:
    return "; ".join(f"{_who(ranks)} sent {fmt(value)}" for ranks, value in _split_by(values))


# Dimensions that must match per kind: all of them, or all but dim 0 (dim 0 may differ per rank).
_FREE_DIM0 = ("allgather", "alltoall")
_REDUCING = ("allreduce", "reducescatter")


def disagreement(name: str, descriptors: Mapping[int, Descriptor]) -> str | None:
    """The error for ``name`` when the ranks' descriptors cannot run together, else None."""
    values = iter(descriptors.values())
    first = next(values)
    if all(d == first for d in values):
        return None  # the common case: every rank sent the same request
    kind = first.kind
    what = f"{kind.upper()} '{name}'"
    fields: list[tuple[str, str, object]] = [
        ("kind", "operation", lambda d: d.kind),
        ("device", "device", lambda d: d.device),
        ("count", "number of tensors", lambda d: len(d.dtypes)),
    ]
    for label, noun, get in fields:
        values = {r: get(d) for r, d in descriptors.items()}
        if len(set(values.values())) > 1:
            hint = (" Keep every rank's tensors on the same kind of device (all CPU or all CUDA)."
                    if label == "device" else "")
            return f"Mismatched {what} {noun}: {_describe_groups(values)}.{hint}"
    if kind in ("add_process_set", "remove_process_set"):
        values = {r: d.ranks for r, d in descriptors.items()}
        if len(set(values.values())) > 1:
            return (f"Mismatched {kind}: {_describe_groups(values, lambda v: list(v))}. Every rank must call "
                    f"{kind} with the same ranks, in the same order as the other ranks.")
        return None
    for i in range(len(first.dtypes)):
        which = "" if len(first.dtypes) == 1 else f" (tensor {i})"
        dtypes = {r: d.dtypes[i] for r, d in descriptors.items()}
        if len(set(dtypes.values())) > 1:
            return f"Mismatched {what} tensor types{which}: {_describe_groups(dtypes)}. Every rank must send the same dtype."
        if kind in _FREE_DIM0:
            key = {r: (len(d.shapes[i]),) + tuple(d.shapes[i][1:]) for r, d in descriptors.items()}
            if len(set(key.values())) > 1:
                shapes = {r: d.shapes[i] for r, d in descriptors.items()}
                return (f"Mismatched {what} tensor shapes{which}: {_describe_groups(shapes, _fmt_shape)}. "
                        f"Ranks may differ in the first dimension only.")
        else:
            shapes = {r: d.shapes[i] for r, d in descriptors.items()}
            if len(set(shapes.values())) > 1:
                return (f"Mismatched {what} tensor shapes{which}: {_describe_groups(shapes, _fmt_shape)}. "
                        f"Every rank must send a tensor of the same shape.")
    if kind in _REDUCING:
        ops = {r: d.op for r, d in descriptors.items()}
        if len(set(ops.values())) > 1:
            return (f"Mismatched {what} reduction ops: "
                    f"{_describe_groups(ops, lambda v: 'hvd.' + ReduceOp(v).name.title())}.")
        scales = {r: (d.prescale, d.postscale) for r, d in descriptors.items()}
        if len(set(scales.values())) > 1:
            return (f"Mismatched {what} prescale and/or postscale factors: "
                    f"{_describe_groups(scales, lambda v: f'prescale={v[0]:g}, postscale={v[1]:g}')}.")
    if kind == "broadcast":
        roots = {r: d.root for r, d in descriptors.items()}
        if len(set(roots.values())) > 1:
            return f"Mismatched {what} root ranks: {_describe_groups(roots)}. Every rank must name the same root_rank."
    if kind == "alltoall":
        given = {r: d.splits is not None for r, d in descriptors.items()}
        if len(set(given.values())) > 1:
            return (f"Mismatched {what} splits: {_describe_groups(given, lambda v: 'splits' if v else 'no splits')}. "
                    f"Pass splits= on every rank or on none.")
    return None


def joined_disagreement(name: str, kind: str, op: int, joined: Sequence[int]) -> str | None:
    """The error when ``kind`` cannot run while ``joined`` ranks stand in with zeros, else None."""
    if kind in CONTROL_KINDS:
        return None
    who = _who(joined)
    if kind not in _REDUCING:
        return (f"{kind.upper()} '{name}' cannot run: {who} already called join() and have no data for it. After "
                f"join() only allreduce, reducescatter and barrier can run until every rank has joined; make the "
                f"ranks that still have data skip this {kind}, or call join() after it.")
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return (f"{kind.upper()} '{name}' with op=hvd.{ReduceOp(op).name.title()} cannot run: {who} already called "
                f"join() and contribute zeros, which only hvd.Sum and hvd.Average can absorb.")
    return None


__all__ = ["CONTROL_KINDS", "Descriptor", "descriptor_of", "disagreement", "joined_disagreement"]
