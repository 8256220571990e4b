"""ZeRO inside fault-tolerant replica groups (FT-HSDP: trainer/replica_groups.py, replicas/), on the tiny GPT in
float64.

Without faults: 2 replica groups of 2 processes at --zero 1, 2 and 3 (each group sharding over its own processes,
place j's gradient shard averaged with place j's of the other group) give the weights of one run of 4 processes at
--zero 0, within 1e-10, every group bit for bit alike. A group that starts late (no checkpoint: step 0, the run past
it) receives its place's shards from the same place of the other group (zero.checkpoint.held_state: no rank sends or
receives more than its own shards), and both end bit for bit alike, at the weights one process replaying the commit
log reaches. A group of another stage asking to join is refused in one line naming --zero.

Why 1e-10: as in tests/test_replicas.py, the groups' sums associate otherwise than one 4-process run's (each shard
averaged in its group, then across the groups), a few units of 2^-53 per step; a shard averaged with the wrong place,
a step applied by one group only or a shard not loaded moves the weights at first order (lr x O(0.1)).
"""
import os
import time

import pytest

import replicas
from harness import LocalGroup
from trainer import faults
from test_replicas import argv_of, coordinator, corpus, wait_for_lines  # noqa: F401 (corpus: a fixture)
from trainer_testing import collect_all, main_in_group, replay_in_group, train_in_group
from zero_testing import max_difference

STAGES = {1: "torch", 2: "ring", 3: "torch"}  # each stage once, the ring's collectives in and across the groups once


@pytest.fixture(scope="module")
def pairs():
    """Two worker groups of 2 processes, one per replica group, for every case of this file."""
    with LocalGroup(2) as first, LocalGroup(2) as second:
        yield first, second


@pytest.fixture(scope="module")
def whole(local_group, corpus):  # noqa: F811
    """One run of the 4 processes at --zero 0: what the groups must equal."""
    return local_group(4).run(train_in_group, argv_of(corpus), "float64")[0]["state"]


def sharded(stage):
    return ["--zero", str(stage), "--allreduce", STAGES[stage]]


@pytest.fixture(scope="module", params=sorted(STAGES))
def together(request, pairs, corpus, tmp_path_factory):  # noqa: F811
    """Groups 0 and 1 at --zero STAGE, from the start; a third process of another stage asks to join meanwhile."""
    stage, out = request.param, tmp_path_factory.mktemp(f"zero{request.param}")
    with coordinator() as address:
        flags = ["--replica-groups", "2", "--coordinator", address, "--fault-timeout", "30", *sharded(stage)]
        pending = {group: where.submit(train_in_group, argv_of(
                       corpus, *flags, "--replica-group", str(group), "--commit-log", str(out / f"log{group}")),
                       "float64") for group, where in enumerate(pairs)}
        groups = collect_all(pending)
    return stage, groups


def test_sharded_groups_are_one_run_of_four_at_zero_0(together, whole):
    stage, groups = together
    for group, ranks in groups.items():
        assert [rank["metrics"]["optimizer_steps"] for rank in ranks] == [6, 6]
        worst = max_difference(ranks[0]["state"], whole)
        print(f"\n--zero {stage} ({STAGES[stage]}), replica group {group} of 2 processes vs one run of 4 at --zero 0, "
              f"float64: max |dw| = {worst:.1e}")
        assert worst < 1e-10
        assert max_difference(ranks[1]["state"], ranks[0]["state"]) == 0
    assert max_difference(groups[0][0]["state"], groups[1][0]["state"]) == 0  # the same average applied


LATE_STEPS, PACE_S = 40, 0.3  # the late case: group 0 takes at least 12 s to end unless group 1 has recovered


def paced_train(rank, world_size, argv, gate, pace_s=PACE_S):
    """train_in_group in float64, each optimizer step ending with ``pace_s`` of sleep until the file ``gate``
    exists (tests/float64_trainer.py's pace): the run cannot end before a late group has joined, however slowly it
    starts."""
    at = faults.FaultPlan.at

    def at_then_wait(plan, point, step):
        at(plan, point, step)
        if point == "after" and not os.path.exists(gate):
            time.sleep(pace_s)
    faults.FaultPlan.at = at_then_wait
    try:
        return train_in_group(rank, world_size, argv, "float64")
    finally:
        faults.FaultPlan.at = at


@pytest.fixture(scope="module", params=[1, 3])
def late(request, pairs, corpus, tmp_path_factory):  # noqa: F811
    """Group 0 at --zero STAGE starts alone (--min-replica-groups 1), its steps paced until group 1 has recovered;
    group 1 starts once group 0 has committed 2 steps, with nothing on disk, so it joins behind and receives the live
    state."""
    stage, out = request.param, tmp_path_factory.mktemp(f"late{request.param}")
    gate = out / "recovered"
    with coordinator() as address:
        flags = ["--replica-groups", "2", "--coordinator", address, "--fault-timeout", "3", "--min-replica-groups",
                 "1", "--max-steps", str(LATE_STEPS), *sharded(stage)]
        first = pairs[0].submit(paced_train, argv_of(corpus, *flags, "--replica-group", "0", "--commit-log",
                                                     str(out / "log0")), str(gate))
        wait_for_lines(out / "log0", 3)  # the run's id, steps 0 and 1
        second = pairs[1].submit(train_in_group, argv_of(corpus, *flags, "--replica-group", "1", "--commit-log",
                                                         str(out / "log1")), "float64")
        deadline = time.monotonic() + 120
        while not (os.path.exists(out / "log1") and "recovered" in open(out / "log1").read()):
            assert time.monotonic() < deadline, "group 1 did not recover within 120 s"
            time.sleep(0.05)
        gate.write_text("")
        groups = collect_all({0: first, 1: second})
    return stage, groups, replicas.read_log(out / "log1", steps_only=False)


def test_a_late_sharded_group_receives_its_places_shards_and_ends_alike(late, local_group, corpus):  # noqa: F811
    stage, groups, log = late
    recovered = [note["recovered"] for note in log if "recovered" in note]
    assert len(recovered) == 1 and recovered[0]["source"] == 0 and recovered[0]["step"] >= 2, recovered
    state = groups[0][0]["state"]
    model_bytes = sum(t.numel() * t.element_size() for name, t in state.items() if name != "head.weight")  # tied
    print(f"\n--zero {stage}: the late group's place 0 received {recovered[0]['bytes']} bytes; the model is "
          f"{model_bytes} (SGD's momentum as much again)")
    if stage == 3:  # a place's own shards (its half of the weights and of the momentum), not the whole model
        assert recovered[0]["bytes"] < 1.2 * model_bytes
    for ranks in groups.values():
        for rank in ranks:
            assert max_difference(rank["state"], state) == 0
    replayed = local_group(1).run(replay_in_group, argv_of(corpus, "--max-steps", str(LATE_STEPS)),
                                  [entry for entry in log if "step" in entry and "participants" in entry], 4)[0]
    worst = max_difference(state, replayed)
    print(f"--zero {stage}: one process replaying the commit log vs the groups, float64: max |dw| = {worst:.1e}")
    assert worst < 1e-10


def test_a_group_of_another_stage_is_refused_naming_zero(pairs, corpus, tmp_path):  # noqa: F811
    """Group 0 at --zero 3 holds the run (paced until the other has asked); group 1 asks at --zero 1: refused in one
    line naming --zero (its shards would be cut otherwise), with 1; group 0 trains on alone (--min-replica-groups
    1) to the end."""
    with coordinator() as address:
        flags = ["--replica-groups", "2", "--coordinator", address, "--fault-timeout", "3", "--min-replica-groups",
                 "1"]
        first = pairs[0].submit(paced_train, argv_of(corpus, *flags, "--replica-group", "0", "--commit-log",
                                                     str(tmp_path / "log0"), *sharded(3)), str(tmp_path / "asked"))
        wait_for_lines(tmp_path / "log0", 2)  # the run's id and step 0: the run is group 0's
        refused = pairs[1].run(main_in_group, argv_of(corpus, *flags, "--replica-group", "1", *sharded(1)))
        (tmp_path / "asked").write_text("")
        held = collect_all({0: first})[0]
    assert [rank["metrics"]["optimizer_steps"] for rank in held] == [6, 6]
    assert [rank["code"] for rank in refused] == [1, 1]
    lines = refused[0]["stderr"].strip().splitlines()
    assert len(lines) == 1 and "another configuration (--zero 1, where the run's is 3)" in lines[0], lines


DILOCO = ["--grad-sync", "diloco", "--local-steps", "2", "--outer-lr", "0.7", "--outer-momentum", "0.9",
          "--fragments", "2", "--zero", "3"]


def test_diloco_across_sharded_groups_is_one_diloco_run_of_sharded_replicas(pairs, local_group, corpus):  # noqa: F811
    """DiLoCo with 2 fragments, each group a replica sharded over its 2 processes at --zero 3 (the outer state is
    per shard: place j's pseudo-gradient shard averaged with place j's), against one run of 4 processes with
    --replicas 2 at --zero 3: the same weights, within 1e-10 in float64, every group alike."""
    with coordinator() as address:
        flags = [*DILOCO, "--replica-groups", "2", "--coordinator", address]
        pending = {group: where.submit(train_in_group, argv_of(corpus, *flags, "--replica-group", str(group)),
                                       "float64") for group, where in enumerate(pairs)}
        groups = collect_all(pending)
    whole = local_group(4).run(train_in_group, argv_of(corpus, *DILOCO, "--replicas", "2"), "float64")
    for group, ranks in groups.items():
        worst = max(max_difference(ranks[j]["state"], whole[2 * group + j]["state"]) for j in (0, 1))
        print(f"\ndiloco --fragments 2 --zero 3, replica group {group} vs replica {group} of one run, float64: "
              f"max |dw| = {worst:.1e}")
        assert worst < 1e-10
