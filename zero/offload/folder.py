"""The offload folder as the group sees it: each rank's store opened there, and the disk's room for what the stage and
its optimizers will keep, each checked with one verdict for every rank ([Note: the same verdict] of zero.checkpoint):
a folder that is missing, read-only, on tmpfs, in use by another live run, or too small for the state is refused in
one line on every rank before any rank writes a byte or enters a collective that another would not.

The room is counted per file system, not per rank: the ranks of one machine share its disk, so each one's need is
summed over the ranks whose folder is on the same device of the same host, and compared with that file system's
free space (``shutil.disk_usage``), naming both sizes.
"""
from __future__ import annotations

import os
import shutil
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

from zero.offload.files import OffloadError, OffloadRefused, folder_problem
from zero.offload.store import Store


def agreed(problem: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise OffloadRefused on every rank of ``group`` if any rank has a problem (the lowest rank's words)."""
    from zero.checkpoint.checks import agree  # torch.distributed.checkpoint's import, only where offload is asked
    problem = agree(problem, group)
    if problem:
        raise OffloadRefused(f"zero.shard(offload=...): {problem}")


def size_text(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def room_problem(folder: str, need: int, group: dist.ProcessGroup | None, what: str) -> str | None:
    """Whether the ranks' ``need`` bytes (each its own) fit the free space of their folders' file systems: the
    problem in words (the first file system short of room), or None. A collective over ``group``."""
    try:
        device, free = os.stat(folder).st_dev, shutil.disk_usage(folder).free
    except OSError:
        device, free = -1, 0
    mine = (socket.gethostname(), device, need, free, os.path.realpath(folder))
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    sums: dict[tuple[str, int], list[Any]] = {}
    for host, dev, their_need, their_free, path in every:
        total = sums.setdefault((host, dev), [0, their_free, path, 0])
        total[0] += their_need
        total[3] += 1
    for (host, _), (total, free_bytes, path, ranks) in sums.items():
        if total > free_bytes:
            return (f"{what}: {size_text(total)} needed in offload folder {path} on {host} ({ranks} rank"
                    f"{'s' if ranks > 1 else ''}), whose file system has {size_text(free_bytes)} free")
    return None


def open_store(folder: str, device: torch.device, group: dist.ProcessGroup | None, need: int,
               **options: Any) -> Store:
    """This rank's store in ``folder`` (its file named by the global rank), once every rank of ``group`` found the
    folder fit, its file free of another live run, and room for ``need`` bytes a rank (the stage's shards)."""
    folder = os.fspath(folder)
    agreed(folder_problem(folder), group)
    store, problem = None, None
    try:
        store = Store(folder, f"rank{dist.get_rank()}.offload", device, **options)
    except OffloadError as error:
        problem = str(error)
    try:
        agreed(problem, group)
        agreed(room_problem(folder, need, group, "the stage's shards"), group)
    except OffloadError:
        if store is not None:
            store.close()
        raise
    return store


def reserve(store: Store, group: dist.ProcessGroup | None, need: int, what: str,
            make: Callable[[], None]) -> None:
    """Room for ``need`` more bytes a rank checked over the group, then ``make()`` run (it creates the slots, which
    reserves their blocks), a failure of it on any rank raised on every rank alike."""
    agreed(room_problem(os.path.dirname(store.file.path), need, group, what), group)
    problem = None
    try:
        make()
    except OffloadError as error:
        problem = str(error)
    agreed(problem, group)
