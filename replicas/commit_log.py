"""The commit log: what one process needs to replay the run (the package docstring's "Why it is exact").

A file of JSON lines, written by each group's place 0: per committed step, {"step", "quorum", "participants",
"time"} and, where the trainer names them, "samples" (what each participant used: {group: samples}); between them,
notes (entries without "step": the run's id, {"run": id}, a recovery's timings, {"recovered": {...}}, and the
run's end, {"finished": step}: such a log is not continued). A joiner receives its source's log with
the live state and keeps it in place of its own steps (which were another branch: [Note: lineage]), its own notes
after it."""
from __future__ import annotations

import fcntl
import json
import os
from typing import Any

from replicas.protocol import ReplicaRefused, one_line, whole_number


def append_log(path: str, entry: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def write_log(path: str, entries: list[dict[str, Any]]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(entry) + "\n" for entry in entries)
    os.replace(tmp, path)


def read_log(path: str, steps_only: bool = True) -> list[dict[str, Any]]:
    """A commit log's entries: the committed steps (``steps_only``), or everything noted too. One that cannot be
    read, or a line of it that is not an entry, is refused in one line naming the file and the line (ReplicaRefused:
    a restart of the group would read the same)."""
    entries = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                except ValueError as error:
                    raise ReplicaRefused(f"--commit-log {path}: line {number} is not JSON ({error}): a log written "
                                         f"by another program, or cut by hand? Give this group a new --commit-log "
                                         f"or mend the line") from None
                if not isinstance(entry, dict) or not valid_entry(entry):
                    raise ReplicaRefused(f"--commit-log {path}: line {number} is not a commit log's entry "
                                         f"({line.strip()[:80]!r})")
                entries.append(entry)
    except (OSError, UnicodeDecodeError) as error:
        raise ReplicaRefused(f"--commit-log {path}: unreadable ({one_line(error)})") from None
    return [entry for entry in entries if "step" in entry] if steps_only else entries


def valid_entry(entry: dict[str, Any]) -> bool:
    """A step's entry has a whole step and quorum (``whole_number``); a note has none."""
    return "step" not in entry or all(whole_number(entry.get(key)) for key in ("step", "quorum"))


def resume_log(path: str, step: int) -> list[dict[str, Any]]:
    """The log an earlier process of this group left at ``path``, kept up to ``step`` (the step the new process's
    weights are at: the later steps are taken again) and its run's note; [] where there is none. Not written back
    here: the member does once the coordinator took it (a log of another run is refused, not truncated)."""
    if not os.path.exists(path):
        return []
    log = read_log(path, steps_only=False)
    finished = next((entry["finished"] for entry in log if "finished" in entry), None)
    if finished is not None:
        raise ReplicaRefused(f"--commit-log {path} holds a run that finished at step {finished} (run "
                             f"{run_of(log)}): give a new run another --commit-log")
    return [entry for entry in log
            if "run" in entry or entry.get("step", entry.get("recovered", {}).get("step", 0)) < step]


def lock_log(path: str) -> int:
    """An exclusive lock on the commit log at ``path`` for the run's life (flock on PATH.lock, which stays: the log
    itself is replaced whole when written back), its descriptor; held by another live process (two groups given one
    --commit-log: they interleaved their steps in it, and a truncation of one dropped the other's), one line. The
    kernel drops it when the process dies: a killed run leaves nothing stuck."""
    descriptor = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise ReplicaRefused(f"another run is writing --commit-log {path} (it holds {path}.lock): give each replica "
                             f"group its own --commit-log") from None
    return descriptor


def run_of(log: list[dict[str, Any]]) -> str | None:
    """The run the log's steps belong to (its {"run": id} note, written at the group's first quorum), or None."""
    return next((entry["run"] for entry in log if "run" in entry), None)


def last_commit(log: list[dict[str, Any]]) -> int | None:
    """The quorum that committed the log's last step (None: none yet), which a join request names."""
    return next((entry["quorum"] for entry in reversed(log) if "step" in entry), None)


def adopt(own: list[dict[str, Any]], received: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A joiner's log once it received its source's: the source's steps (this group's own are another branch), then
    every note of this group's that the source's log lacks."""
    return received + [entry for entry in own if "step" not in entry and entry not in received]
