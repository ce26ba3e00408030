"""Elastic training on a Ray cluster with Horovod's Ray API: ``gpucomm.ray.ElasticRayExecutor``.

Each Ray worker actor runs ``train_fn``: ``hvd.init()``, a small CNN on scikit-learn's bundled
digits (no download), ``hvd.DistributedOptimizer``, and ``@hvd.elastic.run`` training that
commits its state every few batches. When a worker dies (or Ray loses its node), the others
restore the last commit and the job re-forms with the workers left; slots that appear later join.
The driver serves the job's store; ``executor.run`` returns every final worker's result by rank.

    python examples/ray_elastic_train.py                      # a local Ray with 2 CPUs: 2 workers
    python examples/ray_elastic_train.py --address auto       # an existing cluster (`ray start --head`)
    python examples/ray_elastic_train.py --fail-at-batch 5    # one worker kills itself once: watch it re-form

With ``import horovod.torch as hvd`` and ``from horovod.ray import ElasticRayExecutor`` the same
file runs on Horovod.
"""

from __future__ import annotations

import argparse
import os
import signal

import ray
import torch
import torch.nn as nn
import torch.nn.functional as F

import gpucomm.torch as hvd
from gpucomm.ray import ElasticRayExecutor

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")
parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray started without --address")
parser.add_argument("--min-workers", type=int, default=1)
parser.add_argument("--max-workers", type=int, default=2)
parser.add_argument("--cpus-per-slot", type=int, default=1)
parser.add_argument("--use-gpu", action="store_true")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--lr", type=float, default=0.05, help="for one worker; scaled by the number of workers")
parser.add_argument("--batches-per-commit", type=int, default=4)
parser.add_argument("--fail-at-batch", type=int, default=None,
                    help="once, rank 1 kills its own process (SIGKILL) at this batch of the first epoch")
parser.add_argument("--elastic-timeout", type=float, default=60.0)
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits: 75 % to train, 25 % to test, the same split on every worker."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return train_test_split(x, torch.tensor(data.target), test_size=0.25, random_state=0, stratify=data.target)


def train_fn() -> dict:
    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if args.use_gpu else torch.device("cpu")
    x_train, x_test, y_train, y_test = digits()
    train_set = torch.utils.data.TensorDataset(x_train, y_train)
    model = Net().to(device)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=7)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0,
                                   failed_once=False)
    sizes = set()

    def on_reset() -> None:  # after a re-form: the learning rate follows the number of workers
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        state.failed_once = True
        if hvd.rank() == 0:
            print(f"job re-formed: {hvd.size()} worker(s) from epoch {state.epoch} batch {state.batch}", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state) -> None:
        while state.epoch < args.epochs:
            loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
            model.train()
            for idx, (data, target) in enumerate(loader):
                sizes.add(hvd.size())
                if (args.fail_at_batch is not None and not state.failed_once and state.epoch == 0
                        and state.batch == args.fail_at_batch and hvd.rank() == 1):
                    os.kill(os.getpid(), signal.SIGKILL)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(data.to(device)), target.to(device))
                loss.backward()
                optimizer.step()
                sampler.record_batch(idx, args.batch_size)
                state.batch += 1
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
            state.epoch += 1
            state.batch = 0
            sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    accuracy = evaluate(model, x_test, y_test, device)
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.1%} on {hvd.size()} worker(s)", flush=True)
    return {"rank": hvd.rank(), "size": hvd.size(), "epochs": state.epoch, "accuracy": accuracy,
            "sizes": sorted(sizes), "weights_sum": float(sum(p.detach().double().sum() for p in model.parameters()))}


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    """Accuracy over the whole test set, each worker scoring its share (a collective)."""
    model.eval()
    mine = slice(hvd.rank(), None, hvd.size())
    with torch.no_grad():
        correct = (model(x[mine].to(device)).argmax(1) == y[mine].to(device)).sum().float()
    counts = hvd.allreduce(torch.stack([correct.cpu(), torch.tensor(float(len(y[mine])))]), op=hvd.Sum,
                           name="evaluate")
    return float(counts[0] / counts[1])


if __name__ == "__main__":
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_cpus)
    settings = ElasticRayExecutor.create_settings(min_num_proc=args.min_workers, max_num_proc=args.max_workers,
                                                  elastic_timeout=args.elastic_timeout, verbose=True)
    executor = ElasticRayExecutor(settings, use_gpu=args.use_gpu, cpus_per_slot=args.cpus_per_slot)
    executor.start()
    for result in executor.run(train_fn):
        print(f"worker result: {result}", flush=True)
    ray.shutdown()
