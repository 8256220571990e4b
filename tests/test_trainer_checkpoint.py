"""The trainer's sharded checkpoints (trainer/checkpoint/), on the tiny GPT in float64: saved at --zero 3 on 4
processes as a torch.distributed.checkpoint folder (every rank its own shards), resumed at --zero 1, by FSDP2 and by
DDP on 2 processes with --batch-size doubled (the same global batch), each ending where an uninterrupted run ends;
last.pt still resuming at a sharded sync (which then writes folders); --eval-only and --generate reading a folder;
nodes that share no folder keeping last.pt; a torn folder, a changed configuration and diloco (another configuration,
whose replicas' state a folder lacks) refused in one line on every rank; and no state of the folder stranding a run
(DIR/latest lost or unreadable, a finished folder it does not name, a second run on the folder, a reader while the
run supersedes its folder, a user's folders named like ours), --keep-checkpoints.

Why 1e-10 in float64 (test_language_model.py's argument): the legs differ from the uninterrupted run (--zero 0 on
2 processes) only in the order of their sums (stage 3 averages each micro-batch over 4 ranks, stage 0 adds 2 ranks'
windows), a few units of 2^-53 (1e-16) relative per step, which AdamW carries at the same relative size into an
update of about lr = 1e-2: after 4 steps some 1e-15 to 1e-13. A real error (a shard read into another's place, a
moment or a step count lost, a step at the wrong learning rate, the sums of the epoch under way dropped) moves the
weights at first order, by about lr x O(0.1) = 1e-3, seven orders above the bound.
"""
import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import ddp_cifar100 as trainer
from trainer_testing import collect_all, main_in_group, train_in_group, word_corpus
from zero_testing import max_difference


def flip_a_byte(path):
    """One byte inverted, its size kept (a bit rot the file system does not see): in the middle of a file, or of a
    folder's data file, in the middle of the largest weight it holds (which --eval-only reads too)."""
    where = os.path.getsize(path) // 2
    if str(path).endswith(".distcp"):
        from torch.distributed.checkpoint import FileSystemReader
        metadata = FileSystemReader(os.path.dirname(path)).read_metadata()
        stored = [info for index, info in metadata.storage_data.items()
                  if info.relative_path == os.path.basename(path) and index.fqn.startswith("model.")]
        largest = max(stored, key=lambda info: info.length)
        where = largest.offset + largest.length // 2
    with open(path, "r+b") as file:
        file.seek(where)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0xFF]))


def runs_in_group(rank, world_size, variants):
    """Trainer runs in turn in one call of the group, {name: result}: "train" (train_in_group in float64: the
    weights and metrics) or "main" (main_in_group: the exit code and what was printed). "{rank}" in an argument
    becomes the rank's number (a folder of each rank's own: nodes that share none)."""
    out = {}
    for name, how, argv in variants:
        argv = [argument.replace("{rank}", str(rank)) for argument in argv]
        out[name] = train_in_group(rank, world_size, argv, "float64") if how == "train" else main_in_group(
            rank, world_size, argv)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return word_corpus(tmp_path_factory.mktemp("corpus"))


def argv_of(corpus, batch_size, *flags):
    """4 steps of AdamW on 16 windows of 16 bytes (--batch-size x 2 micro-batches x processes)."""
    return ["--device", "cpu", "--dataset", "text", "--model", "gpt-tiny", "--context", "16", "--val-fraction",
            "0.3", "--data-dir", str(corpus), "--batch-size", str(batch_size), "--grad-accum", "2", "--epochs", "1",
            "--seed", "5", "--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1", "--timeout", "120",
            *flags]


HOLD = """
import fcntl, os, sys, time
descriptor = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(descriptor, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(300)
"""  # another run on the folder: its lock, as trainer.checkpoint.folders.lock takes it


@pytest.fixture(scope="module")
def runs(local_group, corpus, tmp_path_factory):
    """Saved at --zero 3 on 4 processes after 2 steps (and, meanwhile on 2, the uninterrupted run and a last.pt
    after 2 steps); then each resume on 2 processes in its own copy of the folder, in one call."""
    root = tmp_path_factory.mktemp("dcp")
    saved, file = root / "saved", root / "file"
    pending = {
        "saved": local_group(4).submit(train_in_group, argv_of(corpus, 2, "--zero", "3", "--max-steps", "2",
                                                               "--checkpoint-dir", str(saved)), "float64"),
        "two": local_group(2).submit(runs_in_group, [
            ("uninterrupted", "train", argv_of(corpus, 4, "--max-steps", "4")),
            ("file", "train", argv_of(corpus, 4, "--max-steps", "2", "--checkpoint-dir", str(file)))])}
    first = collect_all(pending)
    listing = {"saved": sorted(os.listdir(saved)), "folder": sorted(os.listdir(saved / "step-2")),
               "file": sorted(os.listdir(file))}
    for name in ("zero 1", "fsdp", "ddp", "eval", "torn", "changed", "diloco", "no latest", "unreadable", "corrupt"):
        shutil.copytree(saved, root / name)
    shutil.copytree(file, root / "corrupt last.pt")
    flip_a_byte(root / "corrupt" / "step-2" / "__1_0.distcp")  # inside a shard, the size kept
    flip_a_byte(root / "corrupt last.pt" / "last.pt")
    (root / "zero 1" / "step-4.partial").mkdir()  # a save cut short, of 4 ranks: removed when the next run starts
    (root / "zero 1" / "step-4.partial" / "__3_0.distcp").write_bytes(b"half")
    os.remove(root / "torn" / "step-2" / "__1_0.distcp")
    os.remove(root / "no latest" / "latest")  # lost: the newest whole folder is current, nothing is removed but ours
    for name in ("step-best", "step-6-backup"):  # a user's folders, named like ours
        (root / "no latest" / name).mkdir()
        (root / "no latest" / name / "kept").write_text(name)
    (root / "unreadable" / "latest").write_bytes(bytes(range(256)))  # binary: no rank waits out a timeout
    resumed = {name: argv_of(corpus, 4, *flags, "--max-steps", "4", "--checkpoint-dir", str(root / directory))
               for name, directory, flags in (("zero 1", "zero 1", ["--zero", "1", "--checkpoint-every", "1",
                                                                    "--keep-checkpoints", "2"]),
                                              ("fsdp", "fsdp", ["--grad-sync", "fsdp", "--zero", "3"]),
                                              ("ddp", "ddp", ["--grad-sync", "ddp"]),
                                              ("zero 3 from last.pt", "file", ["--zero", "3"]),
                                              ("no latest", "no latest", ["--zero", "1"]),
                                              ("eval", "eval", ["--eval-only"]),
                                              ("torn", "torn", ["--zero", "1"]),
                                              ("changed", "changed", ["--zero", "1", "--lr", "0.02"]),
                                              ("diloco", "diloco", ["--grad-sync", "diloco"]))}
    refusals = {name: resumed.pop(name) for name in ("torn", "changed", "diloco")}
    resumed["not shared"] = argv_of(corpus, 4, "--zero", "3", "--max-steps", "1", "--checkpoint-dir",
                                    str(root / "not shared {rank}"))
    refusals["unreadable"] = argv_of(corpus, 4, "--zero", "3", "--max-steps", "3", "--checkpoint-dir",
                                     str(root / "unreadable"))  # run for what it prints
    (root / "locked" / "step-3.partial").mkdir(parents=True)  # another run's save under way
    refusals["locked"] = argv_of(corpus, 4, "--zero", "1", "--max-steps", "4", "--checkpoint-dir", str(root / "locked"))
    for name, flags in (("corrupt", ["--zero", "1"]), ("corrupt eval", ["--eval-only"]),
                        ("corrupt fsdp", ["--grad-sync", "fsdp", "--zero", "3"]), ("corrupt last.pt", [])):
        directory = root / ("corrupt last.pt" if name.endswith("last.pt") else "corrupt")
        refusals[name] = argv_of(corpus, 4, *flags, "--max-steps", "4", "--checkpoint-dir", str(directory))
    second = local_group(2).run(runs_in_group, [(name, "train", argv) for name, argv in resumed.items()])
    with subprocess.Popen([sys.executable, "-c", HOLD, str(root / "locked")], stdout=subprocess.PIPE) as other_run:
        assert other_run.stdout.readline() == b"held\n"
        refused = local_group(2).run(runs_in_group, [(name, "main", argv) for name, argv in refusals.items()])
        other_run.kill()
    return {"saved": first["saved"], "two": first["two"], "resumed": second, "refused": refused, "root": root,
            "listing": listing}


@pytest.mark.parametrize("name", ["zero 1", "fsdp", "ddp", "zero 3 from last.pt", "no latest"])
def test_resumed_on_2_processes_ends_where_the_uninterrupted_run_ends(runs, name):
    reference = runs["two"][0]["uninterrupted"]
    ranks = runs["resumed"]
    run = ranks[0][name]
    assert run["metrics"]["optimizer_steps"] == reference["metrics"]["optimizer_steps"] == 4
    assert max_difference(run["state"], ranks[1][name]["state"]) == 0  # whole on both ranks alike
    worst = max_difference(reference["state"], run["state"])
    saved_at = "by --zero 0 as last.pt" if name.endswith("last.pt") else "at --zero 3 on 4"
    print(f"\nsaved {saved_at} after 2 steps, resumed {name} on 2 to step 4, vs uninterrupted (float64): max |dw| = "
          f"{worst:.1e}")
    assert worst < 1e-10
    assert run["metrics"]["fingerprint"] == reference["metrics"]["fingerprint"]  # the run's record, kept
    assert run["metrics"]["val_loss"] == pytest.approx(reference["metrics"]["val_loss"], rel=1e-10)
    assert run["metrics"]["train_loss"] == pytest.approx(reference["metrics"]["train_loss"], rel=1e-10)


def test_every_rank_writes_its_own_shards_into_a_folder_made_current_by_latest(runs):
    """The folder of the save at --zero 3 on 4: a data file per rank, each about a quarter of the bytes (no rank
    gathered the model), beside DCP's .metadata; DIR/latest names it; no last.pt, no marker left."""
    listing, root = runs["listing"], runs["root"]
    assert listing["saved"] == ["latest", "step-2"]
    assert (root / "saved" / "latest").read_text() == "step-2\n"
    assert listing["folder"] == [".metadata"] + [f"__{rank}_0.distcp" for rank in range(4)]
    sizes = [os.path.getsize(root / "saved" / "step-2" / f"__{rank}_0.distcp") for rank in range(4)]
    assert max(sizes) < 0.35 * sum(sizes), sizes
    assert listing["file"] == ["last.pt"]  # --zero 0 keeps the single file


def test_nodes_that_share_no_folder_keep_the_single_file(runs):
    """Each rank given a folder of its own (two nodes without a shared file system): rank 0 writes last.pt in its
    own, the model and the optimizer gathered to it, and rank 1 writes nothing."""
    assert sorted(os.listdir(runs["root"] / "not shared 0")) == ["last.pt"]
    assert not os.path.exists(runs["root"] / "not shared 1")


def test_what_a_save_supersedes_is_removed(runs):
    """After the resumes: the new folder alone (the older one, a last.pt removed), with nothing of a save cut short
    under its name; with --keep-checkpoints 2 (saving steps 3 and 4), the one before it too."""
    root = runs["root"]
    for directory in ("zero 1", "fsdp", "file"):
        kept = ["step-3"] if directory == "zero 1" else []
        assert sorted(os.listdir(root / directory)) == ["latest", *kept, "step-4"], directory
        for folder in [*kept, "step-4"]:
            assert sorted(os.listdir(root / directory / folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(os.listdir(root / "ddp")) == ["last.pt"]  # ddp writes the file, and removes the folders


def test_eval_only_evaluates_the_folder_at_zero_0(runs):
    """--eval-only at --zero 0 (zero.shard's stage 0 reading the folder) gives the saved run's last validation."""
    evaluated, saved = runs["resumed"][0]["eval"], runs["saved"][0]
    assert max_difference(evaluated["state"], saved["state"]) == 0
    assert evaluated["metrics"]["val_loss"] == pytest.approx(saved["metrics"]["val_loss"], rel=1e-12)


@pytest.mark.parametrize("name,phrase", [
    ("torn", "step-2: torn: data file __1_0.distcp named by its .metadata is missing"),
    ("changed", "step-2 is from another configuration (lr 0.01 != 0.02)"),
    ("diloco", "step-2 is from another configuration (diloco None != {"),
    ("corrupt", "step-2: file __1_0.distcp does not match its checksum (corrupt: bytes "),
    ("corrupt eval", "step-2: file __1_0.distcp does not match its checksum (corrupt: bytes "),
    ("corrupt fsdp", "step-2: file __1_0.distcp does not match its checksum (corrupt: bytes "),
    ("corrupt last.pt", "last.pt: file last.pt does not match its checksum (corrupt: Bad CRC-32 for file "),
])
def test_a_torn_or_corrupt_checkpoint_another_configuration_and_diloco_are_refused_in_one_line_on_every_rank(
        runs, name, phrase):
    results = [rank[name] for rank in runs["refused"]]
    assert [result["code"] for result in results] == [2, 2]
    err = results[0]["stderr"]
    assert err.startswith(("ddp_cifar100.py: error: checkpoint ", "ddp_cifar100.py: error: cannot read checkpoint ")) \
        and err.count("\n") == 1, err
    folder = "corrupt last.pt" if name.endswith("last.pt") else "corrupt" if name.startswith("corrupt") else name
    assert str(runs["root"] / folder / phrase) in err, err
    assert results[1]["stderr"] == ""  # rank 0 speaks for all


def test_no_state_of_the_folder_strands_a_run(runs):
    """DIR/latest lost (the run above, at --zero 1, ended where the uninterrupted run ends) or unreadable (binary
    bytes, at --zero 3): the newest whole folder is current, said in one line; a user's folders named like ours stay;
    only ours are superseded."""
    root = runs["root"]
    assert sorted(os.listdir(root / "no latest")) == ["latest", "step-4", "step-6-backup", "step-best"]
    assert (root / "no latest" / "step-best" / "kept").read_text() == "step-best"
    unreadable = [rank["unreadable"] for rank in runs["refused"]]
    assert [result["code"] for result in unreadable] == [0, 0], unreadable[0]["stderr"][-2000:]
    folder = root / "unreadable" / "step-2"
    assert f"note: resuming from {folder}: latest is missing or unreadable\n" in unreadable[0]["stdout"]
    assert f"resuming from {folder}: epoch 1, micro-batch 4, optimizer step 2" in unreadable[0]["stdout"]


def test_a_second_run_on_a_folder_is_refused_in_one_line_before_it_touches_anything(runs):
    """Another process holds the folder's lock (a run under way): both ranks refuse in one line, and the other
    run's save under way (step-3.partial) is still there."""
    results = [rank["locked"] for rank in runs["refused"]]
    assert [result["code"] for result in results] == [2, 2]
    err = results[0]["stderr"]
    assert err == (f"ddp_cifar100.py: error: another run is using --checkpoint-dir {runs['root'] / 'locked'} (it "
                   f"holds the folder's lock): wait for it to end, or use another folder\n"), err
    assert results[1]["stderr"] == ""
    assert os.listdir(runs["root"] / "locked") == ["step-3.partial"]


def test_a_finished_folder_latest_does_not_name_is_adopted_once_whole(runs, tmp_path):
    """A run stopped between renaming step-7 and naming it in DIR/latest: step-7 is current (checked whole), and a
    later save of step 7 keeps it rather than failing on the rename; a torn step-8 is passed over; a folder whose step
    folders are all torn is refused in one line."""
    from trainer import checkpoint
    whole = runs["root"] / "saved" / "step-2"
    for name in ("step-6", "step-7", "step-8"):
        shutil.copytree(whole, tmp_path / name)
    os.remove(tmp_path / "step-8" / ".metadata")
    (tmp_path / "latest").write_text("step-6\n")
    found = checkpoint.current(str(tmp_path))
    assert found.path == str(tmp_path / "step-7") and found.folder
    assert "latest names step-6, but step-7 is finished and whole" in found.note
    shutil.copytree(whole, tmp_path / "step-7.partial")  # the resumed run's save of step 7
    checkpoint.make_current(str(tmp_path), "step-7", keep=2)  # and step-6 kept beside it
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-6", "step-7"]
    shutil.rmtree(tmp_path / "step-6")
    assert checkpoint.current(str(tmp_path)) == (str(tmp_path / "step-7"), True, None)
    os.remove(tmp_path / "latest")
    os.remove(tmp_path / "step-7" / "__0_0.distcp")
    with pytest.raises(trainer.UsageError, match=r"holds step folders \(step-7\) but none is whole"):
        checkpoint.current(str(tmp_path))


def test_a_reader_of_a_live_folder_never_races_its_writer(runs, tmp_path, monkeypatch):
    """A reader (--generate, tools) that finds step-2 current while the run makes step-3 current and removes step-2
    reads step-3: what a live run's folder holds is never "no such folder"."""
    from trainer import checkpoint
    from trainer.checkpoint import reading
    shutil.copytree(runs["root"] / "saved" / "step-2", tmp_path / "step-2")
    (tmp_path / "latest").write_text("step-2\n")
    read_state = reading.read_state

    def superseded_meanwhile(found):
        if found.path.endswith("step-2"):  # the writer, between the reader's look at latest and its read
            shutil.copytree(tmp_path / "step-2", tmp_path / "step-3.partial")
            checkpoint.make_current(str(tmp_path), "step-3")
        return read_state(found)
    monkeypatch.setattr(reading, "read_state", superseded_meanwhile)  # read_alone's reader
    found, state = checkpoint.read_alone(str(tmp_path))
    assert found.path == str(tmp_path / "step-3") and sorted(os.listdir(tmp_path)) == ["latest", "step-3"]
    assert state["optimizer_steps"] == 2 and "model" in state


@pytest.mark.parametrize("name", ["corrupt", "corrupt last.pt"])
def test_a_reader_alone_refuses_flipped_bytes_in_one_line(runs, name):
    """--generate's and tools' reader (read_alone, one process) refuses a folder with a byte flipped inside a shard
    and a last.pt with one flipped, in one line naming the file (torch.load would load both in silence); the
    folder's run state, in another file, still reads."""
    from trainer import checkpoint
    directory = runs["root"] / name
    with pytest.raises(trainer.UsageError) as refusal:
        checkpoint.read_alone(str(directory))
    text, file = str(refusal.value), "last.pt" if name.endswith("last.pt") else "__1_0.distcp"
    assert f"file {file} does not match its checksum (corrupt" in text and "\n" not in text, text
    assert "delete it" not in text  # a reader says what is wrong and leaves the checkpoint alone
    if name == "corrupt":
        assert checkpoint.read_state(checkpoint.current(str(directory)))["optimizer_steps"] == 2


def test_generate_samples_from_a_folder(runs, capsysbinary):
    """--generate (one process, no group) rebuilds the GPT from the folder's record and whole weights."""
    argv = ["--checkpoint-dir", str(runs["root"] / "saved"), "--generate", "12", "--prompt", "def ", "--top-k", "1"]
    assert trainer.main(argv) == 0
    out = capsysbinary.readouterr().out
    assert out.startswith(b"def ") and len(out) == 4 + 12 + 1, out


TORCH_ALONE = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], "whole.pt")
for path in ("whole.pt", sys.argv[2]):
    state = torch.load(path, weights_only=True)
    print(path, sorted(state))
"""


def test_checkpoints_open_with_torch_alone(runs, tmp_path):
    """A folder (through dcp_to_torch_save) and last.pt (DDP's, written after its resume from the folder), read by
    torch.load(weights_only=True) in a Python without this repository on its path and away from it: nothing in them
    but tensors and Python's builtins."""
    done = subprocess.run([sys.executable, "-c", TORCH_ALONE, str(runs["root"] / "saved" / "step-2"),
                           str(runs["root"] / "ddp" / "last.pt")], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "")}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "whole.pt ['extra', 'model', 'optimizer']" in done.stdout, done.stdout


class FullDisk:
    """A file on a disk that fills after ``room`` bytes: its writes then raise ENOSPC, as the kernel's do."""

    def __init__(self, file, room):
        self.file, self.room = file, room

    def write(self, data):
        size = memoryview(data).nbytes
        if size > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= size
        return self.file.write(data)

    def __getattr__(self, name):  # tell, flush, fileno, close: the file's own
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


@contextlib.contextmanager
def disk_fault(fault, rank, directory):
    """The disk under ``directory`` failing in this worker, in-process (the tests run as root here, which passes
    permission bits, and may not mount a small file system): "full folder", rank 1's data file of DIR/step-2 fills
    (DCP's file streams); "full file", last.pt's temporary file of the second save fills (os.fdopen, which
    files.atomic_write opens it with); "read-only", a file made in DIR fails with EROFS (tempfile.mkstemp), or, run
    as another user than root, DIR's permission bits (chmod 0o555 by the test) say no."""
    from torch.distributed.checkpoint import filesystem
    patches = []
    if fault == "full folder" and rank == 1:
        create_stream = filesystem.FileSystem.create_stream

        @contextlib.contextmanager
        def filling(self, path, mode):
            with create_stream(self, path, mode) as stream:
                yield FullDisk(stream, 64) if "step-2.partial" in str(path) and "w" in mode else stream
        patches.append((filesystem.FileSystem, "create_stream", filling))
    if fault == "full file" and rank == 0:
        fdopen, opened = os.fdopen, []

        def filling(fd, *args, **kwargs):
            file = fdopen(fd, *args, **kwargs)
            if os.readlink(f"/proc/self/fd/{fd}").startswith(directory):
                opened.append(fd)
                return FullDisk(file, 64) if len(opened) == 2 else file
            return file
        patches.append((os, "fdopen", filling))
    if fault == "read-only" and os.geteuid() == 0:
        mkstemp = tempfile.mkstemp

        def read_only(*args, **kwargs):
            if os.path.abspath(kwargs.get("dir") or "").startswith(directory):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            return mkstemp(*args, **kwargs)
        patches.append((tempfile, "mkstemp", read_only))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def disk_faults_in_group(rank, world_size, legs):
    """main_in_group under each leg's disk_fault, in turn: {name: result}."""
    out = {}
    for name, fault, directory, argv in legs:
        with disk_fault(fault, rank, directory):
            out[name] = main_in_group(rank, world_size, argv)
    return out


def test_the_disks_errors_are_said_in_one_line_and_the_previous_checkpoint_stays_current(local_group, corpus,
                                                                                           tmp_path):
    """A disk that fills during the second save (--checkpoint-every 1): of a folder (rank 1's data file, at
    --zero 1) or of last.pt (rank 0's, at --zero 0), both ranks stop with one line naming it and the checkpoint that
    stays current, which is whole and resumes (nothing of the failed save left); a --checkpoint-dir that cannot be
    written is refused before the first step at every --zero and sync alike (it was refused at the start only where
    folders are written, and --zero 0 failed after its steps with a traceback)."""
    legs = [("full folder", ["--zero", "1"]), ("full file", []), ("read-only zero 0", []),
            ("read-only zero 3", ["--zero", "3"])]
    directories = {name: str(tmp_path / name.replace(" ", "-")) for name, _ in legs}
    for name in directories:
        if name.startswith("read-only"):
            os.makedirs(directories[name])
            if os.geteuid() != 0:
                os.chmod(directories[name], 0o555)
    results = local_group(2).run(disk_faults_in_group, [
        (name, name if name.startswith("full") else "read-only", directories[name],
         argv_of(corpus, 4, *flags, "--max-steps", "2", "--checkpoint-every", "1", "--checkpoint-dir",
                 directories[name])) for name, flags in legs])
    for name, _ in legs:
        os.chmod(directories[name], 0o755)
        assert [rank[name]["code"] for rank in results] == [2, 2], results[0][name]["stderr"][-2000:]
        assert results[1][name]["stderr"] == ""  # rank 0 speaks for all
    from trainer import checkpoint
    for name, kept in (("full folder", "step-1"), ("full file", "last.pt")):
        directory, err = directories[name], results[0][name]["stderr"]
        written = os.path.join(directory, "step-2" if name == "full folder" else "last.pt")
        assert err == (f"ddp_cifar100.py: error: cannot save checkpoint {written}: no space left on device (the "
                       f"previous checkpoint {os.path.join(directory, kept)} is still current)\n"), err
        assert sorted(os.listdir(directory)) == (["latest", "step-1"] if kept == "step-1" else ["last.pt"])
        found, state = checkpoint.read_alone(directory)
        assert found.path == os.path.join(directory, kept) and state["optimizer_steps"] == 1
    for name in ("read-only zero 0", "read-only zero 3"):
        result = results[0][name]
        why = "read-only file system" if os.geteuid() == 0 else "permission denied"
        assert result["stderr"] == (f"ddp_cifar100.py: error: cannot write in --checkpoint-dir {directories[name]}: "
                                    f"{why}\n"), result["stderr"]
        assert "epoch 1" not in result["stdout"], result["stdout"]  # no step taken
        assert os.listdir(directories[name]) == []


# ----------------------------------------------------------------------------------------------------------
# last.pt read by parts: mapped by every rank that sees it, sent by rank 0 where one does not
# ----------------------------------------------------------------------------------------------------------
def load_file_in_group(rank, world_size, folder, shared):
    """An AdamW model's last.pt (zero.checkpoint.save_file, rank 0) loaded into a fresh model and AdamW on every
    rank, from a file every rank sees (``shared``) or from rank 0's folder alone; what each rank loaded, whether the
    whole state was broadcast pickled, and whether the file is still mapped once the load is done (an optimizer
    state left a view of it)."""
    import torch
    import torch.distributed as dist
    import zero

    def built():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
        return zero.shard(model, 0), torch.optim.AdamW(model.parameters(), lr=0.01)

    sync, optimizer = built()
    sync.model(torch.ones(4, 300)).sum().backward()
    optimizer.step()
    path = os.path.join(folder if shared else f"{folder}-{rank}", "last.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    zero.checkpoint.save_file(path, sync, optimizer, {"step": 1})
    saved = ({k: v.clone() for k, v in sync.model.state_dict().items()},
             {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()})
    sync, optimizer = built()
    sent, broadcast = [], dist.broadcast_object_list
    dist.broadcast_object_list = lambda message, *a, **k: (sent.append(1), broadcast(message, *a, **k))[1]
    try:
        extra = zero.checkpoint.load_file(path, sync, optimizer, stepped=True)
    finally:
        dist.broadcast_object_list = broadcast
    with open("/proc/self/maps") as maps:
        still_mapped = path in maps.read()
    loaded = (sync.model.state_dict(), optimizer.state_dict()["state"][0])
    return {"extra": extra, "sent": len(sent), "still_mapped": still_mapped,
            "same": all(torch.equal(a[k], b[k]) for a, b in zip(saved, loaded) for k in a)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
@pytest.mark.parametrize("shared", [True, False], ids=["seen by every rank", "rank 0's alone"])
def test_last_pt_is_mapped_by_every_rank_that_sees_it_and_sent_where_one_does_not(local_group, tmp_path, shared):
    """Seen by every rank: no pickled broadcast of the state, and nothing of the optimizer's left a view of the file;
    in folders of their own (nodes that share none), rank 0's file sent as before. Both load exactly what was
    saved."""
    ranks = local_group(2).run(load_file_in_group, str(tmp_path / "dir"), shared, timeout_s=120)
    for result in ranks:
        assert result["same"] and result["extra"] == {"step": 1}
        assert result["sent"] == (0 if shared else 1)  # (the save's own broadcast of its verdict is not counted)
        assert not result["still_mapped"]


def non_finite_in_group(rank, world_size, legs):
    """main_in_group with DDP_CIFAR100_FAULT set to each leg's fault, in turn: {name: result}."""
    out = {}
    for name, fault, argv in legs:
        os.environ["DDP_CIFAR100_FAULT"] = fault
        try:
            out[name] = main_in_group(rank, world_size, argv)
        finally:
            del os.environ["DDP_CIFAR100_FAULT"]
    return out


def test_a_non_finite_loss_stops_every_rank_in_one_line_and_nothing_non_finite_is_saved(local_group, corpus,
                                                                                       tmp_path):
    """Rank 1's loss made NaN in the 4th step (the fault point "nan"), a save due after it (--checkpoint-every 2):
    both ranks stop at that step, rank 0 says it in one line naming the step and the rank, and the checkpoint of step
    2 is still current and finite, in last.pt (--zero 0, --clip-grad-norm: the global norm is NaN too) and in a
    folder (--zero 1). On main the run trained on at a NaN loss and saved step 4."""
    legs = [("file", ["--clip-grad-norm", "1"]), ("folder", ["--zero", "1"])]
    results = local_group(2).run(non_finite_in_group, [
        (name, "1:3:nan", argv_of(corpus, 4, *flags, "--max-steps", "6", "--checkpoint-every", "2",
                                   "--checkpoint-dir", str(tmp_path / name))) for name, flags in legs])
    import torch
    from trainer import checkpoint
    for name, _ in legs:
        assert [rank[name]["code"] for rank in results] == [2, 2], results[0][name]["stderr"][-2000:]
        lines = results[0][name]["stderr"].strip().splitlines()
        assert len(lines) == 1 and "non-finite loss at optimizer step 4 on rank 1" in lines[0], lines
        assert "the checkpoint of step 2 is still current" in lines[0]
        assert results[1][name]["stderr"] == ""
        found, state = checkpoint.read_alone(str(tmp_path / name))
        assert state["optimizer_steps"] == 2, found
        assert all(torch.isfinite(value).all() for value in state["model"].values())


def readers_in_group(rank, world_size, directory, argv, stop):
    """Readers of ``directory`` in turn until the file ``stop`` appears: --eval-only (the Checkpointer's restore)
    and read_alone (--generate's and the export's reader); each failure's last lines, and how many reads were
    whole."""
    from trainer import checkpoint
    failures, reads = [], 0
    while not os.path.exists(stop):
        if not os.path.exists(os.path.join(directory, "latest")) and not os.path.exists(
                os.path.join(directory, "last.pt")):
            continue  # the run's first save not yet made
        result = main_in_group(rank, world_size, argv)
        if result["code"] != 0:
            failures.append(("eval-only", result["stderr"][-600:]))
        try:
            checkpoint.read_alone(directory)
        except Exception as exc:  # noqa: BLE001 - what the test reports
            failures.append(("read_alone", f"{type(exc).__name__}: {exc}"))
        reads += 1
    return {"failures": failures, "reads": reads}


@pytest.mark.parametrize("flags", [["--zero", "3"], ["--zero", "3", "--async-checkpoint"], [],
                                   ["--async-checkpoint"]], ids=["folders", "folders async", "last.pt",
                                                                 "last.pt async"])
def test_readers_beside_a_saving_run_read_a_whole_checkpoint_every_time(flags, local_group, corpus, tmp_path):
    """A run on 2 processes saving every other step (--checkpoint-every 2), and meanwhile --eval-only and read_alone
    in another process, again and again: every read is whole, the current checkpoint or the one that superseded it.
    A reader that does not start again where its checkpoint was superseded fails against a folder ("step-N: no such
    folder", a data file not found, DCP's "metadata is None")."""
    directory, stop = str(tmp_path / "run"), str(tmp_path / "stop")
    argv = argv_of(corpus, 4, *flags, "--epochs", "20", "--max-steps", "24", "--checkpoint-every", "2",
                   "--checkpoint-dir", directory)
    eval_argv = [a for a in argv if a != "--async-checkpoint"] + ["--eval-only"]
    writer = local_group(2).submit(main_in_group, argv)
    readers = local_group(1).submit(readers_in_group, directory, eval_argv, stop)
    try:
        written = writer()
    finally:
        open(stop, "w").close()
        read = readers()[0]
    assert [rank["code"] for rank in written] == [0, 0], written[0]["stderr"][-2000:]
    assert read["failures"] == [] and read["reads"] >= 1, read


KILLED_WRITING = """
import os, signal, sys
from files import atomic_write
with atomic_write(sys.argv[1], "wb") as f:
    f.write(b"half of a checkpoint")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_what_a_killed_write_of_last_pt_leaves_is_removed_at_the_next_start_and_nothing_else(tmp_path):
    """A process SIGKILLed while files.atomic_write wrote DIR/last.pt (and DIR/latest) leaves its temporary file; the
    next run's lock on the folder removes those, and only those (on main: tmpXXXX.tmp, never removed)."""
    from trainer.checkpoint import folders
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("last.pt", "latest"):
        subprocess.run([sys.executable, "-c", KILLED_WRITING, str(tmp_path / name)], cwd=root, check=False)
    left = sorted(os.listdir(tmp_path))
    assert len(left) == 2 and all(name.endswith(".tmp") for name in left), left
    for name in ("tmpabc123.tmp", ".last.pt.tmp", "notes.tmp", ".last.pt.backup"):  # not the trainer's
        (tmp_path / name).write_text("mine")
    descriptor, problem = folders.lock(str(tmp_path))
    folders.unlock(descriptor)
    assert problem is None
    assert sorted(os.listdir(tmp_path)) == [".last.pt.backup", ".last.pt.tmp", "notes.tmp", "tmpabc123.tmp"]


def background_writes_fail_in_group(rank, world_size, argv):
    """main_in_group with every rank's background writes failing from step 3 on (the disk full as the writer
    starts: trainer.faults.FaultPlan.at patched in this worker), rank 1's a second and a half later than rank 0's."""
    import time
    from trainer import faults
    at = faults.FaultPlan.at

    def disk_full_from_step_3(plan, point, step):
        if point == "write" and step >= 3:
            time.sleep(1.5 * rank)
            raise OSError(errno.ENOSPC, "No space left on device")
        at(plan, point, step)
    faults.FaultPlan.at = disk_full_from_step_3
    try:
        return main_in_group(rank, world_size, argv)
    finally:
        faults.FaultPlan.at = at


def test_a_background_save_that_fails_on_the_ranks_at_different_times_is_one_line(local_group, corpus, tmp_path):
    """--async-checkpoint, the writes failing on rank 0 first and on rank 1 1.5 s later: every rank stops at the same
    step (the failure joins the loop's per-step all-reduce: trainer/finite.py's watch), rank 0 says it in one line and
    rank 1 says nothing (on main rank 0 left at its next step and rank 1 went on into a collective with it, to print
    a line of its own: "rank 1: distributed failure")."""
    argv = argv_of(corpus, 4, "--zero", "3", "--epochs", "5", "--max-steps", "12", "--checkpoint-every", "1",
                   "--async-checkpoint", "--timeout", "15", "--checkpoint-dir", str(tmp_path / "run"))
    ranks = local_group(2).run(background_writes_fail_in_group, argv)
    assert [rank["code"] for rank in ranks] == [2, 2], [rank["stderr"][-600:] for rank in ranks]
    lines = ranks[0]["stderr"].strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0] and "still current" in lines[0], lines
    assert ranks[1]["stderr"] == ""
