"""What a rank holds of each tensor, in the tensors' own terms: the piece arithmetic between the stages' flat
buckets and the parameters they cut across, with no checkpoint format in it (zero/checkpoint/ writes and reads these
pieces in torch.distributed.checkpoint's).

A rank's shard of a stage-1-3 bucket is a contiguous range of a flat buffer that crosses parameters; inside each
parameter it is a contiguous range [start, end) of the parameter's elements in its memory order
(zero.buckets.gradient_view: a channels-last weight is laid out by its strides).

- ``covers(bucket, lo, hi)``: the parameters a range of a flat covers, each a Cover (its elements [start, end), at
  the range's element ``at``). The one translation from flat runs to parameters: the stages' pieces
  (``flat_pieces``), the sharded optimizer's runs (zero/optimizer_state.py's ShardRun.covers) and their checkpoints all
  go through it.
- ``Piece``: what a rank holds of one tensor of the model's state, a 1-D view of the rank's own memory over a range
  of the tensor's memory order; ``Shards``: every piece of one tensor on this rank, as n-D boxes.
- ``range_boxes``, ``layout_boxes``: a range of a tensor's memory order as the n-D boxes it covers ([Note: boxes]),
  which is how torch.distributed.checkpoint describes a rank's part of a tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, NamedTuple

import torch
import torch.nn as nn

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes), one per dimension


# ----------------------------------------------------------------------------------------------------------
# Layouts and boxes ([Note: boxes])
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
# From flat ranges to parameters
# ----------------------------------------------------------------------------------------------------------
@dataclass
class Piece:
    """What a rank holds of one tensor of the model's state: the elements [start, end) of its memory order
    (``order``, memory_order), as ``values``, a 1-D view of the rank's own tensor (the masters' shard). [Note: stored
    pieces] ``source``: the slot of an offload store (zero/offload/) that holds the values; ``values`` is then a
    meta tensor, whose storage offset is its first element's place in the slot."""
    name: str
    shape: tuple[int, ...]
    order: tuple[int, ...]
    start: int
    end: int
    values: torch.Tensor
    source: Hashable | None = None


@dataclass(frozen=True)
class StoredBox:
    """A box of a stored piece ([Note: stored pieces]): elements [first, first + count) of the slot ``source``, seen
    in the box's shape (``sizes`` in memory order, then ``inverse``, the permutation back to the tensor's own
    dimensions). zero/offload/slots.py reads and writes it."""
    source: Hashable
    first: int
    count: int
    dtype: torch.dtype
    sizes: tuple[int, ...]
    inverse: tuple[int, ...]

    def view(self, run: torch.Tensor) -> torch.Tensor:
        """``run`` (its ``count`` elements) in the box's shape."""
        return run.view(self.sizes).permute(self.inverse)


class Cover(NamedTuple):
    """What a range of a bucket's flat covers of one parameter: the parameter's elements [start, end) of its memory
    order (``order``), which are the range's elements [at, at + end - start)."""
    param: nn.Parameter
    order: tuple[int, ...]
    start: int
    end: int
    at: int

    def piece(self, name: str, range_values: torch.Tensor, source: Hashable | None = None) -> Piece:
        """The parameter's piece (under ``name``) of a 1-D tensor over the range: a shard, a run's state tensor (a
        meta one, with the store's slot that holds it: [Note: stored pieces])."""
        return Piece(name, tuple(self.param.shape), self.order, self.start, self.end,
                     range_values[self.at:self.at + self.end - self.start], source)


def covers(bucket: Any, lo: int, hi: int) -> list[Cover]:
    """The parameters of ``bucket`` (zero.buckets.Bucket: each parameter at its offset, laid out by its strides) that
    its flat's elements [lo, hi) cover, in the flat's order, none empty."""
    found = []
    for p, offset in zip(bucket.params, bucket.offsets):
        first, last = max(lo, offset), min(hi, offset + p.numel())
        if first < last:
            order = memory_order(p.shape, bucket.place[id(p)][1])
            found.append(Cover(p, order, first - offset, last - offset, first - lo))
    return found


def all_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of every parameter (a tied one has several), by id."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def flat_pieces(model: nn.Module, buckets: list[Any], shards: list[torch.Tensor], rank: int,
                sources: list[Hashable | None] | None = None) -> dict[str, list[Piece]]:
    """Every name of every parameter in the buckets (a tied one under each), with its pieces in this rank's chunks
    (``shards[b]``, the r-th of W equal slices of bucket b's flat): none where the rank holds none of it. The
    stages' ``held_pieces``. ``sources``: each shard's slot in an offload store, where it is kept there (its
    ``shards[b]`` a meta placeholder: [Note: stored pieces])."""
    names = all_names(model)
    pieces: dict[str, list[Piece]] = {name: [] for bucket in buckets for p in bucket.params for name in names[id(p)]}
    for b, (bucket, shard) in enumerate(zip(buckets, shards)):
        lo = rank * shard.numel()
        for cover in covers(bucket, lo, lo + shard.numel()):
            for name in names[id(cover.param)]:
                pieces[name].append(cover.piece(name, shard, sources[b] if sources else None))
    return pieces


@dataclass
class Shards:
    """A tensor that this rank holds pieces of: its global shape, dtype and memory order, and the pieces (start,
    end, 1-D view) of its memory order; ``sources``: a stored piece's slot, by the piece's index ([Note: stored
    pieces])."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    order: tuple[int, ...]
    pieces: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    sources: dict[int, Hashable] = field(default_factory=dict)

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor | StoredBox]]:
        """(offsets, sizes, view) of every box of every piece: the view aliases the piece, in the box's shape, on a
        storage of exactly its bytes ([Note: no copy in save]); a stored piece's box is a StoredBox instead."""
        inverse = tuple(self.order.index(d) for d in range(len(self.shape)))
        out: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor | StoredBox]] = []
        for i, (start, end, values) in enumerate(self.pieces):
            at = 0
            for offsets, sizes in layout_boxes(self.shape, self.order, start, end):
                count = math.prod(sizes)
                in_order = tuple(sizes[d] for d in self.order)
                if i in self.sources:
                    box: torch.Tensor | StoredBox = StoredBox(self.sources[i], values.storage_offset() + at, count,
                                                             self.dtype, in_order, inverse)
                else:
                    box = exact_storage(values[at:at + count]).view(in_order).permute(inverse)
                out.append((offsets, sizes, box))
                at += count
        return out


def shards_by_name(pieces: Iterable[Piece]) -> dict[str, Shards]:
    """Pieces, as the Shards of each name."""
    by_name: dict[str, Shards] = {}
    for piece in pieces:
        shards = by_name.setdefault(piece.name, Shards(piece.shape, piece.values.dtype, piece.order))
        if piece.source is not None:
            shards.sources[len(shards.pieces)] = piece.source
        shards.pieces.append((piece.start, piece.end, piece.values))
    return by_name


@dataclass
class OptimizerView:
    """What a rank holds of one optimizer, as its checkpoint needs to know it (every sync's ``optimizer_view``): the
    torch.optim class whose state it keeps; the model's parameters in torch.optim's numbering, each with its group
    ((group, parameter), group by group); and for an optimizer over runs of flat shards (zero/optimizer.py), its
    runs: each a tensor of the inner optimizer (``param``, whose state it keeps, 1-D) and what it ``covers`` of the
    parameters. ``runs`` is None for an optimizer of whole parameters (stage 0), whose state is per parameter, in
    ``state`` (default: the optimizer's own; ZeroRedundancyOptimizer keeps its parameters' in its local optimizer's).
    """
    torch_class: type[torch.optim.Optimizer]
    parameters: list[tuple[int, nn.Parameter]]
    runs: list[Any] | None = None
    state: Any = None
    stored: Any = None  # offload: the runs' element-wise state in the store (zero/offload/shards.py's StoredState)


def whole_optimizer_view(model: nn.Module, optimizer: torch.optim.Optimizer,
                         torch_class: type[torch.optim.Optimizer] | None = None, state: Any = None) -> OptimizerView:
    """The view of an optimizer over whole parameters of ``model`` (stage 0, DDP, FSDP2): its parameters group by
    group, of class ``torch_class`` (default: its own), its state in ``state`` (default: its own); a tensor that is
    not one of the model's parameters is refused in one line."""
    owned = {id(p) for p in model.parameters()}
    parameters = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in owned:
                raise ValueError(f"zero.checkpoint: this {type(optimizer).__name__} steps a {tuple(p.shape)} tensor "
                                 f"that is not a parameter of the model")
            parameters.append((g, p))
    return OptimizerView(torch_class or type(optimizer), parameters, state=state)
