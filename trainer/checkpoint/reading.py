"""Reading a checkpoint in one process, no process group: the run state a resume reads first (rank 0's, then
broadcast), and a checkpoint with its whole model for --generate, --eval-only's tools and python -m trainer.export
(``read_alone``). Every record's CRC32 is checked before a tensor is read (zero/checkpoint/checksums.py: torch.load
checks none); a checkpoint that is torn, incomplete, corrupt or not this script's is refused in one line naming it
(UsageError).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Iterable

import torch

import zero
from trainer.checkpoint.folders import Found, behind_note, current
from utils import UsageError, one_line

RUN_STATE = ("scheduler", "scaler", "epoch", "micro_batch", "optimizer_steps", "micro_batches_total", "fingerprint",
             "config", "history", "epoch_sums")  # what a resume reads beside the model and the optimizer
REQUIRED = ("model", "optimizer", *RUN_STATE)  # last.pt's keys a resume needs
AFRESH = "; delete it to start afresh"  # a resume's advice; a reader (read_alone: --generate, the export) gives none
READ_ATTEMPTS = 20  # a reader's tries at a checkpoint a live run keeps superseding (read_alone, --eval-only)


def read_checkpoint(path: str, whole: bool = True) -> dict[str, Any]:
    """last.pt, mapped (torch.load's mmap: a tensor's bytes are read only where it is used), once its records'
    CRC32s are checked (zero.checkpoint.checksums: torch.load checks none); not ``whole``: its pickle's alone, for a
    reader of the run state, whose resume then loads the tensors through the sync, which checks every record."""
    from zero.checkpoint import file_problem
    problem = file_problem(path, pickle_only=not whole)
    if problem:
        raise UsageError(f"cannot read checkpoint {path}: {problem}{AFRESH}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise UsageError(f"cannot read checkpoint {path}: corrupt or not written by torch.save "
                         f"({one_line(exc)}){AFRESH}") from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED):
        raise UsageError(f"cannot read checkpoint {path}: not a checkpoint of this script{AFRESH}")
    return state


def non_finite(tensors: Iterable[tuple[str, Any]]) -> str | None:
    """The first of (name, tensor) with a NaN or an infinity, in words ("tensor NAME holds N non-finite values
    (nan)"); None where every one is finite. A DTensor is checked in its local shard."""
    for name, tensor in tensors:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            continue
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            bad = tensor[~finite]
            kind = "nan" if bool(bad.isnan().any()) else "inf"
            return f"tensor {name} holds {int(bad.numel())} non-finite values ({kind})"
    return None


def read_state(found: Found) -> dict[str, Any]:
    """What is read first, the run state alone: last.pt's keys but the model's and the optimizers', or a folder's
    extra (a few kB)."""
    if not found.folder:
        return {key: value for key, value in read_checkpoint(found.path, whole=False).items()
                if key not in ("model", "optimizer", "replicas")}
    try:
        state = zero.checkpoint.read_extra(found.path)
    except zero.checkpoint.CheckpointError as exc:
        raise usage_error(exc, found.path) from None
    if not isinstance(state, dict) or any(key not in state for key in (*RUN_STATE, "world_size")):
        raise UsageError(f"cannot read checkpoint {found.path}: a torch.distributed.checkpoint folder, but not one "
                         f"of this script (no run state in its extra){AFRESH}")
    return state


def usage_error(exc: Exception, path: str) -> UsageError:
    """zero.checkpoint's refusal ("zero.checkpoint.load: checkpoint DIR: why") or DCP's failure, in one line."""
    if isinstance(exc, zero.checkpoint.CheckpointError):
        return UsageError(str(exc).split(": ", 1)[-1])
    return UsageError(f"checkpoint {path} cannot be read: {one_line(exc)}")


def read_alone(directory: str) -> tuple[Found, dict[str, Any]] | None:
    """This process alone, no process group: the current checkpoint of ``directory`` with its whole model (last.pt's
    dict, or a folder's run state and "model"), for --generate and for tools; None where there is none. A run may
    be saving into ``directory`` meanwhile: a folder removed while it is read (superseded by a newer one) is read
    again from the newer (last.pt is replaced atomically, and a mapped file outlives its name)."""
    behind = behind_note(directory)  # [Note: left behind] in folders.py
    if behind is not None:
        print(behind, file=sys.stderr, flush=True)
    try:
        return read_whole_alone(directory)
    except UsageError as exc:  # what is wrong, and the checkpoint left alone: a reader's is no resume
        raise UsageError(str(exc).replace(AFRESH, "")) from None


def read_whole_alone(directory: str) -> tuple[Found, dict[str, Any]] | None:
    """read_alone's reading, READ_ATTEMPTS times at most."""
    for _ in range(READ_ATTEMPTS):
        found = current(directory)
        if found is None:
            return None
        if not found.folder:
            return found, finite_model(found, read_checkpoint(found.path))
        try:
            state = read_state(found)
            state["model"] = zero.checkpoint.read_whole(found.path, ("model",), alone=True)["model"]
            return found, finite_model(found, state)
        except Exception as exc:  # noqa: BLE001 - DCP's own (an AssertionError on a .metadata gone) too
            error = exc if isinstance(exc, UsageError) else usage_error(exc, found.path)
            if os.path.isdir(found.path):  # not superseded: the folder itself is at fault
                raise error from None
    raise error from None  # superseded on every attempt


def finite_model(found: Found, state: dict[str, Any]) -> dict[str, Any]:
    """``state``, once every tensor of its model is finite (non_finite); else refused in one line naming one."""
    bad = non_finite(state["model"].items())
    if bad is not None:
        raise UsageError(f"checkpoint {found.path}: {bad}")
    return state
