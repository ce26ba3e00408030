"""Elastic training of the digits CNN: workers may die, join or leave, and training goes on.

Run it on one machine with a discovery script that lists local "hosts" (every 127.0.0.x address
is this machine's loopback, so each can stand for a host that fails or is added on its own):

    printf '127.0.0.1:1\\n127.0.0.2:1\\n' > /tmp/hosts.txt
    gpucomm-run -np 2 --min-np 1 --max-np 4 --host-discovery-script "cat /tmp/hosts.txt" \\
        python examples/elastic_train.py --epochs 20

While it trains, add a slot (``echo 127.0.0.3:1 >> /tmp/hosts.txt``), remove one (delete its
line), or kill a worker (``pkill -9 -f "elastic_train.py" -n``): the job re-forms with the workers
left, each continuing from the last commit, and the sampler re-shards the rest of the epoch.
On GPUs the same command pins each worker to the GPU of its local rank.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import gpucomm.torch as hvd
from train_digits import DigitsNet, digits_split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05, help="for one worker; scaled by the current number of workers")
    ap.add_argument("--batches-per-commit", type=int, default=5, help="commit the state this often (in memory)")
    ap.add_argument("--slow", type=float, default=0.0, help="seconds to sleep per batch (time to play with hosts)")
    args = ap.parse_args()

    hvd.init()
    torch.manual_seed(1234)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    x_train, x_test, y_train, y_test = digits_split()
    train_set = torch.utils.data.TensorDataset(x_train, y_train)

    model = DigitsNet().to(device)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=7)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0)

    def on_reset() -> None:  # the number of workers changed: keep the per-worker learning rate
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"job re-formed: {hvd.size()} worker(s) from epoch {state.epoch} batch {state.batch}", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state) -> None:
        while state.epoch < args.epochs:
            loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
            model.train()
            for idx, (data, target) in enumerate(loader):
                data, target = data.to(device), target.to(device)
                optimizer.zero_grad()
                F.cross_entropy(model(data), target).backward()
                optimizer.step()
                sampler.record_batch(idx, args.batch_size)
                state.batch += 1
                if args.slow:
                    time.sleep(args.slow)
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
            accuracy = evaluate(model, x_test, y_test, device)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: test accuracy {accuracy:.1%} on {hvd.size()} worker(s)", flush=True)
            state.epoch += 1
            state.batch = 0
            sampler.set_epoch(state.epoch)  # at the end of the epoch (Horovod's rule)
            state.commit()

    train(state)
    accuracy = evaluate(model, x_test, y_test, device)  # a collective: every worker takes part
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.1%}", flush=True)
    hvd.shutdown()


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    """Accuracy over the whole test set, each worker scoring its share."""
    model.eval()
    mine = slice(hvd.rank(), None, hvd.size())
    with torch.no_grad():
        correct = (model(x[mine].to(device)).argmax(1) == y[mine].to(device)).sum().float()
    counts = hvd.allreduce(torch.stack([correct.cpu(), torch.tensor(float(len(y[mine])))]), op=hvd.Sum,
                           name="evaluate")
    return float(counts[0] / counts[1])


if __name__ == "__main__":
    main()
