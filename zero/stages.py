"""ZeRO stages 1 and 2 (zero.shard(model, 1 | 2)): the optimizer's state sharded (1), and the gradients too (2), over
the W ranks of a process group, on the flat buckets of stage 0 (zero/stage0.py), padded to W equal chunks.

Each stage class says what it adds to the one before it, and in its own body what runs after a backward and after
a step; ShardedStage holds what stages 1-3 share (the precision, the replicas, the state dicts and close() in the
masters' dtype, and what a stage tells its checkpoint: ``held_pieces``, ``optimizer_view``). The optimizer side is
zero/optimizer.py's ShardedOptimizer, a part each stage holds (``shards``); stage 3 is zero/stage3.py.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from collectives import Collectives
from zero.buckets import Bucket
from zero.hybrid import Replicas
from zero.offload.gradients import Gradients
from zero.offload.shards import meta_like
from zero.offload.store import Store
from zero.optimizer import ShardedOptimizer
from zero.pieces import OptimizerView, Piece, flat_pieces
from zero.precision import (Precision, cast_forward_inputs, gather_full, load_masters, master_state_dict,
                            scatter_masters, shard_weights)
from zero.stage0 import BucketedSync, GradientSync


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

    # ------------------------------------------------------------------------------------------------------
    # What the stage tells its checkpoint (zero/checkpoint/: WholeCheckpoints' methods, for shards)
    # ------------------------------------------------------------------------------------------------------
    holds_shards = True

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The shard group; under hybrid sharding the world (the grid of replicas x shards zero.shard requires)."""
        return None if self.replicas is not None else self.comm.group

    def held_pieces(self) -> dict[str, list[Piece]]:
        """What this rank holds of the parameters kept in flat buckets: under each name of each such parameter, its
        pieces in this rank's chunks (zero/pieces.py's Piece: the elements [start, end) of its memory order, a 1-D
        view of them in the masters), none where the rank holds none. Everything else in the model's state_dict
        (buffers, frozen parameters at stages 1-2) is whole on every rank."""
        return flat_pieces(self.model, self.buckets, self.weights, self.rank)

    def optimizer_view(self, optimizer: torch.optim.Optimizer) -> OptimizerView:
        """The optimizer's runs of this rank's shards (zero/optimizer.py)."""
        return self.shards.view(optimizer)

    def load_run_state(self, optimizer: torch.optim.Optimizer, inner: dict[str, Any]) -> None:
        """The optimizer's state in its runs' own form (ShardedOptimizer.load_run_state)."""
        self.shards.load_run_state(optimizer, inner)

    def shards_saving(self) -> None:
        """Before a save reads this rank's state: the gradient shards zero_grad() let go of dropped now, not at the
        next forward ([Note: gradient shards]), so the save does not hold them (4 Psi / W bytes) beside its own; with
        offload, a step still pending taken first (zero/offload/shards.py)."""
        self.shards.settle()
        self.shards.drop_released_gradients()

    def shards_loaded(self) -> None:
        """After this rank's master shards were written other than by a step (a checkpoint's load): stages 1-2
        gather them into every rank's whole weights, as after a step. Every rank of the group calls it."""
        all_gather_weights(self, self.buckets)

    def sent_bytes(self) -> int:
        """Bytes this rank has sent: in its shard group, and across replicas (sent_bytes_by_group)."""
        return sum(self.sent_bytes_by_group().values())

    def sent_bytes_by_group(self) -> dict[str, int]:
        """{"shard_group": bytes sent inside the shard group, "replicas": bytes sent across replicas}."""
        return {"shard_group": self.comm.sent_bytes(),
                "replicas": self.replicas.sent_bytes() if self.replicas is not None else 0}

    @contextlib.contextmanager
    def shard_values(self, bucket: Bucket) -> Iterator[torch.Tensor]:
        """This rank's master shard of ``bucket``, to read (stage 3 with offload: read from the store)."""
        yield self.weights[bucket.index]

    def _hand_back_masters(self) -> None:
        """Under a lower param_dtype, before close(): every parameter made a view of its bucket's whole master
        flat (gathered), so the model handed back is in its own dtype; the low-precision .grad views dropped."""
        if self.precision.separate_masters:
            for bucket in self.buckets:
                with self.shard_values(bucket) as shard:
                    full = gather_full(self.comm, bucket, shard)
                for p in bucket.params:
                    p.grad = None
                    p.data = bucket.view(full, p)

    def close(self, whole: bool = True) -> None:
        """Every hook removed and the model handed back whole (stage 3's ``whole=False``: not gathered); with
        offload, the offload file removed."""
        self.shards.settle()
        self.shards.finish_steps()
        if whole:
            self._hand_back_masters()
        super().close()
        if self.replicas is not None:
            self.replicas.close()
        if self.store is not None:
            self.store.close()


class ZeroStage1(ShardedStage, GradientSync):
    """Stage 1, the optimizer's state sharded. What it adds to stage 0 (zero.stage0.GradientSync): the buckets are
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
                 precision: Precision, replicas: Replicas | None = None, store: Store | None = None):
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
        self.store = store  # offload: the optimizer's state in the store (zero/offload/)
        self.shards = ShardedOptimizer(self.stage, self.buckets, self.names, comm, self.weights, self.grads,
                                       self._after_step, device=self.params[0].device, store=store)
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
                 precision: Precision, replicas: Replicas | None = None, deferred: bool = False,
                 store: Store | None = None):
        super().__init__(model, bucketed, comm, chunks=comm.size)
        self.precision, self.replicas = precision, replicas
        self.device = self.params[0].device
        # offload (zero/offload/): the optimizer's state in the store; at stage 3 (own shards) the weights' and
        # the gradients' shards too, each weight shard written there as it is made
        self.store = store
        self.gradients = Gradients(store) if store is not None and self.own_shards else None
        keep = partial(self._keep_shard, deferred) if self.gradients is not None else None
        self.param_flats, self.weights = shard_weights(self.buckets, comm, precision, self.own_shards, deferred, keep)
        # [Note: gradient shards] grads[b], this rank's accumulated gradient of bucket b: made by the first
        # reduce-scatter of a window to land, and dropped at the next forward once zero_grad() has let go of it
        # (as FSDP2's sharded gradients are), so no rank holds the 4 Psi / W of gradients from the step (or the
        # build) to the next backward's end (nor through a save: shards_saving); the buckets that hold no parameter
        # keep an empty one
        self.grads: list[torch.Tensor | None] = [
            None if b.length else torch.zeros(0, dtype=precision.master, device=b.device) for b in self.buckets]
        for b in self.buckets if self.gradients is not None else []:  # their slots reserved now, as the weights'
            if b.length:
                store.create(("grads", b.index), b.length // comm.size, precision.master)
        self._start_sharded()
        self.shards = ShardedOptimizer(self.stage, self.buckets, self.names, comm, self.weights, self.grads,
                                       self._after_step, lazy_gradients=True, device=self.device, store=store,
                                       gradients=self.gradients)
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

    def _keep_shard(self, deferred: bool, bucket: Bucket, shard: torch.Tensor) -> torch.Tensor:
        """Offload at stage 3: a weight shard just made, into the store (a deferred model's zeros are not written:
        its initialization writes every shard), and its placeholder for the stage's list."""
        if not shard.numel():  # a unit of frozen parameters only: nothing to keep
            return shard
        name = ("weights", bucket.index)
        self.store.create(name, shard.numel(), shard.dtype)
        if not deferred:
            kept = self.store.fresh(name)
            kept.copy_(shard)
            self.store.put(name, kept)
        return meta_like(shard.numel(), shard.dtype)

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
            self.pool.append(torch.empty(self.buffer_length, dtype=self.precision.reduce, device=self.device))
        return self.pool.pop()

    def _launch(self, bucket: Bucket) -> None:
        buffer = self.filling.pop(bucket.index)
        bucket.final = self.requires_sync  # the window's last micro-batch: what lands completes the gradient
        bucket.handle = self.comm.reduce_scatter(buffer[:bucket.length], bucket.name(self.collective))
        self.in_flight.append((bucket, buffer))
        self.launched += 1

    def _land_oldest(self) -> None:
        bucket, buffer = self.in_flight.pop(0)
        self._wait([bucket], f"{self.collective} wait")
        chunk = self.comm.chunk(buffer[:bucket.length])
        if self.gradients is not None:  # offload: into the shard in the store, its norm taken once complete
            first = self.grads[bucket.index] is None
            self.gradients.add(bucket.index, chunk, first, bucket.final, self.precision.master)
            self.grads[bucket.index] = meta_like(chunk.numel(), self.precision.master)
        elif self.grads[bucket.index] is None:  # the window's first ([Note: gradient shards])
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
        return ([g for g in self.grads if g is not None and not g.is_meta] + self.pool + list(self.filling.values())
                + [buffer for _, buffer in self.in_flight])
