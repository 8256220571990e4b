"""Checkpoints as one file of the whole state dicts, for the syncs that hold the whole model on every rank (stage 0,
DDP, DiLoCo's replicas) and for the sharded ones when their ranks share no folder: every sync's
``save_checkpoint(path, ..., one_file=True)``, and its ``load_checkpoint`` of a file.

    {"model": {name: tensor},        the bare model's full state_dict (sync.model_state_dict(): the sharded stages
                                     gather it to rank 0 one bucket or unit at a time, FSDP2 makes its DTensors whole)
     "optimizer": state_dict,        optimizer.state_dict(): torch.optim's whole form over the model's parameters
                                     (several optimizers as one: that object's own, {name: each one's})
     **extra}                        the caller's other keys, as the group's rank 0 has them

The group's rank 0 writes it atomically (a temporary file, flushed, fsynced, renamed over the old one: a crash leaves
the old file or the new one, never half of one) and reads it, sending what it read to every rank of the group, so
ranks on other nodes need no shared file system. Any stage at any world size loads what any other wrote: the state
dicts are the unsharded ones.
"""
from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

import utils
from zero.checkpoint.api import load
from zero.checkpoint.background import AsyncWriter
from zero.checkpoint.checksums import file_problem
from zero.checkpoint.checks import CheckpointError, one_line
from zero.checkpoint.disk import DiskError, disk_problem
from zero.optimizer_kinds import optimizer_parts
from zero.optimizer_kinds import missing_optimizer_state

KEYS = ("model", "optimizer")  # what the file holds besides the caller's extra


def write_file(path: str, state: dict[str, Any], writer: AsyncWriter | None = None) -> Future | None:
    """``state`` to ``path`` atomically (utils.atomic_write: temporary file, flush, fsync, rename); the disk's error
    (a full disk, a read-only folder: zero/checkpoint/disk.py) refused in one line, the old file left as it was.
    With ``writer``: copied into its staging buffers and written in its thread; returns the write's future."""
    if writer is not None:
        staged = writer.stage(state)
        return writer.write(lambda: write_file(path, staged))
    try:
        with utils.atomic_write(path, "wb") as f:
            torch.save(state, f)
    except Exception as error:
        disk = disk_problem(error)
        if disk is None:
            raise
        raise DiskError(path, disk) from None
    return None


def save_file(path: str | os.PathLike, sync: Any, optimizer: Any = None, extra: dict[str, Any] | None = None,
              writer: AsyncWriter | None = None) -> Future | None:
    """Every rank of the sync's group: the whole state dicts gathered to its rank 0 (the sharded stages gather, so
    every rank calls them), which writes the file; the disk's error there (write_file) raised on every rank alike.
    With ``writer`` (an AsyncWriter) rank 0 writes it in the background: its future (the others: None), whose
    error, if any, reaches whoever waits on the writer."""
    optimizer_state = optimizer.state_dict() if optimizer is not None else None
    model_state = sync.model_state_dict()
    clash = sorted(set(extra or {}) & set(KEYS))
    if clash:
        raise ValueError(f"zero.checkpoint.save_file: extra holds {clash}, the file's own keys")
    group, refused, future = sync.checkpoint_group(), [None], None
    if dist.get_rank(group) == 0:
        try:
            future = write_file(os.fspath(path), {"model": model_state,
                                                  **({"optimizer": optimizer_state} if optimizer else {}),
                                                  **(extra or {})}, writer)
        except DiskError as error:
            refused[0] = error
    if writer is None:
        dist.broadcast_object_list(refused, group=group, group_src=0)  # the disk's error on every rank of the group
    if refused[0] is not None:
        raise refused[0]
    return future


def read_file(path: str) -> dict[str, Any]:
    """The file as torch.load(weights_only=True) reads it (tensors and Python builtins only), in one process; one
    that is corrupt (bytes flipped inside it: its records' CRC32s, checksums.file_problem), or no checkpoint of this
    form, refused in one line."""
    problem = file_problem(path)
    if problem:
        raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: {problem}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - whatever torch.load raises, the file is not a checkpoint
        raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: corrupt or not written by torch.save "
                              f"({one_line(error)[:200]})") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: not a checkpoint of the whole state dicts "
                              f"(no \"model\")")
    return state


def shared_file(path: str, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """The file, read by the group's rank 0 and sent to every rank of the group; a refusal reaches every rank alike."""
    message: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            message[0] = ("ok", read_file(path))
        except CheckpointError as error:
            message[0] = ("error", str(error))
    dist.broadcast_object_list(message, group=group, group_src=0)
    if message[0][0] == "error":
        raise CheckpointError(message[0][1])
    return message[0][1]


def load_file(path: str | os.PathLike, sync: Any, optimizer: Any = None, stepped: bool = False) -> dict[str, Any]:
    """Every rank of the sync's group: the file's model (and, with ``optimizer``, its state) loaded; returns the
    extra (every other key). ``stepped``: the saved optimizers had stepped every parameter, so one without state
    is refused (missing_optimizer_state), rather than trained on from another state."""
    path = os.fspath(path)
    state = shared_file(path, sync.checkpoint_group())
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: it holds no optimizer state")
        check_complete(path, sync, optimizer, state["optimizer"], stepped)
    load_model(path, sync, state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return {key: value for key, value in state.items() if key not in KEYS}


def load_model(path: str, sync: Any, model_state: dict[str, Any]) -> None:
    """A whole state_dict (the same on every rank) into the sync's model; another model's refused in one line."""
    try:
        sync.load_model_state_dict(model_state)
    except RuntimeError as error:
        raise CheckpointError(f"zero.checkpoint.load: checkpoint {path} does not fit this model: "
                              f"{(str(error).splitlines() or [''])[0]}") from None


def check_complete(path: str, sync: Any, optimizer: Any, state: Any, stepped: bool) -> None:
    """Refuse, in one line, an optimizer state that lacks what its optimizer keeps for every parameter it has stepped
    (SGD's momentum, AdamW's moments and step): the sharded stages once wrote SGD's without its momentum."""
    for part, part_state in optimizer_parts(optimizer, state):
        problem = missing_optimizer_state(sync.optimizer_view(part).torch_class, part_state, every_parameter=stepped)
        if problem:
            raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: its optimizer state is incomplete "
                                  f"({problem})")


def load_any(path: str | os.PathLike, sync: Any, optimizer: Any = None, stepped: bool = False) -> Any:
    """A checkpoint of either form into the sync: a file (load_file), else a folder (zero.checkpoint.load)."""
    if os.path.isfile(path):
        return load_file(path, sync, optimizer, stepped)
    return load(path, sync, optimizer, stepped)
