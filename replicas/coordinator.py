"""The lighthouse, the one process that decides who is in each quorum (the package docstring's step 1), beside the
coordinator's TCPStore (cli.py starts both). It holds membership, not state: everything the members need is in the
store's keys (protocol.py), and everything else the members settle among themselves through the store."""
from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch.distributed import TCPStore

from replicas.forgetting import Forgetter, forget
from replicas.liveness import LivenessServer
from replicas.protocol import CLAIMED, FINISHED, PREFIX, SERVE, STALE_S, difference, published
from replicas.runs_file import RunsFile

FIRST_WAIT_S = 5.0  # the least the first quorum waits for every planned group (else the fault timeout)
LINEAGE_WAITS = 10  # the fault timeouts the lighthouse waits, at most, for the holders of the last committed step
TICK_S = 0.005  # the lighthouse's poll of its event queue and of the open quorum's decision
WATCH_S = 0.05  # ... and of the heartbeats, when no request came meanwhile


@dataclass
class Asked:
    """A group's latest request to join, as the lighthouse holds it."""
    request: dict[str, Any]
    at: float  # the lighthouse's clock when it came


class Lighthouse:
    """Forms the quorums (the package docstring, step 1) from the join requests in the store's event queue, and aborts a
    quorum whose member went silent. The members need none of its state but the store's keys: quorum/n, members/n
    (the quorum), ticket/T (its answer to request T: the quorum's id), decision/n (by members, or by it on silence).
    ``new_run``: once the run finished, a new run's group (one that keeps no run id) starts a new run instead of
    being refused ([Note: new run]). ``runs_file``: where it keeps the run's id and end and the runs before it, and
    resumes them from (runs_file.py): a coordinator restarted after the groups have gone still knows them."""

    def __init__(self, store: TCPStore, new_run: bool = False, host: str = "0.0.0.0",
                 runs_file: RunsFile | None = None):
        self.store, self.new_run, self.host, self.runs_file = store, new_run, host, runs_file
        self.liveness: LivenessServer | None = None  # while ``run`` runs: the members' connections (liveness.py),
        self.forgetter: Forgetter | None = None  # and what deletes decided quorums' keys (forgetting.py)
        self.finished_read: tuple[dict[str, Any] | None] | None = None  # the run's end, read once a batch
        self.finished_runs: dict[str, int] = {}  # run id -> its last step: the runs before this one ([Note: new run])
        self.quorum: dict[str, Any] | None = None  # the last one formed
        self.frontier: tuple[int, int] | None = None  # (step, quorum) of the last step committed ([Note: lineage])
        self.holders: dict[str, str] = {}  # group -> incarnation: the processes holding the last committed step
        self.asked: dict[int, Asked] = {}  # group -> its request for the next quorum
        self.checkpointed: dict[int, int] = {}  # group -> its newest checkpoint's step ([Note: progress])
        self.beats: dict[str, tuple[bytes, float]] = {}  # heartbeat key -> (value, when it last changed)
        self.claims: dict[int, str] = {}  # group -> the incarnation whose requests it takes (a second claimant's not)
        self.alive: dict[tuple[int, str], float] = {}  # (group, incarnation) -> when a place of it last beat
        self.places: dict[int, int] = {}  # group -> its size P, from its requests
        self.tickets: dict[int, list[str]] = {}  # quorum -> the tickets it answered
        self.first_asked: float | None = None
        self.seen = -1  # the last quorum id a request names (a coordinator restarted numbers its quorums past it)
        self.last_members: tuple[int, list[int]] = (-1, [])  # the latest quorum a request was in, and its members
        self.planned = 0  # R, from the requests
        self.decided_at, self.said = None, None  # (the open quorum's decision seen; the last line said)
        self.run_id: str | None = None  # the run's id: the first quorum's requests' (a restarted coordinator), or new
        self.acknowledged: dict[str, Any] | None = None  # the run's end as finished_kept last said it
        if runs_file is not None and runs_file.kept is not None:
            self._resume(runs_file.kept)

    def run(self, stop: threading.Event | None = None) -> None:
        watched = 0.0
        self.liveness, self.forgetter = LivenessServer(self.store, self.host), Forgetter(self.store)
        try:
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
                    self._keep()
                time.sleep(TICK_S)
        finally:
            self.liveness.close()
            self.forgetter.close()

    def _take_requests(self) -> int:
        """The requests in the queue (how many). Once a quorum exists, one of another identity or size is refused at
        once, and so is a second claimant of a group whose process beats (``_claimed``); a newer start of a group
        whose process is gone replaces the older's request (which is told so)."""
        queue, taken, self.finished_read = PREFIX + "events", 0, None
        while waiting := self.store.queue_len(queue):  # (its length once a batch: a round trip a call)
            for _ in range(waiting):
                taken += 1
                request = json.loads(self.store.queue_pop(queue, False))
                group, incarnation = request["group"], request["ticket"].split("/")[1]
                if request.get("run") is None and self.new_run and self._finished() is not None:
                    self._start_new_run()
                # (before any quorum: a restarted coordinator's, or a new run's, the end of a run is said first)
                why = self._unfit(request, self.quorum) if self.quorum is not None else self._ended(request)
                why = why or self._claimed(group, incarnation)
                older = self.asked.get(group)
                if why is None and older is not None and older.request["ticket"].split("/")[1] != incarnation:
                    self._refuse(older.request, f"replaced by a newer start of replica group {group}")
                if why is not None:
                    self._refuse(request, why)
                    continue
                if request.get("claim"):  # taken ([Note: claims] in asking.py): its quorum request comes next
                    self.store.set(f"{PREFIX}ticket/{request['ticket']}", CLAIMED)
                    continue
                self.places[group] = request["size"]
                self.planned = max(self.planned, request["planned"])
                self.seen = max(self.seen, *(request.get(key) for key in ("seen", "last_commit")
                                             if request.get(key) is not None), -1)
                if request.get("seen") is not None:
                    self.last_members = max(self.last_members, (request["seen"], request["with"]))
                if request.get("durable") is not None:
                    self.checkpointed[group] = request["durable"]
                self.asked[group] = Asked(request, time.monotonic())
                self.first_asked = self.first_asked or time.monotonic()
        return taken

    def _unfit(self, request: dict[str, Any], reference: dict[str, Any]) -> str | None:
        """Why a group may not join the run (None: it may)."""
        if request["identity"] != reference["identity"]:
            return f"another configuration ({difference(request.get('record'), reference.get('record'))})"
        if request["size"] != reference["size"]:
            return f"{request['size']} processes, where the run's replica groups have {reference['size']}"
        if request.get("run") not in (None, self.run_id) and self.run_id is not None:  # (a run before this one on
            return self._ended(request) or (  # this coordinator: told it finished, if behind its end)
                f"its commit log or checkpoints are of another run ({request['run']}; this coordinator's is "
                f"{self.run_id}): give it a new --commit-log and --checkpoint-dir, or its run's coordinator")
        return self._ended(request)

    def _finished(self, fresh: bool = False) -> dict[str, Any] | None:
        """This run's end as its finishing group wrote it ({"step", "group", "run", "quorum"}; None: not yet): read
        once a batch of requests (a read a request cost a round trip each, G a step), or ``fresh``."""
        if fresh or self.finished_read is None:
            self.finished_read = (json.loads(self.store.get(PREFIX + "finished"))
                                  if self.store.check([PREFIX + "finished"]) else None,)
        return self.finished_read[0]

    def _resume(self, kept: dict[str, Any]) -> None:
        """What the runs file keeps, on a coordinator started anew: the run's id, the runs before it, and the run's
        end, set again in the store as a group that finished sets it on a new coordinator (Heartbeat.carried)."""
        self.run_id, self.finished_runs = kept["run"], dict(kept["finished_runs"])
        if kept["finished"] is not None:
            self.store.set(PREFIX + "finished", json.dumps(kept["finished"]))

    def _keep(self) -> None:
        """What a restarted coordinator needs (the run's id, its end, the runs before it) to the runs file, where it
        changed since it was last written (no file: nothing); then the run's end acknowledged (finished_kept) once it
        is where this coordinator's restart finds it, the file or, without one, the store: the group that finished
        waits for it before it exits, which would take the only other copy with it."""
        finished, kept = self._finished(fresh=True), True
        if self.runs_file is not None:
            self.runs_file.write({"run": self.run_id, "finished": finished, "finished_runs": self.finished_runs})
            kept = self.runs_file.kept is not None and self.runs_file.kept["finished"] == finished
        if finished is not None and kept and finished != self.acknowledged:
            self.store.set(PREFIX + "finished_kept", json.dumps(finished))
            self.acknowledged = finished

    def _ended(self, request: dict[str, Any]) -> str | None:
        """Why a request may not join for its run's end (None: not so): a new run once this one finished, a group
        behind the end of its run (this one, or one before it here: told so, exit 0), before its step or at it
        without its last commit (a streaming DiLoCo group late to the last meeting: its steps run ahead of them)."""
        finished = self._finished()
        if finished is not None and request.get("run") is None:
            return (f"this coordinator's run finished at step {finished['step']}, and this group keeps nothing of it "
                    f"(a new run, or a group without --commit-log or --checkpoint-dir): a new run needs a new "
                    f"coordinator (restart `{SERVE}`) or one started with --new-run")
        ours = self._end_of(request, finished) or {"step": self.finished_runs.get(request.get("run"))}
        end, holder, last = ours["step"], ours.get("group"), ours.get("quorum")
        short = request["step"] == end and last is not None and (request.get("last_commit") or -1) < last
        if end is not None and (request["step"] < end or short):
            return (f"{FINISHED} at step {end} while this group was away (it is at step {request['step']}"
                    + (f", without the run's last commit, quorum {last}" if short else "") + "): no group "
                    "is left to take the live state from, and nothing is left to train; the run's weights are "
                    + (f"group {holder}'s (and those of the groups that finished with it)" if holder is not None
                       else "the other groups'"))
        return None

    # [Note: new run] A coordinator whose run finished refuses a new run's groups (a run that trained nothing and ended
    # as done, else), unless it was started with --new-run: then the first group of a new run (no run id: nothing of
    # an earlier run on disk) starts it afresh. The finished run's end is kept by its id (finished_runs), so that its
    # groups back late are still told it finished; the store's finished key is cleared for the new run's own end; the
    # quorum ids go on past the old run's (its keys may still be in the store); the rest of the lighthouse's state,
    # membership and the frontier, starts over.
    def _start_new_run(self) -> None:
        finished = self._finished()
        runs = {**self.finished_runs, (finished.get("run") or self.run_id): finished["step"]}
        seen = max(self.seen, self.quorum["id"] if self.quorum is not None else -1)
        self.store.delete_key(PREFIX + "finished")
        self.store.delete_key(PREFIX + "finished_kept")
        self.finished_read = None
        for group in list(self.asked):  # the old run's requests, never answered: told it finished
            self._refuse(self.asked.pop(group).request, f"{FINISHED} at step {finished['step']}")
        kept = self.liveness, self.forgetter, self.runs_file  # (the liveness server and the forgetter, while
        self.__init__(self.store, self.new_run, self.host)  # ``run`` runs, serve the new run too) membership anew
        self.finished_runs, self.seen, (self.liveness, self.forgetter, self.runs_file) = runs, seen, kept
        self._keep()
        self._say(f"the run {finished.get('run')} finished at step {finished['step']}: a new run starts (--new-run)")

    def _claimed(self, group: int, incarnation: str) -> str | None:
        """Why a request of ``incarnation`` may not speak for ``group`` (None: it may, and from now on it does): the
        group is claimed by another process that is not gone (two torchruns started with one --replica-group: the
        newer one would replace the live one, whose steps since would be lost): it beat within the silence it is
        given (``_silence_given``). A restart of a dead process is not refused: its old incarnation's liveness
        connection has closed (a process of it died), or it has been silent for longer (the heartbeat key now names
        the new one, so each incarnation's last beat is kept: ``alive``). A restart forked warm
        (trainer/warm_start.py) asks within a second of the death, when the last beat may still look recent."""
        claimant = self.claims.get(group)
        if claimant not in (None, incarnation):
            self._watch_heartbeats()
            silent = time.monotonic() - self.alive.get((group, claimant), -float("inf"))
            keys = [f"{PREFIX}hb/{group}/{j}" for j in range(self.places.get(group, 1))]
            if silent <= self._silence_given(keys, claimant):
                return (f"another process of it is running (its heartbeat {silent:.1f} s old): two torchruns "
                        f"given --replica-group {group}? Give each group its own number")
        self.claims[group] = incarnation
        return None

    def _end_of(self, request: dict[str, Any], finished: dict[str, Any] | None) -> dict[str, Any] | None:
        """``finished`` (``_finished``) where the request is of that run, or names none; else None."""
        return finished if finished and request.get("run") in (None, finished.get("run"), self.run_id) else None

    def _refuse(self, request: dict[str, Any], why: str) -> None:
        """The request's answer: refused, why; a group behind its run's end given that end, for its folder's mark."""
        finished = why.startswith(FINISHED)
        end = self._end_of(request, self._finished()) if finished else None
        self.store.set(f"{PREFIX}ticket/{request['ticket']}",
                       json.dumps({"refused": f"replica group {request['group']} refused by the coordinator: {why}",
                                   "finished": finished, "end": end}))

    def _watch_heartbeats(self) -> None:
        size = max(self.places.values(), default=1)  # every planned group's: a restarted coordinator's first quorum
        keys = [f"{PREFIX}hb/{g}/{j}" for g in set(range(self.planned)) | set(self.places)  # waits for those that
                for j in range(self.places.get(g, size))]  # beat (_first_waits)
        present = [key for key in keys if key in self.beats or self.store.check([key])]  # (never deleted)
        now = time.monotonic()
        for key, value in zip(present, self.store.multi_get(present) if present else []):
            group, incarnation = int(key.split("/")[-2]), value.split(b"/")[0].decode()
            if self._intruder(group, incarnation, key):
                continue
            if self.beats.get(key, (None, 0.0))[0] != value:
                self.beats[key] = (value, now)
                self.alive[group, incarnation] = now

    def _intruder(self, group: int, incarnation: str, key: str) -> bool:
        """[Note: intruders] Whether a heartbeat is another process's than the live claimant of its group (its liveness
        connection open, its beat within the fault timeout): a second claimant ``_claimed`` refuses. Counted, its
        beats made the live group's last beat read as the intruder's: ``_may_hold`` denied the group its state, and
        once the refused process exited (its connection closed) ``_gone`` took the group for dead, out of quorums in
        a run with no fault. A claimant gone, or one without a connection (a restart is then not told from a second
        claimant), leaves the key's beats counted as before."""
        claimant = self.claims.get(group)
        if claimant is None or claimant == incarnation or self.liveness is None:
            return False
        if self.liveness.closed(key, claimant) or not self.liveness.connected(key, claimant):
            return False
        return time.monotonic() - self.alive.get((group, claimant), -float("inf")) <= self._patience()

    def _silent_for(self, group: int) -> float:
        """Seconds since the staler of the group's places last beat (inf: never seen, or a place's process is gone:
        its liveness connection closed, liveness.py)."""
        now, silent = time.monotonic(), 0.0
        for j in range(self.places.get(group, 1)):
            key = f"{PREFIX}hb/{group}/{j}"
            value, seen = self.beats.get(key, (None, -float("inf")))
            if value is not None and self.liveness is not None and self.liveness.closed(
                    key, value.split(b"/")[0].decode()):
                return float("inf")
            silent = max(silent, now - seen)
        return silent

    def _gone(self, group: int, unseen: bool = True) -> bool:
        """Whether the group's process is gone for forming the next quorum: a place's heartbeat silent past the
        silence it is given (``_silence_given``). ``unseen``: the answer for a place never seen beating."""
        now = time.monotonic()
        for j in range(self.places.get(group, 1)):
            key = f"{PREFIX}hb/{group}/{j}"
            value, seen = self.beats.get(key, (None, None))
            if value is None:
                if unseen:
                    return True
                continue
            if now - seen > self._silence_given([key], value.split(b"/")[0].decode()):
                return True
        return False

    def _silence_given(self, keys: list[str], incarnation: str) -> float:
        """How long the heartbeat of that incarnation at those places may be silent before its process is taken for
        gone ([Note: hung or gone]): not at all once a place's liveness connection closed (dead); the fault timeout
        while one holds it open (alive: stopped, or starved of CPU); STALE_S where none holds one (its death would go
        unseen otherwise: a liveness server it cannot reach, or a restarted coordinator's it has not reached yet)."""
        if self.liveness is None:
            return STALE_S
        if any(self.liveness.closed(key, incarnation) for key in keys):
            return -float("inf")
        return self._patience() if any(self.liveness.connected(key, incarnation) for key in keys) else STALE_S

    def _patience(self) -> float:
        """The fault timeout: the open quorum's, else the longest a request asked with (STALE_S before any)."""
        if self.quorum is not None:
            return self.quorum["fault_timeout"]
        return max((asked.request["fault_timeout"] for asked in self.asked.values()), default=STALE_S)

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
        """The next quorum, when its conditions hold (the package docstring, step 1)."""
        alive = {g: asked for g, asked in self.asked.items() if not self._gone(g)}
        if not alive:
            return
        if self.quorum is None:
            if self._first_waits(alive):
                return
        elif self._waiting_for_newer_state(alive):
            return
        needed = max(asked.request["min_groups"] for asked in alive.values())
        members = sorted(self._admissible(alive))
        if len(members) < needed:
            self._say(f"waiting: {len(members)} replica group(s) alive, --min-replica-groups {needed}")
            return
        self._publish(members)

    def _first_waits(self, alive: dict[int, Asked]) -> bool:
        """Whether the first quorum waits for more groups: every planned one, up to the fault timeout (at least
        FIRST_WAIT_S) since the first asked: a planned group slower to start than the others (a loaded machine: its
        torch imported seconds later) is no more taken for lost than a quorum's silent member. A coordinator restarted
        after a loss (a request names a quorum it was in: groups that were training) waits instead for the members of
        the latest quorum a request names, the lost coordinator's (one of them may hold the last committed step: [Note:
        lineage]), until they ask, are gone (their heartbeat, back, silent past STALE_S) or the fault timeout has
        passed; not for the other groups (gone, or restarting: not coming)."""
        waited = time.monotonic() - self.first_asked
        patience = max(asked.request["fault_timeout"] for asked in alive.values())
        if self.last_members[0] < 0:
            return len(alive) < self.planned and waited < max(FIRST_WAIT_S, patience)
        coming = [g for g in self.last_members[1]  # (a place not seen beating yet: still reconnecting)
                  if g not in alive and not self._gone(g, unseen=False)]
        return bool(coming) and waited < patience

    def _waiting_for_newer_state(self, alive: dict[int, Asked]) -> bool:
        """Whether the next quorum waits for a group that is not among ``alive`` and may bring back a newer state
        than every alive group holds: a member of the last quorum, silent for less than STALE_S and not yet late; a
        holder of the last committed step that is not gone ([Note: lineage]); a group whose checkpoint holds a later
        step than every alive group's, restarting or about to ([Note: progress]). The last two for at most
        LINEAGE_WAITS fault timeouts since the last decision; then the others go on, which is said in one line."""
        waited = time.monotonic() - self.decided_at
        late = waited > self.quorum["fault_timeout"]
        if not late and any(g not in alive and not self._gone(g) for g in self.quorum["members"]):
            return True
        states = {(a.request["step"], a.request.get("last_commit")) for a in alive.values()}
        best = max(step for step, _ in states)
        away = [int(g) for g, incarnation in self.holders.items()
                if int(g) not in alive and self._may_hold(int(g), incarnation) and self.frontier not in states]
        restarting = sorted(g for g, step in self.checkpointed.items() if g not in alive and step > best)
        if not away and not restarting:
            return False
        if waited <= LINEAGE_WAITS * self.quorum["fault_timeout"]:
            self._say(f"waiting for replica group(s) {away}: the only holders of the last committed step, not gone "
                      f"([Note: lineage])" if away else
                      f"waiting for replica group(s) {restarting}: their checkpoints hold step "
                      f"{max(self.checkpointed[g] for g in restarting)}, past every state alive (step {best}) "
                      f"([Note: progress])")
            return True
        self._say(f"replica group(s) {away or restarting} hold a later step than the groups alive (step {best}) but "
                  f"have not asked to join in {waited:.0f} s ({LINEAGE_WAITS} fault timeouts): the others go on from "
                  f"their older state, which those groups will receive, losing their steps since it")
        for group in restarting:  # not waited for again until it says what its checkpoint holds
            del self.checkpointed[group]
        return False

    def _admissible(self, alive: dict[int, Asked]) -> list[int]:
        """The groups that may join: of the quorum's identity and size (the first quorum: the most common), the
        others refused in one line each."""
        requests = [asked.request for asked in alive.values()]
        reference = self.quorum or max(({"identity": r["identity"], "size": r["size"], "record": r.get("record")}
                                        for r in requests),
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
        n = self.seen + 1 if previous is None else previous["id"] + 1  # (a lost coordinator's ids not reused)
        requests = {g: self.asked.pop(g).request for g in members}
        self.run_id = (self.run_id or next((r["run"] for r in requests.values() if r.get("run")), None)
                       or uuid.uuid4().hex[:12])
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
                  "identity": requests[members[0]]["identity"], "record": requests[members[0]].get("record"),
                  "fault_timeout": max(request["fault_timeout"] for request in requests.values()),
                  # the run goes back: the last committed step is past the quorum's state (every member says so)
                  "back_from": self.frontier[0] if self.frontier is not None and self.frontier[0] > step else None,
                  "run": self.run_id}
        tickets = [request["ticket"] for request in requests.values()]
        keys = published(quorum, previous, tickets)  # [Note: small answers] in protocol.py
        self.store.multi_set(list(keys), list(keys.values()))
        # after the tickets' keys: a member that finds answered/G at or past its ticket, and its ticket's key gone,
        # knows it was answered and forgotten (Replica._forgotten)
        self.store.multi_set([f"{PREFIX}answered/{g}" for g in requests], tickets)
        self.tickets[n] = tickets
        self.quorum, self.decided_at, self.said = quorum, None, None
        if previous is not None:  # quorum n - 2's keys deleted (forgetting.py)
            (self.forgetter or partial(forget, self.store))(n - 2, self.tickets.pop(n - 2, []))

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

    # [Note: progress] A group's live state is not all it can bring back: a group that died restarts from its
    # checkpoint, which may hold a later step than every group alive (the only group that went on alone while the
    # others were away, killed in turn). Went on from the older state, the run would throw those steps away when
    # the group came back and received that state: 250 committed steps once, in a run of 2 groups whose survivor
    # restarted 8 s after its kill with a fault timeout of 3 s. So every request says which step the group's newest
    # checkpoint holds ("durable"), and the lighthouse does not form a quorum whose most advanced state is behind a
    # step that an absent group's checkpoint holds: it waits for that group to ask (its state then wins, being the
    # most advanced) as long as it waits for a holder of the frontier, LINEAGE_WAITS fault timeouts since the last
    # decision. A group that does not come back by then is waited for no more (until it asks again), the others go
    # on from their older state, and every member is told from which step to which the run goes back.

    # [Note: hung or gone] A process is dead or hung; the lighthouse tells them apart by its liveness connection
    # (liveness.py), which the kernel closes when the process dies, however it dies, and which a stopped or starved
    # process keeps open. Dead: the next quorum forms without it at once. Alive but silent: it is given the fault
    # timeout, the time a quorum's member silent in the middle of a step is given too, so a hang costs the same
    # wherever it lands. Its heartbeat alone (1 s, STALE_S) once judged both, and under two busy loops on a 2-core
    # machine a heartbeat thread starved for a second took a healthy group for hung: the next quorum went on without
    # it, and near the end of a run it was told the run had finished, its last steps never taken (seen in
    # tests/test_replica_faults.py's progress scenario). A process without a connection (a liveness server it cannot
    # reach, or a restarted coordinator's that it has not reached yet) is still judged by STALE_S: its death would go
    # unseen for a fault timeout otherwise.

    def _say(self, text: str) -> None:
        if text != self.said:
            print(f"replicas serve: {text}", flush=True)
            self.said = text

