"""Faults on purpose, for the tests of elastic restarts and of fault-tolerant replica groups: a process SIGKILLs itself
at a chosen point of a chosen optimizer step, in one attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT: unset
or 0 for the first, the default), so that the restarted processes run through.

    DDP_CIFAR100_FAULT="RANK:STEP"                      rank RANK, right after optimizer step STEP
    DDP_CIFAR100_FAULT="[GROUP/]RANK:STEP[:POINT[:ATTEMPT]],..."

the second: replica group GROUP's rank RANK (any group's, without GROUP), at POINT, with STEP optimizer steps done
(*: at any step), in torchrun's attempt ATTEMPT (default 0). POINT is one of POINTS: inside the step's forward or
backward, inside the group's own reduce-scatter or all-gather of a bucket (--zero 1-3: the step's first one launched and
not landed, ``watch``), inside the all-reduce across replica groups (its messages launched, not landed), inside the
optimizer's step (the update applied, the step not yet counted), inside it with --offload (its first bucket's state
written behind to the offload file, the others not yet: ``watch``), while this rank sends its live state to a replica
group that joins (half the tensors sent), in --async-checkpoint's writer thread as it starts writing a save (the loop
gone on), while it saves a checkpoint (its files written, the save not yet made current), or after the step (the
default).
One point kills nothing: "nan" makes this rank's loss non-finite in that step's forward (trainer/finite.py's stop).
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any, Callable

ENV = "DDP_CIFAR100_FAULT"
POINTS = ("forward", "backward", "reduce_scatter", "all_gather", "allreduce", "optimizer", "offload", "send", "write",
          "save", "after", "nan")
WATCHED = ("reduce_scatter", "all_gather")  # inside the sync's own collectives (``watch``)


@dataclass(frozen=True)
class Fault:
    group: int | None
    rank: int
    step: int | None  # None: any
    point: str
    attempt: int = 0


def parse(text: str) -> list[Fault]:
    """DDP_CIFAR100_FAULT's faults (module docstring); a malformed one is refused in one line."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            where, _, rest = item.rpartition("/") if "/" in item else ("", "", item)
            rank, step, *point = rest.split(":")
            fault = Fault(int(where) if where else None, int(rank), None if step == "*" else int(step),
                          point[0] if point else "after", int(point[1]) if len(point) > 1 else 0)
        except (ValueError, IndexError):
            raise ValueError(f"{ENV}: {item!r} is not [GROUP/]RANK:STEP[:POINT[:ATTEMPT]]") from None
        if fault.point not in POINTS:
            raise ValueError(f"{ENV}: point {fault.point!r} is not one of {', '.join(POINTS)}")
        faults.append(fault)
    return faults


@dataclass(frozen=True)
class FaultPlan:
    """This process's faults (module docstring), read once at the start: DDP_CIFAR100_FAULT's faults that name its
    rank, its replica group (None: not a replica group's) and torchrun's attempt (TORCHELASTIC_RESTART_COUNT). The
    loop, the checkpointer and the replica groups are given it (trainer/build.py's Parts.faults) and ask it at each
    point; nothing reads the environment again. A plan with no faults answers no to every point."""
    faults: tuple[Fault, ...] = ()

    @classmethod
    def of(cls, rank: int, group: int | None, environ: Any = os.environ) -> FaultPlan:
        """The faults in ``environ`` for this process (a malformed DDP_CIFAR100_FAULT: ValueError, one line)."""
        attempt = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return cls(tuple(fault for fault in parse(environ.get(ENV, "")) if fault.rank == rank
                         and fault.group in (None, group) and fault.attempt == attempt))

    def named(self, point: str, step: int) -> bool:
        """Whether a fault of this plan is at ``point`` with ``step`` optimizer steps done."""
        return any(fault.point == point and fault.step in (None, step) for fault in self.faults)

    def at(self, point: str, step: int) -> None:
        """SIGKILL this process where the plan names this point of this step."""
        if self.named(point, step):
            os.kill(os.getpid(), signal.SIGKILL)

    def watch(self, sync: Any, steps: Callable[[], int]) -> None:
        """Where the plan names a point inside the sync's own collectives (WATCHED), have the sync's
        collectives.Collectives (``sync.comm``; PyTorch's syncs have none) call ``at`` as each one is launched (its
        ``launched`` hook); where it names "offload", have the sync's offload store (zero/offload/) call it as each
        write of the optimizer's state is asked for (its ``on_put`` hook). ``steps()``: the optimizer steps
        done."""
        points = {fault.point for fault in self.faults}
        store, comm = getattr(sync, "store", None), getattr(sync, "comm", None)
        if store is not None and "offload" in points:
            store.on_put = lambda name: self.at("offload", steps()) if name[0] == "state" else None
        if comm is not None and points & set(WATCHED):
            comm.launched = lambda kind: self.at(kind, steps()) if kind in WATCHED else None
