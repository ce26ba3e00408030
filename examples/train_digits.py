"""Data-parallel training of a small CNN on scikit-learn's bundled digits images (no download).

Horovod's recipe with gpucomm: init (which pins each rank to its GPU), scale the learning rate,
wrap the optimizer, broadcast the initial state, checkpoint on rank 0, average the metrics. Runs
on CPU (Gloo) or GPUs (NCCL); change ``import gpucomm.torch as hvd`` to Horovod's and it runs there.

    gpucomm-run -np 2 python examples/train_digits.py
    torchrun --nproc-per-node 2 examples/train_digits.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import gpucomm.torch as hvd


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 8x8 digits as (x_train, x_test, y_train, y_test): 75 % / 25 %, stratified, the same on every rank."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    return train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by the number of ranks")
    ap.add_argument("--checkpoint", default="checkpoints/digits.pt", help="written by rank 0 after every epoch")
    ap.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    args = ap.parse_args()

    hvd.init()
    torch.manual_seed(1234)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    x_train, x_test, y_train, y_test = digits_split()
    # each rank trains on its own shard and evaluates its own share of the test set
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    x_test, y_test = x_test[hvd.rank()::hvd.size()].to(device), y_test[hvd.rank()::hvd.size()].to(device)

    model = DigitsNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    steps_per_epoch = len(x_train) // args.batch_size
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch * 100 + hvd.rank()))
        for step in range(steps_per_epoch):
            idx = perm[step * args.batch_size : (step + 1) * args.batch_size]
            loss = F.cross_entropy(model(x_train[idx].to(device)), y_train[idx].to(device))
            optimizer.zero_grad()
            loss.backward()  # gradients are averaged across ranks while backward runs
            optimizer.step()
        model.eval()
        with torch.no_grad():
            correct = (model(x_test).argmax(1) == y_test).sum().float()
            counts = hvd.allreduce(torch.stack([correct, torch.tensor(float(len(y_test)), device=device)]),
                                   op=hvd.Sum, name="eval")
        accuracy = (counts[0] / counts[1]).item()
        hvd.save_checkpoint({"epoch": epoch + 1, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
                            args.checkpoint)  # rank 0 only; atomic
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}  loss {loss.item():.4f}  test accuracy {accuracy:.4f}  "
                  f"({time.perf_counter() - start:.1f} s, {hvd.size()} ranks)", flush=True)
    if hvd.rank() == 0:
        print(f"final test accuracy: {accuracy:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
