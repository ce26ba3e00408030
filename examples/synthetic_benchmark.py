"""Synthetic training throughput, with the flags and output of Horovod's
``pytorch_synthetic_benchmark.py`` (random data, so only compute and communication are measured).

    gpucomm-run -np 2 python examples/synthetic_benchmark.py --model cnn --no-cuda
    gpucomm-run -np 4 python examples/synthetic_benchmark.py --model resnet50
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
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    if args.use_adasum:
        parser.error("--use-adasum: Adasum is not supported by gpucomm")

    hvd.init()
    if args.cuda:
        torch.cuda.set_device(torch.cuda.current_device())  # init() pinned this rank's GPU by PCI bus id
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))

    model, sample = models.build(args.model)
    lr_scaler = hvd.size()
    if args.cuda:
        model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

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
        if hvd.rank() != 0:
            return
        print(s, end="\n" if nl else "", flush=True)

    def sync() -> None:
        if args.cuda:
            torch.cuda.synchronize()

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    device = "GPU" if args.cuda else "CPU"
    log(f"Number of {device}s: {hvd.size()}")

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
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
