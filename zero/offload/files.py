"""The offload file: one per rank under ``offload_dir``, holding that rank's offloaded tensors in slots, each read and
written whole by a background I/O thread (``os.preadv`` / ``os.pwritev``: zero/offload/store.py has one that reads
and one that writes), with O_DIRECT where the file system takes it, and each slot's bytes checked on every read
against the CRC32C taken when they were written.

Why O_DIRECT: a buffered write leaves its pages in the page cache, which a memory limit counts (a cgroup's, as the
kernel charges the page cache to the group that dirtied it) and which competes with the training for the machine's
memory; O_DIRECT moves the bytes between the disk and the process's own buffers, so the offloaded state takes no
memory at all. Its price is alignment: the buffer's address, the file offset and the length must be multiples of
the device's logical block size. Every slot therefore starts at a multiple of ALIGN (4096: a page, which every
block size divides) and is read and written in whole ALIGN units (its ``capacity``), into buffers aligned the same
way (``aligned_empty``). Where the file system refuses O_DIRECT (tmpfs is refused before that: it is memory), the
file is written through the page cache, and each slot's pages are dropped after it is read or written
(``posix_fadvise(DONTNEED)``): clean pages at once, dirty ones once the kernel has written them back.

[Note: one run per file] Each rank's file is locked (``flock``, exclusive) before anything is written to it, and the
lock is the kernel's: it goes with the process, so a run killed by SIGKILL leaves a file the next run may take, and a
second live run given the same folder is refused in one line instead of writing over the first one's state. The
file is scratch: it holds what the run holds between its steps, never a checkpoint, and is removed by ``close``.

[Note: checksums] A slot's CRC32C is taken from the bytes as they go to the disk and checked on every read, so a
file truncated, or flipped by anything between a write and the next read, stops the run in one line naming the file
and the slot, before a wrong value reaches a step. CRC32C rather than torch.save's CRC32: the same guarantee (every
burst error of up to 32 bits, any odd number of flipped bits), and the CPU has an instruction for it (the crc32c
package, on the I/O threads with the GIL released): 9.7 GB/s on this VM's cores against zlib's CRC32 at 2.4-3.1 GB/s,
which at GPT-2 large's 13 GB a rank and step cost 4-5 s of a core that the training's compute shares.
"""
from __future__ import annotations

import errno
import fcntl
import os
import threading
from dataclasses import dataclass

import crc32c
import torch

ALIGN = 4096  # bytes: a slot's offset, length and buffer address are multiples of it (O_DIRECT's alignment)
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")  # an offload there keeps the state in memory, where it was

# errno -> words, as zero/checkpoint/disk.py names a full disk or a read-only folder
NAMED = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
         errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EPERM: "permission denied"}


class OffloadError(RuntimeError):
    """An offload folder or file that cannot hold the run's state, or whose bytes changed under it: one line, naming
    the folder or the file."""


class OffloadRefused(OffloadError):
    """The folder refused before anything was written, with one verdict on every rank of the group (zero/offload/
    folder.py): the same line everywhere, for the caller to say once."""


def words(error: OSError) -> str:
    return NAMED.get(error.errno) or (error.strerror or os.strerror(error.errno or 0)).lower()


def round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of ``round_up(nbytes)`` bytes whose address is a multiple of ALIGN (torch's CPU allocator
    aligns to 64 bytes: the rest is cut off a larger block); pinned for a GPU's copies where ``pin``."""
    capacity = round_up(nbytes)
    raw = torch.empty(capacity + ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + capacity]


def file_system(path: str) -> str:
    """The type of the file system ``path`` is on (the longest mount point above it in /proc/mounts), or ''."""
    path, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return ""
    return kind


def folder_problem(folder: str) -> str | None:
    """What makes ``folder`` unfit to hold offloaded state, in words, or None: missing, not a folder, not writable,
    or memory (tmpfs)."""
    if not os.path.exists(folder):
        return f"offload folder {folder} does not exist"
    if not os.path.isdir(folder):
        return f"offload folder {folder} is not a folder"
    kind = file_system(folder)
    if kind in MEMORY_FILE_SYSTEMS:
        return (f"offload folder {folder} is on {kind}, which is memory: the state would stay in memory, where it "
                f"was; give a folder on a disk")
    if not os.access(folder, os.W_OK | os.X_OK):
        reason = "read-only file system" if read_only(folder) else "permission denied"
        return f"offload folder {folder} is not writable ({reason})"
    return None


def read_only(folder: str) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


@dataclass
class Slot:
    """A tensor's place in the file: ``nbytes`` of data at ``offset``, read and written as ``capacity`` bytes (whole
    ALIGN units); ``crc``: the CRC32C of the data last written (None: never written, so nothing to read)."""
    name: str
    offset: int
    nbytes: int
    capacity: int
    crc: int | None = None


class OffloadFile:
    """One rank's offload file (module docstring): slots allocated one after another, each ALIGN-aligned and reserved
    on the disk at once (``posix_fallocate``: a full disk is found when a slot is made, not in the middle of a
    step), read and written whole by the caller's I/O threads."""

    tier = "disk"  # offload="disk" (zero/offload/host.py's HostMemory: "cpu")

    def __init__(self, folder: str, name: str):
        self.path = os.path.join(folder, name)
        self.label = f"offload file {self.path}"
        self.direct = True
        self.fd = self._open(os.O_DIRECT)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # [Note: one run per file], before truncating
        except OSError:
            os.close(self.fd)
            raise OffloadError(f"offload file {self.path} is in use by another live run: give each run its own "
                               f"--offload-dir") from None
        os.ftruncate(self.fd, 0)
        if not self._direct_works():
            os.close(self.fd)
            self.direct, self.fd = False, self._open(0)
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.size = 0  # bytes allocated
        self.lock = threading.Lock()  # allocate() from the main thread while the I/O threads read and write

    def _open(self, extra: int) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | extra, 0o600)
        except OSError as error:
            if extra and error.errno == errno.EINVAL:  # a file system without O_DIRECT
                self.direct = False
                return self._open(0)
            raise OffloadError(f"cannot open offload file {self.path}: {words(error)}") from None

    def _direct_works(self) -> bool:
        """Whether an aligned O_DIRECT write and read of one ALIGN unit work here (some file systems take the flag
        at open and refuse it at the first transfer)."""
        if not self.direct:
            return False
        probe = aligned_empty(ALIGN)
        try:
            os.pwritev(self.fd, [memoryview(probe.numpy())], 0)
            os.preadv(self.fd, [memoryview(probe.numpy())], 0)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise OffloadError(f"cannot write offload file {self.path}: {words(error)}") from None
            return False
        finally:
            os.ftruncate(self.fd, 0)
        return True

    def allocate(self, name: str, nbytes: int) -> Slot:
        """A new slot of ``nbytes`` at the file's end, its blocks reserved on the disk now."""
        with self.lock:
            slot = Slot(name, self.size, nbytes, round_up(nbytes))
            try:
                if slot.capacity:
                    os.posix_fallocate(self.fd, slot.offset, slot.capacity)
            except OSError as error:
                raise OffloadError(f"cannot grow offload file {self.path} to {self.size + slot.capacity:,} bytes "
                                   f"for {name}: {words(error)}") from None
            self.size += slot.capacity
            return slot

    def write(self, slot: Slot, buffer: torch.Tensor) -> None:
        """``buffer`` (uint8, ALIGN-aligned, at least the slot's capacity) into the slot, its CRC32C kept: on the I/O
        thread."""
        view = memoryview(buffer[:slot.capacity].numpy())
        crc = crc32c.crc32c(view[:slot.nbytes])
        self._check_size(slot)
        try:
            self._transfer(os.pwritev, view, slot)
        except OSError as error:
            raise OffloadError(f"cannot write {slot.name} to offload file {self.path}: {words(error)}") from None
        slot.crc = crc
        self._drop_cached(slot)

    def read(self, slot: Slot, buffer: torch.Tensor) -> None:
        """The slot into ``buffer``, its CRC32C checked ([Note: checksums]): on the reading thread."""
        if slot.crc is None:
            raise OffloadError(f"offload file {self.path}: {slot.name} was never written, so it cannot be read")
        view = memoryview(buffer[:slot.capacity].numpy())
        self._check_size(slot)
        try:
            done = self._transfer(os.preadv, view, slot)
        except OSError as error:
            raise OffloadError(f"cannot read {slot.name} from offload file {self.path}: {words(error)}") from None
        if done < slot.nbytes:
            raise OffloadError(f"offload file {self.path} was cut short under the run: {slot.name} ends at byte "
                               f"{slot.offset + slot.nbytes:,}, the file at {slot.offset + done:,}")
        crc = crc32c.crc32c(view[:slot.nbytes])
        if crc != slot.crc:
            raise OffloadError(f"offload file {self.path} changed under the run: {slot.name} (bytes "
                               f"{slot.offset:,}-{slot.offset + slot.nbytes:,}) fails its checksum (CRC32C "
                               f"{crc:#010x}, written {slot.crc:#010x})")
        self._drop_cached(slot)

    def _check_size(self, slot: Slot) -> None:
        """The file is as long as its slots (``allocate`` reserved them all): shorter, it was cut under the run (a
        write past the cut would grow it again over a hole of zeros, so it is looked at before every transfer)."""
        expected = self.size  # before the file's size: the main thread grows both, the file first
        size = os.fstat(self.fd).st_size
        if size < expected:
            raise OffloadError(f"offload file {self.path} was cut short under the run: it ends at byte {size:,}, "
                               f"its slots at {expected:,} ({slot.name} next)")

    def _transfer(self, call, view: memoryview, slot: Slot) -> int:
        """The whole slot through ``call`` (preadv or pwritev), which may move fewer bytes than asked; the bytes
        moved (fewer than the capacity only at the file's end: a read of a file cut short)."""
        done = 0
        while done < slot.capacity:
            moved = call(self.fd, [view[done:]], slot.offset + done)
            if moved == 0:
                break
            done += moved
        return done

    def _drop_cached(self, slot: Slot) -> None:
        """Without O_DIRECT: the slot's pages out of the page cache (dirty ones once written back)."""
        if not self.direct:
            os.posix_fadvise(self.fd, slot.offset, slot.capacity, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """The file removed, then closed (and so unlocked): no other run can take it in between."""
        if self.fd < 0:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1
