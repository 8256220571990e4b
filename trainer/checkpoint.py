"""Checkpoints and exact resume: ``save`` writes one, ``restore`` resumes from one; both on every rank.

Rank 0 writes DIR/last.pt atomically (temporary file, flush, fsync, os.replace) at epoch ends, every
--checkpoint-every steps and when --max-steps stops the run. Nothing random is carried from step to step: the data
order comes from (seed, epoch), each sample's augmentation (in memory or from an image folder) from (seed, epoch,
sample index) and dropout from a reseed with (seed, rank, optimizer step) before every step, so the checkpoint
(model, optimizer, scheduler, scaler, position in the epoch) is all a resumed run needs to continue bit for bit; a
resumed image-folder run decodes none of the samples it skips. On resume rank 0 reads the file and broadcasts it,
so other nodes need no shared file system.

"model" is the bare model's full state_dict and "optimizer" torch.optim's state_dict over the model's trainable
parameters numbered group by group, whatever --zero or --grad-sync (the sharded stages gather their shards to rank
0's CPU one bucket or unit at a time; FSDP2's DTensors are made whole), so any stage at any world size loads it.
diloco and localsgd keep each replica's weights, optimizer and outer state under "replicas" ("model": the shared
point).

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

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import utils
import zero
from models import GPT_SIZES
from trainer.build import Parts, optimizer_states
from trainer.config import DILOCO_FLAGS, OUTER_SYNCS, Config
from utils import UsageError

REQUIRED = ("model", "optimizer", "scheduler", "scaler", "epoch", "micro_batch", "optimizer_steps",
            "micro_batches_total", "fingerprint", "config", "history", "epoch_sums")
NO_SUMS = [0.0, 0.0, 0.0]  # a rank's [loss, correct, seen] at an epoch's start


@dataclass
class Position:
    """Where a run stands: the epoch, its next micro-batch, and the totals so far (with the weights, all a resume
    needs)."""
    epoch: int = 0
    micro_batch: int = 0
    optimizer_steps: int = 0
    micro_batches: int = 0


def path_of(config: Config) -> str | None:
    return os.path.join(config.checkpoint_dir, "last.pt") if config.checkpoint_dir else None


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
    # order, and SyncBatchNorm's statistics over the same B x W samples per micro-batch, for any split).
    world_size = parts.ctx.world_size
    record["global_batch"] = config.batch_size * config.grad_accum * world_size
    record["dropout"] = config.dropout if config.model == "net" else None
    record["sizes"] = [len(data.train), data.val_size, data.num_classes] if config.dataset != "cifar100" else None
    record["norm"] = "local" if config.norm == "local" else "synchronized"  # custom and torch compute the same
    record["schedule_steps"] = parts.schedule_steps if config.scheduler in ("onecycle", "cosine") else None
    if config.grad_sync in OUTER_SYNCS:  # the replicas are processes: their number is the run's too
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
# The file
# ----------------------------------------------------------------------------------------------------------
def write_atomically(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically: a crash leaves the old file or the new one, never half of one."""
    with utils.atomic_write(path, "wb") as f:
        torch.save(state, f)


def read_checkpoint(path: str) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UsageError(f"cannot read checkpoint {path}: corrupt or not written by torch.save "
                         f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}); "
                         f"delete it to start afresh") from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED):
        raise UsageError(f"cannot read checkpoint {path}: not a checkpoint of this script; delete it to start afresh")
    return state


def load_on_rank0(path: str) -> dict[str, Any] | None:
    """Rank 0 reads ``path`` (if it exists) and broadcasts it, so other nodes need not see the file."""
    message: list[Any] = [None]
    if dist.get_rank() == 0 and os.path.exists(path):
        try:
            message[0] = ("ok", read_checkpoint(path))
        except UsageError as exc:
            message[0] = ("error", str(exc))
    dist.broadcast_object_list(message, src=0)
    if message[0] is None:
        return None
    status, payload = message[0]
    if status == "error":
        raise UsageError(payload)
    return payload


# ----------------------------------------------------------------------------------------------------------
# Save and restore
# ----------------------------------------------------------------------------------------------------------
def save(parts: Parts, position: Position, history: list[dict[str, Any]], sums: list[list[float]]) -> None:
    """Rank 0 writes the run's state at ``position`` (every rank's epoch sums ``sums`` included) to DIR/last.pt;
    the optimizer's state in the form every --zero and world size loads (the sharded stages gather it first, so
    every rank calls this)."""
    path = path_of(parts.config)
    if path is None:
        return
    optimizer_state = parts.optimizer.state_dict()  # the sharded stages gather it to rank 0, every rank calls it
    model_state = parts.sync.model_state_dict()  # --zero 3, fsdp: gathered one unit at a time
    replicas = None
    if parts.outer is not None:  # every replica's own weights, optimizer and outer state; "model": the shared point
        replicas = gather_replicas(parts, model_state, optimizer_state)
        with parts.outer.global_weights():  # --zero 3: the shards hold it, gathered one unit at a time
            model_state = (parts.sync.model_state_dict() if parts.config.zero == 3 else
                           {key: value.clone() for key, value in parts.model.state_dict().items()})
    if parts.ctx.rank != 0:
        return
    record = trajectory(parts)
    write_atomically(path, {
        "model": model_state, **({"replicas": replicas} if replicas is not None else {}),
        "optimizer": optimizer_state, "world_size": parts.ctx.world_size,
        "scheduler": parts.scheduler.state_dict() if parts.scheduler is not None else None,
        "scaler": parts.scaler.state_dict(), "epoch": position.epoch, "micro_batch": position.micro_batch,
        "optimizer_steps": position.optimizer_steps, "micro_batches_total": position.micro_batches,
        "history": history, "epoch_sums": sums, "fingerprint": fingerprint(record), "config": record,
        "rng_seed": parts.config.seed,  # every random draw derives from it and the position (module docstring)
    })


def gather_replicas(parts: Parts, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> list[Any] | None:
    """Each replica's first rank sends its replica's state to rank 0 (the others hold the same); rank 0 gets them
    in replica order, the others None. With --zero 3 inside the replicas each rank's outer state is its shard's:
    every rank sends it, and a replica's "outer" is the list of its ranks' in order."""
    rank, per = parts.ctx.rank, parts.replica_size
    first, outer = rank % per == 0, parts.outer.state_dict()
    mine = {"model": model_state, "optimizer": optimizer_state, "outer": outer} if first else None
    if parts.config.zero == 3:
        mine = {"outer": outer, **({"model": model_state, "optimizer": optimizer_state} if first else {})}
    gathered: list[Any] = [None] * parts.ctx.world_size
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    if rank != 0:
        return None
    if parts.config.zero == 3:
        return [{**gathered[i * per], "outer": [state["outer"] for state in gathered[i * per:(i + 1) * per]]}
                for i in range(parts.ctx.world_size // per)]
    return [state for state in gathered if state is not None]


def outer_state(parts: Parts, replica: dict[str, Any]) -> dict[str, Any]:
    """This rank's outer state in its replica's entry (--zero 3: its place's shard's)."""
    return replica["outer"][parts.ctx.rank % parts.replica_size] if parts.config.zero == 3 else replica["outer"]


def check_optimizer_state(state: dict[str, Any], path: str, config: Config, position: Position) -> None:
    """Refuse, in one line, a checkpoint whose optimizer state lacks what --optimizer keeps for every parameter it
    has stepped (SGD's momentum, AdamW's moments and step), rather than train on from another state: the sharded
    stages once wrote SGD's without its momentum. Under --amp fp16 the scaler may have skipped every step so far,
    so there a state with no entry at all is accepted."""
    parts = optimizer_states(config, state)  # --optimizer muon: AdamW's and Muon's
    stepped = position.optimizer_steps > 0 and (config.amp != "fp16" or any(part["state"] for _, part in parts))
    problem = next(filter(None, (zero.missing_optimizer_state(kind, part, every_parameter=stepped)
                                 for kind, part in parts)), None)
    if problem:
        raise UsageError(f"checkpoint {path} cannot resume this run: its optimizer state is incomplete ({problem}); "
                         f"resume from another checkpoint, or start afresh in an empty --checkpoint-dir")


def restore(parts: Parts) -> tuple[Position, list[dict[str, Any]], list[float]]:
    """Position, finished epochs and this rank's sums of the current epoch, from DIR/last.pt if there is one (with
    --eval-only: its weights alone)."""
    config, path = parts.config, path_of(parts.config)
    state = load_on_rank0(path) if path else None
    if state is None:
        return Position(), [], list(NO_SUMS)
    position = Position(optimizer_steps=state["optimizer_steps"], micro_batches=state["micro_batches_total"])
    if config.eval_only:
        try:
            if parts.outer is not None and "replicas" in state:  # the shared point is what validation evaluates
                parts.outer.load_state_dict(outer_state(parts, state["replicas"][parts.replica]))
            parts.sync.load_model_state_dict(state["model"])
        except RuntimeError as exc:
            raise UsageError(f"checkpoint {path} does not fit --model {config.model}: "
                             f"{str(exc).splitlines()[0]}") from None
        return position, list(state["history"]), list(NO_SUMS)
    world_size = parts.ctx.world_size
    check_compatible(state, trajectory(parts), path, config, world_size)
    replica = state["replicas"][parts.replica] if parts.outer is not None else state  # its own weights, optimizer
    parts.sync.load_model_state_dict(replica["model"])
    check_optimizer_state(replica["optimizer"], path, config, position)
    parts.optimizer.load_state_dict(replica["optimizer"])
    if parts.outer is not None:
        parts.outer.load_state_dict(outer_state(parts, replica))
    if parts.scheduler is not None:
        parts.scheduler.load_state_dict(state["scheduler"])
    parts.scaler.load_state_dict(state["scaler"])
    position.epoch, position.micro_batch = state["epoch"], state["micro_batch"]
    utils.print0(f"resuming from {path}: epoch {position.epoch + 1}, micro-batch {position.micro_batch}, "
                 f"optimizer step {position.optimizer_steps}")
    saved_sums = state["epoch_sums"] if position.micro_batch else [NO_SUMS] * state["world_size"]
    if state["world_size"] == world_size:
        return position, list(state["history"]), list(saved_sums[parts.ctx.rank])
    # Another number of processes, the same global batch: the same samples in the same micro-batches, split
    # differently. The epoch's figures are sums over ranks, so rank 0 carries them all on.
    reasons = split_dependent(config)
    if reasons:
        utils.print0(f"note: resuming a run of {state['world_size']} processes on {world_size}: with "
                     f"{' and '.join(reasons)} the weights depend on the split, so they will differ from an "
                     f"uninterrupted run's")
    totals = [sum(column) for column in zip(*saved_sums)]
    return position, list(state["history"]), totals if parts.ctx.rank == 0 else list(NO_SUMS)
