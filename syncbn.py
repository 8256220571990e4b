"""Synchronized BatchNorm from first principles: one all_reduce forward, one all_reduce backward.

In training, every rank normalizes its own slice of the global batch with the statistics of the whole global
batch (the concatenation of every rank's batch, rank-major), so the output equals ``nn.BatchNorm*d`` applied
to that concatenation. Eval mode uses the running statistics and talks to nobody.

Notation, per channel c (dropped below): rank r holds n_r values x_ri (all of the N and spatial positions of
channel c), N = sum_r n_r values in total, mu and var the global mean and biased variance,
invstd = 1 / sqrt(var + eps), xhat = (x - mu) * invstd, y = w * xhat + b (w = 1, b = 0 without affine).

Forward: stable statistics with one collective
----------------------------------------------
Each rank sums x and x^2 over its values IN FLOAT64, and one all_reduce(SUM) of one buffer
[sum x (C values), sum x^2 (C values), n_r] gives every rank (S1, S2, N); then

    mu = S1 / N,    var = S2 / N - mu^2    (float64),    unbiased var = var * N / (N - 1)

In float32 this formula cancels catastrophically when |mean| >> std: for 1000 + N(0, 1), E[x^2] ~ 1e6 carries
an absolute rounding error near 0.1, ten percent of the variance. In float64 it does not: the square of a
float32 (or fp16/bf16) value has at most 48 significant bits, so it is exact in float64's 53, and the sums and
the subtraction lose a few units of 2^-53 * mu^2 / var relatively, about 1e-10 for 1000 + N(0, 1). That only
grows large as |mean| / std nears 1e7, where float32 data no longer resolve the spread anyway. Float64 inputs
get the same formula and so the same relative error, about 1e-6 at |mean| / std = 1e5 (a two-pass variance
would do better there). The buffer holds 2C + 1 numbers, the fewest that carry the statistics; the counts
travel in it, so per-rank batch sizes may differ and may be 0 (a rank with no values adds zeros).

Cost: the float64 sums need a float64 copy of the input (twice its bytes for float32, four times for fp16/bf16),
squared in place and freed as soon as the sums are taken; on CUDA it counts in the forward pass's peak memory.
Backward reads xhat = (x - mu) * invstd, kept in the input's dtype: the same bytes as the input that
nn.BatchNorm keeps (for fp16/bf16 that rounds xhat as the output is rounded). The output is a tensor of its
own (a copy of xhat, or w * xhat + b), never the saved one, so an in-place op on the output
(ReLU(inplace=True)) stays legal. Elementwise passes over the data: forward 6 (copy, sum, square, sum,
centering, scaling) and the output; backward 3 (sum g, g * xhat, its sum) and the input gradient (3).
nn.BatchNorm's native kernels fuse theirs into fewer.

Backward, derived by hand (one collective)
------------------------------------------
With g = dL/dy, dL/dxhat = w g, and for every value j of the global batch
    d xhat_i / d x_j = invstd * (delta_ij - 1/N - xhat_i xhat_j / N)
(from d mu / d x_j = 1/N and d var / d x_j = 2 (x_j - mu) / N, so d invstd / d x_j = -invstd^3 (x_j - mu) / N).
Summing over i:
    dL/dx_j = w invstd * (g_j - (1/N) sum_i g_i - xhat_j (1/N) sum_i g_i xhat_i)
The only global quantities are the 2C sums sum(g) and sum(g xhat) over the whole batch: each rank computes its
local sums from the saved xhat, one all_reduce(SUM) of one flat [2C] buffer adds them up, and
    dL/dx = (g - mean(g) - xhat * mean(g xhat)) * (w invstd).
The affine gradients are dL/dw = sum(g xhat), dL/db = sum(g) over THIS rank's values only: like any other
parameter gradient they are averaged by whoever synchronizes gradients (DistributedDataParallel or the
trainer's all-reduce), so adding them up here would count them twice. When the input needs no gradient (and
so no rank's does: they run the same model), backward skips the collective, as torch.nn.SyncBatchNorm does.

Precision, devices, collectives
-------------------------------
- Statistics are summed in float64 and used in float32 (float64 for float64 inputs); fp16/bf16 inputs get
  float32 arithmetic, and the output and input gradient come back in the input's dtype.
- No host-device synchronization in forward or backward on CUDA with nccl: no .item(), no masks, no
  branching on tensor values (only on shapes). The global count N stays a device tensor. The one value check,
  "more than 1 value per channel across all ranks" (ValueError, as nn.BatchNorm), needs N only where it can
  fail: a rank whose own batch has 2 or more values per channel knows N >= 2 and checks nothing; a rank with
  fewer reads N on the host (one sync, on that rare path only). If N < 2, every rank has fewer than 2 values,
  so every rank reads N and raises: no rank is left waiting in the next collective. On the CPU N is read
  directly (free). With gloo over CUDA tensors (several ranks on one GPU) each all_reduce itself goes through
  host memory, so it waits for the GPU: that path is correct but not sync-free.
- A world of one (no process group initialized, or a group of size 1) runs no collective at all; otherwise
  forward and backward each run exactly one all_reduce on ``process_group`` (default: the whole world).
  A rank with 0 samples still runs both, so its peers do not hang.
- momentum=None (cumulative moving average) uses 1 / num_batches_tracked as a device tensor: no sync either.
- Speed: at the sizes of a small MLP the time goes to the number of PyTorch calls (a few microseconds of
  Python and dispatch each), not to arithmetic. torch.profiler counts 41 top-level calls in one forward +
  backward here (the module's and autograd's included), against 4 for nn.BatchNorm1d around its two fused
  native kernels, which no hand-written Python Function matches. The code keeps the count down where that
  costs no clarity: one buffer per collective, both running statistics in one torch._foreach_lerp_,
  broadcast views only for inputs with spatial dimensions. bn_benchmark.py measures what is left.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm


def _checked_count(count: int, world_size: int) -> int:
    """nn.BatchNorm's "more than 1 value per channel" check on a count read on the host."""
    if count < 2:
        raise ValueError(f"Expected more than 1 value per channel when training, got {count} per channel across "
                         f"{world_size} process(es)")
    return count


def _local_sums(input: torch.Tensor, reduce_dims: list[int]) -> torch.Tensor:
    """[sum x, sum x^2, count] over this rank's values of each channel, in float64 (2C + 1 numbers)."""
    x64 = input.to(torch.float64, copy=True)  # our own copy, squared in place; freed on return
    local_count = x64.new_full((1,), input.numel() // input.shape[1])
    return torch.cat([x64.sum(reduce_dims), x64.square_().sum(reduce_dims), local_count])


class sync_batch_norm(torch.autograd.Function):  # noqa: N801 (the name the design fixes)
    """y = BatchNorm(x) over the global batch of every rank in ``process_group`` (None: this process only).

    apply(input, weight, bias, running_mean, running_var, momentum, eps, process_group). weight and bias are
    both tensors or both None. running_mean and running_var (or None) are updated in place with factor
    ``momentum`` (a float or a 0-d tensor of their dtype).
    """

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, momentum, eps, process_group):
        num_channels = input.shape[1]
        reduce_dims = [0, *range(2, input.dim())]
        stat_dtype = torch.promote_types(input.dtype, torch.float32)

        local_count = input.numel() // num_channels  # from the shape: known on the host
        sums = _local_sums(input, reduce_dims)
        if process_group is None:
            count = _checked_count(local_count, 1)
        else:
            dist.all_reduce(sums, group=process_group)  # the one collective of the forward pass
            count = sums[-1]  # 2C, 2C, 1 -> the last number is the global count N
            # Reading N on CUDA waits for the GPU. A rank with 2+ values of its own knows N >= 2 and skips it;
            # if N < 2, every rank has fewer than 2 and reads it, so all of them raise together.
            if count.device.type == "cpu" or local_count < 2:
                count = _checked_count(int(count), process_group.size())
        moments = sums / count
        mean, mean_of_squares = moments[:num_channels], moments[num_channels:2 * num_channels]
        var = torch.addcmul(mean_of_squares, mean, mean, value=-1).to(stat_dtype)  # cancels harmlessly in float64
        mean = mean.to(stat_dtype)
        invstd = (var + eps).rsqrt_()

        # Both buffers in one call. [momentum] * 2: a list of 0-d tensors picks the overload that never reads
        # them on the host (a lone 0-d tensor would become a Python scalar: a sync on CUDA).
        if running_mean is not None:
            unbiased_var = var * (count / (count - 1))
            torch._foreach_lerp_([running_mean, running_var],
                                 [mean.to(running_mean.dtype), unbiased_var.to(running_var.dtype)], [momentum] * 2)

        if input.dim() > 2:  # per-channel values broadcast over (N, C, *spatial) as (C, 1, ..., 1)
            stat_shape = (num_channels,) + (1,) * (input.dim() - 2)
            mean, invstd = mean.view(stat_shape), invstd.view(stat_shape)
        xhat = (input - mean) * invstd
        if weight is None:
            output = xhat.to(input.dtype, copy=True)
        else:
            output = torch.addcmul(bias.view(invstd.shape), xhat, weight.view(invstd.shape)).to(input.dtype)

        # Keep our own xhat, not the output: an in-place op on the output must not change what backward reads.
        count_on_device = isinstance(count, torch.Tensor)
        ctx.save_for_backward(xhat.to(input.dtype), invstd, weight, count if count_on_device else None)
        ctx.count = None if count_on_device else count
        ctx.process_group, ctx.reduce_dims = process_group, reduce_dims
        return output

    @staticmethod
    def backward(ctx, grad_output):
        xhat, invstd, weight, count_tensor = ctx.saved_tensors
        count = ctx.count if count_tensor is None else count_tensor
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        num_channels = invstd.shape[0]
        dy = grad_output.to(invstd.dtype)
        sums = torch.cat([dy.sum(ctx.reduce_dims), (dy * xhat).sum(ctx.reduce_dims)])  # [sum g, sum g xhat]

        # Local to this rank: whoever averages parameter gradients (DDP, the trainer) sums them over ranks.
        grad_weight = sums[num_channels:].to(weight.dtype, copy=True) if need_weight else None
        grad_bias = sums[:num_channels].to(weight.dtype, copy=True) if need_bias else None

        grad_input = None
        if need_input:
            if ctx.process_group is not None:
                dist.all_reduce(sums, group=ctx.process_group)  # the one collective of the backward pass
            mean_dy, mean_dy_xhat = (sums / count).view(2, *invstd.shape)
            scale = invstd if weight is None else invstd * weight.view(invstd.shape)
            grad_input = torch.addcmul(dy - mean_dy, xhat, mean_dy_xhat, value=-1).mul_(scale)
            grad_input = grad_input.to(grad_output.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of every rank; a drop-in for nn.BatchNorm1d/2d/3d and nn.SyncBatchNorm.

    Buffers and parameters are nn.BatchNorm's (running_mean, running_var unbiased, num_batches_tracked,
    weight, bias), so state_dicts move both ways. Inputs (N, C), (N, C, L), (N, C, H, W), (N, C, D, H, W).
    Training synchronizes over ``process_group`` (default: the whole world) when a process group is
    initialized and has more than one member; eval mode uses the running statistics, or, with
    track_running_stats=False, this rank's own batch statistics with no collective (as nn.SyncBatchNorm:
    evaluation must not hang when ranks evaluate different numbers of batches).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = False,
                 track_running_stats: bool = True, process_group: dist.ProcessGroup | None = None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() not in (2, 3, 4, 5):
            raise ValueError(f"SyncBatchNorm expects a 2D, 3D, 4D or 5D input (N, C, ...), "
                             f"got a {input.dim()}D input of shape {tuple(input.shape)}")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) expects {self.num_features} channels in "
                             f"dimension 1, got an input of shape {tuple(input.shape)}")

    def _sync_group(self) -> dist.ProcessGroup | None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as a device tensor: no sync
                momentum = 1.0 / self.num_batches_tracked.to(self.running_mean.dtype)

        if not self.training and self.running_mean is not None:
            stat_shape = [1, self.num_features] + [1] * (input.dim() - 2)
            scale = torch.rsqrt(self.running_var + self.eps)
            if self.weight is not None:
                scale = scale * self.weight
            shift = -self.running_mean * scale
            if self.bias is not None:
                shift = shift + self.bias
            return torch.addcmul(shift.view(stat_shape), input, scale.view(stat_shape)).to(input.dtype)

        update = self.training and self.track_running_stats
        return sync_batch_norm.apply(
            input, self.weight, self.bias,
            self.running_mean if update else None, self.running_var if update else None,
            momentum, self.eps, self._sync_group() if self.training else None)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_group: dist.ProcessGroup | None = None) -> torch.nn.Module:
        """Swap every BatchNorm1d/2d/3d and nn.SyncBatchNorm in ``module`` (recursively) for this class.

        Parameters and buffers are the same objects (so requires_grad, device and dtype are kept), and so is
        the training mode. Returns the converted module (a new one if ``module`` itself was a BatchNorm).
        """
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted
