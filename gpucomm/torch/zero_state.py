"""ZeRO's optimizer state: this rank's shards of one layout with the wrapped optimizer that steps
them (``Shards``), the full state dict assembled from every rank's part and cut back into parts
(any world size, or the plain optimizer class), and the optimizer's state-dict methods over it
(``ShardedStateDict``).

The state dict is the wrapped class's own format over all parameters (``torch.optim`` indices and
shapes), gathered from every rank's segments. ``state_dict()`` gathers it on every rank (a
collective); ``consolidate_state_dict(to=r)`` gathers it for rank ``r`` only, whose next
``state_dict()`` (before the next step) returns it, as torch's does. ``load_state_dict(full)``
keeps the full state and hands each rank its part at the next step (after a re-formed elastic job
has cut its new shards).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from ..errors import CollectiveError
from .functions import allgather_object
from .submission import PlannedBucket, current_job, layout_of
from .zero_geometry import BucketShard, Segment
from .zero_settings import ZeroSettings


class Shards:
    """The shards of one layout on this rank: its segments in the wrapped optimizer's order, that
    optimizer (``optim``; None when this rank's part is empty), and how every rank's local state maps
    to the full state dict. ``params``/``param_groups``: the ZeroRedundancyOptimizer's (every
    parameter, by index); ``size == 1``: no shards, the wrapped optimizer steps the parameters."""

    def __init__(self, settings: ZeroSettings, params: Sequence[torch.Tensor], param_groups: Sequence[dict],
                 plans: Sequence[PlannedBucket], trainable: Sequence[torch.Tensor], size: int, rank: int,
                 tails: Sequence[int]) -> None:
        self.params = list(params)
        self.index = {p: i for i, p in enumerate(self.params)}
        self.group_of = {p: g for g, group in enumerate(param_groups) for p in group["params"]}
        self.size, self.rank = size, rank
        self.buckets = [BucketShard(plan, [trainable[i] for i in plan.param_indices], size, rank, tail, self.group_of)
                        for plan, tail in zip(plans, tails)] if size > 1 else []
        options = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
        if size == 1:
            groups = [{**o, "params": list(g["params"])} for o, g in zip(options, param_groups)]
        else:
            mine = self.owners(rank)
            groups = [{**o, "params": [s.tensor for s, _ in mine if s.group == gi]} for gi, o in enumerate(options)]
        self.optim = settings.optimizer_class(groups, **settings.defaults) if any(g["params"] for g in groups) else None

    def owners(self, rank: int) -> list[tuple[Segment, BucketShard]]:
        """``rank``'s segments (with their buckets) in its wrapped optimizer's index order: group by
        group, bucket order within a group (this rank's own segments hold its tensors)."""
        pairs = [(s, b) for b in self.buckets for s in (b.segments if rank == self.rank else b.segments_of(rank))]
        return sorted(pairs, key=lambda pair: pair[0].group)  # stable

    def local_state(self) -> dict:
        """This rank's wrapped optimizer's state (CPU tensors), by its local index."""
        if self.optim is None:
            return {}
        return {i: {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in s.items()}
                for i, s in self.optim.state_dict()["state"].items()}

    def assemble(self, every: Sequence[dict]) -> dict:
        """The full state (by parameter index) from every rank's ``local_state()``."""
        if self.size == 1:
            return dict(every[0])
        full: dict[int, dict] = {}
        for rank, local in enumerate(every):
            for i, (segment, bucket) in enumerate(self.owners(rank)):
                state = local.get(i)
                if not state:
                    continue
                for piece in segment.pieces:
                    p = bucket.params[piece.param]
                    entry = full.setdefault(self.index[p], {})
                    for key, value in state.items():
                        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == segment.length:
                            target = entry.get(key)
                            if target is None:
                                target = entry[key] = torch.zeros(p.numel(), dtype=value.dtype)
                            at = piece.at - segment.start
                            target[piece.start : piece.start + piece.length].copy_(value[at : at + piece.length])
                        elif key not in entry:  # a copy: optimizers update step counts in place
                            entry[key] = value.clone() if torch.is_tensor(value) else value
        for i, entry in full.items():  # flat, in travel order -> the parameter's shape and memory layout
            p = self.params[i]
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == p.numel() and p.dim() != 1:
                    shaped = torch.empty_strided(p.shape, layout_of(p), dtype=value.dtype)
                    shaped.as_strided((p.numel(),), (1,)).copy_(value)
                    entry[key] = shaped
        return full

    def load(self, full: dict) -> None:
        """This rank's part of ``full`` (by parameter index) into its wrapped optimizer."""
        if self.optim is None:
            return
        if self.size == 1:  # the wrapped optimizer holds every parameter, in the same order
            self.optim.load_state_dict(self._local_dict(dict(full)))
            return
        local = {}
        for i, (segment, bucket) in enumerate(self.owners(self.rank)):
            entries = [(piece, full.get(self.index[bucket.params[piece.param]])) for piece in segment.pieces]
            if not any(entry for _, entry in entries):
                continue
            state: dict[str, Any] = {}
            for piece, entry in entries:
                p = bucket.params[piece.param]
                for key, value in (entry or {}).items():
                    if per_element(value, p, key):
                        target = state.get(key)
                        if target is None:
                            target = state[key] = torch.zeros(segment.length, dtype=value.dtype)
                        flat = travel_order(value.detach().cpu(), p)
                        at = piece.at - segment.start
                        target[at : at + piece.length].copy_(flat[piece.start : piece.start + piece.length])
                    elif key not in state:  # a copy: one tensor shared by two states would count twice
                        state[key] = value.detach().clone() if torch.is_tensor(value) else value
            local[i] = state
        self.optim.load_state_dict(self._local_dict(local))

    def _local_dict(self, state: dict) -> dict:
        groups, at = [], 0
        for group in self.optim.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(at, at + n))})
            at += n
        return {"state": state, "param_groups": groups}

    def state_bytes(self) -> int:
        """Bytes of tensors in this rank's optimizer state."""
        if self.optim is None:
            return 0
        return sum(v.numel() * v.element_size() for s in self.optim.state.values() for v in s.values()
                   if torch.is_tensor(v))


def travel_order(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``value`` (shaped like ``p``) flat, in the order ``p``'s elements travel (its memory order)."""
    laid_out = torch.empty_strided(p.shape, layout_of(p), dtype=value.dtype)
    laid_out.copy_(value)
    return laid_out.as_strided((p.numel(),), (1,))


@contextlib.contextmanager
def keeping_frozen(shards: Shards, scalars: dict) -> Iterator[None]:
    """The wrapped optimizer's step leaves the elements of parameters frozen since the layout was
    agreed as they were, values and per-element state (DistributedOptimizer hands them no gradient,
    so its optimizer skips them); their segments step the other elements. Their per-parameter state
    (step counts), shared with those elements, is kept in ``scalars`` by parameter index for the full
    state. Only the step in which a parameter was frozen has any: the next layout leaves it out."""
    kept = []
    for bucket in shards.buckets:
        for segment, piece in bucket.frozen():
            at = piece.at - segment.start
            state = shards.optim.state.get(segment.tensor, {})
            moments = {k: v[at : at + piece.length].clone() for k, v in state.items()
                       if torch.is_tensor(v) and v.dim() == 1 and v.numel() == segment.length}
            scalars.setdefault(shards.index[bucket.params[piece.param]], {
                k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items() if k not in moments})
            kept.append((segment, at, piece.length, segment.tensor[at : at + piece.length].clone(), moments))
    yield
    with torch.no_grad():
        for segment, at, length, values, moments in kept:
            segment.tensor[at : at + length].copy_(values)
            state = shards.optim.state.get(segment.tensor, {})
            for key, value in moments.items():
                state[key][at : at + length].copy_(value)


def per_element(value: Any, p: torch.Tensor, key: str) -> bool:
    """A state value with one element per parameter element (a moment), as opposed to one per
    parameter (a step count): shaped like the parameter (for a 0-dim parameter, anything but
    ``step``)."""
    return torch.is_tensor(value) and value.shape == p.shape and (p.dim() > 0 or key != "step")


class ShardedStateDict:
    """``ZeroRedundancyOptimizer``'s state-dict methods, merged over ``DistributedOptimizer``'s
    (``zero_steps.sharded_steps``: ``self`` is the optimizer)."""

    def state_dict(self) -> dict:
        """The full state dict (the wrapped class's format over every parameter), gathered from every
        rank: a collective, unless ``consolidate_state_dict(to=r)`` ran since the last step (then rank
        ``r`` returns what it gathered, and the other ranks raise, as torch's do)."""
        if self._consolidated_to is not None:
            if self._consolidated is None:
                raise RuntimeError(f"ZeroRedundancyOptimizer.state_dict(): the state was consolidated to rank "
                                   f"{self._consolidated_to} (consolidate_state_dict(to={self._consolidated_to})), "
                                   f"not to this rank. Call state_dict() on rank {self._consolidated_to}, or call "
                                   f"state_dict() on every rank without consolidating to gather it everywhere.")
            return self._consolidated
        return self._full_state_dict(self._gather())

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state for rank ``to`` (a collective: call it on every rank); until the next
        step, ``state_dict()`` on that rank returns it (torch's ``ZeroRedundancyOptimizer`` contract)."""
        full = self._gather()
        self._consolidated_to = to
        self._consolidated = self._full_state_dict(full) if current_job().world.rank == to else None

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict (from any world size, or from the plain optimizer class): the
        hyper-parameters at once, each rank's part of the state at the next step."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(g["params"]) for saved, g in zip(groups, self.param_groups)):
            raise ValueError("ZeroRedundancyOptimizer.load_state_dict: the state dict's parameter groups do not match "
                             "this optimizer's (number of groups, or of parameters in a group). Load a state dict "
                             "saved from the same model and optimizer parameter groups.")
        if self._buckets.in_flight:
            try:
                self._reduce_step()  # finish what is in flight; the caller's next step starts anew
            except CollectiveError:
                pass  # the job broke (an elastic restore follows): nothing in flight is worth keeping
        self._reset_step()
        # the k-th saved parameter is this optimizer's k-th (torch's rule), whatever index it was saved under
        position = {int(saved): k for k, saved in enumerate(i for g in groups for i in g["params"])}
        self._pending = {position[int(i)]: v for i, v in state_dict["state"].items()}
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._consolidated, self._consolidated_to = None, None

    def _take_pending(self) -> dict:
        pending, self._pending = self._pending, None
        return pending

    def _gather(self) -> dict:
        """The full state by parameter index, from every rank's shard (a collective in a job of
        several ranks); a full state loaded but not yet handed out is that state."""
        self._wait_parameters()
        if self._pending is not None:  # every rank loaded it (load_state_dict is called on every rank)
            return dict(self._pending)
        shards = self._shards
        if self._size == 1:
            return shards.assemble([shards.local_state()])
        self._state_calls += 1
        every = allgather_object((shards.local_state(), self._frozen_scalars), name=f"ZeroRedundancyOptimizer.state."
                                 f"{self._schedule.number}.{self._state_calls}", process_set=self._process_set)
        full = {**self._parked, **shards.assemble([local for local, _ in every])}
        for _, frozen in every:  # the owners of a just-frozen parameter's pieces kept its step counts
            for i, scalars in frozen.items():
                if i in full:
                    full[i].update(scalars)
        return full

    def _full_state_dict(self, full: dict) -> dict:
        groups, at = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(at, at + n))})
            at += n
        return {"state": dict(sorted(full.items())), "param_groups": groups}

    def state_bytes(self) -> int:
        """Bytes of tensors in this rank's optimizer state (its shard's)."""
        return self._shards.state_bytes() if self._shards is not None else 0


__all__ = ["ShardedStateDict", "Shards", "keeping_frozen", "per_element", "travel_order"]
