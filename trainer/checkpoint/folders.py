"""--checkpoint-dir's layout, plain file-system code (no process group: every caller here is one process).

    DIR/last.pt               one file (the whole model), rank 0's
    DIR/step-N                a DCP folder, N optimizer steps; DIR/latest, one line, names the current one
    DIR/step-N.partial        a folder being written; renamed to DIR/step-N once every rank's part is in
    DIR/step-N.removing       a superseded folder being deleted: no reader sees one half gone

Only names of these forms are ever removed (``OURS``: a user's step-best/ stays), and no state of the folder strands a
run (``current``): a finished folder newer than the one DIR/latest names (a run stopped between the rename and the
pointer) is adopted once it is checked whole, and a DIR/latest that is missing, unreadable or names nothing falls
back to the newest whole folder, said in one line; a folder whose step folders are all torn is refused in one line,
never started afresh over. Rank 0 holds a lock on DIR for the run's life (``lock``).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
from typing import Callable, Iterator, NamedTuple

from files import atomic_write, leftover_temporaries
from utils import UsageError

FILE, LATEST = "last.pt", "latest"  # DIR/last.pt; DIR/latest names the current folder
BEHIND = "not-the-runs-end.json"  # a replica group's folder left behind its run's end (mark_behind)
FOLDER, PARTIAL = "step-", ".partial"  # DIR/step-N, written as DIR/step-N.partial
REMOVING = ".removing"  # a superseded DIR/step-N is renamed so before it is deleted: no reader sees it half gone
OURS = re.compile(r"step-(\d+)(\.partial|\.removing)?")  # the names this script writes, the only ones it removes


class Found(NamedTuple):
    """A checkpoint in --checkpoint-dir: its path, whether it is a DCP folder (else last.pt), and why it was chosen
    when DIR/latest did not name it (a note for the user)."""
    path: str
    folder: bool
    note: str | None = None


# ----------------------------------------------------------------------------------------------------------
# The run's hold on the folder
# ----------------------------------------------------------------------------------------------------------
def lock(directory: str) -> tuple[int | None, str | None]:
    """An exclusive lock on ``directory`` (made if missing) for the run's life: (its descriptor, None), or (None, why
    not in one line). flock on the folder itself: nothing is written for it, and the kernel drops it when the process
    dies, so a killed run leaves nothing stuck. A second run on the folder is refused before it touches anything (it
    would remove the first's save under way as a leftover); so is a folder this process cannot write in. Once held,
    the temporary files a killed run's last.pt or latest left (files.atomic_write's names, only those) are removed."""
    try:
        os.makedirs(directory, exist_ok=True)
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError as exc:
        return None, f"cannot use --checkpoint-dir {directory}: {exc.strerror or exc}"
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None, (f"another run is using --checkpoint-dir {directory} (it holds the folder's lock): wait for it "
                      f"to end, or use another folder")
    for name in leftover_temporaries(directory, (FILE, LATEST)):  # a run killed while it wrote last.pt
        with contextlib.suppress(OSError):
            os.remove(os.path.join(directory, name))
    return descriptor, unwritable(directory)


def unlock(descriptor: int | None) -> None:
    """The lock ``lock`` took released (closing the descriptor drops its flock)."""
    if descriptor is not None:
        os.close(descriptor)


def unwritable(directory: str) -> str | None:
    """Why this process cannot write in ``directory`` (a read-only file system, its permissions), or None: a file
    made and removed there, so that a run that could never save is refused before its first step, whatever the
    sync and format (root passes the permission bits: only a read-only mount stops it)."""
    try:
        descriptor, probe = tempfile.mkstemp(dir=directory, prefix=".writable-")
        os.close(descriptor)
        os.remove(probe)
    except OSError as exc:
        return f"cannot write in --checkpoint-dir {directory}: {(exc.strerror or str(exc)).lower()}"
    return None


# ----------------------------------------------------------------------------------------------------------
# Which checkpoint is current
# ----------------------------------------------------------------------------------------------------------
def current(directory: str) -> Found | None:
    """The checkpoint a run in ``directory`` resumes from: the folder DIR/latest names, or DIR/last.pt; the newer
    when both are there (a run stopped between making one current and removing the other). A finished folder newer
    than the named one (a run stopped between its rename and the pointer) is adopted once checked whole; a missing
    or unreadable DIR/latest, or one naming no folder, falls back to the newest whole folder (``note`` says so), and
    a folder marked behind its run's end (``mark_behind``) says that in ``note`` too."""
    file = os.path.join(directory, FILE)
    folder = current_folder(directory)
    if os.path.exists(file) and (folder is None or os.path.getmtime(file) > os.path.getmtime(folder.path)):
        folder = Found(file, folder=False)
    behind = behind_note(directory)
    if folder is None or behind is None:
        return folder
    return folder._replace(note=f"{folder.note}; {behind}" if folder.note else behind)


# [Note: left behind] A replica group back after its run finished (replicas.RunFinished) ends with 0 and its folder
# as it was: a checkpoint of a step before the run's end, which a reader (--eval-only, --generate, the export, a
# user's torch.load) would take for the run's result. So the group leaves DIR/not-the-runs-end.json beside it
# (the step it holds, the run's end and the group whose checkpoints hold it), every reader of the folder notes it,
# and the next save into the folder (a run that trains it again) removes it.
def mark_behind(directory: str, record: dict) -> str:
    """DIR/not-the-runs-end.json written (atomically) with ``record``; its path."""
    path = os.path.join(directory, BEHIND)
    with atomic_write(path) as f:
        json.dump(record, f)
        f.write("\n")
    return path


def behind_note(directory: str) -> str | None:
    """A reader's note where ``directory`` is marked behind its run's end (``mark_behind``), else None."""
    path = os.path.join(directory, BEHIND)
    try:
        with open(path) as f:
            record = json.load(f)
        held, end, holder = record["held_step"], record["run_end_step"], record.get("end_group")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return f"note: {path} marks this folder as not its run's end (unreadable: see the file)"
    where = f"replica group {holder}'s checkpoints" if holder is not None else "the other replica groups'"
    return (f"note: {directory} holds step {held} of a run that finished at step {end} without this group: not the "
            f"run's result, which is in {where} ({path})")


def clear_behind(directory: str) -> None:
    """A save into the folder: what it holds is trained again, no longer left behind."""
    try:
        os.unlink(os.path.join(directory, BEHIND))
    except FileNotFoundError:
        pass


def current_folder(directory: str) -> Found | None:
    """The current DCP folder of ``directory`` (``current``), or None where there is no finished one."""
    steps = finished_steps(directory)
    named = named_step(directory)
    newer = [step for step in steps if named is None or step > named]
    for step in reversed(newer):  # the newest whole one, read only as far as needed
        path = os.path.join(directory, f"{FOLDER}{step}")
        if whole(path):
            why = (f"{LATEST} names {FOLDER}{named}, but {FOLDER}{step} is finished and whole (a run stopped before "
                   f"naming it)" if named is not None else f"{LATEST} is missing or unreadable")
            return Found(path, folder=True, note=f"note: resuming from {path}: {why}")
    if named is not None:
        return Found(os.path.join(directory, f"{FOLDER}{named}"), folder=True)  # torn or not: load says which
    if steps:
        listed = ", ".join(f"{FOLDER}{step}" for step in steps)
        raise UsageError(f"--checkpoint-dir {directory} holds step folders ({listed}) but none is whole and "
                         f"{LATEST} names none; move them away to start afresh")
    return None


def identity(path: str) -> tuple[int, int, int] | None:
    """What ``path`` names now (device, inode, modification time), or None where nothing: a reader compares it before
    and after its read, and a checkpoint superseded meanwhile (a folder renamed .removing, last.pt replaced) differs."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_mtime_ns


@contextlib.contextmanager
def opened(found: Found | None, before: tuple[int, int, int] | None) -> Iterator[str | None]:
    """A path to read ``found`` by: a folder's own; last.pt's open file (/proc/self/fd/N, where there is one), so a
    save that replaces it meanwhile changes nothing of what is read, or None where the name no longer names the file
    ``before`` identified (replaced since: read the newer one). An error that names the alias is raised as a
    UsageError naming the file (every reader of a checkpoint says its errors so: manager.py)."""
    if found is None or found.folder or not os.path.isdir("/proc/self/fd"):
        yield found.path if found is not None else None
        return
    try:
        descriptor = os.open(found.path, os.O_RDONLY)
    except FileNotFoundError:
        yield None
        return
    alias = f"/proc/self/fd/{descriptor}"
    try:
        stat = os.fstat(descriptor)
        yield alias if (stat.st_dev, stat.st_ino, stat.st_mtime_ns) == before else None
    except Exception as error:  # noqa: BLE001 - a reader's error names the file as the user named it, not its alias
        text = str(error) if isinstance(error, UsageError) else f"{type(error).__name__}: {error}"
        if alias not in text:
            raise
        raise UsageError(" ".join(text.replace(alias, found.path).split())) from None
    finally:
        os.close(descriptor)


def finished_steps(directory: str) -> list[int]:
    """The steps of the finished folders DIR/step-N (not .partial), in order."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(match[1]) for match in map(OURS.fullmatch, names)
                  if match and not match[2] and os.path.isdir(os.path.join(directory, match[0])))


def named_step(directory: str) -> int | None:
    """The step of the folder DIR/latest names, where it is readable and names a finished folder; else None."""
    try:
        with open(os.path.join(directory, LATEST), encoding="utf-8") as f:
            match = OURS.fullmatch(f.read(64).strip())
    except (OSError, UnicodeDecodeError):  # missing, a folder, unreadable bytes
        return None
    if match is None or match[2] or not os.path.isdir(os.path.join(directory, match[0])):
        return None
    return int(match[1])


def whole(path: str) -> bool:
    """Whether a DCP folder is whole: its .metadata readable, every data file it names there at its size."""
    from zero.checkpoint import read_folder  # DCP, imported only where a folder is looked at
    return read_folder(path)[1] is None


# ----------------------------------------------------------------------------------------------------------
# Publishing a save, removing what it supersedes (rank 0)
# ----------------------------------------------------------------------------------------------------------
def remove_leftovers(directory: str) -> None:
    """What a save cut short left (DIR/step-N.partial, and a folder half removed), before any rank can write a
    folder of that name."""
    if os.path.isdir(directory):
        remove_folders(directory, lambda name: name.endswith((PARTIAL, REMOVING)))


def remove_folders(directory: str, chosen: Callable[[str], bool]) -> None:
    """The step folders (finished or not) whose names ``chosen`` picks, among the names this script writes (OURS);
    a finished one first renamed out of the names a reader looks at (REMOVING), then deleted."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if OURS.fullmatch(name) and chosen(name) and os.path.isdir(path):
            if not name.endswith((PARTIAL, REMOVING)):
                os.rename(path, path + REMOVING)
                path += REMOVING
            shutil.rmtree(path, ignore_errors=True)


def make_current(directory: str, name: str, keep: int = 1) -> None:
    """Once every rank has written its part of DIR/name.partial: the folder renamed and the rename made durable,
    DIR/latest pointed at it (atomically), and what it supersedes removed (last.pt, the folders but the ``keep`` - 1
    newest before it: --keep-checkpoints, none removed before the new one is current). A whole folder of the same
    step already there (a run stopped before naming it, then resumed from an older one) is kept and this save's copy
    dropped: both hold the same step of the same run, and nothing is ever without one."""
    target = os.path.join(directory, name)
    if os.path.isdir(target) and whole(target):
        shutil.rmtree(target + PARTIAL, ignore_errors=True)
    else:
        shutil.rmtree(target, ignore_errors=True)  # torn: never current (``current`` adopts only whole ones)
        os.rename(target + PARTIAL, target)
    descriptor = os.open(directory, os.O_RDONLY)
    try:  # the rename on disk before the pointer names it
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    with atomic_write(os.path.join(directory, LATEST)) as f:
        f.write(name + "\n")
    step = int(OURS.fullmatch(name)[1])
    older = [other for other in finished_steps(directory) if other < step]
    kept = {name, *(f"{FOLDER}{other}" for other in older[max(0, len(older) - keep + 1):])}
    remove_folders(directory, lambda other: other not in kept)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, FILE))


def forget_folders(directory: str) -> None:
    """Once last.pt is written: DIR/latest and the folders, which it supersedes."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, LATEST))
    remove_folders(directory, lambda name: True)


def failed_save_note(directory: str, name: str) -> str:
    """After a save of DIR/``name`` that the disk stopped: its DIR/name.partial removed (the space it took; last.pt's
    temporary file is removed by atomic_write), and which checkpoint stays current, in words for the refusal."""
    shutil.rmtree(os.path.join(directory, name + PARTIAL), ignore_errors=True)
    try:
        found = current(directory)
    except UsageError:
        found = None
    if found is None:
        return " (no earlier checkpoint)"
    if name == FILE or os.path.basename(found.path) != name:  # (last.pt: replaced atomically)
        return f" (the previous checkpoint {found.path} is still current)"
    return f" ({found.path} is current)"


def seen_marker(directory: str) -> str:
    """A marker file of a name of its own made in ``directory`` (made if missing), for the other ranks to look for
    (whether every rank sees the folder rank 0 sees); its name. OSError where it cannot be written."""
    os.makedirs(directory, exist_ok=True)
    descriptor, marker = tempfile.mkstemp(dir=directory, prefix=".seen-by-every-rank-")
    os.close(descriptor)
    return os.path.basename(marker)
