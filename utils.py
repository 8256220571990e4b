"""What two or more scripts of the toolkit share, and nothing else.

- ``init_distributed``: the process group from torchrun's environment (gloo on CPU, nccl with one GPU per
  process, the device from LOCAL_RANK); plain ``python script.py`` is a world of 1.
- ``UsageError``: bad flags or inputs, reported by rank 0 in one line.
- ``print0``: rank-0 printing; ``profiled``: a named range in torch.profiler traces, only while one records.
- timing, memory, machine description and JSON helpers for the benchmarks.

The harness the tests and benchmarks run their worker processes in (LocalGroup) is harness.py's.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import glob
import json
import math
import os
import platform
import re
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import IO, Any, Callable, Iterator

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose: torch.distributed.nn.functional's functions take
# `group=group.WORLD` as a default argument, evaluated at import time. Imported while a group exists (building a
# torch.optim optimizer imports it, through torch._dynamo), they keep the default group alive after
# destroy_process_group, and its gloo threads run on into interpreter shutdown, where one that still frees a
# finished collective's tensors needs the GIL, is ended by pthread_exit and aborts the process ("terminate called
# without an active exception"). test_teardown.py checks that the group's threads end at cleanup_distributed.
import torch.distributed.nn  # noqa: F401


class UsageError(Exception):
    """Bad flags or inputs: rank 0 reports it in one line and every rank exits with status 2."""


# ----------------------------------------------------------------------------------------------------------
# Process-group set-up from torchrun's environment
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ)


def resolve_device_backend(device: str = "auto", backend: str = "auto",
                           local_rank: int = 0, local_world_size: int = 1) -> tuple[torch.device, str]:
    """auto = cuda + nccl when every local process has a GPU of its own, else cpu + gloo.

    NCCL refuses two ranks on one GPU, so cuda with more local processes than GPUs means gloo over CUDA tensors.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if gpus >= local_world_size and gpus > 0 else "cpu"
    if device == "cuda" and gpus == 0:
        raise ValueError("--device cuda: no CUDA GPU is visible to this process")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}: expected auto, cpu or cuda")
    if backend == "auto":
        backend = "nccl" if device == "cuda" and gpus >= local_world_size else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ValueError("--backend nccl needs --device cuda")
    if backend == "nccl" and gpus < local_world_size:  # NCCL would fail at the first collective, not here
        raise ValueError(f"--backend nccl needs a GPU per process: {local_world_size} processes on this node, "
                         f"{gpus} GPU(s), and NCCL refuses two ranks on one GPU; use --backend gloo "
                         f"(gloo over CUDA tensors) or at most {gpus} process(es) per node")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}: expected auto, gloo or nccl")
    if device == "cuda":
        torch_device = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(torch_device)
    else:
        torch_device = torch.device("cpu")
    return torch_device, backend


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 1800.0) -> DistContext:
    """Join the process group torchrun describes in the environment, or make a world of 1.

    A world of 1 still gets a real process group (over an in-memory store) so that the same collectives run
    unchanged under ``python script.py``. A group that already exists (a harness.LocalGroup worker) is used as it is.
    """
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        torch_device, _ = resolve_device_backend(device, backend, rank, world_size)
        return DistContext(rank, world_size, rank, world_size, torch_device, dist.get_backend())
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch_device, backend = resolve_device_backend(device, backend, local_rank, local_world_size)
    timeout = timedelta(seconds=timeout_s)
    if not launched_by_torchrun():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent serves one TCPStore for the whole job, restarts included; joined through it as is,
        # restarted gloo workers read the dead workers' addresses left in it and fail to connect
        # (pytorch/pytorch#135712). A key prefix per restart attempt gives every attempt fresh keys.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store),
                                rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    return DistContext(rank, world_size, local_rank, local_world_size, torch_device, backend)


def cleanup_distributed() -> None:
    """Destroy the process group; its gloo threads end here, while Python is still whole (see the imports)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def print0(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only (or when no process group exists)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """A range called ``name`` in torch.profiler traces while a profiler records (``as`` gives the
    record_function), else a nullcontext: without --profile nothing is recorded or allocated."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------
# Timing, memory, machine description, results
# ----------------------------------------------------------------------------------------------------------
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


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between neighbours; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def max_across_ranks(value: float) -> float:
    """The largest of one float per rank (the slowest rank sets a collective job's time)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


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


def child_pids(pid: int) -> list[int]:
    """The PIDs of a process's children now (Linux: /proc/PID/task/*/children), sorted; none where it is gone."""
    found = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                found += [int(p) for p in f.read().split()]
        except OSError:  # the task ended while it was read
            pass
    return sorted(found)


def machine_ticks() -> tuple[int, int] | None:
    """The machine's clock ticks since boot, summed over its cores, from /proc/stat's first line: (all, idle +
    iowait); None where it cannot be read (not Linux). Two readings apart give the cores busy and idle between.
    "All" is user to steal: the guest fields after them are counted in user and nice already."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(field) for field in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(ticks), ticks[3] + ticks[4]


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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What a results file needs to say where it came from."""
    device = torch.device(device)
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": device.type,
        "gpu": None,
        "cuda": torch.version.cuda,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def machine_tag(device: torch.device | str = "cpu") -> str:
    """A short name for results files: the GPU's name on CUDA, else cpu-<cores>core."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
        return "gpu-" + re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return f"cpu-{os.cpu_count()}core"


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w") -> Iterator[IO[Any]]:
    """Write ``path`` so that a crash leaves the old file or the new one, never half of one.

    Yields a temporary file in the same folder (made if needed), named after ``path`` (TEMPORARY: ".NAME.XXXXXXXX.tmp",
    so that what a killed process leaves can be told from anything else there and removed: leftover_temporaries); on
    success it is flushed, fsynced, given the mode any file the user writes gets (the umask's) and renamed over
    ``path``; on failure it is removed.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, umasked(0o666))  # mkstemp makes it private
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def umasked(mode: int) -> int:
    """``mode`` as open() and mkdir() would make it under this process's umask (0o666 -> 0o644 under 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def leftover_temporaries(folder: str, names: tuple[str, ...]) -> list[str]:
    """The temporary files atomic_write left in ``folder`` for the files ``names`` (a process killed while it wrote
    one): ".NAME.XXXXXXXX.tmp", and nothing else."""
    pattern = re.compile(rf"\.({'|'.join(map(re.escape, names))})\.[A-Za-z0-9_]+\.tmp")
    return sorted(name for name in os.listdir(folder) if pattern.fullmatch(name)) if os.path.isdir(folder) else []


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write JSON atomically (see atomic_write)."""
    with atomic_write(path) as f:
        json.dump(payload, f, indent=2, sort_keys=False)
        f.write("\n")
