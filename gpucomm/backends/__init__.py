"""The data plane: one backend per transport (Gloo for CPU tensors, NCCL for CUDA tensors)."""
