"""Fault-tolerant replica groups (--replica-group I --replica-groups R --coordinator HOST:PORT): this torchrun is
group I of R, each its own torchrun of P processes (``torchrun --standalone --max-restarts K``, its own
--checkpoint-dir), trained together through the replicas package's quorums, so that a lost group stops no other.

    python -m replicas serve --port 29400
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

With --grad-sync diloco (or localsgd) each group is one DiLoCo replica: its inner steps are its own, and the groups
meet only at the outer step (diloco.DiLoCo's ``meet``), where the quorum is formed, the pseudo-gradients averaged
over the groups alive and the outer step applied only if the quorum commits it (else averaged again in the next
one). A group that comes back joins at the next meeting: it takes the live state (the shared point and the outer
optimizer's state among it) and brings no pseudo-gradient of its own (weight 0), then steps like the others.

The commit log (--commit-log PATH, written by each group's rank 0) holds every committed step: its quorum, the
groups that took part and the samples each used (``samples_of``: epoch, micro-batches and data ranks, which name
them: data.py's order), so one process can replay the run (``replay``) and reach the survivors' weights; a group
that recovers appends when and from whom, and how long its start, its quorum and its transfer took: the times (s since
the epoch) its process started, its imports were done, its parts were built and its checkpoint read, it was connected
to the coordinator, and it asked to join (a restart's timeline: benchmarks/fault_benchmark.py).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

import replicas
import trainer
import utils
from trainer import faults
from trainer.build import Parts
from trainer.checkpoint import NO_SUMS, fingerprint, trajectory
from trainer.config import OUTER_SYNCS, Config

RUN_FILE = "replica-run"  # in --checkpoint-dir: the id of the run this group took part in (replicas.Replica's run)
IMPORTED = time.time()  # the trainer's imports done (torch's among them), for a joiner's timings


def identity_record(config: Config, record: dict[str, Any]) -> dict[str, Any]:
    """The replica groups' identity, which every group must share: the run's trajectory (``record``, the
    checkpoint's; a setting that is a flag named as one: "--lr") and, first, what the average across the groups
    depends on besides, which a checkpoint may change between a save and a resume: --allreduce (torch's collectives
    or the ring's, each with process groups and store keys of its own: groups of both never meet) and, where the
    gradient buckets are averaged (not diloco's whole pseudo-gradient), --bucket-mb (the buckets' shapes). Not
    --sync-mode: it changes when the group's own all-reduce of a bucket starts, not the buckets nor their sums."""
    flags = {field.name for field in dataclasses.fields(Config)}
    cross = ("allreduce",) if config.grad_sync in OUTER_SYNCS else ("allreduce", "bucket_mb")
    named = {key: getattr(config, key) for key in cross} | record
    return {f"--{key.replace('_', '-')}" if key in flags else key.replace("_", " "): value
            for key, value in named.items()}


class ReplicaGroups:
    """The loop's side of replicas.Replica for the trainer: its live state and its records. ``identity``: the run's
    fingerprint (checkpoint.fingerprint), part of the groups' identity (``identity_record``), which every group must
    share; ``step``: where this process starts (its checkpoint's optimizer steps)."""

    def __init__(self, parts: Parts, identity: str, step: int):
        self.ready = time.time()  # built, its checkpoint read: the joiner's timings
        config = parts.config
        record = identity_record(config, trajectory(config, parts.data, parts.schedule_steps))
        record["trajectory"] = identity  # (its fingerprint: the checkpoint's, of the settings above)
        self.parts = parts
        self.position: Any = None  # checkpoint.Position, the loop's
        self.history: list[dict[str, Any]] = []
        self.epoch: Any = None  # the loop's epoch under way (its sums), or None between epochs
        self.sums: list[float] = list(NO_SUMS)  # this rank's sums of the epoch under way, once the live state is taken
        self.joined = False  # diloco: whether this process has joined once (then it meets only at outer steps)
        self.run_file = os.path.join(config.checkpoint_dir, RUN_FILE) if config.checkpoint_dir else None
        run = open(self.run_file).read().strip() if self.run_file and os.path.exists(self.run_file) else None
        self.replica = replicas.Replica(
            config.coordinator, config.replica_group, config.replica_groups, fingerprint(record), self.live_state,
            self.take_live_state, min_groups=config.min_replica_groups, fault_timeout_s=config.fault_timeout,
            collectives=config.allreduce, commit_log=config.commit_log, fault=self._fault, step=step, record=record,
            run=run)
        self.run_kept = run is not None
        self.connected = time.time()
        if parts.outer is not None:  # diloco: the groups meet through this quorum's meeting
            parts.outer.meet_through(self.meet)

    def _fault(self, point: str) -> None:
        """trainer/faults.py's injection, inside the average and the state transfer."""
        faults.at(point, self.parts.ctx.rank, self.position.optimizer_steps, self.parts.config.replica_group)

    def join(self, position: Any, history: list[dict[str, Any]], epoch: Any) -> bool:
        """This step's quorum; whether the live state was taken (``position`` and ``history`` then hold the
        group's, and ``sums`` this rank's sums of the epoch under way). ``epoch``: the loop's epoch under way, or
        None between epochs. diloco: only this process's first join asks (the others are the meetings'), and it
        takes its part at once in its quorum's meeting with nothing to bring (DiLoCo.meet_as_joiner): the groups
        there at a meeting bring theirs, and a quorum of groups that all just started brings none, and applies no
        outer step."""
        self.position, self.history, self.epoch = position, history, epoch
        if self.parts.outer is not None and self.joined:
            return False
        self.joined = True
        recovered = self._join()
        if self.parts.outer is not None:
            self.parts.outer.meet_as_joiner()
        return recovered

    def _join(self) -> bool:
        """This step's quorum joined; whether this group received the live state in it (``take_live_state`` has
        then loaded it), noted in the commit log with its timings."""
        asked = time.time()
        joined = self.replica.join(self.position.optimizer_steps)
        quorum, received = joined.quorum, joined.recovery
        if not self.run_kept and self.run_file and self.parts.ctx.rank == 0 and self.replica.run:
            with utils.atomic_write(self.run_file) as f:  # a restart of this group is of this run (protocol: run)
                f.write(self.replica.run + "\n")
            self.run_kept = True
        if received is not None:
            self.replica.note({"recovered": {"group": self.parts.config.replica_group, "step": quorum.step,
                                             "quorum": quorum.id, "source": received.source,
                                             "started": trainer.STARTED, "imported": IMPORTED,
                                             "built": self.ready, "connected": self.connected, "asked": asked,
                                             "quorum_s": time.time() - asked - received.seconds - received.load_s,
                                             "transfer_s": received.seconds, "load_s": received.load_s,
                                             "bytes": received.bytes}})
        return received is not None

    def meet(self, pseudo: torch.Tensor | None) -> torch.Tensor | None:
        """diloco's meeting (diloco.DiLoCo's ``meet``): this group's pseudo-gradient (None: it has just joined and
        brings nothing, weight 0) averaged over the groups alive, once their quorum has committed it; None where no
        group brought one (no outer step then); an aborted quorum is followed by another, with the same
        pseudo-gradient. The meeting's quorum: a new one, unless this process has just joined (it is in one)."""
        joined = pseudo is None
        while True:
            if not joined and self._join():  # this group was behind (back from a hang): its pseudo-gradient is stale
                pseudo = None
            joined = False
            average = torch.zeros_like(self.parts.outer.start[0]) if pseudo is None else pseudo.clone()
            if self.replica.commit(self.replica.average([average], 0.0 if pseudo is None else 1.0)):
                return average if self.replica.total_weight else None

    def live_state(self) -> dict[str, Any]:
        """What a joiner needs to continue from this rank's place (module docstring)."""
        parts = self.parts
        return {"model": parts.model.state_dict(), "optimizer": parts.optimizer.state_dict(),
                "scheduler": parts.scheduler.state_dict() if parts.scheduler is not None else None,
                "scaler": parts.scaler.state_dict(), "position": dataclasses.asdict(self.position),
                "history": self.history, "sums": self.epoch.sums.values() if self.epoch is not None else NO_SUMS,
                "rng": torch.get_rng_state(), "outer": parts.outer.state_dict() if parts.outer is not None else None}

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
        if parts.outer is not None:
            parts.outer.load_state_dict(state["outer"])

    sent_bytes = 0  # what this rank has sent across the groups: an ideal ring's 2 (G-1)/G of each average (metrics)

    def average(self) -> bool:
        """The sync's gradient buckets (averaged in the group) averaged across the quorum's groups (diloco: an inner
        step's are the group's own); ``sent_bytes`` counts them."""
        if self.parts.outer is not None:
            return True
        buffers = self.parts.sync.held_gradient_buffers()
        averaged = self.replica.average(buffers)
        if averaged:
            groups = len(self.replica.quorum.members)
            self.sent_bytes += 2 * (groups - 1) * sum(b.numel() * b.element_size() for b in buffers) // groups
        return averaged

    def commit(self, ok: bool, position: Any, window: range) -> bool:
        """Whether the quorum applies this step; the commit log names what each participant used (diloco: an inner
        step is the group's own, applied)."""
        config, per = self.parts.config, self.parts.ctx.world_size
        if self.parts.outer is not None:
            return True

        def samples_of(group: int) -> dict[str, Any]:
            return {"epoch": position.epoch, "micro_batches": [window[0], window[-1] + 1],
                    "ranks": [group * per + j for j in range(per)]}
        return self.replica.commit(ok, samples_of if config.commit_log else None)

    def finish(self, position: Any) -> None:
        """Training is over: a group that comes back later is told so (replicas.Replica.finish)."""
        self.replica.finish(position.optimizer_steps)

    def close(self) -> None:
        self.replica.close()
