"""Files written whole or not at all: ``atomic_write`` (a temporary file beside the target, fsynced, renamed over it),
what a killed writer leaves (``leftover_temporaries``), the mode a user's files get (``umasked``), and results as JSON
(``write_json``). Checkpoints, run files and every benchmark's results are written through it."""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from typing import IO, Any, Iterator


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w") -> Iterator[IO[Any]]:
    """Write ``path`` so that a crash leaves the old file or the new one, never half of one.

    Yields a temporary file in the same folder (made if needed), named after ``path`` (TEMPORARY: ".NAME.XXXXXXXX.tmp",
    so that what a killed process leaves can be told from anything else there and removed: leftover_temporaries); on
    success it is flushed, fsynced, given the mode any file the user writes gets (the umask's) and renamed over
    ``path``; on failure it is removed.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, umasked(0o666))  # mkstemp makes it private
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def umasked(mode: int) -> int:
    """``mode`` as open() and mkdir() would make it under this process's umask (0o666 -> 0o644 under 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def leftover_temporaries(folder: str, names: tuple[str, ...]) -> list[str]:
    """The temporary files atomic_write left in ``folder`` for the files ``names`` (a process killed while it wrote
    one): ".NAME.XXXXXXXX.tmp", and nothing else."""
    pattern = re.compile(rf"\.({'|'.join(map(re.escape, names))})\.[A-Za-z0-9_]+\.tmp")
    return sorted(name for name in os.listdir(folder) if pattern.fullmatch(name)) if os.path.isdir(folder) else []


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write JSON atomically (see atomic_write)."""
    with atomic_write(path) as f:
        json.dump(payload, f, indent=2, sort_keys=False)
        f.write("\n")
