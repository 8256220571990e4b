"""Training that never stops for a lost worker: data parallelism across replica groups that die, hang and come back,
each step taken by the groups alive at its start, and a group that (re)joins given the live state by a healthy peer
instead of from disk. torchft's design (a quorum per step through a small coordinator, process groups made afresh
per quorum, a step applied only once every participant finished it) on torch's own parts: the coordinator is a
TCPStore (torchrun's c10d rendezvous store), each quorum's process group a ProcessGroupGloo over a PrefixStore of
it, the collectives this toolkit's (collectives.py: torch's, or allreduce.py's ring).

    python replicas.py serve --port 29400                          # the coordinator: a TCPStore and its lighthouse
    replica = replicas.Replica("host:29400", group=I, planned=R, identity=fingerprint,
                               state_dict=fn, load_state_dict=fn)   # in every process of replica group I
    while training:
        replica.join(step)                    # the groups in this step; a group behind receives the live state
        loss.backward()                       # the group's own data parallelism inside it (any sync)
        ok = replica.average(flats)           # the gradients averaged over the quorum's groups
        if replica.commit(ok, samples_of):    # every participant finished: all apply the step, or none
            optimizer.step(); step += 1
        optimizer.zero_grad()
    replica.close()

Terms. A replica group is P processes that train one model together (a torchrun of its own: its own process group,
its own checkpoints); R groups are planned, any number are alive. Process j of a group is its place j; the places j
of a quorum's groups form that quorum's process group at place j, over which gradients are averaged and state is
sent. The coordinator, ``replicas.py serve``, is a TCPStore with a lighthouse beside it (Lighthouse), the one
process that decides who is in each quorum; everything else the members settle among themselves through the store.
``samples_of(g)`` names what group g used in the step (the trainer's data order is a function of group and step).

One step, quorum n, members M:
1. join: each group's place 0 asks to join (its step, identity and size, in the store's event queue); the
   lighthouse forms quorum n once every member of n-1 has asked, is gone (a heartbeat older than STALE_S) or is
   late (the fault timeout since n-1's decision; but where no group that asked holds the last committed step, the
   processes that committed it are waited for until they ask, are gone, or LINEAGE_WAITS fault timeouts have
   passed: [Note: lineage]), with every new group that asked, if at least ``min_groups`` did (else it waits), and
   answers each ticket with it. A group of another identity (model, optimizer, flags: the trainer's fingerprint) is
   refused in one line, alone.
2. recovery: a member not at the quorum's state (behind its step: new, restarted, back from a hang; or at it by
   another branch: [Note: lineage]) receives, place j from place j of a member that holds it, what ``state_dict``
   names (the trainer's: weights, optimizer state, position, scheduler, generators, commit log) and loads it: no
   disk. It then computes its gradient on the live weights like any member.
3. average: each member's gradient (its own group's average) summed over the quorum and divided by |M|, on the
   quorum's process group: the mean over every sample the step used, since groups take equal batches.
4. commit: every process of every member adds one to the quorum's vote count once its average finished, and the
   last vote writes "commit"; a failed average writes "abort", and so does the lighthouse for a member silent past
   the fault timeout. The first word written is the quorum's decision (the store's compare_set): every member applies
   the step on "commit", none on "abort", and the next quorum takes the aborted step again (one step lost at most).

Why it is exact. A step's update is the mean gradient of the samples its participants used, each computed on the
same weights (a joiner computes only after receiving them), applied by every participant or by none; so the weights
after any run are those of one process that applies, step by step, the mean gradient of the committed steps'
samples: the commit log (per committed step: its quorum, its participants and each one's samples) is enough to
replay the run, and tests do, within 1e-10 in float64. Without faults every step has every group, and R groups of P
processes are one data-parallel run of R P processes.

Faults. A SIGKILLed process closes its sockets: the quorum's average fails at once on every member (gloo reports
the closed peer), they vote abort, ask to join again, and the lighthouse forms the next quorum without the dead
group once its heartbeat is STALE_S old: the survivors lose the step they were in and about STALE_S of waiting.
A hung process (SIGSTOP) holds the average until its timeout (``fault_timeout_s``); woken (SIGCONT), it finds its
quorum decided (abort, or commit if it had voted) and its next join behind, so it recovers. The coordinator gone,
every store call fails: every process says so in one line (CoordinatorLost) and stops; checkpoints are as they were.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from collectives import Collectives

PREFIX = "replicas/"  # every key of the protocol, under the store's root
HEARTBEAT_S = 0.1  # how often every process says it is alive
STALE_S = 1.0  # a heartbeat this old: the process is gone (killed or stopped), for forming the next quorum
FIRST_WAIT_S = 5.0  # the first quorum waits this long for every planned group once one has asked
LINEAGE_WAITS = 10  # the fault timeouts the lighthouse waits, at most, for the holders of the last committed step
TICK_S = 0.005  # the lighthouse's poll of its event queue and of the open quorum's decision
WATCH_S = 0.05  # ... and of the heartbeats, when no request came meanwhile
MESSAGE_BYTES = 64 * 2**20  # a state transfer's message
FINISHED = "the run finished"  # how a refusal of a group back after the end begins (RunFinished)
CONNECT_S = 10.0  # the least time to connect to the store, or a quorum's process group (a loaded machine's processes)


class CoordinatorLost(RuntimeError):
    """The coordinator cannot be reached: one line, naming it."""


class ReplicaRefused(ValueError):
    """The lighthouse refused this group (another identity, another size): one line, why."""


class RunFinished(ReplicaRefused):
    """The run finished while this group was away: nothing is left for it to do. Not a failure: a torchrun that
    restarted the group after a fault need not restart it again (its process ends with 0)."""


def connect(address: str, timeout_s: float) -> TCPStore:
    """A client of the coordinator's store at HOST:PORT; one that cannot be reached in ``timeout_s`` is one line."""
    host, _, port = address.rpartition(":")
    try:
        return TCPStore(host or "127.0.0.1", int(port), is_master=False, wait_for_workers=False,
                        timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as error:
        raise CoordinatorLost(f"coordinator {address} unreachable ({one_line(error)}): start it with `python "
                              f"replicas.py serve --port {port}`") from None


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


# ----------------------------------------------------------------------------------------------------------
# The lighthouse: who is in each quorum
# ----------------------------------------------------------------------------------------------------------
@dataclass
class Asked:
    """A group's latest request to join, as the lighthouse holds it."""
    request: dict[str, Any]
    at: float  # the lighthouse's clock when it came


class Lighthouse:
    """Forms the quorums (module docstring, step 1) from the join requests in the store's event queue, and aborts a
    quorum whose member went silent. It keeps no state that the members need besides the store's keys: quorum/n
    (the quorum), ticket/T (its answer to request T), decision/n (written by members, or by it on silence)."""

    def __init__(self, store: TCPStore):
        self.store = store
        self.quorum: dict[str, Any] | None = None  # the last one formed
        self.frontier: tuple[int, int] | None = None  # (step, quorum) of the last step committed ([Note: lineage])
        self.holders: dict[str, str] = {}  # group -> incarnation: the processes that committed it (they hold that
        # state until they commit again)
        self.asked: dict[int, Asked] = {}  # group -> its request for the next quorum
        self.beats: dict[str, tuple[bytes, float]] = {}  # heartbeat key -> (value, when it last changed)
        self.places: dict[int, int] = {}  # group -> its size P, from its requests
        self.tickets: dict[int, list[str]] = {}  # quorum -> the tickets it answered
        self.first_asked: float | None = None
        self.decided_at: float | None = None
        self.said: str | None = None

    def run(self, stop: threading.Event | None = None) -> None:
        watched = 0.0
        while stop is None or not stop.is_set():
            asked = self._take_requests()
            decided = self.quorum is None or self._decided()
            if asked or time.monotonic() - watched > WATCH_S:
                self._watch_heartbeats()
                watched = time.monotonic()
                if decided:
                    self._form()
                else:
                    self._abort_if_silent()
            time.sleep(TICK_S)

    def _take_requests(self) -> int:
        """The requests in the queue (how many). Once a quorum exists, one of another identity or size is refused at
        once; a newer start of a group replaces the older's request (which is told so: that process is gone, or is
        not the group it says)."""
        queue, taken = PREFIX + "events", 0
        while self.store.queue_len(queue):
            taken += 1
            request = json.loads(self.store.queue_pop(queue, False))
            group = request["group"]
            why = self._unfit(request, self.quorum) if self.quorum is not None else None
            older = self.asked.get(group)
            if why is None and older is not None and older.request["ticket"].split("/")[1] != \
                    request["ticket"].split("/")[1]:
                self._refuse(older.request, f"replaced by a newer start of replica group {group}")
            if why is not None:
                self._refuse(request, why)
                continue
            self.places[group] = request["size"]
            self.asked[group] = Asked(request, time.monotonic())
            self.first_asked = self.first_asked or time.monotonic()
        return taken

    def _unfit(self, request: dict[str, Any], reference: dict[str, Any]) -> str | None:
        """Why a group may not join the run (None: it may)."""
        if request["identity"] != reference["identity"]:
            return "another configuration (its fingerprint differs)"
        if request["size"] != reference["size"]:
            return f"{request['size']} processes, where the run's replica groups have {reference['size']}"
        finished = json.loads(self.store.get(PREFIX + "finished")) if self.store.check([PREFIX + "finished"]) else None
        if finished is not None and request["step"] < finished["step"]:
            return (f"{FINISHED} at step {finished['step']} while this group was away (it is at step "
                    f"{request['step']}): no group is left to take the live state from, and nothing is left to "
                    f"train; the run's weights are the other groups'")
        return None

    def _refuse(self, request: dict[str, Any], why: str) -> None:
        self.store.set(f"{PREFIX}ticket/{request['ticket']}",
                       json.dumps({"refused": f"replica group {request['group']} refused by the coordinator: {why}",
                                   "finished": why.startswith(FINISHED)}))

    def _watch_heartbeats(self) -> None:
        keys = [f"{PREFIX}hb/{g}/{j}" for g, size in self.places.items() for j in range(size)]
        present = [key for key in keys if self.store.check([key])]
        now = time.monotonic()
        for key, value in zip(present, self.store.multi_get(present) if present else []):
            if self.beats.get(key, (None, 0.0))[0] != value:
                self.beats[key] = (value, now)

    def _silent_for(self, group: int) -> float:
        """Seconds since the staler of the group's places last beat (inf: never seen)."""
        now = time.monotonic()
        return max(now - self.beats.get(f"{PREFIX}hb/{group}/{j}", (None, -float("inf")))[1]
                   for j in range(self.places.get(group, 1)))

    def _may_hold(self, group: int, incarnation: str) -> bool:
        """Whether that incarnation of the group may still hold the state it committed: every place's last heartbeat
        says that incarnation (a heartbeat's value is INCARNATION/COUNT: a restarted process no longer holds it), and
        none has been silent past the fault timeout (a stopped or starved process, not yet taken for dead)."""
        keys = [f"{PREFIX}hb/{group}/{j}" for j in range(self.places.get(group, 1))]
        return self._silent_for(group) <= self.quorum["fault_timeout"] and all(
            self.beats.get(key, (b"",))[0].split(b"/")[0] == incarnation.encode() for key in keys)

    def _decided(self) -> bool:
        """Whether the open quorum is decided; the first time it is seen so, committed, its state is the run's."""
        key = f"{PREFIX}decision/{self.quorum['id']}"
        decided = self.store.check([key])
        if decided and self.decided_at is None:
            self.decided_at = time.monotonic()
            if self.store.get(key) == b"commit":
                self.frontier, self.holders = (self.quorum["step"] + 1, self.quorum["id"]), self.quorum["processes"]
        return decided

    def _abort_if_silent(self) -> None:
        quorum = self.quorum
        silent = [g for g in quorum["members"] if self._silent_for(g) > quorum["fault_timeout"]]
        if silent:
            self.store.compare_set(f"{PREFIX}decision/{quorum['id']}", "", "abort")

    def _form(self) -> None:
        """The next quorum, when its conditions hold (module docstring, step 1)."""
        alive = {g: asked for g, asked in self.asked.items() if self._silent_for(g) <= STALE_S}
        if not alive:
            return
        if self.quorum is None:
            planned = max(asked.request["planned"] for asked in alive.values())
            if len(alive) < planned and time.monotonic() - self.first_asked < FIRST_WAIT_S:
                return
        else:
            late = time.monotonic() - self.decided_at > self.quorum["fault_timeout"]
            waiting_for = [g for g in self.quorum["members"]
                           if g not in alive and self._silent_for(g) <= STALE_S and not late]
            if waiting_for:
                return
            away = [int(g) for g, incarnation in self.holders.items()
                    if int(g) not in alive and self._may_hold(int(g), incarnation)]
            if away and not any((a.request["step"], a.request.get("last_commit")) == self.frontier
                                for a in alive.values()):
                waited = time.monotonic() - self.decided_at
                if waited <= LINEAGE_WAITS * self.quorum["fault_timeout"]:
                    self._say(f"waiting for replica group(s) {away}: the only holders of the last committed step, "
                              f"not gone ([Note: lineage])")
                    return
                self._say(f"replica group(s) {away} hold the last committed step (step {self.frontier[0]}) but have "
                          f"not asked to join in {waited:.0f} s ({LINEAGE_WAITS} fault timeouts): the others go on "
                          f"from their older state, which the holders will receive, losing their steps since it")
        needed = max(asked.request["min_groups"] for asked in alive.values())
        members = sorted(self._admissible(alive))
        if len(members) < needed:
            self._say(f"waiting: {len(members)} replica group(s) alive, --min-replica-groups {needed}")
            return
        self._publish(members)

    def _admissible(self, alive: dict[int, Asked]) -> list[int]:
        """The groups that may join: of the quorum's identity and size (the first quorum: the most common), the
        others refused in one line each."""
        requests = [asked.request for asked in alive.values()]
        reference = self.quorum or max(({"identity": r["identity"], "size": r["size"]} for r in requests),
                                       key=lambda ref: sum(r["identity"] == ref["identity"] for r in requests))
        members = []
        for group, asked in alive.items():
            why = self._unfit(asked.request, reference)
            if why:
                self._refuse(asked.request, why)
                del self.asked[group]
            else:
                members.append(group)
        return members

    def _publish(self, members: list[int]) -> None:
        previous = self.quorum
        n = 0 if previous is None else previous["id"] + 1
        requests = {g: self.asked.pop(g).request for g in members}
        steps = {g: request["step"] for g, request in requests.items()}
        # whether it committed, as _decided read it (the frontier is its step then)
        committed = previous is not None and self.frontier == (previous["step"] + 1, previous["id"])
        states = {g: (request["step"], request.get("last_commit")) for g, request in requests.items()}
        reference = self.frontier if self.frontier in states.values() else max(
            states.values(), key=lambda state: (state[0], -1 if state[1] is None else state[1]))
        step = reference[0]
        healthy = [g for g in members if states[g] == reference]
        behind = [g for g in members if states[g] != reference]
        processes = {str(g): request["ticket"].split("/")[1] for g, request in requests.items()}  # incarnations
        same_groups = committed and previous["processes"] == processes
        quorum = {"id": n, "members": members, "steps": {str(g): s for g, s in steps.items()}, "step": step,
                  "sources": {str(g): healthy[i % len(healthy)] for i, g in enumerate(behind)},
                  "pg": previous["pg"] if same_groups else n, "processes": processes,
                  "size": requests[members[0]]["size"],
                  "identity": requests[members[0]]["identity"],
                  "fault_timeout": max(request["fault_timeout"] for request in requests.values())}
        tickets = [request["ticket"] for request in requests.values()]
        keys = [f"{PREFIX}quorum/{n}", *(f"{PREFIX}ticket/{ticket}" for ticket in tickets)]
        self.store.multi_set(keys, [json.dumps(quorum)] * len(keys))
        # after the tickets' keys: a member that finds answered/G at or past its ticket, and its ticket's key gone,
        # knows it was answered and forgotten (Replica._forgotten)
        self.store.multi_set([f"{PREFIX}answered/{g}" for g in requests], tickets)
        self.tickets[n] = tickets
        self.quorum, self.decided_at, self.said = quorum, None, None
        if previous is not None:
            self._forget(previous["id"] - 1)

    # [Note: lineage] A step number alone does not say which state a group holds. A member of the last quorum may
    # be slow to ask again (a loaded machine); past the fault timeout the lighthouse forms the next quorum without
    # it, and a group left out of that last quorum takes the same step again from the state before it: two groups
    # then reach step s + 1 by different steps s. Counted both at the step, they would average gradients computed on
    # different weights and stay apart for good (seen under load: two groups 0.055 apart after 450 steps). So each
    # group also says which quorum committed its last step, and the lighthouse keeps the last committed one (the
    # frontier): the quorum's state is the frontier where a member holds it, else the most advanced a member holds,
    # and every member not holding exactly that state receives it, whatever its step number. The branch it drops
    # goes with its commit log, replaced by its source's: the weights stay the replay of the log they carry.
    # Nor does the lighthouse let a quorum of groups that are all behind the frontier go on from an older state while
    # a process that holds the frontier has not asked yet but is not gone (a long evaluation or save, a loaded
    # machine that starved its heartbeat): that quorum's steps would replace every step since its state once the
    # holders came back and received it. It waits for them until they ask, restart (their heartbeat names another
    # process), are silent past the fault timeout (dead or hung), or LINEAGE_WAITS fault timeouts have passed since
    # the last decision: a holder whose heartbeat thread beats while its training is stuck must not stall the run
    # for good, and going on from the older state is then said in one line.

    def _forget(self, n: int) -> None:
        """The keys of quorum n, long decided (the store would otherwise grow by a few keys a step); ``forgotten``
        says so first, for a member that was stopped while waiting for them (Replica._decision; a ticket's member
        finds answered/G past it, Replica._forgotten)."""
        self.store.set(PREFIX + "forgotten", str(n))
        for key in (f"quorum/{n}", f"votes/{n}", f"decision/{n}", *(f"ticket/{t}" for t in self.tickets.pop(n, []))):
            self.store.delete_key(PREFIX + key)

    def _say(self, text: str) -> None:
        if text != self.said:
            print(f"replicas.py serve: {text}", flush=True)
            self.said = text


def serve(port: int, host: str = "0.0.0.0") -> None:
    """The coordinator: a TCPStore server on HOST:PORT and the lighthouse, until the process is stopped."""
    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    print(f"replicas.py serve: coordinator on {host}:{store.port}", flush=True)
    Lighthouse(store).run()


# ----------------------------------------------------------------------------------------------------------
# A member: one process of one replica group
# ----------------------------------------------------------------------------------------------------------
@dataclass
class Quorum:
    """One step's quorum, as the lighthouse formed it."""
    id: int
    members: list[int]
    steps: dict[int, int]  # each member's step when it asked
    step: int  # the step the quorum takes: the most advanced member's
    sources: dict[int, int]  # member behind -> the member it receives the state from
    pg: int  # the quorum whose process group this one uses (a new one when a member is a new process, after an abort)
    size: int  # P, processes per group
    fault_timeout: float = 60.0
    voters: int = field(init=False)

    def __post_init__(self) -> None:
        self.voters = len(self.members) * self.size

    @classmethod
    def parse(cls, text: bytes) -> Quorum:
        raw = json.loads(text)
        return cls(raw["id"], raw["members"], {int(g): s for g, s in raw["steps"].items()}, raw["step"],
                   {int(g): s for g, s in raw["sources"].items()}, raw["pg"], raw["size"], raw["fault_timeout"])


class Heartbeat:
    """A thread that sets this process's heartbeat key every HEARTBEAT_S, on a store client of its own, to
    INCARNATION/COUNT (the lighthouse tells a restarted process from the one it replaced)."""

    def __init__(self, address: str, key: str, timeout_s: float, incarnation: str = ""):
        self.store, self.key, self.incarnation = connect(address, timeout_s), key, incarnation
        self.stop, self.lost = threading.Event(), None
        self.store.set(key, f"{incarnation}/0")
        self.thread = threading.Thread(target=self._beat, name="replica-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        beats = 0
        while not self.stop.wait(HEARTBEAT_S):
            beats += 1
            try:
                self.store.set(self.key, f"{self.incarnation}/{beats}")
            except RuntimeError as error:  # the coordinator is gone: the main thread says so at its next call
                self.lost = one_line(error)
                return

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class Replica:
    """One process of replica group ``group`` (module docstring). ``state_dict()`` gives and ``load_state_dict``
    takes what a joiner needs to continue (any nesting of dicts, lists and tuples of tensors and picklable values);
    ``group_pg`` is the group's own process group (default: the default group, torchrun's world; None when the
    group is this process alone), over which the group's places agree on one incarnation. ``collectives``: "torch"
    or "ring", for the average across groups. ``commit_log``: a file (JSON lines) where place 0 writes every
    committed step; ``step``: the step this process starts from (its checkpoint's), so that a log left by this
    group's earlier processes keeps only the steps those weights have taken (the later ones are taken again).
    ``fault(point)``: called inside the average ("allreduce": its messages launched, not landed) and inside a state
    transfer ("send": half the tensors sent), where a test kills the process."""

    def __init__(self, coordinator: str, group: int, planned: int, identity: str,
                 state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None], *, min_groups: int = 1,
                 fault_timeout_s: float = 60.0, collectives: str = "torch", group_pg: Any = None,
                 commit_log: str | None = None, fault: Callable[[str], None] | None = None, step: int = 0):
        self.address, self.group, self.planned, self.identity = coordinator, group, planned, identity
        self.state_dict, self.load_state_dict = state_dict, load_state_dict
        self.min_groups, self.timeout_s, self.kind = min_groups, fault_timeout_s, collectives
        alone = not dist.is_initialized()
        self.place, self.size = (0, 1) if alone else (dist.get_rank(group_pg), dist.get_world_size(group_pg))
        incarnation = [uuid.uuid4().hex[:12]]
        if not alone:
            dist.broadcast_object_list(incarnation, group=group_pg, group_src=0)
        self.incarnation = incarnation[0]
        self.store = connect(coordinator, max(fault_timeout_s, CONNECT_S))
        self.heartbeat = Heartbeat(coordinator, f"{PREFIX}hb/{group}/{self.place}", max(fault_timeout_s, CONNECT_S),
                                   self.incarnation)
        self.quorum: Quorum | None = None
        self.pg_id: int | None = None
        self.pg: Any = None
        self.comm: Collectives | None = None
        self.requests = 0
        self.failure: str | None = None  # why the last average failed
        self.total_weight: float | None = None  # the last weighted average's sum of the groups' weights
        self.log: list[dict[str, Any]] = []  # every committed step this run knows (a joiner receives the past)
        self.log_path = commit_log if self.place == 0 else None
        if self.log_path and os.path.exists(self.log_path):  # an earlier process of this group's: up to ``step``
            self.log = [entry for entry in read_log(self.log_path, steps_only=False)
                        if entry.get("step", entry.get("recovered", {}).get("step", 0)) < step]
            write_log(self.log_path, self.log)
        self.recovered: list[dict[str, Any]] = []  # each recovery of this process: step, source, seconds, bytes
        self.fault = fault or (lambda point: None)

    # the store, with the coordinator's loss said in one line
    def _lost(self, why: str) -> CoordinatorLost:
        return CoordinatorLost(f"replica group {self.group}: the coordinator {self.address} is gone ({why}); this "
                               f"group stops, its checkpoints as they were")

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as error:  # torch.distributed's DistError and its kin
            raise self._lost(one_line(error)) from None

    def _wait_for(self, key: str, gone: Callable[[], bool] | None = None) -> bytes | None:
        """The value of ``key`` once it is set (however long: below min_groups the lighthouse waits); None once
        ``gone()`` says it was deleted, or will never be set."""
        while True:
            if self.heartbeat.lost:
                raise self._lost(self.heartbeat.lost)
            try:
                self.store.wait([key], timedelta(seconds=self.timeout_s))
            except RuntimeError as error:
                if not (isinstance(error, dist.DistStoreError) and "timeout" in str(error).lower()):
                    raise self._lost(one_line(error)) from None
                if gone is not None and gone():
                    return None
                continue
            try:
                return self.store.get(key)
            except RuntimeError as error:
                if gone is not None and gone():  # deleted between the wait and the get: stopped there (SIGSTOP)
                    return None
                raise self._lost(one_line(error)) from None

    def _decision(self, quorum_id: int) -> bytes:
        """decision/n once set, b"commit" or b"abort". A process stopped long enough finds quorum n forgotten (the
        lighthouse deletes its keys at quorum n + 2): it was decided without this group, which takes it as not
        taken; the next quorum gives it the state it missed ([Note: lineage]), as after an abort."""
        def forgotten() -> bool:
            return (self._call(self.store.check, [PREFIX + "forgotten"])
                    and int(self._call(self.store.get, PREFIX + "forgotten")) >= quorum_id)
        return self._wait_for(f"{PREFIX}decision/{quorum_id}", gone=forgotten) or b"abort"

    # 1. join
    def join(self, step: int) -> Quorum:
        """This step's quorum; behind it, the live state received (and loaded) first. Every place calls it. A
        transfer whose other end dies aborts the quorum, and this process asks again (the state it had is intact:
        a joiner loads only what it received whole)."""
        while True:
            quorum = self._ask(step)
            try:
                if quorum.pg != self.pg_id:
                    self._make_group(quorum)
                self._transfer(quorum)
                return quorum
            except (RuntimeError, dist.DistError) as error:  # a member died before the group was made or the state
                self._abort(quorum, f"joining quorum {quorum.id} failed ({one_line(error)})")  # arrived

    def _abort(self, quorum: Quorum, why: str) -> None:
        """This quorum's step is not taken: decided so (if nobody decided first), said once per group, and the
        process group left behind (a peer failed in it)."""
        self._call(self.store.compare_set, f"{PREFIX}decision/{quorum.id}", "", "abort")
        self.failure = why
        if self.place == 0:
            print(f"replicas: group {self.group}: step {quorum.step} not taken by quorum {quorum.id} "
                  f"{quorum.members}: {why}", file=sys.stderr, flush=True)
        self._drop_group()

    def _ask(self, step: int) -> Quorum:
        """Ask the lighthouse (place 0 asks, every place waits for the answer to the same ticket), saying the step
        this group's state is at and the quorum that committed the step before it ([Note: lineage]). A ticket
        answered while this process was stopped (SIGSTOP), its quorum since forgotten, went on without it: ask
        again."""
        answer = None
        while answer is None:
            self.requests += 1
            ticket = f"{self.group}/{self.incarnation}/{self.requests}"
            if self.place == 0:
                last_commit = next((entry["quorum"] for entry in reversed(self.log) if "step" in entry), None)
                request = {"ticket": ticket, "group": self.group, "step": step, "last_commit": last_commit,
                           "identity": self.identity, "size": self.size, "planned": self.planned,
                           "min_groups": self.min_groups, "fault_timeout": self.timeout_s}
                self._call(self.store.queue_push, PREFIX + "events", json.dumps(request))
            answer = self._wait_for(f"{PREFIX}ticket/{ticket}", gone=lambda: self._forgotten(ticket))
            if answer is None and self.place == 0:
                print(f"replicas: group {self.group}: the answer to its request {self.requests} came and was "
                      f"forgotten while it was stopped: asking again", file=sys.stderr, flush=True)
        if b"refused" in answer[:12]:
            refusal = json.loads(answer)
            raise (RunFinished if refusal.get("finished") else ReplicaRefused)(refusal["refused"])
        self.quorum = Quorum.parse(answer)
        return self.quorum

    def _forgotten(self, ticket: str) -> bool:
        """Whether the lighthouse answered ``ticket`` and has since forgotten its quorum (deleted the answer with
        the quorum's keys, Lighthouse._forget): answered/G names this ticket or a later one of this process, and the
        ticket's key is gone. Read in that order: the lighthouse sets the ticket's key before answered/G."""
        key = f"{PREFIX}answered/{self.group}"
        if not self._call(self.store.check, [key]):
            return False
        _, incarnation, number = self._call(self.store.get, key).decode().split("/")
        mine = ticket.split("/")
        return (incarnation == mine[1] and int(number) >= int(mine[2])
                and not self._call(self.store.check, [f"{PREFIX}ticket/{ticket}"]))

    def _transfer(self, quorum: Quorum) -> None:
        """2. recovery: a member behind receives from its source; a source sends to each joiner it was given."""
        source = quorum.sources.get(self.group)
        if source is not None:
            self._receive_state(quorum.members.index(source), quorum)
        for joiner, giver in sorted(quorum.sources.items()):
            if giver == self.group:
                self._send_state(quorum.members.index(joiner))

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
        self.pg_id = quorum.pg

    def _drop_group(self) -> None:
        if self.comm is not None:
            self.comm.close()
        self.comm, self.pg, self.pg_id = None, None, None

    # 2. recovery
    def _send_state(self, joiner: int) -> None:
        """This place's state to the joiner's same place: a pickled skeleton (the tensors' places, shapes and
        dtypes), then the tensors in messages of about MESSAGE_BYTES (gloo moves one large message over loopback
        about twice as fast as many small ones: 0.8 against 0.4 GB/s measured here), a tensor larger than that alone.
        The group's own send (allreduce.place_in: torch.distributed's blocking send refuses a group it did not make)."""
        skeleton, tensors = split_tensors({"state": self.state_dict(), "log": self.log})
        header = torch.frombuffer(bytearray(pickle.dumps(skeleton)), dtype=torch.uint8)
        messages = [[torch.tensor([header.numel()], dtype=torch.int64)], [header]]
        messages += [[tensors[i] for i in message] for message in messages_of(skeleton["tensors"])]
        for n, message in enumerate(messages):
            if n == len(messages) // 2:
                self.fault("send")
            flat = message[0].detach().reshape(-1) if len(message) == 1 else torch.cat(
                [t.detach().reshape(-1) for t in message])
            self.pg.send([flat.contiguous().cpu()], joiner, 0).wait()

    def _receive_state(self, source: int, quorum: Quorum) -> None:
        started = time.perf_counter()

        def receive(count: int, dtype: torch.dtype) -> torch.Tensor:
            flat = torch.empty(count, dtype=dtype)
            self.pg.recv([flat], source, 0).wait()
            return flat

        length = receive(1, torch.int64)
        skeleton = pickle.loads(receive(int(length), torch.uint8).numpy().tobytes())
        shapes = skeleton["tensors"]
        tensors: list[torch.Tensor] = [torch.empty(0)] * len(shapes)
        for message in messages_of(shapes):
            sizes = [math.prod(shapes[i][0]) for i in message]
            flat = receive(sum(sizes), shapes[message[0]][1])
            for i, part in zip(message, flat.split(sizes)):
                tensors[i] = part.view(shapes[i][0])  # a view of the message: nothing copied here
        received, arrived = join_tensors(skeleton, tensors), time.perf_counter()
        notes = [entry for entry in self.log if "step" not in entry and entry not in received["log"]]
        self.log = received["log"] + notes  # the source's steps (this group's own are another branch), every note
        self.load_state_dict(received["state"])
        self.recovered.append({"step": quorum.step, "source": quorum.members[source], "seconds": arrived - started,
                               "load_s": time.perf_counter() - arrived,
                               "bytes": int(sum(t.numel() * t.element_size() for t in tensors))})
        if self.log_path:
            write_log(self.log_path, self.log)

    # 3. average
    def average(self, tensors: list[torch.Tensor], weight: float | None = None) -> bool:
        """Each tensor averaged over the quorum's groups, in place; False (and ``failure`` says why) where a peer
        died or timed out, or the quorum was already aborted (a transfer in it failed). ``weight`` (every member
        gives one, or none does): each group's tensors count by their group's weight, sum(w t) / sum(w) (a group
        with nothing to bring: 0)."""
        if self._call(self.store.check, [f"{PREFIX}decision/{self.quorum.id}"]):
            self.failure = "the quorum was aborted before its average"
            return False
        weights = [] if weight is None else [torch.tensor([weight], dtype=torch.float64)]
        if weights:
            torch._foreach_mul_(tensors, weight)
        try:
            pending = [self.comm.all_reduce(t, f"allreduce across replicas {i}")
                       for i, t in enumerate(tensors + weights)]
            self.fault("allreduce")
            for work in pending:
                work.wait()
        except (RuntimeError, dist.DistError) as error:
            self.failure = one_line(error)
            return False
        self.total_weight = None if weight is None else weights[0].item() * len(self.quorum.members)
        if weights and weights[0].item() > 0:  # (all 0: the tensors are 0, and stay so)
            torch._foreach_div_(tensors, weights[0].item())
        return True

    # 4. commit
    def commit(self, ok: bool, samples_of: Callable[[int], Any] | None = None) -> bool:
        """Whether the quorum applies this step (module docstring, step 4); every place calls it. ``samples_of``:
        what group g used in this step (its samples, which every group can name: the trainer's data order is a
        function of the group and the step), written into the commit log beside the participants."""
        quorum, key = self.quorum, f"{PREFIX}decision/{self.quorum.id}"
        if ok and self._call(self.store.add, f"{PREFIX}votes/{quorum.id}", 1) == quorum.voters:
            self._call(self.store.compare_set, key, "", "commit")
        elif not ok:
            self._abort(quorum, f"its average failed ({self.failure})")
        committed = self._decision(quorum.id) == b"commit"
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
        from, and is told so in one line instead of training on alone."""
        if self.place == 0:
            self._call(self.store.compare_set, PREFIX + "finished", "", json.dumps({"step": step, "group": self.group}))

    def note(self, entry: dict[str, Any]) -> None:
        """Something else worth keeping beside the committed steps (a recovery's timings), in the commit log."""
        self.log.append(entry)
        if self.log_path:
            append_log(self.log_path, entry)

    def close(self) -> None:
        self.heartbeat.close()
        self._drop_group()


# ----------------------------------------------------------------------------------------------------------
# State in transit, and the commit log
# ----------------------------------------------------------------------------------------------------------
def messages_of(tensors: list[tuple[tuple[int, ...], torch.dtype]]) -> list[list[int]]:
    """The tensors (shape, dtype) a state transfer sends, grouped into messages: consecutive tensors of one dtype
    up to MESSAGE_BYTES together, a larger one alone. Both ends group them alike, from the skeleton."""
    messages: list[list[int]] = []
    size = 0
    for i, (shape, dtype) in enumerate(tensors):
        nbytes = math.prod(shape) * dtype.itemsize
        if messages and tensors[messages[-1][0]][1] == dtype and size + nbytes <= MESSAGE_BYTES:
            messages[-1].append(i)
            size += nbytes
        else:
            messages.append([i])
            size = nbytes
    return messages


def split_tensors(value: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``value`` (dicts, lists, tuples; tensors and picklable leaves) as a skeleton whose tensors are numbered
    places, and the tensors in that order."""
    tensors: list[torch.Tensor] = []

    def walk(item: Any) -> Any:
        if torch.is_tensor(item):
            tensors.append(item)
            return TensorPlace(len(tensors) - 1)
        if isinstance(item, dict):
            return {key: walk(v) for key, v in item.items()}
        if isinstance(item, (list, tuple)):
            return type(item)(walk(v) for v in item)
        return item

    body = walk(value)
    return {"body": body, "tensors": [(tuple(t.shape), t.dtype) for t in tensors]}, tensors


@dataclass(frozen=True)
class TensorPlace:
    index: int


def join_tensors(skeleton: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    def walk(item: Any) -> Any:
        if isinstance(item, TensorPlace):
            return tensors[item.index]
        if isinstance(item, dict):
            return {key: walk(v) for key, v in item.items()}
        if isinstance(item, (list, tuple)):
            return type(item)(walk(v) for v in item)
        return item
    return walk(skeleton["body"])


def append_log(path: str, entry: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def write_log(path: str, entries: list[dict[str, Any]]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(entry) + "\n" for entry in entries)
    os.replace(tmp, path)


def read_log(path: str, steps_only: bool = True) -> list[dict[str, Any]]:
    """A commit log's entries: the committed steps (``steps_only``), or everything noted too."""
    with open(path) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    return [entry for entry in entries if "step" in entry] if steps_only else entries


# ----------------------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="replicas.py", description="the coordinator of fault-tolerant replica "
                                                                     "groups (see the module docstring)")
    commands = parser.add_subparsers(dest="command", required=True)
    serving = commands.add_parser("serve", help="a TCPStore and the lighthouse that forms the quorums")
    serving.add_argument("--port", type=int, required=True, help="the port to listen on (0: one the OS picks)")
    serving.add_argument("--host", default="0.0.0.0", help="the address to listen on")
    args = parser.parse_args(argv)
    try:
        serve(args.port, args.host)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as error:
        print(f"replicas.py serve: {one_line(error)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
