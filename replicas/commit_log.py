"""The commit log: what one process needs to replay the run (the package docstring's "Why it is exact").

A file of JSON lines, written by each group's place 0: per committed step, {"step", "quorum", "participants",
"time"} and, where the trainer names them, "samples" (what each participant used: {group: samples}); between them,
notes (entries without "step": a recovery's timings, {"recovered": {...}}). A joiner receives its source's log with
the live state and keeps it in place of its own steps (which were another branch: [Note: lineage]), its own notes
after it."""
from __future__ import annotations

import json
import os
from typing import Any


def append_log(path: str, entry: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def write_log(path: str, entries: list[dict[str, Any]]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(entry) + "\n" for entry in entries)
    os.replace(tmp, path)


def read_log(path: str, steps_only: bool = True) -> list[dict[str, Any]]:
    """A commit log's entries: the committed steps (``steps_only``), or everything noted too."""
    with open(path) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    return [entry for entry in entries if "step" in entry] if steps_only else entries


def resume_log(path: str, step: int) -> list[dict[str, Any]]:
    """The log an earlier process of this group left at ``path``, kept up to ``step`` (the step the new process's
    weights are at: the later steps are taken again) and written back so; [] where there is none."""
    if not os.path.exists(path):
        return []
    log = [entry for entry in read_log(path, steps_only=False)
           if entry.get("step", entry.get("recovered", {}).get("step", 0)) < step]
    write_log(path, log)
    return log


def last_commit(log: list[dict[str, Any]]) -> int | None:
    """The quorum that committed the log's last step (None: none yet), which a join request names."""
    return next((entry["quorum"] for entry in reversed(log) if "step" in entry), None)


def adopt(own: list[dict[str, Any]], received: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A joiner's log once it received its source's: the source's steps (this group's own are another branch), then
    every note of this group's that the source's log lacks."""
    return received + [entry for entry in own if "step" not in entry and entry not in received]
