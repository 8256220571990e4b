"""A member: one process of one replica group (Replica), and its heartbeat. It joins each step's quorum (receiving
the live state first where it is behind), averages across the quorum's groups, votes, and applies the step only on
the quorum's commit (the package docstring's steps 1-4).

What it needs of the coordinator is the store at its address and the keys of protocol.py: it claims its group,
pushes join requests, waits for its ticket's answer and the quorum's decision, votes, and beats (its calls are
asking.py's); it holds no connection to the lighthouse itself. A coordinator lost and restarted on the same address
(its store new and empty) is ridden through: every store call that fails waits for it, up to the fault timeout
(``reconnect``), takes the step in flight as not taken and asks the new lighthouse again, state intact (the package
docstring's "Faults"). What it needs of its peers: the
quorum's process groups (made over the store, per quorum) for the average, and a StateTransport (transfer.py) for
the live state."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo

from collectives import Collectives
from replicas.asking import Asking, Reconnected
from replicas.commit_log import adopt, append_log, last_commit, lock_log, resume_log, run_of, write_log
from replicas.protocol import CONNECT_S, PREFIX, CoordinatorLost, GroupStops, Quorum, ReplicaRefused, connect, one_line
from replicas.liveness import Heartbeat
from replicas.transfer import Received, Recovery, SocketTransport, StateTransport, TornTransfer, advertised_host


@dataclass(frozen=True)
class Joined:
    """What ``Replica.join`` gives back: the step's quorum and, where this group was behind it, the state it
    received (None: it held the quorum's state)."""
    quorum: Quorum
    recovery: Recovery | None = None


class Replica(Asking):
    """One process of replica group ``group`` (the package docstring). ``state_dict()`` gives and ``load_state_dict``
    takes what a joiner needs to continue (any nesting of dicts, lists and tuples of tensors and picklable values);
    ``group_pg`` is the group's own process group (default: the default group, torchrun's world; None when the
    group is this process alone), over which the group's places agree on one incarnation. ``collectives``: "torch"
    or "ring", for the average across groups. ``commit_log``: a file (JSON lines) where place 0 writes every
    committed step; ``step``: the step this process starts from (its checkpoint's), so that a log left by this
    group's earlier processes keeps only the steps those weights have taken (the later ones are taken again).
    ``fault(point)``: called inside the average ("allreduce": its messages launched, not landed) and inside a state
    transfer ("send": half the tensors sent), where a test kills the process. ``transport(pg, fault)``: the live
    state's StateTransport for a quorum's process group (transfer.py; SocketTransport: a TCP connection of its own,
    its address sent over that group, the default; PGTransport: over that group). ``record``: the settings
    ``identity`` is the fingerprint of ({name: value}, in the order a refusal compares them), sent with every request
    so that a group of another identity is told which setting differs. ``run``: the id of the run this group took
    part in, where the caller kept it (else its commit log's note; None: a new group, which takes the run's at its
    first quorum): a coordinator whose run finished tells a group of it back late from a new run."""

    def __init__(self, coordinator: str, group: int, planned: int, identity: str,
                 state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None], *, min_groups: int = 1,
                 fault_timeout_s: float = 60.0, collectives: str = "torch", group_pg: Any = None,
                 commit_log: str | None = None, fault: Callable[[str], None] | None = None, step: int = 0,
                 transport: Callable[[Any, Callable[[str], None]], StateTransport] | None = None,
                 record: dict[str, Any] | None = None, run: str | None = None):
        self.address, self.group, self.planned, self.identity = coordinator, group, planned, identity
        self.record = record  # what ``identity`` is the fingerprint of, for a refusal to name what differs
        self.state_dict, self.load_state_dict = state_dict, load_state_dict
        self.min_groups, self.timeout_s, self.kind = min_groups, fault_timeout_s, collectives
        try:  # (SocketTransport: a joiner's address for its sources, the one it reaches the coordinator from)
            host = advertised_host(coordinator) if transport is None else None
        except ValueError as error:
            raise ReplicaRefused(f"replica group {group}: {error}") from None
        alone = not dist.is_initialized()
        self.place, self.size = (0, 1) if alone else (dist.get_rank(group_pg), dist.get_world_size(group_pg))
        self.group_pg = group_pg
        self.log_path = commit_log if self.place == 0 else None
        self.log_lock: int | None = None
        # every committed step this run knows (a joiner receives the past); an earlier process's, up to ``step``
        self.log: list[dict[str, Any]] = []
        refused = None  # the log taken (one process writes it) before connecting: refused, nothing of it beats
        try:
            if self.log_path:
                self.log_lock = lock_log(self.log_path)
                self.log = resume_log(self.log_path, step)
        except ReplicaRefused as error:
            refused = str(error)
        incarnation = [uuid.uuid4().hex[:12], refused]
        if not alone:  # every place of the group takes place 0's incarnation, and its refusal
            dist.broadcast_object_list(incarnation, group=group_pg, group_src=0)
        self.incarnation = incarnation[0]
        if incarnation[1] is not None:
            if self.log_lock is not None:  # (a process that goes on, a test's, may take the log again)
                os.close(self.log_lock)
            raise ReplicaRefused(f"replica group {group}: {incarnation[1]}")
        self.store = connect(coordinator, fault_timeout_s)  # absent: said within the fault timeout
        self.heartbeat: Heartbeat | None = None  # beating once the coordinator took this process's claim (_claim)
        self.quorum: Quorum | None = None
        self.stale = False  # the quorum is a lost coordinator's: not taken, and none of its keys is read again
        self.pg_id: int | None = None
        self.pg: Any = None
        self.comm: Collectives | None = None
        self.transports = transport or functools.partial(SocketTransport, host=host)
        self.transport: StateTransport | None = None  # the live state's way, made with the quorum's process group
        self.requests = 0
        self.failure: str | None = None  # why the last average failed
        self.run = run or run_of(self.log)  # the run this group took part in (None: a new group, of a new run)
        self.taken = False  # whether the coordinator has taken this process (its log then written back)
        self.recovered: list[dict[str, Any]] = []  # each recovery of this process: step, source, seconds, bytes
        self.durable = step  # the step this group's newest checkpoint holds (``saved``): this process started there
        self.fault = fault or (lambda point: None)

    # 1. join
    def join(self, step: int) -> Joined:
        """This step's quorum, and the live state this group received in joining it (loaded already) where it was
        behind. Every place calls it. A transfer whose other end dies before any place's state arrived aborts the
        quorum and the group asks again; after (a place's own tensors written): [Note: a torn transfer]; so too
        once the coordinator is lost and back (Reconnected), asking the new one."""
        while True:
            try:
                quorum = self._ask(step)
                self._same_step(quorum, step)
                failed, received = None, None
                try:
                    if quorum.pg != self.pg_id:
                        self._make_group(quorum)
                    received = self._transfer(quorum)
                except (RuntimeError, dist.DistError) as error:  # a member died before the group was made or the
                    failed = error  # state arrived (GroupStops: torn, this place's own tensors half written)
                # every place learns a torn place's fault here before any raises: one that stopped alone would leave
                # its peers in this collective while it gathers --zero 3's units on its way out, each waiting for
                # the other until the group's --timeout (120 s in every sharded fault scenario, before)
                torn = isinstance(failed, GroupStops)
                failed_anywhere, received_anywhere = self._agree(failed is not None, received is not None or torn)
                if torn:
                    raise failed
                if not failed_anywhere:
                    return Joined(quorum, self._load(received, quorum) if received is not None else None)
                if received_anywhere:  # a place's own tensors hold the new state, another's the old: torn
                    raise self._torn(f"joining quorum {quorum.id} failed at a place of this group after another's "
                                     f"state had arrived")
                self._abort(quorum, f"joining quorum {quorum.id} failed "
                                    f"({one_line(failed) if failed else 'at another place of this group'})")
            except Reconnected:
                continue

    def _agree(self, failed: bool, received: bool) -> tuple[bool, bool]:
        """Whether joining failed at any place of this group, and whether any received a state. Each place's transfer
        is its own: the places go on only together (one alone would wait in the group's collectives for a peer that
        asks again), and load only together (a sharded stage's load gathers across them)."""
        flags = torch.tensor([int(failed), int(received)])
        if self.size > 1:
            dist.all_reduce(flags, group=self.group_pg)
        return bool(flags[0].item()), bool(flags[1].item())

    def _torn(self, why: str) -> GroupStops:
        return GroupStops(f"replica group {self.group}: the live state's transfer was torn after it began writing "
                          f"into this group's state ({why}); the group stops, to start again from its checkpoints")

    def _same_step(self, quorum: Quorum, step: int) -> None:
        """Every place of a group at its place 0's step (which it asked with). Not so only where the places read a
        quorum's decision apart (place 0 read "commit" and another did not, the coordinator lost between): that
        place cannot take the state it lacks from its peers, so the group stops (torchrun restarts it from its
        checkpoints) rather than train on two states."""
        if quorum.step_of(self.group) != step:
            print(f"replicas: group {self.group}: place {self.place} is at step {step} and place 0 at step "
                  f"{quorum.step_of(self.group)} (a decision read apart while the coordinator was lost): the group "
                  f"stops, to start again from its checkpoints", file=sys.stderr, flush=True)
            raise self._lost("its places read the last decision apart")

    def _abort(self, quorum: Quorum, why: str) -> None:
        """This quorum's step is not taken: decided so (if nobody decided first), said once per group, and the
        process group left behind (a peer failed in it)."""
        self._call(self.store.compare_set, f"{PREFIX}decision/{quorum.id}", "", "abort")
        self.failure = why
        if self.place == 0:
            print(f"replicas: group {self.group}: step {quorum.step} not taken by quorum {quorum.id} "
                  f"{quorum.members}: {why}", file=sys.stderr, flush=True)
        self._drop_group()

    def saved(self, step: int) -> None:
        """This group's newest checkpoint now holds ``step`` (its place 0 says so in its requests: what the group
        brings back if it restarts, [Note: progress] in coordinator.py)."""
        self.durable = step

    # 2. recovery
    def _transfer(self, quorum: Quorum) -> tuple[Received, int] | None:
        """A member behind receives from its source (what it received, and from which rank; loaded by ``_load`` once
        every place has it); a source sends to each joiner it was given, its state and its commit log."""
        source = quorum.sources.get(self.group)
        received, rank = None, quorum.members.index(source) if source is not None else None
        if rank is not None:  # into this process's own tensors where it can (transfer.py)
            try:
                received = self.transport.receive(rank, into={"state": self.state_dict(), "log": None}), rank
            except TornTransfer as error:  # [Note: a torn transfer]
                raise self._torn(one_line(error)) from None
        for joiner, giver in sorted(quorum.sources.items()):
            if giver == self.group:
                self.transport.send({"state": self.state_dict(), "log": self.log}, quorum.members.index(joiner))
        return received

    def _load(self, arrived: tuple[Received, int], quorum: Quorum) -> Recovery:
        """The state a place received, loaded (every place of the group together) with the commit log."""
        received, source = arrived
        started = time.perf_counter()
        self.log = adopt(self.log, received.state["log"])
        self.load_state_dict(received.state["state"])
        recovery = Recovery(quorum.step, quorum.members[source], received.seconds, time.perf_counter() - started,
                            received.bytes)
        self.recovered.append(dataclasses.asdict(recovery))
        if self.log_path:
            write_log(self.log_path, self.log)
        return recovery

    def _make_group(self, quorum: Quorum) -> None:
        """The quorum's process groups at this place: one for the average and state, one for the ring's thread."""
        self._drop_group()
        connect = timedelta(seconds=max(quorum.fault_timeout, CONNECT_S))
        rank = quorum.members.index(self.group)
        base = PrefixStore(f"{PREFIX}pg/{quorum.pg}/{self.place}", self.store)
        groups = []
        for name in ("main",) if self.kind == "torch" else ("main", "ring"):
            groups.append(ProcessGroupGloo(PrefixStore(name, base), rank, len(quorum.members), connect))
            groups[-1].set_timeout(timedelta(seconds=quorum.fault_timeout))  # its collectives': a hang's limit
        self.pg, thread_pg = groups[0], groups[1] if len(groups) > 1 else None
        self.comm = Collectives(self.pg, self.kind, quorum.fault_timeout, thread_group=thread_pg)
        self.transport = self.transports(self.pg, self.fault)
        self.pg_id = quorum.pg

    def _drop_group(self) -> None:
        if self.comm is not None:
            self.comm.close()
        self.comm, self.pg, self.pg_id, self.transport = None, None, None, None

    # 3. average
    def can_average(self) -> bool:
        """Whether the quorum can still average: not decided already (a transfer in it failed: aborted) nor a lost
        coordinator's (else False, and ``failure`` says why). An average of the caller's own (diloco's compressed
        ring over ``pg``) asks first, as ``average`` does."""
        try:
            if self.stale or self._call(self.store.check, [f"{PREFIX}decision/{self.quorum.id}"]):
                self.failure = "the quorum was aborted before its average"
                return False
        except Reconnected:
            self.failure = "the coordinator was lost before the average"
            return False
        return True

    def average(self, tensors: list[torch.Tensor]) -> bool:
        """Each tensor averaged over the quorum's groups, in place; False (and ``failure`` says why) where a peer
        died or timed out, or the quorum was already aborted (a transfer in it failed). The coordinator lost before
        it: False (its quorum is not taken)."""
        if not self.can_average():
            return False
        try:
            pending = [self.comm.all_reduce(t, f"allreduce across replicas {i}") for i, t in enumerate(tensors)]
            self.fault("allreduce")
            for work in pending:
                work.wait()
        except (RuntimeError, dist.DistError) as error:
            self.failure = one_line(error)
            return False
        return True

    # 4. commit
    def commit(self, ok: bool, samples_of: Callable[[int], Any] | None = None) -> bool:
        """Whether the quorum applies this step (the package docstring, step 4); every place calls it. ``samples_of``:
        what group g used in this step (its samples, which every group can name: the trainer's data order is a
        function of the group and the step), written into the commit log beside the participants. The coordinator
        lost before this process read the decision: not taken, whatever the others read ([Note: lineage] gives the
        ones behind the state of the ones that applied it, in the new coordinator's first quorum)."""
        quorum, key = self.quorum, f"{PREFIX}decision/{self.quorum.id}"
        try:
            if self.stale:
                raise Reconnected
            if ok and self._call(self.store.add, f"{PREFIX}votes/{quorum.id}", 1) == quorum.voters:
                self._call(self.store.compare_set, key, "", "commit")
            elif not ok:
                self._abort(quorum, f"its average failed ({self.failure})")
            committed = self._decision(quorum.id) == b"commit"
        except Reconnected:
            committed = False
        if not committed:
            self._drop_group()  # a peer failed in it: the next quorum makes a new one
            return False
        entry = {"step": quorum.step, "quorum": quorum.id, "participants": quorum.members, "time": time.time()}
        if samples_of is not None:
            entry["samples"] = {str(g): samples_of(g) for g in quorum.members}
        self.log.append(entry)
        if self.log_path:
            append_log(self.log_path, entry)
        return True

    def finish(self, step: int) -> None:
        """This group is done at ``step``: a group that comes back later, behind it, has no one to take the state
        from, and is told so in one line instead of training on alone. The mark is the coordinator's store's, so a
        coordinator lost and restarted would forget it: until this process closes, its heartbeat sets it again on
        every new one."""
        end = json.dumps({"step": step, "group": self.group, "run": self.run, "quorum": last_commit(self.log)})
        if self.heartbeat is not None:
            self.heartbeat.carried = (PREFIX + "finished", end) if self.place == 0 else None
        if self.place == 0 and self.log_path:  # not continued by a new run (resume_log)
            self.note({"finished": step})
        while self.place == 0:
            try:
                self._call(self.store.compare_set, PREFIX + "finished", "", end)
                # until the coordinator has it where a restart of it finds it (its runs file): this process's exit
                # would otherwise take the only other copy with it; at most the fault timeout
                deadline = time.monotonic() + self.timeout_s  # (each wait is bounded by half of it)
                if self._wait_for(PREFIX + "finished_kept", gone=lambda: time.monotonic() > deadline) is None:
                    print(f"replicas: group {self.group}: the coordinator {self.address} did not say within the fault "
                          f"timeout that it keeps the run's end (its --runs-file unwritable?): restarted, it may not "
                          f"know the run finished", file=sys.stderr, flush=True)
                return
            except Reconnected:  # said to the new coordinator
                continue
            except CoordinatorLost as lost:  # the run is done all the same: this group's commit log says where
                print(f"replicas: {lost}; the run's end is kept in this group's commit log only",
                      file=sys.stderr, flush=True)
                return

    def note(self, entry: dict[str, Any]) -> None:
        """Something else worth keeping beside the committed steps (a recovery's timings), in the commit log."""
        self.log.append(entry)
        if self.log_path:
            append_log(self.log_path, entry)

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.close()
        self._drop_group()
        if self.log_lock is not None:
            os.close(self.log_lock)
            self.log_lock = None

