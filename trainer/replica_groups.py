"""Fault-tolerant replica groups (--replica-group I --replica-groups R --coordinator HOST:PORT): this torchrun is
group I of R, each its own torchrun of P processes (``torchrun --standalone --max-restarts K``, its own
--checkpoint-dir), trained together through replicas.py's quorums, so that a lost group stops no other.

    python replicas.py serve --port 29400
    torchrun --standalone --nproc_per_node P --max-restarts 100 ddp_cifar100.py ... --replica-group 0 \\
        --replica-groups 3 --coordinator 127.0.0.1:29400 --checkpoint-dir run/group0     # and groups 1, 2

Group I's processes take the data of ranks I P .. I P + P - 1 of one R P-process run (data.py's placement), so that
without faults R groups of P processes are exactly that run (--zero 0: the model's gradients averaged in the group
by the sync, then across the quorum's groups). Each optimizer step:

- the loop asks for the step's quorum (``join``); a group behind it (restarted by torchrun from its own checkpoint,
  new, or back from a hang) receives the live state from a group at the step, place j from place j: the weights,
  the optimizer's, the scheduler's and the scaler's state, the position, the finished epochs, this rank's sums of
  the epoch under way and the generator (``live_state``, ``take_live_state``), and the commit log;
- after the window's backward, the gradient buckets (the sync's) are averaged across the quorum (``average``);
- the step is applied only if the quorum commits it (``commit``); else the loop takes the same micro-batches again
  in the next quorum.

The commit log (--commit-log PATH, written by each group's rank 0) holds every committed step: its quorum, the
groups that took part and the samples each used (``samples_of``: epoch, micro-batches and data ranks, which name
them: data.py's order), so one process can replay the run (``replay``) and reach the survivors' weights; a group
that recovers appends when and from whom, and how long its start, its quorum and its transfer took.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

import replicas
from trainer import faults
from trainer.build import Parts

STARTED = time.time()  # this process's start (near enough: the trainer's import), for a joiner's timings


NO_SUMS = [0.0, 0.0, 0.0]  # a rank's [loss, correct, seen] at an epoch's start


class ReplicaGroups:
    """The loop's side of replicas.Replica for the trainer: its live state and its records. ``identity``: the run's
    fingerprint (checkpoint.fingerprint), which every group must share; ``step``: where this process starts (its
    checkpoint's optimizer steps)."""

    def __init__(self, parts: Parts, identity: str, step: int):
        config = parts.config
        self.parts = parts
        self.position: Any = None  # checkpoint.Position, the loop's
        self.history: list[dict[str, Any]] = []
        self.epoch: Any = None  # the loop's epoch under way (its sums), or None between epochs
        self.sums: list[float] = list(NO_SUMS)  # this rank's sums of the epoch under way, once the live state is taken
        self.recovered = False
        self.replica = replicas.Replica(
            config.coordinator, config.replica_group, config.replica_groups, identity, self.live_state,
            self.take_live_state, min_groups=config.min_replica_groups, fault_timeout_s=config.fault_timeout,
            collectives=config.allreduce, commit_log=config.commit_log, fault=self._fault, step=step)

    def _fault(self, point: str) -> None:
        """trainer/faults.py's injection, inside the average and the state transfer."""
        faults.at(point, self.parts.ctx.rank, self.position.optimizer_steps, self.parts.config.replica_group)

    def join(self, position: Any, history: list[dict[str, Any]], epoch: Any) -> bool:
        """This step's quorum; whether the live state was taken (``position`` and ``history`` then hold the
        group's, and ``sums`` this rank's sums of the epoch under way). ``epoch``: the loop's epoch under way, or
        None between epochs."""
        self.position, self.history, self.epoch, self.recovered = position, history, epoch, False
        asked = time.time()
        quorum = self.replica.join(position.optimizer_steps)
        if self.recovered:
            transfer = self.replica.recovered[-1]
            self.replica.note({"recovered": {"group": self.parts.config.replica_group, "step": quorum.step,
                                             "quorum": quorum.id, "source": transfer["source"],
                                             "started": STARTED, "asked": asked,
                                             "quorum_s": time.time() - asked - transfer["seconds"],
                                             "transfer_s": transfer["seconds"], "bytes": transfer["bytes"]}})
        return self.recovered

    def live_state(self) -> dict[str, Any]:
        """What a joiner needs to continue from this rank's place (module docstring)."""
        parts = self.parts
        return {"model": parts.model.state_dict(), "optimizer": parts.optimizer.state_dict(),
                "scheduler": parts.scheduler.state_dict() if parts.scheduler is not None else None,
                "scaler": parts.scaler.state_dict(), "position": dataclasses.asdict(self.position),
                "history": self.history, "sums": self.epoch.sums.values() if self.epoch is not None else NO_SUMS,
                "rng": torch.get_rng_state()}

    def take_live_state(self, state: dict[str, Any]) -> None:
        parts = self.parts
        parts.model.load_state_dict(state["model"])
        parts.optimizer.load_state_dict(state["optimizer"])
        if parts.scheduler is not None:
            parts.scheduler.load_state_dict(state["scheduler"])
        parts.scaler.load_state_dict(state["scaler"])
        for key, value in state["position"].items():
            setattr(self.position, key, value)
        self.history[:] = state["history"]
        self.sums = list(state["sums"])
        torch.set_rng_state(state["rng"])
        self.recovered = True

    def average(self) -> bool:
        """The sync's gradient buckets (averaged in the group) averaged across the quorum's groups."""
        return self.replica.average(self.parts.sync.held_gradient_buffers())

    def commit(self, ok: bool, position: Any, window: range) -> bool:
        """Whether the quorum applies this step; the commit log names what each participant used."""
        config, per = self.parts.config, self.parts.ctx.world_size

        def samples_of(group: int) -> dict[str, Any]:
            return {"epoch": position.epoch, "micro_batches": [window[0], window[-1] + 1],
                    "ranks": [group * per + j for j in range(per)]}
        return self.replica.commit(ok, samples_of if config.commit_log else None)

    def finish(self, position: Any) -> None:
        """Training is over: a group that comes back later is told so (replicas.Replica.finish)."""
        self.replica.finish(position.optimizer_steps)

    def close(self) -> None:
        self.replica.close()
