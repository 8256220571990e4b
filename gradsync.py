"""Gradient averaging for data-parallel training: hand-written, accumulation-aware and bucketed
(``GradientSync``), or PyTorch's DistributedDataParallel behind the same small interface (``DDPSync``).

    sync.prepare(sync=last_micro_batch_of_window)   # before each backward
    sync.finish()                                   # before the optimizer step of a window
    sync.zero_grad()                                # after it

Only the last micro-batch of a window communicates: gradients live in flat buckets (each parameter's .grad is
a view into one), filled in reverse parameter order the way backward produces them. With overlap on, a
post-accumulate-grad hook counts each bucket's parameters down and, once it is complete, divides it by W and
starts an asynchronous all_reduce (SUM), so communication of late layers overlaps the backward of early ones;
buckets are launched strictly in index order so every rank issues the same collectives in the same order.
Without overlap every bucket is launched once backward is over. ``finish`` waits on every handle; with fp16 the
caller's gradient scaler unscales the synchronized gradients. The K-1 other micro-batches do no all_reduce at
all. ``allreduce`` "ring" or "butterfly" hands each complete bucket instead to allreduce.py's own algorithm
(which averages, so there is no division first), run by a thread of its own over a process group of its own,
so it still overlaps backward and never interleaves with SyncBatchNorm's collectives on the default group.

Under torch.profiler (the trainer's --profile) each bucket's average is a range "allreduce bucket I (S)" that
opens when the bucket is launched (inside backward, with overlap) and closes when the average has landed,
whichever thread finishes it (over NCCL: once it is queued on its stream, which is when c10d's future completes;
the kernel's time is in the trace's CUDA rows); waiting for them is "allreduce wait".
"""
from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import utils


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


class GradientSync:
    """Averages gradients over the process group in flat buckets, one all_reduce per bucket (see the module
    docstring). Call ``prepare(sync)`` before each backward, ``finish()`` before the optimizer step of a window
    and ``zero_grad()`` after it; parameters' .grad are views into the buckets and must not be set to None.

    Buckets follow DistributedDataParallel's sizing: reverse parameter order, the first at most 1 MB, the others
    at most ``bucket_mb``. ``allreduce`` "torch" divides a bucket by W and all_reduces it (SUM) asynchronously;
    "ring" or "butterfly" hands it to allreduce.py's algorithm on an AllreduceThread (its own thread and
    process group, so SyncBatchNorm's collectives on the default group meanwhile cannot interleave with it),
    which averages it; either way the buckets are launched in index order and ranks end bit-identical.
    """

    def __init__(self, model: nn.Module, bucket_mb: float, overlap: bool, allreduce: str = "torch",
                 timeout_s: float | None = None):
        self.world_size = dist.get_world_size()
        # ring/butterfly: allreduce.py's algorithms average the buckets on a thread of their own, over a
        # process group of their own (made here, by every rank at the same point); torch: all_reduce (SUM).
        from allreduce import AllreduceThread
        self.averager = None if allreduce == "torch" else AllreduceThread(allreduce, timeout_s)
        params = [p for p in model.parameters() if p.requires_grad]
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
        self.flats: list[torch.Tensor] = []
        self.sizes = [len(b) for b in buckets]
        for index, bucket in enumerate(buckets):
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            offset = 0
            for p in bucket:
                p.grad = gradient_view(flat[offset:offset + p.numel()], p)
                offset += p.numel()
                if overlap:
                    p.register_post_accumulate_grad_hook(partial(self._grad_ready, index))
            self.flats.append(flat)
        self.range_names = [f"allreduce bucket {index} ({size_text(flat.numel() * flat.element_size())})"
                            for index, flat in enumerate(self.flats)]
        self.sync = False
        self.pending: list[int] = []
        self.launched = 0
        self.handles: list[Any] = []

    def prepare(self, sync: bool) -> None:
        """Before a backward: ``sync`` is True only on the last micro-batch of a window."""
        self.sync = sync
        if sync:
            self.pending = list(self.sizes)
            self.launched = 0
            self.handles = []

    def _grad_ready(self, index: int, _param: torch.Tensor) -> None:
        if not self.sync:
            return
        self.pending[index] -= 1
        while self.launched < len(self.flats) and self.pending[self.launched] == 0:
            self._launch()

    def _launch(self) -> None:
        flat = self.flats[self.launched]
        with utils.profiled(self.range_names[self.launched]) as span:
            if self.averager is not None:
                handle = self.averager.submit(flat)  # averages: no division here
            else:
                flat.div_(self.world_size)
                handle = dist.all_reduce(flat, async_op=True)
            if span is not None:  # the range ends when the average lands, not when the launch returns:
                # record_function's hand-over to a future (what torch.distributed.rpc's profiling uses)
                span._call_end_callbacks_on_future(self._landed(handle))
        self.handles.append(handle)
        self.launched += 1

    def _landed(self, handle: Any) -> torch.futures.Future:
        """A torch Future that completes with ``handle``: c10d's Work has one; the averager's
        concurrent.futures.Future is bridged to one from its thread."""
        if self.averager is None:
            return handle.get_future()
        landed: torch.futures.Future = torch.futures.Future()
        handle.add_done_callback(lambda _: landed.set_result(None))
        return landed

    def finish(self) -> None:
        """Launch what the hooks have not (all of it in after-backward mode) and wait for every bucket."""
        while self.launched < len(self.flats):
            self._launch()
        with utils.profiled("allreduce wait"):
            for handle in self.handles:
                handle.wait() if self.averager is None else handle.result()  # re-raises the thread's error
        self.handles = []
        self.sync = False

    def zero_grad(self) -> None:
        for flat in self.flats:
            flat.zero_()


def make_ddp(model: nn.Module, device: torch.device, bucket_mb: float) -> DistributedDataParallel:
    """DistributedDataParallel set up as GradientSync works: gradients as views of its buckets, buckets of at
    most ``bucket_mb``, and no broadcast of rank 0's buffers before every forward (SyncBatchNorm's running
    statistics agree on every rank anyway; local BatchNorm keeps each rank's own, as ours does).

    That last keyword changed name: newer torch calls it forward_sync_buffers, older torch (2.11 among them)
    has only broadcast_buffers, with the same meaning. The installed DDP's signature says which it takes.
    """
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    no_buffer_sync = "forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                   bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
                                   **{no_buffer_sync: False})


class DDPSync:
    """DistributedDataParallel behind GradientSync's interface, so the training step has no branch for it."""

    def __init__(self, ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer):
        self.ddp, self.optimizer = ddp, optimizer

    def prepare(self, sync: bool) -> None:
        # What no_sync() does, as a setting: DDP reads it in forward and keeps it for that backward.
        self.ddp.require_backward_grad_sync = sync

    def finish(self) -> None:
        pass  # DDP waits for its buckets at the end of backward

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def broadcast_state(model: nn.Module, buffers_only: bool = False) -> None:
    """Rank 0's parameters (unless ``buffers_only``) and buffers to every rank."""
    with torch.no_grad():
        tensors = list(model.buffers()) + ([] if buffers_only else list(model.parameters()))
        for t in tensors:
            dist.broadcast(t, src=0)
