"""Faults of fault-tolerant replica groups, caused for real (tests/replica_scenarios.py, run in the background:
a coordinator and a torchrun per group, the trainer in float64), each run compared with what it must equal.

- kills: each of 3 groups SIGKILLed twice, at a different point of a step each time (forward, backward, inside the
  all-reduce across groups, inside the optimizer's step, while sending the live state to a joiner, while saving a
  checkpoint), with --min-replica-groups 3: every step is taken once, by all three groups, none below the minimum
  (the kill mid-transfer loses every group's live state: all start again from their checkpoints, and their logs
  keep only what those checkpoints hold); every group ends with the same weights, bit for bit, and one process
  replaying the commit log reaches them.
- alone: groups 1 and 2 SIGKILLed at once: group 0 goes on alone (--min-replica-groups 1), they come back and
  recover; then group 2 stopped past the fault timeout and woken: left out while hung, it rejoins by recovery, not
  by applying what it had in flight; every group ends with the same weights, which the replay reaches.
- sharded: 3 groups of 2 processes at --zero 3: ranks SIGKILLed inside the group's own reduce-scatter and
  all-gather, while sending their place's shards to a joiner (whose own tensors, half written, stop its group: it
  starts again from its checkpoint) and inside the average of a shard across the groups: every step is taken once
  by all three (one rank of a group stopped past the fault timeout: the run waits for it), every group ends with the
  same weights bit for bit, and the replay reaches them.
- diloco: DiLoCo's replicas as groups: one killed inside a window recovers at the next meeting, bringing nothing to
  it; the one that sends it the state killed mid-transfer: both start again from their checkpoints; they end equal.
- progress: the only group that went on alone killed while it sends the state to the other, back from its older
  checkpoint: that group waits for the first's restart from its newer checkpoint, whose state then wins.
- streaming: streaming DiLoCo's groups (2 fragments, a meeting applied a step late, bf16): one killed inside a
  fragment's meeting heals from the other and they end equal.
- coordinator: the coordinator killed for good: each group waits the fault timeout for it, then says so in one line
  (nothing else: no C++ stack) and stops, its checkpoint whole.
- restart: the coordinator SIGKILLed while 3 groups are inside a step, and restarted on its port: no group restarts
  (its processes are the same), every step is in the log once, the groups end with the same weights, bit for bit,
  and the replay reaches them.

Why 1e-10 for the replay, over hundreds of steps: the replay's sums associate otherwise than the groups' (a few units
of 2^-53 relative per step), and SGD with momentum at lr 0.05 on the tiny GPT is a smooth map that carries such a
difference on without blowing it up: a perturbation of 1e-15 of the weights stays below 2e-13 over 450 steps
(measured here, float64; AdamW at lr 0.01 turns the same 1e-15 into 9e-9 in 17 steps and 5e-2 in 50: Adam's
normalized first steps flip with the sign of tiny gradients, which is why these runs use SGD). A real error (a step
applied by one group and not another, a gradient computed on stale weights, samples counted twice or dropped)
moves the weights at first order, by about lr x O(0.1) = 5e-3.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

import processes
import replica_scenarios
from benchmarks import replica_runs
from trainer_testing import replay_in_group
from zero_testing import max_difference

WAIT_S = 1500  # the scenarios' two batches: about 5 minutes idle, 18 under two busy loops one after the other
pytestmark = [pytest.mark.slow, pytest.mark.timeout(WAIT_S + 100)]  # the first test waits for the scenarios


EARLY_PROCESSES_FIXTURE = "outcomes"  # the fixture that collects them (conftest.py queues them for its tests)


def early_processes():
    """The scenarios in two processes side by side (replica_scenarios.BATCHES): they wait on faults and timeouts more
    than they compute."""
    return {f"scenarios {n}": ([sys.executable, "tests/replica_scenarios.py", processes.folder(__name__), *batch], None)
            for n, batch in enumerate(replica_scenarios.BATCHES)}


@pytest.fixture(scope="module")
def outcomes():
    for done in processes.results_of(sys.modules[__name__], timeout=WAIT_S).values():
        assert done.returncode == 0, done.stderr[-3000:]
    found = {}
    for name in (name for batch in replica_scenarios.BATCHES for name in batch):
        with open(os.path.join(processes.folder(__name__), name, "outcome.json")) as f:
            found[name] = json.load(f)
        assert "error" not in found[name], found[name].get("error")
    return found


def steps_of(log):
    return [entry for entry in log if "step" in entry]


def final_weights(outcome, group):
    """The group's last checkpoint's weights: its last.pt, or (--zero 3) its current DCP folder, read whole."""
    weights = replica_runs.final_weights(outcome["checkpoints"][str(group)])
    assert weights is not None, f"group {group} ended without its checkpoint:\n{outcome['outputs'][str(group)]}"
    return weights


def replayed(local_group, outcome, group, steps):
    log = steps_of(outcome["logs"][str(group)])
    corpus = os.path.join(processes.folder(__name__), "corpus")
    argv = replica_scenarios.flags(corpus, steps)  # without the replica groups' flags
    data_world = 1 + max(rank for entry in log for samples in entry["samples"].values() for rank in samples["ranks"])
    return local_group(1).run(replay_in_group, argv, log, data_world)[0]  # R groups of P: R P data ranks


def test_every_step_is_taken_once_by_all_three_groups_through_six_kills(outcomes):
    kills = outcomes["kills"]
    assert kills["codes"] == {"0": 0, "1": 0, "2": 0}
    for group in ("0", "1", "2"):
        assert kills["restarts"][group] == 2, kills["outputs"][group][-2000:]  # killed twice, restarted twice
        log = steps_of(kills["logs"][group])
        assert [entry["step"] for entry in log] == list(range(replica_scenarios.STEPS["kills"]))
        assert all(entry["participants"] == [0, 1, 2] for entry in log)  # none below --min-replica-groups 3
    recovered = {note["recovered"]["group"] for group in ("0", "1", "2") for note in kills["logs"][group]
                 if "recovered" in note}
    assert recovered == {0, 1}  # group 1 from group 0, group 0 from another (group 2 from its own checkpoint)


def test_a_sharded_group_loses_ranks_inside_each_collective_and_every_step_is_taken_once(outcomes):
    """The sharded scenario (--zero 3, 2 processes a group): ranks SIGKILLed inside the group's reduce-scatter and
    all-gather, while sending a place's shards, and inside the average of a shard across the groups, and one stopped
    past the fault timeout; every step is taken once by all three groups; the joiners see their source lost (a
    joiner whose own tensors were half written stops its group: the torn line)."""
    sharded = outcomes["sharded"]
    assert sharded["codes"] == {"0": 0, "1": 0, "2": 0}
    assert sharded["restarts"]["0"] == 2, sharded["outputs"]["0"][-2000:]  # while sending; inside the average
    for group in ("0", "1", "2"):
        log = steps_of(sharded["logs"][group])
        assert [entry["step"] for entry in log] == list(range(replica_scenarios.STEPS["sharded"]))
        assert all(entry["participants"] == [0, 1, 2] for entry in log)
    # group 0's rank 1 killed while sending its place's shards: the joiners see it by the path the timing gives
    # (a restart warm or cold, a place's transfer ahead of its peer's): half written (torn: the group stops), or
    # before anything was written (the join fails and is asked again, or the group's own collective fails and
    # torchrun restarts it); every step once all the same (above). test_transfer.py has the torn path alone.
    marks = {"torn": "was torn after it began writing", "join failed": "joining quorum", "stopped":
             "failed (exitcode: 1)"}
    seen = {g: [way for way, mark in marks.items() if mark in sharded["outputs"][g]] for g in ("1", "2")}
    print(f"\nsharded: the joiners saw their source lost as {seen}")
    assert any(seen.values()), "no joiner saw its source lost"
    for group in ("0", "1", "2"):  # no place waited for a peer until the group's --timeout: a torn place's group
        # learns it in one collective and stops at once (before: 120 s in every run, one place gathering --zero 3's
        # units on its way out while the other waited in the join's agreement). A quorum's average may time out
        # (its timeout is the fault timeout): group 2's rank 1 is stopped past it, maybe inside the average
        waited = [line for line in sharded["outputs"][group].splitlines()
                  if "Application timeout" in line and "not taken by quorum" not in line]
        assert not waited, waited
    for group in (g for g, ways in seen.items() if "torn" in ways):  # stopped, and restarted by torchrun
        assert sharded["restarts"][group] + sharded["outputs"][group].count("failed (exitcode: 1)") >= 2
    assert any("recovered" in note for note in sharded["logs"]["0"])  # after the kill inside the average
    events = sharded["events"]
    assert events["woken_at"] - events["stopped_at"] > replica_scenarios.FAULT_TIMEOUT_S  # stopped past it
    late = [e for e in steps_of(sharded["logs"]["0"]) if e["time"] > events["stopped_at"]]
    assert late and all(e["participants"] == [0, 1, 2] for e in late)  # the run waited for it and went on with it


@pytest.mark.parametrize("scenario", ["kills", "sharded", "alone", "restart", "progress"])
def test_every_group_ends_with_the_same_weights_and_the_replay_reaches_them(local_group, outcomes, scenario):
    outcome = outcomes[scenario]
    weights = [final_weights(outcome, group) for group in range(len(outcome["codes"]))]
    for other in weights[1:]:
        assert max_difference(weights[0], other) == 0
    worst = max_difference(weights[0], replayed(local_group, outcome, 0, replica_scenarios.STEPS[scenario]))
    print(f"\n{scenario}: one process replaying the commit log vs the groups, float64: max |dw| = {worst:.1e}")
    assert worst < 1e-10


def test_one_group_goes_on_alone_and_the_others_come_back(outcomes):
    alone = outcomes["alone"]
    assert alone["codes"] == {"0": 0, "1": 0, "2": 0}, "\n".join(  # None: still running, its stacks printed
        f"group {g}: {code}\n{alone['outputs'][g]}" for g, code in alone["codes"].items() if code != 0)
    log = steps_of(alone["logs"]["0"])
    assert [entry["step"] for entry in log] == list(range(replica_scenarios.STEPS["alone"]))  # every step once
    killed_at = alone["events"]["killed_at"]
    after = [entry for entry in log if entry["time"] > killed_at]
    assert any(entry["participants"] == [0] for entry in after)  # alone at --min-replica-groups 1
    assert after[-1]["participants"] == [0, 1, 2]  # and all three again
    notes = [note["recovered"] for group in ("0", "1", "2") for note in alone["logs"][group] if "recovered" in note]
    assert {1, 2} <= {note["group"] for note in notes}


def test_a_hung_group_is_left_out_and_rejoins_by_recovery(outcomes):
    alone = outcomes["alone"]
    stopped_at, continued_at = alone["events"]["stopped_at"], alone["events"]["continued_at"]
    log = steps_of(alone["logs"]["0"])
    while_hung = [entry for entry in log if stopped_at + 4.0 < entry["time"] < continued_at]
    assert while_hung and all(2 not in entry["participants"] for entry in while_hung)  # left out past the timeout
    # a recovery in a quorum after the last one committed at the stop (not "asked after the stop": a join that began
    # just before it, stopped before reading its answer, asks again once woken and recovers within that join; nor
    # "past the step taken before it": the commit log that ends the run can be another branch's, from before it)
    before = alone["events"]["quorum_at_stop"]
    rejoined = [note["recovered"] for note in alone["logs"]["2"] if "recovered" in note
                and note["recovered"]["group"] == 2 and note["recovered"]["quorum"] > before]
    assert rejoined, f"group 2 did not rejoin by recovery after its hang (quorum {before}):\n{alone['outputs']['2']}"


def test_no_group_goes_on_from_a_state_older_than_a_checkpoint_holds(outcomes):
    """[Note: progress]: group 0, the only group that went on alone, is killed while it sends the state to group 1;
    group 1, at its older checkpoint's step, waits for group 0's restart instead of training alone, and then
    receives the state group 0's checkpoint holds: no step committed before that checkpoint is thrown away."""
    run = outcomes["progress"]
    assert run["codes"] == {"0": 0, "1": 0}, "\n".join(f"group {g}: {c}\n{run['outputs'][g]}" for g, c in
                                                       run["codes"].items() if c != 0)
    assert run["restarts"] == {"0": 1, "1": 1}
    log = steps_of(run["logs"]["0"])
    assert [entry["step"] for entry in log] == list(range(replica_scenarios.STEPS["progress"]))  # every step once
    resumed = [int(line.rsplit(" ", 1)[1]) for line in run["outputs"]["0"].splitlines()
               if line.startswith("resuming from ")]
    assert len(resumed) == 1 and resumed[0] > 3, run["outputs"]["0"][-2000:]  # group 0's restart, past step 3
    # group 1, back at its checkpoint's step, never trained alone from there up to group 0's checkpoint (before, or
    # once both hold the same state, it may: under load group 0 once started so late that group 1 took the first
    # steps alone, and once was left out of a step past the fault timeout and received group 1's state after it)
    back = [int(line.rsplit(" ", 1)[1]) for line in run["outputs"]["1"].splitlines()
            if line.startswith("resuming from ")]
    assert len(back) == 2 and back[0] == back[1], run["outputs"]["1"][-2000:]  # its kill; its transfer torn by
    # group 0's kill (its own tensors half written: [Note: a torn transfer])
    assert not any(entry["participants"] == [1] and back[0] <= entry["step"] < resumed[0] for entry in log)
    notes = [note["recovered"] for note in run["logs"]["1"] if "recovered" in note]
    assert [(note["group"], note["source"], note["step"]) for note in notes][-1] == (1, 0, resumed[0])
    # what no process can bring back, group 0's steps since its last checkpoint (every 2 steps), said on each group
    # where there were any (none where it was killed right after a save)
    back = [re.findall(r"the run goes back from step (\d+) to step (\d+)", run["outputs"][g]) for g in ("0", "1")]
    assert back[0] == back[1] and all(int(to) == resumed[0] and int(frm) - int(to) <= 2 for frm, to in back[0]), back
    assert "[Note: progress]" in run["coordinator"], run["coordinator"]  # waited for as a restart, not as a holder


def test_diloco_replica_groups_recover_at_a_meeting_and_end_equal(outcomes):
    run = outcomes["diloco"]
    assert run["codes"] == {"0": 0, "1": 0}
    assert run["restarts"] == {"0": 1, "1": 2}
    assert max_difference(final_weights(run, 0), final_weights(run, 1)) == 0  # the run ends on a meeting
    recovered = [note["recovered"] for group in ("0", "1") for note in run["logs"][group] if "recovered" in note]
    assert [(note["group"], note["step"]) for note in recovered] == [(1, 6)]  # at the meeting after its death


def test_a_streaming_diloco_group_killed_inside_a_fragments_meeting_heals_and_ends_equal(outcomes):
    """Streaming DiLoCo across 2 groups (2 fragments, --outer-delay 1, bf16): group 1 SIGKILLed inside a fragment's
    meeting; group 0 goes on alone; group 1 comes back behind, takes group 0's live state (its fragments' state with
    it) at a meeting, and the two end bit for bit alike."""
    run = outcomes["streaming"]
    assert run["codes"] == {"0": 0, "1": 0}, "\n".join(f"group {g}: {c}\n{run['outputs'][g][-2000:]}"
                                                       for g, c in run["codes"].items() if c != 0)
    assert run["restarts"] == {"0": 0, "1": 1}
    assert any("recovered" in note and note["recovered"]["group"] == 1 for note in run["logs"]["1"])
    assert max_difference(final_weights(run, 0), final_weights(run, 1)) == 0  # the run ends on a meeting


def test_the_coordinator_lost_is_one_line_and_the_checkpoints_are_whole(outcomes):
    lost = outcomes["coordinator"]
    for group in ("0", "1"):
        assert lost["codes"][group] not in (0, None)
        lines = [line for line in lost["outputs"][group].splitlines() if line.startswith("ddp_cifar100.py: error:")]
        assert len(lines) == 1 and "coordinator" in lines[0], lost["outputs"][group][-2000:]
        assert "Exception raised from" not in lost["outputs"][group], lost["outputs"][group][-2000:]  # no C++ stack
        path = os.path.join(lost["checkpoints"][group], "last.pt")
        opened = subprocess.run([sys.executable, "-c", "import sys, torch; state = torch.load(sys.argv[1], "
                                 "weights_only=True); print(sorted(state)[:3], state['optimizer_steps'])", path],
                                capture_output=True, text=True, cwd=tempfile.gettempdir())
        assert opened.returncode == 0, opened.stderr  # with torch alone, outside the repository
    assert lost["ended_at"] - lost["events"]["killed_at"] < 60  # every group stopped, none waiting on


def test_the_coordinator_killed_and_restarted_costs_the_groups_nothing(outcomes):
    run = outcomes["restart"]
    assert run["codes"] == {"0": 0, "1": 0, "2": 0}, "\n".join(run["outputs"].values())
    assert run["restarts"] == {"0": 0, "1": 0, "2": 0}  # torchrun restarted none
    assert run["events"]["pids"] == run["events"]["pids_after"]  # the same processes, before and after
    killed_at = run["events"]["killed_at"]
    for group in ("0", "1", "2"):
        log = steps_of(run["logs"][group])
        assert [entry["step"] for entry in log] == list(range(replica_scenarios.STEPS["restart"]))
        assert "the coordinator" in run["outputs"][group] and "is back after" in run["outputs"][group]
    times = [entry["time"] for entry in steps_of(run["logs"]["0"])]
    stall = max(b - a for a, b in zip(times, times[1:]) if b > killed_at)
    print(f"\nrestart: the groups' longest pause across the coordinator's restart: {stall:.1f} s "
          f"(restarted {run['events']['restarted_at'] - killed_at:.1f} s after the kill)")
