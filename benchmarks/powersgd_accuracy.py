"""PowerSGD's final accuracy beside uncompressed averaging, on two real training tasks, in one job.

    gpucomm-run -np 2 python benchmarks/powersgd_accuracy.py [--rank 4] [--seeds 3] [--json out.json]
    gpucomm-run -np 4 python benchmarks/powersgd_accuracy.py

Tasks: the digits CNN of ``examples/train_digits.py`` (scikit-learn's 8x8 digits; its 2-rank recipe at
every rank count: SGD with momentum 0.9, lr 0.1, global batch 64, 12 epochs; the example scales lr with
the ranks, and at 4 ranks lr 0.2 diverged in one seed of three with and without compression, which
says nothing about compression), and a small ResNet (ResNet-8: three stages
of one basic block, 16/32/64 channels, BatchNorm) on a synthetic CIFAR-shaped set (10 classes of
3x32x32 images: a low-frequency colour template per class, shifted by up to 6 pixels, flipped,
scaled in contrast and drowned in Gaussian noise of 4x the template's spread; 4,000 training and
4,000 test images, fixed seeds), trained with SGD + momentum under a one-cycle schedule (peak lr 0.1,
global batch 64) for 8 epochs. Each configuration trains from the same initial weights on the same
shards in the same order, for each seed: uncompressed (``Compression.none``) and PowerSGD
(``Compression.powersgd(rank=R, start_iter=10% of the steps)``). Prints every run's final test
accuracy, the mean per configuration and PowerSGD's difference in points, the bytes per step each
sent after ``start_iter`` (``hvd.stats()``) and the control rounds they cost; writes JSON.
``--quick``: one epoch of each on a tenth of the data, one seed (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from train_digits import DigitsNet, digits_split  # noqa: E402

import gpucomm.torch as hvd  # noqa: E402
from bench_stats import write_json  # noqa: E402


def synthetic_cifar(n: int, seed: int, noise: float = 4.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` CIFAR-shaped images of 10 classes (see the module doc); the classes are fixed, ``seed``
    draws the samples."""
    g = torch.Generator().manual_seed(1234)
    templates = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=32, mode="bilinear", align_corners=False)
    templates = templates / templates.flatten(1).std(1).view(10, 1, 1, 1)
    templates = 0.6 * templates + templates.mean(0, keepdim=True)  # classes share much of their look
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    shifts = torch.randint(-6, 7, (n, 2), generator=g)
    x = torch.stack([torch.roll(templates[c], (int(s[0]), int(s[1])), dims=(1, 2)) for c, s in zip(y, shifts)])
    flip = torch.rand(n, generator=g) < 0.5
    x[flip] = x[flip].flip(3)
    x = x * (0.5 + torch.rand(n, 1, 1, 1, generator=g)) + noise * torch.randn(x.shape, generator=g)
    return x, y


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class ResNet8(nn.Module):
    """A CIFAR ResNet with one basic block per stage (78 k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.stages = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2))
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1).flatten(1))


def task_data(task: str, quick: bool) -> tuple[torch.Tensor, ...]:
    if task == "digits":
        x_train, x_test, y_train, y_test = digits_split()
    else:
        n = 400 if quick else 4000
        x_train, y_train = synthetic_cifar(n, seed=1)
        x_test, y_test = synthetic_cifar(n, seed=2)
    return x_train, y_train, x_test, y_test


def train_once(task: str, compression_name: str, seed: int, args: argparse.Namespace) -> dict:
    """One training run of ``task``; returns its final test accuracy and what it sent."""
    r, n = hvd.rank(), hvd.size()
    x_train, y_train, x_test, y_test = task_data(task, args.quick)
    x_train, y_train = x_train[r::n], y_train[r::n]
    x_test, y_test = x_test[r::n], y_test[r::n]
    torch.manual_seed(seed)
    if task == "digits":  # the example's 2-rank recipe (global batch 64, lr 0.1) at every rank count
        model, epochs, batch = DigitsNet(), (1 if args.quick else 12), 64 // n
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        model, epochs, batch = ResNet8(), (1 if args.quick else 8), 64 // n
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    steps_per_epoch = len(x_train) // batch
    total = epochs * steps_per_epoch
    start_iter = max(2, total // 10)
    compression = (hvd.Compression.none if compression_name == "none" else
                   hvd.Compression.powersgd(rank=args.rank, start_iter=start_iter))
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    schedule = (torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total) if task == "resnet8" else None)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    counted = None
    started = time.perf_counter()
    step = 0
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed * 1000 + epoch * 10 + r))
        for k in range(steps_per_epoch):
            if step == start_iter + 2:  # past start_iter and the first re-cut: the steady state
                counted = (hvd.stats(), step)
            idx = perm[k * batch:(k + 1) * batch]
            opt.zero_grad()
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            opt.step()
            if schedule is not None:
                schedule.step()
            step += 1
    after = hvd.stats()
    seconds = time.perf_counter() - started
    model.eval()
    with torch.no_grad():
        correct = float((model(x_test).argmax(1) == y_test).sum())
    counts = hvd.allreduce(torch.tensor([correct, float(len(y_test))], dtype=torch.float64), op=hvd.Sum,
                           name=f"accuracy.{task}.{compression_name}.{seed}")
    opt.close()
    out = {"task": task, "compression": compression_name, "seed": seed, "accuracy": float(counts[0] / counts[1]),
           "steps": total, "start_iter": start_iter, "seconds": seconds}
    if counted is not None:
        before, at = counted
        out["bytes_per_step"] = (after["bytes"] - before["bytes"]) / (total - at)
        out["control_rounds"] = after["control_rounds"] - before["control_rounds"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD's approximation rank (default 4)")
    ap.add_argument("--seeds", type=int, default=3, help="runs per configuration (default 3)")
    ap.add_argument("--tasks", default="digits,resnet8")
    ap.add_argument("--quick", action="store_true", help="smoke run: one epoch on a tenth of the data, one seed")
    ap.add_argument("--json", default="powersgd_accuracy.json")
    args = ap.parse_args()
    tasks = [t for t in args.tasks.split(",") if t]
    if args.rank < 1 or args.seeds < 1 or any(t not in ("digits", "resnet8") for t in tasks):
        print("powersgd_accuracy.py: --rank and --seeds must be at least 1; --tasks takes digits,resnet8",
              file=sys.stderr)
        raise SystemExit(2)
    if args.quick:
        args.seeds = 1
    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    load = os.getloadavg()[0]
    runs = []
    for task in tasks:
        for seed in range(args.seeds):
            for name in ("none", "powersgd"):
                runs.append(train_once(task, name, seed, args))
                if hvd.rank() == 0:
                    last = runs[-1]
                    print(f"{task:8s} {name:9s} seed {seed}: accuracy {last['accuracy']:.4f} "
                          f"({last['seconds']:.1f} s)", flush=True)
    summary = []
    if hvd.rank() == 0:
        print(f"\n# PowerSGD rank {args.rank} vs uncompressed, {hvd.size()} ranks (load average "
              f"{load:.2f} -> {os.getloadavg()[0]:.2f})")
        print(f"{'task':8s} {'compression':12s} {'accuracy (mean)':>16s} {'per seed':>28s} {'bytes/step':>12s} "
              f"{'control rounds':>15s}")
        for task in tasks:
            means = {}
            for name in ("none", "powersgd"):
                mine = [x for x in runs if x["task"] == task and x["compression"] == name]
                accuracies = [x["accuracy"] for x in mine]
                means[name] = statistics.mean(accuracies)
                sent = [x.get("bytes_per_step") for x in mine if x.get("bytes_per_step") is not None]
                rounds = [x.get("control_rounds") for x in mine if x.get("control_rounds") is not None]
                summary.append({"task": task, "compression": name, "mean_accuracy": means[name],
                                "accuracies": accuracies, "bytes_per_step": sent[0] if sent else None,
                                "control_rounds": max(rounds) if rounds else None})
                print(f"{task:8s} {name:12s} {means[name]:16.4f} {' '.join(f'{a:.4f}' for a in accuracies):>28s} "
                      f"{(f'{sent[0]:.0f}' if sent else 'n/a'):>12s} {(str(max(rounds)) if rounds else 'n/a'):>15s}")
            diff = 100 * (means["powersgd"] - means["none"])
            summary.append({"task": task, "powersgd_minus_none_points": diff})
            print(f"{task:8s} PowerSGD - uncompressed: {diff:+.2f} points")
        write_json(args.json, {"ranks": hvd.size(), "rank": args.rank, "seeds": args.seeds, "quick": args.quick,
                              "load_average": [load, os.getloadavg()[0]], "runs": runs, "summary": summary})
    hvd.shutdown()


if __name__ == "__main__":
    main()
