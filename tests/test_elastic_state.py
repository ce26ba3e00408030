"""Elastic training's state objects and sampler (issue 20): ``hvd.elastic.State``/``ObjectState``/
``TorchState`` and ``ElasticSampler``.

The sampler tests simulate the ranks of a job in one process: each simulated rank's sampler reads
its rank and size when it (re-)partitions, so a size change mid-epoch is a new world plus a reload
of rank 0's state dict, as ``TorchState.sync()`` does it."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader

from gpucomm.errors import CollectiveError, HostsUpdatedInterrupt
from gpucomm.torch import elastic
from gpucomm.torch.elastic import sampler as sampler_module
from tests.ranks import elastic_state_scenarios as scenarios
from tests.harness import run_ranks

ITEM_OFFSET = 1000  # dataset items differ from their indices, so the test reads what the loader delivered


def _dataset(n: int) -> list[int]:
    return [ITEM_OFFSET + i for i in range(n)]


def _as_rank(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(sampler_module, "_rank_and_size", lambda: (rank, size))


def _samplers(monkeypatch, size: int, dataset, state: dict | None = None, **kwargs) -> list:
    """One sampler per simulated rank of a ``size``-rank job, each loaded with ``state`` (rank 0's)."""
    out = []
    for rank in range(size):
        _as_rank(monkeypatch, rank, size)
        s = elastic.ElasticSampler(dataset, **kwargs)
        if state is not None:
            s.load_state_dict(state)
        out.append(s)
    return out


def _train(samplers, dataset, batch: int, steps: int | None) -> list[list[int]]:
    """Every rank takes ``steps`` batches (None: all of its shard) and records each; returns the
    dataset indices each rank was given."""
    seen = []
    for s in samplers:
        mine = []
        for i, items in enumerate(DataLoader(dataset, batch_size=batch, sampler=s)):
            if steps is not None and i == steps:
                break
            mine += [int(v) - ITEM_OFFSET for v in items]
            s.record_batch(i, batch)
        seen.append(mine)
    return seen


def _assert_balanced(samplers) -> None:
    lengths = [len(s) for s in samplers]
    assert max(lengths) - min(lengths) <= 1, lengths  # no padding: shards differ by one sample at most


@pytest.mark.parametrize("sizes", [(3, 2), (2, 3), (3, 2, 3)])
def test_sampler_reshards_mid_epoch_without_losing_or_repeating_samples(monkeypatch, sizes):
    dataset, batch = _dataset(41), 2
    samplers = _samplers(monkeypatch, sizes[0], dataset, {"epoch": 4, "processed_num": 0}, seed=3)
    _assert_balanced(samplers)
    seen = []
    for phase, size in enumerate(sizes):
        last = phase == len(sizes) - 1
        if phase:
            states = {tuple(sorted(s.state_dict().items())) for s in samplers}
            assert len(states) == 1, states  # every rank counted the same progress
            samplers = _samplers(monkeypatch, size, dataset, samplers[0].state_dict(), seed=3)
            _assert_balanced(samplers)
            already = set(samplers[0].processed_indices)
            assert already == {i for rank_seen in seen for i in rank_seen}
            assert not already & {i for s in samplers for i in s}  # nothing processed is handed out again
        seen += _train(samplers, dataset, batch, None if last else 3)
    everything = [i for rank_seen in seen for i in rank_seen]
    assert sorted(everything) == list(range(len(dataset)))  # each sample exactly once in the epoch
    assert samplers[0].processed_num == len(dataset)


def test_sampler_repartitions_on_reset_in_place(monkeypatch):
    """``reset()`` (what ``TorchState.reset()`` runs after a re-form) re-shards with the new rank
    and size, without a state dict."""
    dataset, batch = _dataset(20), 3
    samplers = _samplers(monkeypatch, 2, dataset, seed=1)
    seen = _train(samplers, dataset, batch, 2)
    survivor = samplers[1]  # becomes rank 0 of a 1-rank job
    _as_rank(monkeypatch, 0, 1)
    survivor.reset()
    assert (survivor.rank, survivor.num_replicas) == (0, 1)
    rest = [int(v) - ITEM_OFFSET for items in DataLoader(dataset, batch_size=batch, sampler=survivor) for v in items]
    assert sorted(seen[0] + seen[1] + rest) == list(range(20))


def test_sampler_resumes_mid_epoch_from_a_state_dict(monkeypatch):
    dataset, batch = _dataset(30), 2
    samplers = _samplers(monkeypatch, 3, dataset, {"epoch": 2, "processed_num": 0})
    plans = [list(s) for s in samplers]
    seen = _train(samplers, dataset, batch, 2)
    state = samplers[0].state_dict()
    assert state == {"epoch": 2, "processed_num": 2 * batch * 3}
    resumed = _samplers(monkeypatch, 3, dataset, state)
    for rank, s in enumerate(resumed):
        assert plans[rank][: len(seen[rank])] == seen[rank]
        assert list(s) == plans[rank][2 * batch :]  # same size: each rank goes on where it stopped
        assert len(s) == len(plans[rank]) - 2 * batch


def test_sampler_order_is_a_permutation_fixed_by_seed_and_epoch(monkeypatch):
    dataset = _dataset(50)
    (a,), (b,) = _samplers(monkeypatch, 1, dataset, seed=5), _samplers(monkeypatch, 1, dataset, seed=5)
    order = list(a)
    assert sorted(order) == list(range(50)) and order != list(range(50))
    assert list(b) == order
    a.set_epoch(1)
    assert sorted(a) == list(range(50)) and list(a) != order
    b.set_epoch(1)
    assert list(b) == list(a)
    (c,) = _samplers(monkeypatch, 1, dataset, seed=6)
    assert list(c) != order
    (d,) = _samplers(monkeypatch, 1, dataset, shuffle=False)
    assert list(d) == list(range(50))


def test_sampler_counts_processed_samples_as_horovod_does(monkeypatch):
    dataset = _dataset(25)
    first, second = _samplers(monkeypatch, 2, dataset, shuffle=False)
    assert (len(first), len(second)) == (13, 12)
    assert list(first)[:3] == [0, 2, 4] and list(second)[:3] == [1, 3, 5]  # strided, as Horovod
    first.record_batch(0, 4)
    assert first.processed_num == 8  # the job's samples: batch size times ranks
    assert first.processed_indices == set(range(8))
    for i in range(1, 5):
        first.record_batch(i, 4)
    assert first.processed_num == 25  # clamped to the epoch at its end
    _as_rank(monkeypatch, 0, 2)
    first.set_epoch(1)
    assert first.processed_num == 0 and len(first) == 13


def test_sampler_without_init_is_one_process():
    s = elastic.ElasticSampler(_dataset(7), shuffle=False)
    assert (s.rank, s.num_replicas, list(s)) == (0, 1, list(range(7)))


class _Recording(elastic.ObjectState):
    def __init__(self, log, **kwargs):
        self.log = log
        super().__init__(bcast_object=self._bcast, get_rank=lambda: 1, **kwargs)

    def _bcast(self, obj):
        self.log.append(("bcast", dict(obj)))
        return {"epoch": 7, "items": [7]}  # rank 0's values

    def reset(self):
        self.log.append("reset")


def test_object_state_saves_copies_and_syncs_from_rank_zero(monkeypatch):
    log = []
    state = _Recording(log, epoch=1, items=[1])
    state.items.append(2)  # uncommitted, in place
    state.epoch = 2
    state.restore()
    assert (state.epoch, state.items) == (1, [1])
    state.items.append(3)
    state.restore()  # a restore must not hand out the saved object itself
    assert state.items == [1]

    state.epoch = 5
    state.sync()
    assert log == [("bcast", {"epoch": 5, "items": [1]})]  # the live values are sent
    assert (state.epoch, state.items) == (7, [7])
    state.epoch = 8
    state.restore()
    assert state.epoch == 7  # sync leaves every rank's committed state equal to rank 0's

    state.register_reset_callbacks([lambda: log.append("cb1")])
    state.register_reset_callbacks([lambda: log.append("cb2")])
    log.clear()
    state.on_reset()
    assert log == ["reset", "cb1", "cb2"]


def test_commit_saves_then_checks_for_host_updates(monkeypatch):
    checks = []

    def interrupted():
        checks.append(True)
        raise HostsUpdatedInterrupt(skip_sync=True)

    state = elastic.TorchState(epoch=0)
    monkeypatch.setattr(state, "check_host_updates", interrupted)
    state.epoch = 3
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    state.epoch = 4
    state.restore()
    assert state.epoch == 3 and checks == [True]
    assert elastic.HorovodInternalError is CollectiveError
    with pytest.raises(NotImplementedError):
        elastic.State(bcast_object=lambda o: o, get_rank=lambda: 0).save()


def _resnet18_shaped() -> torch.nn.Module:
    """ResNet-18's parameters and buffers (11.7 M parameters), without its forward."""
    layers = [torch.nn.Conv2d(3, 64, 7, bias=False), torch.nn.BatchNorm2d(64)]
    cin = 64
    for cout in (64, 128, 256, 512):
        for block in range(2):
            layers += [torch.nn.Conv2d(cin, cout, 3, bias=False), torch.nn.BatchNorm2d(cout),
                       torch.nn.Conv2d(cout, cout, 3, bias=False), torch.nn.BatchNorm2d(cout)]
            if block == 0 and cin != cout:
                layers += [torch.nn.Conv2d(cin, cout, 1, bias=False), torch.nn.BatchNorm2d(cout)]
            cin = cout
    layers.append(torch.nn.Linear(512, 1000))
    return torch.nn.ModuleList(layers)


def test_commit_of_a_resnet18_sized_model_and_adam_restores_exactly():
    """Prints the cost of ``commit()`` (not asserted: the machine is shared)."""
    torch.manual_seed(0)
    model = _resnet18_shaped()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    state = elastic.TorchState(model=model, optimizer=opt, epoch=0)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        state.commit()
        times.append(time.perf_counter() - start)
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moment = [s["exp_avg_sq"].clone() for s in opt.state.values()]
    for _ in range(2):
        opt.step()  # same gradients: every parameter and moment moves
        state.restore()
        assert all(torch.equal(v, expected_model[k]) for k, v in model.state_dict().items())
        assert all(torch.equal(s["exp_avg_sq"], m) for s, m in zip(opt.state.values(), expected_moment))
    best = min(times[1:]) * 1e6
    print(f"\ncommit(): ResNet-18-sized model ({params / 1e6:.2f} M params) + Adam state, CPU: "
          f"{best:.0f} us per commit (best of {len(times) - 1}, first {times[0] * 1e6:.0f} us)")


@pytest.mark.parametrize("size", [2, 3])
def test_torch_state_sync_commit_and_restore(size):
    results = run_ranks(scenarios.torch_state_sync_commit_restore, size, timeout=120)
    root = results[0]["before_sync"]
    for rank, r in enumerate(results):
        if rank:  # every tracked value started out different from rank 0's ...
            assert all(r["before_sync"][k] != root[k] for k in root), rank
        assert r["after_sync"] == root, rank  # ... and sync() gave each rank rank 0's
        assert r["rebinds"] == [r["momenta_before_sync"]], rank  # rebind ran once, before the broadcast
        assert r["committed"] == root, rank
        for modified in r["modified"]:
            assert all(modified[k] != r["committed"][k] for k in root), rank
        assert r["restored"] == [r["committed"]] * 2, rank
    # After sync every rank's shard is its part of the rest of rank 0's epoch.
    processed = results[0]["processed"]
    assert len(processed) == scenarios.BATCH * size
    shards = [r["shard"] for r in results]
    assert [len(s) for s in shards] == [r["len"] for r in results]
    assert sorted(processed + [i for s in shards for i in s]) == list(range(scenarios.DATASET_LEN))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_the_ranks_of_a_re_formed_job_agree_on_whether_to_sync():
    """A rank that judged on its own that the state needs a sync (it saw a round given up that a slower rank never
    read) and one that judged it does not: both sync, or one broadcasts while the other trains and both wait out
    GPUCOMM_TIMEOUT. Where none needs it, none syncs."""
    patterns = [(True, False), (False, True), (False, False), (True, True)]  # (rank 0's, rank 1's) judgement
    needs = [[p[rank] for p in patterns] for rank in range(2)]
    results = run_ranks(scenarios.ranks_agree_on_the_sync, 2, args=(needs,), timeout=120)
    assert results == [[True, True, False, True]] * 2, results
