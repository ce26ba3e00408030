"""A DistributedOptimizer's sparse gradients (``nn.Embedding(sparse=True)`` and the like).

Whether a gradient is sparse is only known when it arrives, and every parameter starts in a bucket
(the layout is agreed before any gradient exists). So a sparse gradient that arrives for a
bucketed parameter is densified and averaged in its bucket like any other (always correct, and
what ``sparse_as_dense=True`` does for good), then handed back to the wrapped optimizer sparse,
as it came. After the first step, and whenever the layout is agreed again, the ranks agree (one
``allgather_object``) on the parameters whose gradients arrived sparse on *any* rank; the layout
is then agreed without them, and from the next step each is reduced on its own by Horovod's sparse
allreduce (an allgather of indices and values, ``sparse_allreduce_async``). A rank on which such a
parameter got no gradient in a step sends an empty sparse tensor, so the ranks' collectives always
match; sparse-ness comes from the model, so every rank's later gradients agree with the decision.

The sparse reductions are negotiated by name on the job's control plane (their sizes differ from
rank to rank and step to step), beside the buckets' fixed schedule, which never waits for them.
``hvd.join()`` cannot stand in for them: with ``join`` use ``sparse_as_dense=True``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..errors import CollectiveError
from ..process_sets import ProcessSet
from .functions import allgather_object
from .mpi_ops import sparse_allreduce_async


class SparseGradients:
    """Which of an optimizer's parameters are reduced sparse (``reduced``: parameter -> sparse
    dimensions), what this rank has seen arrive sparse, and the sparse reductions in flight.

    ``params``/``names``: the optimizer's parameters in order and their (rank-independent) names;
    ``prefix``: the start of every collective's name, unique to the optimizer."""

    def __init__(self, params: Sequence[torch.Tensor], names: dict[torch.Tensor, str], op: int,
                 process_set: ProcessSet, sparse_as_dense: bool, prefix: str) -> None:
        self._params = list(params)
        self._index = {p: i for i, p in enumerate(self._params)}
        self._names = names
        self._op = op
        self._process_set = process_set
        self._sparse_as_dense = sparse_as_dense
        self._prefix = prefix
        self.reduced: dict[torch.Tensor, int] = {}  # agreed by every rank: out of the buckets
        self.active: list[torch.Tensor] = []  # ... those in the current layout (they required grad then)
        self.due = not sparse_as_dense  # the first agreement, after the first step
        self._seen: dict[torch.Tensor, int] = {}  # bucketed parameters seen sparse here, not yet agreed
        self._arrived: dict[torch.Tensor, int] = {}  # bucketed parameters whose gradient came sparse this step
        self._handles: dict[torch.Tensor, Callable[[], torch.Tensor]] = {}
        self._agreements = 0

    @property
    def in_flight(self) -> bool:
        return bool(self._handles)

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

    def launch(self, p: torch.Tensor) -> None:
        """Start reducing ``p``'s gradient (one of ``reduced``): empty if it has none or is frozen;
        a dense one (a weight also used densely, e.g. tied) is sent sparse too, so ranks match."""
        dim = self.reduced[p]
        g = p.grad if p.requires_grad else None
        if g is None:
            g = torch.sparse_coo_tensor(torch.empty((dim, 0), dtype=torch.int64, device=p.device),
                                        torch.empty((0, *p.shape[dim:]), dtype=p.dtype, device=p.device), p.shape,
                                        check_invariants=False)
        elif not g.is_sparse or g.sparse_dim() != dim:
            g = g.to_dense().to_sparse(dim)
        self._handles[p] = sparse_allreduce_async(g, name=f"{self._prefix}.{self._names[p]}", op=self._op,
                                                  process_set=self._process_set)

    def launch_missing(self) -> None:
        """Start the reductions of sparse parameters whose gradient did not arrive this step."""
        for p in self.active:
            if p not in self._handles:
                self.launch(p)

    def finish(self) -> None:
        """Wait for the sparse reductions and write each result into ``p.grad`` (sparse)."""
        handles, self._handles = self._handles, {}
        for p, wait in handles.items():
            reduced = wait()
            if p.requires_grad:  # frozen since the layout was agreed: leave its gradient alone
                p.grad = reduced

    def hand_back(self) -> None:
        """After the buckets are unpacked: gradients that arrived sparse (here, or anywhere once
        agreed) reach the wrapped optimizer sparse, as in local training (SparseAdam needs that)."""
        arrived, self._arrived = self._arrived, {}
        for p, dim in [*arrived.items(), *((p, self.reduced[p]) for p in self.active)]:
            g = p.grad
            if g is not None and p.requires_grad and not g.is_sparse:
                p.grad = g.to_sparse(dim)

    def reset(self) -> None:
        """Forget the reductions of an abandoned step (their results are not waited for)."""
        self._handles.clear()

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
