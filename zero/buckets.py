"""Buckets: parameters that travel together as one flat tensor, what every stage of zero.shard stands on. Stage 0
(zero/stage0.py) and stages 1-2 (zero/stages.py) average a bucket of gradients, stage 3 (zero/stage3.py) gathers a
unit of parameters; the optimizer's runs (zero/optimizer.py) and the checkpoint's pieces (zero/pieces.py) are
ranges of a bucket's elements.

``assign_buckets`` sizes them as DistributedDataParallel does; ``Bucket`` owns one's layout (each parameter at its
offset, laid out by its own strides: ``gradient_view``) and the state of its current backward.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Any

import torch
import torch.nn as nn


def gradient_view(piece: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``param``'s slice of a flat bucket, viewed with ``param``'s strides.

    A channels-last weight wants a channels-last gradient: autograd's layout contract. A contiguous view would
    make every step warn ("grad and param do not obey the gradient layout contract") and copy each such
    gradient into the view. A dense parameter's strides are a permutation of contiguous ones, so they address
    exactly its numel() elements of the slice.
    """
    expected = 1
    for size, stride in sorted(zip(param.shape, param.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:  # not dense (overlapping or with gaps): keep the plain layout
            return piece.view_as(param)
        expected *= size
    return piece.as_strided(param.shape, param.stride())


def size_text(nbytes: int) -> str:
    """1234567 -> '1.2 MB', 20480 -> '20.5 kB', 400 -> '400 B' (decimal units, as profilers print them)."""
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def assign_buckets(params: list[nn.Parameter], bucket_mb: float) -> list[list[nn.Parameter]]:
    """DistributedDataParallel's bucket sizing: reverse parameter order (the order backward produces gradients),
    the first bucket at most 1 MB, the others at most ``bucket_mb``, and a new bucket at every change of dtype."""
    cap_bytes = int(bucket_mb * 2**20)
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        limit = min(cap_bytes, 2**20) if len(buckets) == 1 else cap_bytes
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and (size + nbytes > limit or p.dtype != buckets[-1][0].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


class Bucket:
    """Parameters that travel together as one flat tensor: a bucket of gradients to average (stages 0-2) or a
    unit of parameters to gather (stage 3). Owns its layout and the state of its current backward.

    Layout: parameter i starts at element ``offsets[i]`` and is laid out as ``gradient_view`` says (its own
    strides), so the flat weight and the flat gradient match element by element; ``length`` pads ``numel`` to a
    multiple of ``chunks`` (the sharded stages' W equal chunks; the padding stays zero)."""

    def __init__(self, index: int, params: list[nn.Parameter], chunks: int, word: str,
                 dtype: torch.dtype | None = None, device: torch.device | None = None):
        self.index, self.params = index, params
        self.empty_dtype, self.empty_device = dtype, device  # an empty bucket's (stage 3: a frozen unit's)
        self.offsets = list(accumulate((p.numel() for p in params[:-1]), initial=0))
        self.numel = sum(p.numel() for p in params)
        self.length = -(-self.numel // chunks) * chunks
        # each parameter's first element and strides in the flat, worked out once rather than in every hook call
        self.place = {id(p): (start, gradient_view(torch.empty(p.numel(), device="meta"), p).stride())
                      for p, start in zip(params, self.offsets)}
        self.word = word
        self.pending = len(params)  # gradients still to come in this backward
        self.handle: Any = None  # its collective in flight
        self.final = False  # launched by a window's last backward (stage 2-3: what lands completes its gradient)

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype now (a lower param_dtype moves them into it)."""
        return self.params[0].dtype if self.params else self.empty_dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device if self.params else self.empty_device

    def view(self, flat: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        """Parameter ``p``'s place in ``flat`` (this bucket's length, or longer), with ``p``'s shape and strides."""
        start, strides = self.place[id(p)]
        return flat.as_strided(p.shape, strides, flat.storage_offset() + start)

    def name(self, collective: str) -> str:
        """The profiler range of this bucket's ``collective``: "allreduce bucket 3 (1.0 MB)"."""
        nbytes = self.length * self.dtype.itemsize
        return f"{collective} {self.word} {self.index} ({size_text(nbytes)})"

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.length, dtype=self.dtype, device=self.device)
