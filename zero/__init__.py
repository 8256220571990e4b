"""ZeRO: data parallelism that shards the training state over the W ranks of a process group, as a library for
your own training loop.

    import zero
    sharded = zero.shard(model, stage, units=None, group=None, collectives="torch",   # stage 0..3; "ring" too
                         replicate_group=None, param_dtype=None, reduce_dtype=None,    # stages 1-3: hybrid, bf16
                         init=None)                                                   # a meta-device model: fn(module)
    optimizer = sharded.optimizer(torch.optim.AdamW, params_or_groups, lr=3e-4)        # over the MODEL's params
    for i, batch in enumerate(window):
        sharded.set_requires_gradient_sync(i == len(window) - 1)
        loss_fn(model, batch).backward()                 # averaged over the group when the last backward returns
    total_norm = sharded.clip_grad_norm_(max_norm)       # the norm of the whole model's gradient
    optimizer.step(); optimizer.zero_grad()              # the model is whole after step(): nothing else to call
    sharded.model_state_dict(); sharded.load_model_state_dict(state)   # full, on the group's rank 0
    optimizer.state_dict(); optimizer.load_state_dict(state)           # torch.optim's ordinary, unsharded form
    sharded.close()                                      # every hook removed, the model left whole
    sharded.sent_bytes(); sharded.sent_bytes_by_group()  # bytes sent: {"shard_group": ..., "replicas": ...}
    zero.checkpoint.save(path, sharded, optimizer, extra=None)         # sharded, torch.distributed.checkpoint's
    extra = zero.checkpoint.load(path, sharded, optimizer)             # format: zero/checkpoint.py

A model built on the meta device is materialized by zero.shard one module at a time (``init=fn``, zero/init.py),
so that at stage 3 no rank ever holds it whole; its weights are bit for bit those of one process running ``fn``
over ``model.modules()``, at any world size. Frozen parameters are sharded at stage 3 too ([Note: frozen
parameters]). A whole state_dict may be given to load_model_state_dict on the group's rank 0 alone (the others
passing None): it is then scattered, one bucket's chunks at a time.

Parameter groups are given as to any torch.optim optimizer (a configure_optimizers with decay on matrices only
works unchanged) and keep their hyperparameters at every stage. ``group`` is any process group: a sub-group trains
as if it were alone. At stage >= 1 an optimizer built over the model's parameters outside ``sharded.optimizer``
is refused at its first step(); a parameter that gets no gradient is named at the end of that backward. Every
element-wise torch.optim optimizer is exact at every stage, its state dict torch.optim's own, and so are Muon and
Adafactor (zero/matrix.py: what needs a whole matrix travels, pieces by all-to-all or sums by all-reduce); LBFGS
and SparseAdam are refused at ``sharded.optimizer`` ([Note: which optimizers]). Several optimizers may share one
model, each over its own parameters (Muon on the matrices, AdamW on the rest: [Note: several optimizers]).

``param_dtype`` (stages 1-3; zero/precision.py): the weights are kept (stages 1-2) or gathered (stage 3) and
computed in it, while the optimizer steps master shards in the model's own dtype with state in that dtype, and
every state dict and the model close() hands back are in it; ``reduce_dtype`` (default ``param_dtype``) is what
gradients are summed over the ranks in. fp16 is refused (it needs loss scaling). ``replicate_group`` (stages 1-3;
zero/hybrid.py): hybrid sharding, the state sharded over ``group`` and replicated over the ranks holding the same
shard, the groups a grid of the world (R replicas x S shards): a gradient is reduce-scattered in ``group``, and
its shard averaged over ``replicate_group`` once per step.

What a rank holds, for Psi parameters trained with AdamW (two state tensors per parameter), in bytes, with fp32
masters and state and weights in fp32 (p = 4) or bf16 (p = 2, param_dtype=torch.bfloat16; the masters, and at
stage 1 the fp32 gradient shards, are then 4 Psi / W more each, tensors of their own):

    stage   weights             gradients       optimizer state   total (fp32)         total (bf16 weights)
    0       4 Psi               4 Psi           8 Psi             16 Psi               (gradsync.GradientSync, DDP)
    1       p Psi (+ 4 Psi / W) p Psi (+ 4 Psi / W) 8 Psi / W     8 Psi + 8 Psi / W    4 Psi + 16 Psi / W
    2       p Psi (+ 4 Psi / W) 4 Psi / W (+)   8 Psi / W         4 Psi + 12 Psi / W   2 Psi + 16 Psi / W
    3       4 Psi / W           4 Psi / W (+)   8 Psi / W         16 Psi / W           16 Psi / W
    (+ the gradient buffers in flight during backward, in reduce_dtype; stage 3, during a step: the root and two
    units, in param_dtype)

Sent per rank and optimizer step of K micro-batches, in elements: stage 0 and 1, 2 (W-1)/W Psi (one all-reduce,
or a reduce-scatter and an all-gather); stage 2, (K+1)(W-1)/W Psi; stage 3, about 3K (W-1)/W Psi (every unit
gathered for its forward and its backward, and reduce-scattered, on every micro-batch). The gathers move
param_dtype's bytes (bf16: half of fp32's), the reductions reduce_dtype's. Hybrid, with W = S inside a replica:
the same inside the shard group, plus 2 (R-1)/R Psi / S across replicas (one all-reduce of each rank's shard).

Where each part is: zero/precision.py (the dtypes, the masters), zero/hybrid.py (the grid, the replicas);
zero/checkpoint.py (sharded checkpoints in torch.distributed.checkpoint's format, imported at first use);
zero/optimizer.py's ShardedOptimizer (the optimizer side of stages 1-3, a part each stage
holds: the shards, parameter groups, clipping, the unsharded state dicts, which optimizers it carries); here
ZeroStage1, ZeroStage2, ZeroStage3 (each says what it adds to the one before, and in its own body what runs after
a backward and after a step), shard() at the end; gradsync.py (stage 0, buckets, hooks, the end of backward),
collectives.py (the collectives, torch's or the ring's), references.py (DDP, ZeroRedundancyOptimizer and FSDP2
behind the same interface).
"""
from __future__ import annotations

import enum
from functools import partial
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

import utils
from collectives import Collectives
from gradsync import Bucket, BucketedSync, GradientSync, assign_buckets, broadcast_state, check_keys_on_rank0
from zero import init as init_module
from zero.hybrid import Replicas, check_grid
from zero.optimizer import (ELEMENTWISE, WHOLE_PARAMETER, ShardedOptimizer, ShardRun, as_optimizers,
                            check_optimizer_class, missing_optimizer_state, state_kinds)
from zero.precision import (Precision, cast_forward_inputs, gather_full, gathered_state_dict, load_masters,
                            master_state_dict, resolve, scatter_masters, shard_weights)

__all__ = ["shard", "default_units", "stage_3_units", "state_bytes", "ZeroStage1", "ZeroStage2", "ZeroStage3",
           "ShardedOptimizer", "ShardRun", "ELEMENTWISE", "WHOLE_PARAMETER", "check_optimizer_class", "state_kinds",
           "missing_optimizer_state", "checkpoint"]


def __getattr__(name: str) -> Any:
    """``zero.checkpoint``, imported at its first use: torch.distributed.checkpoint brings DTensor with it, about
    half a second of every process's start-up otherwise."""
    if name == "checkpoint":
        import importlib
        return importlib.import_module("zero.checkpoint")
    raise AttributeError(f"module 'zero' has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------------------
# The stages
# ----------------------------------------------------------------------------------------------------------
def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (where activation checkpointing recomputes a
    forward)."""
    return torch._C._current_graph_task_id() != -1


def all_gather_weights(stage: ZeroStage1 | ZeroStage2, buckets: list[Bucket]) -> None:
    """[Note: after the step] Stages 1 and 2: every rank's updated chunks into every rank's weights (all-gather in
    place, every bucket launched before any is waited for), so the model is whole for the next forward. Under a
    lower param_dtype each rank first casts its master shard into its chunk of the flat: the gather moves the
    low-precision bytes."""
    for bucket in buckets:
        flat = stage.param_flats[bucket.index]
        if stage.precision.separate_masters:
            stage.comm.chunk(flat).copy_(stage.weights[bucket.index])
        bucket.handle = stage.comm.all_gather(flat, bucket.name("all_gather"))
    stage._wait(buckets, "all_gather wait")


class ShardedStage:
    """What stages 1-3 share beyond their buckets: the precision (zero/precision.py), the replicas (zero/hybrid.py),
    and the state dicts and close() in the masters' dtype. A stage sets ``precision``, ``replicas``,
    ``weights`` (the master shards) before calling ``_start_sharded``."""

    precision: Precision
    replicas: Replicas | None
    weights: list[torch.Tensor]

    def _start_sharded(self) -> None:
        if self.precision.separate_masters:  # FSDP2's cast_forward_inputs at the root
            self.hooks.append(self.model.register_forward_pre_hook(cast_forward_inputs(self.precision.param)))

    def _average_over_replicas(self, grads: list[torch.Tensor]) -> None:
        """Hybrid sharding: the window's gradient shards averaged across the replicas (zero/hybrid.py)."""
        if self.replicas is not None:
            self.replicas.average(grads, [b.name("allreduce across replicas") for b in self.buckets])

    def model_state_dict(self) -> dict[str, Any]:
        """The whole state_dict on the group's rank 0 (CPU), {} on the others; under a lower param_dtype gathered
        from the masters, so it is in the model's own dtype."""
        self.shards.finish_steps()  # a bucket whose other optimizer skipped its step: gathered now
        if self.precision.separate_masters:
            return master_state_dict(self.model, self.buckets, self.comm, self.weights, self.rank)
        return super().model_state_dict()

    def _load_whole(self, state: dict[str, Any] | None, from_rank0: bool) -> None:
        """Stages 1-2: into the model (its weights, cast to param_dtype) and, where they are their own, the
        masters (cut out of the state on every rank, or scattered from rank 0)."""
        super()._load_whole(state, from_rank0)
        if self.precision.separate_masters:
            (scatter_masters if from_rank0 else load_masters)(self.buckets, self.comm, self.weights, self.names,
                                                              state)

    def held_pieces(self) -> dict[str, list[Any]]:
        """What this rank holds of the parameters kept in flat buckets, for zero/checkpoint.py: under each name of
        each such parameter, its pieces in this rank's chunks (checkpoint.Piece: the elements [start, end) of its
        memory order, a 1-D view of them in the masters), none where the rank holds none. Everything else in the
        model's state_dict (buffers, frozen parameters) is whole on every rank. Another sharded part (frozen
        parameters sharded at stage 3) is one more (buckets, shards) pair of flat_pieces."""
        from zero.checkpoint import flat_pieces
        return flat_pieces(self.model, self.buckets, self.weights, self.rank)

    def shards_loaded(self) -> None:
        """After this rank's master shards were written other than by a step (zero/checkpoint.py's load): stages
        1-2 gather them into every rank's whole weights, as after a step. Every rank of the group calls it."""
        all_gather_weights(self, self.buckets)

    def sent_bytes(self) -> int:
        """Bytes this rank has sent: in its shard group, and across replicas (sent_bytes_by_group)."""
        return sum(self.sent_bytes_by_group().values())

    def sent_bytes_by_group(self) -> dict[str, int]:
        """{"shard_group": bytes sent inside the shard group, "replicas": bytes sent across replicas}."""
        return {"shard_group": self.comm.sent_bytes(),
                "replicas": self.replicas.sent_bytes() if self.replicas is not None else 0}

    def _hand_back_masters(self) -> None:
        """Under a lower param_dtype, before close(): every parameter made a view of its bucket's whole master
        flat (gathered), so the model handed back is in its own dtype; the low-precision .grad views dropped."""
        if self.precision.separate_masters:
            for bucket, shard in zip(self.buckets, self.weights):
                full = gather_full(self.comm, bucket, shard)
                for p in bucket.params:
                    p.grad = None
                    p.data = bucket.view(full, p)

    def close(self) -> None:
        self.shards.finish_steps()
        self._hand_back_masters()
        super().close()
        if self.replicas is not None:
            self.replicas.close()


class ZeroStage1(ShardedStage, GradientSync):
    """Stage 1, the optimizer's state sharded. What it adds to stage 0 (gradsync.GradientSync): the buckets are
    padded to W equal chunks and hold the weights too (the parameters become views of flat weight buckets); on the
    window's last backward each complete bucket is reduce-scattered instead of all-reduced, so chunk r of it holds
    the average over ranks, which is the gradient of this rank's shard; the optimizer steps the shards, and the
    step's hook all-gathers the updated chunks into every rank's weights. The K-1 other micro-batches accumulate
    into the full flats and send nothing: 2 (W-1)/W Psi elements per step, one all-reduce's worth.

    After the reduce-scatter the rest of each gradient flat (this rank's local sums of the others' chunks) has
    served its purpose and is zeroed, so the model's .grad views are not the averaged gradient: the optimizer's
    are, and clip_grad_norm_ reads them."""

    stage = 1
    collective = "reduce_scatter"

    def __init__(self, model: nn.Module, bucket_mb: float, overlap: bool, comm: Collectives,
                 precision: Precision, replicas: Replicas | None = None):
        super().__init__(model, bucket_mb, overlap, comm, chunks=comm.size)
        self.precision, self.replicas = precision, replicas
        if precision.separate_masters:
            for p in self.params:
                p.grad = None  # the .grad views follow their parameters into param_dtype (below)
        self.param_flats, self.weights = shard_weights(self.buckets, comm, precision, own_shards=False)
        if precision.separate_masters:
            self.flats = [bucket.zeros() for bucket in self.buckets]  # in param_dtype: the parameters' now
            self._attach_gradients()
            self.grads = [torch.zeros(b.length // comm.size, dtype=precision.master, device=b.device)
                          for b in self.buckets]
        else:
            self.grads = [comm.chunk(flat) for flat in self.flats]  # views: the reduce-scatter lands in place
        self.reducing: list[torch.Tensor | None] = [None] * len(self.buckets)  # what each bucket reduces, and in
        self._start_sharded()
        self.shards = ShardedOptimizer(self.stage, self.buckets, self.names, comm, self.weights, self.grads,
                                       self._after_step)
        self.hooks.append(self.shards.hook)
        self.optimizer, self.clip_grad_norm_ = self.shards.optimizer, self.shards.clip_grad_norm_  # the part's

    def _average(self, bucket: Bucket, flat: torch.Tensor) -> Any:
        """Reduce-scatter the bucket: the flat itself, or a copy of it in reduce_dtype."""
        reducing = flat if flat.dtype == self.precision.reduce else flat.to(self.precision.reduce)
        self.reducing[bucket.index] = reducing
        return self.comm.reduce_scatter(reducing, bucket.name(self.collective))

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self._attach_gradients()
        self.shards.before_forward()

    def _after_step(self, buckets: list[Bucket]) -> None:
        all_gather_weights(self, buckets)

    def _backward_done(self) -> None:
        """Stage 0's (every bucket averaged, here reduce-scattered); with replicas each chunk averaged across them;
        each chunk into the gradient shard where that is not the flat's own chunk (reduce_dtype, masters); then
        the rest of each flat zeroed (all of it, where the shard is a tensor of its own)."""
        synced = self.requires_sync
        super()._backward_done()
        if synced:
            chunks = [self.comm.chunk(reducing) for reducing in self.reducing]
            self._average_over_replicas(chunks)
            for bucket, flat, chunk, grad in zip(self.buckets, self.flats, chunks, self.grads):
                if chunk.data_ptr() != grad.data_ptr():
                    grad.copy_(chunk)
                if self.precision.separate_masters:
                    flat.zero_()
                    continue
                lo, hi = self.shards.chunk_bounds(bucket)
                flat[:lo].zero_()
                flat[hi:].zero_()
            self.reducing = [None] * len(self.buckets)

    def held_gradient_buffers(self) -> list[torch.Tensor]:
        return list(self.grads)


class ZeroStage2(ShardedStage, BucketedSync):
    """Stage 2, the gradients sharded too. What it adds to stage 1: no full gradient outlives its bucket. On EVERY
    micro-batch each parameter's gradient is copied into its bucket's buffer the moment autograd produces it, and
    the parameter's .grad freed; a complete bucket is reduce-scattered, its chunk added to this rank's gradient
    shard (``grads[b]``, Psi/W elements in all), and the buffer reused for a later bucket. Full buffers exist only
    while a bucket fills or is in flight: a pool, grown only when every buffer is busy, dropped at the end of each
    window. The price is K reduce-scatters per optimizer step instead of one, (K+1)(W-1)/W Psi elements sent per
    rank, the same as stage 1 at K = 1; and the micro-batches are averaged over ranks before they are added, an
    order of summation other than stage 0's (equal to rounding)."""

    stage = 2
    collective = "reduce_scatter"

    own_shards = False  # the weights' shards are views of the flats (stage 3: tensors of their own)

    def __init__(self, model: nn.Module, bucketed: list[list[nn.Parameter]], comm: Collectives,
                 precision: Precision, replicas: Replicas | None = None, deferred: bool = False):
        super().__init__(model, bucketed, comm, chunks=comm.size)
        self.precision, self.replicas = precision, replicas
        self.param_flats, self.weights = shard_weights(self.buckets, comm, precision, self.own_shards, deferred)
        # [Note: gradient shards] grads[b], this rank's accumulated gradient of bucket b: made by the first
        # reduce-scatter of a window to land, and dropped at the next forward once zero_grad() has let go of it
        # (as FSDP2's sharded gradients are), so no rank holds the 4 Psi / W of gradients from the step (or the
        # build) to the next backward's end; the buckets that hold no parameter keep an empty one
        self.grads: list[torch.Tensor | None] = [
            None if b.length else torch.zeros(0, dtype=precision.master, device=b.device) for b in self.buckets]
        self._start_sharded()
        self.shards = ShardedOptimizer(self.stage, self.buckets, self.names, comm, self.weights, self.grads,
                                       self._after_step, lazy_gradients=True)
        self.hooks.append(self.shards.hook)
        self.optimizer, self.clip_grad_norm_ = self.shards.optimizer, self.shards.clip_grad_norm_  # the part's
        for p in self.params:
            p.grad = None  # autograd allocates each gradient; the hook copies it out and frees it
        self.buffer_length = max(bucket.length for bucket in self.buckets)
        self.pool: list[torch.Tensor] = []  # free full-gradient buffers, each buffer_length long
        self.filling: dict[int, torch.Tensor] = {}  # bucket index -> the buffer its gradients are copied into
        self.in_flight: list[tuple[Bucket, torch.Tensor]] = []  # reduce-scatters launched, oldest first
        self.launched = 0  # buckets launched in this backward, in index order
        self.buffers_made = 0  # the most full buffers alive at once, over the run (the pool's high-water mark)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self.shards.before_forward()

    def _after_step(self, buckets: list[Bucket]) -> None:
        all_gather_weights(self, buckets)

    def _grad_ready(self, bucket: Bucket, param: nn.Parameter) -> None:
        self._copy_out(bucket, param)
        while self.launched < len(self.buckets) and self.buckets[self.launched].pending == 0:
            self._launch(self.buckets[self.launched])

    def _copy_out(self, bucket: Bucket, param: nn.Parameter) -> None:
        """Copy ``param``'s new gradient into its place in the bucket's buffer, and free it."""
        buffer = self.filling.get(bucket.index)
        if buffer is None:
            buffer = self.filling[bucket.index] = self._acquire()
            buffer[bucket.numel:bucket.length].zero_()  # the padding
        bucket.view(buffer, param).copy_(param.grad)
        param.grad = None  # the full gradient does not outlive this copy

    def _acquire(self) -> torch.Tensor:
        """A free buffer: from the pool, else the oldest bucket in flight lands and frees its own, else (every
        buffer is filling) a new one."""
        if not self.pool and self.in_flight:
            self._land_oldest()
        if not self.pool:
            self.buffers_made = max(self.buffers_made, len(self.filling) + len(self.in_flight) + 1)
            self.pool.append(torch.empty(self.buffer_length, dtype=self.precision.reduce,
                                         device=self.weights[0].device))
        return self.pool.pop()

    def _launch(self, bucket: Bucket) -> None:
        buffer = self.filling.pop(bucket.index)
        bucket.handle = self.comm.reduce_scatter(buffer[:bucket.length], bucket.name(self.collective))
        self.in_flight.append((bucket, buffer))
        self.launched += 1

    def _land_oldest(self) -> None:
        bucket, buffer = self.in_flight.pop(0)
        self._wait([bucket], f"{self.collective} wait")
        chunk = self.comm.chunk(buffer[:bucket.length])
        if self.grads[bucket.index] is None:  # the window's first ([Note: gradient shards])
            self.grads[bucket.index] = chunk.to(self.precision.master, copy=True)
            self.shards.attach_gradients(bucket)
        else:
            self.grads[bucket.index].add_(chunk)
        self._release(buffer)

    def _release(self, buffer: torch.Tensor) -> None:
        self.pool.append(buffer)  # for a later bucket

    def _backward_done(self) -> None:
        """Every bucket launched; on the window's last backward, wait for the reduce-scatters, add them in, and
        drop the full buffers (the other backwards leave theirs landing while the next forward runs). With
        replicas, the window's gradient shards are then averaged across them: one all-reduce per bucket per
        step, after the micro-batches are summed."""
        self.launched = 0
        if self.requires_sync:
            while self.in_flight:
                self._land_oldest()
            self.pool = []
            self._average_over_replicas(self.grads)

    def held_gradient_buffers(self) -> list[torch.Tensor]:
        return ([g for g in self.grads if g is not None] + self.pool + list(self.filling.values())
                + [buffer for _, buffer in self.in_flight])


class UnitState(enum.Enum):
    SHARDED = "sharded"  # the flat has no storage: only this rank's shard of the unit exists
    GATHERING = "gathering"  # the flat has its storage back and its all-gather is in flight
    GATHERED = "gathered"  # the unit's full parameters are in place


class FrozenPart(Bucket):
    """A stage-3 unit's frozen parameters of one dtype: a flat of their own, gathered and freed with the unit's
    trainable bucket, and this rank's shard of it, which no optimizer steps and no gradient reaches."""

    def __init__(self, index: int, params: list[nn.Parameter], chunks: int):
        super().__init__(index, params, chunks, "frozen")
        self.flat: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None


class Unit(Bucket):
    """A bucket of stage 3: one module's trainable parameters (the bucket's own, which may be none), and its frozen
    ones (``frozen``, a part per dtype), gathered whole only around its forward and its backward."""

    def __init__(self, index: int, params: list[nn.Parameter], chunks: int, word: str,
                 dtype: torch.dtype | None = None, device: torch.device | None = None):
        super().__init__(index, params, chunks, word, dtype, device)
        self.state = UnitState.SHARDED  # as made (shard_weights frees each flat once its shard is taken)
        self.module: nn.Module | None = None
        self.flat: torch.Tensor | None = None  # the unit's parameters, whole: storage only while not SHARDED
        self.frozen: list[FrozenPart] = []
        self.gather: list[Any] = []  # its all-gathers in flight (GATHERING)
        self.backward_begun = False  # in this backward
        self.inputs_pending = False  # [Note: frozen parameters] its inputs' gradient is still to come ...
        self.held_to_end = False  # ... or, where none comes, it is freed at the end of backward
        self.span: Any = None  # its open "unit I forward/backward" profiler range

    def flats(self) -> list[tuple[Bucket, torch.Tensor]]:
        """Each part that is gathered with the unit (the trainable bucket unless empty, the frozen parts) and its
        flat."""
        return ([(self, self.flat)] if self.length else []) + [(part, part.flat) for part in self.frozen]

    def full_bytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for _, flat in self.flats())


class InputsGradient(torch.autograd.Function):
    """The identity on a unit's inputs, whose backward runs once the gradient of every input is computed, that is
    once the unit's own backward is over (FSDP2's RegisterPostBackwardFunction does the same)."""

    @staticmethod
    def forward(ctx: Any, done: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.done()
        return (None, *grads)


class ZeroStage3(ZeroStage2):
    """Stage 3, the parameters sharded too. What it adds to stage 2: the buckets are units (a module each: the
    model's blocks, and the root for the parameters no block owns), and a unit's flat keeps its storage only
    while the unit is gathered. Freeing resizes the storage to 0 bytes, so the parameters stay views of it (their
    identity, autograd's saved references and the hooks intact) with no memory behind them; each rank keeps its
    shard in a tensor of its own, which the optimizer steps. A unit is SHARDED, GATHERING or GATHERED (UnitState;
    its flat has storage exactly when it is not SHARDED).

    [Note: stage 3's micro-batch]
    - forward: a hook before each unit's forward gathers it (or waits for its prefetch) and launches the
      all-gather of the next unit in the order the last forward started them; after the unit's forward it is
      freed (reshard after forward), so it computes while the next is gathered;
    - backward: a hook on the unit's output fires when its gradient is ready, just before the unit's backward:
      the unit is gathered again and the one before it prefetched, along the reverse of the order the forward
      finished units in (so the root, whose head ends the forward, comes first and prefetches the last block).
      As in stage 2 each gradient is copied into the unit's buffer as autograd makes it; when the unit's last one
      is in, the buffer is reduce-scattered into the gradient shard and the unit freed. Every rank runs the same
      graph, so the collectives come in the same order everywhere;
    - the root is used at both ends (stem first, head last), so like FSDP2's root it stays gathered from its
      forward to the end of its backward. Besides it at most ``max_gathered`` units are gathered (the one
      computing and the one prefetched; a prefetch that would make a third waits until a unit is freed);
    - the step's edges: the optimizer's step hook launches the root's and the first unit's all-gathers, so the
      next forward does not start by waiting; the first forward of all prefetches along module order.
    ``accumulate`` "unsharded" keeps instead each unit's full gradient over the window and reduce-scatters it on
    the last micro-batch only (FSDP2's set_requires_gradient_sync): 4 Psi more during the window, K-1 fewer
    reduce-scatters, and stage 0's summation order. Parameters are gathered in their own dtype: under autocast
    each op casts its weight as it would at stage 0. Evaluation runs the same hooks under no_grad (each unit
    freed after its forward), so every rank must run as many forwards.

    [Note: frozen parameters] Frozen parameters (requires_grad False: a fine-tuned model's base) are sharded too,
    as FSDP2 shards them: each unit keeps them in parts of their own (a part per dtype, FrozenPart), gathered and
    freed with the unit and never reduced, so a rank holds 1/W of them. Freeing after backward needs care: a unit's
    last trainable gradient can arrive before autograd has used its frozen weights (a frozen LayerNorm before a
    trainable adapter: the adapter's gradient is in, and the LayerNorm's backward, which reads its weight to pass
    the gradient on, is still to run). So a unit with frozen parts is freed once both its gradients are in and its
    inputs' gradient is computed (InputsGradient on its inputs reports it; FSDP2's RegisterPostBackwardFunction);
    where no input needs a gradient, or for the root, whose modules sit at both ends of the graph, at the end of
    backward. A recomputation inside backward (activation checkpointing) neither records nor frees a unit: it runs
    while the unit is gathered for its backward."""

    stage = 3
    word = "unit"
    bucket_class = Unit
    max_gathered = 2  # units whose full parameters may be in place at once, besides the root

    own_shards = True  # a tensor of its own: the full flat is freed between uses

    def __init__(self, model: nn.Module, units: list[nn.Module], owner: dict[int, nn.Module], comm: Collectives,
                 accumulate: str, precision: Precision, replicas: Replicas | None = None, deferred: bool = False):
        self.unsharded = accumulate == "unsharded"
        owned = [[p for p in unit.parameters() if owner[id(p)] is unit] for unit in units]
        super().__init__(model, [[p for p in params if p.requires_grad] for params in owned], comm, precision,
                         replicas, deferred)
        self.units: list[Unit] = self.buckets  # type: ignore[assignment]
        for unit, module, params in zip(self.units, units, owned):
            unit.module, unit.flat = module, self.param_flats[unit.index]
            unit.frozen = self._frozen_parts(unit.index, [p for p in params if not p.requires_grad], deferred)
        self.root = self.units[0] if units[0] is model else None
        self.wanted: Unit | None = None  # a prefetch held back by max_gathered, launched when a unit is freed
        # the units in the order the last forward started them, and in the reverse of the order it finished them
        self.order: list[Unit] = list(self.units)  # before the first forward: module order
        self.backward_order: list[Unit] = []
        self.recording: tuple[list[Unit], list[Unit]] = ([], [])
        self.peak = {"units": 0, "bytes": 0}  # most units gathered at once besides the root; most full bytes
        # hooks run in the order they were registered: the pass starts before the root's forward begins, and ends
        # after the root's forward has finished (so the recorded orders include it)
        self.hooks.append(model.register_forward_pre_hook(self._pass_starts))
        for unit in self.units:
            self.hooks += [unit.module.register_forward_pre_hook(partial(self._unit_forward_starts, unit)),
                           unit.module.register_forward_hook(partial(self._unit_forward_ends, unit))]
        self.hooks.append(model.register_forward_hook(self._pass_ends))

    def _frozen_parts(self, index: int, params: list[nn.Parameter], deferred: bool) -> list[FrozenPart]:
        """The unit's frozen parameters, a part per dtype ([Note: frozen parameters]), each moved into a flat of its
        own (freed at once) with this rank's shard kept; gathered in param_dtype where one is set (floating ones)."""
        parts = []
        for dtype in dict.fromkeys(p.dtype for p in params):  # each dtype, in the order met
            part = FrozenPart(index, [p for p in params if p.dtype == dtype], self.world_size)
            gathered = self.precision.param if self.precision.separate_masters and dtype.is_floating_point else dtype
            (part.flat,), (part.shard,) = shard_weights([part], self.comm, Precision(dtype, gathered, gathered),
                                                        own_shards=True, deferred=deferred)
            parts.append(part)
        return parts

    def shard_of(self, part: Bucket) -> torch.Tensor:
        """This rank's shard of a unit's trainable bucket (``weights``: the optimizer's) or of a frozen part."""
        return part.shard if isinstance(part, FrozenPart) else self.weights[part.index]

    # ------------------------------------------------------------------------------------------------------
    # A unit's life: SHARDED -> GATHERING -> GATHERED -> SHARDED
    # ------------------------------------------------------------------------------------------------------
    def _gather(self, unit: Unit) -> None:
        """Give the unit's flats their storage back, put this rank's shards in place (cast to param_dtype: the
        gather moves the low-precision bytes) and launch the all-gathers of the others' (asynchronously, like the
        reduce-scatters)."""
        assert unit.state is UnitState.SHARDED, unit.state
        self._allocate(unit)
        for part, flat in unit.flats():
            self.comm.chunk(flat).copy_(self.shard_of(part))
            unit.gather.append(self.comm.all_gather(flat, part.name("all_gather")))
        unit.state = UnitState.GATHERING
        held = self._held()
        self.peak["units"] = max(self.peak["units"], len([u for u in held if u is not self.root]))
        self.peak["bytes"] = max(self.peak["bytes"], sum(u.full_bytes() for u in held))

    def _allocate(self, unit: Unit) -> None:
        for _, flat in unit.flats():
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())

    def _held(self) -> list[Unit]:
        """The units whose flat has storage: gathered, or being gathered."""
        return [unit for unit in self.units if unit.state is not UnitState.SHARDED]

    def _materialize(self, unit: Unit) -> None:
        """The unit's full parameters in place: wait for its prefetch, or gather it now."""
        if unit.state is UnitState.GATHERED:
            return
        if unit.state is UnitState.SHARDED:
            self._gather(unit)
        with utils.profiled("all_gather wait"):
            for pending in unit.gather:
                pending.wait()
        unit.gather, unit.state = [], UnitState.GATHERED

    def _free(self, unit: Unit) -> None:
        """Drop the unit's full parameters (the views stay, on a storage of 0 bytes), and launch a prefetch that
        max_gathered held back."""
        assert unit.state is UnitState.GATHERED, unit.state
        for _, flat in unit.flats():
            flat.untyped_storage().resize_(0)
        unit.state = UnitState.SHARDED
        if self.wanted is not None:
            wanted, self.wanted = self.wanted, None
            self._prefetch(wanted)

    def _prefetch(self, unit: Unit | None) -> None:
        """Launch the unit's all-gather ahead of its use, unless max_gathered units are already held."""
        if unit is None or unit.state is not UnitState.SHARDED:
            return
        if unit is not self.root and len([u for u in self._held() if u is not self.root]) >= self.max_gathered:
            self.wanted = unit
            return
        self._gather(unit)

    @staticmethod
    def _after(order: list[Unit], unit: Unit) -> Unit | None:
        position = next((i for i, u in enumerate(order) if u is unit), -1)
        return order[position + 1] if 0 <= position < len(order) - 1 else None

    def _after_step(self, buckets: list[Bucket]) -> None:
        """The step's edge: the next forward's first units launched now (the optimizer updated the shards they
        are gathered from); nothing else, since the next forward gathers every unit. [Note: a profiler's window]
        Under a recording torch.profiler they land here, inside the step: the profiler.step() that closes a
        window comes next, and a gloo collective launched under a profiler and still in flight when that profiler
        stops kills the process with a segfault when it is waited for (PyTorch's: a bare all_gather_into_tensor
        launched, the profiler stopped, then waited crashed within 200 rounds in 2 tries of 2; the trainer's
        profiled stage-3 runs crashed 3 times in 17 before this). Only units among ``buckets`` (those every
        optimizer over them has stepped: [Note: several optimizers]) or that no optimizer steps, so no prefetch
        carries old weights."""
        if self.order:
            units = [unit for unit in (self.order[0], self._after(self.order, self.order[0]))
                     if unit in buckets or (unit is not None and not self.shards.stepped_by_any(unit))]
            for unit in units:
                self._prefetch(unit)
            if torch.autograd._profiler_enabled():
                for unit in units:
                    if unit is not None and unit.state is UnitState.GATHERING:
                        self._materialize(unit)

    # ------------------------------------------------------------------------------------------------------
    # Hooks: forward (module hooks), backward (a hook on each unit's output; the gradients' hooks)
    # ------------------------------------------------------------------------------------------------------
    def _open(self, unit: Unit, name: str) -> None:
        unit.span = utils.profiled(name)
        unit.span.__enter__()

    def _close(self, unit: Unit) -> None:
        if unit.span is not None:
            unit.span.__exit__(None, None, None)
            unit.span = None

    def _pass_starts(self, model: nn.Module, args: Any) -> None:
        self.recording = ([], [])
        if torch.is_grad_enabled():
            for unit in self.units:
                unit.backward_begun = False

    def _pass_ends(self, model: nn.Module, args: Any, output: Any) -> None:
        started, finished = self.recording
        self.order, self.backward_order = started, finished[::-1]

    def _unit_forward_starts(self, unit: Unit, module: nn.Module, args: Any) -> Any:
        recomputing = in_backward()  # activation checkpointing's recomputation, inside the unit's backward
        if not recomputing:
            self.recording[0].append(unit)
            self._open(unit, f"unit {unit.index} forward")
        self._materialize(unit)
        if not recomputing:
            self._prefetch(self._after(self.order, unit))
        if unit.frozen and torch.is_grad_enabled() and not recomputing:
            return self._watch_inputs(unit, args)
        return None

    def _unit_forward_ends(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward():  # a recomputation (without early stop): the unit's backward comes next, gathered
            return
        self.recording[1].append(unit)
        self._close(unit)
        if not torch.is_grad_enabled():
            self._free(unit)  # evaluation: no backward will come
            return
        for tensor in (output if isinstance(output, (tuple, list)) else [output]):
            if torch.is_tensor(tensor) and tensor.requires_grad:
                tensor.register_hook(partial(self._unit_backward_starts, unit))
        if unit is not self.root:  # the root (stem and head) is used at both ends of forward and backward: kept
            self._free(unit)

    def _watch_inputs(self, unit: Unit, args: Any) -> Any:
        """[Note: frozen parameters] A unit with frozen parameters is freed after its backward only once the
        gradient of its inputs is computed, which the identity InputsGradient on them reports; where no input
        needs one (or for the root, whose modules sit at both ends of the graph) at the end of backward."""
        leaves, spec = tree_flatten(args)
        watched = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf) and leaf.requires_grad]
        unit.held_to_end = unit is self.root or not watched
        unit.inputs_pending = not unit.held_to_end
        if not unit.inputs_pending:
            return None
        outputs = InputsGradient.apply(partial(self._unit_inputs_done, unit), *(leaves[i] for i in watched))
        for i, tensor in zip(watched, outputs):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    def _unit_inputs_done(self, unit: Unit) -> None:
        unit.inputs_pending = False
        self._free_if_done(unit)

    def _free_if_done(self, unit: Unit) -> None:
        """Free the unit after its backward: once its trainable gradients are all in, and its frozen parameters'
        use is over too ([Note: frozen parameters])."""
        if unit.pending == 0 and not unit.inputs_pending and not unit.held_to_end \
                and unit.state is UnitState.GATHERED:
            self._free(unit)
            self._close(unit)

    def _unit_backward_starts(self, unit: Unit, grad: torch.Tensor) -> None:
        """The gradient of the unit's output is ready: its backward is about to run."""
        if not unit.backward_begun:
            unit.backward_begun = True
            self._open(unit, f"unit {unit.index} backward")
            self._materialize(unit)
            self._prefetch(self._after(self.backward_order, unit))

    def _grad_ready(self, unit: Unit, param: nn.Parameter) -> None:  # type: ignore[override]
        self._copy_out(unit, param)
        if unit.pending == 0:  # the unit's gradients are all in: average them, free its parameters
            if self.requires_sync or not self.unsharded:
                self._launch(unit)
            self._free_if_done(unit)

    def _backward_done(self) -> None:
        """Stage 2's, then the units held to the end of backward freed ([Note: frozen parameters])."""
        super()._backward_done()
        for unit in self.units:
            if (unit.held_to_end or unit.inputs_pending) and unit.state is UnitState.GATHERED:
                self._free(unit)
                self._close(unit)
            unit.held_to_end = unit.inputs_pending = False

    def _copy_out(self, unit: Unit, param: nn.Parameter) -> None:  # type: ignore[override]
        """Sharded accumulation: stage 2's. Unsharded: add the gradient into the unit's own full buffer, kept
        over the window (0 + g is g exactly, so the sums are stage 0's: each rank's micro-batches in turn)."""
        if not self.unsharded:
            return super()._copy_out(unit, param)
        buffer = self.filling.get(unit.index)
        if buffer is None:  # in reduce_dtype, as FSDP2 accumulates its unsharded gradients
            buffer = self.filling[unit.index] = torch.zeros(unit.length, dtype=self.precision.reduce,
                                                            device=self.weights[0].device)
        unit.view(buffer, param).add_(param.grad)
        param.grad = None

    def _release(self, buffer: torch.Tensor) -> None:
        if not self.unsharded:  # unsharded buffers are each unit's own length, not the pool's
            super()._release(buffer)

    def gathered_peak(self) -> dict[str, int]:
        return dict(self.peak)

    # ------------------------------------------------------------------------------------------------------
    # The whole model: state dicts, and the model handed back
    # ------------------------------------------------------------------------------------------------------
    def parts(self) -> list[Bucket]:
        """Every unit's trainable bucket and frozen parts, in unit order: what this rank holds a shard of
        (``shard_of``)."""
        return [part for unit in self.units for part in [unit, *unit.frozen] if part.length]

    def frozen_shards(self) -> list[torch.Tensor]:
        return [part.shard for unit in self.units for part in unit.frozen]

    def model_state_dict(self) -> dict[str, Any]:
        """The whole state_dict on rank 0's CPU, gathered from the shards one part at a time ({} on the other
        ranks), so in the masters' dtype (the model's own) whatever param_dtype is."""
        wholes = ((part, gather_full(self.comm, part, self.shard_of(part))) for part in self.parts())
        return gathered_state_dict(self.model, wholes, self.rank)

    def drop_gathered(self) -> None:
        """Every unit gathered or gathering freed (its gather waited for), and no prefetch held back: call it after
        writing the shards (``weights``) other than through the optimizer, since a prefetch launched at the step's
        edge would bring back the old weights. Every rank of the group calls it (the gathers in flight are
        collectives)."""
        self.wanted = None
        for unit in self._held():
            self._materialize(unit)
            self._free(unit)

    def held_pieces(self) -> dict[str, list[Any]]:
        """ShardedStage's, of every part this rank holds a shard of: the units' trainable buckets and their frozen
        parts."""
        from zero.checkpoint import flat_pieces
        parts = self.parts()
        return flat_pieces(self.model, parts, [self.shard_of(part) for part in parts], self.rank)

    def shards_loaded(self) -> None:
        """After the master shards were written other than by a step: no unit gathered before stays (their next
        gathers read the new shards)."""
        self.drop_gathered()

    def _load_whole(self, state: dict[str, Any] | None, from_rank0: bool) -> None:
        """A whole state_dict into the shards, part by part through a full flat of the shard's dtype: on every
        rank, which keeps its chunk (no collective), or on rank 0 only, which scatters the chunks (no other rank
        ever holds more than its chunk of it). Buffers as they are (broadcast from rank 0)."""
        if from_rank0:
            check_keys_on_rank0(self.model, state, self.comm.group)
        else:
            expected = self.model.state_dict().keys()
            if set(state) != set(expected):
                raise RuntimeError(f"Error(s) in loading state_dict: missing keys "
                                   f"{sorted(set(expected) - set(state))}, unexpected keys "
                                   f"{sorted(set(state) - set(expected))}")
        self.drop_gathered()
        parts = self.parts()
        (scatter_masters if from_rank0 else load_masters)(parts, self.comm, [self.shard_of(part) for part in parts],
                                                          self.names, state)
        with torch.no_grad():
            if not from_rank0 or self.rank == 0:
                for name, buffer in self.model.named_buffers():
                    buffer.copy_(state[name])
        if from_rank0:
            broadcast_state(self.model, buffers_only=True, group=self.comm.group)

    def close(self) -> None:
        """Gather every unit for good (under a lower param_dtype: the masters, ShardedStage's), then remove the hooks:
        the model is whole and ordinary again, in its own dtype."""
        for unit in self.units:
            self._materialize(unit)
            for part in unit.frozen:  # in their own dtype, from the shards
                full = gather_full(self.comm, part, part.shard)
                for p in part.params:
                    p.data = part.view(full, p)
        super().close()


def default_units(model: nn.Module) -> list[nn.Module]:
    """Stage 3's units when none are given: every module directly inside an nn.ModuleList of the model (the
    transformer's convention for its blocks)."""
    return [child for module in model.modules() if isinstance(module, nn.ModuleList) for child in module]


def shard(model: nn.Module, stage: int, units: list[nn.Module] | None = None,
          group: dist.ProcessGroup | None = None, collectives: str = "torch",
          replicate_group: dist.ProcessGroup | None = None, param_dtype: torch.dtype | None = None,
          reduce_dtype: torch.dtype | None = None, init: Callable[[nn.Module], None] | None = None, *,
          device: torch.device | str | None = None, init_device: torch.device | str | None = None,
          bucket_mb: float = 25.0, overlap: bool = True, accumulate: str = "sharded",
          timeout_s: float | None = None) -> Any:
    """Data parallelism at ZeRO ``stage`` over ``group`` (default: the world) for ``model``, in place: the group's
    rank 0's weights and buffers are broadcast first (as DistributedDataParallel does), then the model's
    parameters become views of flat buckets (stages 1-3), and hooks do the rest (module docstring).

    ``init`` (a model built on the meta device): ``init(module)`` initializes one module's own parameters and
    buffers, and the model is materialized module by module (zero/init.py): at stage 3 no rank holds it whole,
    and the weights are bit for bit ``model.to_empty(device=init_device); for m in model.modules(): init(m)`` on
    one process, at any world size. ``device``: where the model then lives (default: this process's GPU under
    NCCL, else the CPU); ``init_device``: where ``init`` runs (default: ``device``).

    ``replicate_group`` (stages 1-3): hybrid sharding, the state sharded over ``group`` and replicated over the
    ranks holding the same shard (zero/hybrid.py); the two must tile the world as a grid. ``param_dtype`` (stages
    1-3): the dtype the weights are kept, gathered and computed in, over masters and optimizer state in the
    model's own dtype; ``reduce_dtype`` (default: ``param_dtype``): the dtype gradients are reduced in
    (zero/precision.py).

    ``units`` (stage 3): the modules gathered one at a time (default: default_units); the root owns the
    parameters no unit does. ``collectives``: "torch" (torch.distributed's), "ring" (allreduce.py's, on a thread
    of its own), or at stage 0 "butterfly". ``bucket_mb`` (stages 0-2): the largest bucket; ``overlap`` (stages
    0, 1): average each bucket as backward completes it, rather than after backward; ``accumulate`` (stage 3):
    "sharded" (reduce-scatter every micro-batch) or "unsharded" (keep full gradients over the window)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero.shard: stage is 0, 1, 2 or 3, not {stage!r}")
    kinds = ("torch", "ring", "butterfly") if stage == 0 else ("torch", "ring")
    if collectives not in kinds:
        raise ValueError(f"zero.shard: stage {stage} runs on {' or '.join(kinds)} collectives, not {collectives!r}"
                         + (" (the butterfly has no reduce-scatter and all-gather)" if stage else ""))
    if stage >= 2 and not overlap:
        raise ValueError(f"zero.shard: stage {stage} reduce-scatters gradients as backward produces them "
                         f"(overlap=False would keep every full gradient: that is stage 1)")
    if accumulate not in ("sharded", "unsharded") or (accumulate == "unsharded" and stage != 3):
        raise ValueError(f"zero.shard: accumulate is 'sharded', or 'unsharded' at stage 3; not {accumulate!r} at "
                         f"stage {stage}")
    if units is not None and stage != 3:
        raise ValueError(f"zero.shard: units are stage 3's; stage {stage} shards flat buckets")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("zero.shard: the model has no trainable parameter")
    if stage == 0 and replicate_group is not None:
        raise ValueError("zero.shard: replicate_group is for stages 1-3 (state sharded over group, replicated "
                         "across it); at stage 0 every rank holds everything: pass the whole world as group")
    deferred = init_module.on_meta(model)
    if deferred and init is None:
        raise ValueError("zero.shard: the model is on the meta device; pass init=fn, fn(module) initializing that "
                         "module's own parameters and buffers (its reset_parameters, say), to materialize it shard "
                         "by shard")
    if init is not None and not deferred:
        raise ValueError(f"zero.shard: init= is for a model built on the meta device (with torch.device('meta'): "
                         f"...); this one is on {trainable[0].device} already")
    precision = resolve(model, stage, param_dtype, reduce_dtype)
    if stage == 3:  # refused before any collective, if they do not fit
        given = default_units(model) if units is None else list(units)
        units, owner = stage_3_units(model, given)
    if replicate_group is not None:
        check_grid(group, replicate_group)  # before any broadcast: on every rank, the same verdict
    if deferred:  # materialized (stages 0-2) or given placeholders (stage 3), the same on every rank: no broadcast
        device = torch.device(device) if device is not None else init_module.default_device(group)
        init_device = torch.device(init_device) if init_device is not None else device
        init_module.check_same_generator(group, init_device)
        if stage < 3:
            init_module.initialize_whole(model, init, device, init_device)
        else:
            init_module.replace_parameters(model, lambda p: init_module.placeholder(p, device))
            init_module.materialize_buffers(model, init_device)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if stage == 3:  # the owners again, of the new parameters
            units, owner = stage_3_units(model, given)
    else:
        broadcast_state(model, group=group)
    comm = Collectives(group, collectives, timeout_s)
    if stage == 0:
        return GradientSync(model, bucket_mb, overlap, comm)
    replicas = None
    if replicate_group is not None:
        replicas = Replicas(replicate_group, collectives, timeout_s, precision.reduce)
        if not deferred:
            replicas.broadcast(model)  # then every rank of the grid holds replica 0's rank 0's weights
    if stage == 1:
        return ZeroStage1(model, bucket_mb, overlap, comm, precision, replicas)
    if stage == 2:
        return ZeroStage2(model, assign_buckets(trainable, bucket_mb), comm, precision, replicas)
    sharded = ZeroStage3(model, units, owner, comm, accumulate, precision, replicas, deferred)
    if deferred:
        init_module.initialize_shards(sharded, init, init_device)
        init_module.move_buffers(model, device)
    return sharded


def stage_3_units(model: nn.Module, units: list[nn.Module]) -> tuple[list[nn.Module], dict[int, nn.Module]]:
    """The root (if it owns a trainable parameter no unit does) and the units, and each parameter's owner: a unit
    claims its parameters from the root, an inner unit from an outer one. A unit that is not in the model, or
    owns nothing, is refused in one line."""
    names = {id(m): name for name, m in model.named_modules()}
    owner: dict[int, nn.Module] = {}
    for module in [model, *units]:
        if id(module) not in names:
            raise ValueError(f"zero.shard: a unit ({type(module).__name__}) is not a submodule of the model")
        owner.update((id(p), module) for p in module.parameters())
    for unit in units:
        if not any(owner[id(p)] is unit for p in unit.parameters()):
            raise ValueError(f"zero.shard: unit {names[id(unit)]!r} ({type(unit).__name__}) owns no parameter "
                             f"(none, or all claimed by units inside it)")
    root_owns = any(owner[id(p)] is model for p in model.parameters())
    return ([model] if root_owns else []) + list(units), owner


def state_bytes(model: nn.Module, optimizer: Any, sync: Any) -> dict[str, int]:
    """Bytes this rank holds for the weights, the gradients and the optimizer state: the storages behind the
    model's parameters and the optimizer's (one or several: zero.optimizer.as_optimizers), behind every .grad they
    have and the sync's gradient buffers, and behind the optimizer's state tensors (ZeroRedundancyOptimizer: its
    local optimizer's), each storage counted once. Taken just before a step: the gradients averaged, stage 3's
    units all freed (the step's prefetch of the next forward's first units is not yet launched)."""
    def held(tensors: Iterable[torch.Tensor | None]) -> int:
        storages = {}
        for t in tensors:
            t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor: this rank's shard
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    optimizers = as_optimizers(optimizer)
    optimized = [p for o in optimizers for group in o.param_groups for p in group["params"]]
    states = [getattr(o, "optim", o).state for o in optimizers]
    grads = [p.grad for p in list(model.parameters()) + optimized] + sync.held_gradient_buffers()
    frozen = sync.frozen_shards() if hasattr(sync, "frozen_shards") else []  # stage 3's, beside the model's views
    return {"params": held(list(model.parameters()) + optimized + frozen), "grads": held(grads),
            "optimizer": held(v for state in states for values in state.values() for v in values.values()
                              if torch.is_tensor(v))}
