"""Fault scenarios of replica groups, run as processes of their own (benchmarks/replica_runs.py: a coordinator and a
torchrun per group, the trainer in float64): ``python tests/replica_scenarios.py OUT [NAME ...]``, each scenario in
OUT/NAME,
its outcome in OUT/NAME/outcome.json for tests/test_replica_faults.py to read. Not a test file.

- kills: 3 groups, --min-replica-groups 3 (a step waits for all three), each group SIGKILLed twice at a point of its
  own (trainer/faults.py), paired so that restarts overlap: groups 1 and 2 in step 2's forward and backward; group 0,
  their only source, while sending them the live state (group 1's own tensors half written: it stops too; every group
  lost: all start again from their checkpoints); groups 1 and 2 at the end of step 3, one in its optimizer's step and
  one saving its checkpoint (group 1 recovers from group 0); group 0 inside step 6's all-reduce across groups (it
  recovers from another).
- alone: 3 groups, --min-replica-groups 1, built before any asks its first quorum (as progress: under two busy loops
  group 1 once started so late that the others went on without it, and, killed before it had joined, it came back
  after the run's end with nothing of it): groups 1 and 2 SIGKILLed at once, group 0 goes on alone until they are
  back (their restarts held until it has taken two steps alone: a warm restart is back before the next step); then
  group 2 stopped (SIGSTOP) past the fault timeout and woken (SIGCONT), rejoining by recovery. Until it has, every
  step ends with a pause (tests/float64_trainer.py's pace), so that group 0 cannot reach the run's last
  step first however fast the machine steps and however slowly it restarts the others; then the run ends at speed.
- progress: 2 groups, --min-replica-groups 1, built before either asks its first quorum (under two busy loops one
  once started 38 s after the other, which then trained alone): group 1 SIGKILLed, group 0 goes on alone (group 1's
  restart held until group 0 has checkpointed step 6), then SIGKILLed while it sends group 1 the state: group 1 waits
  for group 0's restart from its checkpoint, whose step is past its own.
- coordinator: 2 groups, --max-restarts 0, and the coordinator killed for good: each group waits the fault timeout
  for it, then says so in one line and stops.
- restart: 3 groups, the coordinator SIGKILLed while they are inside step 6 and a new one started on its port: the
  groups keep their processes and state, lose at most that step, and run to the end.
- sharded: 3 groups of 2 processes at --zero 3 (each sharding the model over its own 2), --min-replica-groups 3:
  in step 2 group 1's rank 1 SIGKILLed inside its own reduce-scatter and group 2's rank 0 inside its all-gather;
  group 0, their only source, has its rank 1 SIGKILLed while it sends them its place's shards (the joiners' own
  tensors half written: their groups stop, [Note: a torn transfer]; every group starts again from its checkpoints);
  in step 6 group 0's rank 0 SIGKILLed inside the average of a shard across the groups (it recovers from another);
  from step 8, group 2's rank 1 stopped (SIGSTOP) past the fault timeout, its peers inside their collectives with
  it, and woken: the run waits for it (--min-replica-groups 3) and goes on with it.
- streaming: 2 groups as streaming DiLoCo's replicas (2 fragments meeting in turn every 2 steps, each applied a step
  late, in bf16), --min-replica-groups 1, built before either asks its first quorum (as progress): group 1 SIGKILLed
  inside the fragment meeting launched at step 6 (launched, not landed); group 0 goes on alone (paced until group 1
  is back), group 1 comes back from its step-4 checkpoint, behind, and heals from group 0 at its next meeting.
- diloco: 2 groups as DiLoCo's replicas (meeting every 3 steps), --min-replica-groups 2: group 1 SIGKILLed inside a
  window (steps 4 and 7), back from its checkpoint, recovering at the next meeting (6), then again (9), where group
  0 is SIGKILLed while sending it the state (both start again from their checkpoints, at one meeting: group 1's own
  tensors half written, it stops and torchrun restarts it).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import replica_runs  # noqa: E402
from benchmarks.replica_runs import ReplicaRun  # noqa: E402
from trainer_testing import word_corpus  # noqa: E402

FAULT_TIMEOUT_S = 3.0
STEPS = {"kills": 10, "alone": 200, "diloco": 12, "restart": 14, "progress": 60, "sharded": 14, "streaming": 40,
         "stops": 1000}
RESTART_TIMEOUT_S = 60.0  # restart: the groups' fault timeout, time enough for a new coordinator on a loaded machine
# progress: a step waits this long for a group before it goes on without it, and group 1 must be in every step up to
# its kill (under two busy loops and the other batch, a step once waited past 10 s: group 1 left out of step 2 asked
# for group 0's state there, and group 0's fault fired in that transfer instead of the one the scenario is about);
# and group 1 must be in the last steps, which run at speed (under two busy loops, the other batch and the
# timing-sensitive tests in the same session, group 1's end of epoch 2 once came 21 s after group 0's: the run's last
# two steps went on without it at 20 s, and it came back after the end, its weights the step-58 ones)
PROGRESS_TIMEOUT_S = 40.0
RESTART_DELAY_S = PROGRESS_TIMEOUT_S + 3  # ... and group 0's restart is slower than it (gone, as a holder)
PACE_S = 0.5  # alone: a step's pause until the events are over: 100 s of them before group 0 could finish alone
KILLS = {0: "0/0:*:send,0/0:6:allreduce:1", 1: "1/0:2:forward,1/0:3:optimizer:2", 2: "2/0:2:backward,2/0:4:save:1"}
# (group 1's second kill in torchrun's attempt 2: attempt 1 ends when group 0's kill tears its transfer)
SHARDED_KILLS = {0: "0/1:*:send,0/0:6:allreduce:1", 1: "1/1:2:reduce_scatter", 2: "2/0:2:all_gather"}


def flags(data: str, steps: int, *more: str) -> list[str]:
    """The tiny GPT on windows of 16 bytes, 2 x 2 windows a step per group, SGD with momentum: a smooth map, over
    which the replay's tolerance holds for hundreds of steps (tests/test_replica_faults.py's argument)."""
    return ["--device", "cpu", "--dataset", "text", "--model", "gpt-tiny", "--context", "16", "--val-fraction", "0.3",
            "--data-dir", data, "--batch-size", "2", "--grad-accum", "2", "--epochs", "1000", "--max-steps",
            str(steps), "--seed", "5", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--timeout", "120",
            *more]


def kills(out: str, data: str) -> dict:
    env = {group: {"DDP_CIFAR100_FAULT": faults} for group, faults in KILLS.items()}
    run = ReplicaRun(out, 3, flags(data, STEPS["kills"], "--checkpoint-every", "4"), entry="tests/float64_trainer.py",
                     group_env=env, min_groups=3, fault_timeout_s=FAULT_TIMEOUT_S, max_restarts=4)
    return finish(run, lambda: None, timeout_s=400)


def sharded(out: str, data: str) -> dict:
    env = {group: {"DDP_CIFAR100_FAULT": faults} for group, faults in SHARDED_KILLS.items()}
    run = ReplicaRun(out, 3, flags(data, STEPS["sharded"], "--checkpoint-every", "4", "--zero", "3"),
                     entry="tests/float64_trainer.py", group_env=env, processes=2, min_groups=3,
                     fault_timeout_s=FAULT_TIMEOUT_S, max_restarts=5)
    events = {}

    def act() -> None:  # (step 8 came 309 s after the start once, under two busy loops beside the other batch)
        run.wait_for_step(0, 8, 600)
        rank1 = max(run.workers(2))  # the newer of group 2's two processes
        os.kill(rank1, signal.SIGSTOP)
        events["stopped_at"] = time.time()
        time.sleep(FAULT_TIMEOUT_S + 2)
        os.kill(rank1, signal.SIGCONT)
        events["woken_at"] = time.time()
    return {**finish(run, act, timeout_s=400), "events": events}


def alone(out: str, data: str) -> dict:
    gate, held = os.path.join(out, "events-over"), os.path.join(out, "groups-back")
    run = ReplicaRun(out, 3, flags(data, STEPS["alone"], "--checkpoint-every", "50"), entry="tests/float64_trainer.py",
                     env={"FLOAT64_TRAINER_PACE": f"{PACE_S}:{gate}", "FLOAT64_TRAINER_RESTART_GATE": held,
                          "FLOAT64_TRAINER_JOIN_BARRIER": out},
                     min_groups=1, fault_timeout_s=FAULT_TIMEOUT_S, max_restarts=2)
    events = {}

    def rejoined(quorum: int):
        return lambda entries: any(e.get("recovered", {}).get("group") == 2 and e["recovered"]["quorum"] > quorum
                                   for e in entries)

    def act() -> None:
        run.wait_for_step(0, 5, 120)
        events["killed"] = run.signal(1, signal.SIGKILL) + run.signal(2, signal.SIGKILL)
        events["killed_at"] = time.time()
        # group 0 alone for two steps, then the others back (held until then: a warm restart is back at once)
        run.wait_for(0, "two steps alone", lambda entries: sum(
            1 for e in entries if e.get("participants") == [0] and e["time"] > events["killed_at"]) >= 2, 120)
        open(held, "w").close()
        run.wait_for(2, "recovery", rejoined(-1), 120)  # group 2 back
        back = max(entry["step"] for entry in run.committed(2))
        run.wait_for_step(2, back + 3, 120)  # ... and stepping
        events["stopped"] = run.signal(2, signal.SIGSTOP)
        events["stopped_at"] = time.time()
        events["quorum_at_stop"] = max(entry["quorum"] for entry in run.committed(0))  # the last one committed
        # past the timeout, and until the others have taken two steps without it (an event, not a fixed wait: under
        # two busy loops an epoch's validation once filled the whole of 8 s, and nothing was stepped while it hung)
        past = events["stopped_at"] + FAULT_TIMEOUT_S + 1
        run.wait_for(0, "two steps without group 2", lambda entries: sum(
            1 for e in entries if "step" in e and e["time"] > past) >= 2, 120)
        run.signal(2, signal.SIGCONT)
        events["continued_at"] = time.time()
        run.wait_for(2, "recovery after the hang", rejoined(events["quorum_at_stop"]), 120)
        open(gate, "w").close()  # the pace off: the run ends at speed
    return {**finish(run, act, timeout_s=400), "events": events}


def stops(out: str, data: str) -> dict:
    """Not in the suite's batches (minutes: ``python tests/replica_scenarios.py OUT stops``): 3 groups,
    --min-replica-groups 1, group 2 stopped (SIGSTOP) REPLICA_STOPS times (20) for STOP_S (8 s, past the fault
    timeout) at random moments of its steps, and woken; after each, the seconds until it rejoined by recovery (a
    quorum after the one the others committed as it stopped; ``asked_s``: from its waking to its request of that
    quorum). The others are paced until the stops are over."""
    import random
    gate = os.path.join(out, "events-over")
    count, pause = int(os.environ.get("REPLICA_STOPS", "20")), float(os.environ.get("REPLICA_STOP_S", "8"))
    run = ReplicaRun(out, 3, flags(data, STEPS["stops"], "--checkpoint-every", "50"), entry="tests/float64_trainer.py",
                     env={"FLOAT64_TRAINER_PACE": f"{PACE_S}:{gate}", "FLOAT64_TRAINER_JOIN_BARRIER": out},
                     min_groups=1, fault_timeout_s=FAULT_TIMEOUT_S, max_restarts=2)
    chance, events = random.Random(int(os.environ.get("REPLICA_STOPS_SEED", "0"))), []

    def act() -> None:
        run.wait_for_step(2, 3, 120)
        for _ in range(count):
            time.sleep(chance.uniform(0.0, 2 * PACE_S))  # anywhere in a step: asking, waiting, averaging, voting
            quorum = max(entry["quorum"] for entry in run.committed(0))
            stopped_at = time.time()
            run.signal(2, signal.SIGSTOP)
            time.sleep(pause)
            run.signal(2, signal.SIGCONT)
            continued_at = time.time()
            run.wait_for(2, f"recovery after stop {len(events) + 1}", lambda entries: any(
                e.get("recovered", {}).get("group") == 2 and e["recovered"]["quorum"] > quorum for e in entries), 120)
            rejoined = time.time()
            note = next(e["recovered"] for e in run.committed(2, steps_only=False)
                        if e.get("recovered", {}).get("group") == 2 and e["recovered"]["quorum"] > quorum)
            events.append({"stopped_at": stopped_at, "continued_at": continued_at, "quorum_at_stop": quorum,
                           "asked_s": note["asked"] - continued_at, "rejoined_s": rejoined - continued_at,
                           "quorum": note["quorum"]})
        open(gate, "w").close()
    outcome = {**finish(run, act, timeout_s=400 + count * (pause + 30)), "events": events}
    return {**outcome, "summary": stops_summary(outcome, run.groups, count, pause)}


def stops_summary(outcome: dict, groups: int, count: int, pause: float) -> dict:
    """The stops scenario's figures: each rejoin's seconds, every group's steps once, their final weights equal."""
    import statistics

    import torch
    weights = [replica_runs.final_weights(outcome["checkpoints"][str(g)]) for g in range(groups)]
    tensors = [{k: v for k, v in (w or {}).items() if torch.is_tensor(v)} for w in weights]
    steps = {str(g): [e["step"] for e in outcome["logs"][str(g)] if "step" in e] for g in range(groups)}
    rejoined, asked = ([e[key] for e in outcome["events"]] for key in ("rejoined_s", "asked_s"))
    return {"stops": count, "stop_s": pause, "fault_timeout_s": FAULT_TIMEOUT_S, "rejoined": len(rejoined),
            "rejoined_s_median": statistics.median(rejoined) if rejoined else None,
            "rejoined_s_max": max(rejoined, default=None), "asked_s_max": max(asked, default=None),
            "codes": outcome["codes"], "seconds": outcome["seconds"],
            "every_step_once": all(s == list(range(STEPS["stops"])) for s in steps.values()),
            "weights_equal": all(t and t.keys() == tensors[0].keys() and all(torch.equal(t[k], tensors[0][k])
                                                                             for k in t) for t in tensors)}


def progress(out: str, data: str) -> dict:
    """Group 1 SIGKILLed after step 3 (its checkpoint at step 2); group 0 goes on alone, saving every 2 steps, and is
    SIGKILLed while it sends the state to group 1, back: its checkpoint holds a later step than group 1's state, so
    group 1 waits for group 0's restart instead of going on from step 2 alone ([Note: progress]). Paced (as alone)
    until group 1 has received group 0's state, so that group 0 cannot finish alone before group 1 is back."""
    gate, back = os.path.join(out, "events-over"), os.path.join(out, "group-1-back")
    env = {0: {"DDP_CIFAR100_FAULT": "0/0:*:send", "FLOAT64_TRAINER_RESTART_DELAY": str(RESTART_DELAY_S)},
           1: {"DDP_CIFAR100_FAULT": "1/0:3:after", "FLOAT64_TRAINER_RESTART_GATE": back}}
    run = ReplicaRun(out, 2, flags(data, STEPS["progress"], "--checkpoint-every", "2"),
                     entry="tests/float64_trainer.py", env={"FLOAT64_TRAINER_PACE": f"{PACE_S}:{gate}",
                                                            "FLOAT64_TRAINER_JOIN_BARRIER": out},
                     group_env=env, min_groups=1, fault_timeout_s=PROGRESS_TIMEOUT_S, max_restarts=2)

    def act() -> None:
        # group 1 back once group 0 alone has checkpointed a later step than group 1's (its restart is warm: back
        # in a fraction of a second, before group 0 took a step alone, were it not held)
        run.wait_for_step(0, 6, 240)
        open(back, "w").close()
        run.wait_for(1, "recovery from group 0", lambda entries: any(
            e.get("recovered", {}).get("group") == 1 and e["recovered"]["source"] == 0 for e in entries), 240)
        open(gate, "w").close()  # the pace off: the run ends at speed
    outcome = finish(run, act, timeout_s=400)
    with open(os.path.join(out, "coordinator.log")) as f:
        return {**outcome, "coordinator": f.read()[-4000:]}


def coordinator(out: str, data: str) -> dict:
    run = ReplicaRun(out, 2, flags(data, 100000, "--checkpoint-every", "3"), entry="tests/float64_trainer.py",
                     min_groups=1, fault_timeout_s=FAULT_TIMEOUT_S, max_restarts=0)
    events = {}

    def act() -> None:
        # both groups past step 7 and each with a checkpoint (a loaded machine may start one late: it then joins
        # by recovery, and its first checkpoint comes later), so that what the test reads is there to be read
        for group in range(2):
            run.wait_for_step(group, 7, 120)
            run.wait_for(group, "checkpoint", lambda entries, g=group: os.path.exists(
                os.path.join(run.path(g, "checkpoints"), "last.pt")), 120)
        run.kill_coordinator()
        events["killed_at"] = time.time()
    outcome = finish(run, act, timeout_s=120)
    outcome["ended_at"] = time.time()
    return {**outcome, "events": events}


def restart(out: str, data: str) -> dict:
    run = ReplicaRun(out, 3, flags(data, STEPS["restart"], "--checkpoint-every", "4"),
                     entry="tests/float64_trainer.py", min_groups=1, fault_timeout_s=RESTART_TIMEOUT_S, max_restarts=2)
    events = {}

    def act() -> None:
        run.wait_for_step(0, 5, 120)  # group 0 has applied step 5: the groups are inside step 6 (or 7)
        events["pids"] = {str(g): run.workers(g) for g in range(3)}
        port = int(run.address.rpartition(":")[2])
        run.kill_coordinator()
        events["killed_at"] = time.time()
        run.start_coordinator(port)  # on the same port, once it listens
        events["restarted_at"] = time.time()
        for group in range(3):
            run.wait_for_step(group, 9, 120)  # every group past the restart, stepping
        events["pids_after"] = {str(g): run.workers(g) for g in range(3)}
    return {**finish(run, act, timeout_s=400), "events": events}


def diloco(out: str, data: str) -> dict:
    env = {0: {"DDP_CIFAR100_FAULT": "0/0:9:send"}, 1: {"DDP_CIFAR100_FAULT": "1/0:4:forward,1/0:7:forward:1"}}
    run = ReplicaRun(out, 2, flags(data, STEPS["diloco"], "--checkpoint-every", "3", "--grad-sync", "diloco",
                                   "--local-steps", "3"), entry="tests/float64_trainer.py", group_env=env,
                     min_groups=2, fault_timeout_s=FAULT_TIMEOUT_S, max_restarts=3)  # group 1: 2 kills, then its
    return finish(run, lambda: None, timeout_s=400)  # transfer torn by group 0's kill ([Note: a torn transfer])


def streaming(out: str, data: str) -> dict:
    gate = os.path.join(out, "events-over")
    env = {1: {"DDP_CIFAR100_FAULT": "1/0:6:allreduce"}}
    run = ReplicaRun(out, 2, flags(data, STEPS["streaming"], "--checkpoint-every", "4", "--grad-sync", "diloco",
                                   "--local-steps", "4", "--fragments", "2", "--outer-delay", "1",
                                   "--outer-compress", "bf16"), entry="tests/float64_trainer.py", group_env=env,
                     env={"FLOAT64_TRAINER_PACE": f"{PACE_S}:{gate}", "FLOAT64_TRAINER_JOIN_BARRIER": out},
                     min_groups=1, fault_timeout_s=FAULT_TIMEOUT_S, max_restarts=2)

    def act() -> None:
        run.wait_for(1, "recovery from group 0", lambda entries: any(
            e.get("recovered", {}).get("group") == 1 for e in entries), 240)
        open(gate, "w").close()  # the pace off: the run ends at speed
    return finish(run, act, timeout_s=400)


def finish(run: ReplicaRun, act, timeout_s: float) -> dict:
    """Start the run, act on it, wait for every group; what the tests read."""
    started = time.time()
    try:
        run.start()
        act()
        codes = run.wait(timeout_s)
    finally:
        run.close()
    return {"codes": {str(g): code for g, code in codes.items()}, "seconds": time.time() - started,
            "logs": {str(g): run.committed(g, steps_only=False) for g in range(run.groups)},
            "outputs": {str(g): run.output(g)[-4000:] for g in range(run.groups)},
            "restarts": {str(g): run.output(g).count("failed (exitcode: -9)") for g in range(run.groups)},
            "checkpoints": {str(g): run.path(g, "checkpoints") for g in range(run.groups)},
            "metrics": {str(g): run.path(g, "metrics") for g in range(run.groups)}}


SCENARIOS = {"kills": kills, "sharded": sharded, "alone": alone, "progress": progress, "diloco": diloco,
             "streaming": streaming, "coordinator": coordinator, "restart": restart, "stops": stops}
# two batches, each a process of its own (tests/test_replica_faults.py): about as long each, on a loaded machine too
BATCHES = (("sharded", "diloco", "coordinator"), ("kills", "alone", "progress", "streaming", "restart"))


def main(out: str, names: list[str]) -> int:
    data = word_corpus(os.path.join(out, "corpus"))
    for name, scenario in ((name, SCENARIOS[name]) for name in names or [n for batch in BATCHES for n in batch]):
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        try:
            outcome = scenario(folder, data)
        except Exception:  # noqa: BLE001 - the test shows it
            outcome = {"error": traceback.format_exc()}
        with open(os.path.join(folder, "outcome.json"), "w") as f:
            json.dump(outcome, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
