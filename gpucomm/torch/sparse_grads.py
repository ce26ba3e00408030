"""A DistributedOptimizer's sparse gradients (``nn.Embedding(sparse=True)`` and the like).

Whether a gradient is sparse is only known when it arrives, and every parameter starts in a bucket
(the layout is agreed before any gradient exists). So a sparse gradient that arrives for a
bucketed parameter is densified and averaged in its bucket like any other (always correct, and
what ``sparse_as_dense=True`` does for good), then handed back to the wrapped optimizer sparse,
as it came. After the first step, and whenever the layout is agreed again, the ranks agree (one
``allgather_object``) on the parameters whose gradients arrived sparse on *any* rank; the layout
is then agreed without them, and from the next step each is reduced on its own, as Horovod's
sparse allreduce does: every rank's coalesced indices and values are allgathered and summed.

These reductions run on the optimizer's fixed schedule, like its buckets: at ``synchronize()``,
after the last bucket is launched, in parameter order, one allgather of the entry counts per
device, then one allgather of indices and values per parameter, padded to the longest. So every
rank issues them in the same order as its buckets, with no negotiation (which would place them
among the buckets in an order that differs from rank to rank). A rank on which such a parameter
got no gradient in a step sends no entries, so the ranks' collectives always match; sparse-ness
comes from the model, so every rank's later gradients agree with the decision. ``hvd.join()``
cannot stand in for them: with ``join`` use ``sparse_as_dense=True``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import CollectiveError
from ..process_sets import ProcessSet
from ..reduce_op import ReduceOp
from .functions import allgather_object
from .submission import Request


class SparseGradients:
    """Which of an optimizer's parameters are reduced sparse (``reduced``: parameter -> sparse
    dimensions), what this rank has seen arrive sparse, and the sparse reductions in flight.

    ``params``/``names``: the optimizer's parameters in order and their (rank-independent) names;
    ``prefix``: the start of every collective's name, unique to the optimizer; ``schedule``: the
    optimizer's fixed schedule (None in a one-rank job); ``size``: its process set's size."""

    def __init__(self, params: Sequence[torch.Tensor], names: dict[torch.Tensor, str], op: int,
                 process_set: ProcessSet, sparse_as_dense: bool, prefix: str, schedule: Any = None,
                 size: int = 1) -> None:
        self._params = list(params)
        self._index = {p: i for i, p in enumerate(self._params)}
        self._names = names
        self._op = ReduceOp(op)
        self._process_set = process_set
        self._sparse_as_dense = sparse_as_dense
        self._prefix = prefix
        self._schedule = schedule
        self._size = size
        self._set_id = 0 if schedule is None else schedule.group.id
        self.reduced: dict[torch.Tensor, int] = {}  # agreed by every rank: out of the buckets
        self.active: list[torch.Tensor] = []  # ... those in the current layout (they required grad then)
        self.due = not sparse_as_dense  # the first agreement, after the first step
        self._seen: dict[torch.Tensor, int] = {}  # bucketed parameters seen sparse here, not yet agreed
        self._arrived: dict[torch.Tensor, int] = {}  # bucketed parameters whose gradient came sparse this step
        self._launched: list[tuple[torch.Tensor, Any]] = []  # this step's reductions: (parameter, handle or None)
        self._agreements = 0

    def add(self, params: Sequence[torch.Tensor]) -> None:
        """Parameters added to the optimizer (a new parameter group), after the others."""
        for p in params:
            self._index[p] = len(self._params)
            self._params.append(p)

    @property
    def in_flight(self) -> bool:
        return bool(self._launched)

    def split(self, trainable: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A new layout of ``trainable``: the agreed sparse ones are reduced here (``active``);
        returns the others, for the buckets."""
        self.active = [p for p in trainable if p in self.reduced]
        return [p for p in trainable if p not in self.reduced]

    # -- a step -----------------------------------------------------------------------------------
    def arrived(self, p: torch.Tensor, g: torch.Tensor) -> None:
        """A bucketed parameter's final gradient for this step arrived sparse: remember it."""
        self._arrived[p] = g.sparse_dim()
        if not self._sparse_as_dense:
            self._seen[p] = g.sparse_dim()

    def _gradient(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s gradient as the reduction sends it: coalesced, sparse in the agreed dimensions;
        empty when it has none or is frozen; a dense one (a weight also used densely, e.g. tied) is
        sent sparse too, so ranks match."""
        dim = self.reduced[p]
        g = p.grad if p.requires_grad else None
        if g is None:
            return torch.sparse_coo_tensor(torch.empty((dim, 0), dtype=torch.int64, device=p.device),
                                           torch.empty((0, *p.shape[dim:]), dtype=p.dtype, device=p.device),
                                           p.shape, check_invariants=False).coalesce()
        if not g.is_sparse or g.sparse_dim() != dim:
            g = g.to_dense().to_sparse(dim)
        return g.detach().coalesce()

    def launch_all(self) -> None:
        """Launch this step's reductions on the schedule (once per step; a collective: every rank
        calls it after its buckets, see the module doc)."""
        if self._launched or not self.active or self._schedule is None:
            return
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for p in self.active:
            g = self._gradient(p)
            by_device.setdefault(p.device, []).append((p, g.indices().t().contiguous(), g.values().contiguous()))
        for device, entries in by_device.items():
            mine = torch.tensor([len(indices) for _, indices, _ in entries], dtype=torch.int64, device=device)
            counts = self._launch("allgather", f"{self._prefix}.counts.{device}", [mine],
                                  {"rows": [[len(entries)] * self._size]}).wait()[0][0]
            counts = counts.view(self._size, len(entries)).tolist()  # a host sync, once per device and step
            for j, (p, indices, values) in enumerate(entries):
                rows = [counts[r][j] for r in range(self._size)]
                if max(rows) == 0:  # no rank has entries: nothing to send
                    self._launched.append((p, None))
                    continue
                handle = self._launch("allgather", f"{self._prefix}.{self._names[p]}", [indices, values],
                                      {"rows": [rows, rows]})
                self._launched.append((p, handle))

    def _launch(self, kind: str, name: str, tensors: list[torch.Tensor], meta: dict) -> Any:
        request = Request(kind, name, tensors, device=tensors[0].device, set_id=self._set_id)
        return self._schedule.launch(request, meta)

    def finish(self) -> None:
        """Wait for the sparse reductions and write each result into ``p.grad`` (sparse, coalesced;
        Average divides the values by the set's size, integers truncating as a dense Average does)."""
        for p, handle in self._launched:  # (kept until all are waited for: reset() abandons the rest on an error)
            dim = self.reduced[p]
            if handle is None:
                out = torch.sparse_coo_tensor(torch.empty((dim, 0), dtype=torch.int64, device=p.device),
                                              torch.empty((0, *p.shape[dim:]), dtype=p.dtype, device=p.device),
                                              p.shape, check_invariants=False).coalesce()
            else:
                (all_indices, all_values), _ = handle.wait()
                out = torch.sparse_coo_tensor(all_indices.t(), all_values, p.shape, check_invariants=False).coalesce()
            if self._op == ReduceOp.AVERAGE and out.values().numel():
                values = out.values()
                values = (values / self._size if values.is_floating_point()
                          else torch.div(values, self._size, rounding_mode="trunc"))
                out = torch.sparse_coo_tensor(out.indices(), values, p.shape, check_invariants=False,
                                              is_coalesced=True)
            if p.requires_grad:  # frozen since the layout was agreed: leave its gradient alone
                p.grad = out
        self._launched = []

    def hand_back(self) -> None:
        """After the buckets are unpacked: gradients that arrived sparse (here, or anywhere once
        agreed) reach the wrapped optimizer sparse, as in local training (SparseAdam needs that)."""
        arrived, self._arrived = self._arrived, {}
        for p, dim in [*arrived.items(), *((p, self.reduced[p]) for p in self.active)]:
            g = p.grad
            if g is not None and p.requires_grad and not g.is_sparse:
                p.grad = g.to_sparse(dim)

    def reset(self) -> None:
        """Forget the reductions of an abandoned step (their results are not waited for; a CUDA one's done
        event goes back to the pool once it is done; those already waited for are left as they are)."""
        for _, handle in self._launched:
            if handle is not None:
                handle.abandon()
        self._launched = []

    # -- agreement ----------------------------------------------------------------------------------
    def agree(self) -> bool:
        """A collective (every rank calls it at the same point): add the parameters any rank has
        seen sparse to ``reduced``. True if that changed anything (the layout must follow). False,
        changing nothing, if a rank has joined (every training rank then gets the same refusal)."""
        self.due = False
        if self._sparse_as_dense:
            return False
        self._agreements += 1
        mine = {self._index[p]: dim for p, dim in self._seen.items()}
        try:
            every = allgather_object(mine, name=f"{self._prefix}.agree.{self._agreements}",
                                     process_set=self._process_set)
        except CollectiveError as e:
            if "already called join()" not in str(e):
                raise
            return False
        self._seen.clear()
        new = {self._params[i]: dim for theirs in every for i, dim in theirs.items()
               if self._params[i] not in self.reduced}
        self.reduced.update(new)
        return bool(new)


__all__ = ["SparseGradients"]
