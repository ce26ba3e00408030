"""A rank of tests/test_kubernetes.py: a short data-parallel training run under the environment a Kubernetes
runtime gives its pods (torchrun configured by Kubeflow Trainer's torch plugin, or mpirun with the MPI
operator's hostfile and OMPI_MCA_* variables).

Each rank trains the same linear model on its own batches with ``DistributedOptimizer`` (gradients averaged),
then prints one line the test parses: where gpucomm placed it and which launcher it recognised, one
allreduce's result, the averaged loss before and after training and a digest of the final parameters, which
must be identical on every rank if the ranks really trained together.
"""

from __future__ import annotations

import hashlib
import sys

import torch

import gpucomm.torch as hvd
from gpucomm.bootstrap.world import detect_world

STEPS = 20


def main() -> None:
    hvd.init()
    launcher = detect_world().launcher  # which launcher's variables gpucomm read (torchrun, openmpi, ...)
    torch.manual_seed(1000 + hvd.rank())  # different data on every rank; the model comes from rank 0
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rank_sum = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    target = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    losses = []
    for _ in range(STEPS):
        x = torch.randn(32, 4)
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(hvd.allreduce(loss.detach(), op=hvd.Average).item())
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    # one write per line: print() writes the text and its newline separately, and the launcher merges the
    # ranks' output, so two ranks' lines could run into each other
    sys.stdout.write(f"k8s-rank {hvd.rank()}/{hvd.size()} local {hvd.local_rank()}/{hvd.local_size()} "
                     f"cross {hvd.cross_rank()}/{hvd.cross_size()} launcher {launcher} rank_sum {rank_sum:g} "
                     f"first_loss {losses[0]:.6f} final_loss {losses[-1]:.6f} params {digest}\n")
    sys.stdout.flush()
    hvd.shutdown()


if __name__ == "__main__":
    main()
