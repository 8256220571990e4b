"""The offload folder as the group sees it: each rank's store opened there, and the disk's room for what the stage and
its optimizers will keep, each checked with one verdict for every rank ([Note: the same verdict] of zero.checkpoint):
a folder that is missing, read-only, on tmpfs, in use by another live run, or too small for the state is refused in
one line on every rank before any rank writes a byte or enters a collective that another would not.

The room is counted per file system, not per rank: the ranks of one machine share its disk, so each one's need is
summed over the ranks whose folder is on the same device of the same host, and compared with that file system's
free space (``shutil.disk_usage``), naming both sizes. With offload="cpu" (zero/offload/host.py) the room is the
host's available memory, shared by the ranks of the host alike.
"""
from __future__ import annotations

import os
import shutil
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

from zero.offload.files import OffloadError, OffloadFile, OffloadRefused, folder_problem
from zero.offload.host import HostMemory, available_bytes
from zero.offload.store import Store


def agreed(problem: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise OffloadRefused on every rank of ``group`` if any rank has a problem (the lowest rank's words)."""
    from zero.checkpoint.checks import agree  # torch.distributed.checkpoint's import, only where offload is asked
    problem = agree(problem, group)
    if problem:
        raise OffloadRefused(f"zero.shard(offload=...): {problem}")


def size_text(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def disk_room(folder: str) -> tuple[str, int, str, str]:
    """A folder's room, as ``room_problem`` compares it: its file system (the device), its free bytes, in words."""
    try:
        device, free = os.stat(folder).st_dev, shutil.disk_usage(folder).free
    except OSError:
        device, free = -1, 0
    return f"device {device}", free, f"offload folder {os.path.realpath(folder)}", "whose file system has {} free"


def memory_room() -> tuple[str, int, str, str]:
    """The host memory's room (offload="cpu": zero/offload/host.py): what it has available."""
    return "memory", available_bytes(), "host memory", "which has {} available"


def room_problem(room: tuple[str, int, str, str], need: int, group: dist.ProcessGroup | None, what: str) -> str | None:
    """Whether the ranks' ``need`` bytes (each its own) fit the free space of their rooms (``disk_room``,
    ``memory_room``) summed over the ranks of a host that share one: the problem in words (the first room short),
    or None. A collective over ``group``."""
    kind, free, where, said = room
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (socket.gethostname(), kind, need, free, where, said))
    sums: dict[tuple[str, str], list[Any]] = {}
    for host, their_kind, their_need, their_free, their_where, their_said in every:
        total = sums.setdefault((host, their_kind), [0, their_free, their_where, their_said, 0])
        total[0] += their_need
        total[4] += 1
    for (host, _), (total, free_bytes, where, said, ranks) in sums.items():
        if total > free_bytes:
            return (f"{what}: {size_text(total)} needed in {where} on {host} ({ranks} rank{'s' if ranks > 1 else ''}"
                    f"), {said.format(size_text(free_bytes))}")
    return None


def open_store(offload: str, folder: str | None, device: torch.device, group: dist.ProcessGroup | None, need: int,
               **options: Any) -> Store:
    """This rank's store: in ``folder`` (offload="disk": its file named by the global rank), once every rank of
    ``group`` found the folder fit, its file free of another live run, and room for ``need`` bytes a rank (the
    stage's shards); or in host memory (offload="cpu"), once every host has room for its ranks' ``need``."""
    if offload == "cpu":
        agreed(room_problem(memory_room(), need, group, "the stage's shards"), group)
        return Store(HostMemory(f"host memory of rank {dist.get_rank()}", device.type == "cuda"), device, **options)
    folder = os.fspath(folder)
    agreed(folder_problem(folder), group)
    store, problem = None, None
    try:
        store = Store(OffloadFile(folder, f"rank{dist.get_rank()}.offload"), device, **options)
    except OffloadError as error:
        problem = str(error)
    try:
        agreed(problem, group)
        agreed(room_problem(disk_room(folder), need, group, "the stage's shards"), group)
    except OffloadError:
        if store is not None:
            store.close()
        raise
    return store


def reserve(store: Store, group: dist.ProcessGroup | None, need: int, what: str,
            make: Callable[[], None]) -> None:
    """Room for ``need`` more bytes a rank checked over the group, then ``make()`` run (it creates the slots, which
    reserves their blocks), a failure of it on any rank raised on every rank alike."""
    room = memory_room() if store.file.tier == "cpu" else disk_room(os.path.dirname(store.file.path))
    agreed(room_problem(room, need, group, what), group)
    problem = None
    try:
        make()
    except OffloadError as error:
        problem = str(error)
    agreed(problem, group)
