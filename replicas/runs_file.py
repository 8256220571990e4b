"""What a coordinator keeps of its runs on disk (``python -m replicas serve --runs-file PATH``), for a coordinator
restarted after every group that could tell it has gone: the run's id, its end (the finished mark a group that
finished wrote: {"step", "group", "run", "quorum"}, the last the quorum that committed its last step; or null) and
the ends of the runs before it on this coordinator ({run id: last step}, from --new-run). The store's keys die
with the coordinator; the groups still connected carry the run's id and its end to a new one (liveness.py,
Heartbeat.carried), but a group that finished and exited carries nothing, and a new coordinator that knew
nothing would let a late group of the finished run train alone.

One JSON object, written whole to a temporary file in the same folder, flushed to disk and renamed over the old one
(a reader, a restart after a crash mid-write included, sees the old content or the new, never half). Membership and
the frontier are not kept: the groups bring those back in their requests."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

from replicas.protocol import SERVE, one_line, whole_number

KEYS = ("run", "finished", "finished_runs")


class RunsFileError(ValueError):
    """A runs file that cannot be used (malformed, unreadable, its folder missing): one line, at the start."""


class RunsFile:
    """The file at ``path``: read at construction (``kept``: its content, None where there is no file yet, a fresh
    coordinator; RunsFileError where it cannot be used), written by ``write`` whenever what it keeps changes."""

    def __init__(self, path: str):
        self.path, self.warned = path, None
        folder = os.path.dirname(os.path.abspath(path))
        if not path or os.path.isdir(path):
            raise RunsFileError(f"--runs-file {path or '(empty)'}: a file's path expected, not a folder's")
        if not os.path.isdir(folder):
            raise RunsFileError(f"--runs-file {path}: its folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise RunsFileError(f"--runs-file {path}: its folder {folder} is not writable")
        self.kept: dict[str, Any] | None = self._read()

    def _read(self) -> dict[str, Any] | None:
        try:
            with open(self.path) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as error:
            raise RunsFileError(f"--runs-file {self.path}: unreadable ({one_line(error)})") from None
        try:
            kept = json.loads(text)
        except ValueError as error:
            raise RunsFileError(f"--runs-file {self.path}: not JSON ({error})") from None
        why = malformed(kept)
        if why:
            raise RunsFileError(f"--runs-file {self.path}: not a runs file ({why})")
        return kept

    def write(self, kept: dict[str, Any]) -> None:
        """``kept`` ({"run", "finished", "finished_runs"}) to the file, atomically, where it differs from what the file
        holds. A failure (a full disk) is said in one line, once, and the coordinator goes on: the file keeps its
        last content, and the next write tries again."""
        text = json.dumps(kept) + "\n"
        if self.kept is not None and text == json.dumps(self.kept) + "\n":
            return
        folder, temporary = os.path.dirname(os.path.abspath(self.path)), None
        try:
            descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(self.path)}.",
                                                     suffix=".tmp")
            with os.fdopen(descriptor, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, self.path)
            directory = os.open(folder, os.O_RDONLY)  # the rename itself on disk
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as error:
            if temporary is not None and os.path.exists(temporary):
                os.unlink(temporary)
            if one_line(error) != self.warned:
                self.warned = one_line(error)
                print(f"{SERVE}: warning: --runs-file {self.path} not written ({self.warned}): a coordinator "
                      f"restarted now would not know what changed", file=sys.stderr, flush=True)
            return
        self.kept, self.warned = json.loads(text), None  # (a copy: the lighthouse's dicts change)


def malformed(kept: Any) -> str | None:
    """What is wrong with a runs file's content (None: nothing). A step is a whole number (``whole_number``), a run
    id a string of at least one character."""
    if not isinstance(kept, dict) or set(kept) != set(KEYS):
        return f"a JSON object with exactly the keys {', '.join(KEYS)} expected"
    if kept["run"] is not None and not run_id(kept["run"]):
        return f"run {kept['run']!r}: a run id or null expected"
    finished = kept["finished"]
    if finished is not None and not (isinstance(finished, dict) and whole_number(finished.get("step"))
                                     and (finished.get("run") is None or run_id(finished["run"]))
                                     and (finished.get("quorum") is None or whole_number(finished["quorum"]))):
        return (f"finished {finished!r}: null or {{\"step\": N, \"group\": G, \"run\": id, \"quorum\": Q}} "
                f"expected")
    runs = kept["finished_runs"]
    if not isinstance(runs, dict) or not all(run_id(run) and whole_number(step) for run, step in runs.items()):
        return f"finished_runs {runs!r}: {{run id: last step}} expected"
    return None


def run_id(value: Any) -> bool:
    return isinstance(value, str) and bool(value)
