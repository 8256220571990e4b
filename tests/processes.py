"""Processes a test launches (torchrun, a script, a notebook run): started together, waited for together, none
outliving its deadline. Not a test file: pytest collects nothing here.

A test module whose processes need nothing from the tests before them declares them in a module-level
``early_processes()`` ({name: (argv, env)}); conftest.py starts them when the session starts, so that they run
beside the in-process tests (they are mostly interpreter start-up and waiting on each other), and the module's
fixture collects them with ``results_of(module)``, which starts them then if the session did not (a module run alone
under -p no:... or imported elsewhere).
"""
from __future__ import annotations

import os
import subprocess
import time
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root (this file: tests/)
EARLY: dict[str, dict[str, subprocess.Popen]] = {}  # module name -> its processes, started with the session


def start(commands: dict[str, tuple[list[str], dict[str, str] | None]]) -> dict[str, subprocess.Popen]:
    """Start every (argv, env) of ``commands`` at once, from the repository's root, output captured."""
    return {name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                   cwd=ROOT) for name, (argv, env) in commands.items()}


def wait_for(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, subprocess.CompletedProcess]:
    """Each process's CompletedProcess, all within ``timeout`` seconds (the stragglers killed)."""
    deadline = time.monotonic() + timeout
    results = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        kill(procs)
    return results


def kill(procs: dict[str, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def start_early(modules: list[ModuleType]) -> None:
    """conftest.py's, when the session starts: each module's early_processes()."""
    for module in modules:
        if module.__name__ not in EARLY:
            EARLY[module.__name__] = start(module.early_processes())


def results_of(module: ModuleType, timeout: float = 240) -> dict[str, subprocess.CompletedProcess]:
    """The module's early processes, waited for (started now if the session did not)."""
    procs = EARLY.pop(module.__name__, None) or start(module.early_processes())
    return wait_for(procs, timeout)


def stop_all() -> None:
    """The session's end: early processes nobody collected (their tests deselected or failed before) are killed."""
    while EARLY:
        kill(EARLY.popitem()[1])
