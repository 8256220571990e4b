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
one). --fragments, --outer-delay and --outer-compress too: a quorum per fragment's meeting, its average on
diloco.py's compressed ring over the quorum's process group (``start_meeting``, on a thread, so that R groups meet as
the R replicas of one run, bit for bit) and its vote when it is applied, --outer-delay steps later (``end_meeting``):
an aborted meeting, a group lost between the launch and the landing, is averaged again at the landing step in the
next quorum, with the same pseudo-gradients. A group that comes back joins at a peer's meeting: it takes the live
state (the shared point, the outer optimizer's state, the error feedback, the fragment in flight and where the peer
stands in its meeting) and the peer's place in it with weight 0, and brings nothing to each fragment's next meeting
(diloco.DiLoCo._meet_as_joiner).

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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import replicas
import trainer
import zero.checkpoint
from diloco import ring_allreduce_compressed
from files import atomic_write
from trainer.build import Parts
from trainer import checkpoint
from trainer.checkpoint import NO_SUMS, fingerprint, trajectory
from trainer.config import OUTER_SYNCS, Config

RUN_FILE = "replica-run"  # in --checkpoint-dir: the id of the run this group took part in (replicas.Replica's run)
IMPORTED = time.time()  # the trainer's imports done (torch's among them), for a joiner's timings


def identity_record(config: Config, record: dict[str, Any]) -> dict[str, Any]:
    """The replica groups' identity, which every group must share: the run's trajectory (``record``, the
    checkpoint's; a setting that is a flag named as one: "--lr") and, first, what the average across the groups
    depends on besides, which a checkpoint may change between a save and a resume: --allreduce (torch's collectives
    or the ring's, each with process groups and store keys of its own: groups of both never meet) and, where the
    gradient buckets are averaged (not diloco's whole pseudo-gradient), --zero (place j averages its shard j with
    place j's of the other groups: the shards must be cut alike, and a live state is a place's own shards),
    --bucket-mb at --zero 0-2 (the buckets' shapes; stage 3's units are the model's blocks) and --zero3-accumulate
    at 3 (the order a window's gradient is summed in). Not --sync-mode: it changes when the group's own all-reduce
    of a bucket starts, not the buckets nor their sums. The group's size P is in every request besides."""
    flags = {field.name for field in dataclasses.fields(Config)}
    cross = ("allreduce", "zero")
    if config.grad_sync not in OUTER_SYNCS:
        cross += ("bucket_mb",) if config.zero < 3 else ("zero3_accumulate",)
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
        self.meeting: ThreadPoolExecutor | None = None  # diloco: the thread of the average in flight
        if parts.outer is not None:  # diloco: a quorum per meeting (join_meeting, start_meeting, end_meeting)
            parts.outer.meet_through(Meeting(self))

    def _fault(self, point: str) -> None:
        """trainer/faults.py's injection, inside the average and the state transfer."""
        self.parts.faults.at(point, self.position.optimizer_steps)

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
        if self.parts.outer is not None:
            return self.parts.outer.meet_first()
        return self._join()

    def _join(self) -> bool:
        """This step's quorum joined; whether this group received the live state in it (``take_live_state`` has
        then loaded it), noted in the commit log with its timings."""
        asked = time.time()
        try:
            joined = self.replica.join(self.position.optimizer_steps)
        except replicas.RunFinished as finished:
            raise self._left_behind(finished) from None
        quorum, received = joined.quorum, joined.recovery
        if not self.run_kept and self.run_file and self.parts.ctx.rank == 0 and self.replica.run:
            with atomic_write(self.run_file) as f:  # a restart of this group is of this run (protocol: run)
                f.write(self.replica.run + "\n")
            self.run_kept = True
        if received is not None:
            self.parts.phases.end("recovery")  # the joiner's peak memory while it received and loaded (metrics)
            self.replica.note({"recovered": {"group": self.parts.config.replica_group, "step": quorum.step,
                                             "quorum": quorum.id, "source": received.source,
                                             "started": trainer.STARTED, "imported": trainer.FORKED or IMPORTED,
                                             "built": self.ready, "connected": self.connected, "asked": asked,
                                             "quorum_s": time.time() - asked - received.seconds - received.load_s,
                                             "transfer_s": received.seconds, "load_s": received.load_s,
                                             "bytes": received.bytes}})
        return received is not None

    def _left_behind(self, finished: replicas.RunFinished) -> replicas.RunFinished:
        """The run finished while this group was away: its --checkpoint-dir marked as not the run's end ([Note: left
        behind] in trainer/checkpoint/folders.py: rank 0 writes it), and the note says which step it holds."""
        directory = self.parts.config.checkpoint_dir
        if not directory or finished.end is None or checkpoint.current(directory) is None:
            return finished  # (no checkpoint: nothing a reader could take for the run's result)
        held = self.replica.durable
        record = {"held_step": held, "group": self.parts.config.replica_group, "run": self.replica.run,
                  "run_end_step": finished.end["step"], "end_group": finished.end.get("group")}
        path = os.path.join(directory, checkpoint.folders.BEHIND)
        if self.parts.ctx.rank == 0:
            checkpoint.mark_behind(directory, record)
        return replicas.RunFinished(f"{finished}; its --checkpoint-dir {directory} holds step {held}, marked as not "
                                    f"the run's end ({path})", finished.end)

    # diloco's meeting (diloco.DiLoCo.meet_through): a quorum per meeting, an average on a thread, a vote
    def join_meeting(self) -> bool:
        """A new quorum for a meeting; True where this group was behind it and took a peer's live state there."""
        return self._join()

    def start_meeting(self, sent: torch.Tensor | None, weight: float, codec: str) -> Any:
        """Launch sum_g w_g sent_g / sum_g w_g across the quorum's groups on this process's meeting thread: the
        weights' sum, then ``sent`` (this group's, a copy; None: nothing, the weights alone) averaged on diloco.py's
        compressed ring over the quorum's process group (this place's; rank: the group's place among the members), so
        that R groups meet as the R replicas of one run do, bit for bit. A quorum already aborted: nothing launched."""
        replica = self.replica
        if not replica.can_average():
            return None
        flat = None if sent is None else sent * weight  # (weight 1: the same bits)
        error = None if sent is None or codec == "none" else torch.zeros_like(sent)
        pg, members = replica.pg, replica.quorum.members
        rank, size = members.index(self.parts.config.replica_group), len(members)

        def meet() -> tuple[float, int]:
            total = torch.tensor([weight], dtype=torch.float64)
            pg.allreduce([total]).wait()  # the group's own call: torch.distributed's would, on a peer's loss, fail to
            # name the group (it is not in torch.distributed's registry) and raise a ValueError in place of the error
            sent_bytes = 0 if flat is None else ring_allreduce_compressed(flat, rank, size, pg, codec=codec,
                                                                          error=error)
            return total.item(), sent_bytes
        if self.meeting is None:
            self.meeting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-meeting")
        future = self.meeting.submit(meet)
        replica.fault("allreduce")
        return future, flat, error, size

    def end_meeting(self, handle: Any) -> tuple[bool, torch.Tensor | None, torch.Tensor | None, int]:
        """``start_meeting``'s average landed and voted on: (committed, the average or None where every weight was 0,
        this rank's error feedback, the bytes this rank sent)."""
        ok, total, sent = handle is not None, 0.0, 0
        if ok:
            try:
                total, sent = handle[0].result()
            except (RuntimeError, torch.distributed.DistError) as error:
                self.replica.failure, ok = replicas.one_line(error), False
        if not self.replica.commit(ok):
            return False, None, None, 0
        _, flat, error, size = handle
        if flat is not None and total and total != size:  # the ring divided by the members: by the weights instead
            flat *= size / total
        return True, flat if total else None, error, sent

    def live_state(self) -> dict[str, Any]:
        """What a joiner needs to continue from this rank's place (module docstring): the model and the optimizer as
        this rank holds them (zero.checkpoint.held_state: at --zero 1-3 this place's shards alone, as views), the
        rest small."""
        parts = self.parts
        return {"held": zero.checkpoint.held_state(parts.sync, parts.optimizer),
                "scheduler": parts.scheduler.state_dict() if parts.scheduler is not None else None,
                "scaler": parts.scaler.state_dict(), "position": dataclasses.asdict(self.position),
                "history": self.history, "sums": self.epoch.sums.values() if self.epoch is not None else NO_SUMS,
                "rng": torch.get_rng_state(), "outer": parts.outer.state_dict() if parts.outer is not None else None}

    def take_live_state(self, state: dict[str, Any]) -> None:
        parts = self.parts
        zero.checkpoint.load_held_state(parts.sync, parts.optimizer, state["held"])
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
        if self.meeting is not None:
            self.meeting.shutdown(wait=True)
        self.replica.close()


class Meeting:
    """diloco.DiLoCo's view of the groups' meetings (its ``meet_through``): ``join``, ``start``, ``finish``."""

    def __init__(self, groups: ReplicaGroups):
        self.join, self.start, self.finish = groups.join_meeting, groups.start_meeting, groups.end_meeting
