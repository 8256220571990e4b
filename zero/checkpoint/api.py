"""zero.checkpoint's entries: ``save`` and ``load`` (every rank of the group: each its own pieces, in
torch.distributed.checkpoint's format), ``read_extra`` and ``read_whole`` (whole tensors, for programs that keep
them whole). What is written is zero/checkpoint/state_dict.py's; the checks are zero/checkpoint/checks.py's; the
planners that write and read pieces as boxes are zero/checkpoint/planner.py's.
"""
from __future__ import annotations

import os
import warnings
from concurrent.futures import Future
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # DCP's own rebuilding (dcp_to_torch_save's)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from utils import one_line
from zero.checkpoint.background import AsyncWriter
from zero.checkpoint.checksums import folder_problem
from zero.checkpoint.disk import DiskError, Writer, disk_problem
from zero.checkpoint.checks import (CheckpointError, agree, groups_problem, model_problem, optimizer_problem,
                                    parameter_kinds, read_folder, saved_optimizer, scalars_problem)
from zero.checkpoint.planner import ShardLoadPlanner, ShardSavePlanner
from zero.checkpoint.state_dict import (Checkpointable, decode_extra, encode_extra, model_entries, optimizer_entries,
                                        plain_destinations, sharded_destinations, slots, small_entries)
from zero.offload.slots import SlotCache
from zero.optimizer_kinds import as_optimizers


def checkpoint_group(sync: Any) -> dist.ProcessGroup | None:
    """The sync's group that saves and loads together; a sync that does not say what it holds is refused in one
    line."""
    if not isinstance(sync, Checkpointable):
        raise ValueError(f"zero.checkpoint: {type(sync).__name__} is not one of zero.shard's stages (0-3); for "
                         f"FSDP2 use torch.distributed.checkpoint with get_state_dict, which reads and writes this "
                         f"format")
    return sync.checkpoint_group()


def save(path: str | os.PathLike, sync: Any, optimizer: Any, extra: Any = None,
         writer: AsyncWriter | None = None) -> Future | None:
    """Write ``sync``'s model and ``optimizer``'s state (as_optimizers: one, several, or None) to the folder
    ``path`` in DCP's format (module docstring), each rank its own shards; ``extra`` (any picklable structure of
    Python values and tensors) as the group's rank 0 has it ([Note: extra]). Every rank of the group calls it (under
    hybrid sharding, every rank of the world). An optimizer that has not stepped is saved without state, as its
    state_dict() is (get_state_dict would step it once at lr 0 first, and FSDP2's strict set_state_dict refuses a
    checkpoint without state). With ``writer`` (an AsyncWriter: zero/checkpoint/background.py) it returns once this
    rank's state is copied, with the write's future; the folder is whole once every rank's future is done.

    [Note: no tensor collective in save] Nothing is gathered: the pieces are views of what the rank holds, and DCP's
    planning exchanges objects (each rank's plan, then the written files' list) over the group. Stage 3's prefetch
    of the next forward's units, if in flight, is left as it is."""
    path = os.fspath(path)
    group = checkpoint_group(sync)
    optimizers = as_optimizers(optimizer)
    store = getattr(sync, "store", None)  # offload: the stored pieces stream through a SlotCache
    if store is not None and writer is not None:
        raise CheckpointError(f"zero.checkpoint.save: checkpoint {path}: a save in the background stages the whole "
                              f"state in memory first, which offload keeps on the disk: save in the foreground")
    sync.shards_saving()
    state = {"model": model_entries(sync, saving=True)}
    if optimizers:
        state["optimizer"] = optimizer_entries(sync, optimizers)
    if extra is not None and dist.get_rank(group) == 0:  # DCP's coordinator; the others' are not written
        state["extra"] = encode_extra(extra)
    problem = None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        problem = disk_problem(error) or one_line(error)
    problem = agree(problem, group)
    if problem:
        raise DiskError(path, problem)
    if writer is None:
        write_folder(path, state, group, SlotCache(store) if store is not None else None)
        return None
    staged = writer.stage(state)
    writer_group = writer.writer_group(group)
    return writer.write(lambda: write_folder(path, staged, writer_group))


def write_folder(path: str, state: dict[str, Any], group: dist.ProcessGroup | None, window: Any = None) -> None:
    """One rank's state dict (model_entries' and optimizer_entries' form) into the folder, DCP's planning over
    ``group``; the disk's errors (a full disk, a read-only folder) named as such, on every rank
    (zero/checkpoint/disk.py). ``window``: the stored pieces' window on the offload store (zero/offload/slots.py),
    read one box at a time (DCP's serial loader: [Note: a save's boxes])."""
    storage = Writer(path, per_thread_copy_ahead=0) if window is not None else Writer(path)
    try:
        dcp.save(state, storage_writer=storage, planner=ShardSavePlanner(window), process_group=group)
    except CheckpointException as error:
        disk = disk_problem(error)
        if disk:
            raise DiskError(path, disk) from None
        raise CheckpointError(f"zero.checkpoint.save: checkpoint {path}: {one_line(error)}") from None
    finally:
        if window is not None:
            window.close()


def load(path: str | os.PathLike, sync: Any, optimizer: Any, stepped: bool = False) -> Any:
    """Read a checkpoint of this format (ours from any stage 0-3, world size and replicate_group, or FSDP2's) into
    ``sync``'s model and ``optimizer``'s state (as_optimizers: one, several, or None: the model alone), every rank
    only what its shards overlap; return the saved extra (None if absent). Every rank of the group calls it. After it
    the model is ready to train: stages 1-2 gather the weights whole again, stage 3 holds no unit gathered before,
    and the optimizer has the checkpoint's state and hyperparameters (as torch.optim's load_state_dict restores them),
    whether or not it had stepped. ``stepped``: the caller knows that the saved optimizers had stepped every
    parameter (a trainer, from its position), so a parameter without state is refused too (a checkpoint cut short
    of its state), where by default it is taken as not stepped yet.

    [Note: two reads] The checks that need only the metadata run first, on every rank, and their verdict is
    agreed; then the checksums of every stored item the load reads, each rank a share (zero/checkpoint/checksums.py:
    bytes flipped inside a data file are refused here); then DCP reads the small things (param_groups, step
    counts, extra), which the parameter groups and the step counts are checked against; only then the shards, in
    place. So a refused checkpoint has changed nothing; a read that fails after that (a file that changes under
    the load) leaves a partly loaded model."""
    path = os.fspath(path)
    group = checkpoint_group(sync)
    optimizers = as_optimizers(optimizer)
    slots_ = slots(sync, optimizers)
    runs = [sync.optimizer_view(o).runs for o in optimizers]
    sharded_optimizer = any(r is not None for r in runs)
    kinds = parameter_kinds(slots_)
    metadata, problem = read_folder(path)
    if metadata is not None:
        problem = model_problem(metadata, sync.model)
        if problem is None and optimizers:
            group_count = sum(len(o.param_groups) for o in optimizers)
            problem = optimizer_problem(metadata, slots_, kinds, group_count, sharded_optimizer, stepped)
    problem = agree(f"checkpoint {path}: {problem}" if problem else None, group)
    if problem is None:  # [Note: the checksums are torch's own]: each rank a share of what is read, agreed
        parts = ("model", "extra", *(("optimizer",) if optimizers else ()))
        problem = folder_problem(path, metadata, parts, group)
        problem = f"checkpoint {path}: {problem}" if problem else None
    if problem:
        raise CheckpointError(f"zero.checkpoint.load: {problem}")

    def read(state: dict[str, Any], window: Any = None) -> None:
        try:
            dcp.load(state, storage_reader=FileSystemReader(path), planner=ShardLoadPlanner(window),
                     process_group=group)
        except CheckpointException as error:
            raise CheckpointError(f"zero.checkpoint.load: checkpoint {path} cannot be read: {one_line(error)}") \
                from None

    small = small_entries(metadata, with_optimizer=bool(optimizers))
    if small:  # the same on every rank: built from the same metadata
        read(small)
    saved_groups = small.get("optimizer", {}).get("param_groups", [])
    matched, problem = groups_problem(saved_groups, slots_, optimizers)
    if problem is None and sharded_optimizer:
        problem = scalars_problem(small, slots_, kinds)
    if problem:  # the same on every rank: every rank read the same small things
        raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: {problem}")

    sync.shards_loading()  # stage 3: what is gathered freed (the shards change under it)
    installs, state_entries = destinations(sync, optimizers, runs, slots_, metadata, small, kinds)
    store = getattr(sync, "store", None)  # offload: the stored pieces are read into the store through a SlotCache
    window = SlotCache(store) if store is not None else None
    try:
        read({"model": model_entries(sync), "optimizer": {"state": state_entries}}, window)
    finally:
        if window is not None:
            window.close()
    sync.shards_loaded()
    position = 0
    for optimizer_, install in installs:
        install([saved_groups[j] for j in matched[position:position + len(optimizer_.param_groups)]])
        position += len(optimizer_.param_groups)
    return decode_extra(small["extra"]) if "extra" in small else None


def destinations(sync: Any, optimizers: list[torch.optim.Optimizer], runs: list[Any], slots_: list[Any],
                 metadata: Any, small: dict[str, Any], kinds: dict[str, dict[str, bool]]) -> tuple[list[Any], dict]:
    """Where a load reads each optimizer's state (every old state let go of first, before the new is allocated),
    and how each is then installed: (optimizer, install) pairs and the "optimizer.state" entries to read."""
    scalars = small.get("optimizer", {}).get("state", {})
    layout = saved_optimizer(metadata)[0]
    installs, state_entries = [], {}
    for optimizer_, optimizer_runs in zip(optimizers, runs):
        optimizer_.state.clear()  # the old state goes before the new is allocated
        if optimizer_runs is None:
            install, entries = plain_destinations(optimizer_, [s for s in slots_ if s.optimizer is optimizer_],
                                                  layout, scalars)
        else:
            install, entries = sharded_destinations(sync, optimizer_, optimizer_runs, layout, scalars, kinds,
                                                    sync.optimizer_view(optimizer_).stored)
        installs.append((optimizer_, install))
        state_entries.update(entries)
    return installs, state_entries


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
    if problem is None:  # the checksums of what is read ([Note: the checksums are torch's own])
        problem = folder_problem(path, metadata, parts, group, alone)
        problem = f"checkpoint {path}: {problem}" if problem else None
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
