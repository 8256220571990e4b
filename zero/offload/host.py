"""Offload to host memory (``offload="cpu"``): the offload file's slots (zero/offload/files.py) kept in the host's
memory instead of a disk, pinned where the model is on a GPU, so that the same store (zero/offload/store.py), the
same streamed step and the same checkpoints (zero/offload/shards.py, slots.py) move a GPU's state to the host and back
instead of to a disk: ZeRO-Offload's placement, where a GPU's memory is what runs short and the host has room.

What moves is what ``offload="disk"`` moves (the optimizer's state, and at stage 3 the weights' and gradients'
shards); the I/O threads copy a slot into a staging buffer and back (host memory's bandwidth, 5-20 GB/s, against a
disk's 1-2), and on a GPU the store copies the staging buffer to the device. The step runs where the model is, as with
the disk: ZeRO-Offload's other half, the step itself on the host's cores (its CPU Adam), is not what this tier does.
On a CPU device the slots are host memory as the model is: the tier then only copies, bit for bit as ever, which
makes it testable without a GPU, and saves no memory.

A slot is never read before it is written (the store's ``put_once``), so it holds no checksum: memory is not a file
that another process truncates or flips between a write and a read.
"""
from __future__ import annotations

import threading

import torch

from utils import one_line
from zero.offload.files import OffloadError, Slot, round_up


def available_bytes() -> int:
    """The host's MemAvailable (/proc/meminfo): what can be allocated without swapping out or dropping anyone's
    page cache the kernel would keep."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class HostMemory:
    """One rank's slots in host memory, with the offload file's interface (``allocate``, ``write``, ``read``,
    ``size``, ``close``): each slot its own tensor of whole ALIGN units, pinned when ``pin``."""

    tier = "cpu"  # offload="cpu"
    direct = False  # (the disk's O_DIRECT: no disk here)

    def __init__(self, label: str, pin: bool):
        self.label = label
        self.pin = pin
        self.slots: dict[int, torch.Tensor] = {}  # offset -> its bytes
        self.size = 0
        self.lock = threading.Lock()  # allocate() from the main thread while the I/O threads copy

    def allocate(self, name: str, nbytes: int) -> Slot:
        with self.lock:
            slot = Slot(name, self.size, nbytes, round_up(nbytes))
            try:
                self.slots[slot.offset] = torch.empty(slot.capacity, dtype=torch.uint8, pin_memory=self.pin)
            except RuntimeError as error:  # (pinned memory the driver would not give)
                raise OffloadError(f"cannot keep {name} ({slot.capacity:,} bytes) in {self.label}: "
                                   f"{one_line(error)}") from None
            self.size += slot.capacity
            return slot

    def write(self, slot: Slot, buffer: torch.Tensor) -> None:
        self.slots[slot.offset].copy_(buffer[:slot.capacity])

    def read(self, slot: Slot, buffer: torch.Tensor) -> None:  # (only once written: the store's take and prefetch)
        buffer[:slot.capacity].copy_(self.slots[slot.offset])

    def close(self) -> None:
        self.slots.clear()
