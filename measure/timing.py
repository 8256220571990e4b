"""Time: named ranges in torch.profiler traces, and wall times of intervals and of whole calls in milliseconds
(perf_counter on the CPU, CUDA events on a GPU)."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist


def profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """A range called ``name`` in torch.profiler traces while a profiler records (``as`` gives the
    record_function), else a nullcontext: without --profile nothing is recorded or allocated."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


@dataclass
class IntervalTimer:
    """Wall times of start()/stop() intervals in ms: perf_counter on the CPU, CUDA events on a GPU (recorded on
    the stream, read in collect(): timing adds no host-device sync of its own)."""
    device: torch.device
    times_ms: list[float] = field(default_factory=list)
    _events: list[Any] = field(default_factory=list)
    _start: Any = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self.times_ms.append((time.perf_counter() - self._start) * 1e3)

    def collect(self) -> list[float]:
        """Read the recorded CUDA intervals (waits for the last one); returns every time so far."""
        if self._events:
            self._events[-1][1].synchronize()
            self.times_ms.extend(start.elapsed_time(end) for start, end in self._events)
            self._events = []
        return self.times_ms


def time_calls_ms(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 5) -> list[float]:
    """Per-call wall times in milliseconds: CUDA events on a GPU, perf_counter on the CPU.

    Every call starts after a barrier (when a process group exists), so all ranks start each call together
    and the collectives inside are timed as one job, not as ranks waiting for stragglers from the last call.
    """
    synced = dist.is_initialized() and dist.get_world_size() > 1
    for _ in range(warmup):
        fn()
    timer = IntervalTimer(device)
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the last call's kernels are done: the barrier lines up real starts
        if synced:
            dist.barrier()
        timer.start()
        fn()
        timer.stop()
    return timer.collect()
