"""What a phase's memory is made of, as the allocators see it: the memory benchmark's ``--view``.

A process's resident set (VmRSS, its peak VmHWM) is the sum of what the allocators handed out and still hold. On
the CPU there are two of them, one above the other:

    torch's CPU allocator   every tensor's storage; it keeps nothing: a freed storage goes straight to free()
    glibc's malloc          every byte above (and Python's objects, gloo's buffers, DCP's pickles); a freed block of
                            the heap stays in the process (its free bytes), a freed mmapped block goes back

So a phase's peak resident set above the process's start is read as

    tensors held     the storages alive as the phase begins (what ZeRO's formula counts: weights, gradients,
                     optimizer state, and whatever else a rank keeps between phases)
    tensors' peak    held, plus what the phase allocated less what it freed of that, at its highest; what the
                     phase had allocated and not freed at that moment is named by the innermost function of this
                     repository (the profiler's Python frames: "zero/stages.py(263): _acquire") or named range
                     (record_function's: ours such as "all_gather wait", FSDP2's "FSDP::all_gather", torch.optim's)
                     it was made in, with the aten op (torch.profiler's memory events: each allocation's size and
                     address). The profiler reports no free of a storage made before it started, so where a phase
                     frees what it held (a load drops the old optimizer state first) the peak is an upper bound
    heap kept        glibc's free bytes inside its heap at the phase's end (mallinfo2's fordblks): memory freed
                     that the process still holds, the allocator's history ([Note: the allocator] in
                     memory_benchmark.py)
    the rest         the peak less the above: Python objects, gloo's and DCP's buffers, pages the phase touched

The tensors' peak and the resident set's peak need not fall at one moment, so the rest is what the peak holds
beside the tensors at their own peak: a lower bound on what is not a tensor. The profiler's own records (its
events, the Python frames each allocation is named by) take hundreds of MB a process (about 3 GB at GPT-2 small's
scale on 8 processes), so the peaks and the heap are read from a run without it, and the tensors from the same work
run again under it: the same tensors, allocated in the same order.
"""
from __future__ import annotations

import bisect
import ctypes
import gc
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

MB = 1e6


class _Mallinfo2(ctypes.Structure):  # glibc >= 2.33, malloc.h: every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def glibc_heap() -> dict[str, float] | None:
    """glibc's malloc now, in MB: ``heap`` (the main and thread arenas' size), ``heap_in_use``, ``heap_free`` (freed
    bytes the heap keeps), ``mmapped`` (blocks served by mmap, given back when freed); None off glibc."""
    # here: the memory benchmark's spawned workers import this module before their own set-up
    from measure.malloc import libc
    mallinfo2 = getattr(libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return {"heap": info.arena / MB, "heap_in_use": info.uordblks / MB, "heap_free": info.fordblks / MB,
            "mmapped": info.hblkhd / MB}


def held_tensor_bytes() -> int:
    """The bytes of every CPU storage a Python object reaches now (each storage once, however many views share it:
    a flat bucket and its parameters' views count as the bucket)."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor) or obj.device.type != "cpu":  # type(): no __class__ lookup
                continue
            if hasattr(obj, "_local_tensor"):  # a DTensor: its storage is its local tensor's, walked on its own
                continue
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, a subclass of its own)
            continue
        if storage.data_ptr():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


Chain = tuple[tuple[str, int], ...]  # the Python frames and ops an allocation was made in, outermost first, each
                                     # with its start (ns)


def op(name: str) -> bool:
    """An operator's event (aten::mm, autograd::engine::...), not a range (FSDP2's FSDP::all_gather is a range)."""
    return "::" in name and name.split("::")[0].islower()


def ours(name: str) -> bool:
    """This repository's Python frame ("zero/stage3.py(233): gather"), or a named range (not torch's frames, the
    standard library's, nn.Module's or an op)."""
    if ".py(" in name:
        return not name.startswith(("torch/", "<", "/"))
    return not op(name) and not name.startswith(("nn.Module:", "ProfilerStep", "<"))


def _allocations(prof: profile) -> list[tuple[int, int, int, str]]:
    """Every allocation and free the profile saw, in time order: (time ns, address, bytes (negative: a free), its
    name: ``named``). The Python frames and ops come from the event tree; the named ranges by time, on the thread
    that made the allocation (a range opened by a context manager's __enter__ is not its body's parent there)."""
    from torch._C._profiler import _EventType
    found: list[tuple[int, int, int, int, Chain]] = []
    ranges: dict[int, list[tuple[int, int, str]]] = {}  # thread -> (start, end, name) of every named range
    stack: list[tuple[Any, Chain]] = [(root, ()) for root in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, chain = stack.pop()
        if node.tag == _EventType.Allocation:
            if node.extra_fields.device.type == "cpu":
                found.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size,
                              node.start_tid, chain))
            continue
        if node.tag == _EventType.TorchOp and not op(node.name):
            ranges.setdefault(node.start_tid, []).append((node.start_time_ns, node.end_time_ns, node.name))
        elif node.tag in (_EventType.TorchOp, _EventType.PyCall):
            chain = chain + ((node.name, node.start_time_ns),)
        stack.extend((child, chain) for child in node.children)
    starts = {tid: sorted(spans) for tid, spans in ranges.items()}
    out = []
    for at, ptr, size, tid, chain in sorted(found, key=lambda a: a[0]):
        spans = starts.get(tid, [])
        covering = None
        for begin, end, name in reversed(spans[:bisect.bisect_right(spans, (at, float("inf"), ""))]):
            if end >= at:  # the innermost range open at ``at`` (ranges nest: the latest begun that still runs)
                covering = (name, begin)
                break
        out.append((at, ptr, size, named(chain, covering)))
    return out


def named(chain: Chain, covering: tuple[str, int] | None) -> str:
    """An allocation's name: the innermost of this repository's functions ("zero/stage3.py(233): gather") and named
    ranges (record_function's: "all_gather wait", torch.optim's "Optimizer.step#AdamW.step", FSDP2's
    "FSDP::all_gather") it was made in, with the op that made it; the op alone outside them."""
    candidates = [(begin, name) for name, begin in chain if ours(name)] + ([covering[::-1]] if covering else [])
    op_name = next((name for name, _ in reversed(chain) if op(name)), "(no op)")
    return f"{max(candidates)[1]} / {op_name}" if candidates else op_name


class AllocatorView:
    """A context around one phase, under torch.profiler's memory events; ``figures()`` after it: the tensors held as
    it began, their peak in it, and what the phase had allocated and not freed at that peak, by name.

        with AllocatorView() as view:
            work()
        view.figures(start_held)   # start_held: held_tensor_bytes() at the process's start (the baseline)
    """

    def __init__(self, top: int = 8, stacks: bool = True) -> None:
        self.top, self.stacks = top, stacks  # stacks: name by this repository's functions too (costs GBs at scale)

    def __enter__(self) -> "AllocatorView":
        self.held = held_tensor_bytes()
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=self.stacks)
        self.prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.prof.__exit__(*exc)

    def figures(self, start_held: int = 0) -> dict[str, Any]:
        events = _allocations(self.prof)
        total = highest = 0  # the phase's allocations less their frees (the profiler reports no other free)
        peak_at = -1  # the event after which the total first reached its highest
        for index, (_, _, size, _) in enumerate(events):
            total += size
            if total > highest:
                highest, peak_at = total, index
        at_peak: dict[int, tuple[int, str]] = {}  # the phase's own allocations not yet freed at that event
        for _, ptr, size, name in events[:peak_at + 1]:
            if size > 0:
                at_peak[ptr] = (size, name)
            else:
                at_peak.pop(ptr, None)
        by_name: dict[str, float] = {}
        for size, name in at_peak.values():
            by_name[name] = by_name.get(name, 0.0) + size / MB
        ordered = sorted(by_name.items(), key=lambda kv: -kv[1])
        if len(ordered) > self.top:
            ordered = ordered[:self.top] + [("(the rest)", sum(v for _, v in ordered[self.top:]))]
        held_mb = (self.held - start_held) / MB
        return {"tensors_held_mb": round(held_mb, 1), "tensors_peak_mb": round(held_mb + highest / MB, 1),
                "in_use_at_peak_mb": round(sum(size for size, _ in at_peak.values()) / MB, 1),
                "in_use_by_range_mb": {name: round(mb, 1) for name, mb in ordered}}


def reading(peak_mb: float, heap: dict[str, float] | None, tensors: dict[str, Any]) -> dict[str, Any]:
    """One phase's peak read through: ``peak_mb`` and ``heap`` (glibc_heap() at the phase's end) from a run
    without the profiler, ``tensors`` (AllocatorView.figures()) from one with it (the same work, so the same
    tensors); the rest is the peak less both."""
    heap_free = heap["heap_free"] if heap else 0.0
    return {**tensors, "heap_kept_mb": round(heap_free, 1),
            "rest_mb": round(peak_mb - tensors["tensors_peak_mb"] - heap_free, 1),
            "glibc_mb": {k: round(v, 1) for k, v in heap.items()} if heap else None}
