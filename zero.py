"""ZeRO stages 1 to 3: data parallelism that shards the optimizer's state over the W ranks (stage 1), the gradients
too (stage 2), on flat buckets, and the parameters too (stage 3), on flat units gathered one or two at a time;
behind the interface of gradsync.py, so the trainer's loop is the same. FSDPSync puts PyTorch's FSDP2 behind it.

    sync = make_sync(stage, model, bucket_mb, overlap, allreduce, blocks=models.blocks(model))  # 0: GradientSync
    optimizer = torch.optim.AdamW(sync.parameters(), ...)           # ZeRO: this rank's shards only
    for each micro-batch: sync.prepare(sync=last_of_window); loss.backward()
    sync.finish(); optimizer.step(); sync.gather_params(); sync.zero_grad()

What a rank holds, for Psi parameters in fp32 trained with AdamW (two state tensors per parameter), in bytes:

    stage   weights   gradients       optimizer state   total
    0       4 Psi     4 Psi           8 Psi             16 Psi          (gradsync.GradientSync, DDP)
    1       4 Psi     4 Psi           8 Psi / W         8 Psi + 8 Psi / W
    2       4 Psi     4 Psi / W (+)   8 Psi / W         4 Psi + 12 Psi / W
    3       4 Psi / W 4 Psi / W (+)   8 Psi / W         16 Psi / W      (+ during a step: the root and two units)
    (+ the gradient buckets in flight during backward)

The layout. Parameters are grouped into buckets exactly as GradientSync groups gradients (reverse order, the first
bucket at most 1 MB, the others at most --bucket-mb), and each bucket becomes ONE flat tensor, zero-padded to a
multiple of W; the model's parameters become views into it (gradsync.gradient_view: a channels-last weight keeps
its strides, and its gradient is laid out the same way, so element j of the flat parameter and element j of the
flat gradient always belong together). Rank r owns shard r of every bucket: the r-th of W equal slices. The
optimizer is built over the shards (one nn.Parameter per bucket sharing the flat's storage), so it updates this
rank's slice of the weights in place and keeps state for that slice alone. That is exact for any elementwise
optimizer (SGD with momentum and weight decay, Adam, AdamW: each element's update reads only that element's
weight, gradient and state), and wrong for one that takes a norm over a whole tensor (LAMB, LARS): those would see
a slice. Padding stays zero: its gradient is zero, and so is every elementwise update of a zero weight with a zero
gradient.

Stage 1 (ZeroStage1), one optimizer step of K micro-batches:
- micro-batches 1 .. K-1: backward accumulates into the full flat gradient buckets, as GradientSync; nothing is
  sent;
- micro-batch K: as soon as backward has completed a bucket (a post-accumulate-grad hook counts its parameters
  down), it is divided by W and reduce-scattered (SUM): shard r of the bucket then holds the average over ranks of
  shard r, which is the gradient of this rank's shard param. Buckets launch in index order on every rank, while
  the rest of backward runs;
- the optimizer steps the shards; then each parameter bucket is all-gathered: every rank's updated shard r into
  every rank's flat, so the model is whole and identical everywhere for the next forward.
Per rank and step that sends (W-1)/W Psi elements in the reduce-scatter and (W-1)/W Psi in the all-gather: the
2 (W-1)/W Psi of one all-reduce, which is itself a reduce-scatter and an all-gather (allreduce.py's ring).

Stage 2 (ZeroStage2) keeps no full gradient beyond its bucket: on EVERY micro-batch each parameter's gradient is
copied into its bucket's buffer the moment autograd produces it, and the parameter's .grad is freed; a complete
bucket is averaged by reduce-scatter, its shard added to this rank's shard accumulator (the shard param's .grad,
Psi/W elements in all), and the buffer reused for a later bucket. Full buffers exist only while a bucket fills or
is in flight (a pool, grown only when every buffer is busy, released at the end of each window). The price is K
reduce-scatters per optimizer step instead of one: (K + 1)(W - 1)/W Psi elements sent per rank and step, the same
as stage 1 at K = 1. Measure both: training_benchmark.py --zero.

Collectives: ``allreduce`` "torch" uses torch.distributed's reduce_scatter_tensor and all_gather_into_tensor in
place (the output is this rank's chunk of the input, NCCL's in-place convention, which gloo follows too); "ring"
uses allreduce.py's ring_reduce_scatter and ring_all_gather, point-to-point messages run on an AllreduceThread (a
thread and a process group of their own, so they overlap backward and never interleave with SyncBatchNorm's
collectives on the default group). ``sent_bytes()`` counts what this rank sends: the ring's own isend payloads, or
for torch's collectives what an ideal ring sends, (W-1)/W of the buffer per call (gloo's reduce_scatter_tensor
actually all-reduces, twice that).

Stage 3 (ZeroStage3) keeps no whole parameter between steps. The model is cut into units: its blocks (models.blocks:
a ResNet's Bottleneck or BasicBlock, a ViT's EncoderBlock) and the root, which owns what no block does (a ResNet's
stem and classifier, a ViT's patch embedding, class token, position embedding and head). Each unit's parameters
are one flat tensor padded to a multiple of W, as a bucket above, but the flat keeps its storage only while the
unit is gathered: freeing it resizes the storage to 0 bytes, so the parameters stay views of it (their identity,
shapes and autograd's saved references intact) with no memory behind them. Rank r keeps shard r in a tensor of
its own, which the optimizer steps. One micro-batch:
- forward: a hook before each unit's forward puts its flat back (storage, own shard copied in, all-gather of the
  others' launched, or the prefetch launched earlier waited for) and then launches the all-gather of the next unit
  in the order the previous forward ran them (recorded by the same hooks: the first forward has no prefetch);
  after the unit's forward its flat is freed (reshard after forward), so it computes while the next is gathered;
- backward: a hook on the unit's output fires when its gradient is ready, just before the unit's backward: the
  unit is gathered again (the prefetch launched by the unit after it) and the unit before it in forward order is
  prefetched. As in stage 2 each parameter's gradient is copied into the unit's buffer and freed as autograd
  makes it; when the unit's last one is in, the buffer is averaged by reduce-scatter into the shard accumulator
  and the unit's flat freed. Every rank runs the same graph, so the collectives come in the same order everywhere;
- the root is used at both ends (stem first, head last, and the reverse in backward), so like FSDP2's root it stays
  gathered from its forward to the end of its backward, and frees with its last gradient. Besides it at most two
  units are ever gathered (max_gathered: the one computing and the one prefetched; a prefetch that would make a
  third waits until a unit is freed), so during a step a rank holds 16 Psi/W plus the root, two units' parameters
  and the gradient buffers in flight.
Sent per rank and micro-batch: (W-1)/W of every unit twice in all-gathers (the root once) and once in the
reduce-scatter, about 3 (W-1)/W Psi elements: 1.5 times a replicated step's all-reduce, and K times per optimizer
step, since every micro-batch needs the parameters anyway. Nothing is gathered after the step. ``accumulate``
"unsharded" (the trainer's --zero3-accumulate) is the alternative FSDP2's set_requires_gradient_sync takes: each
unit's full gradient is kept over the window (added into as each micro-batch's backward produces it) and
reduce-scattered on the last micro-batch only, which holds 4 Psi more during the window (stage 1's gradients) to
save K-1 reduce-scatters, and sums each rank's micro-batches in stage 0's order: at 2 processes the weights are
stage 0's bit for bit; at more, the ranks' sum associates as the collective chunks each unit, not as it chunks
stage 0's buckets. The parameters are gathered in their own dtype: under autocast
each op casts its weight as it would at stage 0, so the numerics are stage 0's; gathering a bf16 copy instead (as
FSDP2's MixedPrecisionPolicy can) would halve the all-gathers and the gathered units but round the weights before
the optimizer sees their gradients, and reduce the gradients in bf16. Evaluation runs the same hooks under
no_grad (each unit freed after its forward, the root too), and every rank must run as many forwards.

Checkpoints. ``optimizer_state`` gathers the sharded state to rank 0's CPU one bucket at a time (never the whole
state on one GPU) and returns it as torch.optim's ordinary state_dict over the model's trainable parameters in
their order: what a replicated optimizer has. ``load_optimizer_state`` cuts this rank's shards out of such a dict.
So a checkpoint of any stage loads into any stage at any world size. ``model_state`` is the whole state_dict (stage 3
gathers it to rank 0 one unit at a time) and ``load_model_state`` loads one (stage 3 cuts each unit's shard out).
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import utils
from allreduce import ring_all_gather, ring_reduce_scatter
from gradsync import DDPSync, GradientSync, gradient_view, size_text


class ZeroStage1(GradientSync):
    """Optimizer state sharded: full gradient buckets, reduce-scattered on the window's last micro-batch; the
    optimizer steps this rank's shards, and ``gather_params`` all-gathers the updated shards (module docstring)."""

    collective = "reduce_scatter"

    def __init__(self, model: nn.Module, bucket_mb: float, overlap: bool, allreduce: str = "torch",
                 timeout_s: float | None = None):
        if allreduce not in ("torch", "ring"):
            raise ValueError(f"ZeRO runs on torch's or the ring's reduce-scatter and all-gather, not {allreduce!r}")
        self.rank = dist.get_rank()
        super().__init__(model, bucket_mb, overlap, allreduce, timeout_s)
        self.param_flats = [self._parameter_buffer(index) for index in range(len(self.buckets))]
        self.shards = [nn.Parameter(self.shard_of(flat)) for flat in self.param_flats]
        for index, shard in enumerate(self.shards):
            shard.grad = self._shard_gradient(index)
        self.gather_names = [f"all_gather {self.group_word} {index} "
                             f"({size_text(flat.numel() * flat.element_size())})"
                             for index, flat in enumerate(self.param_flats)]

    def flat_length(self, bucket: list[nn.Parameter]) -> int:
        numel = sum(p.numel() for p in bucket)
        return -(-numel // self.world_size) * self.world_size  # padded: W equal shards

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a padded flat bucket (a view)."""
        width = flat.numel() // self.world_size
        return flat[self.rank * width:(self.rank + 1) * width]

    def _parameter_buffer(self, index: int) -> torch.Tensor:
        """The bucket's parameters moved into one padded flat tensor; each parameter becomes a view into it, laid
        out as its gradient is (gradient_view), so the flat weight and the flat gradient match element by element."""
        bucket = self.buckets[index]
        flat = torch.zeros(self.lengths[index], dtype=bucket[0].dtype, device=bucket[0].device)
        with torch.no_grad():
            for p, start in zip(bucket, self.offsets[index]):
                view = gradient_view(flat[start:start + p.numel()], p)
                view.copy_(p)
                p.data = view
        return flat

    def _shard_gradient(self, index: int) -> torch.Tensor:
        """The shard param's .grad: this rank's slice of the full gradient bucket (the reduce-scatter's output)."""
        return self.shard_of(self.flats[index])

    def _reduce_scatter(self, flat: torch.Tensor) -> Any:
        """Average ``flat`` over ranks into this rank's shard of it, asynchronously (divide first, then SUM)."""
        flat.div_(self.world_size)
        if self.averager is not None:
            return self.averager.submit(flat, operation=ring_reduce_scatter)
        self.nominal_sent += self._one_way_bytes(flat)
        return dist.reduce_scatter_tensor(self.shard_of(flat), flat, async_op=True)

    def _one_way_bytes(self, flat: torch.Tensor) -> int:
        """What a ring sends per rank in one reduce-scatter or all-gather of ``flat``: W-1 of its W shards."""
        return self.shard_of(flat).numel() * (self.world_size - 1) * flat.element_size()

    def _start(self, index: int) -> Any:
        return self._reduce_scatter(self.flats[index])

    def parameters(self) -> list[nn.Parameter]:
        return self.shards

    def gather_params(self) -> None:
        """After the optimizer step: every rank's updated shards into every rank's parameters (all-gather in
        place, every bucket launched before any is waited for)."""
        handles = [self._all_gather(index) for index in range(len(self.param_flats))]
        with utils.profiled("all_gather wait"):
            self._wait(handles)

    def _all_gather(self, index: int) -> Any:
        """Launch the all-gather of parameter flat ``index`` in place (every rank's shard r into slice r of every
        rank's flat), under its profiler range until it lands; returns what _wait takes."""
        flat = self.param_flats[index]
        with utils.profiled(self.gather_names[index]) as span, torch.no_grad():  # gloo's in-place copies
            if self.averager is not None:
                handle = self.averager.submit(flat, operation=ring_all_gather)
            else:
                self.nominal_sent += self._one_way_bytes(flat)
                handle = dist.all_gather_into_tensor(flat, self.shard_of(flat), async_op=True)
            if span is not None:
                span._call_end_callbacks_on_future(self._landed(handle))
        return handle

    # ------------------------------------------------------------------------------------------------------
    # Checkpoints: the sharded state as an ordinary state_dict over the model's parameters, and back
    # ------------------------------------------------------------------------------------------------------
    def _index_of(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(self.params)}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """torch.optim's state_dict over the model's trainable parameters (what a replicated optimizer would
        hold), assembled on rank 0's CPU one bucket at a time; None on the other ranks. Every rank calls it."""
        local = optimizer.state_dict()  # state keyed by bucket index: shard-sized tensors and scalars
        index_of = self._index_of()
        comm_device = self.shards[0].device if dist.get_backend() == "nccl" else torch.device("cpu")
        state: dict[int, dict[str, Any]] = {}
        for index, bucket in enumerate(self.buckets):
            for key, value in sorted(local["state"].get(index, {}).items()):
                if torch.is_tensor(value) and value.dim() > 0:  # one number per element: gather the shards
                    pieces = [torch.empty_like(value, device=comm_device) for _ in range(self.world_size)] \
                        if self.rank == 0 else None
                    dist.gather(value.to(comm_device), pieces, dst=0)
                    if self.rank != 0:
                        continue
                    full = torch.cat(pieces).cpu()
                    for p, start in zip(bucket, self.offsets[index]):
                        piece = gradient_view(full[start:start + p.numel()], p)
                        state.setdefault(index_of[id(p)], {})[key] = piece.clone()  # its own storage
                else:  # a scalar (AdamW's step count): the same for every parameter of the bucket
                    for p in bucket:
                        state.setdefault(index_of[id(p)], {})[key] = value.clone() if torch.is_tensor(value) \
                            else value
        if self.rank != 0:
            return None
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(range(len(self.params)))}
                  for group in local["param_groups"]]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, full: dict[str, Any]) -> None:
        """Load a state_dict over the model's parameters (``optimizer_state``'s form, or a replicated optimizer's)
        by cutting this rank's shard out of each bucket, one bucket at a time."""
        if len(full["param_groups"]) != 1 or len(full["param_groups"][0]["params"]) != len(self.params):
            raise ValueError(f"the optimizer state has {sum(len(g['params']) for g in full['param_groups'])} "
                             f"parameters in {len(full['param_groups'])} group(s); this model has "
                             f"{len(self.params)} in one")
        index_of = self._index_of()
        state: dict[int, dict[str, Any]] = {}
        for index, bucket in enumerate(self.buckets):
            saved = [full["state"].get(index_of[id(p)], {}) for p in bucket]
            for key in saved[0]:
                first = saved[0][key]
                if torch.is_tensor(first) and first.dim() > 0:
                    flat = torch.zeros(self.lengths[index], dtype=first.dtype)
                    for p, start, entry in zip(bucket, self.offsets[index], saved):
                        gradient_view(flat[start:start + p.numel()], p).copy_(entry[key])
                    state.setdefault(index, {})[key] = self.shard_of(flat).clone()
                else:
                    state.setdefault(index, {})[key] = first.clone() if torch.is_tensor(first) else first
        group = {k: v for k, v in full["param_groups"][0].items() if k != "params"}
        group["params"] = list(range(len(self.shards)))  # the shard params, one per bucket
        optimizer.load_state_dict({"state": state, "param_groups": [group]})


class ZeroStage2(ZeroStage1):
    """Gradients sharded too: every micro-batch reduce-scatters each complete bucket into this rank's shard
    accumulator, and full gradient buffers live only while a bucket fills or is in flight (module docstring).
    Always overlapped: the hooks that copy each gradient out are what frees it."""

    def __init__(self, model: nn.Module, bucket_mb: float, overlap: bool = True, allreduce: str = "torch",
                 timeout_s: float | None = None):
        if not overlap:
            raise ValueError("ZeRO stage 2 reduce-scatters each bucket as backward completes it; syncing after "
                             "backward would keep every full gradient (use stage 1 for that)")
        super().__init__(model, bucket_mb, True, allreduce, timeout_s)
        # each parameter's place in its bucket's buffer, as (first element, strides): gradient_view's layout,
        # worked out once here rather than in every hook call
        self.place = {id(p): (start, gradient_view(torch.empty(p.numel(), device="meta"), p).stride())
                      for index, bucket in enumerate(self.buckets)
                      for p, start in zip(bucket, self.offsets[index])}
        self.numels = [sum(p.numel() for p in bucket) for bucket in self.buckets]
        self.buffer_length = max(self.lengths)
        self.pool: list[torch.Tensor] = []  # free full-gradient buffers, each buffer_length long
        self.filling: dict[int, torch.Tensor] = {}  # bucket index -> the buffer its gradients are copied into
        self.in_flight: list[tuple[int, torch.Tensor, Any]] = []  # (bucket, its buffer, handle), launch order
        self.buffers_made = 0  # the most full buffers alive at once, over the run (the pool's high-water mark)

    def _gradient_buffer(self, index: int) -> None:
        for p in self.buckets[index]:
            p.grad = None  # autograd allocates each gradient; the hook copies it out and frees it
        return None

    def _shard_gradient(self, index: int) -> torch.Tensor:
        """The shard accumulator: the sum over the window's micro-batches of the averaged shard gradients."""
        flat_params = self.param_flats[index]
        return torch.zeros(flat_params.numel() // self.world_size, dtype=flat_params.dtype,
                           device=flat_params.device)

    def prepare(self, sync: bool) -> None:
        """Every micro-batch communicates in stage 2: ``sync`` changes nothing here."""
        self.pending = list(self.sizes)
        self.launched = 0
        self.handles = []

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        self._copy_out(index, param)
        self.pending[index] -= 1
        while self.launched < len(self.buckets) and self.pending[self.launched] == 0:
            self._launch(self.launched)

    def _copy_out(self, index: int, param: torch.Tensor) -> None:
        """Copy ``param``'s new gradient into its place in bucket ``index``'s buffer, and free it."""
        buffer = self.filling.get(index)
        if buffer is None:
            buffer = self.filling[index] = self._acquire()
            buffer[self.numels[index]:self.lengths[index]].zero_()  # the padding
        start, strides = self.place[id(param)]
        buffer.as_strided(param.shape, strides, start).copy_(param.grad)  # the pool's buffers start at offset 0
        param.grad = None  # the full gradient does not outlive this copy

    def _acquire(self) -> torch.Tensor:
        """A free buffer: from the pool, else the oldest bucket in flight lands and frees its own, else (every
        buffer is filling) a new one."""
        if not self.pool and self.in_flight:
            self._land_oldest()
        if not self.pool:
            busy = len(self.filling) + len(self.in_flight)
            self.buffers_made = max(self.buffers_made, busy + 1)
            self.pool.append(torch.empty(self.buffer_length, dtype=self.shards[0].dtype,
                                         device=self.shards[0].device))
        return self.pool.pop()

    def _flat(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[:self.lengths[index]]

    def _land_oldest(self) -> None:
        index, buffer, handle = self.in_flight.pop(0)
        self._wait([handle])
        self.shards[index].grad.add_(self.shard_of(self._flat(index, buffer)))
        self._release(buffer)

    def _release(self, buffer: torch.Tensor) -> None:
        self.pool.append(buffer)  # for a later bucket

    def _start(self, index: int) -> Any:
        buffer = self.filling.pop(index)
        handle = self._reduce_scatter(self._flat(index, buffer))
        self.in_flight.append((index, buffer, handle))
        return handle

    def finish(self) -> None:
        """Wait for the window's last reduce-scatters, add them in, and release the full buffers."""
        with utils.profiled(f"{self.collective} wait"):
            while self.in_flight:
                self._land_oldest()
        self.pool = []
        self.handles = []

    def zero_grad(self) -> None:
        for shard in self.shards:
            shard.grad.zero_()

    def held_gradient_buffers(self) -> list[torch.Tensor]:
        return self.pool + list(self.filling.values()) + [flat for _, flat, _ in self.in_flight]


class ZeroStage3(ZeroStage2):
    """Parameters sharded too: each unit (a block of the model, or the root for the parameters no block owns)
    keeps 1/W of its flat parameters and gathers the whole only around its forward and its backward, the next
    unit's all-gather running while the current one computes (module docstring, "Stage 3").

    Gradients go as in stage 2 (copied out as autograd produces them, reduce-scattered per micro-batch into the
    shard accumulators), one unit per buffer, launched when the unit's last gradient is in. ``accumulate``
    "unsharded" keeps instead each unit's full gradient over the window and reduce-scatters it on the last
    micro-batch only (FSDP2's set_requires_gradient_sync): 4 Psi more during the window, K-1 fewer
    reduce-scatters, and stage 0's summation order."""

    group_word = "unit"
    max_gathered = 2  # units whose full parameters may be in place at once, besides the root

    def __init__(self, model: nn.Module, bucket_mb: float, overlap: bool = True, allreduce: str = "torch",
                 timeout_s: float | None = None, blocks: list[nn.Module] = (), accumulate: str = "sharded"):
        if accumulate not in ("sharded", "unsharded"):
            raise ValueError(f"accumulate is 'sharded' or 'unsharded', not {accumulate!r}")
        self.unsharded = accumulate == "unsharded"
        # the units: the root (if it owns a trainable parameter no block does) and the blocks, in module order
        owner: dict[int, nn.Module] = {}
        for module in [model, *blocks]:  # a block claims its parameters from the root (an inner block, from outer)
            owner.update((id(p), module) for p in module.parameters())
        self.units = [m for m in [model, *blocks] if any(owner[id(p)] is m for p in m.parameters()
                                                         if p.requires_grad)]
        self.owner = owner
        super().__init__(model, bucket_mb, overlap, allreduce, timeout_s)
        for shard in self.shards:  # the shards take storage of their own: the full flats are freed between uses
            shard.data = shard.data.clone()
        self.root = 0 if self.units[0] is model else None
        self.gathering: dict[int, Any] = {}  # unit -> its all-gather in flight
        self.gathered: set[int] = set()  # units whose full parameters are in place
        self.wanted: int | None = None  # a prefetch held back by max_gathered, launched when a unit is freed
        # the units in the order the last forward started them (the next forward prefetches along it) and in the
        # reverse of the order it finished them (the backward's: the root, whose head ends the forward, first)
        self.order: list[int] = []
        self.backward_order: list[int] = []
        self.recording: tuple[list[int], list[int]] = ([], [])
        self.backward_begun: set[int] = set()
        self.peak = {"units": 0, "bytes": 0}  # most units gathered at once besides the root; most full bytes
        self.spans: dict[str, Any] = {}  # open "unit I forward/backward" ranges
        for index in range(len(self.units)):
            self._free(index)
        # hooks run in the order they were registered: the pass starts before the root's forward begins, and ends
        # after the root's forward has finished (so the recorded orders include it)
        self.hooks = [model.register_forward_pre_hook(self._pass_starts)]
        for index, unit in enumerate(self.units):
            self.hooks += [unit.register_forward_pre_hook(partial(self._before_forward, index)),
                           unit.register_forward_hook(partial(self._after_forward, index))]
        self.hooks.append(model.register_forward_hook(self._pass_ends))

    def group(self, model: nn.Module, bucket_mb: float) -> list[list[nn.Parameter]]:
        """One group per unit: its trainable parameters in module order (``bucket_mb`` plays no part)."""
        return [[p for p in unit.parameters() if p.requires_grad and self.owner[id(p)] is unit]
                for unit in self.units]

    # ------------------------------------------------------------------------------------------------------
    # Gathering and freeing a unit's full parameters
    # ------------------------------------------------------------------------------------------------------
    def _gather(self, index: int) -> None:
        """Give unit ``index``'s flat its storage back, put this rank's shard in place and launch the
        all-gather of the others' (asynchronously, like the reduce-scatters)."""
        flat = self._allocate(index)
        self.shard_of(flat).copy_(self.shards[index])
        self.gathering[index] = self._all_gather(index)
        held = self._held()
        self.peak["units"] = max(self.peak["units"], len(held - {self.root}))
        self.peak["bytes"] = max(self.peak["bytes"], sum(self.param_flats[i].numel() for i in held)
                                 * flat.element_size())

    def _allocate(self, index: int) -> torch.Tensor:
        """Unit ``index``'s flat with its storage back (contents undefined), for a gather or a load."""
        flat = self.param_flats[index]
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        return flat

    def _held(self) -> set[int]:
        """The units whose full flat has storage: gathered, or being gathered."""
        return set(self.gathering) | self.gathered

    def _materialize(self, index: int) -> None:
        """Unit ``index``'s full parameters in place: wait for its prefetch, or gather it now."""
        if index in self.gathered:
            return
        if index not in self.gathering:
            self._gather(index)
        with utils.profiled("all_gather wait"):
            self._wait([self.gathering.pop(index)])
        self.gathered.add(index)

    def _free(self, index: int) -> None:
        """Drop unit ``index``'s full parameters (the views stay, on a storage of 0 bytes), and launch a
        prefetch that max_gathered held back."""
        self.param_flats[index].untyped_storage().resize_(0)
        self.gathered.discard(index)
        if self.wanted is not None:
            wanted, self.wanted = self.wanted, None
            self._prefetch(wanted)

    def _prefetch(self, index: int | None) -> None:
        """Launch unit ``index``'s all-gather ahead of its use, unless max_gathered units are already held."""
        if index is None or index in self._held():
            return
        if len(self._held() - {self.root}) >= self.max_gathered:
            self.wanted = index
            return
        self._gather(index)

    @staticmethod
    def _after(order: list[int], index: int) -> int | None:
        position = order.index(index) if index in order else -1
        return order[position + 1] if 0 <= position < len(order) - 1 else None

    # ------------------------------------------------------------------------------------------------------
    # Hooks: forward (module hooks), backward (a hook on each unit's output; the gradients' hooks)
    # ------------------------------------------------------------------------------------------------------
    def _open(self, name: str) -> None:
        span = utils.profiled(name)
        span.__enter__()
        self.spans[name] = span

    def _close(self, name: str) -> None:
        span = self.spans.pop(name, None)
        if span is not None:
            span.__exit__(None, None, None)

    def _pass_starts(self, model: nn.Module, args: Any) -> None:
        self.recording = ([], [])
        if torch.is_grad_enabled():
            self.backward_begun = set()

    def _pass_ends(self, model: nn.Module, args: Any, output: Any) -> None:
        started, finished = self.recording
        self.order, self.backward_order = started, finished[::-1]

    def _before_forward(self, index: int, module: nn.Module, args: Any) -> None:
        self.recording[0].append(index)
        self._open(f"unit {index} forward")
        self._materialize(index)
        self._prefetch(self._after(self.order, index))

    def _after_forward(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        self.recording[1].append(index)
        self._close(f"unit {index} forward")
        if not torch.is_grad_enabled():
            self._free(index)  # evaluation: no backward will come
            return
        for tensor in (output if isinstance(output, (tuple, list)) else [output]):
            if torch.is_tensor(tensor) and tensor.requires_grad:
                tensor.register_hook(partial(self._before_backward, index))
        if index != self.root:  # the root (stem and head) is used at both ends of forward and backward: kept
            self._free(index)

    def _before_backward(self, index: int, grad: torch.Tensor) -> None:
        """The gradient of unit ``index``'s output is ready: its backward is about to run."""
        if index not in self.backward_begun:
            self.backward_begun.add(index)
            self._open(f"unit {index} backward")
            self._materialize(index)
            self._prefetch(self._after(self.backward_order, index))

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        self._copy_out(index, param)
        self.pending[index] -= 1
        if self.pending[index] == 0:  # the unit's backward is done: average its gradients, free its parameters
            if self.sync or not self.unsharded:
                self._launch(index)
            self._free(index)
            self._close(f"unit {index} backward")

    def _copy_out(self, index: int, param: torch.Tensor) -> None:
        """Sharded accumulation: stage 2's. Unsharded: add the gradient into the unit's own full buffer, kept
        over the window (0 + g is g exactly, so the sums are stage 0's: each rank's micro-batches in turn)."""
        if not self.unsharded:
            return super()._copy_out(index, param)
        buffer = self.filling.get(index)
        if buffer is None:
            buffer = self.filling[index] = torch.zeros(self.lengths[index], dtype=self.shards[0].dtype,
                                                       device=self.shards[0].device)
        start, strides = self.place[id(param)]
        buffer.as_strided(param.shape, strides, start).add_(param.grad)
        param.grad = None

    def _release(self, buffer: torch.Tensor) -> None:
        if not self.unsharded:  # unsharded buffers are each unit's own length, not the pool's
            super()._release(buffer)

    def prepare(self, sync: bool) -> None:
        self._check_complete()
        super().prepare(sync)
        self.sync = sync

    def finish(self) -> None:
        self._check_complete()
        super().finish()

    def _check_complete(self) -> None:
        """Every unit's gradients in, in the last backward (a parameter left without a gradient would leave its
        unit waiting, and its all-gathers out of step with the other ranks')."""
        done = sum(count == 0 for count in self.pending)  # pending: per unit, gradients still to come
        if done not in (0, len(self.units)):
            waiting = [index for index, count in enumerate(self.pending) if count]
            raise RuntimeError(f"ZeRO stage 3: unit(s) {waiting} got no gradient for some parameter in the last "
                               f"backward; every trainable parameter must take part in the loss")

    def gather_params(self) -> None:
        """Nothing after the step: the optimizer updated the shards, which the next forward gathers."""

    # ------------------------------------------------------------------------------------------------------
    # The whole model: checkpoints, and the trained model handed back
    # ------------------------------------------------------------------------------------------------------
    def _names(self, model: nn.Module) -> dict[int, list[str]]:
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        return names

    def model_state(self, model: nn.Module) -> dict[str, Any] | None:
        """The whole state_dict on rank 0's CPU, gathered one unit at a time (None on the other ranks)."""
        gathered: dict[str, torch.Tensor] = {}
        names = self._names(model)
        for index, unit_params in enumerate(self.buckets):
            self._materialize(index)
            if self.rank == 0:
                for p in unit_params:
                    gathered.update((name, p.detach().cpu().clone()) for name in names[id(p)])
            self._free(index)
        if self.rank != 0:
            return None
        return {key: gathered.get(key, value) for key, value in model.state_dict().items()}

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Load a whole state_dict (every rank has it): unit by unit into a full flat, whose slice becomes this
        rank's shard; buffers as they are."""
        expected = model.state_dict().keys()
        if set(state) != set(expected):
            raise RuntimeError(f"Error(s) in loading state_dict: missing keys {sorted(set(expected) - set(state))}, "
                               f"unexpected keys {sorted(set(state) - set(expected))}")
        names = self._names(model)
        with torch.no_grad():
            for index, unit_params in enumerate(self.buckets):
                flat = self._allocate(index)
                flat.zero_()  # the padding
                for p in unit_params:
                    p.copy_(state[names[id(p)][0]])
                self.shards[index].copy_(self.shard_of(flat))
                self._free(index)
            for name, buffer in model.named_buffers():
                buffer.copy_(state[name])

    def release_model(self) -> None:
        """Gather every unit for good and remove the hooks: the model is whole and ordinary again (the sync is
        done)."""
        for index in range(len(self.units)):
            self._materialize(index)
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


def make_sync(stage: int, model: nn.Module, bucket_mb: float, overlap: bool, allreduce: str = "torch",
              timeout_s: float | None = None, blocks: list[nn.Module] = (), accumulate: str = "sharded"
              ) -> GradientSync:
    """The hand-written sync for ZeRO ``stage`` 0 (replicated: gradsync.GradientSync), 1, 2 or 3 (whose units
    are ``blocks`` and the root, and which accumulates ``accumulate``: see ZeroStage3)."""
    if stage == 3:
        return ZeroStage3(model, bucket_mb, overlap, allreduce, timeout_s, blocks, accumulate)
    return (GradientSync, ZeroStage1, ZeroStage2)[stage](model, bucket_mb, overlap, allreduce, timeout_s)


class FSDPSync:
    """PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard) on the same units, behind the sync interface: the
    anchor for stage 3 (``reshard_after_forward`` True) and, with it False, for a stage 2 whose parameters are
    sharded between steps. Accumulation is FSDP2's own: set_requires_gradient_sync(False) keeps the unsharded
    gradients until the window's last micro-batch reduce-scatters them. Checkpoints go through
    torch.distributed.checkpoint's full state dicts, turned into the same form as ours (parameters by index)."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], stage: int):
        from torch.distributed.fsdp import fully_shard
        for block in blocks:
            fully_shard(block, reshard_after_forward=stage == 3)
        fully_shard(model, reshard_after_forward=stage == 3)
        self.model = model
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())  # DTensors: each rank's shard of every parameter

    def prepare(self, sync: bool) -> None:
        self.model.set_requires_gradient_sync(sync)

    def finish(self) -> None:
        pass  # FSDP2 waits for its reduce-scatters at the end of backward

    def gather_params(self) -> None:
        pass  # gathered at the next forward

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=False)  # keep the sharded gradients, as our accumulators are kept

    def _reshard(self) -> None:
        """Every unit sharded, before a state dict: an evaluation's forward with reshard_after_forward=False
        (--zero 2) leaves its units gathered (no backward comes to reshard them), and the state dict would then
        miss the parameters the optimizer holds."""
        from torch.distributed.fsdp import FSDPModule
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _options(self) -> Any:
        """Full state dicts on rank 0's CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        self._reshard()
        full = get_optimizer_state_dict(self.model, optimizer, options=self._options())  # keyed by name
        if dist.get_rank() != 0:
            return None
        index = {name: i for i, name in enumerate(self.names)}
        return {"state": {index[name]: value for name, value in full["state"].items()},
                "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                                 for group in full["param_groups"]]}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        named = {"state": {self.names[i]: value for i, value in state["state"].items()},
                 "param_groups": [{**group, "params": [self.names[i] for i in group["params"]]}
                                  for group in state["param_groups"]]}
        set_optimizer_state_dict(self.model, optimizer, named, options=StateDictOptions(full_state_dict=True))

    def model_state(self, model: nn.Module) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        self._reshard()
        state = get_model_state_dict(model, options=self._options())
        return state if dist.get_rank() == 0 else None

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def release_model(self) -> None:
        pass  # the parameters stay DTensors: full_tensor() gathers one

    def sent_bytes(self) -> None:
        return None  # inside FSDP2 and gloo: not counted

    def close(self) -> None:
        pass


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, sync: GradientSync | DDPSync
                ) -> dict[str, int]:
    """Bytes this rank holds for the weights, the gradients and the optimizer state: the storages behind the
    model's parameters, behind every .grad the model or the optimizer reaches (and stage 2's buffers), and behind
    the optimizer's state tensors (ZeroRedundancyOptimizer: its local optimizer's), each storage counted once."""
    def held(tensors) -> int:
        storages = {}
        for t in tensors:
            t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor: this rank's shard
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    optimized = [p for group in optimizer.param_groups for p in group["params"]]
    local = getattr(optimizer, "optim", optimizer)
    grads = [p.grad for p in list(model.parameters()) + optimized]
    grads += getattr(sync, "held_gradient_buffers", list)()
    return {"params": held(list(model.parameters()) + optimized), "grads": held(grads),
            "optimizer": held(v for s in local.state.values() for v in s.values() if torch.is_tensor(v))}
