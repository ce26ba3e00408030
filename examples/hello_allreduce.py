"""Smallest gpucomm job: every rank reports where it runs, then the ranks check one allreduce.

    gpucomm-run -np 4 python examples/hello_allreduce.py
    torchrun --nproc-per-node 2 examples/hello_allreduce.py
"""

import socket

import torch

import gpucomm.torch as hvd


def main() -> None:
    hvd.init()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    print(f"rank {hvd.rank()}/{hvd.size()} local {hvd.local_rank()}/{hvd.local_size()} "
          f"cross {hvd.cross_rank()}/{hvd.cross_size()} on {socket.gethostname()} ({device})")
    total = hvd.allreduce(torch.full((4,), float(hvd.rank()), device=device), op=hvd.Sum)
    expected = hvd.size() * (hvd.size() - 1) / 2
    if not torch.equal(total.cpu(), torch.full((4,), expected)):
        raise SystemExit(f"rank {hvd.rank()}: allreduce gave {total.tolist()}, expected {expected}")
    if hvd.rank() == 0:
        print(f"allreduce over {hvd.size()} ranks OK (sum of ranks = {expected:g})")
    hvd.shutdown()


if __name__ == "__main__":
    main()
