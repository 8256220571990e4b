"""glibc's allocator, whose settings decide what a memory figure says: when it gives a freed block back to the system
(its mmap threshold, which it raises by itself unless pinned) and how much it keeps at its heap's top. Off glibc
each setter says it did not take."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TOP_PAD, M_MMAP_THRESHOLD = -2, -3  # glibc's mallopt parameters (malloc.h)


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library this process runs on (None where it cannot be loaded): glibc's malloc's knobs and figures."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def pin_mmap_threshold(nbytes: int = 128 * 1024) -> bool:
    """glibc's malloc: serve every block of ``nbytes`` or more by mmap, so a freed one goes back to the system at
    once, and stop the threshold from rising (glibc raises it to the size of the first such block freed, up to
    32 MB, after which blocks of that size stay in the heap when freed and the resident set reports the allocator's
    history). What MALLOC_MMAP_THRESHOLD_=131072 does when set before the process starts. Returns whether it took
    (False off glibc)."""
    return _mallopt(M_MMAP_THRESHOLD, nbytes)


def pad_heap_top(nbytes: int) -> bool:
    """glibc's malloc: grow the heap by ``nbytes`` more than a request needs, and keep as much free at its top when
    it trims. A block past the mmap threshold is then served from the heap's top while the top has room, instead of
    by a fresh mmap that the kernel faults in page by page and that is unmapped again when freed (what every such
    block costs under pin_mmap_threshold, once the top is trimmed). The resident set keeps up to ``nbytes`` of freed
    memory: not for runs that measure it. Like pin_mmap_threshold, it also stops glibc from raising the threshold.
    What MALLOC_TOP_PAD_ does when set before the process starts. Returns whether it took (False off glibc)."""
    return _mallopt(M_TOP_PAD, nbytes)


def _mallopt(parameter: int, value: int) -> bool:
    """glibc's mallopt(parameter, value): whether it took (False off glibc)."""
    mallopt = getattr(libc(), "mallopt", None)
    return bool(mallopt(parameter, value)) if mallopt is not None else False
