"""What the coordinator and the members share: the store's keys and timings, the errors a member raises, the
connection to the coordinator's store, and the quorum as the lighthouse publishes it.

The store's keys, all under PREFIX: events (the queue of join requests and claims), ticket/T (the lighthouse's
answer to request T: a quorum's id, CLAIMED, or a refusal), answered/G (group G's last answered ticket), quorum/n,
members/n, votes/n and decision/n (quorum n but its members, its members, its commit votes, its first decision:
"commit" or "abort"; [Note: small answers]), forgotten (the last quorum whose keys were deleted), finished (the step
where a group finished the run, and the run's id), finished_kept (the same, once the coordinator has it where its
restart finds it), hb/G/J (place J of group G's heartbeat: INCARNATION/COUNT, once its claim is taken) and
pg/N/J/... (the process groups of quorum N's place J)."""
from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from utils import one_line  # (the replica groups' modules import it from here)

PREFIX = "replicas/"  # every key of the protocol, under the store's root
HEARTBEAT_S = 0.1  # how often every process says it is alive
STALE_S = 1.0  # a heartbeat this old: the process is gone (killed or stopped), for forming the next quorum
FINISHED = "the run finished"  # how a refusal of a group back after the end begins (RunFinished)
RECONNECT_S = 0.2  # how often a member tries the coordinator's address again, once it is lost
CONNECT_S = 10.0  # the least time to connect to the store, or a quorum's process group (a loaded machine's processes)
HANDSHAKE_S = 30.0  # the least time a listening coordinator's store has to answer a new client: under two busy loops
# its handshake once took over 10 s, and the client logged a C++ stack per try it timed out
SERVE = "python -m replicas serve"  # the coordinator's command
CLAIMED = b"claimed"  # a claim's answer where the lighthouse takes it ([Note: claims] in asking.py)


class GroupStops(RuntimeError):
    """This group cannot go on with the state it holds: its processes stop (one line, a non-zero exit), and torchrun
    restarts them from their checkpoints."""


class CoordinatorLost(GroupStops):
    """The coordinator cannot be reached: one line, naming it."""


def whole_number(value: Any) -> bool:
    """A step or a quorum as the files read it: an int of at least 0 (JSON's true is not one, though Python's bool
    is an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class ReplicaRefused(ValueError):
    """The lighthouse refused this group (another identity, another size): one line, why."""


class RunFinished(ReplicaRefused):
    """The run finished while this group was away: nothing is left for it to do. Not a failure: a torchrun that
    restarted the group after a fault need not restart it again (its process ends with 0)."""

    def __init__(self, message: str, end: dict | None = None):
        super().__init__(message)
        self.end = end  # the run's end as the coordinator keeps it: {"step", "group", "run", "quorum"} (None: none)


def refusal(answer: bytes) -> ReplicaRefused | None:
    """The refusal a ticket's answer says (Lighthouse._refuse), or None: it names a quorum (its id)."""
    if answer.isdigit():
        return None
    raw = json.loads(answer)
    return RunFinished(raw["refused"], raw.get("end")) if raw.get("finished") else ReplicaRefused(raw["refused"])


def connect(address: str, timeout_s: float, handshake_s: float = HANDSHAKE_S) -> TCPStore:
    """A client of the coordinator's store at HOST:PORT; one that cannot be reached in ``timeout_s`` is one line. A
    plain socket waits for a listener first (every RECONNECT_S): the store's client, given nothing there, takes
    about twice its timeout and logs a C++ stack per try; once one listens, it has at least HANDSHAKE_S to answer."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=RECONNECT_S).close()
            break
        except OSError as error:
            if time.monotonic() > deadline:
                raise CoordinatorLost(f"coordinator {address} unreachable (nothing answers there after {timeout_s:g} "
                                      f"s: {error.strerror or error}): start it with `{SERVE} --port {port}`") from None
            time.sleep(RECONNECT_S)
    try:
        return TCPStore(host or "127.0.0.1", int(port), is_master=False, wait_for_workers=False,
                        timeout=timedelta(seconds=max(deadline - time.monotonic(), handshake_s)))
    except (RuntimeError, ValueError) as error:
        raise CoordinatorLost(f"coordinator {address} unreachable ({one_line(error)}): start it with `{SERVE} "
                              f"--port {port}`") from None


def reconnect(address: str, timeout_s: float) -> TCPStore | None:
    """A new client of the coordinator's store at HOST:PORT once one listens there again (a coordinator restarted
    after a loss: its store is new and empty), tried every RECONNECT_S; None if none does within ``timeout_s``. A
    plain socket tries first: the store's client would log each failed try at error level, a C++ stack's worth."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=RECONNECT_S).close()
            # CONNECT_S, not HANDSHAKE_S: a probe that met the dying store would hold a lost coordinator's line 60 s
            return connect(address, max(deadline - time.monotonic(), RECONNECT_S), CONNECT_S)
        except (OSError, CoordinatorLost):
            time.sleep(RECONNECT_S)
    return None


@dataclass
class Quorum:
    """One step's quorum, as a member reads it (quorum/n and members/n: ``published``)."""
    id: int
    members: list[int]
    steps: dict[int, int]  # the step each member behind (in ``sources``) asked at; the others asked at ``step``
    step: int  # the step the quorum takes: the most advanced member's
    sources: dict[int, int]  # member behind -> the member it receives the state from
    pg: int  # the quorum whose process group this one uses (a new one when a member is a new process, after an abort)
    size: int  # P, processes per group
    fault_timeout: float = 60.0
    back_from: int | None = None  # the last committed step, where the quorum's state is behind it ([Note: progress])
    run: str | None = None  # the run's id: the lighthouse's for its first quorum, or a request's (Lighthouse.run_id)
    voters: int = field(init=False)

    def __post_init__(self) -> None:
        self.voters = len(self.members) * self.size

    def step_of(self, group: int) -> int:
        """The step ``group`` asked at."""
        return self.steps.get(group, self.step)

    @classmethod
    def of(cls, raw: dict[str, Any], members: list[int]) -> Quorum:
        """From quorum/n's record and the members (members/n's, or the quorum before's: [Note: small answers])."""
        return cls(raw["id"], members, {int(g): s for g, s in raw["steps"].items()}, raw["step"],
                   {int(g): s for g, s in raw["sources"].items()}, raw["pg"], raw["size"], raw["fault_timeout"],
                   raw.get("back_from"), raw.get("run"))


# [Note: small answers] What the lighthouse writes for a quorum, a member reads: G members, every step. The whole
# quorum in every ticket's answer and in quorum/n (the members, their steps and processes: 19 KB at 512 groups) was
# O(G^2) bytes a step through the store's one server thread: at 512 simulated groups on this 2-core VM its CPU was
# 1.8 s a step, a multi_set of 512 such answers 1.2 s of it (benchmarks/coordinator_benchmark.py). So a ticket is
# answered by the quorum's id; quorum/n holds what does not grow with G (but the members behind and their sources,
# none without a fault), members/n the members, written once; and quorum/n says whether they are quorum n-1's, which
# a member that read n-1 from this store then holds already: only a member new to the quorums, or a change of
# members, reads members/n. Exact: one store's quorum ids are never reused (a new run's go on past the old's), and a
# member's quorum from a lost coordinator's store is stale (Replica.stale). Each key goes with its quorum
# (forgetting.py); a member stopped between its ticket and these keys finds them forgotten, as it finds its ticket.
# So too a request: it names the members of the quorum its group was last in (O(G)) only where that quorum is a lost
# coordinator's, for the first quorum of the one that replaced it (Lighthouse._first_waits), the only reader.
def published(quorum: dict[str, Any], previous: dict[str, Any] | None, tickets: list[str]) -> dict[str, str]:
    """The store's keys and values that publish the lighthouse's quorum (``previous``: the quorum before it, None at
    a coordinator's first or a new run's), ``tickets`` answered by it."""
    n, behind = quorum["id"], quorum["sources"]
    record = {key: quorum[key] for key in ("id", "step", "sources", "pg", "size", "fault_timeout", "back_from", "run")}
    record["steps"] = {g: s for g, s in quorum["steps"].items() if g in behind}
    record["same_members"] = previous is not None and previous["members"] == quorum["members"]
    return {f"{PREFIX}quorum/{n}": json.dumps(record), f"{PREFIX}members/{n}": json.dumps(quorum["members"]),
            **{f"{PREFIX}ticket/{ticket}": str(n) for ticket in tickets}}


def difference(record: dict[str, Any] | None, run: dict[str, Any] | None) -> str:
    """The first setting, in the record's order, where a group's identity record differs from the run's: "--lr
    0.02, where the run's is 0.05" (the fingerprints alone where a request carries no record)."""
    for key in dict.fromkeys([*(record or {}), *(run or {})]):
        if record is not None and run is not None and record.get(key) != run.get(key):
            return f"{key} {record.get(key)}, where the run's is {run.get(key)}"
    return "its fingerprint differs"
