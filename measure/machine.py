"""Where a figure came from and what the machine did meanwhile: the CPU, GPU and versions a results file names
(machine_info, machine_tag), the machine's clock ticks busy and idle (/proc/stat), a process's children now."""
from __future__ import annotations

import glob
import os
import platform
import re
from typing import Any

import torch


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
