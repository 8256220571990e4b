"""The trainer run by the benchmarks: ``torchrun --standalone --nproc_per_node N ddp_cifar100.py FLAGS``, a process
of its own, and the metrics JSON its rank 0 writes, read back.

Every benchmark that measures the whole trainer launches it through ``run_trainer``: training_benchmark.py at the
root, and here compile_, lm_, memory_, slowlink_ and zero_benchmark. The metrics go to a folder of the run's own
(--metrics-out), removed once read. A run that fails (a non-zero exit, or no metrics) may be tried again
(``attempts``: a shared machine can fail a run for reasons of its own, and one lost run should not cost a whole
table); each failed attempt's output tail goes to stderr, and the last failure raises TrainerRunFailed in one line,
as does a run past its timeout (not tried again). Results files show the command as ``TrainerRun.command``: torchrun
and the trainer by their names, the metrics file as METRICS.json.

``configuration_flags`` and ``run_configuration``: the runs training_benchmark.py and zero_benchmark.py compare, each a
configuration (its gradient sync, norm, micro-batches, ...) over settings the benchmark shares between them (the
data, the model, the batch, the epochs, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from benchmarks.trainer_traces import rank_traces
from trainer.config import WARMUP_STEPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
TRAINER = os.path.join(ROOT, "ddp_cifar100.py")
TAIL_LINES = 40  # of a failed run's output, shown on stderr


class TrainerRunFailed(RuntimeError):
    """A trainer run that failed every attempt, or ran past its timeout; the message is one line."""


@dataclass(frozen=True)
class TrainerRun:
    metrics: dict[str, Any]  # what rank 0 wrote to --metrics-out
    command: str  # as results files show it: torchrun ... ddp_cifar100.py FLAGS --metrics-out METRICS.json
    wall_s: float  # the whole command's wall seconds (start-up, data, evaluation included), of the attempt that ran
    stderr: str  # every process's standard error (the trainer's logs, TORCH_LOGS' output)
    attempts: int  # the attempt that ran: 1, or more after failures


def run_trainer(flags: list[str], nproc: int, *, label: str, timeout_s: float | None = None,
                env: dict[str, str] | None = None, wrap: Callable[[list[str]], list[str]] | None = None,
                attempts: int = 1) -> TrainerRun:
    """``torchrun --standalone --nproc_per_node nproc ddp_cifar100.py flags`` from the repository's root, tried up to
    ``attempts`` times, with ``env`` over this process's environment; ``wrap`` turns the command into the one
    launched (a network namespace around it: slowlink_benchmark.shaped). ``label`` names the run in what goes to
    stderr and in TrainerRunFailed."""
    torchrun = ["--standalone", f"--nproc_per_node={nproc}"]
    shown = shlex.join(["torchrun", *torchrun, "ddp_cifar100.py", *flags, "--metrics-out", "METRICS.json"])
    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryDirectory(prefix="trainer-run-") as folder:
            metrics_path = os.path.join(folder, "metrics.json")
            command = [sys.executable, "-m", "torch.distributed.run", *torchrun, TRAINER, *flags,
                       "--metrics-out", metrics_path]
            began = time.perf_counter()
            try:
                done = subprocess.run(wrap(command) if wrap else command, capture_output=True, text=True,
                                      env=dict(os.environ, **(env or {})), cwd=ROOT, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise TrainerRunFailed(f"{label} took more than {timeout_s:.0f} s") from None
            wall_s = time.perf_counter() - began
            if done.returncode == 0 and os.path.exists(metrics_path):
                with open(metrics_path) as f:
                    metrics = json.load(f)
                return TrainerRun(metrics, shown, wall_s, done.stderr, attempt)
        tail = "\n".join(workers_output(done.stdout + done.stderr)[-TAIL_LINES:])
        status = f"exit {done.returncode}" if done.returncode else "exit 0 without its metrics"
        print(f"{label} failed ({status}" + (f", attempt {attempt} of {attempts}" if attempts > 1 else "")
              + f"):\n{tail}", file=sys.stderr, flush=True)
    raise TrainerRunFailed(f"{label} failed" + (f" {attempts} times" if attempts > 1 else "")
                           + "; its output's tail is above")


def workers_output(output: str) -> list[str]:
    """A failed run's lines without torchrun's own report of the failure (its agent's traceback and table of exit
    codes, some 40 lines that would push the workers' error out of the tail): the report's first line, which names
    the exit code, is kept."""
    lines = output.strip().splitlines()
    for i, line in enumerate(lines):
        if "elastic/multiprocessing/api.py" in line and "failed (exitcode" in line:
            return lines[:i + 1]
    return lines


def configuration_flags(config: dict, settings: argparse.Namespace) -> list[str]:
    """The trainer's flags for one configuration of a comparison: the settings every configuration shares (dataset,
    model, device, batch, epochs, seed, ...; training_benchmark.py's flags, or zero_benchmark.trainer_settings), then
    the configuration's own (grad sync, norm, micro-batches, ...), then whatever else it sets (``flags``)."""
    flags = ["--dataset", settings.dataset, "--model", settings.model, "--device", settings.device,
             "--grad-sync", config["grad_sync"], "--norm", config["norm"],
             "--grad-accum", str(config["grad_accum"]), "--batch-size", str(settings.batch_size),
             "--epochs", str(settings.epochs), "--seed", str(settings.seed)]
    if settings.dataset == "synthetic":
        flags += ["--train-size", str(settings.train_size), "--val-size", str(settings.val_size)]
    if settings.data_dir:
        flags += ["--data-dir", settings.data_dir]
    if settings.imagenet:
        flags += ["--image-size", str(settings.image_size), "--workers", str(settings.workers), "--channels-last",
                  "--max-steps", str(settings.steps + WARMUP_STEPS)]
    if config["sync_mode"]:
        flags += ["--sync-mode", config["sync_mode"]]
    if config.get("bucket_mb"):
        flags += ["--bucket-mb", str(config["bucket_mb"])]
    if config.get("max_steps"):
        flags += ["--max-steps", str(config["max_steps"])]
    if config.get("allreduce"):
        flags += ["--allreduce", config["allreduce"]]
    if settings.amp != "off":
        flags += ["--amp", settings.amp]
    return flags + config.get("flags", [])


def run_configuration(config: dict, settings: argparse.Namespace, profile: bool = False) -> dict:
    """One run of a configuration on ``config["nproc"]`` processes (else ``settings.nproc``), tried twice: its
    metrics, with the command that ran ("command") and the attempt that succeeded ("attempts"). With ``profile``,
    the trainer's --profile traces come back as metrics["traces"], one per rank."""
    nproc = config.get("nproc", settings.nproc)
    with tempfile.TemporaryDirectory(prefix="trainbench-") as folder:
        flags = configuration_flags(config, settings) + (["--profile", folder] if profile else [])
        try:
            run = run_trainer(flags, nproc, label=f"training_benchmark: {config['name']}",
                              timeout_s=settings.run_timeout,
                              env={"OMP_NUM_THREADS": str(settings.threads_per_process)}, attempts=2)
        except TrainerRunFailed as failure:
            raise SystemExit(str(failure)) from None
        metrics = dict(run.metrics, command=run.command.replace(folder, "DIR"), attempts=run.attempts)
        if profile:
            metrics["traces"] = rank_traces(folder, nproc)
    return metrics
