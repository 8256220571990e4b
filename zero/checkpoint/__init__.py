"""Sharded checkpoints of zero.shard's stages in torch.distributed.checkpoint's (DCP's) format: every rank writes its
own shards and reads only what its shards overlap, and FSDP2 reads ours as we read FSDP2's.

    zero.checkpoint.save(path, sharded, optimizer, extra=None)   # every rank; optimizer: one, several, None
    extra = zero.checkpoint.load(path, sharded, optimizer)        # every rank; any stage 0-3, W, replicate_group
    extra = zero.checkpoint.read_extra(path)                      # one process: the extra alone, before a load
    whole = zero.checkpoint.read_whole(path, ("model",))          # whole tensors: for programs that keep them whole
    writer = zero.checkpoint.AsyncWriter()                        # saves in the background (background.py):
    future = zero.checkpoint.save(path, sharded, optimizer, extra, writer=writer)  # returns once staged
    writer.wait()                                                 # written (or its error, in one line)

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

The chunk arithmetic ([Note: boxes], zero/pieces.py). A rank's shard of a stage-1-3 bucket is a contiguous range of
a flat buffer that crosses parameters; inside each parameter it is a contiguous range [start, end) of the
parameter's elements in its memory order (zero/buckets.py's gradient_view: a channels-last weight is laid out by its
strides). DCP describes a rank's part of a tensor as n-D boxes (ChunkStorageMetadata: offsets, sizes), so each range
is written as the boxes it covers: ``range_boxes`` cuts a range of a row-major shape into at most 2(n-1)+1 boxes,
each one contiguous in memory (a view of the shard, no copy), none empty, none overlapping; ``layout_boxes`` does it
in a permuted layout's memory order and maps the boxes back to the tensor's own dimensions. On load the same boxes
are the rank's local chunks, and DCP's ``create_read_items_for_chunk_list`` intersects them with the boxes on disk,
whatever world size, stage or FSDP2 wrote them.

What each rank holds is said by the sync itself, through the methods of ``Checkpointable``
(zero/checkpoint/state_dict.py), never read from its internals: ``held_pieces()`` (per parameter kept in a flat
bucket, its range and a 1-D view of the masters: zero/pieces.py's ``flat_pieces``) and, for each optimizer,
``optimizer_view(optimizer)`` (its parameters in torch.optim's numbering and, at stages 1-3, its runs:
zero/optimizer.py, one inner tensor per run of a bucket's chunk, each run's ``covers`` cutting its state into the
same per-parameter ranges; Muon's and Adafactor's runs are pieces of one parameter each, zero/matrix.py). Whatever
no stage shards (frozen parameters, stage 0's whole model and plain optimizer, Adafactor's factored statistics:
[Note: state kept whole]) is a whole tensor on every rank that holds it: each offers it and DCP's de-duplication of
identical write items keeps one copy, as it does for the replicas of hybrid sharding, whose equal shards give equal
boxes. Buffers are rank 0's alone ([Note: one definition of a buffer]: each rank's running statistics may differ).

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
DCP checkpoint, torn (its .metadata or a data file it names missing or short), corrupt (bytes flipped inside a data
file: each item DCP writes is a torch.save archive whose records carry CRC32s, checked before anything is read,
[Note: the checksums are torch's own] in zero/checkpoint/checksums.py; a last.pt's records too), another model
(missing or unexpected keys, another shape), an optimizer state of another kind or other parameter groups. The
disk's errors during a save (a full disk, a quota, a read-only or unwritable folder) are raised as DiskError ("cannot
save checkpoint PATH: no space left on device") on every rank alike (zero/checkpoint/disk.py). [Note: the same
verdict] says how no rank is left in a collective another has left. A save writes into its folder in place, the
.metadata last (DCP's coordinator, after every rank's data): one cut short leaves a torn folder, which load
refuses; save each checkpoint to a fresh folder and rename it, for one that is always whole.

Two readers serve what is not a zero.shard stage. ``read_extra`` reads the extra alone, in this process (no
collective): a trainer looks at its position and configuration before it decides to load. ``read_whole`` reads
parts of the state dict whole, every tensor in its global shape (what ``dcp_to_torch_save`` gives, in memory), for
programs that keep the whole model on every rank anyway (DDP, ZeroRedundancyOptimizer, a sampler), by every rank
of a group together or by one process alone.

Where each part is (DCP's own split): zero/checkpoint/api.py (save, load, read_extra, read_whole),
zero/checkpoint/background.py (AsyncWriter: the staging buffers and the writer thread), zero/checkpoint/state_dict.py
(the state dict of one rank: what the sync holds, in get_state_dict's layout; the places a load reads into; extra),
zero/checkpoint/planner.py (DCP's default planners, with pieces written and read as boxes), zero/checkpoint/checks.py
(every refusal, in one line, the same on every rank), zero/checkpoint/checksums.py (the CRC32s checked before a read),
zero/checkpoint/disk.py (the disk's errors of a save, named), zero/checkpoint/whole.py (one file of the whole state
dicts), zero/checkpoint/held.py (what one rank holds, as it holds it, for a peer of the same layout: a replica group's
live state), zero/checkpoint/methods.py (the checkpoint methods every sync offers, ``Checkpoints``, and a whole-tensor
sync's, ``WholeCheckpoints``); the piece arithmetic without DCP is zero/pieces.py's. DCP's flattening and its inverse
come from its private modules (``_nested_dict.flatten_state_dict``, ``_traverse.set_element``): the ones DCP's own
planners and ``dcp_to_torch_save`` use, so the keys and the rebuilt structure are DCP's by construction.

Everything used from outside zero/ is a name of this module (nothing outside imports its files), imported at its first
use (``__getattr__``, as zero's own): the stages inherit ``WholeCheckpoints`` without torch.distributed.checkpoint's
half a second of start-up.
"""
from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
EXPORTS = {
    "save": "zero.checkpoint.api", "load": "zero.checkpoint.api", "read_extra": "zero.checkpoint.api",
    "read_whole": "zero.checkpoint.api",
    "save_file": "zero.checkpoint.whole", "load_file": "zero.checkpoint.whole", "read_file": "zero.checkpoint.whole",
    "load_any": "zero.checkpoint.whole", "write_file": "zero.checkpoint.whole", "read_shared": "zero.checkpoint.whole",
    "load_model": "zero.checkpoint.whole", "load_optimizer": "zero.checkpoint.whole",
    "check_complete": "zero.checkpoint.whole", "KEYS": "zero.checkpoint.whole",
    "Checkpoints": "zero.checkpoint.methods", "WholeCheckpoints": "zero.checkpoint.methods",
    "AsyncWriter": "zero.checkpoint.background", "StagingBuffers": "zero.checkpoint.background",
    "CheckpointError": "zero.checkpoint.checks", "agree": "zero.checkpoint.checks",
    "read_folder": "zero.checkpoint.checks",
    "file_problem": "zero.checkpoint.checksums", "verify": "zero.checkpoint.checksums",
    "Writer": "zero.checkpoint.disk", "disk_problem": "zero.checkpoint.disk",
    "Checkpointable": "zero.checkpoint.state_dict", "encode_extra": "zero.checkpoint.state_dict",
    "model_entries": "zero.checkpoint.state_dict", "optimizer_entries": "zero.checkpoint.state_dict",
    "ShardSavePlanner": "zero.checkpoint.planner", "ShardLoadPlanner": "zero.checkpoint.planner",
    "held_state": "zero.checkpoint.held", "load_held_state": "zero.checkpoint.held",
    "Piece": "zero.pieces", "Shards": "zero.pieces", "flat_pieces": "zero.pieces", "layout_boxes": "zero.pieces",
    "memory_order": "zero.pieces", "range_boxes": "zero.pieces",
}

__all__ = list(EXPORTS)


def __getattr__(name: str) -> Any:
    """``zero.checkpoint.NAME``, imported at its first use."""
    if name in EXPORTS:
        return getattr(importlib.import_module(EXPORTS[name]), name)
    raise AttributeError(f"module 'zero.checkpoint' has no attribute {name!r}")
