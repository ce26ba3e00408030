"""Rank functions for tests/test_elastic_state.py (module level, so the rank pool can import them)."""

from __future__ import annotations

from typing import Any

import torch

import gpucomm.torch as hvd
from gpucomm.torch.elastic import ElasticSampler, TorchState

DATASET_LEN = 29  # prime: the shards of the remaining samples are uneven at 2 and 3 ranks
BATCH = 2


class RecordingSGD(torch.optim.SGD):
    """SGD with the ``rebind`` hook TorchState calls; it records the momentum it saw then, to show
    that the hook runs before the optimizer state is broadcast."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.rebinds: list[list[float]] = []

    def rebind(self) -> None:
        self.rebinds.append(_momenta(self))


def _momenta(opt: torch.optim.Optimizer) -> list[float]:
    return [float(s["momentum_buffer"].sum()) for s in opt.state.values() if "momentum_buffer" in s]


def _plain(value: Any) -> Any:
    """``value`` with tensors as lists: picklable, and compared exactly by the test."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _fingerprint(state: TorchState) -> dict:
    """Everything the state tracks, as plain values."""
    return {"model": _plain(state.model.state_dict()), "optimizer": _plain(state.optimizer.state_dict()),
            "aux": _plain(state.aux.state_dict()), "sampler": dict(state.sampler.state_dict()),
            "epoch": state.epoch, "batch": state.batch, "meta": _plain(state.meta)}


def _train_step(model, opt, aux, rank: int, scale: float) -> None:
    x = torch.linspace(-1.0, 1.0, 24).reshape(6, 4) * scale + rank
    opt.zero_grad()
    aux.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()  # averaged over the ranks
    aux.step()  # local: uses the same (averaged) gradients


def torch_state_sync_commit_restore() -> dict:
    """Ranks start with different models, Adam moments, hyper-parameters, sampler progress and plain
    values; ``sync()`` must make each equal to rank 0's. Then ``commit()`` → train and change every
    value → ``restore()`` must give the committed values back, twice (a restore must not alias the
    saved copy)."""
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 2))
    model(torch.randn(5, 4) + rank)  # rank-dependent BatchNorm running statistics
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    aux = RecordingSGD(model.parameters(), lr=0.1, momentum=0.9)
    _train_step(model, opt, aux, rank, 1.0)
    with torch.no_grad():
        for st in opt.state.values():  # rank-dependent Adam moments and step counts
            st["exp_avg"].add_(rank)
            st["exp_avg_sq"].add_(rank)
            st["step"].add_(rank)
        for st in aux.state.values():
            st["momentum_buffer"].add_(rank)
    opt.param_groups[0]["lr"] = 0.01 * (rank + 1)
    sampler = ElasticSampler(list(range(DATASET_LEN)), shuffle=True, seed=7)
    sampler.set_epoch(rank + 1)
    for b in range(rank + 1):
        sampler.record_batch(b, BATCH)

    state = TorchState(model=model, optimizer=opt, aux=aux, sampler=sampler, epoch=10 + rank, batch=rank,
                       meta={"tags": [rank]})
    before_sync = _fingerprint(state)
    momenta_before_sync = _momenta(aux)
    state.sync()
    after_sync = _fingerprint(state)
    shard = list(iter(state.sampler))
    processed = sorted(state.sampler.processed_indices)

    state.commit()  # outside elastic mode the host check is a no-op
    committed = _fingerprint(state)
    restored = []
    modified = []
    for scale in (2.0, 3.0):
        _train_step(model, opt, aux, rank, scale)
        state.epoch += 1
        state.batch = 99
        state.meta["tags"].append(scale)  # in place: the saved copy must not see it
        state.sampler.record_batch(0, BATCH)
        modified.append(_fingerprint(state))
        state.restore()
        restored.append(_fingerprint(state))
    _train_step(model, opt, aux, rank, 1.0)  # training goes on after a restore
    hvd.shutdown()
    return {"before_sync": before_sync, "after_sync": after_sync, "shard": shard, "processed": processed,
            "len": len(state.sampler), "committed": committed, "modified": modified, "restored": restored,
            "rebinds": aux.rebinds, "momenta_before_sync": momenta_before_sync}


def ranks_agree_on_the_sync(needs: list[bool]) -> list[bool]:
    """Each rank ``r`` of a job in elastic mode judges on its own that the state needs a sync
    (``needs[r]``), as after rounds some ranks saw given up and others did not; what ``sync_needed``
    decides on each, for every pattern of the others' judgements in turn."""
    import importlib  # noqa: PLC0415

    from gpucomm.bootstrap import rounds  # noqa: PLC0415

    elastic_run = importlib.import_module("gpucomm.torch.elastic.run")  # the module (the package's run is the function)

    hvd.init()
    plain = rounds.elastic_mode
    rounds.elastic_mode = lambda *args: True  # what gpucomm-run's elastic workers have (a warm pool process:
    try:  # restored below)
        return [elastic_run.sync_needed(not need) for need in needs[hvd.rank()]]
    finally:
        rounds.elastic_mode = plain
        hvd.shutdown()
