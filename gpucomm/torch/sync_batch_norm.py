"""``hvd.SyncBatchNorm``: batch normalization whose statistics cover the whole batch of all ranks.

Forward: each rank computes, per channel, its row count, mean and sum of squared deviations (in
fp32, or fp64 for fp64 input); one allgather brings every rank's row and Chan's parallel formula
combines them. That is exact for uneven shards, and a rank with no rows sends a count of 0 and
adds nothing, yet still takes part, so no rank waits for it. Backward: one allreduce (Sum) of the
per-channel ``sum(dy)`` and ``sum(dy * (x - mean))`` gives the global terms of the input gradient;
weight and bias gradients stay local, like any other parameter's, for the optimizer to reduce.

Plain torch ops throughout, so one code path serves CPU (Gloo) and CUDA (NCCL): torch's fused
``batch_norm_stats`` family has no CPU kernels.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ..process_sets import ProcessSet, global_process_set
from .autograd import allgather, allreduce
from .submission import Sum, set_id, set_size

# Fixed names, as Horovod's: every layer's call is blocking, so one name never has two calls in
# flight, and (unlike unnamed calls, numbered job-wide) they stay aligned when only a process
# set's members make them.
_STATS, _GRADS = "sync_batch_norm.stats", "sync_batch_norm.grads"


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, process_set):
        channels, dims, shape = x.shape[1], _reduced_dims(x), _channel_shape(x)
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32  # fp16/bf16: stats in fp32
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(compute)
            local = x.numel() // channels
            if local:
                var, mean = torch.var_mean(xc, dim=dims, correction=0)
                m2 = var * local
            else:  # no rows here: contribute nothing, but still join the allgather
                mean = m2 = xc.new_zeros(channels)
            row = torch.cat([xc.new_full((1,), local), mean, m2]).to(torch.float64)
            rows = allgather(row.unsqueeze(0), name=_STATS, process_set=process_set)  # (ranks, 1 + 2C); fp64 counts
            counts, means, m2s = rows[:, :1], rows[:, 1:1 + channels], rows[:, 1 + channels:]
            total = int(counts.sum().item())
            if total <= 1:  # every rank sees the same total, so every rank raises: nobody is left waiting
                raise ValueError(f"Expected more than 1 value per channel when training, got {total} over the "
                                 f"global batch of {rows.shape[0]} ranks (input size here: {tuple(x.shape)}). "
                                 f"Give the ranks more rows, or put the module in eval() mode.")
            g_mean = (counts * means).sum(0) / total
            g_m2 = (m2s + counts * (means - g_mean) ** 2).sum(0)
            invstd = torch.rsqrt(g_m2 / total + eps)
            if running_mean is not None:
                running_mean.mul_(1 - factor).add_(g_mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_((g_m2 / (total - 1)).to(running_var.dtype), alpha=factor)
            mean, invstd = g_mean.to(compute), invstd.to(compute)
            y = (xc - mean.view(shape)) * invstd.view(shape)
            if weight is not None:
                y = y * weight.to(compute).view(shape) + bias.to(compute).view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.process_set = total, process_set
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        dims, shape = _reduced_dims(x), _channel_shape(x)
        dyc = dy.to(mean.dtype)
        xmu = x.to(mean.dtype) - mean.view(shape)
        sum_dy, sum_dy_xmu = dyc.sum(dims), (dyc * xmu).sum(dims)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            both = allreduce(torch.cat([sum_dy, sum_dy_xmu]), name=_GRADS, op=Sum, process_set=ctx.process_set)
            both = both / ctx.total
            mean_dy, mean_dy_xmu = both.split(mean.numel())
            scale = invstd if weight is None else invstd * weight.to(mean.dtype)
            dx = (dyc - mean_dy.view(shape) - xmu * (invstd * invstd * mean_dy_xmu).view(shape)) * scale.view(shape)
            dx = dx.to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            dw = (sum_dy_xmu * invstd).to(weight.dtype)
        if weight is not None and ctx.needs_input_grad[2]:  # affine: weight and bias come together
            db = sum_dy.to(weight.dtype)
        return dx, dw, db, None, None, None, None, None


def _reduced_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` whose training statistics are those of the global
    batch: every rank of ``process_set`` (default: all) contributes its rows, however many (zero
    included), and gradients flow as if one process had normalized the concatenated batch.

    Eval mode with running statistics normalizes with them locally, without communication. As in
    Horovod, a module without running statistics (``track_running_stats=False``) synchronizes in
    eval mode too, so every member must call it. With one rank it is plain ``BatchNorm``. Every
    member must run forward (and backward) of each SyncBatchNorm layer in the same order.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, *, process_set: ProcessSet = global_process_set,
                 device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        if not isinstance(process_set, ProcessSet):
            raise ValueError(f"SyncBatchNorm: process_set must be a hvd.ProcessSet, got "
                             f"{type(process_set).__name__}.")
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input): SyncBatchNorm normalizes "
                             f"(N, C, ...) tensors over every dimension but C.")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) expected {self.num_features} channels in dim 1 of "
                             f"its input, got {input.shape[1]} (input shape {tuple(input.shape)}). Likely a layer "
                             f"before it changed its width, or channels are last: permute to (N, C, ...).")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        uses_batch_stats = self.training or self.running_mean is None
        if not uses_batch_stats or set_size(set_id(self.process_set)) == 1:
            return super().forward(input)
        factor = 0.0
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        updating = self.training and self.running_mean is not None
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.running_mean if updating else None,
                                            self.running_var if updating else None, self.eps, factor,
                                            self.process_set)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_set: ProcessSet = global_process_set) -> torch.nn.Module:
        """``module`` with every ``BatchNorm*d`` (and ``torch.nn.SyncBatchNorm``) inside it replaced by
        a ``SyncBatchNorm`` sharing its parameters and running statistics (as torch's helper of the same name)."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_set=process_set)
            if module.affine:
                converted.weight, converted.bias = module.weight, module.bias
            converted.running_mean, converted.running_var = module.running_mean, module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return converted


__all__ = ["SyncBatchNorm"]
