"""A run of fault-tolerant replica groups on this machine, for the fault benchmark and the fault tests: the coordinator
(``python -m replicas serve --port 0``, the port the OS hands out) and each group a ``torchrun --standalone
--nproc_per_node P --max-restarts K`` of the trainer with its own checkpoint folder, commit log and metrics, in a
working folder; the groups' workers found by process (to kill or stop one), their commit logs read as they grow.

    run = ReplicaRun(workdir, groups=3, flags=[...])      # the trainer's flags every group shares
    run.start()
    run.signal(1, signal.SIGKILL)                           # group 1's workers: torchrun restarts them
    codes = run.wait(timeout_s=600)                          # every group's exit code
    run.committed(0)                                        # group 0's commit log: the committed steps
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import replicas
from measure.machine import child_pids
from trainer import warm_start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def final_weights(checkpoint_dir: str) -> dict[str, Any] | None:
    """The weights of a group's current checkpoint (its last.pt, or a DCP folder read whole: --zero 3's), by this
    process alone; None where it has none."""
    import torch

    import zero.checkpoint
    from trainer.checkpoint import folders
    found = folders.current(checkpoint_dir)
    if found is None:
        return None
    if found.folder:
        return zero.checkpoint.read_whole(found.path, ("model",), alone=True)["model"]
    return torch.load(found.path, map_location="cpu", weights_only=True)["model"]


class ReplicaRun:
    """R replica groups and their coordinator, as processes (module docstring). ``entry``: the trainer's script
    (a test's float64 one); ``group_env``: extra environment per group (its faults); ``processes``: P; ``warm``:
    --warm-restarts (a restart forked by its rank's zygote: trainer/warm_start.py)."""

    def __init__(self, workdir: str, groups: int, flags: list[str], *, processes: int = 1, max_restarts: int = 100,
                 entry: str = "ddp_cifar100.py", env: dict[str, str] | None = None,
                 group_env: dict[int, dict[str, str]] | None = None, min_groups: int = 1, fault_timeout_s: float = 10,
                 warm: bool = True):
        self.workdir, self.groups, self.flags, self.processes = workdir, groups, flags, processes
        self.max_restarts, self.entry, self.warm = max_restarts, entry, warm
        self.min_groups, self.timeout_s = min_groups, fault_timeout_s
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.group_env = group_env or {}
        self.coordinator: subprocess.Popen | None = None
        self.address: str | None = None
        self.agents: dict[int, subprocess.Popen] = {}
        os.makedirs(workdir, exist_ok=True)

    def path(self, group: int, what: str) -> str:
        """A group's file: "log" (the commit log), "metrics", "checkpoints" (a folder), "output"."""
        return os.path.join(self.workdir, {"log": f"commits-{group}.jsonl", "metrics": f"metrics-{group}.json",
                                           "checkpoints": f"checkpoints-{group}", "output": f"group-{group}.log"}[what])

    def start(self) -> None:
        self.start_coordinator()
        for group in range(self.groups):
            self.start_group(group)

    def start_coordinator(self, port: int = 0) -> None:
        """``python -m replicas serve`` on ``port`` (0: one the OS hands out), once it listens."""
        log = open(os.path.join(self.workdir, "coordinator.log"), "a")
        self.coordinator = subprocess.Popen([sys.executable, "-m", "replicas", "serve", "--host", "127.0.0.1", "--port",
                                             str(port)], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline, seen = time.monotonic() + 120, 0 if self.address is None else len(self._ports(log.name))
        while len(self._ports(log.name)) <= seen:
            if self.coordinator.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start: see {log.name}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{self._ports(log.name)[-1]}"

    @staticmethod
    def _ports(log: str) -> list[str]:
        with open(log) as f:
            return re.findall(r"coordinator on \S+:(\d+)", f.read())

    def start_group(self, group: int) -> None:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(self.processes), "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.1",
                self.entry, *self.flags, *(["--warm-restarts"] if self.warm else []), "--replica-group", str(group),
                "--replica-groups", str(self.groups), "--coordinator", self.address, "--min-replica-groups",
                str(self.min_groups), "--fault-timeout", str(self.timeout_s), "--commit-log", self.path(group, "log"),
                "--checkpoint-dir", self.path(group, "checkpoints"), "--metrics-out", self.path(group, "metrics")]
        output = open(self.path(group, "output"), "a")
        self.agents[group] = subprocess.Popen(argv, cwd=ROOT, env={**self.env, **self.group_env.get(group, {})},
                                              stdout=output, stderr=subprocess.STDOUT, start_new_session=True)

    def workers(self, group: int) -> list[int]:
        """The PIDs of group ``group``'s trainer processes now: its torchrun's children, or, for a restart that a
        zygote forked (--warm-restarts), the child that such a thin process stands for."""
        agent = self.agents[group].pid
        return [self._trainer(agent, pid) for pid in child_pids(agent)]

    def zygotes(self, group: int) -> list[int]:
        """The PIDs of group ``group``'s zygotes (--warm-restarts: one per local rank, once its first start forked
        it)."""
        found = (warm_start.zygote(self.agents[group].pid, rank) for rank in range(self.processes))
        return [pid for pid in found if pid is not None]

    def _trainer(self, agent: int, pid: int) -> int:
        """The trainer a torchrun child is: itself, or the child a zygote forked for it (a warm restart, served in
        a fraction of a second after torchrun starts it: asked again for up to 10 s)."""
        with open(f"/proc/{pid}/environ", "rb") as f:
            variables = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        if not self.warm or variables.get(b"TORCHELASTIC_RESTART_COUNT", b"0") == b"0":
            return pid  # the first start: the trainer itself
        deadline = time.monotonic() + 10
        while True:
            served = warm_start.served(agent, int(variables.get(b"LOCAL_RANK", b"0")), pid)
            if served is not None or time.monotonic() > deadline or not os.path.exists(f"/proc/{pid}"):
                return served or pid  # (none: a restart that started cold)
            time.sleep(0.05)

    def signal(self, group: int, sig: int) -> list[int]:
        """Send ``sig`` to the group's workers (SIGKILL: torchrun restarts them; SIGSTOP/SIGCONT: a hang)."""
        pids = self.workers(group)
        for pid in pids:
            os.kill(pid, sig)
        return pids

    def kill_coordinator(self) -> None:
        self.coordinator.kill()
        self.coordinator.wait()

    def committed(self, group: int, steps_only: bool = True) -> list[dict[str, Any]]:
        path = self.path(group, "log")
        return replicas.read_log(path, steps_only) if os.path.exists(path) else []

    def wait_for(self, group: int, what: str, found: Any, timeout_s: float) -> None:
        """Until ``found(entries)`` holds of group ``group``'s commit log (every entry, notes included)."""
        deadline = time.monotonic() + timeout_s
        while not found(self.committed(group, steps_only=False)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica group {group}: no {what} in {timeout_s} s")
            time.sleep(0.05)

    def wait_for_step(self, group: int, step: int, timeout_s: float) -> None:
        """Until group ``group`` has committed ``step``."""
        self.wait_for(group, f"step {step}", lambda entries: any(e.get("step", -1) >= step for e in entries),
                      timeout_s)

    def wait(self, timeout_s: float) -> dict[int, int | None]:
        """Every group's exit code (None: still running at the deadline, then killed)."""
        deadline, codes = time.monotonic() + timeout_s, {}
        for group, agent in self.agents.items():
            try:
                codes[group] = agent.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                codes[group] = None
        return codes

    def output(self, group: int) -> str:
        with open(self.path(group, "output")) as f:
            return f.read()

    def close(self) -> None:
        """Everything this run started, stopped (the groups' whole process sessions). A group still running is
        first sent SIGUSR1 (SIGCONT before it), which a worker that registered faulthandler for it answers with
        every thread's stack in the group's output: where it waited."""
        running = [group for group, agent in self.agents.items() if agent.poll() is None]
        for group in running:
            with contextlib.suppress(ProcessLookupError):  # a worker that ended meanwhile
                self.signal(group, signal.SIGCONT)
                self.signal(group, signal.SIGUSR1)
        if running:
            time.sleep(2.0)
        for group in running:
            os.killpg(self.agents[group].pid, signal.SIGKILL)
            self.agents[group].wait()
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.kill_coordinator()
