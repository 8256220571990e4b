"""A process's memory: its resident set now and at its peak (Linux's /proc), another process's private share, the peak
of each phase of a run (PhasePeaks), and the figure a run reports (the CUDA allocator's peak on a GPU)."""
from __future__ import annotations

import functools
import resource
from typing import Any, Callable

import torch


def proc_status_mb(key: str) -> float | None:
    """A field of Linux's /proc/self/status in MB (VmRSS: the resident set now; VmHWM: its peak since the last
    reset), or None where it cannot be read (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1e3  # kB
    except OSError:
        pass
    return None


def process_memory_mib(pid: int) -> dict[str, float]:
    """RSS, PSS and private memory (USS: what the process's end would free) of one process, in MiB, from Linux's
    /proc/PID/smaps_rollup. PSS shares each page among the processes that map it: a forked process's pages still
    shared copy-on-write count in part."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return {"rss": fields["Rss"], "pss": fields["Pss"], "private": fields["Private_Clean"] + fields["Private_Dirty"]}


def reset_peak_resident() -> bool:
    """VmHWM back to the resident set now (Linux's clear_refs, 5: "reset the peak resident set size"; it resets
    getrusage's ru_maxrss too); False where it cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PhasePeaks:
    """This process's peak resident memory above its start in each phase of a run (build, restore, steps,
    checkpoint, evaluation), in MB: Linux's VmHWM, reset at each phase's end through /proc/self/clear_refs, so the
    next phase's peak is its own. ``end(phase)`` closes the phase that ran since the last end; a phase that recurs
    (every step) keeps its largest. The reset also resets getrusage's ru_maxrss, so ``peak_mb()`` is the whole
    run's absolute peak in its place. Where /proc cannot be read or reset (not Linux), it records nothing."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self.highest = 0.0
        self.start = proc_status_mb("VmRSS")
        self.working = self.start is not None and reset_peak_resident()

    def end(self, phase: str) -> None:
        if not self.working:
            return
        peak = proc_status_mb("VmHWM") or 0.0
        self.highest = max(self.highest, peak)
        self.peaks[phase] = max(self.peaks.get(phase, 0.0), peak - self.start)
        reset_peak_resident()

    def peak_mb(self) -> float | None:
        """The absolute peak resident set over the run so far (None where phases are not measured)."""
        return max(self.highest, proc_status_mb("VmHWM") or 0.0) if self.working else None


def measured_phase(phase: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A trainer function whose first argument holds the run's ``phases`` (trainer.build.Parts, or a method's
    self: trainer.checkpoint.Checkpointer): when it returns, ``phase`` ends (PhasePeaks)."""
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(parts: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(parts, *args, **kwargs)
            finally:
                parts.phases.end(phase)
        return run
    return decorate


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: torch.cuda.max_memory_allocated. CPU: the process's peak resident set size (ru_maxrss)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
