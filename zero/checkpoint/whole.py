"""Checkpoints as one file of the whole state dicts, for the syncs that hold the whole model on every rank (stage 0,
DDP, DiLoCo's replicas) and for the sharded ones when their ranks share no folder: every sync's
``save_checkpoint(path, ..., one_file=True)``, and its ``load_checkpoint`` of a file.

    {"model": {name: tensor},        the bare model's full state_dict (sync.model_state_dict(): the sharded stages
                                     gather it to rank 0 one bucket or unit at a time, FSDP2 makes its DTensors whole)
     "optimizer": state_dict,        optimizer.state_dict(): torch.optim's whole form over the model's parameters
                                     (several optimizers as one: that object's own, {name: each one's})
     **extra}                        the caller's other keys, as the group's rank 0 has them

The group's rank 0 writes it atomically (a temporary file, flushed, fsynced, renamed over the old one: a crash leaves
the old file or the new one, never half of one). Any stage at any world size loads what any other wrote: the state
dicts are the unsharded ones.

[Note: a load that reads like a save] A load holds little more than what it loads. Where every rank of the group
sees the same file (the same size and the same records' CRC32s in its zip directory: one machine, or a shared file
system; ``same_file_everywhere``), each rank maps it itself (torch.load's mmap: a tensor's bytes come from the page
cache as it is used) after checking a share of its records' CRC32s, and nothing is pickled or sent. Each part's
pages are given back once it is loaded (``release``: madvise(MADV_DONTNEED) on the private file mapping, whose clean
pages a later read would map from the file again): the model's after the model's load, and each optimizer tensor's
once it is copied into a tensor of the optimizer's own (torch.optim's load_state_dict keeps a tensor of the right
dtype and device as it is, which would leave the state a view of the file: ``load_optimizer``). The resident peak
above the model and its buffers is then the optimizer's state plus one tensor's pages, where reading the file whole
and receiving it pickled held two or three copies of everything (GPT-2 small's shape, AdamW, --zero 0 resumed on 2
processes: 4,757 MB above start against 16 Psi = 1,365 MB; docs/trainer.md). Where a rank does not see the same
file (nodes that share no folder), the group's rank 0 reads it and sends it whole, as before.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import zipfile
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from files import atomic_write
from utils import one_line
from zero.checkpoint.api import load
from zero.checkpoint.background import AsyncWriter
from zero.checkpoint.checksums import file_problem
from zero.checkpoint.checks import CheckpointError, agree
from zero.checkpoint.disk import DiskError, disk_problem
from zero.optimizer_kinds import as_optimizers, missing_optimizer_state, optimizer_parts

KEYS = ("model", "optimizer")  # what the file holds besides the caller's extra


def write_file(path: str, state: dict[str, Any], writer: AsyncWriter | None = None) -> Future | None:
    """``state`` to ``path`` atomically (files.atomic_write: temporary file, flush, fsync, rename); the disk's error
    (a full disk, a read-only folder: zero/checkpoint/disk.py) refused in one line, the old file left as it was.
    With ``writer``: copied into its staging buffers and written in its thread; returns the write's future."""
    if writer is not None:
        staged = writer.stage(state)
        return writer.write(lambda: write_file(path, staged))
    try:
        with atomic_write(path, "wb") as f:
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


def read_file(path: str, mmap: bool = False, checked: bool = False) -> dict[str, Any]:
    """The file as torch.load(weights_only=True) reads it (tensors and Python builtins only), in one process; one
    that is corrupt (bytes flipped inside it: its records' CRC32s, checksums.file_problem; ``checked``: the caller
    has checked them), or no checkpoint of this form, refused in one line. ``mmap``: its tensors mapped from the
    file, not read into memory ([Note: a load that reads like a save])."""
    problem = None if checked else file_problem(path)
    if problem:
        raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: {problem}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # noqa: BLE001 - whatever torch.load raises, the file is not a checkpoint
        raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: corrupt or not written by torch.save "
                              f"({one_line(error)})") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: not a checkpoint of the whole state dicts "
                              f"(no \"model\")")
    return state


def file_identity(path: str) -> tuple[int, str] | None:
    """What tells one torch.save archive from another without reading its data: its size and a hash of its zip
    directory (every record's name, offset, size and CRC32); None where it is no file or no zip archive here."""
    try:
        with zipfile.ZipFile(path) as archive:
            records = [(r.filename, r.header_offset, r.file_size, r.CRC) for r in archive.infolist()]
        size = os.path.getsize(path)
    except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile, ValueError):
        return None
    return size, hashlib.sha256(repr(records).encode()).hexdigest()


def same_file_everywhere(path: str, group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of the group sees the file rank 0 sees (one all_gather_object of a few bytes each)."""
    if dist.get_world_size(group) == 1:
        return True
    seen: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, file_identity(path), group=group)
    return seen[0] is not None and all(identity == seen[0] for identity in seen)


def read_shared(path: str, group: dist.ProcessGroup | None) -> tuple[dict[str, Any], bool]:
    """The file on every rank of the group, and whether it is mapped: mapped by each rank where every rank sees it
    (its records' CRC32s checked first, each rank a share, the verdict agreed), else read by the group's rank 0 and
    sent to every rank ([Note: a load that reads like a save]); a refusal reaches every rank alike."""
    if same_file_everywhere(path, group):
        ranks = dist.get_world_size(group) if dist.is_initialized() else 1
        problem = file_problem(path, dist.get_rank(group) if ranks > 1 else 0, ranks)
        if ranks > 1:
            problem = agree(problem, group, split=True)
        if problem:
            raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: {problem}")
        return read_file(path, mmap=True, checked=True), True
    message: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            message[0] = ("ok", read_file(path))
        except CheckpointError as error:
            message[0] = ("error", str(error))
    dist.broadcast_object_list(message, group=group, group_src=0)
    if message[0][0] == "error":
        raise CheckpointError(message[0][1])
    return message[0][1], False


def load_file(path: str | os.PathLike, sync: Any, optimizer: Any = None, stepped: bool = False) -> dict[str, Any]:
    """Every rank of the sync's group: the file's model (and, with ``optimizer``, its state) loaded, each part's
    pages given back once loaded; returns the extra (every other key). ``stepped``: the saved optimizers had stepped
    every parameter, so one without state is refused (missing_optimizer_state), rather than trained on from another
    state."""
    path = os.fspath(path)
    state, mapped = read_shared(path, sync.checkpoint_group())
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: it holds no optimizer state")
        check_complete(path, sync, optimizer, state["optimizer"], stepped)
    load_model(path, sync, state.pop("model"), mapped)
    if optimizer is not None:
        load_optimizer(optimizer, state.pop("optimizer"), mapped)
    return {key: value for key, value in state.items() if key not in KEYS}


def load_model(path: str, sync: Any, model_state: dict[str, Any], mapped: bool = False) -> None:
    """A whole state_dict (the same on every rank) into the sync's model; ``mapped`` (from the file: read_shared),
    its pages given back (release). Another model's refused in one line."""
    try:
        sync.load_model_state_dict(model_state)
    except RuntimeError as error:
        raise CheckpointError(f"zero.checkpoint.load: checkpoint {path} does not fit this model: "
                              f"{one_line(error)}") from None
    if mapped:
        release(tensors_in(model_state))


def load_optimizer(optimizer: Any, state: dict[str, Any], mapped: bool = False) -> None:
    """``optimizer.load_state_dict(state)``. ``mapped`` (``state`` from the file: read_shared): torch.optim keeps a
    tensor of the parameter's dtype and device as it is, which would leave the optimizer's state a view of the
    file, so each one the optimizers now hold from the mapping is copied into one of their own and its pages given
    back, one at a time; then every page of ``state`` is given back (what a sharded optimizer read of it)."""
    if not mapped:
        optimizer.load_state_dict(state)
        return
    storages = {t.untyped_storage().data_ptr() for t in tensors_in(state)}
    optimizer.load_state_dict(state)
    for part in as_optimizers(optimizer):
        for entry in getattr(part, "state", {}).values():
            for key, value in list(entry.items()) if isinstance(entry, dict) else ():
                if torch.is_tensor(value) and value.untyped_storage().data_ptr() in storages:
                    entry[key] = value.clone()
                    release([value])
    release(tensors_in(state))


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples (torch's pytree: zero/init.py reads arguments so)."""
    return [leaf for leaf in tree_leaves(value) if torch.is_tensor(leaf)]


MADV_DONTNEED = 4  # <sys/mman.h> on Linux
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def release(tensors: Any) -> None:
    """The resident pages of tensors mapped from a file (torch.load's mmap) given back: madvise(MADV_DONTNEED) on
    the whole pages inside each one's storage. Only for mapped tensors never written: a private mapping's clean
    pages are mapped from the file again if read later, but a written one would lose what was written. The CPU
    only; elsewhere (not Linux) nothing is done."""
    if LIBC is None:
        return
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.device.type != "cpu" or not storage.nbytes():
            continue
        start = -(-storage.data_ptr() // PAGE) * PAGE
        end = (storage.data_ptr() + storage.nbytes()) // PAGE * PAGE
        if end > start:
            LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


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
