"""Synthetic training throughput, with the flags and output of Horovod's
``pytorch_synthetic_benchmark.py`` (random data, so only compute and communication are measured).

    gpucomm-run -np 2 python examples/synthetic_benchmark.py --model cnn --no-cuda
    gpucomm-run -np 4 python examples/synthetic_benchmark.py --model resnet50

``--ddp`` runs the same loop with PyTorch DDP instead (start it with torchrun), for comparison:

    torchrun --nproc-per-node 2 examples/synthetic_benchmark.py --model cnn --no-cuda --ddp

Like Horovod's script it leaves the thread count to the launcher: gpucomm-run sets OMP_NUM_THREADS
to cores / local ranks when it is unset (torchrun sets 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

import gpucomm.torch as hvd  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce")
    parser.add_argument("--model", type=str, default="resnet50", help="model to benchmark: resnet50, cnn or mlp10m")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches that don't count towards benchmark")
    parser.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction")
    parser.add_argument("--ddp", action="store_true", default=False,
                        help="train with torch DistributedDataParallel instead (launch with torchrun)")
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    if args.ddp:
        return run_ddp(args)

    hvd.init()
    if args.cuda:
        torch.cuda.set_device(torch.cuda.current_device())  # init() pinned this rank's GPU by PCI bus id

    model, sample = models.build(args.model)
    lr_scaler = hvd.size() if not args.use_adasum else 1  # Horovod's rule: Adasum does not scale the rate
    if args.cuda:
        model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    run_loop(args, model, optimizer, sample, hvd.rank(), hvd.size())
    hvd.shutdown()


def run_ddp(args) -> None:
    """The same benchmark on torch.distributed + DDP (torchrun's environment)."""
    import torch.distributed as dist  # noqa: PLC0415

    dist.init_process_group("nccl" if args.cuda else "gloo")
    if args.cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    model, sample = models.build(args.model)
    if args.cuda:
        model.cuda()
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * dist.get_world_size())
    run_loop(args, model, optimizer, sample, dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()


def run_loop(args, model, optimizer, sample, rank: int, size: int) -> None:
    """Horovod's timing loop and report (rank 0 prints)."""

    data = torch.randn(args.batch_size, *sample)
    target = torch.LongTensor(args.batch_size).random_() % 1000
    if args.cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step() -> None:
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()

    def log(s: str, nl: bool = True) -> None:
        if rank != 0:
            return
        print(s, end="\n" if nl else "", flush=True)

    def sync() -> None:
        if args.cuda:
            torch.cuda.synchronize()

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    device = "GPU" if args.cuda else "CPU"
    log(f"Number of {device}s: {size}")

    log("Running warmup...")
    timeit.timeit(lambda: (benchmark_step(), sync()), number=args.num_warmup_batches)

    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        t = timeit.timeit(lambda: (benchmark_step(), sync()), number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {size} {device}(s): {size * img_sec_mean:.1f} +-{size * img_sec_conf:.1f}")


if __name__ == "__main__":
    main()
