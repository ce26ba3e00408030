"""The state of an elastic job: what each rank keeps in memory to roll back to after a failure
(``commit``/``restore``), and what it hands to ranks that join (``sync``, from rank 0).

Horovod's contract (``hvd.elastic.State``, ``ObjectState``, ``TorchState``), with three choices
of ours, each so that a rank never ends up holding state another rank does not:
- a commit's copies are never handed out: ``restore`` gives the live objects fresh copies, so a
  second restore after more training still returns the commit (torch's
  ``Optimizer.load_state_dict`` keeps the tensors it is given);
- ``sync`` sends rank 0's live values (the model, too, is live) and then commits on every rank, so
  a failure right after a re-form rolls every rank back to the same point; a sharded optimizer
  (``hvd.ZeroRedundancyOptimizer``) sends rank 0's last commit instead, which holds its full state
  (its live state is spread over ranks that may be gone), and every commit gathers that state;
- ``reset`` (after every re-form, before the sync, which Horovod skips when ranks only left)
  re-shards ``ElasticSampler``s and calls the optimizers' ``rebind``.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch

from ...bootstrap.rounds import elastic_mode
from ...errors import HostsUpdatedInterrupt
from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters, is_sharded
from ..submission import current_job
from .sampler import ElasticSampler


class State:
    """Base of the state ``hvd.elastic.run`` keeps across re-forms of the job.

    ``bcast_object(obj)`` returns rank 0's ``obj`` on every rank; ``get_rank()`` is this rank.
    Subclasses define ``save``, ``restore`` and ``sync``, and may extend ``reset``."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Run ``callbacks`` after each re-form of the job, before the state is synced (e.g. to
        scale the learning rate with the new ``hvd.size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """The job was re-formed: ``reset()``, then the registered callbacks in order."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the current state in memory as the point to roll back to, then check for host
        changes (``HostsUpdatedInterrupt``). A collective in elastic mode: call it on every rank."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank alike when the launcher changed the hosts;
        a no-op outside elastic mode. Cheaper than ``commit()``: nothing is copied.

        In elastic mode a collective: rank 0 reads the launcher's newest round from the store and
        hands it to every rank with the state's own ``bcast_object``, so every rank decides alike."""
        if not elastic_mode():
            return
        job = current_job()
        seen = job.newest_round() if self._rank() == 0 else None
        newest, hosts_added = self._bcast_object(seen)
        if newest > job.elastic_round:
            raise HostsUpdatedInterrupt(skip_sync=not hosts_added)

    def save(self) -> None:
        """Copy the state to memory (the commit)."""
        raise NotImplementedError(f"{type(self).__name__}.save()")

    def restore(self) -> None:
        """Undo every change since the last commit."""
        raise NotImplementedError(f"{type(self).__name__}.restore()")

    def sync(self) -> None:
        """Give every rank rank 0's state."""
        raise NotImplementedError(f"{type(self).__name__}.sync()")

    def reset(self) -> None:
        """Adapt to the re-formed job (new ranks and size), before the sync."""


class ObjectState(State):
    """Plain Python values, each keyword argument an attribute (``state.epoch``), committed as deep
    copies and synced with one ``bcast_object`` call."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any) -> None:
        super().__init__(bcast_object, get_rank)
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs(kwargs)

    def save(self) -> None:
        self._saved_state = copy.deepcopy(self._live_values())

    def restore(self) -> None:
        self._set_attrs(copy.deepcopy(self._saved_state))

    def sync(self) -> None:
        if self._saved_state:
            self._set_attrs(self._bcast_object(self._live_values()))
            self.save()

    def _live_values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._saved_state}

    def _set_attrs(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            setattr(self, name, value)


class TorchState(ObjectState):
    """The state of a PyTorch training loop (Horovod's ``hvd.elastic.TorchState``).

    Every keyword argument becomes an attribute. Models (``nn.Module``), optimizers and
    ``ElasticSampler``s, under any name, are tracked by their state dicts: a commit copies them in
    memory (tensors stay on their device; no disk I/O), ``sync`` broadcasts them from rank 0.
    Other values (epoch, batch, ...) are plain attributes, synced with ``broadcast_object``."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        values = {**kwargs, "model": model, "optimizer": optimizer}
        handlers = {name: _handler_for(value) for name, value in values.items()}
        object.__setattr__(self, "_handlers", {name: h for name, h in handlers.items() if h is not None})
        for name in self._handlers:
            object.__setattr__(self, name, values.pop(name))
        super().__init__(bcast_object=functools.partial(broadcast_object, root_rank=0, name="elastic.state"),
                         get_rank=_rank, **values)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:  # a new model, optimizer or sampler: track it, committed as it is now
            handler = _handler_for(value)
            if handler is None:
                raise TypeError(f"TorchState.{name} holds a {type(handlers[name].value).__name__}; it cannot be "
                                f"replaced by a {type(value).__name__}. Create a new TorchState for other values.")
            handlers[name] = handler
        object.__setattr__(self, name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        self._rebind_optimizers()  # before any optimizer state is broadcast
        for handler in self._handlers.values():
            handler.sync()
        super().sync()  # plain values, then a commit of everything
        if not self._saved_state:
            self.save()

    def reset(self) -> None:
        self._rebind_optimizers()
        for handler in self._handlers.values():
            if isinstance(handler, _SamplerHandler):
                handler.value.reset()

    def _rebind_optimizers(self) -> None:
        for handler in self._handlers.values():
            rebind = getattr(handler.value, "rebind", None) if isinstance(handler, _OptimizerHandler) else None
            if rebind is not None:
                rebind()


def _rank() -> int:
    return current_job().world.rank


# ---------------------------------------------------------------------------------------------
# handlers: how each kind of tracked object is committed, restored and synced


class _StateDictHandler:
    """Commits an object's ``state_dict()`` into buffers reused from one commit to the next."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self._saved: dict = {}
        self.save()

    def save(self) -> None:
        self._saved = _copy_tree(self.value.state_dict(), reuse=self._saved)


class _ModelHandler(_StateDictHandler):
    def restore(self) -> None:
        self.value.load_state_dict(self._saved)  # copies into the parameters: the commit stays intact

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_StateDictHandler):
    def restore(self) -> None:
        self.value.load_state_dict(_copy_tree(self._saved))  # it keeps the tensors it is given

    def sync(self) -> None:
        if is_sharded(self.value):
            # ZeRO: the live state is spread over the previous job's ranks, some of which may be gone;
            # every commit holds the full state (its state_dict() gathers it), so rank 0's last commit
            # (the live state: a restore or the commit that saw the host change just set it) is sent,
            # and every rank takes its part of it under the new job's shards
            full = broadcast_object(self._saved if _rank() == 0 else None, root_rank=0, name="elastic.optimizer")
            self.value.load_state_dict(full)
        else:
            broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler:
    def __init__(self, sampler: ElasticSampler) -> None:
        self.value = sampler
        self._saved = dict(sampler.state_dict())

    def save(self) -> None:
        self._saved = dict(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(dict(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0, name="elastic.sampler"))


def _handler_for(value: Any) -> _ModelHandler | _OptimizerHandler | _SamplerHandler | None:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


def _copy_tree(value: Any, reuse: Any = None) -> Any:
    """A deep copy of ``value`` (a state dict) whose tensors are detached copies: written into the
    matching tensors of ``reuse`` (a previous copy) where shape, dtype and device agree, so a
    commit after the first allocates nothing; cloned otherwise."""
    if isinstance(value, torch.Tensor):
        if (isinstance(reuse, torch.Tensor) and reuse is not value and reuse.shape == value.shape
                and reuse.dtype == value.dtype and reuse.device == value.device and reuse.layout == value.layout
                and not value.is_sparse):
            return reuse.copy_(value.detach())
        return value.detach().clone()
    if isinstance(value, dict):
        reuse = reuse if isinstance(reuse, dict) else {}
        out = OrderedDict() if isinstance(value, OrderedDict) else {}
        for k, v in value.items():
            out[k] = _copy_tree(v, reuse.get(k))
        if hasattr(value, "_metadata"):  # a module state dict's versions, read by load_state_dict
            out._metadata = copy.deepcopy(value._metadata)
        return out
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        reuse = reuse if isinstance(reuse, type(value)) and len(reuse) == len(value) else [None] * len(value)
        return type(value)(_copy_tree(v, r) for v, r in zip(value, reuse))
    return copy.deepcopy(value)
