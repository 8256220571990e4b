"""A whole state dict given on the group's rank 0, sent to every rank: what every sync's
``load_model_state_dict`` does with one (zero.shard's stages, references.py's DDP), and how the trainer hands
rank 0's weights and buffers to the others.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn


def only_rank0_holds(state: dict[str, Any] | None, group: dist.ProcessGroup | None) -> bool:
    """Whether a whole state_dict was given on the group's rank 0 only (the others passing None or {}) rather than
    on every rank: one object all-gather, so every rank reaches the same verdict; rank 0 without one is refused in
    one line."""
    held: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(held, bool(state), group=group)
    if all(held):
        return False
    if not held[0]:
        raise ValueError("load_model_state_dict: the group's rank 0 has no state_dict; pass it on rank 0 (the "
                         "others may pass None or {}), or the same on every rank")
    return True


def check_keys_on_rank0(model: nn.Module, state: dict[str, Any] | None, group: dist.ProcessGroup | None) -> None:
    """Rank 0's verdict on a state_dict's keys against the model's, sent to every rank: all raise together."""
    verdict: list[Any] = [None]
    if dist.get_rank(group) == 0:
        expected = set(model.state_dict(keep_vars=True))  # names alone (stage 3 refuses detached tensors)
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            verdict[0] = (f"Error(s) in loading state_dict: missing keys {missing}, unexpected keys "
                          f"{unexpected}")
    dist.broadcast_object_list(verdict, group=group, group_src=0)
    if verdict[0]:
        raise RuntimeError(verdict[0])


def broadcast_state(model: nn.Module, buffers_only: bool = False, group: dist.ProcessGroup | None = None) -> None:
    """The group's rank 0's parameters (unless ``buffers_only``) and buffers to every rank of the group."""
    with torch.no_grad():
        tensors = list(model.buffers()) + ([] if buffers_only else list(model.parameters()))
        for t in tensors:
            dist.broadcast(t, group=group, group_src=0)
