"""Mixed precision for stages 1-3 (``zero.shard(..., param_dtype=, reduce_dtype=)``): which dtype each tensor of a
stage is kept in, the master shards, and the model's state gathered or loaded in the model's own dtype.

Three dtypes (FSDP2's MixedPrecisionPolicy names two of them, and keeps the third as we do):

    master   the model's own (fp32; float64 in the tests): the optimizer's shards, its state, every state dict
    param    param_dtype (default: master): the weights the forward and backward compute with, the flats that
             are gathered (stage 3) or kept whole between steps (stages 1-2), and so the gradients autograd makes
    reduce   reduce_dtype (default: param): the dtype gradients are summed over the ranks in

Where they differ, what moves where, per optimizer step (Psi parameters, W ranks):

    forward/backward  compute in ``param``; floating inputs of the root's forward are cast to it (FSDP2's
                      cast_forward_inputs), buffers are left as they are
    gradients         ``param`` from autograd -> cast to ``reduce`` into the bucket's buffer -> reduce-scatter ->
                      this rank's chunk cast to ``master`` (added into the gradient shard at stages 2-3)
    step              the optimizer steps the ``master`` shards with ``master`` state
    after the step    each rank casts its master shard into its chunk of the ``param`` flat and all-gathers that
                      (stages 1-2); stage 3 casts it at every gather of a unit instead

So with bf16 over fp32 masters a rank holds 2 Psi of bf16 weights (stages 1-2; 2 Psi / W at stage 3) beside
4 Psi / W of masters and 8 Psi / W of AdamW state, and every gather sends half the bytes of an fp32 one. The
masters are tensors of their own only when ``param`` differs from ``master``: otherwise (the default) they are
views of the model's flats (stages 1-2) as before, and nothing is copied.

Why not autocast: autocast casts every weight again in every forward (and the gathers stay at fp32); here the
weights are cast once per step, by the rank that owns them, before they travel.

fp16 is refused: its 5-bit exponent needs loss scaling (a scaler that agrees over the ranks whether any shard
overflowed), which this does not build; bf16 has fp32's exponent.

Stage 1 accumulates a window's micro-batches in the model's .grad views, which autograd keeps in ``param``
(as DDP does with bf16 parameters); stages 2 and 3 add each micro-batch's reduced chunk into the ``master``
shard, and stage 3's accumulate="unsharded" keeps its full gradients in ``reduce`` (FSDP2's order and dtype).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from collectives import Collectives
from zero.buckets import Bucket


@dataclass(frozen=True)
class Precision:
    """The three dtypes of a sharded stage (module docstring)."""
    master: torch.dtype
    param: torch.dtype
    reduce: torch.dtype

    @property
    def separate_masters(self) -> bool:
        """Whether the optimizer's shards are tensors of their own (``param`` is not the master dtype)."""
        return self.param != self.master


def resolve(model: nn.Module, stage: int, param_dtype: torch.dtype | None,
            reduce_dtype: torch.dtype | None) -> Precision:
    """The stage's Precision, or a one-line ValueError for what it cannot train with."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if stage == 0 and (param_dtype is not None or reduce_dtype is not None):
        raise ValueError("zero.shard: param_dtype and reduce_dtype are for stages 1-3 (masters and gathers of "
                         "shards); stage 0 keeps the model whole in its own dtype (use autocast there)")
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is None:
            continue
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"zero.shard: {name} is a floating torch.dtype (torch.bfloat16, torch.float32), "
                             f"not {dtype!r}")
        if dtype == torch.float16:
            raise ValueError(f"zero.shard: {name}=torch.float16 needs loss scaling (its 5-bit exponent under- and "
                             f"overflows gradients), which zero.shard does not do; use torch.bfloat16")
    dtypes = {p.dtype for p in trainable}
    if len(dtypes) > 1 and (param_dtype is not None or reduce_dtype is not None):
        raise ValueError(f"zero.shard: param_dtype needs one master dtype; the model's trainable parameters are "
                         f"{', '.join(sorted(str(d) for d in dtypes))}")
    master = trainable[0].dtype
    param = param_dtype or master
    return Precision(master, param, reduce_dtype or param)


def shard_weights(buckets: list[Bucket], comm: Collectives, precision: Precision, own_shards: bool,
                  deferred: bool = False, keep: Callable[[Bucket, torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each bucket's parameters moved into one padded flat tensor of ``precision.param`` (each parameter a view
    into it laid out as its gradient is, Bucket.view, so the flat weight and the flat gradient match element by
    element), and this rank's shard of the weights in the master dtype: a view of the flat's chunk when the dtypes
    agree and not ``own_shards`` (stages 1-2: the step writes the model's weights), else a tensor of its own
    (stage 3, whose flats are freed here, one bucket at a time, so no more than one is whole at once; or masters
    under a lower param_dtype). ``deferred`` (stage 3 from the meta device, zero/init.py): the parameters hold no
    values yet, so the shards start as zeros for the initialization to fill. ``keep(bucket, shard)`` (stage 3 with
    offload: zero/offload/) takes each own shard as it is made and returns what the stage holds in its place, so no
    more than one bucket's shard is in memory at once. Returns (flats, shards)."""
    flats, shards = [], []
    with torch.no_grad():
        for bucket in buckets:
            full = bucket.zeros()  # the master dtype: the parameters' own, before they move
            if not deferred:
                for p in bucket.params:
                    bucket.view(full, p).copy_(p)
            flat = full if not precision.separate_masters else full.to(precision.param)
            shard = comm.chunk(full)
            if keep is not None:
                shards.append(keep(bucket, shard))
            else:
                shards.append(shard.clone() if own_shards or precision.separate_masters else shard)
            for p in bucket.params:
                p.data = bucket.view(flat, p)
            if own_shards:
                flat.untyped_storage().resize_(0)  # the parameters stay views of it, with no memory behind them
            flats.append(flat)
    return flats, shards


def gather_full(comm: Collectives, bucket: Bucket, shard: torch.Tensor) -> torch.Tensor:
    """The bucket's whole flat in the shard's dtype, from every rank's shard (an all-gather, on every rank)."""
    full = torch.empty(bucket.length, dtype=shard.dtype, device=shard.device)
    comm.chunk(full).copy_(shard)
    comm.all_gather(full, bucket.name("all_gather")).wait()
    return full


def gathered_state_dict(model: nn.Module, wholes: Iterable[tuple[Bucket, torch.Tensor]],
                        rank: int) -> dict[str, Any]:
    """The model's state_dict with every bucket's parameters read from its whole flat: ``wholes`` yields each
    bucket with it, one at a time (each a collective: every rank runs through them all). On rank 0 of the group as
    CPU tensors (a tied parameter under each of its names), {} on the others."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    gathered: dict[str, torch.Tensor] = {}
    for bucket, full in wholes:
        if rank == 0:
            for p in bucket.params:
                gathered.update((name, bucket.view(full, p).detach().cpu().clone()) for name in names[id(p)])
    if rank != 0:
        return {}
    return {key: gathered[key] if key in gathered else value.detach().cpu()  # (not .get: a stage-3 parameter has
            for key, value in model.state_dict(keep_vars=True).items()}        # no storage to copy between uses)


def master_state_dict(model: nn.Module, buckets: list[Bucket], comm: Collectives, masters: list[torch.Tensor],
                      rank: int) -> dict[str, Any]:
    """The model's state_dict with every trainable parameter taken from the masters (the model's own dtype),
    gathered one bucket at a time; on rank 0 of the group (CPU tensors), {} on the others."""
    return gathered_state_dict(model, ((b, gather_full(comm, b, m)) for b, m in zip(buckets, masters)), rank)


def full_flat(bucket: Bucket, state: dict[str, Any], names: dict[int, str], like: torch.Tensor) -> torch.Tensor:
    """The bucket's parameters out of a whole state_dict as its flat, zero-padded, in ``like``'s dtype and device."""
    full = torch.zeros(bucket.length, dtype=like.dtype, device=like.device)
    for p in bucket.params:
        bucket.view(full, p).copy_(state[names[id(p)]])
    return full


def load_masters(buckets: list[Bucket], comm: Collectives, masters: list[torch.Tensor], names: dict[int, str],
                 state: dict[str, Any]) -> None:
    """Each master shard cut out of a whole state_dict (every rank passes the same), in the master dtype: a full
    flat per bucket, zero-padded, whose chunk is this rank's shard. No collective."""
    with torch.no_grad():
        for bucket, shard in zip(buckets, masters):
            shard.copy_(comm.chunk(full_flat(bucket, state, names, shard)))


def scatter_masters(buckets: list[Bucket], comm: Collectives, masters: list[torch.Tensor], names: dict[int, str],
                    state: dict[str, Any] | None) -> None:
    """Each master shard scattered from the group's rank 0, the only one holding the state_dict: there a full flat
    per bucket, one at a time, whose W chunks go out (dist.scatter); the others receive their chunk alone."""
    with torch.no_grad():
        for bucket, shard in zip(buckets, masters):
            chunks = list(full_flat(bucket, state, names, shard).chunk(comm.size)) if comm.rank == 0 else None
            received = shard if shard.is_contiguous() else torch.empty_like(shard)
            dist.scatter(received, chunks, group=comm.group, group_src=0)
            if received is not shard:
                shard.copy_(received)


def cast_forward_inputs(dtype: torch.dtype):
    """A forward pre-hook casting the floating tensors among a module's positional inputs to ``dtype`` (what
    FSDP2's cast_forward_inputs does at the root): images in fp32 meet bf16 weights in bf16."""
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
    return hook
