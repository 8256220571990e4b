"""The store: a rank's offloaded tensors by name, kept in its offload file (zero/offload/files.py) and brought into
memory only while a stage uses them, through a few reusable buffers, by two background I/O threads.

    store = Store(OffloadFile(folder, "rank0.offload"), device)   # or HostMemory (zero/offload/host.py)
    store.create(("weights", 3), numel, torch.float32)   # a slot in the file, reserved on the disk
    tensor = store.fresh(("weights", 3))                  # a buffer for it, to fill ...
    store.put(("weights", 3), tensor)                     # ... and write behind: the tensor is the store's again
    store.prefetch(("weights", 3))                        # read ahead, while the caller computes
    tensor = store.take(("weights", 3))                   # its values (waits for the read-ahead, or reads now)
    store.discard(tensor)                                 # given back unwritten (read only, or dead values)

[Note: the I/O threads] Two threads (ThreadPoolExecutors of one worker each) move the bytes: one reads, one writes,
each in the order asked, so that a read the compute will wait for never queues behind the writes of what it already
finished (at GPT-2 large's shape, one thread for both made each rank wait 4 s a step on its reads). A read asked
while a write of the same slot is in flight waits for that write first, so it reads what was written; a read-ahead
asked before a write is dropped by ``put`` (its bytes are the old ones). The caller's thread alone hands out and
takes back buffers: a write's buffer goes back to the pool when the caller next looks (``_reap``), where a failed
write's error is raised too, so every error of the disk reaches the training loop, in one line (OffloadError), at
its next use of the store. Writes in flight are bounded (``write_behind_bytes``): past it ``put`` waits for the
oldest, so a disk slower than the compute holds the compute back rather than filling memory with buffers.

Buffers are ALIGN-aligned (O_DIRECT's), pooled by size (a model's buckets come in few sizes: the blocks'), and on a
CPU device a tensor handed out is a view of its buffer: the disk's bytes land where the step reads them. On a GPU
the buffer stages the bytes (pinned) and the tensor handed out is a device copy.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from zero.offload.files import OffloadError, OffloadFile, Slot, aligned_empty, round_up
from zero.offload.host import HostMemory


def slot_text(name: Hashable) -> str:
    """A slot's name in words, for errors: ("weights", 3) -> "weights 3"; ("state", 0, 3, "exp_avg") ->
    "optimizer 0's exp_avg of bucket 3"."""
    if isinstance(name, tuple) and name and name[0] == "state":
        _, optimizer, bucket, key = name
        return f"optimizer {optimizer}'s {key} of bucket {bucket}"
    if isinstance(name, tuple) and len(name) == 2:
        return f"{name[0]} of bucket {name[1]}"
    return str(name)


@dataclass
class Entry:
    """A named tensor: its slot in the file, and its dtype and length."""
    slot: Slot
    dtype: torch.dtype
    numel: int


@dataclass
class Traffic:
    """What the store moved and what it cost the caller's thread: bytes read and written, and the seconds the caller
    waited on a read (not read ahead in time) or on a write (``write_behind_bytes`` full)."""
    read_bytes: int = 0
    written_bytes: int = 0
    read_wait_s: float = 0.0
    write_wait_s: float = 0.0
    reads: int = 0
    writes: int = 0
    log: list[tuple[float, str, int, float]] = field(default_factory=list)  # traced: (end, "read" | "write",
    # bytes, start), perf_counter() times


class Store:
    """A rank's named offloaded tensors (module docstring). ``file``: where their bytes are kept (an offload file, or
    host memory); ``device``: where the tensors handed out live; ``write_behind_bytes``: the most bytes of writes in
    flight before ``put`` waits."""

    def __init__(self, file: OffloadFile | HostMemory, device: torch.device | str = "cpu",
                 write_behind_bytes: int = 512 * 2**20, trace: bool = False):
        self.file = file
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.entries: dict[Hashable, Entry] = {}
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-offload-read")
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-offload-write")
        self.last_write: dict[Hashable, Future] = {}  # each name's latest write, until it is done
        self.free: dict[int, list[torch.Tensor]] = {}  # capacity -> buffers not in use
        self.lent: dict[int, torch.Tensor] = {}  # data_ptr of a tensor handed out on the CPU -> its buffer
        self.ahead: dict[Hashable, Future] = {}  # reads asked ahead, by name; each gives its buffer
        self.writing: deque[tuple[Future, torch.Tensor, int]] = deque()  # (write, its buffer, bytes), oldest first
        self.put_once: set[Hashable] = set()  # the names with values: written, or being written
        self.write_behind_bytes = write_behind_bytes
        self.traffic = Traffic()
        self.trace = trace
        self.buffer_bytes = 0  # every buffer made, free or in use (what the store costs in memory)
        self.closed = False
        self.on_put: Callable[[Hashable], None] | None = None  # told each name put, once its write is asked for

    # ------------------------------------------------------------------------------------------------------
    # Slots
    # ------------------------------------------------------------------------------------------------------
    def create(self, name: Hashable, numel: int, dtype: torch.dtype) -> None:
        """A slot for ``numel`` elements of ``dtype`` under ``name`` (not yet written)."""
        assert name not in self.entries, name
        nbytes = numel * dtype.itemsize
        self.entries[name] = Entry(self.file.allocate(slot_text(name), nbytes), dtype, numel)

    def ensure(self, name: Hashable, numel: int, dtype: torch.dtype) -> None:
        """A slot for ``name`` of this length and dtype: the one it has, or a new one (its values forgotten)."""
        entry = self.entries.get(name)
        if entry is not None and (entry.numel, entry.dtype) == (numel, dtype):
            return
        self.entries.pop(name, None)
        self.forget(name)
        self.create(name, numel, dtype)

    def __contains__(self, name: Hashable) -> bool:
        return name in self.entries

    def written(self, name: Hashable) -> bool:
        """Whether ``name`` has values to read (a write of it asked for)."""
        return name in self.put_once

    def stored_bytes(self) -> int:
        return self.file.size

    # ------------------------------------------------------------------------------------------------------
    # Tensors handed out and taken back
    # ------------------------------------------------------------------------------------------------------
    def fresh(self, name: Hashable) -> torch.Tensor:
        """A tensor for ``name``'s slot, its values undefined: to be filled and ``put``."""
        self._reap()
        entry = self.entries[name]
        buffer = self._buffer(entry.slot.capacity)
        if self.device.type == "cpu":
            return self._lend(buffer, entry)
        tensor = torch.empty(entry.numel, dtype=entry.dtype, device=self.device)
        self._give_back(buffer)
        return tensor

    def prefetch(self, name: Hashable) -> None:
        """Read ``name`` ahead (nothing if already asked, or if never written)."""
        if name in self.ahead or not self.written(name):
            return
        entry = self.entries[name]
        buffer = self._buffer(entry.slot.capacity)
        self.ahead[name] = self.reader.submit(self._read, entry.slot, buffer, self.last_write.get(name))

    def take(self, name: Hashable) -> torch.Tensor:
        """``name``'s values: its read-ahead waited for, or read now."""
        self._reap()
        self.prefetch(name)
        if name not in self.ahead:
            raise OffloadError(f"{self.file.label}: {slot_text(name)} was never written, so it cannot "
                               f"be read")
        future = self.ahead.pop(name)
        start = time.perf_counter()
        buffer = future.result()
        self.traffic.read_wait_s += time.perf_counter() - start
        entry = self.entries[name]
        if self.device.type == "cpu":
            return self._lend(buffer, entry)
        tensor = torch.empty(entry.numel, dtype=entry.dtype, device=self.device)
        tensor.copy_(self._typed(buffer, entry))
        self._give_back(buffer)
        return tensor

    def put(self, name: Hashable, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (of ``name``'s length and dtype) behind; it is the store's from now on: the caller drops
        it. A read-ahead of ``name`` asked before this is dropped (it reads the old bytes)."""
        entry = self.entries[name]
        assert tensor.numel() == entry.numel and tensor.dtype == entry.dtype, (name, tensor.shape, tensor.dtype)
        stale = self.ahead.pop(name, None)
        if stale is not None:
            self._give_back(stale.result())
        buffer = self.lent.pop(tensor.data_ptr(), None) if self.device.type == "cpu" else None
        if buffer is None:  # a device tensor, or one the store did not hand out: through a buffer of its own
            buffer = self._buffer(entry.slot.capacity)
            self._typed(buffer, entry).copy_(tensor.reshape(-1))
        write = self.writer.submit(self._write, entry.slot, buffer)
        self.writing.append((write, buffer, entry.slot.capacity))
        self.last_write[name] = write
        self.put_once.add(name)
        if self.on_put is not None:
            self.on_put(name)
        self._bound_writes()

    def forget(self, name: Hashable) -> None:
        """``name``'s values are dead (a gradient zero_grad() let go of): nothing to read until it is put again."""
        self.put_once.discard(name)
        stale = self.ahead.pop(name, None)
        if stale is not None:
            self._give_back(stale.result())

    def discard(self, tensor: torch.Tensor) -> None:
        """A tensor handed out, given back unwritten."""
        buffer = self.lent.pop(tensor.data_ptr(), None)
        if buffer is not None:
            self._give_back(buffer)

    def flush(self) -> None:
        """Every write asked for done (its error raised here, if any)."""
        while self.writing:
            self._finish_oldest_write()

    def close(self) -> None:
        """Every read and write finished or dropped, the I/O threads stopped, the file removed."""
        if self.closed:
            return
        self.closed = True
        for future in self.ahead.values():
            future.cancel()
        self.reader.shutdown(wait=True)
        self.writer.shutdown(wait=True)
        self.ahead.clear()
        self.writing.clear()
        self.free.clear()
        self.lent.clear()
        self.file.close()

    # ------------------------------------------------------------------------------------------------------
    # On the I/O threads
    # ------------------------------------------------------------------------------------------------------
    def _read(self, slot: Slot, buffer: torch.Tensor, after: Future | None) -> torch.Tensor:
        if after is not None:  # a write of this slot in flight: read what it writes
            after.result()
        start = time.perf_counter()
        self.file.read(slot, buffer)
        self._count("read", slot.capacity, start)
        return buffer

    def _write(self, slot: Slot, buffer: torch.Tensor) -> None:
        start = time.perf_counter()
        self.file.write(slot, buffer)
        self._count("write", slot.capacity, start)

    def _count(self, kind: str, nbytes: int, start: float) -> None:
        if kind == "read":
            self.traffic.read_bytes += nbytes
            self.traffic.reads += 1
        else:
            self.traffic.written_bytes += nbytes
            self.traffic.writes += 1
        if self.trace:
            self.traffic.log.append((time.perf_counter(), kind, nbytes, start))

    # ------------------------------------------------------------------------------------------------------
    # Buffers (the caller's thread alone)
    # ------------------------------------------------------------------------------------------------------
    def _buffer(self, capacity: int) -> torch.Tensor:
        free = self.free.get(capacity)
        if free:
            return free.pop()
        self.buffer_bytes += round_up(capacity)
        return aligned_empty(capacity, pin=self.pin)

    def _give_back(self, buffer: torch.Tensor) -> None:
        self.free.setdefault(buffer.numel(), []).append(buffer)

    @staticmethod
    def _typed(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
        return buffer[:entry.numel * entry.dtype.itemsize].view(entry.dtype)

    def _lend(self, buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
        tensor = self._typed(buffer, entry)
        self.lent[tensor.data_ptr()] = buffer
        return tensor

    def _reap(self) -> None:
        """Writes done: their buffers back to the pool, their errors raised."""
        while self.writing and self.writing[0][0].done():
            self._finish_oldest_write()

    def _finish_oldest_write(self) -> None:
        future, buffer, _ = self.writing[0]
        start = time.perf_counter()
        try:
            future.result()
        finally:
            self.traffic.write_wait_s += time.perf_counter() - start
            self.writing.popleft()
            self._give_back(buffer)
            for name in [name for name, write in self.last_write.items() if write is future]:
                del self.last_write[name]

    def _bound_writes(self) -> None:
        while sum(nbytes for _, _, nbytes in self.writing) > self.write_behind_bytes:
            self._finish_oldest_write()
        self._reap()
