"""A run stops at a non-finite loss or gradient norm (Megatron-LM's check of the loss and the gradient norm for NaN,
check_for_nan_in_loss_and_grad): one line naming the optimizer step and the rank, on every rank at the same step,
before anything non-finite is saved, so the last checkpoint stays current.

What is checked, per optimizer step: this rank's loss over the window (the non-finite one's rank is named: the
all-reduce's MAX of W - rank keeps the lowest such rank), and with --clip-grad-norm the gradient's norm, which is
global already (every rank computes the same total). Without --clip-grad-norm a non-finite gradient with a finite
loss (rare: the loss itself is float32) is caught one step later, at the loss it then makes.

fp16: a step GradScaler skips for an overflow (its found_inf) is its normal path, not a stop: the scale halves and
the next step tries again. More than MAX_SKIPS skips in a row stop the run: from torch's initial scale of 2^16,
40 halvings bring the scale below 2^-24, fp16's smallest subnormal, where no gradient is left that fp16 could
carry; a loss that still overflows is non-finite of itself, not for the scale.

Its cost: one all-reduce of 4 numbers per step (the fourth: a background save that failed, ``watch``; a world of
1: none), launched without waiting, and read one step later (a CUDA event on a pinned copy: the host never waits for
the step under way), or before a save, which reads the step it saves (``settle``). No host-device sync of its own
per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from utils import UsageError

MAX_SKIPS = 40  # fp16: consecutive steps GradScaler may skip (the module docstring's 16 + 24 halvings)


class NonFiniteError(UsageError):
    """The run stopped at a non-finite loss or gradient norm: one line, as a usage error is said."""


@dataclass
class Pending:
    step: int  # the optimizer step checked (counted from 1)
    flags: torch.Tensor  # [W - rank of the lowest rank with a non-finite loss, or 0; norm non-finite; skipped;
    # a background save failed (``watch``)]
    work: Any = None  # the all-reduce in flight (gloo)
    event: Any = None  # CUDA: recorded after the pinned copy


class FiniteCheck:
    """Every rank makes one and calls ``step`` after each optimizer step and ``settle`` before each save."""

    def __init__(self, world_size: int, rank: int, comm_device: torch.device, fp16: bool):
        self.world_size, self.rank, self.comm_device, self.fp16 = world_size, rank, comm_device, fp16
        self.pending: Pending | None = None
        self.skips = 0  # fp16: GradScaler's skips in a row
        self.saved_step: int | None = None  # the step of the checkpoint current now (when_published's)
        self.failed: Callable[[], bool] = lambda: False  # watch's: this rank's background save failed ...
        self.stop: Callable[[], None] = lambda: None  # ... and what every rank then calls (it raises)

    def watch(self, failed: Callable[[], bool], stop: Callable[[], None]) -> None:
        """``failed()`` joins each step's all-reduce; where it was True on any rank, every rank calls ``stop()`` at
        the same step (--async-checkpoint: a background save that failed on one rank stops every rank in one line,
        where one rank alone would leave and its peers fail in the next collective, each with a line of its own)."""
        self.failed, self.stop = failed, stop

    def saved(self, step: int) -> None:
        self.saved_step = step

    def step(self, step: int, loss: torch.Tensor, norm: torch.Tensor | None, scaler: Any, optimizer: Any) -> None:
        """After optimizer step ``step`` (its scaler not yet updated): this rank's window ``loss``, the global
        ``norm`` (--clip-grad-norm, else None); launches this step's check, reads the previous step's."""
        zero = torch.zeros((), dtype=torch.float32, device=loss.device)
        bad_loss = (~torch.isfinite(loss)).float() * (self.world_size - self.rank)
        norm = norm.to_local() if hasattr(norm, "to_local") else norm  # FSDP2's DTensor: no collective here
        bad_norm = (~torch.isfinite(norm)).float().to(loss.device).reshape(()) if norm is not None else zero
        skipped = zero
        if self.fp16:  # GradScaler's verdict on this step (private: torch names no public one)
            found = scaler._found_inf_per_device(optimizer).values()
            skipped = (sum(value.to(loss.device).sum() for value in found) > 0).float() if found else zero
        failed = zero + float(self.failed())
        flags = torch.stack([bad_loss, bad_norm, skipped, failed]).to(self.comm_device)
        pending = Pending(step, flags)
        if self.world_size > 1:
            pending.work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        if flags.is_cuda:  # the stream waits for the all-reduce, the host for nothing; read at the next step
            if pending.work is not None:
                pending.work.wait()
                pending.work = None
            pending.flags = torch.empty(len(flags), pin_memory=True)
            pending.flags.copy_(flags, non_blocking=True)
            pending.event = torch.cuda.Event()
            pending.event.record()
        previous, self.pending = self.pending, pending
        if previous is not None:
            self.read(previous)

    def settle(self) -> None:
        """The last step's check read now: before a save (nothing non-finite saved) and at the run's end."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.read(pending)

    def read(self, pending: Pending) -> None:
        if pending.work is not None:
            pending.work.wait()
        if pending.event is not None:
            pending.event.synchronize()
        code, bad_norm, skipped, failed = pending.flags.tolist()
        if failed:
            self.stop()
        what = None
        if code:
            what = f"non-finite loss at optimizer step {pending.step} on rank {self.world_size - int(code)}"
        elif bad_norm and not self.fp16:
            what = f"non-finite gradient norm at optimizer step {pending.step} (every rank's: the norm is global)"
        self.skips = self.skips + 1 if skipped else 0
        if what is None and self.skips > MAX_SKIPS:
            what = (f"fp16: GradScaler skipped {self.skips} optimizer steps in a row for non-finite gradients (up "
                    f"to step {pending.step}; more than {MAX_SKIPS}: the gradients are non-finite of themselves)")
        if what is not None:
            kept = ("this run saved no checkpoint" if self.saved_step is None else
                    f"the checkpoint of step {self.saved_step} is still current")
            raise NonFiniteError(f"stopped: {what}; nothing after it was saved ({kept})")
