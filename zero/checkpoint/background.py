"""Saves written in the background: the loop pauses only to copy this rank's state into staging buffers, and a writer
thread writes the copy (a DCP folder's pieces, or one file of whole state dicts) while the loop goes on.

    writer = zero.checkpoint.AsyncWriter()
    pending = zero.checkpoint.save(path, sync, optimizer, extra, writer=writer)   # returns once staged
    writer.then(publish)      # optional: runs in the writer thread once the write is done (not if it failed)
    ...                       # train on
    writer.wait()             # the last save written (and published), or its error as CheckpointError

The stall of a save is the copy: this rank's bytes (12 Psi / W for AdamW at stage 3: the weights and two moments)
read once from the live state and written once into the buffers, against the synchronous save's serialization and
write of the same bytes. The buffers are kept from save to save (one extra copy of the rank's state, however many
saves: a tensor's buffer is reused where its shape, dtype and strides hold, and one no longer saved is dropped), and
they are pinned host memory where the state is on a GPU (the copy is a DMA the host waits for once, not a pageable
round trip per tensor).

[Note: one save in flight] A save asked for while the previous one is still writing waits for it first (the caller
counts the wait as stall), so at most one copy is staged and one write is under way: the buffers being written are
never overwritten. The writer is one thread: DCP's planning and its exchange of the written files' list run there,
over a gloo group of the same ranks made for the writer alone (the loop's collectives run on the loop's group
meanwhile; two threads issuing collectives on one group would pair them in a different order on each rank). Its work
is serialization and file I/O, which release the GIL for the bytes; the loop's kernels release it too.

[Note: thread, not process] A writer process (DCP's AsyncCheckpointerType.PROCESS) takes the GIL out of the picture,
but the staged copy must then cross into it (shared memory: a second copy, or buffers allocated in shared memory from
the start), and it holds a Python and torch of its own (~300-400 MB per rank). On a GPU node the loop's host thread
mostly launches kernels and waits, so a thread's GIL share costs little; on this 2-core CPU machine every process
already competes for the same two cores. benchmarks/checkpoint_benchmark.py measures both (DCP's thread and process
writers beside ours).

Crash safety is the format's: a folder is written as DIR/step-N.partial and published by the caller's ``then``
(trainer/checkpoint/folders.py renames it and points DIR/latest at it), a file is written to a temporary name and
renamed (zero/checkpoint/whole.py): a process killed while its writer writes leaves the previous checkpoint current
and whole.
"""
from __future__ import annotations

import copy
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist

from utils import one_line
from zero.checkpoint.checks import CheckpointError
from zero.pieces import Shards


class StagingBuffers:
    """Host copies of a rank's state, kept from save to save: ``stage`` returns the state with every tensor (and every
    piece of a Shards) replaced by a copy in a buffer of its own, and every other leaf deep-copied (param_groups'
    rates, the extra's numbers: the loop changes them meanwhile)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def stage(self, state: Any) -> Any:
        used: set[tuple[Any, ...]] = set()  # the keys of this save's tensors
        staged = self._stage(state, (), used)
        if any(self.buffers[key].is_pinned() for key in used):  # copies launched non-blocking from a GPU: wait once
            torch.cuda.synchronize()
        for key in set(self.buffers) - used:  # no longer saved: not kept
            del self.buffers[key]
        return staged

    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers.values())

    def _stage(self, value: Any, key: tuple[Any, ...], used: set[tuple[Any, ...]]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy(key, value, used)
        if isinstance(value, Shards):
            return Shards(value.shape, value.dtype, value.order,
                          [(start, end, self._copy((*key, i), values, used))
                           for i, (start, end, values) in enumerate(value.pieces)])
        if type(value) is dict:
            return {name: self._stage(item, (*key, name), used) for name, item in value.items()}
        if type(value) in (list, tuple):
            return type(value)(self._stage(item, (*key, i), used) for i, item in enumerate(value))
        return copy.deepcopy(value)

    def _copy(self, key: tuple[Any, ...], tensor: torch.Tensor, used: set[tuple[Any, ...]]) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype \
                or buffer.stride() != tensor.stride():
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
            self.buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        used.add(key)
        return buffer


class AsyncWriter:
    """One background writer of checkpoints (module docstring): its staging buffers, its thread, and the gloo group
    its thread exchanges DCP's plans over. Every rank of the group that saves makes one and passes it to every save;
    ``close`` when done."""

    def __init__(self) -> None:
        self.staging = StagingBuffers()
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()  # (future, task), or None to stop
        # a daemon: a run that fails while its writer waits on a dead peer exits without waiting for it (a
        # ThreadPoolExecutor's thread would be joined at exit)
        self.thread = threading.Thread(target=self._work, name="checkpoint-writer", daemon=True)
        self.thread.start()
        self.pending: Future | None = None  # the last task submitted (a write, or a ``then`` after it)
        self.groups: dict[Any, dist.ProcessGroup] = {}
        self.lock = threading.Lock()
        self.before_write: Callable[[], Any] | None = None  # run in the thread before each write (a test's fault)

    # the loop's side
    def stage(self, state: Any) -> Any:
        """Wait for the save in flight (its error raised here: [Note: one save in flight]), then copy ``state``."""
        self.wait()
        return self.staging.stage(state)

    def submit(self, task: Callable[[], Any]) -> Future:
        """``task`` to the writer thread, after what is already there; its future is the writer's pending one."""
        future: Future = Future()
        with self.lock:
            self.pending = future
            self.tasks.put((future, task))
        return future

    def _work(self) -> None:
        while (item := self.tasks.get()) is not None:
            future, task = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(task())
            except BaseException as error:  # noqa: BLE001 - the loop reads it from the future
                future.set_exception(error)

    def write(self, task: Callable[[], Any]) -> Future:
        """A write of staged state to the thread (``before_write`` first, in the thread)."""
        hook = self.before_write

        def run() -> Any:
            if hook is not None:
                hook()
            return task()
        return self.submit(run)

    def adopt(self, future: Future) -> Future:
        """Another writer's save (DCP's async_save) as the pending one: waited for, and followed by ``then``, alike."""
        with self.lock:
            self.pending = future
            return future

    def then(self, callback: Callable[[], Any]) -> Future:
        """``callback`` in the writer thread once the pending write is done, and only if it succeeded (a failed
        write is never published)."""
        before = self.pending

        def after() -> Any:
            if before is not None:
                before.result()  # its error, carried on
            return callback()
        return self.submit(after)

    def error(self) -> BaseException | None:
        """The error of the last save, if it is done and failed (the loop polls it; it does not wait)."""
        pending = self.pending
        if pending is None or not pending.done():
            return None
        return pending.exception()

    def wait(self) -> None:
        """The pending save done (written, and published if a ``then`` was given); its error raised as one line."""
        pending = self.pending
        if pending is None:
            return
        try:
            pending.result()
        except CheckpointError:
            raise
        except Exception as error:  # noqa: BLE001 - the writer's failure (the disk, DCP), said in one line
            raise CheckpointError(f"zero.checkpoint: the background save failed: {one_line(error)}") from None
        finally:
            with self.lock:
                if self.pending is pending:
                    self.pending = None

    def writer_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The writer's own gloo group over ``group``'s ranks (made once, by every rank of ``group``, in the
        loop's thread); None in a world of one process."""
        if not dist.is_initialized():
            return None
        if group not in self.groups:
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            self.groups[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=ranks is not None)
        return self.groups[group]

    def close(self, wait: bool = True) -> None:
        """The thread stopped; with ``wait``, after the pending save (its error raised). Without: a run that failed
        leaves its write as it is (the previous checkpoint stays current)."""
        try:
            if wait:
                self.wait()
        finally:
            self.tasks.put(None)
            if wait:
                self.thread.join()  # the thread is done with its groups (a failed run's process exits with them)
                for group in self.groups.values():
                    if group is not None and dist.is_initialized():
                        dist.destroy_process_group(group)
            self.groups.clear()
