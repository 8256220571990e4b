"""The keys of quorums long decided, deleted by the coordinator off its lighthouse's loop (coordinator.py).

Each quorum leaves G + 4 keys in the store (its quorum, members, votes and decision keys, and the answer to each
member's ticket), which would otherwise grow the store by a few keys a group and a step. TCPStore deletes one key a
call, and each call is a round trip to the store's server: done on the lighthouse's loop, the deletions of quorum
n - 2 held up quorum n + 1 (at 512 simulated groups on this 2-core VM, 2/3 of the loop's time: a quorum took 4.3 s
to form, ``python -m benchmarks.coordinator_benchmark``). So a thread with a store client of its own deletes them, in
the order they were decided, after saying so first (``forgotten``: a member stopped while waiting for them reads it,
Replica._deleted and Replica._forgotten)."""
from __future__ import annotations

import queue
import threading
from typing import Any

from replicas.protocol import PREFIX


def forget(store: Any, n: int, tickets: list[str]) -> None:
    """Quorum n's keys out of the store, ``forgotten`` set to n first."""
    store.set(PREFIX + "forgotten", str(n))
    for key in (f"quorum/{n}", f"members/{n}", f"votes/{n}", f"decision/{n}", *(f"ticket/{t}" for t in tickets)):
        store.delete_key(PREFIX + key)


class Forgetter:
    """``forget`` on a thread of its own, over a clone of the coordinator's store client; ``close`` deletes what is
    still queued, then stops."""

    def __init__(self, store: Any):
        self.store = store.clone()
        self.queue: queue.Queue[tuple[int, list[str]] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="replica-forgetter", daemon=True)
        self.thread.start()

    def __call__(self, n: int, tickets: list[str]) -> None:
        self.queue.put((n, tickets))

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            try:
                forget(self.store, *item)
            except RuntimeError:  # the store is gone (the coordinator stopping): nothing left to forget
                return

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
