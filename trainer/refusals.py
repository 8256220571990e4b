"""A refusal is final (replica groups): the coordinator that refused a group refuses it again, so a torchrun that
restarts it must not ask again and again. torchrun's agent restarts a failed worker group, whatever its exit code,
as long as --max-restarts lasts: a refused group asked K + 1 times, each start building the model and the data
first (a wrong --lr refused 3 times in 22 s at K = 2; about 9 minutes at K = 100).

So the first refusal leaves a note (``remember``) keyed by this torchrun's run (TORCHELASTIC_RUN_ID: a new one per
``torchrun --standalone``) and the command line, and a restart of that torchrun (TORCHELASTIC_RESTART_COUNT > 0)
with that command finds it (``earlier``) and is refused again, in the same line, before anything is built. A new
torchrun asks the coordinator afresh: what was refused may have changed (a flag fixed, the other claimant gone).
Nothing is noted outside torchrun: nothing restarts such a process."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile


def _note(argv: list[str] | None) -> str | None:
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run:
        return None
    key = hashlib.sha256(json.dumps([run, sys.argv[1:] if argv is None else argv]).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"replicas-refused-{os.getuid()}-{key}")


def remember(refusal: str, argv: list[str] | None) -> None:
    """This process's group was refused (``refusal``, its line): noted for a restart of this torchrun, by its local
    rank 0 (written whole: a restart reads all of it or nothing)."""
    path = _note(argv)
    if path is None or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    with open(f"{path}.{os.getpid()}", "w") as f:
        f.write(refusal)
    os.replace(f"{path}.{os.getpid()}", path)


def earlier(argv: list[str] | None) -> str | None:
    """The refusal a previous start of this torchrun (same command) was given, or None (not a restart, or none)."""
    path = _note(argv)
    if path is None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 or not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def exit_if_refused(argv: list[str]) -> None:
    """A restart of a refused group's torchrun (``earlier``), at the script's start, before torch is imported (about
    2 s of every start, and what makes K restarts cost seconds rather than minutes): the same line on rank 0, exit 1,
    as ddp_cifar100.main says a refusal."""
    refusal = earlier(argv)
    if refusal is None:
        return
    if os.environ.get("RANK", "0") == "0":
        print(f"ddp_cifar100.py: error: {refusal}", file=sys.stderr, flush=True)
    sys.exit(1)
