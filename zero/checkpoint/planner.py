"""DCP's default planners, with a rank's pieces of a tensor (zero/pieces.py's Shards) written and read as their n-D
boxes. The calls, in order (torch.distributed.checkpoint's protocol): ``set_up_planner`` with this rank's state
dict; ``create_local_plan`` (every rank: what it writes or reads); the coordinator's global plan (DCP's default:
de-duplication of identical write items, the metadata); then ``resolve_data`` per item written, or
``resolve_tensor`` per item read, which hand DCP a view of the rank's own memory: nothing is copied or gathered.
A box of a stored piece (an offloaded stage's: [Note: stored pieces] in zero/pieces.py) is read or written through
``slots``, zero/offload/slots.py's window on the store.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's own flattening
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                           create_default_local_load_plan,
                                                           create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from zero.pieces import Shards, StoredBox, layout_strides, narrowed

# DCP records a saved tensor's layout (TensorProperties.strides) in the torch this repository pins; the torch 2.11
# of the lent GPU machines has no such field, and its readers need none.
RECORDS_STRIDES = "strides" in {field.name for field in dataclasses.fields(TensorProperties)}


class ShardSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner (flattening, de-duplication of identical items, the metadata), where a Shards value is
    written as its boxes: one WriteItem of type SHARD per box, its data a view of the rank's own tensor (or, for a
    stored piece, its values read through ``slots``)."""

    def __init__(self, slots: Any = None):
        super().__init__()
        self.slots = slots

    def create_local_plan(self) -> SavePlan:
        shards = {fqn: value for fqn, value in self.state_dict.items() if isinstance(value, Shards)}
        whole = {fqn: value for fqn, value in self.state_dict.items() if fqn not in shards}
        items = create_default_local_save_plan(whole, self.is_coordinator).items
        self.boxes: dict[tuple[str, tuple[int, ...]], torch.Tensor | StoredBox] = {}
        for fqn, tensor in shards.items():
            layout = {"strides": layout_strides(tensor.shape, tensor.order)} if RECORDS_STRIDES else {}
            properties = TensorProperties(dtype=tensor.dtype, **layout)
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
        if isinstance(view, StoredBox):
            return self.slots.read_box(view)
        return view if view is not None else super().resolve_data(write_item)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, where a Shards value is read as its boxes: they are the rank's local chunks, which
    create_read_items_for_chunk_list intersects with the chunks on disk, and each read lands in a view of the
    rank's own tensor (or of a stored piece's slot, through ``slots``). (Its set-up leaves out DefaultLoadPlanner's
    materializing of meta tensors, which would replace a Shards value by None.)"""

    def __init__(self, slots: Any = None):
        super().__init__()
        self.slots = slots

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        shards = {fqn: value for fqn, value in self.state_dict.items() if isinstance(value, Shards)}
        whole = {fqn: value for fqn, value in self.state_dict.items() if fqn not in shards}
        items = create_default_local_load_plan(whole, self.metadata, not self.allow_partial_load).items
        self.boxes: dict[str, list[torch.Tensor | StoredBox]] = {}
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
        view = views[read_item.dest_index.index]
        if isinstance(view, StoredBox):
            view = self.slots.write_box(view)
        return narrowed(view, read_item.dest_offsets, read_item.lengths)
