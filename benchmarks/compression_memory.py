"""Less traffic, less memory: PowerSGD and ZeRO-1 beside their PyTorch anchors, in one job.

    gpucomm-run -np 2 python benchmarks/compression_memory.py [--models vgg16,resnet18] [--json out.json]
    gpucomm-run -np 4 python benchmarks/compression_memory.py --parts zero --zero-models vgg16-cifar,resnet18

Part ``compression``: for each model and each configuration, gpucomm's DistributedOptimizer and
PyTorch DDP (on Gloo, a process group of its own in the same job) train identical copies on the same
CIFAR-shaped batches, rounds alternating between them (gpucomm, DDP, gpucomm, ...):

| configuration | gpucomm | DDP anchor |
|---|---|---|
| none | ``Compression.none`` | ``default_hooks.allreduce_hook`` |
| fp16 | ``Compression.fp16`` | ``default_hooks.fp16_compress_hook`` |
| powersgd rank R | ``Compression.powersgd(rank=R, start_iter=2)`` | ``powerSGD_hook`` with ``PowerSGDState(rank R, start_powerSGD_iter=2)``, one bucket |

(both PowerSGDs with ``min_compression_rate=2``, error feedback and warm start). DDP's PowerSGD runs
with one bucket (``bucket_cap_mb_list``): its hook issues each bucket's P and Q allreduces from
future callbacks, so with several buckets the ranks can issue them in different orders, and Gloo
aborts the job ("Received data size doesn't match expected size"); with one bucket its
communication cannot overlap backward. gpucomm's two phases run in the same order on every rank, on
its usual buckets. Bytes per step on the
wire are measured, not computed: gpucomm's from its counters (``hvd.stats()["bytes"]``: the input
size of every collective this rank issued), DDP's by counting, in the same way, the tensors its hooks
hand to ``torch.distributed.all_reduce``. gpucomm's add a few bytes: bucket 0's 4-byte training
flag and, under the default finite check (``GPUCOMM_CHECK_FINITE=auto``), one element per rank in
every bucket (the slots that name the rank that went non-finite). The reduction factors are against each one's uncompressed
bytes measured in the same run. Warm-up steps (past ``start_iter`` and gpucomm's first re-cut) are
not measured. gpucomm's control rounds over the measured steps are printed (0: the fixed schedule).

Part ``zero``: per-rank optimizer-state bytes (the tensors in the optimizer state this rank holds,
measured after warm-up) and step time of Adam with gpucomm's DistributedOptimizer (unsharded), with
``hvd.ZeroRedundancyOptimizer`` (ZeRO-1), and with ``torch.distributed.optim.ZeroRedundancyOptimizer``
over DDP (the anchor), rounds interleaved across the three.

Every step time is the slowest rank's median over the measured steps. Models: ``vgg16``
(torchvision's VGG-16 shapes, 138.4 M parameters, 528 MiB of float32 gradients), ``vgg16-cifar``
(VGG-16's convolutions with a 512-512-10 classifier, 15.0 M), ``resnet18`` (11.7 M), ``cnn`` (a
small conv net for ``--quick``), all on 3x32x32 inputs. Prints each figure beside its anchor with the
load average; writes JSON. ``--quick``: the small conv net, one round of one step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpucomm.torch as hvd  # noqa: E402
from gpucomm.scaling import zoo  # noqa: E402
from bench_stats import fmt, ratio, write_json  # noqa: E402
from torch_group import init_torch_group  # noqa: E402


def build(name: str) -> nn.Module:
    if name == "vgg16":
        return zoo.vgg16(num_classes=10)
    if name == "vgg16-cifar":
        features = zoo.vgg16(num_classes=10)[0]
        return nn.Sequential(features, nn.Flatten(), nn.Linear(512, 512), nn.ReLU(inplace=True),
                             nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Linear(512, 10))
    if name == "resnet18":
        return zoo.resnet(18, num_classes=10)
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4), nn.Conv2d(32, 64, 3, padding=1),
                             nn.ReLU(), nn.MaxPool2d(8), nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    raise ValueError(name)


MODELS = ("vgg16", "vgg16-cifar", "resnet18", "cnn")


class WireCounter:
    """Bytes this rank hands to ``torch.distributed``'s all_reduce and (as the source) broadcast:
    what DDP's Python hooks and torch's ZeroRedundancyOptimizer send, counted as gpucomm counts its
    own (each collective's input)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._originals: dict[str, Callable] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator["WireCounter"]:
        def counting(name: str, original: Callable) -> Callable:
            def call(*args: Any, **kwargs: Any) -> Any:
                tensor = kwargs.get("tensor", args[0] if args else None)
                src = kwargs.get("src", args[1] if name == "broadcast" and len(args) > 1 else None)
                if isinstance(tensor, torch.Tensor) and (name != "broadcast" or src == dist.get_rank()):
                    self.bytes += tensor.numel() * tensor.element_size()
                return original(*args, **kwargs)
            return call

        for name in ("all_reduce", "broadcast"):
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, counting(name, self._originals[name]))
        try:
            yield self
        finally:
            for name, original in self._originals.items():
                setattr(dist, name, original)


def batches(n: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


class Runner:
    """One configuration: a model copy, its optimizer, how its bytes are read; ``step()`` trains one
    step and records its time and bytes."""

    def __init__(self, label: str, model: nn.Module, opt: torch.optim.Optimizer, sent: Callable[[], int],
                 forward: nn.Module | None = None) -> None:
        self.label, self.model, self.opt, self.sent = label, model, opt, sent
        self.forward = forward if forward is not None else model
        self.times: list[float] = []
        self.bytes: list[int] = []
        self.control: list[int] = []
        self.collectives: list[int] = []

    def step(self, data: tuple[torch.Tensor, torch.Tensor], measure: bool) -> None:
        before = hvd.stats()
        before_bytes = self.sent()
        start = time.perf_counter()
        self.opt.zero_grad()
        F.cross_entropy(self.forward(data[0]), data[1]).backward()
        self.opt.step()
        elapsed = time.perf_counter() - start
        if measure:
            after = hvd.stats()
            self.times.append(elapsed)
            self.bytes.append(self.sent() - before_bytes)
            self.control.append(after["control_rounds"] - before["control_rounds"])
            self.collectives.append(after["collectives"] - before["collectives"])

    def result(self) -> dict:
        """Medians per step; ``collectives_per_step`` counts gpucomm's backend calls (0 for DDP's side)."""
        return {"median_step_s": statistics.median(self.times) if self.times else None,
                "bytes_per_step": statistics.median(self.bytes) if self.bytes else None,
                "control_rounds": sum(self.control),
                "collectives_per_step": statistics.median(self.collectives) if self.collectives else None}


def interleave(runners: list[Runner], data: list, warmup: int, rounds: int, steps: int) -> None:
    """Warm every runner up, then ``rounds`` rounds of ``steps`` steps each, runners alternating."""
    for runner in runners:
        for k in range(warmup):
            runner.step(data[k % len(data)], measure=False)
    for r in range(rounds):
        for runner in runners:
            for k in range(steps):
                runner.step(data[(r * steps + k) % len(data)], measure=True)


def gpucomm_bytes() -> int:
    return hvd.stats()["bytes"]


def compression_part(name: str, args: argparse.Namespace, counter: WireCounter, data: list) -> list[dict]:
    torch.manual_seed(0)
    base = build(name)
    configs: list[tuple[str, Any, Callable[[DDP], None]]] = [
        ("none", hvd.Compression.none, lambda ddp: ddp.register_comm_hook(None, default_hooks.allreduce_hook)),
        ("fp16", hvd.Compression.fp16, lambda ddp: ddp.register_comm_hook(None, default_hooks.fp16_compress_hook))]
    for r in args.powersgd_ranks:
        configs.append((f"powersgd r{r}", hvd.Compression.powersgd(rank=r, start_iter=2, min_compression_rate=2),
                        lambda ddp, r=r: ddp.register_comm_hook(
                            powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                                        start_powerSGD_iter=2, min_compression_rate=2,
                                                        use_error_feedback=True, warm_start=True, random_seed=0),
                            powerSGD_hook.powerSGD_hook)))
    results = []
    for label, compression, hook in configs:
        mine = copy.deepcopy(base)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(mine.parameters(), lr=1e-3),
                                       named_parameters=mine.named_parameters(), compression=compression)
        theirs = copy.deepcopy(base)
        # DDP's powerSGD_hook issues each bucket's P and Q allreduces from future callbacks, so with several
        # buckets the ranks can issue them in different orders: on Gloo that aborts ("Received data size doesn't
        # match expected size"), seen here. Its anchor therefore runs DDP with one bucket (no overlap).
        one_bucket = one_bucket_args(base) if label.startswith("powersgd") else {}
        ddp = DDP(theirs, gradient_as_bucket_view=True, **one_bucket)
        hook(ddp)
        runners = [Runner(f"gpucomm {label}", mine, opt, gpucomm_bytes),
                   Runner(f"DDP {label}", theirs, torch.optim.SGD(theirs.parameters(), lr=1e-3), lambda: counter.bytes,
                          forward=ddp)]
        interleave(runners, data, args.warmup, args.rounds, args.steps)
        results.append({"config": label, "gpucomm": runners[0].result(), "ddp": runners[1].result()})
        opt.close()
        del runners, opt, ddp, mine, theirs
        gc.collect()
    return results


def one_bucket_args(model: nn.Module) -> dict[str, Any]:
    """DDP's arguments that put all of ``model``'s gradients in one bucket: ``bucket_cap_mb_list`` where this torch's
    DDP has it; else none are needed while the model fits DDP's first bucket (1 MiB), and beyond that this torch
    cannot (SystemExit saying so)."""
    mb = math.ceil(model_bytes(model) / 2**20) + 1
    if "bucket_cap_mb_list" in inspect.signature(DDP.__init__).parameters:
        return {"bucket_cap_mb_list": [mb]}
    if model_bytes(model) <= 1 << 20:
        return {}
    raise SystemExit(f"compression_memory: DDP's PowerSGD anchor needs all gradients in one bucket, and this torch's DDP "
                     f"(torch {torch.__version__}, no bucket_cap_mb_list) caps its first bucket at 1 MiB while the model "
                     f"holds {model_bytes(model) / 2**20:.1f} MiB. Use a newer torch, or a model under 1 MiB.")


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in the optimizer state this rank holds."""
    state = opt.optim.state if hasattr(opt, "optim") else opt.state
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if torch.is_tensor(v))


def zero_part(name: str, args: argparse.Namespace, counter: WireCounter, data: list) -> list[dict]:
    torch.manual_seed(0)
    base = build(name)
    plain_model, zero_model, torch_model = (copy.deepcopy(base) for _ in range(3))
    plain = hvd.DistributedOptimizer(torch.optim.Adam(plain_model.parameters(), lr=1e-4),
                                     named_parameters=plain_model.named_parameters())
    zero = hvd.ZeroRedundancyOptimizer(zero_model.parameters(), torch.optim.Adam,
                                       named_parameters=zero_model.named_parameters(), lr=1e-4)
    ddp = DDP(torch_model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # DDP's allreduce, from Python (counted)
    anchor = TorchZero(torch_model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    runners = [Runner("gpucomm Adam (unsharded)", plain_model, plain, gpucomm_bytes),
               Runner("gpucomm ZeRO-1 Adam", zero_model, zero, gpucomm_bytes),
               Runner("torch DDP + ZeroRedundancyOptimizer(Adam)", torch_model, anchor, lambda: counter.bytes,
                      forward=ddp)]
    interleave(runners, data, args.warmup, args.rounds, args.steps)
    results = [{"config": r.label, **r.result(), "state_bytes": state_bytes(r.opt)} for r in runners]
    plain.close()
    zero.close()
    del runners, plain, zero, anchor, ddp
    gc.collect()
    return results


def slowest(per_rank: list[dict], key: str) -> float | None:
    values = [d[key] for d in per_rank if d.get(key) is not None]
    return max(values) if values else None


def mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.3f} MB"


def report(doc: dict) -> None:
    size, load = doc["ranks"], doc["load_average"]
    for model in doc["compression"]:
        entries = doc["compression"][model]
        print(f"\n# compression: {model} ({doc['parameters'][model] / 1e6:.1f} M parameters), {size} ranks, batch "
              f"{doc['batch_size']} per rank (load average {load['start']:.2f} -> {load['end']:.2f})")
        print(f"{'config':14s} {'gpucomm bytes/step':>19s} {'reduction':>10s} {'DDP bytes/step':>16s} {'reduction':>10s} "
              f"{'gpucomm step s':>15s} {'DDP step s':>11s} {'gpucomm/DDP':>12s} {'control rounds':>15s}")
        base_g, base_d = entries[0]["gpucomm"]["bytes_per_step"], entries[0]["ddp"]["bytes_per_step"]
        for e in entries:
            g, d = e["gpucomm"], e["ddp"]
            print(f"{e['config']:14s} {mb(g['bytes_per_step']):>19s} {fmt(ratio(base_g, g['bytes_per_step']), '.1f'):>9s}x "
                  f"{mb(d['bytes_per_step']):>16s} {fmt(ratio(base_d, d['bytes_per_step']), '.1f'):>9s}x "
                  f"{fmt(g['median_step_s'], '.4f'):>15s} {fmt(d['median_step_s'], '.4f'):>11s} "
                  f"{fmt(ratio(g['median_step_s'], d['median_step_s']), '.3f'):>12s} {g['control_rounds']:>15d}")
    for model in doc["zero"]:
        entries = doc["zero"][model]
        print(f"\n# ZeRO-1 (Adam): {model} ({doc['parameters'][model] / 1e6:.1f} M parameters), {size} ranks "
              f"(load average {load['start']:.2f} -> {load['end']:.2f})")
        print(f"{'config':44s} {'state bytes/rank (max)':>23s} {'of unsharded':>13s} {'step s':>8s} {'bytes/step':>14s}")
        unsharded = entries[0]["state_bytes_max"]
        for e in entries:
            print(f"{e['config']:44s} {mb(e['state_bytes_max']):>23s} {fmt(ratio(e['state_bytes_max'], unsharded), '.3f'):>13s} "
                  f"{fmt(e['median_step_s'], '.4f'):>8s} {mb(e['bytes_per_step']):>14s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="compression,zero")
    ap.add_argument("--models", default="vgg16,resnet18", help="models of the compression part")
    ap.add_argument("--zero-models", default="vgg16,resnet18", help="models of the ZeRO part")
    ap.add_argument("--powersgd-ranks", default="1,2,4,8")
    ap.add_argument("--batch-size", type=int, default=4, help="per rank (default 4)")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured steps per configuration (default 4)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="steps per round")
    ap.add_argument("--quick", action="store_true", help="smoke run: the small conv net, one round of one step")
    ap.add_argument("--json", default="compression_memory.json")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    models = [m for m in args.models.split(",") if m]
    zero_models = [m for m in args.zero_models.split(",") if m]
    try:
        args.powersgd_ranks = [int(r) for r in args.powersgd_ranks.split(",") if r]
    except ValueError:
        args.powersgd_ranks = [0]
    if args.quick:
        models = zero_models = ["cnn"]
        args.rounds, args.steps, args.warmup, args.powersgd_ranks = 1, 1, 3, [1, 4]
    if (any(p not in ("compression", "zero") for p in parts) or any(m not in MODELS for m in models + zero_models)
            or min(args.powersgd_ranks, default=0) < 1 or min(args.batch_size, args.rounds, args.steps) < 1
            or args.warmup < 3):
        print(f"compression_memory.py: --parts takes compression,zero; models are {', '.join(MODELS)}; PowerSGD "
              f"ranks, --batch-size, --rounds and --steps must be at least 1 and --warmup at least 3 (past start_iter "
              f"and the first re-cut)", file=sys.stderr)
        raise SystemExit(2)
    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    store = init_torch_group("gloo")
    counter = WireCounter()
    data = batches(args.rounds * args.steps + args.warmup, args.batch_size, seed=100 + hvd.rank())
    doc: dict[str, Any] = {"ranks": hvd.size(), "batch_size": args.batch_size, "quick": args.quick,
                           "warmup": args.warmup, "rounds": args.rounds, "steps_per_round": args.steps,
                           "torch": torch.__version__, "load_average": {"start": os.getloadavg()[0]},
                           "parameters": {m: sum(p.numel() for p in build(m).parameters())
                                          for m in dict.fromkeys(models + zero_models)},
                           "compression": {}, "zero": {}}
    with counter.installed():
        if "compression" in parts:
            for model in models:
                mine = compression_part(model, args, counter, data)
                every = hvd.allgather_object(mine, name=f"bench.compression.{model}")
                doc["compression"][model] = [
                    {"config": e["config"], **{side: {
                        "bytes_per_step": e[side]["bytes_per_step"], "control_rounds": e[side]["control_rounds"],
                        "collectives_per_step": e[side]["collectives_per_step"],
                        "median_step_s": slowest([r[i][side] for r in every], "median_step_s"),
                        "per_rank_median_step_s": [r[i][side]["median_step_s"] for r in every]}
                        for side in ("gpucomm", "ddp")}} for i, e in enumerate(mine)]
        if "zero" in parts:
            for model in zero_models:
                mine = zero_part(model, args, counter, data)
                every = hvd.allgather_object(mine, name=f"bench.zero.{model}")
                doc["zero"][model] = [
                    {"config": e["config"], "bytes_per_step": e["bytes_per_step"],
                     "median_step_s": slowest([r[i] for r in every], "median_step_s"),
                     "state_bytes_per_rank": [r[i]["state_bytes"] for r in every],
                     "state_bytes_max": max(r[i]["state_bytes"] for r in every)} for i, e in enumerate(mine)]
    doc["load_average"]["end"] = os.getloadavg()[0]
    if hvd.rank() == 0:
        report(doc)
        write_json(args.json, doc)
    dist.destroy_process_group()
    del store
    hvd.shutdown()


if __name__ == "__main__":
    main()
