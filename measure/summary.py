"""Many figures as one: the median and a percentile of a list, and the largest of one figure per rank (the slowest rank
sets a collective job's time)."""
from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist


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
