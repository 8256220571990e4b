"""Stage 3's units (zero/stage3.py): what a unit is (UnitState, Unit and its frozen parts), the autograd function
that says when a unit's backward is over (InputsGradient), and the refusal of ``model.state_dict()`` while the
parameters are shards ([Note: no state_dict at stage 3]).
"""
from __future__ import annotations

import enum
from typing import Any

import torch
import torch.nn as nn

from zero.buckets import Bucket


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (where activation checkpointing recomputes a
    forward)."""
    return torch._C._current_graph_task_id() != -1


STATE_DICT_REFUSED = ("zero: at stage 3 a rank holds only shards, so model.state_dict() has no weights to give: use "
                      "sync.model_state_dict() (every rank calls it; gathered to rank 0) or zero.checkpoint.save")


def refuse_detached_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """[Note: no state_dict at stage 3] A state_dict pre-hook on every module of a stage-3 model, until close():
    ``model.state_dict()`` is refused in one line. Its tensors would be views of flats whose storage is freed
    between uses (0 bytes), so ``.clone()`` of one reads freed memory (a SIGSEGV on every rank that tries) and
    ``torch.save`` of them writes a 1.8 kB file without a weight, in silence. Why refuse rather than gather: a
    gather is a collective, so a state_dict() that gathered would hang the common ``if rank == 0:
    torch.save(model.state_dict(), ...)``, and it would hand every rank the whole model, which stage 3 exists not
    to hold; the two calls that do it knowingly are named in the refusal (sync.model_state_dict(): every rank,
    rank 0 gets it whole, one unit at a time; zero.checkpoint.save: every rank its own shards). keep_vars=True is
    let through: it hands the parameters themselves (as model.named_parameters() does, shards' views), for code
    that reads names and shapes (zero.checkpoint's model_entries and model_problem, load_state_dict's key checks)."""
    if not keep_vars:
        raise RuntimeError(STATE_DICT_REFUSED)


class UnitState(enum.Enum):
    SHARDED = "sharded"  # the flat has no storage: only this rank's shard of the unit exists
    GATHERING = "gathering"  # the flat has its storage back and its all-gather is in flight
    GATHERED = "gathered"  # the unit's full parameters are in place


class FrozenPart(Bucket):
    """A stage-3 unit's frozen parameters of one dtype: a flat of their own, gathered and freed with the unit's
    trainable bucket, and this rank's shard of it, which no optimizer steps and no gradient reaches."""

    def __init__(self, index: int, params: list[nn.Parameter], chunks: int):
        super().__init__(index, params, chunks, "frozen")
        self.flat: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None


class Unit(Bucket):
    """A bucket of stage 3: one module's trainable parameters (the bucket's own, which may be none), and its frozen
    ones (``frozen``, a part per dtype), gathered whole only around its forward and its backward."""

    def __init__(self, index: int, params: list[nn.Parameter], chunks: int, word: str,
                 dtype: torch.dtype | None = None, device: torch.device | None = None):
        super().__init__(index, params, chunks, word, dtype, device)
        self.state = UnitState.SHARDED  # as made (shard_weights frees each flat once its shard is taken)
        self.module: nn.Module | None = None
        self.flat: torch.Tensor | None = None  # the unit's parameters, whole: storage only while not SHARDED
        self.frozen: list[FrozenPart] = []
        self.gather: list[Any] = []  # its all-gathers in flight (GATHERING)
        self.backward_begun = False  # in this backward
        self.inputs_pending = False  # [Note: frozen parameters] its inputs' gradient is still to come ...
        self.held_to_end = False  # ... or, where none comes, it is freed at the end of backward
        self.span: Any = None  # its open "unit I forward/backward" profiler range

    def flats(self) -> list[tuple[Bucket, torch.Tensor]]:
        """Each part that is gathered with the unit (the trainable bucket unless empty, the frozen parts) and its
        flat."""
        return ([(self, self.flat)] if self.length else []) + [(part, part.flat) for part in self.frozen]

    def full_bytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for _, flat in self.flats())


class InputsGradient(torch.autograd.Function):
    """The identity on a unit's inputs, whose backward runs once the gradient of every input is computed, that is
    once the unit's own backward is over (FSDP2's RegisterPostBackwardFunction does the same)."""

    @staticmethod
    def forward(ctx: Any, done: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.done()
        return (None, *grads)
