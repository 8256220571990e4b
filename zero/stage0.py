"""Stage 0 of zero.shard: gradient averaging for data-parallel training, by hand, accumulation-aware and bucketed;
every rank keeps everything. Also what the sharded stages (zero/stages.py, zero/stage3.py) build on: hooks on
autograd and the end of backward over the buckets of zero/buckets.py (``BucketedSync``), and the training interface
every sync offers (``DataParallel``; its checkpoints are zero.checkpoint's ``Checkpoints``).

    sync = zero.shard(model, 0)                                   # GradientSync(model) underneath
    optimizer = sync.optimizer(torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9)
    sync.set_requires_gradient_sync(last_micro_batch)             # before each backward
    loss.backward()                                               # averaged by the end of the last one
    optimizer.step(); optimizer.zero_grad()

Gradients live in flat buckets (each parameter's .grad a view into one), filled in reverse parameter order the way
backward produces them: DistributedDataParallel's sizing (zero/buckets.py), the first bucket at most 1 MB, the
others at most ``bucket_mb``. Only a backward after set_requires_gradient_sync(True) (the default) communicates: the
others accumulate into the buckets and send nothing. With ``overlap`` on, a post-accumulate-grad hook counts each
bucket's parameters down and, once it is complete, averages it asynchronously (collectives.py: torch's all_reduce,
or allreduce.py's ring or butterfly on a thread of its own), so communication of late layers overlaps the backward
of early ones; buckets launch strictly in index order so every rank issues the same collectives in the same order. A
callback queued on autograd's engine waits for them all at the end of backward [Note: the end of backward], so the
gradients are averaged when ``backward()`` returns, with nothing else to call. Under torch.profiler each bucket's
average is a range "allreduce bucket I (S)" from its launch to its landing; waiting for them is "allreduce wait".
"""
from __future__ import annotations

from functools import partial
from typing import Any, Iterable, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable

from collectives import Collectives
from measure.timing import profiled
from zero.broadcast import broadcast_state, check_keys_on_rank0, only_rank0_holds
from zero.buckets import Bucket, assign_buckets
from zero.checkpoint import WholeCheckpoints


class DataParallel(Protocol):
    """What every sync offers the training loop: ours (zero.shard, stages 0-3; diloco.py's replicas) and PyTorch's
    (references.py: DistributedDataParallel, ZeroRedundancyOptimizer, FSDP2). Rank 0 of the group holds the whole
    state dicts. Its checkpoints are the other half of its interface (zero.checkpoint.Checkpoints:
    ``save_checkpoint``, ``load_checkpoint``, ``holds_shards``); the last four methods say what it holds and sends,
    for the trainer's figures and zero.state_bytes."""

    module: nn.Module  # what the loop runs forward on (DDP's wrapper, else the model itself)

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any],
                  **settings: Any) -> torch.optim.Optimizer: ...

    def set_requires_gradient_sync(self, requires: bool) -> None: ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor: ...

    def model_state_dict(self) -> dict[str, Any]: ...

    def load_model_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...

    def held_gradient_buffers(self) -> list[torch.Tensor]: ...

    def held_shards(self) -> list[torch.Tensor]: ...

    def gathered_peak(self) -> dict[str, int] | None: ...

    def sent_bytes(self) -> int | None: ...


class BucketedSync(WholeCheckpoints):
    """What every hand-written stage shares: the trainable parameters in Buckets, a hook on each parameter's
    gradient, the end of backward, the sync switch, and close(). A stage says what to do with a gradient
    (``_grad_ready``) and at the end of backward (``_backward_done``).

    [Note: the end of backward] The first gradient hook of a backward queues a callback on autograd's engine
    (Variable._execution_engine.queue_callback, as DistributedDataParallel's reducer and picotron's bucketed
    data parallelism do): it runs once the whole backward is done, before ``backward()`` returns, so the stage
    waits for its collectives there, and the loop has nothing to call between backward and the optimizer. It also
    checks that every trainable parameter got its gradient: one that did not would leave its bucket waiting and
    its collectives out of step with the other ranks'; it is named in one line instead."""

    word = "bucket"  # what a bucket is called in profiler ranges (stage 3: "unit")
    bucket_class = Bucket  # (stage 3: zero.Unit)

    def __init__(self, model: nn.Module, bucketed: list[list[nn.Parameter]], comm: Collectives, chunks: int):
        self.module = self.model = model
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.size
        self.params = [p for p in model.parameters() if p.requires_grad]
        first = self.params[0]  # the dtype and device of a bucket with no parameter (stage 3: a frozen unit's)
        self.buckets = [self.bucket_class(index, params, chunks, self.word, first.dtype, first.device)
                        for index, params in enumerate(bucketed)]
        self.bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.requires_sync = True
        self.in_backward = False
        self.arrived: set[int] = set()  # the parameters whose gradient is in, in this backward
        self.hooks = [p.register_post_accumulate_grad_hook(partial(self._on_grad, self.bucket_of[id(p)]))
                      for p in self.params]
        self.hooks.append(model.register_forward_pre_hook(self._before_forward))

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """Whether the next backward averages over the group (True: the last micro-batch of a window) or only
        accumulates (what DDP's no_sync() does)."""
        self.requires_sync = requires

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        """Before each forward (stages add to it)."""

    def _on_grad(self, bucket: Bucket, param: nn.Parameter) -> None:
        if not self.in_backward:  # the backward's first gradient
            self.in_backward = True
            self.arrived = set()
            for b in self.buckets:
                b.pending = len(b.params)
            Variable._execution_engine.queue_callback(self._end_of_backward)
        self.arrived.add(id(param))
        bucket.pending -= 1
        self._grad_ready(bucket, param)

    def _end_of_backward(self) -> None:
        self.in_backward = False
        if len(self.arrived) != len(self.params):
            missing = [self.names[id(p)] for p in self.params if id(p) not in self.arrived]
            raise RuntimeError(f"data parallelism: parameter(s) {', '.join(missing)} got no gradient in this "
                               f"backward; every trainable parameter must take part in the loss on every rank (or "
                               f"set requires_grad=False)")
        self._backward_done()

    def _grad_ready(self, bucket: Bucket, param: nn.Parameter) -> None:
        raise NotImplementedError

    def _backward_done(self) -> None:
        raise NotImplementedError

    def _wait(self, buckets: list[Bucket], what: str) -> None:
        with profiled(what):
            for bucket in buckets:
                bucket.handle.wait()
                bucket.handle = None

    def model_state_dict(self) -> dict[str, Any]:
        """The model's state_dict on rank 0 of the group (CPU tensors), {} on the others: the model is whole on
        every rank between steps (stage 3 overrides this)."""
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()} if self.rank == 0 else {}

    def load_model_state_dict(self, state: dict[str, Any] | None) -> None:
        """Load a whole state_dict, given on every rank alike, or on the group's rank 0 only (the others passing
        None or {}: then sent from there, one tensor at a time, or at stages 1-3 one bucket's shards at a time;
        FSDP2's broadcast_from_rank0). At stages 1 and 2 the weights' shards are views of the model's parameters,
        so they follow."""
        self._load_whole(state, only_rank0_holds(state, self.comm.group))

    def _load_whole(self, state: dict[str, Any] | None, from_rank0: bool) -> None:
        if not from_rank0:
            self.model.load_state_dict(state)
            return
        check_keys_on_rank0(self.model, state, self.comm.group)
        if self.rank == 0:
            self.model.load_state_dict(state)
        broadcast_state(self.model, group=self.comm.group)

    def sent_bytes(self) -> int:
        """Bytes this rank has sent in the gradient sync (collectives.py's count)."""
        return self.comm.sent_bytes()

    def held_shards(self) -> list[torch.Tensor]:
        """Shards of parameters this rank holds besides the model's own and the optimizer's (stage 3's frozen
        parts)."""
        return []

    def gathered_peak(self) -> dict[str, int] | None:
        return None

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        return self.comm.group

    def close(self) -> None:
        """Remove every hook and stop the collectives' thread: the model is an ordinary module again."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.comm.close()


class GradientSync(BucketedSync):
    """Stage 0: every rank keeps every weight, gradient and optimizer state, and the gradients are averaged over
    the group in flat buckets, one collective per bucket on the window's last backward (module docstring).

    The flats are the gradients: each parameter's .grad is a view into its bucket's flat. ``optimizer.zero_grad()``
    sets them to None (torch's default); the next forward puts the views back, zeroed."""

    collective = "allreduce"

    def __init__(self, model: nn.Module, bucket_mb: float = 25.0, overlap: bool = True,
                 comm: Collectives | None = None, chunks: int = 1):
        comm = comm or Collectives()
        params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(model, assign_buckets(params, bucket_mb), comm, chunks)
        self.overlap = overlap
        self.flats = [bucket.zeros() for bucket in self.buckets]
        self._attach_gradients()
        self.launched = 0  # buckets launched in this backward, in index order

    def _attach_gradients(self) -> None:
        """Every parameter's .grad its view of the flat: put back, zeroed, where zero_grad() set it to None."""
        for bucket, flat in zip(self.buckets, self.flats):
            for p in bucket.params:
                if p.grad is None:
                    view = bucket.view(flat, p)
                    view.zero_()
                    p.grad = view

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self._attach_gradients()

    def _grad_ready(self, bucket: Bucket, param: nn.Parameter) -> None:
        if self.requires_sync and self.overlap:
            while self.launched < len(self.buckets) and self.buckets[self.launched].pending == 0:
                self._launch(self.buckets[self.launched])

    def _launch(self, bucket: Bucket) -> None:
        bucket.handle = self._average(bucket, self.flats[bucket.index])
        self.launched += 1

    def _average(self, bucket: Bucket, flat: torch.Tensor) -> Any:
        return self.comm.all_reduce(flat, bucket.name(self.collective))

    def _backward_done(self) -> None:
        """The window's last backward: launch what the hooks have not (all of it without overlap), wait for all."""
        if self.requires_sync:
            for bucket in self.buckets[self.launched:]:
                self._launch(bucket)
            self._wait(self.buckets, f"{self.collective} wait")
        self.launched = 0

    # ------------------------------------------------------------------------------------------------------
    # The contract (zero.shard's): replicated, so PyTorch's own functions apply as they are
    # ------------------------------------------------------------------------------------------------------
    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any],
                  **settings: Any) -> torch.optim.Optimizer:
        """``optimizer_class(params, **settings)``: every rank steps the whole model."""
        return optimizer_class(params, **settings)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the averaged gradients, the same on every rank."""
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm, norm_type, error_if_nonfinite)

    def held_gradient_buffers(self) -> list[torch.Tensor]:
        return list(self.flats)
