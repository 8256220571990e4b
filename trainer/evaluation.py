"""Evaluation: exact validation at any world size.

Rank 0 splits the validation indices into W contiguous shards (sizes differ by at most one), pads them to equal
length with the true length in front, and sends them with dist.scatter; every rank evaluates its shard with the
running BatchNorm statistics (broadcast from rank 0 first) and the float64 loss sums and int64 top-1/top-5 counts
are dist.reduce'd to rank 0, so the accuracy equals a single-process evaluation for any world size. With the
parameters sharded (--zero 3, FSDP2) every forward is a collective: every rank runs as many forwards as the busiest
(empty batches for the others). diloco and localsgd evaluate the replicas' shared point.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import sys
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from data import FolderData, MemoryData, TextData
from measure.memory import measured_phase
from trainer.build import Parts
from zero.broadcast import broadcast_state


def scatter_shard(total: int, comm_device: torch.device) -> torch.Tensor:
    """This rank's contiguous slice of range(total), sent by rank 0 with dist.scatter.

    dist.scatter needs tensors of one size: each shard is padded to ceil(total / W) and carries its true
    length in front.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    width = math.ceil(total / world_size) + 1
    received = torch.empty(width, dtype=torch.int64, device=comm_device)
    shards = None
    if rank == 0:
        shards = []
        for shard in torch.tensor_split(torch.arange(total, dtype=torch.int64), world_size):
            message = torch.full((width,), -1, dtype=torch.int64)
            message[0] = len(shard)
            message[1:1 + len(shard)] = shard
            shards.append(message.to(comm_device))
    dist.scatter(received, shards, src=0)
    return received[1:1 + int(received[0])].cpu()


@torch.no_grad()
def evaluate(model: nn.Module, data: MemoryData | FolderData | TextData, batch_size: int, device: torch.device,
             comm_device: torch.device, amp_dtype: torch.dtype | None,
             empty_batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, Any]:
    """Loss, top-1 and top-5 accuracy over all of ``data``'s validation set (exact on rank 0; the other ranks
    get their shard's figures): per image, or for text per predicted byte (every position of every window).

    ``empty_batch`` (inputs and labels of no sample): the model gathers its parameters in every forward (--zero
    3, FSDP2), which every rank must join, so a rank whose shard has fewer batches runs this one until it has run
    as many forwards as the busiest rank."""
    was_training = model.training
    model.eval()
    shard = scatter_shard(data.val_size, comm_device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    counts = torch.zeros(3, dtype=torch.int64, device=device)  # correct top-1, correct top-5, seen
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = data.val_batches(shard, batch_size)
    forwards = own = math.ceil(len(shard) / batch_size)
    if empty_batch is not None:
        most = torch.tensor([own], device=comm_device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        forwards = int(most)
        batches = itertools.chain(batches, itertools.repeat(empty_batch, forwards - own))
    # rank 0's bar, on a terminal: at --zero 3 each forward gathers the whole model, so a small batch makes a long
    # evaluation
    bar = tqdm(batches, total=forwards, desc="evaluating", unit="batch", leave=False,
               disable=not (dist.get_rank() == 0 and sys.stderr.isatty()))
    for images, labels in bar:
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits = model(images)
        logits, labels = logits.flatten(0, -2), labels.flatten()  # text: every position is a prediction
        loss_sum += F.cross_entropy(logits.float() if amp_dtype else logits, labels, reduction="none").double().sum()
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        counts[0] += (logits.argmax(1) == labels).sum()
        counts[1] += (top5 == labels[:, None]).any(1).sum()
        counts[2] += len(labels)
    loss_sum, counts = loss_sum.to(comm_device), counts.to(comm_device)
    dist.reduce(loss_sum, dst=0)
    dist.reduce(counts, dst=0)
    model.train(was_training)
    correct, correct5, total = (int(c) for c in counts)
    return {"val_loss": float(loss_sum) / max(total, 1), "val_acc": correct / max(total, 1),
            "val_acc5": correct5 / max(total, 1), "val_correct": correct, "val_correct5": correct5,
            "val_total": total}


@measured_phase("evaluation")
def validate(parts: Parts) -> dict[str, Any]:
    """The validation figures of the model as it stands (rank 0's are exact; see the module docstring)."""
    broadcast_state(parts.model, buffers_only=True)  # evaluate with rank 0's running statistics everywhere
    config, device = parts.config, parts.device
    empty = None
    if config.zero == 3 or config.grad_sync == "fsdp":  # parameters gathered in every forward
        if config.dataset == "text":
            empty = 2 * (torch.zeros(0, config.context, dtype=torch.int64, device=device),)
        else:
            empty = (torch.zeros(0, 3, config.image_size, config.image_size, device=device),
                     torch.zeros(0, dtype=torch.int64, device=device))
    # diloco, localsgd: the replicas differ inside a window; the model evaluated is their shared point
    with parts.outer.global_weights() if parts.outer is not None else contextlib.nullcontext():
        return evaluate(parts.model, parts.data, config.eval_batch_size, device, parts.comm_device,
                        parts.amp_dtype, empty)
