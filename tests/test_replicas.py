"""Fault-tolerant replica groups (replicas/, trainer/replica_groups.py), on the tiny GPT in float64.

Without faults: 2 replica groups of 2 processes, each its own process group and coordinated only through the
coordinator's store, give the weights of one run of 4 processes at --zero 0, and one process replaying the commit
log gives them too; a group of another configuration that asks to join is refused in one line and changes nothing.

Why 1e-10 in float64: the groups' arithmetic differs from one 4-process run only in how the sums associate (each
group averages its 2 ranks, then the quorum its 2 groups; the replay adds 4 ranks' scaled gradients), a few units
of 2^-53 relative per step, which SGD with momentum carries on without blowing it up (tests/test_replica_faults.py
measures it: 1e-15 stays below 2e-13 over 450 steps). A real error (a step applied by one group and not the other, a
group's samples counted twice or dropped, a gradient averaged over the wrong number of groups) moves the weights at
first order, by about lr x O(0.1) = 5e-3.
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

import replicas
from harness import LocalGroup
from trainer_testing import collect_all, main_in_group, replay_in_group, train_in_group, word_corpus
from zero_testing import max_difference


@contextlib.contextmanager
def coordinator(runs_file=None):
    """A coordinator in this process: a TCPStore on a port the OS hands out, and the lighthouse on a thread (keeping
    ``runs_file``, a path, if given)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    stop = threading.Event()
    kept = replicas.RunsFile(str(runs_file)) if runs_file else None
    lighthouse = threading.Thread(target=replicas.Lighthouse(store, runs_file=kept).run, args=(stop,), daemon=True)
    lighthouse.start()
    try:
        yield f"127.0.0.1:{store.port}"
    finally:
        stop.set()
        lighthouse.join()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return word_corpus(tmp_path_factory.mktemp("corpus"))


def argv_of(corpus, *flags):
    """6 steps of SGD with momentum on 16 windows of 16 bytes a step (2 a micro-batch x 2 micro-batches x 4 data
    ranks)."""
    return ["--device", "cpu", "--dataset", "text", "--model", "gpt-tiny", "--context", "16", "--val-fraction",
            "0.3", "--data-dir", str(corpus), "--batch-size", "2", "--grad-accum", "2", "--epochs", "1",
            "--max-steps", "6", "--seed", "5", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
            "--timeout", "120", *flags]


def wait_for_lines(path, count, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not (os.path.exists(path) and sum(1 for _ in open(path)) >= count):
        assert time.monotonic() < deadline, f"{path}: fewer than {count} lines in {timeout_s} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two_groups(local_group, corpus, tmp_path_factory):
    """Groups 0 and 1 of 2 processes each (two process groups of their own) through one coordinator, a third of
    another --lr asking to join once they train; and one run of the 4 processes, which the groups must equal."""
    out = tmp_path_factory.mktemp("groups")
    with coordinator() as address, LocalGroup(2) as first, LocalGroup(2) as second, LocalGroup(1) as stranger:
        flags = ["--replica-groups", "2", "--coordinator", address, "--fault-timeout", "30"]
        pending = {group: where.submit(train_in_group, argv_of(
                       corpus, *flags, "--replica-group", str(group), "--commit-log", str(out / f"log{group}")),
                       "float64") for group, where in enumerate((first, second))}
        wait_for_lines(out / "log0", 2)  # the run's id and step 0
        refused = stranger.run(main_in_group, argv_of(corpus, *flags, "--replica-group", "1", "--lr", "0.02"))
        groups = collect_all(pending)
        (out / "late").write_text("".join(line for line in open(out / "log1") if "finished" not in line))  # the
        # log of a process of group 1 that died before the end: it took part in the run
        late = first.run(main_in_group, argv_of(corpus, *flags, "--replica-group", "1", "--commit-log",
                                                str(out / "late")))  # back at step 0 (no checkpoint), too late
        new = first.run(main_in_group, argv_of(corpus, *flags, "--replica-group", "0"))  # a new run: nothing on disk
    whole = local_group(4).run(train_in_group, argv_of(corpus), "float64")
    return {"groups": groups, "whole": whole, "refused": refused[0], "late": late, "new": new, "logs": out}


def test_a_group_back_after_the_run_finished_ends_with_0_and_says_why(two_groups):
    """Not a failure (its torchrun would restart it again and again, each start refused): a note in one line."""
    late = two_groups["late"]
    assert [rank["code"] for rank in late] == [0, 0]
    lines = late[0]["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp_cifar100.py: note: replica group 1 refused by the "
                                                   "coordinator: the run finished at step 6"), late[0]["stderr"]


def test_a_group_left_behind_marks_its_folder_and_every_reader_says_so(tmp_path, capsys):
    """[Note: left behind] (trainer/checkpoint/folders.py): a group told the run finished at step 6 while its folder
    holds step 4 marks the folder (rank 0), says which step it holds in its note, and the readers (the trainer's
    current checkpoint, read_alone: --generate and the export) say the folder is not the run's result; a save into
    it removes the mark."""
    from types import SimpleNamespace

    from trainer import checkpoint
    from trainer.replica_groups import ReplicaGroups
    from utils import UsageError
    (tmp_path / "last.pt").write_bytes(b"a checkpoint of step 4")
    groups = object.__new__(ReplicaGroups)
    groups.parts = SimpleNamespace(config=SimpleNamespace(checkpoint_dir=str(tmp_path), replica_group=1),
                                   ctx=SimpleNamespace(rank=0))
    groups.replica = SimpleNamespace(durable=4, run="the-run")
    said = groups._left_behind(replicas.RunFinished("replica group 1 refused by the coordinator: the run finished at "
                                                    "step 6", {"step": 6, "group": 0, "run": "the-run"}))
    mark = tmp_path / checkpoint.folders.BEHIND
    assert isinstance(said, replicas.RunFinished) and str(said).endswith(
        f"; its --checkpoint-dir {tmp_path} holds step 4, marked as not the run's end ({mark})"), str(said)
    assert json.loads(mark.read_text()) == {"held_step": 4, "group": 1, "run": "the-run", "run_end_step": 6,
                                            "end_group": 0}
    note = (f"note: {tmp_path} holds step 4 of a run that finished at step 6 without this group: not the run's "
            f"result, which is in replica group 0's checkpoints ({mark})")
    assert checkpoint.current(str(tmp_path)).note == note
    with pytest.raises(UsageError):  # (not a real last.pt: the reader refuses it, having said the note)
        checkpoint.read_alone(str(tmp_path))
    assert capsys.readouterr().err.splitlines()[0] == note
    checkpoint.folders.clear_behind(str(tmp_path))  # what every save does first, on rank 0
    assert checkpoint.current(str(tmp_path)).note is None


def test_a_new_run_on_a_coordinator_whose_run_finished_is_refused_with_1(two_groups):
    """Not the late group's note and 0 (a new run that trained nothing, its checkpoint folder empty, ended as done):
    a group that keeps nothing of the run (no commit log nor checkpoint naming its id) is a new run, refused."""
    new = two_groups["new"]
    assert [rank["code"] for rank in new] == [1, 1]
    lines = new[0]["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp_cifar100.py: error: replica group 0 refused by the "
                                                   "coordinator: this coordinator's run finished at step 6"), lines


def answer_of(store, ticket):
    """The lighthouse's answer to ``ticket`` as a member reads it (Replica._ask): a refusal, or the quorum whose id
    it names, its record and its members ([Note: small answers] in replicas/protocol.py)."""
    answer = store.get(f"{replicas.PREFIX}ticket/{ticket}")
    if not answer.isdigit():
        return json.loads(answer)
    n = answer.decode()
    return {**json.loads(store.get(f"{replicas.PREFIX}quorum/{n}")),
            "members": json.loads(store.get(f"{replicas.PREFIX}members/{n}"))}


def lighthouse_by_hand(new_run=False, runs_file=None):
    """A lighthouse over a store of its own, driven by hand: ``ask(ticket, run, step)`` has group 0 (1 process of 1
    planned, incarnation ``ticket``, of run ``run``) ask, the lighthouse form (and write its runs file, if given a
    path), and returns its answer; each asker is gone once answered (not a second claimant). Returns (store, ask);
    ``ask.lighthouse`` is the lighthouse."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    lighthouse = replicas.Lighthouse(store, new_run=new_run,
                                     runs_file=replicas.RunsFile(str(runs_file)) if runs_file else None)

    def ask(ticket, run, step=0, last_commit=None):
        store.set(f"{replicas.PREFIX}hb/0/0", f"{ticket}/0")
        store.queue_push(replicas.PREFIX + "events", json.dumps({
            "ticket": f"0/{ticket}/1", "group": 0, "step": step, "last_commit": last_commit, "durable": 0,
            "identity": "same", "run": run, "size": 1, "planned": 1, "min_groups": 1, "fault_timeout": 30.0}))
        lighthouse._take_requests()
        lighthouse._watch_heartbeats()
        lighthouse._form()
        lighthouse._keep()  # (as the run loop, after it forms)
        lighthouse.alive.clear()
        return answer_of(store, f"0/{ticket}/1")
    ask.lighthouse = lighthouse
    return store, ask


def test_the_run_id_tells_a_group_of_the_run_from_another_run():
    """The lighthouse by hand: its first quorum names a new run id, which a group's request carries from then on (its
    commit log's note, its --checkpoint-dir's replica-run); once the run finished, a request without one is a new
    run (refused: 1), one with the run's is a group back late (the note: 0), one of another run is refused."""
    store, ask = lighthouse_by_hand()
    run = ask("first", None)["run"]
    assert run
    store.set(f"{replicas.PREFIX}finished", json.dumps({"step": 5, "group": 0, "run": run}))
    answers = [ask(ticket, which) for ticket, which in (("new", None), ("late", run), ("other", "elsewhere"))]
    assert [answer.get("finished") for answer in answers] == [False, True, False]
    assert answers[1]["end"] == {"step": 5, "group": 0, "run": run}  # for its folder's mark ([Note: left behind])
    assert "the run's weights are group 0's (and those of the groups that finished with it)" in answers[1]["refused"]
    assert "this coordinator's run finished at step 5" in answers[0]["refused"]
    assert "another run (elsewhere" in answers[2]["refused"]


def test_a_group_at_the_ends_step_without_the_last_commit_is_behind_the_end():
    """A streaming DiLoCo group's steps run ahead of its meetings: one late to the run's last meeting asks at the
    end's step with an older last commit. It is behind the end (refused, told the run finished), as a group at an
    earlier step is. (Once seen under load: such a group formed a quorum of
    its own, and the run ended twice with two sets of weights.)"""
    store, ask = lighthouse_by_hand()
    run = ask("first", None)["run"]
    store.set(f"{replicas.PREFIX}finished", json.dumps({"step": 40, "group": 1, "run": run, "quorum": 21}))
    late = ask("late", run, step=40, last_commit=19)
    assert late.get("finished") and late["end"]["quorum"] == 21, late
    assert "the run finished at step 40 while this group was away (it is at step 40, without the run's last " \
           "commit, quorum 21)" in late["refused"]


def test_a_coordinator_started_with_new_run_starts_a_new_run_once_the_old_one_finished():
    """--new-run (Lighthouse(new_run=True)): once the run finished, a group that keeps no run id (a new run) is not
    refused but starts a new run, under a new id; a group of the finished run back late is still told it finished,
    and the new run's own end is kept apart from the old one's. Without the flag, the same group is refused (the
    test above)."""
    store, ask = lighthouse_by_hand(new_run=True)

    old = ask("first", None)
    store.set(f"{replicas.PREFIX}finished", json.dumps({"step": 5, "group": 0, "run": old["run"]}))
    new = ask("new", None)
    assert "refused" not in new and new["members"] == [0] and new["run"] not in (None, old["run"])
    assert new["id"] > old["id"]  # (the old run's quorum keys are not reused)
    assert not store.check([f"{replicas.PREFIX}finished"])  # the new run's end will be its own
    late = ask("late", old["run"], step=2)
    assert late.get("finished") and "the run finished at step 5" in late["refused"]
    assert late["end"] is None and "the run's weights are the other groups'" in late["refused"]  # (not the new run's)
    store.set(f"{replicas.PREFIX}finished", json.dumps({"step": 9, "group": 0, "run": new["run"]}))
    assert ask("late-new", new["run"], step=3).get("finished")  # the new run's late group: its end, step 9


def test_a_coordinator_restarted_on_its_runs_file_knows_the_runs_end_once_the_groups_have_gone(tmp_path):
    """--runs-file: a lighthouse that saw its run finish, stopped (every group gone, so none carries the end to the
    next one), and a new lighthouse on a new store and the same file: a late group of the run is told it finished,
    a new run is refused; started with --new-run, the new run starts afresh and the file names both runs; and the
    next restart still tells the old run's late group."""
    path = tmp_path / "runs.json"
    store, ask = lighthouse_by_hand(runs_file=path)  # (no file yet: a fresh coordinator)
    old = ask("first", None)["run"]
    store.set(f"{replicas.PREFIX}finished", json.dumps({"step": 5, "group": 0, "run": old}))
    ask.lighthouse._keep()  # (the run loop's next look)
    assert json.loads(path.read_text()) == {"run": old, "finished": {"step": 5, "group": 0, "run": old},
                                            "finished_runs": {}}

    _, ask = lighthouse_by_hand(runs_file=path)  # restarted: an empty store
    late = ask("late", old, step=2)
    assert late.get("finished") and "the run finished at step 5 while this group was away" in late["refused"]
    new = ask("new", None)
    assert not new.get("finished") and "this coordinator's run finished at step 5" in new["refused"]

    _, ask = lighthouse_by_hand(new_run=True, runs_file=path)
    new = ask("new", None)
    assert "refused" not in new and new["run"] not in (None, old)
    assert json.loads(path.read_text()) == {"run": new["run"], "finished": None, "finished_runs": {old: 5}}
    assert ask("late", old, step=2).get("finished")

    _, ask = lighthouse_by_hand(runs_file=path)
    assert ask("late", old, step=2).get("finished")
    assert "refused" not in ask("again", new["run"], step=3)  # the new run, not finished, goes on


@pytest.mark.timeout(60)
def test_a_group_that_finished_returns_only_once_the_coordinator_keeps_the_end(tmp_path, monkeypatch):
    """The run's end is the coordinator's store's until its lighthouse writes the runs file, at its next look: a
    group that finished and exited before that, the coordinator lost too, would leave a restarted coordinator knowing
    nothing of the end (a late group would train alone). Replica.finish returns only once the lighthouse says the end
    is kept (finished_kept): the file holds it by then, however slow its write (0.5 s here)."""
    path, write = tmp_path / "runs.json", replicas.RunsFile.write

    def slow(self, kept):
        if kept["finished"] is not None:
            time.sleep(0.5)
        write(self, kept)
    monkeypatch.setattr(replicas.RunsFile, "write", slow)
    with coordinator(runs_file=path) as address:
        member = replicas.Replica(address, 0, 1, "same", lambda: {}, lambda state: None, fault_timeout_s=30.0)
        try:
            member.join(0)
            member.finish(5)
            assert json.loads(path.read_text())["finished"] == {"step": 5, "group": 0, "run": member.run,
                                                                "quorum": None}  # (it committed no step)
        finally:
            member.close()


@pytest.mark.timeout(60)
def test_a_coordinator_that_cannot_keep_the_end_holds_a_finished_group_a_fault_timeout_and_says_so(
        tmp_path, monkeypatch, capsys):
    """Its runs file unwritable (a full disk), the coordinator never says the end is kept: the group that finished
    waits the fault timeout, no longer, and says in one line what that leaves."""
    def full(descriptor):
        raise OSError(28, "No space left on device")
    with coordinator(runs_file=tmp_path / "runs.json") as address:
        member = replicas.Replica(address, 0, 1, "same", lambda: {}, lambda state: None, fault_timeout_s=2.0)
        try:
            member.join(0)
            monkeypatch.setattr(os, "fsync", full)
            member.finish(5)  # (after the fault timeout, 2 s: the test's timeout is the bound on a hang)
        finally:
            member.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("replicas: group 0:")]
    assert lines == [f"replicas: group 0: the coordinator {address} did not say within the fault timeout that it "
                     f"keeps the run's end (its --runs-file unwritable?): restarted, it may not know the run "
                     f"finished"], lines


@pytest.mark.timeout(120)
def test_a_run_that_finished_as_its_coordinator_was_lost_ends_well(tmp_path, capsys):
    """The coordinator lost for good just as a group finishes: the run is done all the same (the group returns, the
    trainer exits 0), and the group says in one line that its commit log alone keeps the end."""
    from benchmarks.replica_runs import ReplicaRun
    run = ReplicaRun(str(tmp_path), 0, [])
    run.start_coordinator()
    try:
        member = replicas.Replica(run.address, 0, 1, "same", lambda: {}, lambda state: None, fault_timeout_s=2.0,
                                  commit_log=str(tmp_path / "commits.jsonl"))
        try:
            member.join(0)
            run.kill_coordinator()
            member.finish(5)
        finally:
            member.close()
    finally:
        run.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("replicas: ")]
    assert lines[-1].startswith("replicas: replica group 0: the coordinator ") and lines[-1].endswith(
        "the run's end is kept in this group's commit log only"), lines
    assert replicas.read_log(str(tmp_path / "commits.jsonl"), False)[-1] == {"finished": 5}


def test_the_runs_file_is_replaced_whole_never_written_in_place(tmp_path, monkeypatch, capsys):
    """Each change of the runs file is a new file renamed over the old one (a reader, or a restart after a crash
    mid-write, sees the old content or the new, never half), no temporary file left behind; a write that fails (a
    full disk) leaves the old content whole, is said in one line, and is tried again at the next look."""
    path = tmp_path / "runs.json"
    store, ask = lighthouse_by_hand(runs_file=path)
    seen = []

    def look():
        assert os.listdir(tmp_path) == ["runs.json"]  # (no temporary file left)
        seen.append((os.stat(path).st_ino, json.loads(path.read_text())))

    run = ask("first", None)["run"]
    look()
    store.set(f"{replicas.PREFIX}finished", json.dumps({"step": 5, "group": 0, "run": run}))
    ask.lighthouse._keep()
    look()
    assert seen[0][1]["run"] == run and seen[1][1]["finished"]["step"] == 5
    assert seen[0][0] != seen[1][0]  # another file in its place, not the same one rewritten

    def full(descriptor):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    ask.lighthouse.finished_runs["earlier"] = 2
    ask.lighthouse._keep()
    ask.lighthouse._keep()  # (said once)
    look()
    assert seen[2] == seen[1]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m replicas serve: warning: --runs-file {path} not "
                                               f"written (OSError: [Errno 28] No space left on device)"), err
    monkeypatch.undo()
    ask.lighthouse._keep()
    look()
    assert seen[3][1]["finished_runs"] == {"earlier": 2}


@pytest.mark.timeout(60)
def test_serve_refuses_a_runs_file_it_cannot_use_in_one_line(tmp_path, capsys):
    """A runs file that is not one (half a JSON object, another shape), a folder, or a path whose folder does not
    exist: one line at the start, exit 2, the port never taken, no traceback (the real command, and main)."""
    bad = tmp_path / "runs.json"
    bad.write_text('{"run": "abc", "finished": ')
    done = subprocess.run([sys.executable, "-m", "replicas", "serve", "--port", "0", "--runs-file", str(bad)],
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"python -m replicas serve: error: --runs-file {bad}: not JSON "
                                                   f"(Expecting value"), lines
    (tmp_path / "list.json").write_text("[]")
    kept = {"run": "abc", "finished_runs": {}}
    for name, finished in (("true", {"step": True, "group": 0, "run": "abc"}),  # read as "finished at step 1"
                           ("negative", {"step": -3, "group": 0, "run": "abc"}),
                           ("no id", {"step": 3, "group": 0, "run": ""}),
                           ("quorum", {"step": 3, "group": 0, "run": "abc", "quorum": True})):
        (tmp_path / f"{name}.json").write_text(json.dumps({**kept, "finished": finished}))
    (tmp_path / "empty run.json").write_text(json.dumps({**kept, "run": "", "finished": None}))
    for path, why in ((tmp_path / "list.json", "not a runs file (a JSON object with exactly the keys"),
                      *((tmp_path / f"{name}.json", "not a runs file (finished {") for name in
                        ("true", "negative", "no id", "quorum")),
                      (tmp_path / "empty run.json", "not a runs file (run '': a run id or null expected)"),
                      (tmp_path, "a file's path expected"),
                      (tmp_path / "nowhere" / "runs.json", f"its folder {tmp_path / 'nowhere'} does not exist")):
        assert replicas.main(["serve", "--port", "0", "--runs-file", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"python -m replicas serve: error: --runs-file {path}: "), err
        assert why in err[0], err


def test_serve_passes_new_run_to_the_lighthouse():
    from unittest import mock
    with mock.patch("replicas.cli.serve") as serve:
        assert replicas.main(["serve", "--port", "0", "--new-run"]) == 0
        assert replicas.main(["serve", "--port", "0"]) == 0
    assert [call.args for call in serve.call_args_list] == [(0, "0.0.0.0", True), (0, "0.0.0.0", False)]


@pytest.mark.timeout(120)
def test_the_finished_mark_outlives_a_restart_of_the_coordinator(tmp_path):
    """The run's end is a key of the coordinator's store, which a coordinator killed and restarted has lost: the
    group that finished sets it again on the new one (its heartbeat, until it closes), so that a group of the run
    back late is told the run finished rather than trains alone from its checkpoint."""
    from benchmarks.replica_runs import ReplicaRun
    run = ReplicaRun(str(tmp_path), 0, [])
    run.start_coordinator()
    port, state, members = int(run.address.rpartition(":")[2]), {}, []
    try:
        done = replicas.Replica(run.address, 0, 1, "same", lambda: {}, state.update, fault_timeout_s=60.0)
        members.append(done)
        done.join(0)
        done.finish(5)
        run.kill_coordinator()
        run.start_coordinator(port)
        probe = replicas.connect(run.address, 30.0)
        deadline = time.monotonic() + 30
        while not probe.check([f"{replicas.PREFIX}finished"]):
            assert time.monotonic() < deadline, "the finished mark was not set again on the new coordinator"
            time.sleep(0.05)
        late = replicas.Replica(run.address, 0, 1, "same", lambda: {}, state.update, fault_timeout_s=60.0,
                                step=2, run=done.run)
        members.append(late)
        with pytest.raises(replicas.RunFinished, match="the run finished at step 5"):
            late.join(2)
    finally:
        for member in members:
            member.close()
        run.close()


def test_two_groups_of_two_are_one_run_of_four(two_groups):
    whole = two_groups["whole"][0]
    for group, ranks in two_groups["groups"].items():
        for rank in ranks:
            assert rank["metrics"]["optimizer_steps"] == 6
            assert max_difference(rank["state"], ranks[0]["state"]) == 0  # a group's ranks alike
        worst = max_difference(ranks[0]["state"], whole["state"])
        print(f"\nreplica group {group} (2 of 2 processes) vs one run of 4 processes, float64: max |dw| = {worst:.1e}")
        assert worst < 1e-10
    zero, one = (two_groups["groups"][g][0]["state"] for g in (0, 1))
    assert max_difference(zero, one) == 0  # every group applies the same average


def test_the_bytes_sent_across_the_groups_count(two_groups):
    """sent_bytes_per_step, with replica groups: the group's own gradient sync (2 processes: half the gradient each
    way, an ideal ring's 2 (2-1)/2) plus the average across the 2 groups (the same again); on main the second was
    left out (and a group of 1 process said 0)."""
    ranks = two_groups["groups"][0]
    gradient = sum(t.numel() * t.element_size() for name, t in ranks[0]["state"].items()
                   if name != "head.weight")  # (tied: the token embedding's, one gradient)
    for rank in ranks:
        figures = rank["metrics"]
        assert figures["sent_bytes_per_step"] == pytest.approx(2 * gradient, rel=0.01), figures["sent_bytes_per_step"]


def test_the_commit_log_names_every_step_its_groups_and_their_samples(two_groups):
    for group in (0, 1):
        log = replicas.read_log(two_groups["logs"] / f"log{group}")
        assert [entry["step"] for entry in log] == list(range(6))
        for entry in log:
            assert entry["participants"] == [0, 1]
            window = [2 * entry["step"], 2 * entry["step"] + 2]
            assert entry["samples"] == {str(g): {"epoch": 0, "micro_batches": window, "ranks": [2 * g, 2 * g + 1]}
                                        for g in (0, 1)}


def test_a_group_of_another_configuration_is_refused_in_one_line(two_groups):
    refused = two_groups["refused"]
    assert refused["code"] == 1
    lines = refused["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("refused by the coordinator: another configuration (--lr 0.02, "
                                                 "where the run's is 0.05)"), refused["stderr"]


def test_a_group_of_another_allreduce_is_refused_naming_it():
    """--allreduce is in the groups' identity (not in the checkpoint's trajectory: a resume may change it), and the
    refusal names it: groups of torch's collectives and of the ring's never meet (each quorum timed out, a livelock),
    and --bucket-mb gives buckets of other shapes."""
    from trainer.config import parse_args
    from trainer.replica_groups import identity_record

    base = ["--dataset", "text", "--model", "gpt-tiny", "--replica-groups", "2", "--coordinator", "h:1"]
    records = {(group, flags): identity_record(parse_args([*base, "--replica-group", str(group), *flags]),
                                               {"lr": 0.05, "global_batch": 16})
               for group, flags in ((0, ()), (1, ("--allreduce", "ring")), (1, ("--bucket-mb", "1")))}
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    lighthouse = replicas.Lighthouse(store)
    for ticket, (group, flags) in enumerate(records):
        record = records[group, flags]
        store.queue_push(replicas.PREFIX + "events", json.dumps({
            "ticket": f"{group}/{ticket}/0", "group": group, "step": 0, "last_commit": None, "durable": 0,
            "identity": json.dumps(record),
            "record": record, "size": 1, "planned": 1, "min_groups": 1, "fault_timeout": 30.0}))
        store.set(f"{replicas.PREFIX}hb/{group}/0", f"{ticket}/0")
        lighthouse._take_requests()
        lighthouse._watch_heartbeats()
        lighthouse._form()
    answers = [answer_of(store, f"1/{ticket}/0") for ticket in (1, 2)]
    assert [answer["refused"] for answer in answers] == [
        "replica group 1 refused by the coordinator: another configuration (--allreduce ring, where the run's is "
        "torch)", "replica group 1 refused by the coordinator: another configuration (--bucket-mb 1.0, where the "
        "run's is 25.0)"]


def test_one_process_replaying_the_commit_log_reaches_the_groups_weights(local_group, two_groups, corpus):
    log = replicas.read_log(two_groups["logs"] / "log1")
    replayed = local_group(1).run(replay_in_group, argv_of(corpus), log, 4)[0]
    worst = max_difference(two_groups["groups"][1][0]["state"], replayed)
    print(f"\none process replaying the commit log vs replica group 1, float64: max |dw| = {worst:.1e}")
    assert worst < 1e-10


DILOCO = ["--grad-sync", "diloco", "--local-steps", "2", "--outer-lr", "0.7", "--outer-momentum", "0.9",
          "--allreduce", "ring"]  # the quorum's average on allreduce.py's ring (the groups of 2 above: torch's)


@pytest.fixture(scope="module")
def singles():
    """Three worker groups of one process each, one per replica group, shared by the diloco cases."""
    with LocalGroup(1) as first, LocalGroup(1) as second, LocalGroup(1) as third:
        yield first, second, third


OUTER = {"plain": [], "streaming": ["--local-steps", "4", "--fragments", "2", "--outer-delay", "1",
                                    "--outer-compress", "int4"],
         "bf16": ["--fragments", "2", "--outer-compress", "bf16"]}


@pytest.fixture(scope="module", params=sorted(OUTER))
def diloco_groups(request, local_group, singles, corpus):
    """DiLoCo's replicas as 2 replica groups of one process (meeting through a quorum per meeting, every 2 steps,
    or per fragment, on diloco.py's ring over the quorum's own process groups), and as one run of 2 processes with
    --replicas 2 (meeting on diloco.py's ring): plain, 2 fragments applied a step after launch in int4, and 2
    fragments in bf16."""
    flags = [*DILOCO, *OUTER[request.param]]
    with coordinator() as address:
        groups_flags = [*flags, "--replica-groups", "2", "--coordinator", address]
        pending = {group: where.submit(train_in_group, argv_of(corpus, *groups_flags, "--replica-group", str(group)),
                                       "float64") for group, where in enumerate(singles[:2])}
        groups = collect_all(pending)
    whole = local_group(2).run(train_in_group, argv_of(corpus, *flags, "--replicas", "2"), "float64")
    return request.param, groups, whole


def test_diloco_replica_groups_are_one_diloco_run(diloco_groups):
    case, groups, whole = diloco_groups
    for group, ranks in groups.items():
        worst = max_difference(ranks[0]["state"], whole[group]["state"])  # replica `group` is rank `group` there
        print(f"\ndiloco ({case}) replica group {group} vs replica {group} of one run, float64: max |dw| = "
              f"{worst:.1e}")
        assert worst < 1e-10
    if case == "plain":
        assert max_difference(groups[0][0]["state"], groups[1][0]["state"]) == 0  # the run ends on a meeting


def test_a_diloco_group_joining_mid_window_heals_at_each_fragments_next_meeting(singles, corpus, tmp_path):
    """Groups 0 and 1 of 3 planned train 3 steps of streaming DiLoCo (2 fragments, meeting at steps 2 and 4 of 4,
    applied a step later) and stop; both resume from their checkpoints to step 6, alone, and again with a group 2
    that starts afresh and joins there, mid-window, taking a peer's live state. Group 2 brings nothing to each
    fragment's next meeting (its progress there is the peer's): groups 0 and 1 end as they do alone (to the sums'
    rounding: the average is over 3 members, weights 1, 1, 0), and all three hold the same shared point and outer
    momentum, bit for bit."""
    flags = [*DILOCO, "--local-steps", "4", "--fragments", "2", "--outer-delay", "1", "--replica-groups", "3",
             "--fault-timeout", "3"]  # (a planned group absent: the quorum forms without it after 3 s)

    def run(groups, folder, *more):
        with coordinator() as address:
            return collect_all({g: singles[g].submit(train_in_group, argv_of(
                corpus, *flags, "--coordinator", address, "--replica-group", str(g), "--checkpoint-dir",
                str(tmp_path / folder / f"group{g}"), "--min-replica-groups", str(len(groups)), *more), "float64")
                for g in groups})
    run((0, 1), "alone", "--max-steps", "3")
    shutil.copytree(tmp_path / "alone", tmp_path / "joined")
    alone, joined = run((0, 1), "alone"), run((0, 1, 2), "joined")
    worst = max(max_difference(joined[g][0]["state"], alone[g][0]["state"]) for g in (0, 1))
    print(f"\ndiloco groups 0, 1 with group 2 joining at step 3 vs without it, float64: max |dw| = {worst:.1e}")
    assert worst < 1e-10
    outer = [joined[g][0]["outer"] for g in range(3)]
    for other in outer[1:]:
        assert all(a.equal(b) for a, b in zip(outer[0]["start"], other["start"]))
        momentum = [state["outer_optimizer"]["state"][i]["momentum_buffer"] for state in (outer[0], other)
                    for i in range(2)]
        assert momentum[0].equal(momentum[2]) and momentum[1].equal(momentum[3])


def push_request(store, ticket, group, step, last_commit, fault_timeout=0.0, durable=None):
    """A request to join as a group's place 0 makes it (Replica._ask), of 1 process of 2 planned; with a fault
    timeout of 0, every absent member of the last quorum is late at once. ``durable``: the step the group's newest
    checkpoint holds."""
    store.queue_push(replicas.PREFIX + "events", json.dumps({
        "ticket": ticket, "group": group, "step": step, "last_commit": last_commit, "durable": durable,
        "identity": "same", "size": 1, "planned": 2, "min_groups": 1, "fault_timeout": fault_timeout}))


FAULT_TIMEOUT_S = 3.0  # the lighthouse replays' fault timeout


def lighthouse_replay(fault_timeout):
    """A lighthouse over a store of its own, driven by hand: ``ask(group, step, last_commit, durable)`` queues a
    request (a group of 1 process, its incarnation "start"), ``formed(decision, silent, restarted, decided_ago)``
    runs one formation and decides the quorum it formed (None: it formed none)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    lighthouse = replicas.Lighthouse(store)
    asked = []

    def ask(group, step, last_commit, durable=None):
        ticket = f"{group}/start/{len(asked)}"
        asked.append(ticket)
        push_request(store, ticket, group, step, last_commit, fault_timeout, durable)

    def formed(decision, silent=None, restarted=(), decided_ago=fault_timeout + 1):
        """The next quorum once the last was decided decided_ago seconds ago (by default: its absent members late),
        group g's heartbeat last changed silent[g] seconds ago; None if the lighthouse forms none."""
        for group in (1, 2):  # INCARNATION/COUNT
            incarnation = "again" if group in restarted else "start"
            store.set(f"{replicas.PREFIX}hb/{group}/0", f"{incarnation}/{time.monotonic()}")
        lighthouse._take_requests()
        lighthouse._watch_heartbeats()
        for group, seconds in (silent or {}).items():
            key = f"{replicas.PREFIX}hb/{group}/0"
            lighthouse.beats[key] = (lighthouse.beats[key][0], time.monotonic() - seconds)
        assert lighthouse.quorum is None or lighthouse._decided()  # the run loop forms the next once decided
        if lighthouse.decided_at is not None:
            lighthouse.decided_at = time.monotonic() - decided_ago
        lighthouse._form()
        if not store.check([f"{replicas.PREFIX}ticket/{asked[-1]}"]):
            return None
        quorum = answer_of(store, asked[-1])
        store.set(f"{replicas.PREFIX}decision/{quorum['id']}", decision)
        return quorum

    formed.lighthouse = lighthouse
    return ask, formed


@pytest.mark.parametrize("holder", ["stopped", "restarted", "beating", "starved", "stuck"])
def test_a_group_at_the_step_by_another_branch_receives_the_state(holder, capsys):
    """[Note: lineage], replayed on the lighthouse alone (what a loaded machine did once in the alone scenario):
    quorum 1 is group 1 alone (group 2 had not asked within the fault timeout) and commits step 1; group 1 is then
    late to ask again. Stopped (its heartbeat silent past the fault timeout), it is left out: quorum 2 is group 2
    alone, which takes step 1 again from the state before it; both are then at step 2 by different steps 1, and the
    next quorum must give group 2's state (the last committed) to group 1, not take both as they are. So too if
    another process of group 1 beats (restarted: not the one that holds the step). Beating, or silent for less than
    the fault timeout (starved of CPU on a loaded machine), it is waited for: group 2 alone would take the run back a
    step (every step since its state, in general); the next quorum is both, group 2 receiving group 1's state.
    Beating but stuck past LINEAGE_WAITS fault timeouts, it is waited for no more, and the lighthouse says so."""
    fault_timeout = FAULT_TIMEOUT_S
    ask, formed = lighthouse_replay(fault_timeout)
    ask(1, 0, None), ask(2, 0, None)
    assert formed("commit")["sources"] == {}  # quorum 0: both at step 0
    ask(1, 1, 0)
    first = formed("commit")  # quorum 1: group 1 alone takes step 1
    assert (first["members"], first["step"]) == ([1], 1)
    ask(2, 1, 0)
    if holder in ("beating", "starved"):
        silent = {1: (replicas.STALE_S + fault_timeout) / 2} if holder == "starved" else None
        assert formed("commit", silent) is None  # group 1, the step's only holder, not gone: waited for
        assert "waiting for replica group(s) [1]" in capsys.readouterr().out
        ask(1, 2, first["id"])
        second = formed("commit")
        assert (second["members"], second["step"], second["sources"]) == ([1, 2], 2, {"2": 1})
        return
    left_out = {"stopped": {"silent": {1: fault_timeout + replicas.STALE_S}}, "restarted": {"restarted": [1]},
                "stuck": {"decided_ago": replicas.LINEAGE_WAITS * fault_timeout + 1}}[holder]
    second = formed("commit", **left_out)  # quorum 2: group 1 left out, group 2 alone takes step 1 again
    assert (second["members"], second["step"]) == ([2], 1)
    assert ("have not asked to join in" in capsys.readouterr().out) == (holder == "stuck")
    ask(1, 2, first["id"]), ask(2, 2, second["id"])
    third = formed("commit")
    assert third["members"] == [1, 2] and third["step"] == 2
    assert third["sources"] == {"1": 2}  # the last committed branch is group 2's: group 1 receives it


@pytest.mark.parametrize("liveness", ["connected", "closed", "none"])
def test_a_silent_member_is_given_the_fault_timeout_while_its_connection_is_open(liveness):
    """[Note: hung or gone], replayed on the lighthouse alone: group 1's heartbeat is 2 s old (past STALE_S, within
    the fault timeout of 3 s). Holding its liveness connection open, it is alive (a process starved of CPU, as two
    busy loops on 2 cores once starved one for a second): the next quorum waits for it to ask, and takes it once it
    asked while still silent. Its connection closed (dead), or none held (its heartbeat alone tells), it is gone:
    group 2 goes on alone at once."""
    ask, formed = lighthouse_replay(FAULT_TIMEOUT_S)
    key = f"{replicas.PREFIX}hb/1/0"
    formed.lighthouse.liveness = processes = GoneProcesses((), {(key, "start")} if liveness != "none" else ())
    ask(1, 0, None), ask(2, 0, None)
    first = formed("commit")
    if liveness == "closed":  # group 1's process died after quorum 0
        processes.open.discard((key, "start")), processes.ended.add((key, "start"))
    ask(2, 1, first["id"])
    silent = {"silent": {1: 2.0}, "decided_ago": 0.5}
    second = formed("commit", **silent)
    if liveness != "connected":
        assert (second["members"], second["step"]) == ([2], 1)
        return
    assert second is None  # waited for: alive, not yet late
    ask(1, 1, first["id"])
    second = formed("commit", **silent)
    assert (second["members"], second["step"]) == ([1, 2], 1)


@pytest.mark.parametrize("restarted", ["back", "gone"])
def test_no_quorum_goes_on_from_a_state_older_than_a_checkpoint_can_bring_back(restarted, capsys):
    """[Note: progress], replayed on the lighthouse alone: group 2 is away, group 1 goes on alone to step 3 and
    checkpoints step 2, then dies; group 2 comes back at step 0. It is not given a quorum of its own while group 1,
    whose checkpoint holds step 2, may still restart: back, group 1's state wins (2 of its 3 steps kept, the run
    said to go back from 3 to 2 on every member); gone past LINEAGE_WAITS fault timeouts, group 2 goes on alone from
    step 0, said in one line by the lighthouse and on every member."""
    ask, formed = lighthouse_replay(FAULT_TIMEOUT_S)
    dead = {"silent": {1: FAULT_TIMEOUT_S + replicas.STALE_S}}
    ask(1, 0, None, 0), ask(2, 0, None, 0)
    assert formed("commit")["members"] == [1, 2]  # quorum 0
    ask(1, 1, 0, 0)
    first = formed("commit", silent={2: FAULT_TIMEOUT_S + replicas.STALE_S})  # group 2 away
    ask(1, 2, first["id"], 0)
    second = formed("commit")
    assert (first["members"], first["step"], second["members"], second["step"]) == ([1], 1, [1], 2)
    ask(1, 3, second["id"], 2)  # group 1 at step 3, its checkpoint at step 2: it dies in the next quorum
    assert formed("abort")["step"] == 3
    ask(2, 0, None, 0)  # group 2 back from its checkpoint at step 0
    assert formed("commit", **dead) is None
    assert "waiting for replica group(s) [1]: their checkpoints hold step 2" in capsys.readouterr().out
    if restarted == "back":
        ask(1, 2, first["id"], 2)  # its log cut back to its checkpoint's steps 0 and 1
        quorum = formed("commit", restarted=[1])
        assert (quorum["members"], quorum["step"], quorum["sources"], quorum["back_from"]) == ([1, 2], 2, {"2": 1}, 3)
        return
    quorum = formed("commit", **dead, decided_ago=replicas.LINEAGE_WAITS * FAULT_TIMEOUT_S + 1)
    assert (quorum["members"], quorum["step"], quorum["back_from"]) == ([2], 0, 3)
    assert "have not asked to join in" in capsys.readouterr().out


def stopped_member():
    """A store, its lighthouse, and member 2 as _decision and _ask read it (place 0 of a group of 1, its fault
    timeout 0.2 s), without its processes. The store's own timeout is the members' (protocol.connect's: HANDSHAKE_S,
    30 s), which a get of a deleted key waits out unless the member bounds it ([Note: bounded reads] in
    replicas/asking.py): a 2-s store here hid that from these tests while woken groups waited 26-34 s."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=replicas.protocol.HANDSHAKE_S))
    member = object.__new__(replicas.Replica)
    member.store, member.timeout_s, member.group, member.address = store, 0.2, 2, "the test's store"
    member.heartbeat = type("Beating", (), {"lost": None})()
    member.place, member.size, member.incarnation, member.requests, member.log = 0, 1, "start", 0, []
    member.identity, member.planned, member.min_groups, member.durable = "same", 2, 1, 0
    member.quorum, member.stale = None, False
    member.record, member.run, member.taken, member.log_path = None, None, True, None
    return store, replicas.Lighthouse(store), member


class StoppedAfterTheWait:
    """The store as a member sees it when SIGSTOP lands between its wait for a key and its get: meanwhile the
    lighthouse forgets the quorum (what a loaded run of the alone scenario did: that member then took the store's
    timeout on the get for the coordinator's loss, and came back too late to rejoin)."""

    def __init__(self, store, lighthouse, quorum_id):
        self.store, self.lighthouse, self.quorum_id = store, lighthouse, quorum_id

    def wait(self, keys, timeout):
        self.store.wait(keys, timeout)
        replicas.forgetting.forget(self.store, self.quorum_id, [])

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.mark.timeout(60)
def test_a_decision_forgotten_while_the_member_was_stopped_is_taken_as_not_taken():
    """Replica._decision, the member's read of a quorum's decision (commit's): once the lighthouse has
    forgotten the quorum (its keys deleted two quorums on), the member takes its step as not taken, at once, and is
    given the state it missed by the next quorum, instead of waiting for a key that will never be set again or
    taking the store's timeout for the coordinator's loss."""
    store, lighthouse, member = stopped_member()
    for n, decision in ((4, "commit"), (5, "abort")):
        store.set(f"{replicas.PREFIX}decision/{n}", decision)
        assert member._decision(n) == decision.encode()  # as set, while the quorum is remembered
    replicas.forgetting.forget(store, 4, [])  # quorum 4 forgotten before the member asked: it says so
    began = time.monotonic()
    assert member._decision(4) == b"abort" and time.monotonic() - began < 1.5
    store.set(f"{replicas.PREFIX}decision/6", "commit")
    member.store = StoppedAfterTheWait(store, lighthouse, 6)  # forgotten between the wait and the get
    decided = []
    thread = threading.Thread(target=lambda: decided.append(member._decision(6)), daemon=True)
    thread.start()
    thread.join(replicas.protocol.HANDSHAKE_S / 2)  # the get of the forgotten key, unbounded, waits out the store's
    assert decided == [b"abort"], "the member still waits in the get of a decision its lighthouse forgot"


class StoppedBeforeTheAnswer:
    """The store as member 2 sees it when SIGSTOP lands after its request and before it reads the answer: meanwhile
    the lighthouse answers it (quorum 0, with group 1), aborts that quorum on its silence, goes on with group 1
    alone, and forgets quorum 0 two quorums on, the member's ticket with it (``between``: stopped between its wait
    and its get instead). Then the lighthouse answers whatever the member asks next."""

    def __init__(self, store, lighthouse, between):
        self.store, self.lighthouse, self.between, self.waits, self.asked = store, lighthouse, between, 0, 0
        self.emptied = between != "inside-the-get"

    def get(self, key):
        """``inside-the-get``: the answer deleted between the get's own wait and its read, which TCPStore's libuv
        server answers with b"" (measured: a client's get of a key set and deleted in a loop by another thread
        returned b"" 30,322 times in 10 s, never an error)."""
        if not self.emptied:
            self.emptied = True
            return b""
        return self.store.get(key)

    def wait(self, keys, timeout):
        self.waits += 1
        if self.waits == 1:
            self._quorum([1, 2], "abort")  # the lighthouse, on the member's silence
            time.sleep(0.3)  # past the fault timeout: the next quorum does not wait for it
            self._quorum([1], "commit")
            if self.between:
                self.store.wait(keys, timeout)
            self._quorum([1], "commit")  # forgets quorum 0
            if self.between:
                return
        elif self.store.queue_len(replicas.PREFIX + "events"):  # asked again: answered at once
            self._quorum([1, 2], "commit")
        self.store.wait(keys, timeout)

    def _quorum(self, beating, decision):
        """Group 1 asks; the lighthouse forms the next quorum of the groups that asked and beat; decided so."""
        self.asked += 1
        push_request(self.store, f"1/start/{self.asked}", 1, 0, None)
        for group in beating:
            self.store.set(f"{replicas.PREFIX}hb/{group}/0", f"start/{time.monotonic()}")  # INCARNATION/COUNT
        self.lighthouse._take_requests()
        self.lighthouse._watch_heartbeats()
        self.lighthouse._form()
        self.store.set(f"{replicas.PREFIX}decision/{self.lighthouse.quorum['id']}", decision)
        assert self.lighthouse._decided()  # seen at once, as the lighthouse's loop does

    def __getattr__(self, name):
        return getattr(self.store, name)


def asked_within(member, seconds):
    """``member._ask(0)`` on a thread of its own, waited for up to ``seconds``: [its quorum], or [] where it still
    waits."""
    asked = []
    thread = threading.Thread(target=lambda: asked.append(member._ask(0)), daemon=True)
    thread.start()
    thread.join(seconds)
    return asked


@pytest.mark.timeout(60)
@pytest.mark.parametrize("between", [False, True, "inside-the-get"],
                         ids=["before-the-wait", "between-the-wait-and-the-get", "inside-the-get"])
def test_a_ticket_answered_while_the_member_was_stopped_is_asked_again(between, capsys):
    """Replica._ask: a member stopped after asking, whose answer the lighthouse gave and then forgot (its quorum
    went on without it, and was deleted two quorums on), asks again instead of waiting for a key that will never be
    set again (the alone scenario in CI: group 2 woken from its SIGSTOP waited for good, its run never ended) or
    taking the store's timeout on the get for the coordinator's loss."""
    store, lighthouse, member = stopped_member()
    member.store = StoppedBeforeTheAnswer(store, lighthouse, between)
    asked = asked_within(member, 20)
    assert asked, "the member still waits for the answer its lighthouse forgot"
    assert member.requests == 2 and asked[0].id == 3 and asked[0].members == [1, 2]  # the next quorum's
    assert "forgotten while it was stopped: asking again" in capsys.readouterr().err  # said, in one line


class StoppedAfterTheTicket(StoppedBeforeTheAnswer):
    """The store as member 2 sees it when SIGSTOP lands after it read its ticket's answer (quorum 0's id) and before
    it read quorum/0 (``between``: between its wait for quorum/0 and its get): meanwhile the lighthouse aborts
    quorum 0 on its silence, goes on with group 1 alone, and forgets quorum 0 two quorums on, quorum/0 and members/0
    with it. Then the lighthouse answers whatever the member asks next."""

    def get(self, key):
        value = self.store.get(key)
        if key.endswith("/ticket/2/start/1") and not self.between:
            self._go_on()
        return value

    def wait(self, keys, timeout):
        if self.store.queue_len(replicas.PREFIX + "events"):  # the member asked: answered at once
            self._quorum([1, 2], "abort" if self.asked == 0 else "commit")
        self.store.wait(keys, timeout)
        if keys == [f"{replicas.PREFIX}quorum/0"] and self.between:
            self._go_on()

    def _go_on(self):
        time.sleep(0.3)  # past the fault timeout: the next quorum does not wait for it
        self._quorum([1], "commit")
        self._quorum([1], "commit")  # forgets quorum 0
        assert not self.store.check([f"{replicas.PREFIX}quorum/0"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("between", [False, True], ids=["before-the-wait", "between-the-wait-and-the-get"])
def test_a_quorum_forgotten_after_the_member_read_its_ticket_is_asked_again(between, capsys):
    """Replica._read_quorum: a ticket's answer is the quorum's id, and the member reads the quorum after it; stopped
    between the two, and woken after the lighthouse forgot that quorum, it asks again, as for a forgotten ticket,
    instead of waiting for good for quorum/n or taking the store's timeout for the coordinator's loss."""
    store, lighthouse, member = stopped_member()
    member.store = StoppedAfterTheTicket(store, lighthouse, between)
    asked = asked_within(member, 20)
    assert asked, "the member still waits for the quorum its lighthouse forgot"
    assert member.requests == 2 and asked[0].id == 3 and asked[0].members == [1, 2]
    assert "forgotten while it was stopped: asking again" in capsys.readouterr().err


class Pushed(Exception):
    """A request pushed (CountedReads), the member stopped there."""


class CountedReads:
    """A store whose gets are counted, by key; a request pushed is kept, and stops the member (Pushed)."""

    def __init__(self, store):
        self.store, self.read, self.pushed = store, [], []

    def get(self, key):
        self.read.append(key.removeprefix(replicas.PREFIX))
        return self.store.get(key)

    def queue_push(self, key, value):
        self.pushed.append(json.loads(value))
        raise Pushed

    def __getattr__(self, name):
        return getattr(self.store, name)


def two_quorums(groups):
    """A lighthouse over a store of its own, by hand: ``groups`` groups of 1 process ask, quorum 0 of them all commits,
    they ask again, and quorum 1 of them all is formed. Returns the store."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    lighthouse = replicas.Lighthouse(store)
    for n in (0, 1):
        for group in range(groups):
            push_request(store, f"{group}/start/{n}", group, n, n - 1 if n else None, 30.0)
            store.set(f"{replicas.PREFIX}hb/{group}/0", f"start/{n}")
        if n:
            store.set(f"{replicas.PREFIX}decision/0", "commit")
            assert lighthouse._decided()
        lighthouse._take_requests()
        lighthouse._watch_heartbeats()
        lighthouse._form()
    assert lighthouse.quorum["id"] == 1 and lighthouse.quorum["members"] == list(range(groups))
    return store


def test_what_a_member_reads_of_a_quorum_does_not_grow_with_the_groups():
    """[Note: small answers]: a ticket's answer (the quorum's id) and quorum/n are the same bytes at 2 groups and at
    300 (each ticket's answer was the whole quorum: 19 KB at 512 groups); a member that read quorum n - 1 reads
    quorum n, its members unchanged, without members/n, and still knows them; one whose quorum is a lost
    coordinator's (stale) reads them. Its request names its quorum's members only then (for the new lighthouse)."""
    sizes = []
    for groups in (2, 300):
        store = two_quorums(groups)
        sizes.append([len(store.get(f"{replicas.PREFIX}{key}")) for key in ("ticket/1/start/1", "quorum/1")])
        assert store.get(f"{replicas.PREFIX}ticket/1/start/1") == b"1"
        _, _, member = stopped_member()
        member.store = CountedReads(store)
        member.quorum = member._read_quorum(0)
        for stale, reads in ((False, ["quorum/1"]), (True, ["quorum/1", "members/1"])):
            member.store.read, member.stale = [], stale
            quorum = member._read_quorum(1)
            assert member.store.read == reads and quorum.members == list(range(groups)) and quorum.voters == groups
            member.quorum = quorum
            with pytest.raises(Pushed):
                member._ask(2)
            assert member.store.pushed[-1]["seen"] == 1
            assert member.store.pushed[-1]["with"] == (list(range(groups)) if stale else [])
    assert sizes[0] == sizes[1], sizes


def run_members(address, on_step, steps=8):
    """Groups 0 and 1 of one process each, as threads of this process: w (float64) stepped by the mean of both
    groups' gradients, each a function of (w, group, step); ``on_step(group, step, where)`` called after the join
    ("joined") and after a committed step ("committed"). Each group's weights and commit log at the end."""
    import torch
    ended, errors = {}, []

    def member(group):
        state = {"w": torch.linspace(-1.0, 1.0, 5, dtype=torch.float64), "step": 0}  # the live state
        replica = replicas.Replica(address, group, 2, "same", lambda: {"w": state["w"].clone(), "step": state["step"]},
                                   state.update, fault_timeout_s=60.0)
        try:
            while state["step"] < steps:
                replica.join(state["step"])  # a group behind receives the other's weights and step
                on_step(group, state["step"], "joined")
                grad = torch.sin(state["w"] * (group + 1) + state["step"])
                if replica.commit(replica.average([grad])):
                    state["w"], state["step"] = state["w"] - 0.1 * grad, state["step"] + 1
                    on_step(group, state["step"] - 1, "committed")
            ended[group] = (state["w"], [entry["step"] for entry in replica.log if "step" in entry])
        except BaseException as error:  # noqa: BLE001 - the test shows it
            errors.append(f"group {group}: {replicas.one_line(error)}")
        finally:
            replica.close()
    threads = [threading.Thread(target=member, args=(group,), daemon=True) for group in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(ended) == 2, errors or "a member still runs after 120 s"
    w = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)  # the fault-free run: every step the mean of both
    for step in range(steps):
        w = w - 0.1 * ((torch.sin(w * 1 + step) + torch.sin(w * 2 + step)) / 2)
    return ended, w


@pytest.mark.timeout(180)
@pytest.mark.parametrize("when", ["joined", "committed"])
def test_the_coordinator_killed_and_restarted_mid_run_costs_the_members_nothing(tmp_path, when):
    """The coordinator (``python -m replicas serve``) SIGKILLed at step 3 and a new one started on its port, the
    members (Replica objects in threads) riding through: inside the step ("joined": group 0 has joined quorum 3,
    nobody voted: the step is taken again), or once group 0 has applied step 3 ("committed": group 1 may or may not
    have read the decision; if not, it receives group 0's state from the new coordinator's first quorum). Either way
    both groups end at the fault-free run's weights, bit for bit, every step in their logs once."""
    from benchmarks.replica_runs import ReplicaRun
    run = ReplicaRun(str(tmp_path), 0, [])
    run.start_coordinator()
    port, restarted = run.address.rpartition(":")[2], threading.Event()

    def on_step(group, step, where):
        if (group, step, where) == (0, 3, when) and not restarted.is_set():  # once
            run.kill_coordinator()
            run.start_coordinator(int(port))
            restarted.set()
    try:
        ended, reference = run_members(run.address, on_step)
    finally:
        run.close()
    assert restarted.is_set() and run.address.endswith(f":{port}")
    for group in (0, 1):
        w, steps = ended[group]
        assert steps == list(range(8)), steps
        assert max_difference({"w": w}, {"w": reference}) == 0


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_serve_refuses_a_port_out_of_range_in_one_line(port, capsys):
    """Not the store constructor's TypeError traceback: one line at parse time, exit 2 (0 stays: the OS picks)."""
    assert replicas.main(["serve", "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"python -m replicas serve: error: --port must be between 0 (one the OS picks) "
                                        f"and 65535, got {port}"], err


def test_a_second_claimant_of_a_live_group_is_refused_and_a_restart_of_a_dead_one_is_not():
    """Two torchruns started with one --replica-group: the newer is refused while the first one's heartbeat beats
    (it replaced the live one, whose steps since were later thrown away); once the first has been silent past
    STALE_S without a liveness connection, or closed its connection (dead: torchrun restarts it), a new process of
    the group is taken; holding its connection open, it is alive until the fault timeout."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    lighthouse = replicas.Lighthouse(store)

    def ask(incarnation):
        ticket = f"0/{incarnation}/1"
        store.set(f"{replicas.PREFIX}hb/0/0", f"{incarnation}/0")
        store.queue_push(replicas.PREFIX + "events", json.dumps({
            "ticket": ticket, "group": 0, "step": 0, "last_commit": None, "durable": 0, "identity": "same",
            "size": 1, "planned": 1, "min_groups": 1, "fault_timeout": 30.0}))
        lighthouse._take_requests()
        lighthouse._watch_heartbeats()
        if lighthouse.quorum is None or lighthouse._decided():  # as the run loop: the next once decided
            lighthouse._form()
        key = f"{replicas.PREFIX}ticket/{ticket}"
        return answer_of(store, ticket) if store.check([key]) else {}

    assert ask("first")["members"] == [0]
    store.set(f"{replicas.PREFIX}hb/0/0", "first/1")  # the first one beats on
    lighthouse._watch_heartbeats()
    key = f"{replicas.PREFIX}hb/0/0"
    lighthouse.liveness = GoneProcesses((), {(key, "first"), (key, "second")})  # both hold their connections
    refused = ask("second").get("refused", "")
    assert refused.startswith("replica group 0 refused by the coordinator: another process of it is running"), refused
    # the refused one's beat, still in the key, is not the group's ([Note: intruders]): once it exits (its liveness
    # connection closed), the live group is not taken for gone, nor denied its state
    assert lighthouse.beats[key][0] == b"first/1", lighthouse.beats[key]
    lighthouse.liveness.ended.add((key, "second"))  # the refused one exits
    assert not lighthouse._gone(0) and lighthouse._may_hold(0, "first")
    lighthouse.liveness = None
    store.set(f"{replicas.PREFIX}decision/0", "abort")
    lighthouse._decided()
    lighthouse.alive[0, "first"] -= replicas.STALE_S + 1  # the first one killed: silent since
    assert ask("restarted").get("members") == [0]
    # killed, and restarted warm within a second (trainer/warm_start.py): its last beat still looks recent, but its
    # liveness connection closed (liveness.py), so the restart is taken, not refused as a second claimant
    store.set(f"{replicas.PREFIX}decision/1", "abort")
    lighthouse._decided()
    store.set(f"{replicas.PREFIX}hb/0/0", "restarted/1")
    lighthouse._watch_heartbeats()
    lighthouse.liveness = GoneProcesses({(f"{replicas.PREFIX}hb/0/0", "restarted")})
    assert ask("warm").get("members") == [0]
    # the warm one holds its connection open and its heartbeat is 2 s old (starved of CPU, past STALE_S, within the
    # fault timeout): alive ([Note: hung or gone]), so a third claimant is refused still
    store.set(f"{replicas.PREFIX}decision/2", "abort")
    lighthouse._decided()
    lighthouse.liveness.open.add((f"{replicas.PREFIX}hb/0/0", "warm"))
    lighthouse.alive[0, "warm"] -= 2.0
    assert ask("third").get("refused", "").startswith("replica group 0 refused by the coordinator: another process")


def test_a_refused_process_writes_nothing_under_its_groups_name():
    """[Note: claims] (replicas/asking.py): a second claimant of a live group and a group of another configuration
    are refused at their claim, before they beat: no heartbeat key of theirs, no liveness connection, no request of
    theirs in a quorum; the live group's heartbeat key says its own incarnation all along and it goes on."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    lighthouse, stop = replicas.Lighthouse(store), threading.Event()
    thread = threading.Thread(target=lighthouse.run, args=(stop,), daemon=True)
    thread.start()
    address, key = f"127.0.0.1:{store.port}", f"{replicas.PREFIX}hb/0/0"
    live = replicas.Replica(address, 0, 1, "same", dict, lambda state: None, min_groups=1, fault_timeout_s=30.0)
    seen, watching = set(), threading.Event()

    def watch():  # every value group 0's heartbeat key takes while the others are refused
        reader = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
        while not watching.is_set():
            if reader.check([key]):
                seen.add(reader.get(key).split(b"/")[0].decode())
            time.sleep(0.002)
    watcher = threading.Thread(target=watch, daemon=True)
    try:
        assert live.join(0).quorum.members == [0]
        deadline = time.monotonic() + 30  # its heartbeat and liveness connection seen by the lighthouse
        while not (lighthouse.liveness.connected(key, live.incarnation) and (0, live.incarnation) in lighthouse.alive):
            assert time.monotonic() < deadline, "the live group's heartbeat not seen in 30 s"
            time.sleep(0.01)
        watcher.start()
        refusals = {}
        for group, identity in ((0, "same"), (1, "other")):
            intruder = replicas.Replica(address, group, 1, identity, dict, lambda state: None, min_groups=1,
                                        fault_timeout_s=30.0)
            with pytest.raises(replicas.ReplicaRefused) as refused:
                intruder.join(0)
            refusals[group] = str(refused.value)
            assert intruder.heartbeat is None
            hb = f"{replicas.PREFIX}hb/{group}/0"
            assert not lighthouse.liveness.connected(hb, intruder.incarnation)
            assert not lighthouse.liveness.closed(hb, intruder.incarnation)
            assert (group, intruder.incarnation) not in lighthouse.alive
            assert all(request.request["ticket"].split("/")[1] != intruder.incarnation
                       for request in lighthouse.asked.values())
            intruder.close()
        assert "another process of it is running" in refusals[0], refusals
        assert "another configuration" in refusals[1], refusals
        assert not store.check([f"{replicas.PREFIX}hb/1/0"])
        watching.set()
        watcher.join()
        assert seen == {live.incarnation}, seen
        assert not lighthouse._gone(0) and live.commit(True) and live.join(1).quorum.members == [0]
    finally:
        watching.set()
        live.close()
        stop.set()
        thread.join()


class GoneProcesses:
    """A liveness server's answers (replicas.LivenessServer): these (key, incarnation) closed their connection, those
    hold it open (the others never opened one)."""

    def __init__(self, closed, connected=()):
        self.ended, self.open = set(closed), set(connected)

    def closed(self, key, incarnation):
        return (key, incarnation) in self.ended

    def connected(self, key, incarnation):
        return (key, incarnation) in self.open


class CountingLighthouse(replicas.Lighthouse):
    """A lighthouse that counts the refusals it gives."""
    refused: list[str] = []

    def _refuse(self, request, why):
        self.refused.append(why)
        super()._refuse(request, why)


def test_a_refused_group_restarted_by_torchrun_is_refused_again_at_once(corpus, tmp_path):
    """A refusal is final: the restarts of a refused group's torchrun (--max-restarts 2) say the same line without
    asking the coordinator again nor building anything (trainer/refusals.py); it asked 3 times before."""
    import subprocess
    import sys

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    store.set(f"{replicas.PREFIX}hb/0/0", "other/0")  # a run of another configuration, its group 0 in a quorum
    store.queue_push(replicas.PREFIX + "events", json.dumps({
        "ticket": "0/other/1", "group": 0, "step": 0, "last_commit": None, "durable": 0, "identity": "other",
        "size": 1, "planned": 1, "min_groups": 1, "fault_timeout": 30.0}))  # (planned 1: formed at once)
    lighthouse, stop = CountingLighthouse(store), threading.Event()
    lighthouse.refused = []
    thread = threading.Thread(target=lighthouse.run, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60  # its quorum formed (the lighthouse's thread alone uses its store)
        while lighthouse.quorum is None:
            assert time.monotonic() < deadline, "the other run's quorum not formed in 60 s"
            time.sleep(0.01)
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
             "--max-restarts", "2", "ddp_cifar100.py", *argv_of(corpus, "--replica-group", "1", "--replica-groups",
                                                                "2", "--coordinator", f"127.0.0.1:{store.port}")],
            capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
        seconds = time.monotonic() - began
    finally:
        stop.set()
        thread.join()
    lines = [line for line in done.stderr.splitlines() if line.startswith("ddp_cifar100.py: ")]
    print(f"\n3 starts of a refused group (--max-restarts 2): {seconds:.1f} s")
    assert done.returncode != 0
    assert len(lighthouse.refused) == 1, lighthouse.refused
    assert len(lines) == 3 and len(set(lines)) == 1 and "another configuration" in lines[0], done.stderr


def test_a_commit_log_is_one_runs_and_one_processs(tmp_path):
    """Two groups given one --commit-log interleaved their steps in it (677 entries for 600 steps, 76 twice): the
    second is refused while the first holds it; a log of another run is refused and left as it was (it was truncated
    to the new process's step), and so is a log whose run finished."""
    log, other, done = tmp_path / "log", tmp_path / "other", tmp_path / "done"
    entries = [{"run": "elsewhere"}, *({"step": s, "quorum": s, "participants": [0]} for s in range(3))]
    other.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    done.write_text(other.read_text() + json.dumps({"finished": 3}) + "\n")
    kept = other.read_text()
    with coordinator() as address:
        first = replicas.Replica(address, 0, 1, "same", dict, print, fault_timeout_s=10, commit_log=str(log))
        try:
            first.join(0)
            with pytest.raises(replicas.ReplicaRefused, match=f"another run is writing --commit-log {log}"):
                replicas.Replica(address, 1, 1, "same", dict, print, fault_timeout_s=10, commit_log=str(log))
            with pytest.raises(replicas.ReplicaRefused, match="holds a run that finished at step 3"):
                replicas.Replica(address, 1, 1, "same", dict, print, fault_timeout_s=10, commit_log=str(done))
            stranger = replicas.Replica(address, 1, 1, "same", dict, print, fault_timeout_s=10, commit_log=str(other))
            try:
                with pytest.raises(replicas.ReplicaRefused, match=r"another run \(elsewhere"):
                    stranger.join(0)
            finally:
                stranger.close()
        finally:
            first.close()
    assert other.read_text() == kept
    assert replicas.read_log(log, steps_only=False) == [{"run": first.run}]


@pytest.mark.parametrize("damage", ["not JSON", "a step of true", "unreadable"])
def test_a_commit_log_that_cannot_be_read_is_refused_in_one_line_naming_it(tmp_path, damage):
    """A line cut or written by hand, a step that is not a whole number, a log that cannot be read: refused when the
    group starts (resume_log), one line naming the file and the line, before anything connects; not a
    JSONDecodeError's traceback, printed again at every torchrun restart."""
    log = tmp_path / "log"
    good = json.dumps({"step": 0, "quorum": 0, "participants": [0]})
    bad = {"not JSON": '{"step": 1, "quorum"', "a step of true": json.dumps({"step": True, "quorum": 1})}
    log.write_text(f"{good}\n{bad.get(damage, good)}\n")
    if damage == "unreadable":
        log.write_bytes(b"\xff\xfe not text\n")
    with pytest.raises(replicas.ReplicaRefused) as refusal:
        replicas.commit_log.resume_log(str(log), 5)
    text = str(refusal.value)
    assert text.startswith(f"--commit-log {log}: ") and "\n" not in text, text
    assert {"not JSON": "line 2 is not JSON", "a step of true": "line 2 is not a commit log's entry",
            "unreadable": "unreadable (UnicodeDecodeError"}[damage] in text, text


def test_a_coordinator_absent_at_the_start_is_said_within_the_fault_timeout():
    """Nothing listening at the address (a port held, not listened on): one line within the fault timeout, not the
    store client's twice its timeout (114 s at the default 60)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        began = time.monotonic()
        with pytest.raises(replicas.CoordinatorLost, match="unreachable"):
            replicas.Replica(f"127.0.0.1:{held.getsockname()[1]}", 0, 1, "same", dict, print, fault_timeout_s=1.0)
        assert time.monotonic() - began < 1.0 + 2.0  # (the last try's RECONNECT_S, and a loaded machine)


def test_a_member_killed_is_gone_at_once_and_a_stopped_one_only_once_silent():
    """replicas/liveness.py: a member's process SIGKILLed is taken for gone (silent for ever) within a fraction of a
    second, where its heartbeat alone would take STALE_S; one stopped (SIGSTOP: hung, its connection open) is found
    by its silence only, and the lighthouse knows it still holds its connection."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    lighthouse, stop = replicas.Lighthouse(store, host="127.0.0.1"), threading.Event()
    lighthouse.planned = 1  # (else from the requests: this member asks nothing)
    thread = threading.Thread(target=lighthouse.run, args=(stop,), daemon=True)
    thread.start()
    code = ("import sys, time, replicas; replicas.Heartbeat(sys.argv[1], replicas.PREFIX + 'hb/0/0', 30, 'one', 30); "
            "time.sleep(600)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    member = subprocess.Popen([sys.executable, "-c", code, f"127.0.0.1:{store.port}"], cwd=root)
    try:
        deadline = time.monotonic() + 60
        while lighthouse._silent_for(0) > replicas.STALE_S / 2:  # beating
            assert time.monotonic() < deadline and member.poll() is None, "the member never beat"
            time.sleep(0.02)
        member.send_signal(signal.SIGSTOP)
        time.sleep(replicas.STALE_S + 0.5)
        hung = lighthouse._silent_for(0)
        connected_while_stopped = lighthouse.liveness.connected(replicas.PREFIX + "hb/0/0", "one")
        member.send_signal(signal.SIGCONT)
        while lighthouse._silent_for(0) > replicas.STALE_S / 2:  # beating again
            assert time.monotonic() < deadline, "the member did not beat again"
            time.sleep(0.02)
        member.kill()
        killed = time.monotonic()
        while lighthouse._silent_for(0) != float("inf") and time.monotonic() - killed < 60:
            time.sleep(0.005)
        gone_after = time.monotonic() - killed
        gone = lighthouse._silent_for(0) == float("inf")
        connected_once_killed = lighthouse.liveness.connected(replicas.PREFIX + "hb/0/0", "one")
    finally:
        member.kill()
        member.wait()
        stop.set()
        thread.join()
    assert replicas.STALE_S < hung < float("inf")  # silent, not gone: a hang is the fault timeout's to judge
    assert connected_while_stopped and not connected_once_killed  # what tells the two apart ([Note: hung or gone])
    print(f"\na member SIGKILLed: gone for the lighthouse after {gone_after * 1000:.0f} ms (STALE_S: "
          f"{replicas.STALE_S * 1000:.0f} ms)")
    # gone for good (silent for ever), which only its closed connection says: a heartbeat's silence is finite. How
    # soon is the machine's (41 ms idle; 3.6 s once under two busy loops and six training processes): not asserted
    assert gone


def test_a_new_run_keeps_the_lighthouses_liveness_server_and_host():
    """--new-run starts the lighthouse's membership anew (Lighthouse._start_new_run), not the liveness server its
    ``run`` holds nor the host it listens on: the new run's deaths are seen at once too."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    lighthouse = replicas.Lighthouse(store, new_run=True, host="127.0.0.1")
    lighthouse.liveness = server = object()  # (run's, while it runs)
    store.set(f"{replicas.PREFIX}finished", json.dumps({"step": 5, "group": 0, "run": "old"}))
    lighthouse._start_new_run()
    assert lighthouse.liveness is server and lighthouse.host == "127.0.0.1"
    assert lighthouse.finished_runs == {"old": 5}
