"""What every script shares: the process group from torchrun's environment, and what a rank says to its user.

- ``init_distributed``: the process group from torchrun's environment (gloo on CPU, nccl with one GPU per
  process, the device from LOCAL_RANK); plain ``python script.py`` is a world of 1. ``cleanup_distributed`` ends it.
- ``UsageError``: bad flags or inputs, reported by rank 0 in one line; ``one_line``: any exception in one line.
- ``print0``: rank-0 printing.

Timing, memory, the allocator and the machine are measure/'s (a module each); files written whole or not at all,
files.py's. The harness the tests and benchmarks run their worker processes in (LocalGroup) is harness.py's.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose: torch.distributed.nn.functional's functions take
# `group=group.WORLD` as a default argument, evaluated at import time. Imported while a group exists (building a
# torch.optim optimizer imports it, through torch._dynamo), they keep the default group alive after
# destroy_process_group, and its gloo threads run on into interpreter shutdown, where one that still frees a
# finished collective's tensors needs the GIL, is ended by pthread_exit and aborts the process ("terminate called
# without an active exception"). test_teardown.py checks that the group's threads end at cleanup_distributed.
import torch.distributed.nn  # noqa: F401

LINE = 300  # the longest line one_line gives: a message, not a dump


# ----------------------------------------------------------------------------------------------------------
# What the user is told: in one line
# ----------------------------------------------------------------------------------------------------------
class UsageError(Exception):
    """Bad flags or inputs: rank 0 reports it in one line and every rank exits with status 2."""


def one_line(error: BaseException) -> str:
    """An exception in one line for its user: its type and its message, every run of whitespace (line breaks
    included) one space, at most LINE characters. DCP's CheckpointException (every failed rank's traceback) is said as
    its first failure."""
    # Looked up, not imported: only DCP raises it (so it is loaded wherever one is caught), and importing DCP costs
    # every script that says an error some seconds
    dcp = sys.modules.get("torch.distributed.checkpoint.api")
    if dcp is not None and isinstance(error, dcp.CheckpointException):
        failures = list(error.failures.values())
        if failures:
            error = failures[0][0] if isinstance(failures[0], tuple) else failures[0]
    text = " ".join(str(error).split())
    line = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return line if len(line) <= LINE else line[:LINE - 4] + " ..."


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
