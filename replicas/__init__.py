"""Training that never stops for a lost worker: data parallelism across replica groups that die, hang and come back,
each step taken by the groups alive at its start, and a group that (re)joins given the live state by a healthy peer
instead of from disk. torchft's design (a quorum per step through a small coordinator, process groups made afresh
per quorum, a step applied only once every participant finished it) on torch's own parts: the coordinator is a
TCPStore (torchrun's c10d rendezvous store), each quorum's process group a ProcessGroupGloo over a PrefixStore of
it, the collectives this toolkit's (collectives.py: torch's, or allreduce.py's ring).

    python -m replicas serve --port 29400                          # the coordinator: a TCPStore and its lighthouse
    replica = replicas.Replica("host:29400", group=I, planned=R, identity=fingerprint,
                               state_dict=fn, load_state_dict=fn)   # in every process of replica group I
    while training:
        joined = replica.join(step)           # the groups in this step; a group behind receives the live state
                                              # (joined.recovery says what it received: None if it was not behind)
        loss.backward()                       # the group's own data parallelism inside it (any sync)
        ok = replica.average(flats)           # the gradients averaged over the quorum's groups
        if replica.commit(ok, samples_of):    # every participant finished: all apply the step, or none
            optimizer.step(); step += 1
        optimizer.zero_grad()
    replica.close()

Terms. A replica group is P processes that train one model together (a torchrun of its own: its own process group,
its own checkpoints); R groups are planned, any number are alive. Process j of a group is its place j; the places j
of a quorum's groups form that quorum's process group at place j, over which gradients are averaged and state is
sent. The coordinator, ``python -m replicas serve``, is a TCPStore with a lighthouse beside it (Lighthouse), the one
process that decides who is in each quorum; everything else the members settle among themselves through the store.
``samples_of(g)`` names what group g used in the step (the trainer's data order is a function of group and step).

One step, quorum n, members M:
1. join: each group's place 0 asks to join (its step, identity and size, in the store's event queue); the
   lighthouse forms quorum n once every member of n-1 has asked, is gone (its process dead: its liveness
   connection closed, liveness.py; or silent: its heartbeat older than the fault timeout while its connection is
   open, a stopped or starved process, or than STALE_S where it holds none: [Note: hung or gone]) or is
   late (the fault timeout since n-1's decision; but where no group that asked holds the last committed step, the
   processes that committed it are waited for until they ask, are gone, or LINEAGE_WAITS fault timeouts have
   passed: [Note: lineage]), with every new group that asked, if at least ``min_groups`` did (else it waits), and
   answers each ticket with it. A group of another identity (model, optimizer, flags: the trainer's record, whose first
   differing setting the refusal names), of another run (the run's id, named by the first quorum and kept by each
   group), a second claimant of a live group, or a new run on a coordinator whose run finished, is refused in one
   line, alone.
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
the closed peer), they vote abort, ask to join again, and the lighthouse, which saw the dead process's liveness
connection close (liveness.py), forms the next quorum without its group at once: the survivors lose the step they
were in, not a heartbeat's timeout (a process that cannot reach the liveness server is found by its heartbeat,
STALE_S old).
A hung process (SIGSTOP) holds the average until its timeout (``fault_timeout_s``); woken (SIGCONT), it finds its
quorum decided (abort, or commit if it had voted) and its next join behind, so it recovers. The coordinator gone,
every store call fails: each process tries its address again every RECONNECT_S for up to the fault timeout; a new
coordinator there (an empty store), it takes the step in flight as not taken, keeps its state and asks the new
lighthouse, which numbers its quorums past every id the requests name and gives the groups that did not apply the
step the state of those that did ([Note: lineage]): one step lost at most, none applied twice, no process restarted.
Not back in time: every process says so in one line (CoordinatorLost) and stops; checkpoints are as they were.

The files, one concern each: protocol.py (the store's keys, the timings, the errors, the quorum as published),
coordinator.py (the lighthouse; forgetting.py deletes its decided quorums' keys off its loop), cli.py (``python -m
replicas serve``: the store and the lighthouse), member.py (Replica: join, average, commit, finish), asking.py (its
calls to the coordinator: claim, requests, answers, decisions, bounded reads), liveness.py (its
heartbeat and its connection), transfer.py (the live state's transfer: the StateTransport interface, its
implementations over a TCP connection of its own and over the process group, the wire format), commit_log.py (the log
that replays the run) and runs_file.py (what the coordinator keeps of its runs on disk, ``serve --runs-file``: their
ids and ends, for a restart).
"""
from replicas.cli import main, serve
from replicas.commit_log import append_log, read_log, write_log
from replicas.coordinator import FIRST_WAIT_S, LINEAGE_WAITS, Lighthouse
from replicas.liveness import Heartbeat
from replicas.member import Joined, Replica
from replicas.protocol import (CONNECT_S, HEARTBEAT_S, PREFIX, RECONNECT_S, STALE_S, CoordinatorLost, GroupStops,
                               Quorum, ReplicaRefused, RunFinished, connect, one_line, reconnect)
from replicas.runs_file import RunsFile, RunsFileError
from replicas.transfer import (MESSAGE_BYTES, PGTransport, Received, Recovery, SocketTransport, StateTransport,
                               TensorPlace, TornTransfer, join_tensors, messages_of, split_tensors)

__all__ = ["CONNECT_S", "FIRST_WAIT_S", "HEARTBEAT_S", "LINEAGE_WAITS", "MESSAGE_BYTES", "PREFIX", "RECONNECT_S",
           "STALE_S", "CoordinatorLost", "GroupStops", "Heartbeat", "Joined", "Lighthouse", "PGTransport", "Quorum",
           "Received", "Recovery", "Replica", "ReplicaRefused", "RunFinished", "RunsFile", "RunsFileError",
           "SocketTransport", "StateTransport", "TensorPlace", "TornTransfer", "append_log", "connect", "join_tensors",
           "main", "messages_of", "one_line", "read_log", "reconnect", "serve", "split_tensors", "write_log"]
