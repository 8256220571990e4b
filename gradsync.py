"""Gradient averaging for data-parallel training: hand-written, accumulation-aware and bucketed
(``GradientSync``), or PyTorch's DistributedDataParallel behind the same small interface (``DDPSync``).

    optimizer = torch.optim.SGD(sync.parameters(), ...)
    sync.prepare(sync=last_micro_batch_of_window)   # before each backward
    sync.finish()                                   # before the optimizer step of a window
    sync.gather_params()                            # after it (nothing here; zero.py's stages gather shards)
    sync.zero_grad()                                # then

zero.py's ZeRO stages are subclasses of GradientSync: the same buckets and hooks, other collectives.

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
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
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

    collective = "allreduce"  # what a bucket's range is called in profiler traces
    group_word = "bucket"  # what a group of parameters is called there (zero.py's stage 3: "unit")

    def __init__(self, model: nn.Module, bucket_mb: float, overlap: bool, allreduce: str = "torch",
                 timeout_s: float | None = None):
        self.world_size = dist.get_world_size()
        # ring/butterfly: allreduce.py's algorithms average the buckets on a thread of their own, over a
        # process group of their own (made here, by every rank at the same point); torch: all_reduce (SUM).
        from allreduce import AllreduceThread, sent_bytes
        self.averager = None if allreduce == "torch" else AllreduceThread(allreduce, timeout_s)
        self.ring_sent_at_start, self.nominal_sent = sent_bytes(), 0  # for sent_bytes()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = self.group(model, bucket_mb)
        self.sizes = [len(b) for b in self.buckets]
        # each parameter's first element in its bucket's flat, and each flat's length
        self.offsets = [list(accumulate((p.numel() for p in bucket[:-1]), initial=0)) for bucket in self.buckets]
        self.lengths = [self.flat_length(bucket) for bucket in self.buckets]
        self.flats: list[torch.Tensor | None] = [self._gradient_buffer(index) for index in range(len(self.buckets))]
        if overlap:
            for index, bucket in enumerate(self.buckets):
                for p in bucket:
                    p.register_post_accumulate_grad_hook(partial(self._grad_ready, index))
        self.range_names = [f"{self.collective} {self.group_word} {index} "
                            f"({size_text(length * bucket[0].element_size())})"
                            for index, (bucket, length) in enumerate(zip(self.buckets, self.lengths))]
        self.sync = False
        self.pending: list[int] = []
        self.launched = 0
        self.handles: list[Any] = []
        self.unlanded: dict[int, torch.futures.Future] = {}  # profiled ranges of Works without a future

    def group(self, model: nn.Module, bucket_mb: float) -> list[list[nn.Parameter]]:
        """The trainable parameters in buckets (assign_buckets); zero.py's stage 3 groups them by unit."""
        return assign_buckets(self.params, bucket_mb)

    def flat_length(self, bucket: list[nn.Parameter]) -> int:
        """Elements of a bucket's flat buffer: its parameters' (the sharded stages pad to a multiple of W)."""
        return sum(p.numel() for p in bucket)

    def _gradient_buffer(self, index: int) -> torch.Tensor | None:
        """Bucket ``index``'s flat gradient buffer, with every parameter's .grad a view into it."""
        bucket = self.buckets[index]
        flat = torch.zeros(self.lengths[index], dtype=bucket[0].dtype, device=bucket[0].device)
        for p, start in zip(bucket, self.offsets[index]):
            p.grad = gradient_view(flat[start:start + p.numel()], p)
        return flat

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
            self._launch(self.launched)

    def _launch(self, index: int) -> None:
        with utils.profiled(self.range_names[index]) as span:
            handle = self._start(index)
            if span is not None:  # the range ends when the average lands, not when the launch returns:
                # record_function's hand-over to a future (what torch.distributed.rpc's profiling uses)
                span._call_end_callbacks_on_future(self._landed(handle))
        self.handles.append(handle)
        self.launched += 1

    def _start(self, index: int) -> Any:
        """Start averaging bucket ``index``; returns what finish() waits on."""
        flat = self.flats[index]
        if self.averager is not None:
            return self.averager.submit(flat)  # averages: no division here
        flat.div_(self.world_size)
        self.nominal_sent += 2 * (self.world_size - 1) * flat.numel() * flat.element_size() // self.world_size
        return dist.all_reduce(flat, async_op=True)

    def _landed(self, handle: Any) -> torch.futures.Future:
        """A torch Future that completes with ``handle``: c10d's Work has one; the averager's
        concurrent.futures.Future is bridged to one from its thread. A Work without one (gloo's
        reduce_scatter_tensor: "Work::getFuture not implemented") gets one that _wait completes once it has
        waited for the Work, so its range closes when the wait sees it done."""
        if self.averager is not None:
            landed: torch.futures.Future = torch.futures.Future()
            handle.add_done_callback(lambda _: landed.set_result(None))
            return landed
        try:
            return handle.get_future()
        except RuntimeError:
            self.unlanded[id(handle)] = torch.futures.Future()
            return self.unlanded[id(handle)]

    def finish(self) -> None:
        """Launch what the hooks have not (all of it in after-backward mode) and wait for every bucket."""
        while self.launched < len(self.flats):
            self._launch(self.launched)
        with utils.profiled(f"{self.collective} wait"):
            self._wait(self.handles)
        self.handles = []
        self.sync = False

    def _wait(self, handles: list[Any]) -> None:
        for handle in handles:
            handle.wait() if self.averager is None else handle.result()  # re-raises the thread's error
            if id(handle) in self.unlanded:
                self.unlanded.pop(id(handle)).set_result(None)

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates: every trainable parameter, in the model's order (ZeRO: this rank's
        shards)."""
        return self.params

    def gather_params(self) -> None:
        """After the optimizer step. Every rank stepped the whole model: nothing to gather (ZeRO: see zero.py)."""

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The optimizer's state_dict over the model's trainable parameters, in their order: the form every sync
        saves and loads (zero.py's sharded stages assemble it from their shards)."""
        return optimizer.state_dict()

    def model_state(self, model: nn.Module) -> dict[str, Any] | None:
        """The model's whole state_dict, for rank 0 to save (every rank calls it: zero.py's stage 3 gathers its
        units); the other ranks may get None."""
        return model.state_dict()

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Load a whole state_dict (every rank calls it, with the same one); a mismatch raises RuntimeError."""
        model.load_state_dict(state)

    def release_model(self) -> None:
        """After training: leave the model whole and ordinary for the caller (zero.py's stage 3 gathers it)."""

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def sent_bytes(self) -> int:
        """Bytes this rank has sent averaging gradients: counted by allreduce.py's algorithms, or for
        torch.distributed's all_reduce what a ring sends, 2 (W-1)/W of each bucket."""
        if self.averager is not None:
            from allreduce import sent_bytes
            return sent_bytes() - self.ring_sent_at_start
        return self.nominal_sent

    def zero_grad(self) -> None:
        for flat in self.flats:
            flat.zero_()

    def close(self) -> None:
        """Stop what this sync started (the averaging thread and its process group)."""
        if self.averager is not None:
            self.averager.close()
            self.averager = None


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

    def gather_params(self) -> None:
        pass  # ZeroRedundancyOptimizer broadcasts the updated parameters inside its step

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """As GradientSync's. ZeroRedundancyOptimizer first gathers its shards to rank 0 (every rank calls it)."""
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.consolidate_state_dict(to=0)
            return optimizer.state_dict() if dist.get_rank() == 0 else None
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)  # ZeroRedundancyOptimizer keeps its own partition of it

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return model.state_dict()

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        model.load_state_dict(state)

    def release_model(self) -> None:
        pass

    def sent_bytes(self) -> None:
        return None  # inside DDP's reducer and gloo: not counted

    def close(self) -> None:
        pass


def broadcast_state(model: nn.Module, buffers_only: bool = False) -> None:
    """Rank 0's parameters (unless ``buffers_only``) and buffers to every rank."""
    with torch.no_grad():
        tensors = list(model.buffers()) + ([] if buffers_only else list(model.parameters()))
        for t in tensors:
            dist.broadcast(t, src=0)
