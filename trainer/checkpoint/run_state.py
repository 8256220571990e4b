"""The run's own state beside the model and the optimizer (``RunState``: the position in the epoch, the finished
epochs, every rank's sums of the current one, the world size and the seed), and what identifies a run: the
trajectory (the settings that decide the sequence of weights), its fingerprint, and the checks a resume makes.

A run is identified by its global batch (batch size x grad-accum x processes), not by its number of processes:
micro-batch j of an epoch holds the same B x W samples (the sampler's order, rank r taking every W-th) and
SyncBatchNorm normalizes over all of them, however they are split, so a run stopped on 2 processes resumes on 4 with
--batch-size halved and ends where it would have, up to float summation order; this is what torchrun's elastic
restarts need when a node is lost (--nnodes MIN:MAX). A resume that changes the global batch is refused with the
--batch-size that keeps it; one whose weights depend on the split (--norm local, dropout) says so and goes on. (The
micro-batches are the same where the training set divides evenly over both numbers of processes; otherwise
DistributedSampler pads each rank's shard by repeating samples, and how many depends on W.)
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import utils
from models import GPT_SIZES
from trainer.config import DILOCO_FLAGS, Config
from utils import UsageError

NO_SUMS = [0.0, 0.0, 0.0]  # a rank's [loss, correct, seen] at an epoch's start


@dataclass
class Position:
    """Where a run stands: the epoch, its next micro-batch, and the totals so far (with the weights, all a resume
    needs)."""
    epoch: int = 0
    micro_batch: int = 0
    optimizer_steps: int = 0
    micro_batches: int = 0


# ----------------------------------------------------------------------------------------------------------
# What identifies a run
# ----------------------------------------------------------------------------------------------------------
def trajectory(config: Config, data: Any, schedule_steps: int) -> dict[str, Any]:
    """The settings that decide the sequence of weights (the checkpoint's "config"); a checkpoint resumes only a
    run that agrees on all. ``data``: the run's (data.py's), ``schedule_steps``: the learning-rate schedule's
    length."""
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
    world_size = data.placement()[1]
    record["global_batch"] = config.batch_size * config.grad_accum * world_size
    record["dropout"] = config.dropout if config.model == "net" else None
    record["sizes"] = [len(data.train), data.val_size, data.num_classes] if config.dataset != "cifar100" else None
    record["norm"] = "local" if config.norm == "local" else "synchronized"  # custom and torch compute the same
    record["schedule_steps"] = schedule_steps if config.scheduler in ("onecycle", "cosine") else None
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
# The run's state, as a checkpoint holds it
# ----------------------------------------------------------------------------------------------------------
class RunState:
    """The loop's state beside the model and the optimizer (torchtitan's TrainState): ``position`` and ``history``
    (the finished epochs' entries), the loop's own objects, which it changes in place (so do replica groups, when
    they take the live state); ``sums``, every rank's sums of the epoch under way as of the next save; and the
    run's ``record`` (``trajectory``) and ``fingerprint``. Its state_dict is the checkpoint's keys of its own: last.pt
    holds them beside "model" and "optimizer", a folder as its extra."""

    def __init__(self, config: Config, record: dict[str, Any], world_size: int, rank: int):
        self.config, self.record, self.world_size, self.rank = config, record, world_size, rank
        self.fingerprint = fingerprint(record)
        self.position = Position()
        self.history: list[dict[str, Any]] = []
        self.sums: list[list[float]] = [NO_SUMS] * world_size
        self.saved_world_size = world_size  # the world ``sums`` were taken on

    def state_dict(self) -> dict[str, Any]:
        position = self.position
        return {"world_size": self.world_size, "epoch": position.epoch, "micro_batch": position.micro_batch,
                "optimizer_steps": position.optimizer_steps, "micro_batches_total": position.micro_batches,
                "history": self.history, "epoch_sums": self.sums, "fingerprint": self.fingerprint,
                "config": self.record,
                "rng_seed": self.config.seed}  # every random draw derives from it and the position (the package's doc)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's run state (once ``check_compatible`` passed): the position, the finished epochs, and every
        rank's sums of the epoch under way (this rank's: ``my_sums``)."""
        self.load_totals(state)
        self.position.epoch, self.position.micro_batch = state["epoch"], state["micro_batch"]
        self.sums = state["epoch_sums"] if state["micro_batch"] else [NO_SUMS] * state["world_size"]
        self.saved_world_size = state["world_size"]

    def load_totals(self, state: dict[str, Any]) -> None:
        """The totals and the finished epochs alone (--eval-only: the weights are read, the run not continued)."""
        self.position.optimizer_steps = state["optimizer_steps"]
        self.position.micro_batches = state["micro_batches_total"]
        self.history[:] = state["history"]

    def my_sums(self) -> list[float]:
        """This rank's sums of the epoch under way. On another number of processes with the same global batch, the
        same samples in the same micro-batches, split differently: the epoch's figures are sums over ranks, so rank
        0 carries them all on."""
        if self.saved_world_size == self.world_size:
            return list(self.sums[self.rank])
        reasons = split_dependent(self.config)
        if reasons:
            utils.print0(f"note: resuming a run of {self.saved_world_size} processes on {self.world_size}: with "
                         f"{' and '.join(reasons)} the weights depend on the split, so they will differ from an "
                         f"uninterrupted run's")
        totals = [sum(column) for column in zip(*self.sums)]
        return totals if self.rank == 0 else list(NO_SUMS)
