"""Rank functions for tests/test_sparse.py (module level, so the rank pool can import them):
``hvd.sparse_allreduce_async``, ``DistributedOptimizer`` with sparse gradients, and
``hvd.broadcast_optimizer_state`` with missing gradients or state (issue 19).

Every reference is computed in the rank itself without gpucomm: the other ranks' inputs are
rebuilt from their seeds, and the reference training is one process that sums the ranks' losses
(each the mean over its equal shard) and divides by the number of ranks, which is the full-batch
mean.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import gpucomm.torch as hvd


def _size_hint() -> int:
    return int(os.environ["GPUCOMM_SIZE"])


# ---------------------------------------------------------------------------------------------
# sparse_allreduce_async

# (shape, sparse_dim, dtype, how): "plain" coalesced input, "dup" the same values split over
# duplicate indices (uncoalesced), "empty1" no entries on rank 1, "empty" no entries anywhere
CASES = [((17, 5), 1, torch.float32, "plain"), ((9, 4), 2, torch.float64, "dup"),
         ((12, 3, 2), 1, torch.float32, "empty1"), ((6, 4), 1, torch.float32, "empty")]


def rank_dense(case: int, rank: int) -> torch.Tensor:
    """What ``rank`` holds in ``case``, densely (the reference's input)."""
    shape, _, dtype, how = CASES[case]
    g = torch.Generator().manual_seed(100 * case + rank)
    dense = torch.randn(shape, generator=g, dtype=torch.float64)
    keep = torch.rand(shape[0], generator=g) < 0.4  # whole rows, as an embedding's gradient has
    if how == "empty" or (how == "empty1" and rank == 1):
        keep[:] = False
    dense[~keep] = 0
    return dense.to(dtype)


def rank_sparse(case: int, rank: int) -> torch.Tensor:
    shape, sparse_dim, _, how = CASES[case]
    t = rank_dense(case, rank).to_sparse(sparse_dim)
    if how == "dup":
        t = torch.sparse_coo_tensor(torch.cat([t.indices(), t.indices()], 1),
                                    torch.cat([t.values() * 0.25, t.values() * 0.75]), shape, check_invariants=True)
        assert not t.is_coalesced()
    return t


def sparse_allreduce_cases() -> dict:
    """Every case with Average and Sum (all handles started before any is waited on), against the
    dense sum of every rank's tensor; at 3 ranks also on the process set {0, 1}; bad input."""
    pair = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[pair] if _size_hint() > 2 else None)
    r, n = hvd.rank(), hvd.size()
    checked = 0
    runs = [(hvd.global_process_set, list(range(n)))]
    if n > 2:
        runs.append((pair, [0, 1]))
    for ps, members in runs:
        if r not in members:
            try:
                hvd.sparse_allreduce_async(rank_sparse(0, r), name="outsider", op=hvd.Sum, process_set=ps)
            except ValueError as e:
                assert "not a member" in str(e), e
            else:
                raise AssertionError("a rank outside the process set must be refused")
            continue
        inputs = {(c, op): rank_sparse(c, r) for c in range(len(CASES)) for op in ("avg", "sum")}
        kept = {k: v.clone() for k, v in inputs.items()}
        handles = {(c, op): hvd.sparse_allreduce_async(t, name=f"sp.{ps.process_set_id}.{c}.{op}",
                                                        op=hvd.Average if op == "avg" else hvd.Sum, process_set=ps)
                   for (c, op), t in inputs.items()}
        assert all(callable(h) for h in handles.values())
        for (c, op), handle in handles.items():
            out = handle()
            ref = sum(rank_dense(c, m).double() for m in members)
            if op == "avg":
                ref = ref / len(members)
            shape, _, dtype, _ = CASES[c]
            assert out.is_sparse and out.is_coalesced(), (c, op)
            assert out.shape == shape and out.dtype == dtype, (c, op, out.shape, out.dtype)
            assert torch.allclose(out.to_dense().double(), ref, atol=1e-6), (c, op, (out.to_dense() - ref).abs().max())
            assert torch.equal(inputs[(c, op)].to_dense(), kept[(c, op)].to_dense())  # input untouched
            checked += 1
    errors = []
    for bad in (lambda: hvd.sparse_allreduce_async(rank_sparse(0, r), name="max", op=hvd.Max),
                lambda: hvd.sparse_allreduce_async(torch.ones(3), name="dense", op=hvd.Sum)):
        try:
            bad()
        except (ValueError, TypeError) as e:
            errors.append(str(e))
        else:
            errors.append(None)
    hvd.barrier()
    hvd.shutdown()
    return {"checked": checked, "errors": errors}


# ---------------------------------------------------------------------------------------------
# DistributedOptimizer with sparse gradients

VOCAB, DIM, OUT, BATCH, TOKENS = 30, 4, 3, 12, 3  # BATCH divides by 2 and by 3


class SparseNet(nn.Module):
    """Two sparse embeddings (the second only on some ranks in some steps) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.extra = nn.Embedding(VOCAB, DIM, sparse=True)
        self.head = nn.Linear(DIM, OUT)

    def forward(self, ids: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        h = self.emb(ids).mean(1)
        if extra is not None:
            h = h + self.extra(extra).mean(1)
        return self.head(h)


def step_data(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + 10 * step + micro)
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g)
    extra = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g)
    return ids, extra, torch.randn(BATCH, OUT, generator=g)


def uses_extra(step: int, rank: int, size: int) -> bool:
    """Step 0: rank 0 only (the others' hooks never fire for it when its sparseness is first seen);
    step 2: the last rank only; otherwise every rank."""
    return rank == 0 if step == 0 else rank == size - 1 if step == 2 else True


def rank_loss(model: nn.Module, step: int, micro: int, rank: int, size: int) -> torch.Tensor:
    """The mean loss over ``rank``'s shard of the batch, as that rank computes it."""
    ids, extra, y = step_data(step, micro)
    k = BATCH // size
    part = slice(rank * k, (rank + 1) * k)
    return nn.functional.mse_loss(model(ids[part], extra[part] if uses_extra(step, rank, size) else None), y[part])


def train(sparse_as_dense: bool, steps: int, passes: int) -> tuple[nn.Module, dict]:
    """This rank's training: SGD through DistributedOptimizer; with ``passes`` > 1, gradients of
    ``passes`` micro-batches accumulate, then ``synchronize()`` and ``step()`` under
    ``skip_synchronize()``; the zero_grad guard is tried after each backward."""
    r, n = hvd.rank(), hvd.size()
    model = SparseNet()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense,
                                   backward_passes_per_step=passes)
    seen = {"grad_sparse": [], "guard": []}
    for s in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            rank_loss(model, s, micro, r, n).backward()
        if uses_extra(s, r, n):  # (the guard counts launched buckets: one waiting for an unused gradient is not)
            try:
                opt.zero_grad()
            except AssertionError as e:
                seen["guard"].append("zero_grad() was called after loss.backward()" in str(e))
            else:
                seen["guard"].append(False)
        if passes > 1:
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        seen["grad_sparse"].append((model.emb.weight.grad.is_sparse, model.extra.weight.grad.is_sparse,
                                    model.head.weight.grad.is_sparse))
    held = opt._buckets.holds
    seen["in_buckets"] = (held(model.emb.weight), held(model.extra.weight), held(model.head.weight))
    return model, seen


def reference(steps: int, passes: int, size: int) -> nn.Module:
    """One process: the mean of the ranks' shard losses, the same SGD."""
    model = SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for s in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            (sum(rank_loss(model, s, micro, rank, size) for rank in range(size)) / size).backward()
        opt.step()
    return model


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def sparse_training() -> dict:
    hvd.init()
    n = hvd.size()
    out = {}
    for label, sparse_as_dense, steps, passes in (("sparse", False, 5, 1), ("dense", True, 5, 1),
                                                  ("sparse_passes", False, 4, 2)):
        model, seen = train(sparse_as_dense, steps, passes)
        seen["diff"] = max_abs_diff(model, reference(steps, passes, n))
        out[label] = seen
    out["sparse_adam"] = sparse_adam_only()
    hvd.shutdown()
    return out


def sparse_adam_only() -> dict:
    """Horovod's own case: a model that is only a sparse embedding, SparseAdam, inputs of a
    different shape on each rank; with and without sparse_as_dense. Once the embedding leaves the
    buckets (without sparse_as_dense) no bucket is left: the zero_grad guard sees the sparse
    reduction in flight."""
    r, n = hvd.rank(), hvd.size()

    def inputs(step: int, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(50 * step + rank)
        return torch.randint(0, 10, (2, 3 + rank), generator=g)

    out = {}
    for sparse_as_dense in (False, True):
        torch.manual_seed(1)
        model = nn.Embedding(10, 3, sparse=True)
        ref = nn.Embedding(10, 3, sparse=True)
        ref.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(model.parameters()), lr=0.1),
                                       sparse_as_dense=sparse_as_dense)
        ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.1)
        guards = []
        for s in range(3):
            opt.zero_grad()
            model(inputs(s, r)).sum().backward()
            try:
                opt.zero_grad()
            except AssertionError:
                guards.append(True)
            else:
                guards.append(False)
            opt.step()
            ref_opt.zero_grad()
            (sum(ref(inputs(s, rank)).sum() for rank in range(n)) / n).backward()
            ref_opt.step()
        out[sparse_as_dense] = {"diff": float((model.weight - ref.weight).detach().abs().max()), "guards": guards,
                                "buckets": len(opt._buckets.buckets)}
    return out


# ---------------------------------------------------------------------------------------------
# broadcast_optimizer_state


class StateNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 2)
        self.unused = nn.Linear(6, 2)  # never in the forward: its gradient stays None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to_dense().cpu() if obj.is_sparse else obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _same(a, b, where: str = "") -> str | None:
    """None if ``a`` and ``b`` are equal (tensors exactly, with dtype), else where they differ."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return None if ok else where
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where} keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        return next((d for k in a if (d := _same(a[k], b[k], f"{where}.{k}")) is not None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where} lengths {len(a)} != {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _same(x, y, f"{where}[{i}]")) is not None), None)
    return None if a == b else f"{where}: {a!r} != {b!r}"


def _check_equal_to_root(opt: torch.optim.Optimizer, label: str) -> dict:
    """Every rank's state_dict equals rank 0's (tensors and hyper-parameters)."""
    everyone = hvd.allgather_object(_cpu(opt.state_dict()), name=f"state.{label}")
    for rank, sd in enumerate(everyone):
        diff = _same(everyone[0], sd)
        assert diff is None, f"{label}: rank {rank}'s optimizer state differs from root's at {diff}"
    return everyone[0]


def _steps(state_dict: dict) -> list[float]:
    return sorted({float(s["step"]) for s in state_dict["state"].values()})


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def optimizer_state_cases() -> dict:
    hvd.init()
    r = hvd.rank()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(11))
    found: dict = {}

    # (a) root has stepped (partial state: `unused` has no gradient, hence no state); the others are
    # fresh with other hyper-parameters, rank 1 even holds gradients but no state
    model = StateNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01 if r == 0 else 0.5, betas=(0.8, 0.9) if r == 0 else (0.5, 0.5))
    if r == 0:
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    elif r == 1:
        model(x).sum().backward()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = _params(model)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert all(torch.equal(p, q) for p, q in zip(before, _params(model))), "broadcast_optimizer_state moved parameters"
    root = _check_equal_to_root(opt, "partial")
    found["partial"] = {"lr": root["param_groups"][0]["lr"], "betas": tuple(root["param_groups"][0]["betas"]),
                        "with_state": sorted(root["state"]), "steps": _steps(root)}

    # (b) fresh everywhere, wrapped in DistributedOptimizer: state is materialised by the wrapped
    # optimizer's own step on zero gradients (weight decay must not move the parameters), then
    # training proceeds
    model = StateNet()
    dopt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5),
                                    named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = _params(model)
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    assert all(torch.equal(p, q) for p, q in zip(before, _params(model))), "materialising state moved parameters"
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters()), "no zero gradients left (Horovod)"
    root = _check_equal_to_root(dopt, "fresh")
    found["fresh"] = {"with_state": sorted(root["state"]), "steps": _steps(root),
                      "zero_moments": all(not s["exp_avg"].any() for s in root["state"].values())}
    dopt.zero_grad()
    model(x).pow(2).mean().backward()
    dopt.step()  # a distributed step afterwards works on every rank
    found["fresh"]["trained"] = _check_equal_to_root(dopt, "fresh.after")["state"][0]["step"].item()

    # (c) ``model=``: sparse embeddings get sparse zero gradients (SparseAdam needs them; SGD keeps
    # a sparse momentum buffer, as training will produce)
    torch.manual_seed(5)
    emb = nn.Embedding(10, 3, sparse=True)
    sadam = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
    hvd.broadcast_optimizer_state(sadam, root_rank=0, model=emb)
    root = _check_equal_to_root(sadam, "sparse_adam")
    found["sparse_adam"] = sorted(root["state"])
    net = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 2))
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(sgd, root_rank=0, model=net)
    _check_equal_to_root(sgd, "sgd")
    found["sgd_sparse_buffer"] = [sgd.state[p]["momentum_buffer"].is_sparse for p in net.parameters()]
    hvd.shutdown()
    return found


def sparse_allreduce_cuda() -> bool:
    """The cases of ``sparse_allreduce_cases`` on this rank's GPU (NCCL), Average."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    device = f"cuda:{torch.cuda.current_device()}"
    handles = [hvd.sparse_allreduce_async(rank_sparse(c, r).to(device), name=f"cuda.{c}", op=hvd.Average)
               for c in range(len(CASES))]
    for c, handle in enumerate(handles):
        out = handle()
        ref = sum(rank_dense(c, m).double() for m in range(n)) / n
        assert out.is_sparse and out.device.type == "cuda", (c, out.device)
        assert torch.allclose(out.to_dense().double().cpu(), ref, atol=1e-6), c
    hvd.shutdown()
    return True
