"""Sharded checkpoints of zero.shard's stages in torch.distributed.checkpoint's (DCP's) format: every rank writes its
own shards and reads only what its shards overlap, and FSDP2 reads ours as we read FSDP2's.

    zero.checkpoint.save(path, sharded, optimizer, extra=None)   # every rank; optimizer: one, several, None
    extra = zero.checkpoint.load(path, sharded, optimizer)        # every rank; any stage 0-3, W, replicate_group
    extra = zero.checkpoint.read_extra(path)                      # one process: the extra alone, before a load
    whole = zero.checkpoint.read_whole(path, ("model",))          # whole tensors: for programs that keep them whole

Why: the whole state dicts (``sharded.model_state_dict()``, ``optimizer.state_dict()``) gather 12 Psi bytes (AdamW)
on rank 0 and hand the whole of them to every rank on resume; this writes 12 Psi / W per rank and reads as much.

The format is the one ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizers)`` gives an FSDP2
model, saved by ``dcp.save`` (checked against torch 2.15): a folder of ``__R_0.distcp`` files and a ``.metadata``,
holding the nested state dict

    {"model":     {fqn: tensor},                 every name of model.state_dict(), a tied weight under each name
     "optimizer": {"state": {fqn: {key: value}}, a parameter under its first name; AdamW's step a 0-dim tensor per
                                                 parameter, its moments (Muon's momentum_buffer) in the parameter's
                                                 shape, Adafactor's row_var and col_var whole in torch's shapes;
                                                 several optimizers merged (disjoint parameters)
                   "param_groups": [{..., "params": [fqn, ...]}]},   every optimizer's groups, in turn
     "extra":     anything}                      the caller's (position, scheduler, ...): rank 0's, when not None

flattened by DCP into keys such as "optimizer.state.blocks.0.attn.qkv.weight.exp_avg", every tensor in its
parameter's own (global) shape and the model's own dtype (the masters under param_dtype). So
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` makes ours an ordinary state dict, an FSDP2 program
loads ours with ``dcp.load`` + ``set_state_dict``, and ours loads FSDP2's (``load`` then returns None: no extra).

The chunk arithmetic ([Note: boxes]). A rank's shard of a stage-1-3 bucket is a contiguous range of a flat buffer
that crosses parameters; inside each parameter it is a contiguous range [start, end) of the parameter's elements in
its memory order (gradsync.gradient_view: a channels-last weight is laid out by its strides). DCP describes a
rank's part of a tensor as n-D boxes (ChunkStorageMetadata: offsets, sizes), so each range is written as the boxes
it covers: ``range_boxes`` cuts a range of a row-major shape into at most 2(n-1)+1 boxes, each one contiguous in
memory (a view of the shard, no copy), none empty, none overlapping; ``layout_boxes`` does it in a permuted
layout's memory order and maps the boxes back to the tensor's own dimensions. On load the same boxes are the
rank's local chunks, and DCP's ``create_read_items_for_chunk_list`` intersects them with the boxes on disk,
whatever world size, stage or FSDP2 wrote them.

What each rank holds is listed by the stage (``sharded.held_pieces()``: per parameter kept in a flat bucket, its
range and a 1-D view of the masters; ``flat_pieces`` of (buckets, shards), so another sharded part, frozen
parameters sharded at stage 3, is one more such pair) and, for the optimizer, by its runs (zero/optimizer.py: one
inner tensor per run of a bucket's chunk, so a run's state is cut into the same per-parameter ranges; Muon's and
Adafactor's runs are pieces of one parameter each, zero/matrix.py). Whatever no stage shards (buffers, frozen
parameters, stage 0's whole model and plain optimizer, Adafactor's factored statistics: [Note: state kept whole]) is
a whole tensor on every rank that holds it: each offers it and DCP's de-duplication of identical write items keeps
one copy, as it does for the replicas of hybrid sharding, whose equal shards give equal boxes.

Memory, per rank (Psi parameters, W ranks of the shard group), on top of what the rank holds anyway:
- save: nothing gathered, no collective but DCP's planning (objects: [Note: no tensor collective in save]) and no
  copy: the boxes are views of the shards and of the optimizer's state, each on a storage of exactly its own
  bytes, which DCP's writer serializes as they are ([Note: no copy in save]). Only DCP's plans, and, where the
  state is on a GPU, the writer's copies to the host (DCP keeps them until the rank's file is closed: the rank's
  share, in host memory, as for FSDP2's shards).
- load: first the small things (param_groups, step counts, extra); then the model's shards are read in place into
  the masters (stage 3's gathered units dropped first), and the optimizer's state straight into new per-run
  tensors, its own from then on (the old state is released before: 8 Psi / W for AdamW, never twice). DCP's
  reader loads one stored box at a time to copy what overlaps: the saver's share of one tensor (a whole tensor
  only where the saver held it whole: stage 0, W = 1, buffers), about twice over while it is read (a 320 MB
  shard read from 8 stored boxes of 40 MB: peak RSS +76 MB). Stages 1-2 then all-gather the loaded shards into
  the whole weights, in place, as after a step.

Bad input is answered in one line naming the folder (CheckpointError, a ValueError) on every rank alike: not a
DCP checkpoint, torn (its .metadata or a data file it names missing or short), another model (missing or
unexpected keys, another shape), an optimizer state of another kind or other parameter groups. [Note: the same
verdict] says how no rank is left in a collective another has left. A save writes into its folder in place, the
.metadata last (DCP's coordinator, after every rank's data): one cut short leaves a torn folder, which load
refuses; save each checkpoint to a fresh folder and rename it, for one that is always whole.

Two readers serve what is not a zero.shard stage. ``read_extra`` reads the extra alone, in this process (no
collective): a trainer looks at its position and configuration before it decides to load. ``read_whole`` reads
parts of the state dict whole, every tensor in its global shape (what ``dcp_to_torch_save`` gives, in memory), for
programs that keep the whole model on every rank anyway (DDP, ZeroRedundancyOptimizer, a sampler), by every rank
of a group together or by one process alone.

Two of DCP's helpers come from private modules (``_nested_dict.flatten_state_dict``, ``_traverse.set_element``):
they are the flattening DCP's own planners and ``dcp_to_torch_save`` use, so the keys and the rebuilt structure are
DCP's by construction.
"""
from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's own flattening ...
from torch.distributed.checkpoint._traverse import set_element  # ... and its inverse (dcp_to_torch_save's)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                           create_default_local_load_plan,
                                                           create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from gradsync import Bucket, GradientSync
from zero.matrix import PROBE_DIMS
from zero.optimizer import as_optimizers, state_kinds

__all__ = ["save", "load", "read_extra", "read_whole", "encode_extra", "one_line", "CheckpointError", "Piece", "Shards",
           "flat_pieces", "memory_order", "range_boxes", "layout_boxes", "ShardSavePlanner", "ShardLoadPlanner"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes), one per dimension


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked, in one line naming its folder."""


# ----------------------------------------------------------------------------------------------------------
# The chunk arithmetic ([Note: boxes])
# ----------------------------------------------------------------------------------------------------------
def memory_order(shape: Iterable[int], strides: Iterable[int]) -> tuple[int, ...]:
    """A dense layout's dimensions from outermost to innermost in memory: by decreasing stride (a dimension of size
    1 takes no place in memory: first). Row-major is (0, 1, ..., n-1); channels-last (N, C, H, W) is (0, 2, 3, 1)."""
    shape, strides = tuple(shape), tuple(strides)
    return tuple(sorted(range(len(shape)), key=lambda d: (shape[d] != 1, -strides[d], d)))


def range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Elements [start, end) of a row-major ``shape`` as boxes, in memory order.

    [Note: boxes] A box that fixes the leading dimensions at one index each, takes a range of the next one and the
    whole of every later one is contiguous in memory, and a range is cut into such boxes from the outside in: in
    dimension 0, the partial row it starts in (a range that ends at its row's end: recursively at most n-1 boxes,
    one per level), the whole rows between (one box), and the partial row it ends in (at most n-1 boxes). So at
    most 2(n-1)+1 boxes, never empty, tiling the range exactly; a range inside one row recurses into that row."""
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    (first, head), (last, tail) = divmod(start, inner), divmod(end, inner)
    rest = (0,) * (len(shape) - 1)

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *offsets), (1, *sizes)) for offsets, sizes in range_boxes(shape[1:], lo, hi)]

    if first == last:
        return in_row(first, head, tail)
    boxes = []
    if head:
        boxes += in_row(first, head, inner)
        first += 1
    if last > first:
        boxes.append(((first, *rest), (last - first, *shape[1:])))
    if tail:
        boxes += in_row(last, 0, tail)
    return boxes


def layout_boxes(shape: tuple[int, ...], order: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Elements [start, end) of a tensor's memory order (``order``: memory_order) as boxes in the tensor's own
    dimensions, in memory order: range_boxes of the permuted shape, mapped back."""
    boxes = []
    for offsets, sizes in range_boxes(tuple(shape[d] for d in order), start, end):
        own_offsets, own_sizes = [0] * len(shape), [0] * len(shape)
        for position, d in enumerate(order):
            own_offsets[d], own_sizes[d] = offsets[position], sizes[position]
        boxes.append((tuple(own_offsets), tuple(own_sizes)))
    return boxes


def layout_strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` laid out in ``order``."""
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = step
        step *= shape[d]
    return tuple(strides)


def spans(params: list[torch.Tensor], offsets: list[int], lo: int,
          hi: int) -> Iterator[tuple[torch.Tensor, int, int, int]]:
    """The parameters of a flat (each at its offset) that the flat's range [lo, hi) covers: (parameter, start, end,
    at): its elements [start, end) are the range's elements [at, at + end - start)."""
    for p, offset in zip(params, offsets):
        first, last = max(lo, offset), min(hi, offset + p.numel())
        if first < last:
            yield p, first - offset, last - offset, first - lo


def exact_storage(run: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view as a tensor whose storage is exactly its bytes, the same memory (a slice of the
    storage). [Note: no copy in save] DCP's file writer copies any tensor whose storage is larger than it (torch.save
    would write the whole storage), and keeps the last tensor it wrote of every key until the file is closed: views
    of the shards would be copied, most of a rank's share at once (a 320 MB shard of 8 parameters, saved in one
    process: peak RSS +307 MB with views of it, +2 MB with these)."""
    size, offset = run.element_size(), run.storage_offset()
    storage = run.untyped_storage()[offset * size:(offset + run.numel()) * size]
    return torch.empty(0, dtype=run.dtype, device=run.device).set_(storage, 0, (run.numel(),), (1,))


def narrowed(tensor: torch.Tensor, offsets: Iterable[int], lengths: Iterable[int]) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


# ----------------------------------------------------------------------------------------------------------
# What a rank holds
# ----------------------------------------------------------------------------------------------------------
@dataclass
class Piece:
    """What a rank holds of one tensor of the model's state: the elements [start, end) of its memory order
    (``order``, memory_order), as ``values``, a 1-D view of the rank's own tensor (the masters' shard)."""
    name: str
    shape: tuple[int, ...]
    order: tuple[int, ...]
    start: int
    end: int
    values: torch.Tensor


def flat_pieces(model: nn.Module, buckets: list[Bucket], shards: list[torch.Tensor],
                rank: int) -> dict[str, list[Piece]]:
    """Every name of every parameter in the buckets (a tied one under each), with its pieces in this rank's chunks
    (``shards[b]``, the r-th of W equal slices of bucket b's flat): none where the rank holds none of it. The
    stages' ``held_pieces``."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    pieces: dict[str, list[Piece]] = {name: [] for bucket in buckets for p in bucket.params for name in names[id(p)]}
    for bucket, shard in zip(buckets, shards):
        lo = rank * shard.numel()
        for p, start, end, at in spans(bucket.params, bucket.offsets, lo, lo + shard.numel()):
            order = memory_order(p.shape, bucket.place[id(p)][1])
            for name in names[id(p)]:
                pieces[name].append(Piece(name, tuple(p.shape), order, start, end, shard[at:at + end - start]))
    return pieces


@dataclass
class Shards:
    """A tensor of the checkpoint that this rank holds pieces of, as the planners see it: its global shape, dtype
    and memory order, and the pieces (start, end, 1-D view) of its memory order."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    order: tuple[int, ...]
    pieces: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
        """(offsets, sizes, view) of every box of every piece: the view aliases the piece, in the box's shape, on a
        storage of exactly its bytes ([Note: no copy in save])."""
        inverse = tuple(self.order.index(d) for d in range(len(self.shape)))
        out = []
        for start, end, values in self.pieces:
            at = 0
            for offsets, sizes in layout_boxes(self.shape, self.order, start, end):
                count = math.prod(sizes)
                run = exact_storage(values[at:at + count])
                view = run.view([sizes[d] for d in self.order]).permute(inverse)
                out.append((offsets, sizes, view))
                at += count
        return out


def shards_by_name(pieces: Iterable[Piece]) -> dict[str, Shards]:
    """Pieces, as the Shards of each name."""
    by_name: dict[str, Shards] = {}
    for piece in pieces:
        shards = by_name.setdefault(piece.name, Shards(piece.shape, piece.values.dtype, piece.order))
        shards.pieces.append((piece.start, piece.end, piece.values))
    return by_name


class Cover(NamedTuple):
    """What one run of a sharded optimizer (zero/optimizer.py: one inner tensor per stretch of a bucket's chunk)
    covers of one parameter: its elements [start, end), the run's [at, at + end - start)."""
    name: str
    shape: tuple[int, ...]
    order: tuple[int, ...]
    start: int
    end: int
    at: int

    def piece(self, run_values: torch.Tensor) -> Piece:
        """The parameter's piece of a tensor over the run (a state tensor of the run's length)."""
        return Piece(self.name, self.shape, self.order, self.start, self.end,
                     run_values[self.at:self.at + self.end - self.start])


# ----------------------------------------------------------------------------------------------------------
# The planners: DCP's default ones, with Shards written and read as their boxes
# ----------------------------------------------------------------------------------------------------------
class ShardSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner (flattening, de-duplication of identical items, the metadata), where a Shards value is
    written as its boxes: one WriteItem of type SHARD per box, its data a view of the rank's own tensor."""

    def create_local_plan(self) -> SavePlan:
        shards = {fqn: value for fqn, value in self.state_dict.items() if isinstance(value, Shards)}
        whole = {fqn: value for fqn, value in self.state_dict.items() if fqn not in shards}
        items = create_default_local_save_plan(whole, self.is_coordinator).items
        self.boxes: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        for fqn, tensor in shards.items():
            properties = TensorProperties(dtype=tensor.dtype, strides=layout_strides(tensor.shape, tensor.order))
            for offsets, sizes, view in tensor.boxes():
                self.boxes[fqn, offsets] = view
                items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(
                                           chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                           properties=properties, size=torch.Size(tensor.shape))))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        view = self.boxes.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        return view if view is not None else super().resolve_data(write_item)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, where a Shards value is read as its boxes: they are the rank's local chunks, which
    create_read_items_for_chunk_list intersects with the chunks on disk, and each read lands in a view of the
    rank's own tensor. (Its set-up leaves out DefaultLoadPlanner's materializing of meta tensors, which would
    replace a Shards value by None.)"""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        shards = {fqn: value for fqn, value in self.state_dict.items() if isinstance(value, Shards)}
        whole = {fqn: value for fqn, value in self.state_dict.items() if fqn not in shards}
        items = create_default_local_load_plan(whole, self.metadata, not self.allow_partial_load).items
        self.boxes: dict[str, list[torch.Tensor]] = {}
        for fqn, tensor in shards.items():
            boxes = tensor.boxes()
            self.boxes[fqn] = [view for _, _, view in boxes]
            chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes, _ in boxes]
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        views = self.boxes.get(read_item.dest_index.fqn)
        if views is None:
            return super().resolve_tensor(read_item)
        return narrowed(views[read_item.dest_index.index], read_item.dest_offsets, read_item.lengths)


# ----------------------------------------------------------------------------------------------------------
# The state dict of one rank: the model, the optimizers, extra
# ----------------------------------------------------------------------------------------------------------
def process_group(sharded: Any) -> dist.ProcessGroup | None:
    """The group that saves and loads together: the shard group, or under hybrid sharding the world (the grid of
    replicas x shards that zero.shard requires). Other syncs are refused in one line."""
    if not isinstance(sharded, GradientSync) and not hasattr(sharded, "held_pieces"):
        raise ValueError(f"zero.checkpoint: {type(sharded).__name__} is not one of zero.shard's stages (0-3); "
                         f"for FSDP2 use torch.distributed.checkpoint with get_state_dict, which reads and writes "
                         f"this format")
    return None if getattr(sharded, "replicas", None) is not None else sharded.comm.group


def model_entries(sharded: Any) -> dict[str, Any]:
    """The "model" part, name by name as in model.state_dict(): a Shards of this rank's pieces where the stage
    keeps the tensor in flat buckets (nothing where it holds none of it), else the whole tensor (buffers, frozen
    parameters, stage 0)."""
    held = sharded.held_pieces() if hasattr(sharded, "held_pieces") else {}
    pieces = shards_by_name(piece for pieces in held.values() for piece in pieces)
    entries = {}
    for name, value in sharded.model.state_dict(keep_vars=True).items():
        if not torch.is_tensor(value):
            raise ValueError(f"zero.checkpoint: the model's state_dict holds {name!r}, a {type(value).__name__} "
                             f"(a module's extra state), which these checkpoints do not carry")
        if name in pieces:
            entries[name] = pieces[name]
        elif name not in held:
            entries[name] = value.detach()
    return entries


@dataclass
class Slot:
    """One parameter's place in one optimizer: its name (the first), the optimizer, its group there, and the
    parameter."""
    name: str
    optimizer: torch.optim.Optimizer
    group: int
    param: torch.Tensor


def slots(sharded: Any, optimizers: list[torch.optim.Optimizer]) -> list[Slot]:
    """Every optimizer's parameters in torch.optim's order (group by group), refusing in one line an optimizer
    that is not over this sharded model's parameters (not built by sharded.optimizer, at stages 1-3) and a
    parameter in two optimizers."""
    names = {id(p): name for name, p in sharded.model.named_parameters()}  # a tied parameter: its first name
    out: list[Slot] = []
    for number, optimizer in enumerate(optimizers):
        layouts = getattr(getattr(sharded, "shards", None), "layouts", None)
        if layouts is not None:
            if optimizer not in layouts:
                raise ValueError(f"zero.checkpoint: optimizer {number} ({type(optimizer).__name__}) was not built by "
                                 f"this sharded model's sharded.optimizer")
            layout = layouts[optimizer]
            params = {index: pid for pid, (_, index) in layout.index.items()}
            by_id = {id(p): p for b in sharded.buckets for p in b.params}
            out += [Slot(names[params[index]], optimizer, g, by_id[params[index]])
                    for g, indices in enumerate(layout.groups) for index in indices]
            continue
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(f"zero.checkpoint: optimizer {number} ({type(optimizer).__name__}) steps a "
                                     f"{tuple(p.shape)} tensor that is not a parameter of the model")
                out.append(Slot(names[id(p)], optimizer, g, p))
    seen: set[str] = set()
    for slot in out:
        if slot.name in seen:
            raise ValueError(f"zero.checkpoint: parameter {slot.name} is in two optimizers")
        seen.add(slot.name)
    return out


def packed_groups(sharded: Any, optimizers: list[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    """Every optimizer's param_groups as torch.optim's state_dict packs them (every setting, then "params"), the
    parameters named, one optimizer after another (get_state_dict's merge)."""
    names: dict[tuple[int, int], list[str]] = {}
    for slot in slots(sharded, optimizers):
        names.setdefault((id(slot.optimizer), slot.group), []).append(slot.name)
    return [{**{key: value for key, value in group.items() if key != "params"},
             "params": names.get((id(optimizer), g), [])}
            for optimizer in optimizers for g, group in enumerate(optimizer.param_groups)]


def run_covers(sharded: Any, optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, Any, list[Cover]]]:
    """A sharded optimizer's runs in its numbering, each with what it covers of the parameters (their first
    names: get_state_dict's)."""
    names = {id(p): name for name, p in sharded.model.named_parameters()}
    for number, run in enumerate(sharded.shards.layouts[optimizer].runs):
        yield number, run, [Cover(names[id(p)], tuple(p.shape), memory_order(p.shape, run.bucket.place[id(p)][1]),
                                  start, end, at)
                            for p, start, end, at in spans(run.bucket.params, run.bucket.offsets, run.start, run.end)]


def optimizer_shards(pieces: dict[str, list[Piece]]) -> dict[str, dict[str, Shards]]:
    """{state key: pieces} as {parameter name: {state key: Shards}}."""
    entries: dict[str, dict[str, Shards]] = {}
    for key, key_pieces in pieces.items():
        for name, shards in shards_by_name(key_pieces).items():
            entries.setdefault(name, {})[key] = shards
    return entries


def optimizer_entries(sharded: Any, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """The "optimizer" part: get_state_dict's layout of this rank's state. A plain optimizer's (stage 0) state as it
    is, under each parameter's name; a sharded one's per run: element-wise tensors (1-D over the run) cut into the
    parameters' pieces (Shards), scalars (step) and the tensors kept whole (Adafactor's row_var and col_var) under
    every parameter the run covers.

    [Note: state kept whole] Adafactor's factored statistics are not one number per element: every rank holding a
    piece of a matrix keeps the whole ``row_var`` and ``col_var``, alike (zero/matrix.py), in torch's shapes. That is
    what FSDP2 holds too (torch 2.15: DTensors of Replicate placement, their global shapes), and get_state_dict gives
    them as whole tensors: each rank that holds one offers it whole, and DCP's de-duplication of identical write
    items writes it once. A load reads it whole on every rank that holds a piece (a few hundred numbers)."""
    state: dict[str, dict[str, Any]] = {}
    for optimizer in optimizers:
        if not hasattr(sharded, "shards"):
            state.update((slot.name, dict(optimizer.state[slot.param])) for slot in slots(sharded, [optimizer])
                         if optimizer.state.get(slot.param))
            continue
        pieces: dict[str, list[Piece]] = {}
        for _, run, covers in run_covers(sharded, optimizer):
            values = optimizer.state.get(run.param)
            for cover in covers if values else []:
                entry = state.setdefault(cover.name, {})
                for key, value in values.items():
                    if torch.is_tensor(value) and value.dim() == 1:  # element-wise: 1-D over the run
                        pieces.setdefault(key, []).append(cover.piece(value))
                        entry[key] = None  # its place in the entry's order of keys, for the Shards below
                    else:  # a scalar, or a tensor kept whole ([Note: state kept whole]): the run's, the same for
                        entry.setdefault(key, value)  # all it covers
        for name, keys in optimizer_shards(pieces).items():
            state[name].update(keys)
    return {"state": state, "param_groups": packed_groups(sharded, optimizers)}


# ----------------------------------------------------------------------------------------------------------
# extra: the caller's structure, through DCP's flattening and back ([Note: extra])
# ----------------------------------------------------------------------------------------------------------
class KeptWhole:
    """A mapping DCP's flattening would not give back as it was (empty, a key that is not a str, not a plain dict):
    kept whole, as one pickled item."""

    def __init__(self, value: Any):
        self.value = value


def encode_extra(value: Any) -> Any:
    """[Note: extra] DCP flattens nested dicts into one key per leaf (each tensor an item of its own, each other
    leaf pickled whole: a tuple, a number, a scheduler's list of rates) and rebuilds them from the paths in its
    metadata, with every key made a str and an empty dict gone. So a plain dict of str keys and a list are opened;
    any other mapping is kept whole (KeptWhole): what load returns equals what was saved, its tensors on the CPU.
    (dcp_to_torch_save shows a KeptWhole as it is: torch.load that file with weights_only=False.)"""
    if type(value) is dict and value and all(type(key) is str for key in value):
        return {key: encode_extra(item) for key, item in value.items()}
    if isinstance(value, Mapping):
        return KeptWhole(value)
    if type(value) is list:
        return [encode_extra(item) for item in value]
    return value


def decode_extra(value: Any) -> Any:
    if isinstance(value, KeptWhole):
        return value.value
    if type(value) is dict:
        return {key: decode_extra(item) for key, item in value.items()}
    if type(value) is list:
        return [decode_extra(item) for item in value]
    return value


# ----------------------------------------------------------------------------------------------------------
# Checks: one line each, the same on every rank ([Note: the same verdict])
# ----------------------------------------------------------------------------------------------------------
def agree(problem: str | None, group: dist.ProcessGroup | None) -> str | None:
    """[Note: the same verdict] Every rank's verdict, one all_gather_object, and the lowest rank's problem for all
    (naming that rank where the others saw none): a folder one rank cannot read (another node's file system)
    stops every rank before any collective of DCP's, where a rank that went on would wait for the one that
    raised. The checks after DCP's first read need no such round: every rank read the same things."""
    verdicts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, problem, group=group)
    first = next((rank for rank, verdict in enumerate(verdicts) if verdict), None)
    if first is None:
        return None
    alone = any(verdict is None for verdict in verdicts)
    return verdicts[first] + (f" (seen by rank {first} of the group, not by every rank)" if alone else "")


def one_line(error: BaseException) -> str:
    """An exception in one line: DCP's CheckpointException (every failed rank's traceback) as its first failure."""
    if isinstance(error, CheckpointException):  # DCP's, with every failed rank's traceback
        failures = list(error.failures.values())
        if failures:
            error = failures[0][0] if isinstance(failures[0], tuple) else failures[0]
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def read_folder(path: str) -> tuple[Metadata | None, str | None]:
    """The checkpoint's metadata, or what makes the folder not one: no folder, no .metadata (torn if data files
    are there), a .metadata that does not unpickle, a data file it names missing or shorter than it says."""
    if not os.path.isdir(path):
        return None, "no such folder" if not os.path.exists(path) else "not a folder"
    if not os.path.isfile(os.path.join(path, ".metadata")):
        if any(name.endswith(".distcp") for name in os.listdir(path)):
            return None, "torn: its .metadata is missing (a save that did not finish?)"
        return None, "not a torch.distributed.checkpoint folder (no .metadata)"
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:  # noqa: BLE001 - any unpickling failure is a torn file
        return None, f"torn: its .metadata cannot be read ({one_line(error)})"
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        return None, "torn: its .metadata is not DCP's Metadata"
    if not isinstance(metadata.planner_data, dict):
        return None, "not a checkpoint of nested state dicts (DCP's flattening left no planner_data)"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return None, f"torn: data file {name} named by its .metadata is missing"
        if os.path.getsize(file) < size:
            return None, f"torn: data file {name} is {os.path.getsize(file)} bytes, its .metadata needs {size}"
    return metadata, None


def listed(names: Iterable[str], most: int = 3) -> str:
    names = sorted(names)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def model_problem(metadata: Metadata, model: nn.Module) -> str | None:
    """Another model: missing or unexpected keys, or another shape."""
    paths = {key: metadata.planner_data.get(key, (key,)) for key in metadata.state_dict_metadata}
    saved = {".".join(map(str, path[1:])): metadata.state_dict_metadata[key]
             for key, path in paths.items() if path[0] == "model"}
    ours = {name: tuple(value.shape) for name, value in model.state_dict(keep_vars=True).items()}
    missing, unexpected = set(ours) - set(saved), set(saved) - set(ours)
    if missing or unexpected:
        return ("another model: " + "; ".join(
            ([f"it lacks {listed(missing)} ({len(missing)} of this model's keys)"] if missing else []) +
            ([f"it holds {listed(unexpected)}, which this model has not"] if unexpected else [])))
    for name, shape in ours.items():
        md = saved[name]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != shape:
            theirs = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
            return f"another model: {name} is {theirs} there, {shape} here"
    return None


def saved_optimizer(metadata: Metadata) -> tuple[dict[str, dict[str, Any]], int, list[str]]:
    """The optimizer part's layout from the metadata alone: {name: {key: storage metadata}}, the number of
    parameter groups, and the paths that fit neither."""
    state: dict[str, dict[str, Any]] = {}
    groups, odd = 0, []
    for key, md in metadata.state_dict_metadata.items():
        path = metadata.planner_data.get(key, (key,))
        if path[0] != "optimizer":
            continue
        if len(path) == 4 and path[1] == "state":
            state.setdefault(path[2], {})[path[3]] = md
        elif len(path) >= 4 and path[1] == "param_groups" and isinstance(path[2], int):
            groups = max(groups, path[2] + 1)
        else:
            odd.append(key)
    return state, groups, odd


def parameter_kinds(slots_: list[Slot]) -> dict[str, dict[str, bool]]:
    """Each parameter's state_kinds by name (the keys its optimizer keeps with its group's settings, and which are
    element-wise), probed once per group and, for Muon and Adafactor, per number of dimensions (Adafactor keeps a
    vector's variance and a matrix's row_var and col_var). A sharded Muon or Adafactor is asked as torch's class."""
    probed: dict[tuple[int, int, int], dict[str, bool]] = {}
    kinds = {}
    for slot in slots_:
        torch_class = getattr(slot.optimizer, "torch_class", type(slot.optimizer))
        dim = max(slot.param.dim(), 1) if torch_class in PROBE_DIMS else 1
        where = (id(slot.optimizer), slot.group, dim)
        if where not in probed:
            settings = {k: v for k, v in slot.optimizer.param_groups[slot.group].items() if k != "params"}
            probed[where] = state_kinds(torch_class, settings, slot.param.device, dim)
        kinds[slot.name] = probed[where]
    return kinds


def optimizer_problem(metadata: Metadata, slots_: list[Slot], kinds: dict[str, dict[str, bool]],
                      group_count: int, sharded_optimizer: bool, stepped: bool = False) -> str | None:
    """An optimizer state of another kind, from the metadata: keys not the ones the optimizer keeps, element-wise
    state of another shape, state of parameters it does not step, another number of parameter groups; at stages
    1-3 also a group with state for some parameters and not others (a run steps a group's parameters together);
    with ``stepped``, a parameter without state."""
    state, groups, odd = saved_optimizer(metadata)
    if not state and not groups:
        return "it holds no optimizer state (saved without an optimizer)"
    if odd:
        return f"its optimizer part holds {listed(odd)}, which is not torch.optim's state layout"
    ours = {slot.name: slot for slot in slots_}
    strangers = set(state) - set(ours)
    if strangers:
        return f"its optimizer state holds {listed(strangers)}, which these optimizers do not step"
    stateless = [slot.name for slot in slots_ if slot.name not in state]
    if stepped and stateless:
        return (f"its optimizer state is incomplete: {listed(stateless)} ({len(stateless)} of {len(slots_)} "
                f"parameters) have none, and the run that saved it had stepped every parameter")
    for slot in slots_:
        saved = state.get(slot.name)
        if saved is None:
            continue
        keeps = kinds[slot.name]
        if set(saved) != set(keeps):
            return (f"an optimizer state of another kind: {slot.name} holds {sorted(saved)}, and "
                    f"torch.optim.{getattr(slot.optimizer, 'torch_class', type(slot.optimizer)).__name__} with "
                    f"these settings keeps {sorted(keeps)}")
        for key, elementwise in keeps.items():
            md = saved[key]
            if elementwise and (not isinstance(md, TensorStorageMetadata)
                                or tuple(md.size) != tuple(slot.param.shape)):
                theirs = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
                return (f"the optimizer state's {key!r} of {slot.name} is {theirs}, the parameter "
                        f"{tuple(slot.param.shape)}")
    if groups != group_count:
        return f"its optimizer state has {groups} parameter groups, these optimizers {group_count}"
    if sharded_optimizer:
        members_of: dict[tuple[int, int], list[str]] = {}
        for slot in slots_:
            members_of.setdefault((id(slot.optimizer), slot.group), []).append(slot.name)
        for members in members_of.values():
            having = [name for name in members if name in state]
            if having and len(having) != len(members):
                lacking = next(name for name in members if name not in state)
                return (f"{having[0]} has optimizer state and {lacking}, in the same parameter group, has none; a "
                        f"sharded optimizer steps a group's parameters together")
    return None


def groups_problem(saved_groups: list[dict[str, Any]], slots_: list[Slot],
                   optimizers: list[torch.optim.Optimizer]) -> tuple[list[int], str | None]:
    """Which saved group each of ours is (by the names of its parameters, as set_state_dict matches them), or the
    group that has none."""
    matched = []
    for optimizer in optimizers:
        for g in range(len(optimizer.param_groups)):
            names = {slot.name for slot in slots_ if slot.optimizer is optimizer and slot.group == g}
            same = [j for j, group in enumerate(saved_groups) if set(group.get("params", [])) == names]
            if not same:
                first = next(iter(sorted(names)), "none")
                return [], (f"another parameter grouping: this optimizer's group {g} ({len(names)} parameters, "
                            f"{first} among them) is none of the checkpoint's groups")
            matched.append(same[0])
    return matched, None


def scalars_problem(small: dict[str, Any], slots_: list[Slot], kinds: dict[str, dict[str, bool]]) -> str | None:
    """At stages 1-3 a run steps a group's parameters together, with one step count: the saved scalars of a
    group's parameters must agree."""
    state = small.get("optimizer", {}).get("state", {})
    first: dict[tuple[int, int], str] = {}
    for slot in slots_:
        entry = state.get(slot.name)
        if not entry:
            continue
        where = (id(slot.optimizer), slot.group)
        if where not in first:
            first[where] = slot.name
            continue
        other = state[first[where]]
        for key, value in entry.items():
            theirs = other.get(key)
            if kinds[slot.name].get(key, True):  # element-wise (a 0-dim parameter's is 0-dim too): not a scalar
                continue
            same = torch.equal(value, theirs) if torch.is_tensor(value) and torch.is_tensor(theirs) else value == theirs
            if not same:
                return (f"in one parameter group, {slot.name}'s {key!r} is {value}, {first[where]}'s {theirs}: a "
                        f"sharded optimizer steps a group's parameters together, with one {key!r}")
    return None


# ----------------------------------------------------------------------------------------------------------
# save and load
# ----------------------------------------------------------------------------------------------------------
def save(path: str | os.PathLike, sharded: Any, optimizer: Any, extra: Any = None) -> None:
    """Write ``sharded``'s model and ``optimizer``'s state (as_optimizers: one, several, or None) to the folder
    ``path`` in DCP's format (module docstring), each rank its own shards; ``extra`` (any picklable structure of
    Python values and tensors) as the group's rank 0 has it ([Note: extra]). Every rank of the group calls it (under
    hybrid sharding, every rank of the world). An optimizer that has not stepped is saved without state, as its
    state_dict() is (get_state_dict would step it once at lr 0 first, and FSDP2's strict set_state_dict refuses a
    checkpoint without state).

    [Note: no tensor collective in save] Nothing is gathered: the pieces are views of what the rank holds, and DCP's
    planning exchanges objects (each rank's plan, then the written files' list) over the group. Stage 3's prefetch
    of the next forward's units, if in flight, is left as it is."""
    path = os.fspath(path)
    group = process_group(sharded)
    optimizers = as_optimizers(optimizer)
    state = {"model": model_entries(sharded)}
    if optimizers:
        state["optimizer"] = optimizer_entries(sharded, optimizers)
    if extra is not None and dist.get_rank(group) == 0:  # DCP's coordinator; the others' are not written
        state["extra"] = encode_extra(extra)
    problem = None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        problem = f"cannot write checkpoint {path}: {one_line(error)}"
    problem = agree(problem, group)
    if problem:
        raise CheckpointError(f"zero.checkpoint.save: {problem}")
    try:
        dcp.save(state, storage_writer=FileSystemWriter(path), planner=ShardSavePlanner(), process_group=group)
    except CheckpointException as error:
        raise CheckpointError(f"zero.checkpoint.save: checkpoint {path}: {one_line(error)}") from None


def load(path: str | os.PathLike, sharded: Any, optimizer: Any, stepped: bool = False) -> Any:
    """Read a checkpoint of this format (ours from any stage 0-3, world size and replicate_group, or FSDP2's) into
    ``sharded``'s model and ``optimizer``'s state (as_optimizers: one, several, or None: the model alone), every rank
    only what its shards overlap; return the saved extra (None if absent). Every rank of the group calls it. After it
    the model is ready to train: stages 1-2 gather the weights whole again, stage 3 holds no unit gathered before,
    and the optimizer has the checkpoint's state and hyperparameters (as torch.optim's load_state_dict restores them),
    whether or not it had stepped. ``stepped``: the caller knows that the saved optimizers had stepped every
    parameter (a trainer, from its position), so a parameter without state is refused too (a checkpoint cut short
    of its state), where by default it is taken as not stepped yet.

    [Note: two reads] The checks that need only the metadata run first, on every rank, and their verdict is
    agreed; then DCP reads the small things (param_groups, step counts, extra), which the parameter groups and
    the step counts are checked against; only then the shards, in place. So a refused checkpoint has changed
    nothing; a read that fails after that (a data file corrupt inside) leaves a partly loaded model."""
    path = os.fspath(path)
    group = process_group(sharded)
    optimizers = as_optimizers(optimizer)
    slots_ = slots(sharded, optimizers)
    sharded_optimizer = hasattr(sharded, "shards")
    kinds = parameter_kinds(slots_)
    group_count = sum(len(o.param_groups) for o in optimizers)
    metadata, problem = read_folder(path)
    if metadata is not None:
        problem = model_problem(metadata, sharded.model)
        if problem is None and optimizers:
            problem = optimizer_problem(metadata, slots_, kinds, group_count, sharded_optimizer, stepped)
    problem = agree(f"checkpoint {path}: {problem}" if problem else None, group)
    if problem:
        raise CheckpointError(f"zero.checkpoint.load: {problem}")

    def read(state: dict[str, Any]) -> None:
        try:
            dcp.load(state, storage_reader=FileSystemReader(path), planner=ShardLoadPlanner(), process_group=group)
        except CheckpointException as error:
            raise CheckpointError(f"zero.checkpoint.load: checkpoint {path} cannot be read: {one_line(error)}") \
                from None

    small = small_entries(metadata, with_optimizer=bool(optimizers))
    if small:  # the same on every rank: built from the same metadata
        read(small)
    matched, problem = groups_problem(small.get("optimizer", {}).get("param_groups", []), slots_, optimizers)
    if problem is None and sharded_optimizer:
        problem = scalars_problem(small, slots_, kinds)
    if problem:  # the same on every rank: every rank read the same small things
        raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: {problem}")

    if hasattr(sharded, "drop_gathered"):
        sharded.drop_gathered()  # stage 3: free what is gathered before reading (the shards change under it)
    scalars = small.get("optimizer", {}).get("state", {})
    layout = saved_optimizer(metadata)[0]
    installs, state_entries = [], {}
    for optimizer_ in optimizers:
        optimizer_.state.clear()  # the old state goes before the new is allocated
        install, entries = (sharded_destinations if sharded_optimizer else plain_destinations)(
            sharded, optimizer_, layout, scalars, kinds)
        installs.append((optimizer_, install))
        state_entries.update(entries)
    read({"model": model_entries(sharded), "optimizer": {"state": state_entries}})
    if hasattr(sharded, "shards_loaded"):
        sharded.shards_loaded()
    saved_groups = small.get("optimizer", {}).get("param_groups", [])
    position = 0
    for optimizer_, install in installs:
        groups = [saved_groups[j] for j in matched[position:position + len(optimizer_.param_groups)]]
        position += len(optimizer_.param_groups)
        install(groups)
    return decode_extra(small["extra"]) if "extra" in small else None


def small_entries(metadata: Metadata, with_optimizer: bool) -> dict[str, Any]:
    """The first read's state dict, rebuilt from the metadata's paths (as dcp_to_torch_save rebuilds all of it):
    extra, and the optimizer's param_groups and scalars (every 0-dim tensor and pickled value of its state)."""
    small: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        path = metadata.planner_data.get(key, (key,))
        tensor = isinstance(md, TensorStorageMetadata)
        if path[0] == "extra" or (with_optimizer and path[0] == "optimizer" and (not tensor or len(md.size) == 0)):
            set_element(small, path, torch.empty(md.size, dtype=md.properties.dtype) if tensor else None)
    return small


def read_extra(path: str | os.PathLike) -> Any:
    """The saved extra alone (None if absent), read by this process alone, with no collective: what a caller looks
    at (its position, its configuration) before it decides to load. A folder that is not a checkpoint or is torn is
    refused in one line naming it (CheckpointError), as load refuses it."""
    return read_whole(path, ("extra",), alone=True).get("extra")


def read_whole(path: str | os.PathLike, parts: Iterable[str] = ("model", "optimizer", "extra"),
               group: dist.ProcessGroup | None = None, alone: bool = False) -> dict[str, Any]:
    """The saved state dict's ``parts`` ("model", "optimizer", "extra"), each tensor whole, in its global shape, on
    the CPU: {"model": {name: tensor}, "optimizer": {"state": {name: {key: value}}, "param_groups": [...]},
    "extra": ...}, what dcp_to_torch_save would write (the parts the checkpoint lacks are left out). For programs
    that hold the whole model on every rank anyway (DDP, ZeroRedundancyOptimizer, a sampler), so every tensor of
    those parts is read by every rank. Every rank of ``group`` calls it, and a folder one of them cannot read is
    refused on all alike ([Note: the same verdict]); ``alone``: this process alone, with no collective (no process
    group needed)."""
    path, parts = os.fspath(path), tuple(parts)
    metadata, problem = read_folder(path)
    if not alone:
        problem = agree(f"checkpoint {path}: {problem}" if problem else None, group)
    elif problem:
        problem = f"checkpoint {path}: {problem}"
    if problem:
        raise CheckpointError(f"zero.checkpoint.read_whole: {problem}")
    state: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        where = metadata.planner_data.get(key, (key,))
        if where[0] in parts:
            tensor = isinstance(md, TensorStorageMetadata)
            set_element(state, where, torch.empty(md.size, dtype=md.properties.dtype) if tensor else None)
    if state:
        try:
            with warnings.catch_warnings():  # dcp.load warns that it reads in one process: what alone asks for
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, storage_reader=FileSystemReader(path), planner=DefaultLoadPlanner(),
                         process_group=group, no_dist=alone)
        except CheckpointException as error:
            raise CheckpointError(f"zero.checkpoint.read_whole: checkpoint {path} cannot be read: "
                                  f"{one_line(error)}") from None
    if "extra" in state:
        state["extra"] = decode_extra(state["extra"])
    return state


def sharded_destinations(sharded: Any, optimizer: torch.optim.Optimizer, layout: dict[str, dict[str, Any]],
                         scalars: dict[str, dict[str, Any]], kinds: dict[str, dict[str, bool]]):
    """Stages 1-3: for each run whose parameters have state in the checkpoint (``layout``: saved_optimizer's), a
    new tensor per element-wise key (the run's length and dtype), cut into the parameters' pieces to read into; a
    new tensor of the saved shape per key kept whole ([Note: state kept whole]: a piece of a matrix, the only
    run of its parameter on this rank), read whole; the scalars from the first read (``scalars``). Returns
    (install(groups), what to read), where install loads the runs' state and the groups' settings through
    torch.optim's load_state_dict."""
    runs = sharded.shards.layouts[optimizer].runs
    runs_state: dict[int, dict[str, Any]] = {}
    pieces: dict[str, list[Piece]] = {}
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for number, run, covers in run_covers(sharded, optimizer):
        name = covers[0].name  # a group's parameters all have state or none (optimizer_problem), one scalar each
        if name not in layout:
            continue
        state: dict[str, Any] = {}
        for key, md in layout[name].items():
            if kinds[name][key]:
                state[key] = torch.empty(run.end - run.start, dtype=run.param.dtype, device=run.param.device)
                pieces.setdefault(key, []).extend(cover.piece(state[key]) for cover in covers)
            elif isinstance(md, TensorStorageMetadata) and len(md.size):
                state[key] = whole.setdefault(name, {})[key] = torch.empty(md.size, dtype=md.properties.dtype)
            else:  # the first read's tensor, the run's own (no two runs begin with one parameter)
                state[key] = scalars[name][key]
        runs_state[number] = state

    def install(groups: list[dict[str, Any]]) -> None:
        inner_groups = [{**{k: v for k, v in saved_group.items() if k != "params"},
                         "params": [n for n, run in enumerate(runs) if run.group == g]}
                        for g, saved_group in enumerate(groups)]
        sharded.shards.load_run_state(optimizer, {"state": runs_state, "param_groups": inner_groups})
    entries = optimizer_shards(pieces)
    for name, keys in whole.items():
        entries.setdefault(name, {}).update(keys)
    return install, entries


def plain_destinations(sharded: Any, optimizer: torch.optim.Optimizer, layout: dict[str, dict[str, Any]],
                       scalars: dict[str, dict[str, Any]], kinds: dict[str, dict[str, bool]]):
    """Stage 0's plain optimizer: each parameter's state tensors whole (element-wise, and those kept whole:
    Adafactor's row_var and col_var), read into new tensors (torch.optim's load then casts and places them as the
    parameter is); the scalars from the first read."""
    state: dict[int, dict[str, Any]] = {}
    entries: dict[str, dict[str, Any]] = {}
    for index, slot in enumerate(slots(sharded, [optimizer])):
        if slot.name not in layout:
            continue
        state[index] = {}
        for key, md in layout[slot.name].items():
            if isinstance(md, TensorStorageMetadata) and len(md.size):
                tensor = torch.empty(md.size, dtype=md.properties.dtype)
                state[index][key] = entries.setdefault(slot.name, {})[key] = tensor
            else:
                state[index][key] = scalars[slot.name][key]

    def install(groups: list[dict[str, Any]]) -> None:
        numbered, count = [], 0
        for group in optimizer.param_groups:
            numbered.append(list(range(count, count + len(group["params"]))))
            count += len(group["params"])
        optimizer.load_state_dict({"state": state, "param_groups": [
            {**{k: v for k, v in saved_group.items() if k != "params"}, "params": indices}
            for saved_group, indices in zip(groups, numbered)]})
    return install, entries

