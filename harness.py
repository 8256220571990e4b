"""The harness the tests and benchmarks run their processes in: ``LocalGroup``, N local worker processes joined in one
gloo group over a FileStore (no guessed ports), started once and reused for many calls.

Starting processes is the expensive part of a multi-process test on a small machine (an interpreter that imports
torch costs about 2.5 s of CPU on 2 cores), so a group's workers are forked from a server that has imported torch
once (_worker_context), take task after task (``run``, or ``submit`` to overlap groups), and report a failure as one
exception naming each rank: its traceback, or its exit code when it died without a word. ``stop_worker_server``
stops that server at the end of a session. The scripts' own process groups (from torchrun's environment) are
utils.init_distributed's.
"""
from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

def _group_worker(rank: int, world_size: int, store_path: str, backend: str, timeout_s: float,
                  tasks: Any, results: Any, env: dict[str, str], owner: int, heap_top_pad: int) -> None:
    os.environ.update(env)  # before the first task imports anything that reads it (forked: the server's environment)
    # What the fork server imported (torch: some 190,000 objects) lives as long as the worker: out of the collector's
    # sight, a full collection stops walking it (60 ms each) and writing into its pages, each write a copy-on-write
    # fault that copies a page of the server's. And a young collection every 10,000 new containers instead of 700:
    # a task's steps make and drop them by the thousand (tests/test_syncbn_compile.py alone: 61.6 CPU-s at 700, 56.8).
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])
    # A forked worker inherits the fork server as its start method; the task's own processes (a DataLoader's
    # workers) start as in a fresh interpreter, by the platform's default
    mp.set_start_method(None, force=True)
    # With a couple of cores and several workers, one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    if heap_top_pad:
        from measure.malloc import pad_heap_top  # the server's: already imported (_worker_context)
        pad_heap_top(heap_top_pad)
    faulthandler.enable(all_threads=True)  # a crash prints every thread's Python stack to stderr before it dies
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        results.put((rank, "ready", None))
    except BaseException:  # report start-up failures instead of dying silently
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if _gone(owner):  # the process that made the group died without closing it: no task will come
                os._exit(1)
            continue
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, "ok", fn(rank, world_size, *args, **kwargs)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()
    # Nothing is left to report: leave without the interpreter's teardown of torch and its libraries, which costs
    # about a second of CPU per worker (a session's groups hold some twenty of them).
    results.close()
    results.join_thread()
    os._exit(0)


def _worker_context() -> Any:
    """How LocalGroup starts its workers: forked from multiprocessing's fork server, which imports this module and utils
    (and so torch) once, instead of a fresh interpreter per worker importing torch again (about 2.5 s of CPU each on
    a 2-core machine; a test session starts some thirty workers). utils too: nearly every task imports it, and it
    imports torch.distributed.nn, which must come before the worker's process group exists (see utils' imports);
    measure.malloc, which a worker sets its heap with before its group. The server has started no thread and no
    process group when it forks, which is what makes forking safe. A forked worker has the server's environment, the
    one of the first group made: a group's own variables are given as LocalGroup(env=...)."""
    context = mp.get_context("forkserver")
    # read when the server starts, the first time a group is made
    context.set_forkserver_preload(["utils", "measure.malloc", __name__])
    return context


def stop_worker_server() -> None:
    """Stop the fork server once every group is closed, waiting for it: no process outlives the caller, and the
    workers' CPU time (the server reaps them) joins the caller's children's (resource.RUSAGE_CHILDREN). Uses
    multiprocessing's own stop, the one its tests call: the only private name of another module used here."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()


def _stop_workers(procs: list[Any], ask: list[Any], wait: bool = True) -> None:
    """Ask each worker to leave through its task queue in ``ask``, give them 10 s if ``wait``, then kill what is
    left."""
    for q in ask:
        q.put(None)
    if wait:
        for p in procs:
            p.join(timeout=10)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a killed test session leaves its groups' workers waiting otherwise)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class WorkerError(RuntimeError):
    """A worker of a LocalGroup raised; the message carries its traceback."""


class LocalGroup:
    """``world_size`` processes (forked from a server that has imported torch: _worker_context; what it imported
    is frozen out of the garbage collector's sight) joined in one process group over a FileStore, reused across
    calls; ``env``: variables set in each worker before its first task;
    ``heap_top_pad_mb``: glibc's heap keeps that much free memory at its top (measure.malloc.pad_heap_top; 0:
    glibc's own 128 kB), for workers that allocate and free many large blocks and do not measure their resident set.

    ``group.run(fn, *args)`` calls ``fn(rank, world_size, *args)`` in every worker and returns the results as
    a list in rank order. ``fn`` must be importable by the workers (a module-level function). Any worker's
    exception is re-raised here as WorkerError with its traceback, and a worker that dies (a signal, a crash) as
    one naming its exit code; a call that does not finish within ``timeout_s`` kills the group and raises
    TimeoutError. After either, the group is closed: make a new one.
    """

    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = 120.0,
                 start_timeout_s: float = 120.0, env: dict[str, str] | None = None, heap_top_pad_mb: int = 0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._dir = tempfile.mkdtemp(prefix="localgroup-")
        ctx = _worker_context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_group_worker, daemon=False,  # a worker may start processes: a DataLoader's
                        args=(r, world_size, os.path.join(self._dir, "store"), backend, timeout_s,
                              self._tasks[r], self._results, dict(env or {}), os.getpid(), heap_top_pad_mb << 20))
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.closed = self._stop_requested = self._busy = False
        # Not daemons: stopped at the latest when this object is collected or the interpreter exits (before
        # multiprocessing waits for its children), even if nobody closed the group
        self._finalizer = mp.util.Finalize(self, _stop_workers, args=(self._procs, self._tasks), exitpriority=10)
        self._collect("start-up", start_timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        """Every worker's answer, in rank order. After a failure (an error, or a worker that died without a word:
        a signal, the kernel's OOM killer) the others get 5 s to answer, or less once all that have not are dead:
        a failed rank's peers are often stuck in a collective with it."""
        out: list[Any] = [None] * self.world_size
        answered: set[int] = set()
        errors: list[str] = []
        deadline = time.monotonic() + timeout_s
        failed_at = None
        while len(answered) < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=0.5)
            except queue.Empty:
                now = time.monotonic()
                silent = [r for r in range(self.world_size) if r not in answered]
                dead = [r for r in silent if not self._procs[r].is_alive()]
                if dead and failed_at is None:
                    failed_at = now
                if failed_at is not None and (now > failed_at + 5.0 or dead == silent):
                    break
                if now > deadline:
                    self.close(kill=True)
                    raise TimeoutError(f"LocalGroup({self.world_size}): {what} did not finish within "
                                       f"{timeout_s:.0f}s") from None
                continue
            answered.add(rank)
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{value}")
                if failed_at is None:
                    failed_at = time.monotonic()
            else:
                out[rank] = value
        # a worker that died is named with its exit code: its peers' "Connection reset by peer" is only the echo
        errors += [f"--- rank {r} --- died, exit code {p.exitcode}" for r, p in enumerate(self._procs)
                   if r not in answered and not p.is_alive()]
        if errors:
            self.close(kill=True)
            raise WorkerError(f"LocalGroup({self.world_size}) {what} failed:\n" + "\n".join(errors))
        return out

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        return self.submit(fn, *args, timeout_s=timeout_s, **kwargs)()

    def submit(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
               **kwargs: Any) -> Callable[[], list[Any]]:
        """Start ``fn`` in every worker and return at once: calling what is returned waits for the results, as
        run() does (its timeout counted from that call). Meanwhile the caller may compute (a reference) or start
        another group's work; this group takes no other call until then."""
        if self.closed:
            raise RuntimeError("this LocalGroup is closed")
        if self._busy:
            raise RuntimeError("this LocalGroup is still running a call: wait for its results first")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        self._busy = True

        def results() -> list[Any]:
            try:
                return self._collect(getattr(fn, "__name__", str(fn)), timeout_s or self.timeout_s)
            finally:
                self._busy = False
        return results

    def request_stop(self) -> None:
        """Ask every worker to leave, without waiting: several groups then stop at once (close() waits)."""
        if not self.closed and not self._stop_requested:
            self._stop_requested = True
            for q in self._tasks:
                q.put(None)

    def close(self, kill: bool = False) -> None:
        if self.closed:
            return
        if not kill:
            self.request_stop()
        self.closed = True
        self._finalizer.cancel()
        _stop_workers(self._procs, [], wait=not kill)  # request_stop() has asked them, unless killed
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "LocalGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(kill=exc[0] is not None)
