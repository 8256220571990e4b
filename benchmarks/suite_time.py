"""The test suite's time, file by file: each test file run alone by pytest in a fresh interpreter, with its wall
time and the CPU time it used (user + system, of pytest and of every process it started and waited for: the worker
groups' processes, torchrun and its workers, the notebook's kernel). Then the whole suite, the README's test
command, run --suite-runs times in a row for the total.

    python -m benchmarks.suite_time --suite-runs 3 --out results/suite-time-cpu-2core.json

Run alone: the machine's other load lands in the wall times (the CPU times are steadier). A file run alone pays
for its own worker groups (a few seconds each), which the whole suite pays once: the files' walls add up to more
than the suite's.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import subprocess
import sys
import time

import utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(command: list[str]) -> dict[str, float]:
    """Run ``command`` from the repository's root; its wall seconds, CPU seconds (its own and its waited-for
    descendants'), exit code and the last line pytest printed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = done.stdout.strip().splitlines()
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "exit": done.returncode,
            "summary": lines[-1] if lines else ""}


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
    result = {"machine": utils.machine_info(), "command": "python3 -m pytest -q", "files": rows, "suite": []}
    for run in range(args.suite_runs):
        total = timed([sys.executable, "-m", "pytest", "-q"])
        result["suite"].append(total)
        print(f"{f'the suite, run {run + 1}':<36} {total['wall_s']:>8.1f} {total['cpu_s']:>8.1f}  "
              f"{total['summary']}", flush=True)
    if args.out:
        with utils.atomic_write(os.path.join(ROOT, args.out)) as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
