"""The test suite's time, file by file: each test file run alone by pytest in a fresh interpreter, with its wall
time and the CPU time it used (user + system, of pytest and of every process it started and waited for: the worker
groups' processes, torchrun and its workers, the notebook's kernel). Then the whole suite, the README's test
command, run --suite-runs times in a row for the total.

    python -m benchmarks.suite_time --suite-runs 3 --out results/suite-time-cpu-2core.json

Run alone: the machine's other load lands in the wall times (the CPU times are steadier). A file run alone pays
for its own worker groups (a few seconds each), which the whole suite pays once: the files' walls add up to more
than the suite's.

Each run also says what the machine's cores did meanwhile (Linux's /proc/stat, read once a second): the core-seconds
busy and idle, the busy ones that were not the command's (the VM's own threads, other load, the hypervisor's steal),
and how many cores were busy in each 10-second slice. With C cores, a run whose cores were never idle could not have
taken less than its busy core-seconds / C: the wall it would still need if every idle moment were filled
("floor_s"), and the busy cores by slice show where the idle ones were.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import subprocess
import sys
import threading
import time

from benchmarks.gpu_checks import git_commit
from files import atomic_write
from measure.machine import machine_info, machine_ticks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SLICE_S = 10  # the busy cores are told in slices of this many seconds
TICK_S = 1 / os.sysconf("SC_CLK_TCK")  # /proc/stat's unit


class CoreMeter:
    """/proc/stat's (all, idle) ticks read once a second from a thread of its own, from start() to stop()."""

    def __init__(self):
        self.readings: list[tuple[float, tuple[int, int]]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read_each_second, name="core-meter", daemon=True)

    def _read(self) -> None:
        ticks = machine_ticks()
        if ticks is not None:
            self.readings.append((time.perf_counter(), ticks))

    def _read_each_second(self) -> None:
        while not self.done.wait(1.0):
            self._read()

    def start(self) -> None:
        self._read()
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self._read()

    def report(self, command_cpu_s: float) -> dict | None:
        """Core-seconds busy and idle over the run, the busy ones not the command's, the floor (busy / cores) and
        the busy cores in each SLICE_S-second slice; None without two readings."""
        if len(self.readings) < 2:
            return None
        cores = os.cpu_count() or 1
        (_, (all0, idle0)), (_, (all1, idle1)) = self.readings[0], self.readings[-1]
        busy, idle = (all1 - all0 - (idle1 - idle0)) * TICK_S, (idle1 - idle0) * TICK_S
        slices, (then, (all_then, idle_then)) = [], self.readings[0]
        for at, (all_now, idle_now) in self.readings[1:]:
            if at - then >= SLICE_S or at == self.readings[-1][0]:
                busy_ticks = all_now - all_then - (idle_now - idle_then)
                slices.append(round(busy_ticks * TICK_S / max(at - then, 1e-9), 2))
                then, all_then, idle_then = at, all_now, idle_now
        return {"cores": cores, "busy_core_s": round(busy, 1), "idle_core_s": round(idle, 1),
                "others_cpu_s": round(max(busy - command_cpu_s, 0.0), 1), "floor_s": round(busy / cores, 1),
                "slice_s": SLICE_S, "busy_cores_by_slice": slices}


def timed(command: list[str]) -> dict:
    """Run ``command`` from the repository's root; its wall seconds, CPU seconds (its own and its waited-for
    descendants'), exit code, the last line pytest printed and what the machine's cores did meanwhile
    ("core_use": CoreMeter.report)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    meter = CoreMeter()
    meter.start()
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    finally:
        wall = time.perf_counter() - start
        meter.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = done.stdout.strip().splitlines()
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "exit": done.returncode,
            "summary": lines[-1] if lines else "", "core_use": meter.report(cpu)}


def core_use_line(use: dict | None) -> str:
    """A run's CoreMeter.report in two lines of the table."""
    if use is None:
        return "  the machine's cores: /proc/stat cannot be read here"
    slices = " ".join(f"{busy:.1f}" for busy in use["busy_cores_by_slice"])
    return (f"  the machine's {use['cores']} cores: busy {use['busy_core_s']:.0f} core-s (others than the command: "
            f"{use['others_cpu_s']:.0f}), idle {use['idle_core_s']:.0f}; never idle, the wall could not go under "
            f"{use['floor_s']:.0f} s\n  busy cores, each {use['slice_s']} s: {slices}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    parser.add_argument("--files", nargs="*", default=None, help="test files (default: every one)")
    parser.add_argument("--suite-runs", type=int, default=1, help="runs of the whole suite (0: none)")
    args = parser.parse_args()
    files = args.files or sorted(["test_syncbn.py"] + [os.path.relpath(f, ROOT) for f in
                                                       glob.glob(os.path.join(ROOT, "tests", "test_*.py"))])
    rows = {}
    print(f"{'file':<36} {'wall s':>8} {'CPU s':>8}  result")
    for name in files:
        row = rows[name] = timed([sys.executable, "-m", "pytest", "-q", name])
        print(f"{name:<36} {row['wall_s']:>8.1f} {row['cpu_s']:>8.1f}  {row['summary']}", flush=True)
    result = {"machine": machine_info(), "code": git_commit(None), "command": "python3 -m pytest -q",
              "files": rows, "suite": []}
    for run in range(args.suite_runs):
        total = timed([sys.executable, "-m", "pytest", "-q"])
        result["suite"].append(total)
        print(f"{f'the suite, run {run + 1}':<36} {total['wall_s']:>8.1f} {total['cpu_s']:>8.1f}  "
              f"{total['summary']}\n{core_use_line(total['core_use'])}", flush=True)
    if args.out:
        with atomic_write(os.path.join(ROOT, args.out)) as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
