"""Processes a test launches (torchrun, a script, a notebook run): run in the background beside the in-process
tests, waited for together, none outliving its deadline. Not a test file: pytest collects nothing here.

A test module whose processes need nothing from the tests before them declares them in a module-level
``early_processes()`` ({name: (argv, env)}), and names the fixture that collects them in EARLY_PROCESSES_FIXTURE.
conftest.py queues them when the session starts (``queue``) if a selected test uses that fixture, and the fixture
collects them with ``results_of(module)`` (or ``beside``, running the module's in-process runs meanwhile), which
starts them at once if they are still queued, or if the session did not queue them (a module run alone under
-p no:..., or imported elsewhere).

The queue keeps the cores busy to the session's end instead of crowding its start. The first module's processes
start at once; each next module's when none of the queue's is running, or, SETTLE_S after the last start, when the
machine has left half a core idle over the last second (read from /proc/stat; where there is none, at once). Those
processes are mostly interpreter start-up and waiting on each other, so they fill what the in-process tests leave
idle (a test group's ranks wait on each other too); started all at once, they left the cores idle for the second
half of the session. Their output goes to files, not pipes: a process that nobody reads yet never blocks on a full
pipe.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import IO, Callable, TypeVar

from measure.machine import machine_ticks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root (this file: tests/)
FOLDERS: dict[str, str] = {}  # module name -> the folder its processes write in (folder)
POLL_S = 1.0  # how often the queue looks at the machine
SETTLE_S = 5.0  # after a start, the new processes' start-up is not in the idle time yet: no other start before this
SPARE_CORES = 0.5  # idle over the last poll that lets the next module's processes start
T = TypeVar("T")


def folder(module_name: str) -> str:
    """The temporary folder of a module's processes, made on first use: its early_processes() and the fixture
    that collects them share it."""
    if module_name not in FOLDERS:
        FOLDERS[module_name] = tempfile.mkdtemp(prefix=module_name.replace("_", "-") + "-")
    return FOLDERS[module_name]


@dataclass
class Launch:
    """A started process and the files its output goes to."""
    proc: subprocess.Popen
    stdout: IO[bytes]
    stderr: IO[bytes]


def start(commands: dict[str, tuple[list[str], dict[str, str] | None]]) -> dict[str, Launch]:
    """Start every (argv, env) of ``commands`` at once, from the repository's root, output to temporary files."""
    launches = {}
    for name, (argv, env) in commands.items():
        stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        launches[name] = Launch(subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=env, cwd=ROOT), stdout,
                                stderr)
    return launches


def wait_for(launches: dict[str, Launch], timeout: float) -> dict[str, subprocess.CompletedProcess]:
    """Each process's CompletedProcess (output as text), all within ``timeout`` seconds (the stragglers killed)."""
    deadline = time.monotonic() + timeout
    results = {}
    try:
        for name, launch in launches.items():
            launch.proc.wait(timeout=max(deadline - time.monotonic(), 1))
            results[name] = subprocess.CompletedProcess(launch.proc.args, launch.proc.returncode, read(launch.stdout),
                                                        read(launch.stderr))
    finally:
        kill(launches)
    return results


def read(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


def kill(launches: dict[str, Launch]) -> None:
    for launch in launches.values():
        if launch.proc.poll() is None:
            launch.proc.kill()
            launch.proc.wait()
        launch.stdout.close()
        launch.stderr.close()


def running(launches: dict[str, Launch]) -> bool:
    return any(launch.proc.poll() is None for launch in launches.values())


class IdleMeter:
    """The cores left idle since the last call, from /proc/stat's first line (None where there is none)."""

    def __init__(self):
        self.last = machine_ticks()

    def idle_cores(self) -> float | None:
        now, last = machine_ticks(), self.last
        self.last = now
        if now is None or last is None or now[0] == last[0]:
            return None
        return (now[1] - last[1]) / (now[0] - last[0]) * (os.cpu_count() or 1)


class BackgroundQueue:
    """Modules' early processes, started one module at a time as the machine has room (the module docstring)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.waiting: list[ModuleType] = []
        self.started: dict[str, dict[str, Launch]] = {}  # module name -> its processes, until collected
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def queue(self, modules: list[ModuleType]) -> None:
        with self.lock:
            self.waiting += [m for m in modules if m.__name__ not in self.started and m not in self.waiting]
            if self.waiting and not self.started:
                self._start_next()
        if self.waiting and self.thread is None:
            self.thread = threading.Thread(target=self._pump, name="background-queue", daemon=True)
            self.thread.start()

    def _start_next(self) -> None:
        module = self.waiting.pop(0)
        self.started[module.__name__] = start(module.early_processes())

    def _pump(self) -> None:
        meter, last_start = IdleMeter(), time.monotonic()
        while not self.stopping.wait(POLL_S):
            idle = meter.idle_cores()
            with self.lock:
                if not self.waiting:
                    return
                busy = any(running(launches) for launches in self.started.values())
                room = idle is None or idle >= SPARE_CORES
                if not busy or (room and time.monotonic() - last_start >= SETTLE_S):
                    self._start_next()
                    last_start = time.monotonic()

    def collect(self, module: ModuleType) -> dict[str, Launch]:
        """The module's processes, started now if they were still waiting or never queued; the queue forgets them."""
        with self.lock:
            if module in self.waiting:
                self.waiting.remove(module)
            launches = self.started.pop(module.__name__, None)
        return launches if launches is not None else start(module.early_processes())

    def stop(self) -> None:
        """The session's end: what nobody collected (its tests deselected or failed before) is killed."""
        self.stopping.set()
        with self.lock:
            self.waiting.clear()
            while self.started:
                kill(self.started.popitem()[1])


BACKGROUND = BackgroundQueue()


def queue(modules: list[ModuleType]) -> None:
    """conftest.py's, when the session starts: the modules' early_processes(), in this order."""
    BACKGROUND.queue(modules)


def collect(module: ModuleType) -> dict[str, Launch]:
    """The module's early processes, started now if they were not yet, for ``wait_for``."""
    return BACKGROUND.collect(module)


def results_of(module: ModuleType, timeout: float = 240) -> dict[str, subprocess.CompletedProcess]:
    """The module's early processes, waited for (started now if they were not yet)."""
    return wait_for(collect(module), timeout)


def beside(module: ModuleType, work: Callable[[], T], timeout: float = 240
           ) -> tuple[T, dict[str, subprocess.CompletedProcess]]:
    """``work()`` (a module's in-process runs) while the module's early processes run (started now if they were not
    yet), then those waited for: (what work returned, their CompletedProcess by name). On an error in ``work`` too,
    no process outlives the call."""
    launches = collect(module)
    try:
        done = work()
    finally:
        results = wait_for(launches, timeout)
    return done, results


def stop_all() -> None:
    BACKGROUND.stop()
