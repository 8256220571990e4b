"""Synchronized BatchNorm from first principles: one all_reduce forward, one all_reduce backward.

In training, every rank normalizes its own slice of the global batch with the statistics of the whole global
batch (the concatenation of every rank's batch, rank-major), so the output equals ``nn.BatchNorm*d`` applied
to that concatenation. Eval mode uses the running statistics and talks to nobody.

Notation, per channel c (dropped below): rank r holds n_r values x_ri (all of the N and spatial positions of
channel c), N = sum_r n_r values in total, mu and var the global mean and biased variance,
invstd = 1 / sqrt(var + eps), xhat = (x - mu) * invstd, y = w * xhat + b (w = 1, b = 0 without affine).

Forward: stable statistics with one collective
----------------------------------------------
Sums of x and x^2 can be added across ranks, but summed as they are, in float32, E[x^2] - E[x]^2 cancels
catastrophically when |mean| >> std: for 1000 + N(0, 1), E[x^2] ~ 1e6 carries a rounding error near 0.1, ten
percent of the variance. So each rank sums its values shifted by k, one value of each channel (its first
sample's first position: a typical value, so x - k is of the size of the spread, not of the mean), in float32:

    s_r = sum_i (x_ri - k),    q_r = sum_i (x_ri - k)^2

and rebuilds the plain sums in float64, on C-sized vectors only:

    S1_r = n_r k + s_r,    S2_r = q_r + k (2 s_r + n_r k)        (= sum x, sum x^2 over rank r's values)

One all_reduce(SUM) of one buffer [S1 (C values), S2 (C values), n_r] gives every rank (S1, S2, N):

    mu = S1 / N,    var = S2 / N - mu^2    (float64),    unbiased var = var * N / (N - 1)

That subtraction cancels too, but in float64 and harmlessly: k is a float32 (or narrower) value, so k^2 is exact
in float64, and the float64 adds lose a few units of 2^-53 * mu^2, about 1e-10 of the variance for 1000 + N(0, 1).
The float32 sums are of shifted values, so their rounding is relative to the spread, not to the mean. (k is per
rank and never needs to agree: each rank's S1, S2 are plain sums.) The buffer holds 2C + 1 numbers, the fewest
that carry the statistics; the counts travel in it, so per-rank batch sizes may differ and may be 0 (a rank
with no values adds zeros).

Backward, derived by hand (one collective)
------------------------------------------
With g = dL/dy, dL/dxhat = w g, and for every value j of the global batch
    d xhat_i / d x_j = invstd * (delta_ij - 1/N - xhat_i xhat_j / N)
(from d mu / d x_j = 1/N and d var / d x_j = 2 (x_j - mu) / N, so d invstd / d x_j = -invstd^3 (x_j - mu) / N).
Summing over i:
    dL/dx_j = w invstd * (g_j - (1/N) sum_i g_i - xhat_j (1/N) sum_i g_i xhat_i)
The only global quantities are the 2C sums sum(g) and sum(g xhat) over the whole batch: each rank computes its
local sums, one all_reduce(SUM) of one flat [2C] buffer adds them up, and
    dL/dx = (g - mean(g) - xhat * mean(g xhat)) * (w invstd).
The affine gradients are dL/dw = sum(g xhat), dL/db = sum(g) over THIS rank's values only: like any other
parameter gradient they are averaged by whoever synchronizes gradients (DistributedDataParallel or the
trainer's all-reduce), so adding them up here would count them twice. When the input needs no gradient (and
so no rank's does: they run the same model), backward skips the collective, as torch.nn.SyncBatchNorm does.

What a pass reads and writes
----------------------------
BatchNorm is bound by memory traffic: the arithmetic per value is a handful of flops, so the time is the number
of times the activation crosses memory. Two implementations of the math above, chosen per call:

- Fused kernels (CUDA; Triton, which PyTorch's CUDA wheel ships), six launches per forward + backward:
    forward   1. per-channel s = sum(x - k), q = sum((x - k)^2) of each split, float32 - 1 read
              2. the splits' partials -> [S1, S2, n_r] in float64                    - C-sized
              -- all_reduce --
              3. mu, invstd (float64 from the sums) and y = (x - mu) * invstd * w + b in one pass, running
                 statistics updated by the same kernel                                - 1 read, 1 write
    backward  4. per-channel sum(g) and sum(g xhat) (xhat recomputed from x)          - 1 read of x and g
              5. the splits' partials -> [2C] (float64 adds), and the local affine gradients
              -- all_reduce --
              6. dx                                                                   - 1 read of x and g, 1 write
  Statistics are accumulated in float32 whatever the input's dtype (bf16/fp16 under autocast, float32), with
  the float64 steps on C-sized vectors only; kept for backward: the input itself (as nn.BatchNorm) plus mu
  and invstd. The kernels are registered as torch.library custom ops (``syncbn::...``) with fake
  implementations, so FakeTensorMode and torch.compile see their shapes. Activations are read in their own
  layout: channels-last (and 2-D (N, C)) as rows of C, contiguous as N planes of C x L; any other strides are
  made contiguous first. ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors (numpy; slow), which is
  how the tests check them on a machine without a GPU.
- PyTorch operations (the CPU, float64, and CUDA without Triton). Each rank writes x - k once; everything
  else reads it:
    forward   s and q per channel (reductions: no temporary), turned into [S1, S2, n_r] in float64;
              -- all_reduce --
              y = (x - k) scale - (offset scale - b), offset = mu - k, scale = invstd w: one addcmul
    backward  sum(g) and sum(g (x - k)) per channel, the second a dot product taken a block of samples
              at a time, each block's product summed while it is in the cache (no activation-sized
              temporary);  sum(g xhat) = invstd (sum(g (x - k)) - offset sum(g)) on this rank
              -- all_reduce --
              dx = g scale - (x - k) q scale - (mean(g) - offset q) scale, q = invstd mean(g xhat): two
              passes (addcmul, addcmul_)
  In all: 2 activation-sized writes forward (x - k, y) and 2 backward (dx, twice), against nn.BatchNorm's 1
  and 1; kept for backward: x - k, the input's bytes, in place of the input that nn.BatchNorm keeps. (Up to
  CACHED_VALUES values (512 KiB of float32) the whole activation is one block: its product is one more
  activation-sized temporary per dot product, in the cache.) PyTorch's CPU reductions copy bf16/fp16 inputs to
  float32 when asked for a float32 result, so on the CPU half-precision inputs go through float32 copies for
  the statistics (CPU autocast is rare; the CUDA kernels have no such copies).
  test_syncbn.py counts all of this at PyTorch's dispatcher, with the profiler's allocations and with
  saved-tensor hooks.

Precision, devices, collectives
-------------------------------
- The statistics are float32 or better for every input dtype; mu and invstd are used in float32 (float64 for
  float64 inputs); the output and input gradient come back in the input's dtype; the affine gradients and
  running statistics in theirs.
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
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

from measure.timing import profiled

try:
    import triton
    import triton.language as tl
except ImportError:  # PyTorch's CPU wheels and some platforms have no Triton: the PyTorch-ops path serves all
    triton = None

# TRITON_INTERPRET=1 makes @triton.jit kernels run on CPU tensors; it is read when the kernels are defined.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _checked_count(count: int, world_size: int) -> int:
    """nn.BatchNorm's "more than 1 value per channel" check on a count read on the host."""
    if count < 2:
        raise ValueError(f"Expected more than 1 value per channel when training, got {count} per channel across "
                         f"{world_size} process(es)")
    return count


def _per_channel(input: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values (C,) shaped to broadcast over input: as they are for (N, C), (C, 1, ..., 1) with spatial dims."""
    return values if input.dim() == 2 else values.view((input.shape[1],) + (1,) * (input.dim() - 2))


# ----------------------------------------------------------------------------------------------------------
# The PyTorch-operations path (CPU, float64, CUDA without Triton)
# ----------------------------------------------------------------------------------------------------------
def _shifted_and_local_sums(input: torch.Tensor, reduce_dims: list[int]
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x - k, k, [S1_r, S2_r, n_r]): this rank's values shifted by k, one value of each channel (the first
    sample's first position: a typical value, so x - k is of the size of the spread, not of the mean); k in
    float64; and the 2C + 1 sums in float64 built from sums of shifted values only:

        S1_r = n k + sum(x - k),    S2_r = sum((x - k)^2) + k (2 sum(x - k) + n k)    (= sum x, sum x^2)

    x - k (float32 for fp16/bf16 inputs) is the forward's one activation-sized write besides the output; backward
    keeps it, in the input's dtype, in place of x.
    In float32 nothing cancels: the float32 sums are of shifted values, and the float64 adds that rebuild
    sum x^2 lose a few units of 2^-53 k^2 (the same argument as the module docstring's)."""
    num_channels = input.shape[1]
    local_count = input.numel() // num_channels
    if local_count == 0:  # an empty rank adds zeros
        zeros = input.new_zeros(2 * num_channels + 1, dtype=torch.float64)
        return input, zeros[:num_channels], zeros
    # PyTorch's CPU reductions copy bf16/fp16 to float32 when asked for a float32 result; do it once, explicitly.
    values = input if input.dtype in (torch.float32, torch.float64) else input.float()
    shift = values[(0, slice(None)) + (0,) * (input.dim() - 2)]  # a view: x[0, :, 0, ...]
    shifted = values - _per_channel(input, shift)
    shift, shifted_sum, shifted_squares = torch.stack(
        [shift, shifted.sum(reduce_dims), _channel_dot(shifted, shifted)]).double()
    sum_x = torch.add(shifted_sum, shift, alpha=local_count)
    sum_x2 = torch.addcmul(shifted_squares, shift, sum_x + shifted_sum)
    return shifted, shift, torch.cat([sum_x, sum_x2, sum_x.new_full((1,), local_count)])


# Per-channel dot products multiply blocks of at most this many values (512 KiB of float32, within a core's L2
# cache): the product never reaches memory, and no activation-sized temporary exists.
CACHED_VALUES = 2**17


def _channel_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b) over everything but dim 1, per channel, in float32 or wider, a block of samples at a time: each
    block's product (at most CACHED_VALUES values, or one sample) is summed while it is still in the cache."""
    reduce_dims = [0, *range(2, a.dim())]
    block = max(CACHED_VALUES // max(a.numel() // a.shape[0], 1), 1) if a.shape[0] else 1
    if a.shape[0] <= block and a.dtype in (torch.float32, torch.float64):  # one block: the activation itself
        return (a * b).sum(reduce_dims)
    total = None
    for start in range(0, a.shape[0], block):
        a_block, b_block = a[start:start + block], b[start:start + block]
        if a.dtype not in (torch.float32, torch.float64):  # bf16/fp16: a float32 block, not a float32 copy
            a_block, b_block = a_block.float(), b_block.float()
        part = (a_block * b_block).sum(reduce_dims)
        total = part if total is None else total.add_(part)
    if total is None:  # no samples on this rank
        return a.new_zeros(a.shape[1], dtype=torch.promote_types(a.dtype, torch.float32))
    return total


# ----------------------------------------------------------------------------------------------------------
# The fused-kernel path: Triton kernels behind torch.library custom ops
# ----------------------------------------------------------------------------------------------------------
class _Tiles:
    """How a kernel walks an activation: `planes` blocks of `rows` x C values, each value at
    plane * plane_stride + row * row_stride + channel * channel_stride.

    Channels-last and 2-D inputs are one plane of N*H*W rows of C contiguous channels; contiguous inputs are N
    planes of C channels of H*W contiguous values. A program takes BLOCK_C channels and a run of (plane,
    row-block) units; the grid is (channel blocks, splits), enough programs to fill the GPU.
    """

    def __init__(self, x: torch.Tensor):
        num_channels = x.shape[1]
        self.channels = num_channels
        if x.movedim(1, -1).is_contiguous():  # channels-last, or 2-D (N, C)
            self.planes, self.rows = 1, x.numel() // max(num_channels, 1)
            self.plane_stride, self.row_stride, self.channel_stride = 0, num_channels, 1
            block_c = min(triton.next_power_of_2(num_channels), 64)
            block_r = max(_TILE // block_c, 1)
        else:
            assert x.is_contiguous(), "the caller makes other layouts contiguous"
            self.planes, self.rows = x.shape[0], x.numel() // max(x.shape[0] * num_channels, 1)
            self.plane_stride, self.row_stride, self.channel_stride = num_channels * self.rows, 1, self.rows
            block_r = min(triton.next_power_of_2(max(self.rows, 1)), _TILE)
            block_c = min(max(_TILE // block_r, 1), triton.next_power_of_2(num_channels))
        if INTERPRET:  # small tiles on the CPU, so that the tests walk many tiles, splits and masked edges
            block_c, block_r = min(block_c, 4), min(block_r, 8)
        self.block_c, self.block_r = block_c, block_r
        self.row_blocks = triton.cdiv(self.rows, block_r)
        self.units = self.planes * self.row_blocks
        self.channel_blocks = triton.cdiv(num_channels, block_c)
        splits = min(self.units, max(_target_programs(x.device) // self.channel_blocks, 1))
        self.units_per_split = triton.cdiv(self.units, max(splits, 1))
        self.splits = triton.cdiv(self.units, self.units_per_split) if self.units else 0

    @property
    def grid(self) -> tuple[int, int]:
        return (self.channel_blocks, self.splits)

    @property
    def blocks(self) -> dict[str, int]:
        """The tile's constexprs and the launch's warps (a tile of _TILE values: 16 per thread at 8 warps)."""
        return {"BLOCK_R": self.block_r, "BLOCK_C": self.block_c, "num_warps": 8 if not INTERPRET else 1}

    def args(self) -> tuple[int, ...]:
        return (self.channels, self.rows, self.row_blocks, self.units, self.units_per_split,
                self.plane_stride, self.row_stride, self.channel_stride)


_TILE = 4096  # values per tile
_SPLITS_AT_ONCE = 2 if INTERPRET else 16  # partials a finishing kernel reads per step (per channel)


@functools.lru_cache(maxsize=None)
def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 6  # the interpreter: a few splits, to exercise the merge


if triton is not None:
    @triton.jit
    def _tile(unit, channels, cmask, rows, row_blocks, plane_stride, row_stride, channel_stride,
              BLOCK_R: tl.constexpr):
        """Offsets and mask of one (plane, row-block) unit for a block of channels: [BLOCK_R, BLOCK_C]."""
        plane = unit // row_blocks
        row = (unit % row_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = row < rows
        offsets = (plane.to(tl.int64) * plane_stride + row[:, None].to(tl.int64) * row_stride
                   + channels[None, :].to(tl.int64) * channel_stride)
        return offsets, rmask[:, None] & cmask[None, :]

    @triton.jit
    def _add_up_splits(partial_ptr, channels, cmask, C, splits, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
        """Both rows of the splits' partials [splits, 2, C] added up over the splits in float64, BLOCK_S splits
        at a time (a handful of steps, where one split per step would be hundreds of dependent loads)."""
        first_sum = tl.zeros([BLOCK_C], tl.float64)
        second_sum = tl.zeros([BLOCK_C], tl.float64)
        for first in range(0, splits, BLOCK_S):
            split = first + tl.arange(0, BLOCK_S)
            mask = (split < splits)[:, None] & cmask[None, :]
            offsets = split[:, None] * 2 * C + channels[None, :]
            first_sum += tl.sum(tl.load(partial_ptr + offsets, mask=mask, other=0.0).to(tl.float64), 0)
            second_sum += tl.sum(tl.load(partial_ptr + offsets + C, mask=mask, other=0.0).to(tl.float64), 0)
        return first_sum, second_sum

    @triton.jit
    def _shifted_sums_kernel(x_ptr, partial_ptr, C, rows, row_blocks, units, units_per_split, plane_stride,
                             row_stride, channel_stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """Per split and channel: sum(x - k) and sum((x - k)^2) of the split's values, in float32, with k each
        channel's first value (the same k in every program). partial: [splits, 2, C]."""
        split = tl.program_id(1)
        channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = channels < C
        shift = tl.load(x_ptr + channels.to(tl.int64) * channel_stride, mask=cmask, other=0.0).to(tl.float32)
        shifted_sum = tl.zeros([BLOCK_C], tl.float32)
        shifted_squares = tl.zeros([BLOCK_C], tl.float32)
        for unit in range(split * units_per_split, tl.minimum((split + 1) * units_per_split, units)):
            offsets, mask = _tile(unit, channels, cmask, rows, row_blocks, plane_stride, row_stride,
                                  channel_stride, BLOCK_R)
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            shifted = tl.where(mask, x - shift[None, :], 0.0)
            shifted_sum += tl.sum(shifted, 0)
            shifted_squares += tl.sum(shifted * shifted, 0)
        tl.store(partial_ptr + split * 2 * C + channels, shifted_sum, mask=cmask)
        tl.store(partial_ptr + (split * 2 + 1) * C + channels, shifted_squares, mask=cmask)

    @triton.jit(do_not_specialize=["count"])  # a count of 1 would become a constant, without .to()
    def _local_sums_kernel(x_ptr, partial_ptr, sums_ptr, C, count, splits, channel_stride, BLOCK_C: tl.constexpr,
                           BLOCK_S: tl.constexpr):
        """[S1_r, S2_r, n_r] (2C + 1, float64) from the splits' shifted sums, BLOCK_S splits at a time:
        S1 = n k + sum(x - k), S2 = sum((x - k)^2) + k (2 sum(x - k) + n k)."""
        channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = channels < C
        shift = tl.load(x_ptr + channels.to(tl.int64) * channel_stride, mask=cmask, other=0.0).to(tl.float64)
        shifted_sum, shifted_squares = _add_up_splits(partial_ptr, channels, cmask, C, splits, BLOCK_C, BLOCK_S)
        n = count.to(tl.float64)
        sum_x = shifted_sum + n * shift
        tl.store(sums_ptr + channels, sum_x, mask=cmask)
        tl.store(sums_ptr + C + channels, shifted_squares + shift * (sum_x + shifted_sum), mask=cmask)
        if tl.program_id(0) == 0:
            tl.store(sums_ptr + 2 * C, n)

    @triton.jit
    def _normalize_kernel(x_ptr, y_ptr, sums_ptr, weight_ptr, bias_ptr, mean_ptr, invstd_ptr, running_mean_ptr,
                          running_var_ptr, momentum_ptr, momentum, eps, C, rows, row_blocks, units, units_per_split,
                          plane_stride, row_stride, channel_stride, HAS_WEIGHT: tl.constexpr,
                          HAS_RUNNING: tl.constexpr, MOMENTUM_TENSOR: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
        """mu, invstd from the global sums (float64, per program: C-sized), then y = (x - mu) * invstd * w + b.
        The first split's programs store mu and invstd for backward and update the running statistics."""
        split = tl.program_id(1)
        channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = channels < C
        n = tl.load(sums_ptr + 2 * C).to(tl.float64)
        mean64 = tl.load(sums_ptr + channels, mask=cmask, other=0.0) / n
        var64 = tl.maximum(tl.load(sums_ptr + C + channels, mask=cmask, other=0.0) / n - mean64 * mean64, 0.0)
        invstd64 = 1.0 / tl.sqrt(var64 + eps)
        mean, invstd = mean64.to(tl.float32), invstd64.to(tl.float32)
        scale = invstd
        shift = tl.zeros([BLOCK_C], tl.float32)
        if HAS_WEIGHT:
            scale = invstd * tl.load(weight_ptr + channels, mask=cmask, other=1.0)
            shift = tl.load(bias_ptr + channels, mask=cmask, other=0.0)
        if split == 0:
            tl.store(mean_ptr + channels, mean, mask=cmask)
            tl.store(invstd_ptr + channels, invstd, mask=cmask)
            if HAS_RUNNING:
                if MOMENTUM_TENSOR:
                    factor = tl.load(momentum_ptr).to(tl.float64)
                else:
                    factor = momentum
                unbiased = var64 * (n / (n - 1.0))
                running_mean = tl.load(running_mean_ptr + channels, mask=cmask, other=0.0).to(tl.float64)
                running_var = tl.load(running_var_ptr + channels, mask=cmask, other=0.0).to(tl.float64)
                running_mean += factor * (mean64 - running_mean)
                running_var += factor * (unbiased - running_var)
                tl.store(running_mean_ptr + channels, running_mean.to(tl.float32), mask=cmask)
                tl.store(running_var_ptr + channels, running_var.to(tl.float32), mask=cmask)
        for unit in range(split * units_per_split, tl.minimum((split + 1) * units_per_split, units)):
            offsets, mask = _tile(unit, channels, cmask, rows, row_blocks, plane_stride, row_stride,
                                  channel_stride, BLOCK_R)
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean[None, :]) * scale[None, :] + shift[None, :]  # centred first: no cancellation
            tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _grad_sums_kernel(dy_ptr, x_ptr, mean_ptr, invstd_ptr, partial_ptr, C, rows, row_blocks, units,
                          units_per_split, plane_stride, row_stride, channel_stride, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
        """Per split and channel: sum(g) and sum(g xhat), xhat recomputed from x (float32).
        partial: [splits, 2, C]."""
        split = tl.program_id(1)
        channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = channels < C
        mean = tl.load(mean_ptr + channels, mask=cmask, other=0.0)
        invstd = tl.load(invstd_ptr + channels, mask=cmask, other=0.0)
        sum_dy = tl.zeros([BLOCK_C], tl.float32)
        sum_dy_xhat = tl.zeros([BLOCK_C], tl.float32)
        for unit in range(split * units_per_split, tl.minimum((split + 1) * units_per_split, units)):
            offsets, mask = _tile(unit, channels, cmask, rows, row_blocks, plane_stride, row_stride,
                                  channel_stride, BLOCK_R)
            dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            xhat = (x - mean[None, :]) * invstd[None, :]
            sum_dy += tl.sum(dy, 0)
            sum_dy_xhat += tl.sum(dy * xhat, 0)
        tl.store(partial_ptr + split * 2 * C + channels, sum_dy, mask=cmask)
        tl.store(partial_ptr + (split * 2 + 1) * C + channels, sum_dy_xhat, mask=cmask)

    @triton.jit
    def _grad_sums_total_kernel(partial_ptr, sums_ptr, local_ptr, C, splits, BLOCK_C: tl.constexpr,
                                BLOCK_S: tl.constexpr):
        """[sum g, sum g xhat] over the splits (float64 adds, BLOCK_S splits at a time; stored float32): one copy
        for the all_reduce, one kept as this rank's affine gradients."""
        channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = channels < C
        sum_dy, sum_dy_xhat = _add_up_splits(partial_ptr, channels, cmask, C, splits, BLOCK_C, BLOCK_S)
        tl.store(sums_ptr + channels, sum_dy.to(tl.float32), mask=cmask)
        tl.store(sums_ptr + C + channels, sum_dy_xhat.to(tl.float32), mask=cmask)
        tl.store(local_ptr + channels, sum_dy.to(tl.float32), mask=cmask)
        tl.store(local_ptr + C + channels, sum_dy_xhat.to(tl.float32), mask=cmask)

    @triton.jit
    def _grad_input_kernel(dy_ptr, x_ptr, dx_ptr, mean_ptr, invstd_ptr, weight_ptr, grad_sums_ptr, stat_sums_ptr,
                           C, rows, row_blocks, units, units_per_split, plane_stride, row_stride, channel_stride,
                           HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """dx = (g - mean(g) - xhat mean(g xhat)) * w invstd, with the global sums and the global count N."""
        split = tl.program_id(1)
        channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = channels < C
        n = tl.load(stat_sums_ptr + 2 * C).to(tl.float32)
        mean = tl.load(mean_ptr + channels, mask=cmask, other=0.0)
        invstd = tl.load(invstd_ptr + channels, mask=cmask, other=0.0)
        mean_dy = tl.load(grad_sums_ptr + channels, mask=cmask, other=0.0) / n
        mean_dy_xhat = tl.load(grad_sums_ptr + C + channels, mask=cmask, other=0.0) / n
        scale = invstd
        if HAS_WEIGHT:
            scale = invstd * tl.load(weight_ptr + channels, mask=cmask, other=1.0)
        for unit in range(split * units_per_split, tl.minimum((split + 1) * units_per_split, units)):
            offsets, mask = _tile(unit, channels, cmask, rows, row_blocks, plane_stride, row_stride,
                                  channel_stride, BLOCK_R)
            dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            xhat = (x - mean[None, :]) * invstd[None, :]
            dx = (dy - mean_dy[None, :] - xhat * mean_dy_xhat[None, :]) * scale[None, :]
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _on_device_of(x: torch.Tensor):
    """x's CUDA device as the current one while its kernels launch (a process may drive several GPUs)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


@torch.library.custom_op("syncbn::local_sums", mutates_args=())
def kernel_local_sums(x: torch.Tensor) -> torch.Tensor:
    """[S1_r, S2_r, n_r] (2C + 1, float64) of this rank's values: kernels 1 and 2."""
    with _on_device_of(x):  # Triton launches on the current CUDA device
        tiles = _Tiles(x)
        sums = x.new_zeros(2 * tiles.channels + 1, dtype=torch.float64)
        if tiles.splits == 0:
            return sums
        partial = x.new_empty((tiles.splits, 2, tiles.channels), dtype=torch.float32)
        _shifted_sums_kernel[tiles.grid](x, partial, *tiles.args(), **tiles.blocks)
        _local_sums_kernel[(tiles.channel_blocks,)](x, partial, sums, tiles.channels, x.numel() // tiles.channels,
                                                    tiles.splits, tiles.channel_stride, BLOCK_C=tiles.block_c,
                                                    BLOCK_S=_SPLITS_AT_ONCE)
        return sums


@kernel_local_sums.register_fake
def _(x):
    return x.new_empty(2 * x.shape[1] + 1, dtype=torch.float64)


@torch.library.custom_op("syncbn::normalize", mutates_args=("running_mean", "running_var"))
def kernel_normalize(x: torch.Tensor, sums: torch.Tensor, weight: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], running_mean: Optional[torch.Tensor],
                     running_var: Optional[torch.Tensor], momentum_tensor: Optional[torch.Tensor], momentum: float,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mu, invstd) from the global sums, running statistics updated in place: kernel 3."""
    with _on_device_of(x):  # Triton launches on the current CUDA device
        tiles = _Tiles(x)
        y = torch.empty_like(x)
        mean = x.new_empty(tiles.channels, dtype=torch.float32)
        invstd = torch.empty_like(mean)
        # No values on this rank: the statistics and running buffers are still the global ones, from one program.
        grid = tiles.grid if tiles.splits else (tiles.channel_blocks, 1)
        _normalize_kernel[grid](
            x, y, sums, weight, bias, mean, invstd, running_mean, running_var, momentum_tensor, momentum, eps,
            *tiles.args(), HAS_WEIGHT=weight is not None, HAS_RUNNING=running_mean is not None,
            MOMENTUM_TENSOR=momentum_tensor is not None, **tiles.blocks)
        return y, mean, invstd


@kernel_normalize.register_fake
def _(x, sums, weight, bias, running_mean, running_var, momentum_tensor, momentum, eps):
    mean = x.new_empty(x.shape[1], dtype=torch.float32)
    return torch.empty_like(x), mean, torch.empty_like(mean)


@torch.library.custom_op("syncbn::grad_sums", mutates_args=())
def kernel_grad_sums(grad_output: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                     invstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([sum g, sum g xhat] to all_reduce, the same [2C] kept as the local affine gradients): kernels 4 and 5."""
    with _on_device_of(x):  # Triton launches on the current CUDA device
        tiles = _Tiles(x)
        sums = x.new_zeros(2 * tiles.channels, dtype=torch.float32)
        local = torch.zeros_like(sums)
        if tiles.splits == 0:
            return sums, local
        partial = x.new_empty((tiles.splits, 2, tiles.channels), dtype=torch.float32)
        _grad_sums_kernel[tiles.grid](grad_output, x, mean, invstd, partial, *tiles.args(), **tiles.blocks)
        _grad_sums_total_kernel[(tiles.channel_blocks,)](partial, sums, local, tiles.channels, tiles.splits,
                                                          BLOCK_C=tiles.block_c, BLOCK_S=_SPLITS_AT_ONCE)
        return sums, local


@kernel_grad_sums.register_fake
def _(grad_output, x, mean, invstd):
    sums = x.new_empty(2 * x.shape[1], dtype=torch.float32)
    return sums, torch.empty_like(sums)


@torch.library.custom_op("syncbn::grad_input", mutates_args=())
def kernel_grad_input(grad_output: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                      weight: Optional[torch.Tensor], grad_sums: torch.Tensor,
                      stat_sums: torch.Tensor) -> torch.Tensor:
    """dx from the global [sum g, sum g xhat] and the global count in stat_sums: kernel 6."""
    with _on_device_of(x):  # Triton launches on the current CUDA device
        tiles = _Tiles(x)
        grad_input = torch.empty_like(x)
        if tiles.splits:
            _grad_input_kernel[tiles.grid](grad_output, x, grad_input, mean, invstd, weight, grad_sums, stat_sums,
                                           *tiles.args(), HAS_WEIGHT=weight is not None, **tiles.blocks)
        return grad_input


@kernel_grad_input.register_fake
def _(grad_output, x, mean, invstd, weight, grad_sums, stat_sums):
    return torch.empty_like(x)


def _uses_kernels(input, weight, running_mean) -> bool:
    """The fused kernels take CUDA tensors (CPU ones under TRITON_INTERPRET=1) of the dtypes they were written
    for, with float32 parameters and buffers (nn.BatchNorm's, also under autocast)."""
    if not (input.is_cuda or INTERPRET) or triton is None:  # the common CPU case, decided at once
        return False
    return (input.device.type in ("cuda", "cpu") and input.dtype in KERNEL_DTYPES and input.dim() >= 2
            and all(t is None or t.dtype == torch.float32 for t in (weight, running_mean)))


def _in_kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """x itself if it is contiguous or channels-last; else a contiguous copy."""
    if x.is_contiguous() or x.movedim(1, -1).is_contiguous():
        return x
    return x.contiguous()


class sync_batch_norm(torch.autograd.Function):  # noqa: N801 (the name the design fixes)
    """y = BatchNorm(x) over the global batch of every rank in ``process_group`` (None: this process only).

    apply(input, weight, bias, running_mean, running_var, momentum, eps, process_group). weight and bias are
    both tensors or both None. running_mean and running_var (or None) are updated in place with factor
    ``momentum`` (a float or a 0-d tensor of their dtype).
    """

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, momentum, eps, process_group):
        num_channels = input.shape[1]
        local_count = input.numel() // num_channels  # from the shape: known on the host
        ctx.use_kernels = _uses_kernels(input, weight, running_mean)
        if ctx.use_kernels:
            input = _in_kernel_layout(input)
            sums = kernel_local_sums(input)
        else:
            shifted, shift, sums = _shifted_and_local_sums(input, [0, *range(2, input.dim())])

        if process_group is None:
            count = _checked_count(local_count, 1)
        else:
            _named_all_reduce(sums, process_group, "syncbn.forward.all_reduce")  # the forward's one collective
            count = sums[-1]  # 2C, 2C, 1 -> the last number is the global count N
            # Reading N on CUDA waits for the GPU. A rank with 2+ values of its own knows N >= 2 and skips it;
            # if N < 2, every rank has fewer than 2 and reads it, so all of them raise together. A compiled graph
            # reads nothing on the host: the check runs on the device, in the graph.
            if torch.compiler.is_compiling():
                if local_count < 2:
                    torch._assert_async(count >= 2, "Expected more than 1 value per channel when training")
            elif count.device.type == "cpu" or local_count < 2:
                count = _checked_count(int(count), process_group.size())
        ctx.process_group = process_group

        # The output is a tensor of its own, never one kept for backward: an in-place op on the output
        # (ReLU(inplace=True)) stays legal.
        if ctx.use_kernels:
            momentum_tensor = momentum if isinstance(momentum, torch.Tensor) else None
            output, mean, invstd = kernel_normalize(input, sums, weight, bias, running_mean, running_var,
                                                    momentum_tensor, 0.0 if momentum_tensor is not None
                                                    else float(momentum), eps)
            ctx.save_for_backward(input, mean, invstd, weight, sums)  # sums: the global count N, on device
            return output

        moments = sums / count
        mean, mean_of_squares = moments[:num_channels], moments[num_channels:2 * num_channels]
        var = torch.addcmul(mean_of_squares, mean, mean, value=-1).clamp_min_(0)  # float64: harmless cancelling
        # Both buffers in one call. [momentum] * 2: a list of 0-d tensors picks the overload that never reads
        # them on the host (a lone 0-d tensor would become a Python scalar: a sync on CUDA).
        if running_mean is not None:
            unbiased_var = var * (count / (count - 1))
            torch._foreach_lerp_([running_mean, running_var],
                                 [mean.to(running_mean.dtype), unbiased_var.to(running_var.dtype)], [momentum] * 2)
        # y = (x - mu) invstd w + b = (x - k) scale - (offset scale - b), offset = mu - k, scale = invstd w: from
        # the shifted values, of the size of the spread, so nothing cancels; one pass (addcmul).
        stat_dtype = torch.promote_types(input.dtype, torch.float32)
        offset, invstd = (mean - shift).to(stat_dtype), var.add_(eps).rsqrt_().to(stat_dtype)
        scale = invstd if weight is None else invstd * weight
        if bias is None:
            constant = torch.mul(offset, scale).neg_()
        else:
            constant = torch.addcmul(bias, offset, scale, value=-1)
        output = torch.addcmul(_per_channel(input, constant), shifted, _per_channel(input, scale))
        shifted = shifted.to(input.dtype)  # kept for backward in the input's dtype (float32 above for fp16/bf16)
        count_tensor = count if isinstance(count, torch.Tensor) else None
        ctx.save_for_backward(shifted, offset, invstd, scale, weight, count_tensor)
        ctx.count = count if count_tensor is None else None  # a host int; a device count is saved above
        return output.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        backward_pass = _kernels_backward if ctx.use_kernels else _ops_backward
        grad_input, grad_weight, grad_bias = backward_pass(ctx, grad_output, need_input)
        return (grad_input, grad_weight if need_weight else None, grad_bias if need_bias else None,
                None, None, None, None, None)


def _named_all_reduce(sums: torch.Tensor, group: dist.ProcessGroup, name: str) -> None:
    """all_reduce(SUM), shown as a range called ``name`` in torch.profiler traces (nothing when not profiling).
    Compiled, Dynamo turns it into a functional all_reduce in the graph (and the profiler names the op itself)."""
    if torch.compiler.is_compiling():
        dist.all_reduce(sums, group=group)
        return
    with profiled(name):
        dist.all_reduce(sums, group=group)


def _all_reduce(ctx, sums: torch.Tensor) -> None:
    if ctx.process_group is not None:  # the backward's one collective
        _named_all_reduce(sums, ctx.process_group, "syncbn.backward.all_reduce")


def _kernels_backward(ctx, grad_output, need_input):
    input, mean, invstd, weight, stat_sums = ctx.saved_tensors
    if grad_output.stride() != input.stride():  # the kernels index both with the input's strides
        grad_output = torch.empty_like(input).copy_(grad_output)
    sums, local = kernel_grad_sums(grad_output, input, mean, invstd)  # local: [sum g, sum g xhat], a copy
    num_channels = input.shape[1]
    # Local to this rank: whoever averages parameter gradients (DDP, the trainer) sums them over ranks.
    grad_weight, grad_bias = local[num_channels:], local[:num_channels]
    if not need_input:  # no rank needs dx (they run the same model): no collective, as nn.SyncBatchNorm
        return None, grad_weight, grad_bias
    _all_reduce(ctx, sums)
    return kernel_grad_input(grad_output, input, mean, invstd, weight, sums, stat_sums), grad_weight, grad_bias


def _ops_backward(ctx, grad_output, need_input):
    shifted, offset, invstd, scale, weight, count_tensor = ctx.saved_tensors  # shifted: x - k, offset: mu - k
    count = ctx.count if count_tensor is None else count_tensor
    num_channels = shifted.shape[1]
    # This rank's [sum g, sum g xhat], with sum g xhat = invstd (sum g (x - k) - offset sum g) (k is this
    # rank's own shift, so this is taken before the all_reduce); sum g (x - k) in cache-sized blocks.
    sum_dy = grad_output.sum([0, *range(2, shifted.dim())], dtype=invstd.dtype)
    sum_dy_xhat = torch.addcmul(_channel_dot(grad_output, shifted).to(invstd.dtype), offset, sum_dy, value=-1)
    sums = torch.cat([sum_dy, sum_dy_xhat.mul_(invstd)])
    grad_weight = grad_bias = None
    if weight is not None:  # local to this rank, as above; copies: the all_reduce below adds into sums
        grad_weight = sums[num_channels:].to(weight.dtype, copy=True)
        grad_bias = sums[:num_channels].to(weight.dtype, copy=True)
    if not need_input:
        return None, grad_weight, grad_bias
    _all_reduce(ctx, sums)
    mean_dy, mean_dy_xhat = (sums / count).view(2, num_channels)
    # dx = (g - mean(g) - xhat mean(g xhat)) scale, with xhat = ((x - k) - offset) invstd:
    #    = g scale - (x - k) q scale - (mean(g) - offset q) scale,   q = invstd mean(g xhat)
    q = mean_dy_xhat.mul_(invstd)
    constant = torch.addcmul(mean_dy, offset, q, value=-1).mul_(scale).neg_()
    grad_input = torch.addcmul(_per_channel(shifted, constant), grad_output, _per_channel(shifted, scale))
    grad_input.addcmul_(shifted, _per_channel(shifted, q.mul_(scale)), value=-1)
    return grad_input.to(grad_output.dtype), grad_weight, grad_bias


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
            # (x - running_mean) / sqrt(running_var + eps) * w + b: eval-mode batch_norm is exactly that, one
            # fused per-channel affine pass in the input's dtype and memory format, computing nothing of its own.
            mean, var = self.running_mean, self.running_var
            if self.weight is not None and self.weight.dtype != mean.dtype:  # bf16 weights over float32 statistics
                mean, var = mean.to(self.weight.dtype), var.to(self.weight.dtype)  # (param_dtype): one dtype for all
            return torch.batch_norm(input, self.weight, self.bias, mean, var, False, 0.0, self.eps,
                                    torch.backends.cudnn.enabled)

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
