"""A member's calls to the coordinator (Asking, which Replica in member.py is): its claim and its quorum requests,
their answers, the decisions it waits for, each of the store's reads bounded ([Note: bounded reads]), and the
coordinator lost and found again on its address (``_reconnect``). What Replica does with a quorum (the state's
transfer, the average, the commit) is member.py's."""
from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any, Callable, NoReturn

import torch.distributed as dist

from replicas.commit_log import last_commit, write_log
from replicas.liveness import Heartbeat
from replicas.protocol import (CLAIMED, CONNECT_S, PREFIX, CoordinatorLost, Quorum, one_line, reconnect, refusal)

READ_BOUND = 0.5  # of the fault timeout: the longest a member's wait or get of a key waits before asking again


def timed_out(error: BaseException) -> bool:
    """Whether a store call failed on its own timeout (the key not there in time), not on a lost connection."""
    return isinstance(error, dist.DistStoreError) and "timeout" in str(error).lower()


class Reconnected(Exception):  # not a RuntimeError: none of the handlers of a failed collective takes it
    """The coordinator was lost and a new one answers at its address: the quorum in flight is not taken."""


class Asking:
    """A member's side of the lighthouse's protocol (module docstring), over Replica's store, group, incarnation,
    heartbeat, commit log and quorum (member.py)."""

    # the store: the coordinator lost, waited for up to the fault timeout; not back, said in one line
    def _lost(self, why: str) -> CoordinatorLost:
        return CoordinatorLost(f"replica group {self.group}: the coordinator {self.address} is gone ({why}) and not "
                               f"back within the fault timeout ({self.timeout_s:g} s); this group stops, its "
                               f"checkpoints as they were")

    def _reconnect(self, error: BaseException) -> NoReturn:
        """The store's client failed (its socket closed: the coordinator is gone). A new one at the address within
        the fault timeout: this process's quorum is stale (the new store knows nothing of it: not taken), its process
        groups dropped (their store is gone), and the caller learns it by Reconnected; else CoordinatorLost."""
        began = time.monotonic()
        store = reconnect(self.address, self.timeout_s)
        if store is None:
            raise self._lost(one_line(error)) from None
        self.store, self.stale = store, True
        self._drop_group()
        if self.place == 0:
            print(f"replicas: group {self.group}: the coordinator {self.address} was lost ({one_line(error)}) and "
                  f"is back after {time.monotonic() - began:.1f} s: the step in flight is not taken, asking the new "
                  f"one", file=sys.stderr, flush=True)
        raise Reconnected

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as error:  # torch.distributed's DistError and its kin
            self._reconnect(error)

    def _wait_for(self, key: str, gone: Callable[[], bool] | None = None) -> bytes | None:
        """The value of ``key`` once it is set (however long: below min_groups the lighthouse waits); None once
        ``gone()`` says it was deleted, or will never be set.

        [Note: bounded reads] Every wait and get here gives up after half the fault timeout and asks ``gone()``
        again, so a process stopped (SIGSTOP) anywhere in it finds a key deleted meanwhile within one fault timeout
        of waking. The get is the one to watch: TCPStore's get of a missing key waits for it, up to the store's own
        timeout, which is the connection's (30 s, HANDSHAKE_S: protocol.connect), so a get made as the lighthouse
        forgot the key held a woken group 26-34 s, past the run's end (issue 75)."""
        bound = timedelta(seconds=self.timeout_s * READ_BOUND)
        while True:
            if self.heartbeat is not None and self.heartbeat.lost:
                raise self._lost(self.heartbeat.lost)
            try:
                self.store.wait([key], bound)
            except RuntimeError as error:
                if not timed_out(error):
                    self._reconnect(error)
                if gone is not None and gone():
                    return None
                continue
            failure = None
            try:
                value = self._bounded_get(key, bound)
            except RuntimeError as error:
                value, failure = b"", error
            if value:
                return value
            # deleted between the wait and the get (stopped there: SIGSTOP): the get times out, or, deleted inside
            # it (between the client's own wait and its read), reads b"", as the store's libuv server answers a
            # missing key (a woken process under load, once: its ticket's answer parsed as b"")
            if gone is not None and gone():
                return None
            if failure is not None and not timed_out(failure):
                self._reconnect(failure)

    def _bounded_get(self, key: str, bound: timedelta) -> bytes:
        """The store's get of ``key``, waiting at most ``bound`` for it ([Note: bounded reads]): the store's timeout
        lowered for this one call (the process groups made over the store read it with the timeout they had)."""
        kept = self.store.timeout
        self.store.set_timeout(bound)
        try:
            return self.store.get(key)
        finally:
            self.store.set_timeout(kept)

    def _decision(self, quorum_id: int) -> bytes:
        """decision/n once set, b"commit" or b"abort". A process stopped long enough finds quorum n forgotten (the
        lighthouse deletes its keys at quorum n + 2): it was decided without this group, which takes it as not
        taken; the next quorum gives it the state it missed ([Note: lineage]), as after an abort."""
        return self._wait_for(f"{PREFIX}decision/{quorum_id}", gone=lambda: self._deleted(quorum_id)) or b"abort"

    def _deleted(self, quorum_id: int) -> bool:
        """Whether the lighthouse has forgotten quorum n, its keys deleted or about to be (forgetting.py)."""
        return (self._call(self.store.check, [PREFIX + "forgotten"])
                and int(self._call(self.store.get, PREFIX + "forgotten")) >= quorum_id)

    def _ask(self, step: int) -> Quorum:
        """Ask the lighthouse (place 0 asks, every place waits for the answer to the same ticket), saying the step
        this group's state is at and the quorum that committed the step before it ([Note: lineage]). A ticket
        answered while this process was stopped (SIGSTOP), its quorum forgotten before it was read, went on without
        it: ask again."""
        if self.heartbeat is None:
            self._claim(step)
        quorum = None
        while quorum is None:
            ticket = self._ticket()
            if self.place == 0:
                request = {**self._request(ticket, step),
                           "seen": self.quorum.id if self.quorum is not None else None,  # for a new lighthouse
                           "with": self.quorum.members if self.stale and self.quorum else []}  # [Note: small answers]
                self._call(self.store.queue_push, PREFIX + "events", json.dumps(request))
            answer = self._wait_for(f"{PREFIX}ticket/{ticket}", gone=lambda: self._forgotten(ticket))
            if answer is not None and (refused := refusal(answer)) is not None:
                raise refused
            quorum = self._read_quorum(int(answer)) if answer is not None else None
            if quorum is None and self.place == 0:
                print(f"replicas: group {self.group}: the answer to its request {self.requests} came and was "
                      f"forgotten while it was stopped: asking again", file=sys.stderr, flush=True)
        self.quorum, self.stale = quorum, False
        if not self.taken:
            self._taken()
        if self.quorum.back_from is not None and self.place == 0:
            print(f"replicas: group {self.group}: the run goes back from step {self.quorum.back_from} to step "
                  f"{self.quorum.step} (quorum {self.quorum.id}): no group that holds a later state is alive or came "
                  f"back in time", file=sys.stderr, flush=True)
        return self.quorum

    def _ticket(self) -> str:
        self.requests += 1  # (every place counts alike: each waits for place 0's ticket)
        return f"{self.group}/{self.incarnation}/{self.requests}"

    def _request(self, ticket: str, step: int) -> dict[str, Any]:
        """What every request of place 0 says of this group (a claim's and a quorum request's alike)."""
        return {"ticket": ticket, "group": self.group, "step": step, "last_commit": last_commit(self.log),
                "durable": self.durable, "identity": self.identity, "record": self.record, "run": self.run,
                "size": self.size, "planned": self.planned, "min_groups": self.min_groups,
                "fault_timeout": self.timeout_s}

    def _claim(self, step: int) -> None:
        """[Note: claims] This process asks the coordinator to take it for its group before it writes anything
        under the group's name: a claim (a request the lighthouse checks as any other, answered at once, never put
        in a quorum). Taken, it starts beating (its heartbeat key and liveness connection: the group's); refused (a
        second claimant of a live group, another configuration, a run that finished), it raises that refusal with
        nothing of the live group's touched. Before, the beat started as the process was made: a refused claimant's
        beat shared the live group's key and its liveness connection closed when it exited, which took the live
        group out of quorums in a run with no fault (issue 75; [Note: intruders] in coordinator.py stays for a race of
        two claims made at once, both taken: one of them is refused only at its first quorum request)."""
        while True:
            ticket = self._ticket()
            try:
                if self.place == 0:
                    self._call(self.store.queue_push, PREFIX + "events",
                               json.dumps({**self._request(ticket, step), "claim": True}))
                answer = self._wait_for(f"{PREFIX}ticket/{ticket}")
            except Reconnected:  # a new coordinator: claim again there
                continue
            if answer != CLAIMED:
                raise refusal(answer)
            break
        self.heartbeat = Heartbeat(self.address, f"{PREFIX}hb/{self.group}/{self.place}",
                                   max(self.timeout_s, CONNECT_S), self.incarnation, self.timeout_s)

    def _read_quorum(self, n: int) -> Quorum | None:
        """Quorum n, its ticket's answer: quorum/n, and members/n unless they are those of quorum n - 1, which this
        process holds from this store ([Note: small answers] in protocol.py). None: forgotten before it was read (a
        process stopped after reading its ticket), each read bounded as the ticket's ([Note: bounded reads])."""
        record = self._wait_for(f"{PREFIX}quorum/{n}", gone=lambda: self._deleted(n))
        raw = json.loads(record) if record is not None else None
        held = self.quorum if self.quorum is not None and not self.stale else None
        if raw is not None and raw["same_members"] and held is not None and held.id == n - 1:
            return Quorum.of(raw, held.members)
        members = self._wait_for(f"{PREFIX}members/{n}", gone=lambda: self._deleted(n)) if raw is not None else None
        return Quorum.of(raw, json.loads(members)) if members is not None else None

    def _taken(self) -> None:
        """The coordinator took this process: its run's id kept (a new group's: the run's, from the quorum), and its
        commit log written back as ``resume_log`` kept it, with that id (refused, it would have stayed as it was)."""
        self.taken = True
        if self.run is None and self.quorum.run is not None:
            self.run = self.quorum.run
            self.log.insert(0, {"run": self.run})
        if self.log_path:
            write_log(self.log_path, self.log)

    def _forgotten(self, ticket: str) -> bool:
        """Whether the lighthouse answered ``ticket`` and has since forgotten its quorum (deleted the answer with
        the quorum's keys, forgetting.py): answered/G names this ticket or a later one of this process, and the
        ticket's key is gone. Read in that order: the lighthouse sets the ticket's key before answered/G."""
        key = f"{PREFIX}answered/{self.group}"
        if not self._call(self.store.check, [key]):
            return False
        _, incarnation, number = self._call(self.store.get, key).decode().split("/")
        mine = ticket.split("/")
        return (incarnation == mine[1] and int(number) >= int(mine[2])
                and not self._call(self.store.check, [f"{PREFIX}ticket/{ticket}"]))
