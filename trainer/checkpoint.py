"""Checkpoints and exact resume: ``save`` writes one, ``restore`` resumes from one; both on every rank.

Two formats of one content: the model, the optimizer's state, and the run's state beside them (RUN_STATE: the
position in the epoch, the finished epochs, every rank's sums of the current one, the run's record and fingerprint,
the scheduler, the scaler, the world size and the seed). Written at epoch ends, every --checkpoint-every steps and
when --max-steps stops the run, in the one ``restore`` chose at the start (``writes_folders``). Either is written and
read by the sync itself (every sync's ``save_checkpoint`` / ``load_checkpoint``: gradsync.DataParallel), so nothing
here asks which sync runs; this room decides where a checkpoint goes, which is current, and what the run carries.

- Folders of torch.distributed.checkpoint (DCP; zero.checkpoint's format, which FSDP2 and torch's tools read), where
  the sync holds shards (``sync.holds_shards``: --grad-sync custom --zero 1-3 and fsdp) and every rank sees the same
  --checkpoint-dir (checked once: rank 0 leaves a marker, the others look for it). Every rank writes its own shards
  and nothing is gathered: AdamW's 12 Psi bytes leave as 12 Psi / W per rank, where a file would gather all of them
  on rank 0 (9.3 GB for GPT-2 large's shape). A save is a complete folder DIR/step-N (N optimizer steps), written as
  DIR/step-N.partial and renamed once every rank's part and DCP's .metadata are in; then DIR/latest, a one-line
  file naming it (written atomically: DeepSpeed's pointer), makes it current, and what it supersedes is removed
  (older folders, a last.pt). A run killed mid-save resumes from the folder that was current; its unfinished one is
  removed at the next start. The run state is the folder's extra. Only names of this form are ever removed
  (``OURS``: a user's step-best/ stays), and no state of the folder strands a run (``current``): a finished folder
  newer than the one DIR/latest names (a run stopped between the rename and the pointer) is adopted once it is
  checked whole, and a DIR/latest that is missing, unreadable or names nothing falls back to the newest whole folder,
  said in one line; a folder whose step folders are all torn is refused in one line, never started afresh over.
  --keep-checkpoints K keeps the K newest; a superseded folder is renamed DIR/step-N.removing before it is deleted,
  so that no reader sees one half gone, and a reader whose folder vanished reads the newer one (``read_alone``).
  Rank 0 holds a lock on DIR for the run's life (``lock``): a second run on it is refused in one line.
- DIR/last.pt, one file that rank 0 writes atomically (temporary file, flush, fsync, os.replace), at the syncs that
  keep the whole model on every rank (custom --zero 0, ddp, diloco, localsgd), and at the sharded ones when the
  nodes share no folder: the model and the optimizer gathered to rank 0 (below), the run state beside them.

Resume. Rank 0 finds the current checkpoint (the folder DIR/latest names, or last.pt; the newer, should a run have
stopped between making one current and removing the other), reads its run state (a folder's extra alone: a few kB)
and broadcasts it, and every rank checks it (the global batch and the fingerprint: ``check_compatible``) before a
tensor is read. Then ``sync.load_checkpoint`` reads it, any sync either format at any world size: the sharded ones
read only what their shards overlap, the others read the folder whole; last.pt is read by rank 0 and sent to every
rank, so other nodes need no shared file system; diloco and localsgd refuse a folder (their replicas' own weights
and outer state are not in it). A checkpoint that is torn, incomplete, corrupt (bytes flipped inside it: the CRC32s
every torch.save record carries, checked before a tensor is read, each rank a share: zero/checkpoint/checksums.py;
at resume, --eval-only and --generate alike), of another model or another configuration stops every rank with one
line naming it (UsageError), never a silent fresh start.

The disk's errors. A save the disk stops (a full disk, a quota, a read-only or unwritable folder: ENOSPC, EDQUOT,
EROFS, EACCES) stops every rank with one line naming it and the checkpoint that stays current ("cannot save
checkpoint DIR/step-N: no space left on device (the previous checkpoint DIR/step-M is still current)": ``settle``);
the failed DIR/step-N.partial is removed, last.pt's temporary file too, and nothing current was touched. A
--checkpoint-dir this run cannot write in is refused at the start, before any step, at every sync (``unwritable``).

Nothing random is carried from step to step: the data order comes from (seed, epoch), each sample's augmentation (in
memory or from an image folder) from (seed, epoch, sample index) and dropout from a reseed with (seed, rank,
optimizer step) before every step, so the checkpoint (model, optimizer, scheduler, scaler, position in the epoch) is
all a resumed run needs to continue bit for bit; a resumed image-folder run decodes none of the samples it skips.

last.pt's "model" is the bare model's full state_dict and "optimizer" torch.optim's state_dict over the model's
trainable parameters numbered group by group, whatever --zero or --grad-sync (the sharded stages gather their shards
to rank 0's CPU one bucket or unit at a time; FSDP2's DTensors are made whole), so any stage at any world size loads
it. diloco and localsgd keep each replica's weights, optimizer and outer state under "replicas" ("model": the shared
point). A folder holds get_state_dict's form: every tensor by name in its global shape (zero/checkpoint/).

A run is identified by its global batch (batch size x grad-accum x processes), not by its number of processes:
micro-batch j of an epoch holds the same B x W samples (the sampler's order, rank r taking every W-th) and
SyncBatchNorm normalizes over all of them, however they are split, so a run stopped on 2 processes resumes on 4 with
--batch-size halved and ends where it would have, up to float summation order; this is what torchrun's elastic
restarts need when a node is lost (--nnodes MIN:MAX). A resume that changes the global batch is refused with the
--batch-size that keeps it; one whose weights depend on the split (--norm local, dropout) says so and goes on. (The
micro-batches are the same where the training set divides evenly over both numbers of processes; otherwise
DistributedSampler pads each rank's shard by repeating samples, and how many depends on W.)

Bit-for-bit claims (resume, restarts, two nodes, custom == DDP) are facts of the CPU kernels. On CUDA, convolutions
pick nondeterministic algorithms unless asked: --deterministic (build.make_deterministic) asks.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import utils
import zero
from models import GPT_SIZES
from trainer import faults
from trainer.build import Parts
from trainer.config import DILOCO_FLAGS, Config
from utils import UsageError

RUN_STATE = ("scheduler", "scaler", "epoch", "micro_batch", "optimizer_steps", "micro_batches_total", "fingerprint",
             "config", "history", "epoch_sums")  # what a resume reads beside the model and the optimizer
REQUIRED = ("model", "optimizer", *RUN_STATE)  # last.pt's keys a resume needs
FILE, LATEST = "last.pt", "latest"  # DIR/last.pt; DIR/latest names the current folder
FOLDER, PARTIAL = "step-", ".partial"  # DIR/step-N, written as DIR/step-N.partial
REMOVING = ".removing"  # a superseded DIR/step-N is renamed so before it is deleted: no reader sees it half gone
OURS = re.compile(r"step-(\d+)(\.partial|\.removing)?")  # the names this script writes, the only ones it removes
READ_ATTEMPTS = 5  # a reader's tries at a folder a live run keeps superseding (read_alone)
MARKER_WAIT_S = 2.0  # how long a rank looks for rank 0's marker (a network file system may show it late)
NO_SUMS = [0.0, 0.0, 0.0]  # a rank's [loss, correct, seen] at an epoch's start


@dataclass
class Position:
    """Where a run stands: the epoch, its next micro-batch, and the totals so far (with the weights, all a resume
    needs)."""
    epoch: int = 0
    micro_batch: int = 0
    optimizer_steps: int = 0
    micro_batches: int = 0


class Found(NamedTuple):
    """A checkpoint in --checkpoint-dir: its path, whether it is a DCP folder (else last.pt), and why it was chosen
    when DIR/latest did not name it (a note for the user)."""
    path: str
    folder: bool
    note: str | None = None


# ----------------------------------------------------------------------------------------------------------
# What identifies a run
# ----------------------------------------------------------------------------------------------------------
def trajectory(parts: Parts) -> dict[str, Any]:
    """The settings that decide the sequence of weights (the checkpoint's "config"); a checkpoint resumes only a
    run that agrees on all."""
    config, data = parts.config, parts.data
    record = {key: getattr(config, key) for key in
              ("model", "dataset", "grad_accum", "epochs", "optimizer", "lr", "momentum", "weight_decay",
               "scheduler", "amp", "seed", "augment", "image_size")}
    # named only when given, so that a checkpoint from before these flags existed still resumes without them
    record.update({key: getattr(config, key) for key in ("norm_weight_decay", "clip_grad_norm", "betas",
                                                         "warmup_steps", "min_lr", "param_dtype", "reduce_dtype",
                                                         "muon_lr", "muon_momentum", "muon_weight_decay")
                   if getattr(config, key) is not None})
    if config.dataset == "text":  # the GPT's shape too, so that --generate can rebuild it from the checkpoint
        record.update(context=config.context, val_fraction=config.val_fraction,
                      gpt=dict(GPT_SIZES[config.model], context=config.context))
    # A run is its global batch, not its number of processes: B x K x W samples per step (the same sample
    # order, and SyncBatchNorm's statistics over the same B x W samples per micro-batch, for any split); W is the
    # data's world (replica groups: R groups of P)
    world_size = parts.data.placement()[1]
    record["global_batch"] = config.batch_size * config.grad_accum * world_size
    record["dropout"] = config.dropout if config.model == "net" else None
    record["sizes"] = [len(data.train), data.val_size, data.num_classes] if config.dataset != "cifar100" else None
    record["norm"] = "local" if config.norm == "local" else "synchronized"  # custom and torch compute the same
    record["schedule_steps"] = parts.schedule_steps if config.scheduler in ("onecycle", "cosine") else None
    if config.outer_sync:  # the replicas are processes: their number is the run's too
        record.update(world_size=world_size, diloco={key: getattr(config, key) for key in DILOCO_FLAGS})
        if config.zero == 3:  # the outer state is per shard: such a checkpoint resumes only at --zero 3 (and the
            record["diloco"]["zero"] = 3  # others, which lack the key, keep their fingerprint)
    return record


def fingerprint(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def split_dependent(config: Config) -> list[str]:
    """What makes the weights depend on how the global batch is split over processes, not on the batch alone."""
    reasons = []
    if config.norm == "local":
        reasons.append("--norm local (each process normalizes its own samples)")
    if config.model == "net" and config.dropout > 0:
        reasons.append("dropout (masks drawn per process)")
    return reasons


def check_compatible(state: dict[str, Any], record: dict[str, Any], path: str, config: Config,
                     world_size: int) -> None:
    """Refuse a checkpoint of another run in one line; a changed global batch names the --batch-size that keeps
    it on this many processes."""
    if state["fingerprint"] == fingerprint(record):
        return
    saved, accum = state["config"], config.grad_accum
    if "global_batch" in saved and saved["global_batch"] != record["global_batch"] and saved.get("grad_accum") == accum:
        saved_size, saved_world = saved["global_batch"] // (accum * state["world_size"]), state["world_size"]
        per_process, rest = divmod(saved["global_batch"], accum * world_size)
        advice = (f"--batch-size {per_process} keeps it on {world_size} processes" if per_process and not rest else
                  f"no --batch-size keeps it on {world_size} processes with --grad-accum {accum}")
        raise UsageError(f"checkpoint {path} is from a run with a global batch of {saved['global_batch']} "
                         f"(batch size x grad-accum x processes = {saved_size} x {accum} x {saved_world}), "
                         f"not {record['global_batch']}: {advice}")
    differences = [f"{key} {saved.get(key)!r} != {record.get(key)!r}" for key in sorted(record)
                   if saved.get(key) != record.get(key)]
    raise UsageError(f"checkpoint {path} is from another configuration ({', '.join(differences) or 'fingerprint'})"
                     f"; use another --checkpoint-dir or delete it")


# ----------------------------------------------------------------------------------------------------------
# Which format, and where the current checkpoint is
# ----------------------------------------------------------------------------------------------------------
def lock(parts: Parts) -> None:
    """Rank 0 holds an exclusive lock on --checkpoint-dir for the run's life (flock on the folder itself: nothing
    is written for it, and the kernel drops it when the process dies, so a killed run leaves nothing stuck). A
    second run on the folder is refused in one line on every rank before it touches anything (it would remove the
    first's save under way as a leftover)."""
    directory, message = parts.config.checkpoint_dir, [None]
    if parts.ctx.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            descriptor = os.open(directory, os.O_RDONLY)
        except OSError as exc:
            message[0] = f"cannot use --checkpoint-dir {directory}: {exc.strerror or exc}"
        else:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                parts.checkpoint_lock = descriptor
            except BlockingIOError:
                os.close(descriptor)
                message[0] = (f"another run is using --checkpoint-dir {directory} (it holds the folder's lock): wait "
                              f"for it to end, or use another folder")
            else:
                message[0] = unwritable(directory)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise UsageError(message[0])


def unwritable(directory: str) -> str | None:
    """Why this process cannot write in ``directory`` (a read-only file system, its permissions), or None: a file
    made and removed there, so that a run that could never save is refused before its first step, whatever the
    sync and format (root passes the permission bits: only a read-only mount stops it)."""
    try:
        descriptor, probe = tempfile.mkstemp(dir=directory, prefix=".writable-")
        os.close(descriptor)
        os.remove(probe)
    except OSError as exc:
        return f"cannot write in --checkpoint-dir {directory}: {(exc.strerror or str(exc)).lower()}"
    return None


def unlock(parts: Parts) -> None:
    """The run's lock on --checkpoint-dir released (the run ends; in-process callers may start another)."""
    if parts.checkpoint_lock is not None:
        os.close(parts.checkpoint_lock)  # closing the descriptor drops its flock
        parts.checkpoint_lock = None


def writes_folders(parts: Parts) -> bool:
    """Whether this run saves DCP folders (module docstring): a sync that holds shards, and every rank sees the
    folder rank 0 sees (else last.pt, said once). Rank 0 first removes what a save cut short left
    (DIR/step-N.partial), before any rank can write a folder of that name."""
    config = parts.config
    if config.eval_only or not parts.sync.holds_shards:
        return False
    if parts.ctx.rank == 0 and os.path.isdir(config.checkpoint_dir):
        remove_folders(config.checkpoint_dir, lambda name: name.endswith((PARTIAL, REMOVING)))
    if seen_by_every_rank(config.checkpoint_dir, parts.comm_device):
        return True
    utils.print0(f"note: not every rank sees --checkpoint-dir {config.checkpoint_dir} (no shared file system): rank "
                 f"0 writes {FILE} there, the model and the optimizer gathered to it")
    return False


def seen_by_every_rank(directory: str, device: torch.device) -> bool:
    """Whether every rank sees ``directory`` as rank 0 does (one machine, or a shared file system): rank 0 leaves a
    marker of a name of its own there, the others look for it, and all agree (one broadcast, one all-reduce)."""
    if dist.get_world_size() == 1:
        return True
    rank, message = dist.get_rank(), [None]
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            descriptor, marker = tempfile.mkstemp(dir=directory, prefix=".seen-by-every-rank-")
            os.close(descriptor)
            message[0] = ("ok", os.path.basename(marker))
        except OSError as exc:
            message[0] = ("error", f"cannot write in --checkpoint-dir {directory}: {exc.strerror or exc}")
    dist.broadcast_object_list(message, src=0)
    status, text = message[0]
    if status == "error":
        raise UsageError(text)
    marker = os.path.join(directory, text)
    deadline = time.monotonic() + MARKER_WAIT_S
    while rank != 0 and not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = torch.tensor([int(os.path.exists(marker))], device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    if rank == 0:
        os.remove(marker)
    return bool(seen.item())


def current(directory: str) -> Found | None:
    """The checkpoint a run in ``directory`` resumes from: the folder DIR/latest names, or DIR/last.pt; the newer
    when both are there (a run stopped between making one current and removing the other). A finished folder newer
    than the named one (a run stopped between its rename and the pointer) is adopted once checked whole; a missing
    or unreadable DIR/latest, or one naming no folder, falls back to the newest whole folder (``note`` says so)."""
    file = os.path.join(directory, FILE)
    folder = current_folder(directory)
    if os.path.exists(file) and (folder is None or os.path.getmtime(file) > os.path.getmtime(folder.path)):
        return Found(file, folder=False)
    return folder


def current_folder(directory: str) -> Found | None:
    """The current DCP folder of ``directory`` (``current``), or None where there is no finished one."""
    steps = finished_steps(directory)
    named = named_step(directory)
    newer = [step for step in steps if named is None or step > named]
    for step in reversed(newer):  # the newest whole one, read only as far as needed
        path = os.path.join(directory, f"{FOLDER}{step}")
        if whole(path):
            why = (f"{LATEST} names {FOLDER}{named}, but {FOLDER}{step} is finished and whole (a run stopped before "
                   f"naming it)" if named is not None else f"{LATEST} is missing or unreadable")
            return Found(path, folder=True, note=f"note: resuming from {path}: {why}")
    if named is not None:
        return Found(os.path.join(directory, f"{FOLDER}{named}"), folder=True)  # torn or not: load says which
    if steps:
        listed = ", ".join(f"{FOLDER}{step}" for step in steps)
        raise UsageError(f"--checkpoint-dir {directory} holds step folders ({listed}) but none is whole and "
                         f"{LATEST} names none; move them away to start afresh")
    return None


def finished_steps(directory: str) -> list[int]:
    """The steps of the finished folders DIR/step-N (not .partial), in order."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(match[1]) for match in map(OURS.fullmatch, names)
                  if match and not match[2] and os.path.isdir(os.path.join(directory, match[0])))


def named_step(directory: str) -> int | None:
    """The step of the folder DIR/latest names, where it is readable and names a finished folder; else None."""
    try:
        with open(os.path.join(directory, LATEST), encoding="utf-8") as f:
            match = OURS.fullmatch(f.read(64).strip())
    except (OSError, UnicodeDecodeError):  # missing, a folder, unreadable bytes
        return None
    if match is None or match[2] or not os.path.isdir(os.path.join(directory, match[0])):
        return None
    return int(match[1])


def whole(path: str) -> bool:
    """Whether a DCP folder is whole: its .metadata readable, every data file it names there at its size."""
    from zero.checkpoint import read_folder  # DCP, imported only where a folder is looked at
    return read_folder(path)[1] is None


def remove_folders(directory: str, chosen: Any) -> None:
    """Rank 0: the step folders (finished or not) whose names ``chosen`` picks, among the names this script
    writes (OURS); a finished one first renamed out of the names a reader looks at (REMOVING), then deleted."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if OURS.fullmatch(name) and chosen(name) and os.path.isdir(path):
            if not name.endswith((PARTIAL, REMOVING)):
                os.rename(path, path + REMOVING)
                path += REMOVING
            shutil.rmtree(path, ignore_errors=True)


def make_current(directory: str, name: str, keep: int = 1) -> None:
    """Rank 0, once every rank has written its part of DIR/name.partial: the folder renamed and the rename made
    durable, DIR/latest pointed at it (atomically), and what it supersedes removed (last.pt, the folders but the
    ``keep`` - 1 newest before it: --keep-checkpoints, none removed before the new one is current). A
    whole folder of the same step already there (a run stopped before naming it, then resumed from an older one) is
    kept and this save's copy dropped: both hold the same step of the same run, and nothing is ever without one."""
    target = os.path.join(directory, name)
    if os.path.isdir(target) and whole(target):
        shutil.rmtree(target + PARTIAL, ignore_errors=True)
    else:
        shutil.rmtree(target, ignore_errors=True)  # torn: never current (``current`` adopts only whole ones)
        os.rename(target + PARTIAL, target)
    descriptor = os.open(directory, os.O_RDONLY)
    try:  # the rename on disk before the pointer names it
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    with utils.atomic_write(os.path.join(directory, LATEST)) as f:
        f.write(name + "\n")
    step = int(OURS.fullmatch(name)[1])
    older = [other for other in finished_steps(directory) if other < step]
    kept = {name, *(f"{FOLDER}{other}" for other in older[max(0, len(older) - keep + 1):])}
    remove_folders(directory, lambda other: other not in kept)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, FILE))


def forget_folders(directory: str) -> None:
    """Rank 0, once last.pt is written: DIR/latest and the folders, which it supersedes."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, LATEST))
    remove_folders(directory, lambda name: True)


# ----------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------
def read_checkpoint(path: str, whole: bool = True) -> dict[str, Any]:
    """last.pt, mapped (torch.load's mmap: a tensor's bytes are read only where it is used), once its records'
    CRC32s are checked (zero.checkpoint.checksums: torch.load checks none); not ``whole``: its pickle's alone, for a
    reader of the run state, whose resume then loads the tensors through the sync, which checks every record."""
    from zero.checkpoint import file_problem
    problem = file_problem(path, pickle_only=not whole)
    if problem:
        raise UsageError(f"cannot read checkpoint {path}: {problem}; delete it to start afresh")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise UsageError(f"cannot read checkpoint {path}: corrupt or not written by torch.save "
                         f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}); "
                         f"delete it to start afresh") from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED):
        raise UsageError(f"cannot read checkpoint {path}: not a checkpoint of this script; delete it to start afresh")
    return state


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
                         f"of this script (no run state in its extra); delete it to start afresh")
    return state


def usage_error(exc: Exception, path: str) -> UsageError:
    """zero.checkpoint's refusal ("zero.checkpoint.load: checkpoint DIR: why") or DCP's failure, in one line."""
    if isinstance(exc, zero.checkpoint.CheckpointError):
        return UsageError(str(exc).split(": ", 1)[-1])
    return UsageError(f"checkpoint {path} cannot be read: {zero.checkpoint.one_line(exc)}")


def load_on_rank0(directory: str) -> tuple[Found, dict[str, Any]] | None:
    """Rank 0 finds the current checkpoint, reads its run state (read_state) and broadcasts both, so that every rank
    checks the same thing, and other nodes need not see last.pt."""
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            found = current(directory)
            if found is not None and found.note:
                print(found.note, flush=True)
            message[0] = ("ok", found, read_state(found)) if found else None
        except UsageError as exc:
            message[0] = ("error", str(exc))
        except Exception as exc:  # noqa: BLE001 - said in one line on every rank, none left waiting for rank 0
            message[0] = ("error", f"cannot read --checkpoint-dir {directory}: {zero.checkpoint.one_line(exc)}")
    dist.broadcast_object_list(message, src=0)
    if message[0] is None:
        return None
    if message[0][0] == "error":
        raise UsageError(message[0][1])
    return message[0][1], message[0][2]


def read_alone(directory: str) -> tuple[Found, dict[str, Any]] | None:
    """This process alone, no process group: the current checkpoint of ``directory`` with its whole model (last.pt's
    dict, or a folder's run state and "model"), for --generate and for tools; None where there is none. A run may
    be saving into ``directory`` meanwhile: a folder removed while it is read (superseded by a newer one) is read
    again from the newer (last.pt is replaced atomically, and a mapped file outlives its name)."""
    for _ in range(READ_ATTEMPTS):
        found = current(directory)
        if found is None:
            return None
        if not found.folder:
            return found, read_checkpoint(found.path)
        try:
            state = read_state(found)
            state["model"] = zero.checkpoint.read_whole(found.path, ("model",), alone=True)["model"]
            return found, state
        except (UsageError, zero.checkpoint.CheckpointError, OSError) as exc:
            error = exc if isinstance(exc, UsageError) else usage_error(exc, found.path)
            if os.path.isdir(found.path):  # not superseded: the folder itself is at fault
                raise error from None
    raise error from None  # superseded on every attempt


# ----------------------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------------------
@utils.measured_phase("checkpoint")
def save(parts: Parts, position: Position, history: list[dict[str, Any]], sums: list[list[float]]) -> None:
    """The run's state at ``position`` (every rank's epoch sums ``sums`` included) to --checkpoint-dir, in the
    format restore chose (module docstring). Every rank calls it. With --async-checkpoint it returns once this
    rank's state is staged (after the previous save is written and published: [Note: one save in flight]); the
    time the loop spends here is the save's stall, in the metrics' checkpoint_stalls_s."""
    if parts.config.checkpoint_dir is None:
        return
    start = time.perf_counter()
    wait_for_saves(parts)
    state = run_state(parts, position, history, sums)
    if parts.checkpoint_folders:
        save_folder(parts, state)
    else:
        save_file(parts, state)
    parts.checkpoint_stalls.append(time.perf_counter() - start)


def run_state(parts: Parts, position: Position, history: list[dict[str, Any]],
              sums: list[list[float]]) -> dict[str, Any]:
    """What a resume needs beside the model and the optimizer: last.pt's other keys, a folder's extra."""
    record = trajectory(parts)
    return {"world_size": parts.ctx.world_size,
            "scheduler": parts.scheduler.state_dict() if parts.scheduler is not None else None,
            "scaler": parts.scaler.state_dict(), "epoch": position.epoch, "micro_batch": position.micro_batch,
            "optimizer_steps": position.optimizer_steps, "micro_batches_total": position.micro_batches,
            "history": history, "epoch_sums": sums, "fingerprint": fingerprint(record), "config": record,
            "rng_seed": parts.config.seed}  # every random draw derives from it and the position (module docstring)


def save_folder(parts: Parts, state: dict[str, Any]) -> None:
    """DIR/step-N: every rank writes its own shards into DIR/step-N.partial (the sync's save_checkpoint), ``state``
    as rank 0's extra; then rank 0 makes it current (``write_then_publish``)."""
    directory, name = parts.config.checkpoint_dir, f"{FOLDER}{state['optimizer_steps']}"
    path = os.path.join(directory, name + PARTIAL)
    write_then_publish(parts, state, name,
                       lambda writer: parts.sync.save_checkpoint(path, parts.optimizer, state, writer=writer),
                       lambda: make_current(directory, name, parts.config.keep_checkpoints))


def save_file(parts: Parts, state: dict[str, Any]) -> None:
    """DIR/last.pt, written by rank 0: the model and the optimizer's state in the form every --zero and world size
    loads (the sharded syncs gather them to rank 0, so every rank calls this), and ``state``; then what it
    supersedes removed (``write_then_publish``)."""
    directory = parts.config.checkpoint_dir
    path = os.path.join(directory, FILE)
    write_then_publish(parts, state, FILE,
                       lambda writer: parts.sync.save_checkpoint(path, parts.optimizer, state, one_file=True,
                                                                 writer=writer),
                       lambda: forget_folders(directory))


def write_then_publish(parts: Parts, state: dict[str, Any], name: str, write: Any, publish: Any) -> None:
    """A save of DIR/``name``: ``write(writer)`` (every rank), the fault point "save" (written, not yet current),
    then rank 0's ``publish``. The disk's error on the way is refused on every rank (``settle``). With
    --async-checkpoint all of it after the copy happens in the writer's thread (``in_background``)."""
    if parts.checkpoint_writer is not None:
        in_background(parts, state, write, publish)
        return
    problem = disk_error(lambda: write(None))
    if problem is None:
        faults.at("save", parts.ctx.rank, state["optimizer_steps"], parts.config.replica_group)
    if problem is None and parts.ctx.rank == 0:  # DCP's save returns once every rank's data and the .metadata are
        problem = disk_error(publish)  # written
    settle(parts, name, problem)


def disk_error(write: Any) -> str | None:
    """``write()``, and the disk's error it raised in words (a full disk, a quota, a read-only or unwritable
    folder: zero/checkpoint/disk.py), or None; any other error raised as it is."""
    from zero.checkpoint import disk_problem
    try:
        write()
    except Exception as exc:
        problem = disk_problem(exc)
        if problem is None:
            raise
        return problem
    return None


def settle(parts: Parts, name: str, problem: str | None) -> None:
    """After a save of DIR/``name``, every rank: a disk's error that stopped it, on any rank, refused on every rank
    in one line naming the checkpoint that stays current. Rank 0 first removes what the save left (its .partial
    folder: the space it took; last.pt's temporary file is removed by atomic_write), so the previous checkpoint,
    untouched, is still the one a resume reads."""
    from zero.checkpoint import agree
    directory = parts.config.checkpoint_dir
    if problem is not None and parts.ctx.rank == 0:
        shutil.rmtree(os.path.join(directory, name + PARTIAL), ignore_errors=True)
        try:
            found = current(directory)
        except UsageError:
            found = None
        problem += (f" (the previous checkpoint {found.path} is still current)" if found is not None and
                    (name == FILE or os.path.basename(found.path) != name) else  # (last.pt: replaced atomically)
                    f" ({found.path} is current)" if found is not None else " (no earlier checkpoint)")
    problem = agree(problem, None, split=True) if dist.get_world_size() > 1 else problem
    if problem is not None:
        raise UsageError(f"cannot save checkpoint {os.path.join(directory, name)}: {problem}")


# ----------------------------------------------------------------------------------------------------------
# Saves in the background (--async-checkpoint)
# ----------------------------------------------------------------------------------------------------------
def in_background(parts: Parts, state: dict[str, Any], write: Any, publish: Any) -> None:
    """``write(writer)`` copies this rank's state into the writer's staging buffers and hands the write to its
    thread, which passes the fault point "write" first (trainer/faults.py); after the write, in the thread and
    only if it succeeded, the fault point "save" (written, not yet current) and rank 0's ``publish``. A failure
    stops the loop at the next step or save, in one line (``poll_saves``, ``wait_for_saves``); the save's
    DIR/step-N.partial is then left for the next start to remove."""
    rank, step, group = parts.ctx.rank, state["optimizer_steps"], parts.config.replica_group
    writer = parts.checkpoint_writer
    writer.before_write = lambda: faults.at("write", rank, step, group)
    write(writer)

    def published() -> None:
        faults.at("save", rank, step, group)
        if rank == 0:
            publish()
    writer.then(published)


def poll_saves(parts: Parts) -> None:
    """--async-checkpoint, after every step: a background save that failed stops the run here, in one line (the
    previous checkpoint is still current)."""
    writer = parts.checkpoint_writer
    if writer is not None and writer.error() is not None:
        try:
            writer.wait()
        except zero.checkpoint.CheckpointError as exc:
            raise background_failure(parts, exc) from None


def wait_for_saves(parts: Parts) -> None:
    """--async-checkpoint: the save in flight written and published on every rank before the next one (or the
    run's end); a failure on any rank said on all in one line (one all_gather_object)."""
    writer = parts.checkpoint_writer
    if writer is None:
        return
    problem = None
    try:
        writer.wait()
    except zero.checkpoint.CheckpointError as exc:
        problem = str(background_failure(parts, exc))
    if dist.get_world_size() > 1:
        from zero.checkpoint import agree
        problem = agree(problem, None)
    if problem:
        raise UsageError(problem)


def background_failure(parts: Parts, exc: Exception) -> UsageError:
    why = usage_error(exc, parts.config.checkpoint_dir)  # zero.checkpoint's refusal without its prefix
    return UsageError(f"the background save into --checkpoint-dir {parts.config.checkpoint_dir} failed: {why} (the "
                      f"checkpoint before it is still current)")


def finish_saves(parts: Parts) -> None:
    """The run's end: its last save written (the wait counted in checkpoint_final_wait_s) and the writer stopped."""
    if parts.checkpoint_writer is None:
        return
    start = time.perf_counter()
    wait_for_saves(parts)
    parts.checkpoint_writer.close()
    parts.checkpoint_writer = None
    parts.checkpoint_final_wait = time.perf_counter() - start


def close_writer(parts: Parts) -> None:
    """A run stopped by an error: the writer left as it is (its folder stays .partial, removed at the next start;
    the previous checkpoint is current)."""
    if parts.checkpoint_writer is not None:
        parts.checkpoint_writer.close(wait=False)
        parts.checkpoint_writer = None


# ----------------------------------------------------------------------------------------------------------
# Restore
# ----------------------------------------------------------------------------------------------------------
@utils.measured_phase("restore")
def restore(parts: Parts) -> tuple[Position, list[dict[str, Any]], list[float]]:
    """Position, finished epochs and this rank's sums of the current epoch, from --checkpoint-dir's current
    checkpoint if there is one (with --eval-only: its weights alone); and which format this run saves."""
    config = parts.config
    if config.checkpoint_dir is None:
        return Position(), [], list(NO_SUMS)
    if not config.eval_only:  # a reader (--eval-only) needs no lock
        lock(parts)
    parts.checkpoint_folders = writes_folders(parts)
    if config.async_checkpoint and not config.eval_only:
        parts.checkpoint_writer = zero.checkpoint.AsyncWriter()
    loaded = load_on_rank0(config.checkpoint_dir)
    if loaded is None:
        return Position(), [], list(NO_SUMS)
    found, state = loaded
    position = Position(optimizer_steps=state["optimizer_steps"], micro_batches=state["micro_batches_total"])
    if not config.eval_only:
        check_compatible(state, trajectory(parts), found.path, config, parts.ctx.world_size)
    # the sync reads its model and optimizer (the weights alone with --eval-only); under fp16 the scaler may have
    # skipped every step, and left some parameters without state
    stepped = position.optimizer_steps > 0 and config.amp != "fp16"
    # imported here, not at the top: DCP (and DTensor under it) is 1.4 s of every launched process's start
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        parts.sync.load_checkpoint(found.path, None if config.eval_only else parts.optimizer, stepped=stepped)
    except (zero.checkpoint.CheckpointError, CheckpointException) as exc:
        raise usage_error(exc, found.path) from None
    if config.eval_only:
        return position, list(state["history"]), list(NO_SUMS)
    if parts.scheduler is not None:
        parts.scheduler.load_state_dict(state["scheduler"])
    parts.scaler.load_state_dict(state["scaler"])
    position.epoch, position.micro_batch = state["epoch"], state["micro_batch"]
    utils.print0(f"resuming from {found.path}: epoch {position.epoch + 1}, micro-batch {position.micro_batch}, "
                 f"optimizer step {position.optimizer_steps}")
    return position, list(state["history"]), sums_carried_on(parts, state)


def sums_carried_on(parts: Parts, state: dict[str, Any]) -> list[float]:
    """This rank's sums of the epoch under way. On another number of processes with the same global batch, the
    same samples in the same micro-batches, split differently: the epoch's figures are sums over ranks, so rank 0
    carries them all on."""
    config, world_size = parts.config, parts.ctx.world_size
    saved_sums = state["epoch_sums"] if state["micro_batch"] else [NO_SUMS] * state["world_size"]
    if state["world_size"] == world_size:
        return list(saved_sums[parts.ctx.rank])
    reasons = split_dependent(config)
    if reasons:
        utils.print0(f"note: resuming a run of {state['world_size']} processes on {world_size}: with "
                     f"{' and '.join(reasons)} the weights depend on the split, so they will differ from an "
                     f"uninterrupted run's")
    totals = [sum(column) for column in zip(*saved_sums)]
    return totals if parts.ctx.rank == 0 else list(NO_SUMS)
