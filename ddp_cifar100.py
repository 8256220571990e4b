"""Data-parallel CIFAR-100 training: hand-written gradient averaging next to PyTorch's DistributedDataParallel.

    torchrun --standalone --nproc_per_node N ddp_cifar100.py [flags]     (python ddp_cifar100.py: a world of 1)

Every rank holds a full replica of the model and sees its own shard of each epoch's data (DistributedSampler,
seeded by --seed and the epoch). A micro-batch is B samples per rank; K = --grad-accum micro-batches make one
optimizer step, so one step consumes K*B*W samples on W ranks.

Gradient averaging (--grad-sync custom). Let n be the number of samples this rank sees in the current window of
K micro-batches (the same on every rank: the sampler pads the shards to equal length). Each micro-batch's loss
is its summed cross-entropy divided by n, so after K backward passes a rank holds sum_i grad l_i / n over its
n samples; averaging that over W ranks gives

    g = 1/W sum_r 1/n sum_{i in window of r} grad l_i = 1/(W n) sum_{i in window} grad l_i,

the gradient of the mean loss of one batch of K*B*W samples. An epoch whose last window is shorter than K
micro-batches (or whose last micro-batch is short) gets the same formula with its own n, so it still steps with
the exact mean. BatchNorm statistics are taken per micro-batch (over all ranks with SyncBatchNorm), which is what
a single process would do with micro-batches of B*W.

Only the last micro-batch of a window communicates: gradients live in flat buckets (each parameter's .grad is
a view into one), filled in reverse parameter order the way backward produces them. With --sync-mode overlap a
post-accumulate-grad hook counts each bucket's parameters down and, once it is complete, divides it by W and
starts an asynchronous all_reduce (SUM), so communication of late layers overlaps the backward of early ones;
buckets are launched strictly in index order so every rank issues the same collectives in the same order.
--sync-mode after launches every bucket once backward is over. Before the optimizer step all handles are waited
on; with fp16 the gradient scaler unscales the synchronized gradients. The K-1 other micro-batches do no
all_reduce at all. Parameters and buffers are broadcast from rank 0 at start.

--grad-sync ddp does the same with DistributedDataParallel and no_sync() on the K-1 micro-batches.

Validation: rank 0 splits the validation indices into W contiguous shards (sizes differ by at most one), pads
them to equal length with the true length in front, and sends them with dist.scatter; every rank evaluates its
shard with the running BatchNorm statistics (broadcast from rank 0 first) and the float64 loss sums and int64
correct counts are dist.reduce'd to rank 0, so the accuracy equals a single-process evaluation for any world size.

Checkpoints and exact resume: rank 0 writes DIR/last.pt atomically (temporary file, flush, fsync, os.replace)
at epoch ends, every --checkpoint-every steps and when --max-steps stops the run. Nothing random is carried from
step to step: the data order comes from (seed, epoch), CIFAR augmentation from (seed, epoch, rank, micro-batch)
and dropout from a reseed with (seed, rank, optimizer step) before every step, so the checkpoint (model,
optimizer, scheduler, scaler, position in the epoch) is all a resumed run needs to continue bit for bit. On
resume rank 0 reads the file and broadcasts it, so other nodes need no shared file system.

Fault injection, for tests of elastic restarts: DDP_CIFAR100_FAULT="RANK:STEP" makes that rank SIGKILL itself
right after optimizer step STEP, but only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT
unset or 0), so that the restarted group runs through.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import signal
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import utils
from syncbn import SyncBatchNorm

CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
NUM_CLASSES = 100
WARMUP_STEPS = 3  # optimizer steps left out of the step-time statistics (allocator and autograd warm-up)
FAULT_ENV = "DDP_CIFAR100_FAULT"
NORM_TORCH_ON_CPU = "--norm torch (nn.SyncBatchNorm) needs CUDA; use --norm custom or --norm local on the CPU"


class UsageError(Exception):
    """Bad flags or inputs: rank 0 reports it in one line and every rank exits with status 2."""


# ----------------------------------------------------------------------------------------------------------
# Data: uint8 images held in memory (on the training device), batches gathered by index
# ----------------------------------------------------------------------------------------------------------
@dataclass
class ImageSet:
    images: torch.Tensor  # (N, 3, 32, 32) uint8
    labels: torch.Tensor  # (N,) int64
    augment: bool  # random crop (padding 4) + horizontal flip, as torchvision's CIFAR recipe

    def __len__(self) -> int:
        return len(self.labels)

    def to(self, device: torch.device) -> "ImageSet":
        return ImageSet(self.images.to(device), self.labels.to(device), self.augment)

    def batch(self, indices: torch.Tensor, generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalized images (default dtype) and labels of ``indices``; augmentation draws from ``generator``."""
        indices = indices.to(self.images.device)
        images = self.images[indices]
        if self.augment:
            images = random_crop_flip(images, generator)
        mean = torch.tensor(CIFAR100_MEAN, device=images.device).view(1, 3, 1, 1)
        std = torch.tensor(CIFAR100_STD, device=images.device).view(1, 3, 1, 1)
        return (images.to(mean.dtype) / 255 - mean) / std, self.labels[indices]


def random_crop_flip(images: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """RandomCrop(32, padding=4) and RandomHorizontalFlip on a uint8 batch, drawing from ``generator`` (CPU)."""
    n, _, h, w = images.shape
    padded = F.pad(images, (4, 4, 4, 4))  # zero padding, as RandomCrop(padding=4)
    top = torch.randint(0, 9, (n,), generator=generator).to(images.device)
    left = torch.randint(0, 9, (n,), generator=generator).to(images.device)
    flip = (torch.rand(n, generator=generator) < 0.5).to(images.device)
    rows = (top[:, None] + torch.arange(h, device=images.device))[:, None, :, None]
    cols = (left[:, None] + torch.arange(w, device=images.device))[:, None, None, :]
    cols = torch.where(flip[:, None, None, None], cols.flip(-1), cols)
    channels = torch.arange(3, device=images.device)[None, :, None, None]
    batch = torch.arange(n, device=images.device)[:, None, None, None]
    return padded[batch, channels, rows, cols]


def make_synthetic(train_size: int, val_size: int, seed: int) -> tuple[ImageSet, ImageSet]:
    """A deterministic CIFAR-100-shaped set: each class a smooth random prototype image (a common background
    plus its own fainter pattern); each sample its class's prototype shifted by up to 4 pixels, blended with
    another class's (weaker) prototype, colour-jittered per channel and noisy.

    Learnable (the prototypes are fixed) but not at once: shifts, distractors, colour and noise keep accuracy
    rising for several epochs. Labels are uniform over 0..99; train and validation come from separate streams.
    """
    generator = torch.Generator().manual_seed(seed)
    # A shared background plus a fainter class-specific pattern: classes resemble one another.
    coarse = 0.6 * torch.rand(1, 3, 8, 8, generator=generator) + 0.4 * torch.rand(NUM_CLASSES, 3, 8, 8,
                                                                                 generator=generator)
    prototypes = F.interpolate(coarse, size=(40, 40), mode="bicubic", align_corners=False).clamp(0, 1)

    def sample(size: int, stream: int) -> ImageSet:
        g = torch.Generator().manual_seed(seed * 1000 + stream)
        labels = torch.randint(0, NUM_CLASSES, (size,), generator=g)
        images = torch.empty(size, 3, 32, 32, dtype=torch.uint8)
        for start in range(0, size, 4096):  # bounded temporary memory for large sets
            y = labels[start:start + 4096]
            n = len(y)
            top = torch.randint(0, 9, (n,), generator=g)
            left = torch.randint(0, 9, (n,), generator=g)
            rows = (top[:, None] + torch.arange(32))[:, None, :, None]
            cols = (left[:, None] + torch.arange(32))[:, None, None, :]
            idx = torch.arange(n)[:, None, None, None]
            ch = torch.arange(3)[None, :, None, None]
            own = prototypes[y][idx, ch, rows, cols]
            other = prototypes[torch.randint(0, NUM_CLASSES, (n,), generator=g)][idx, ch, rows, cols]
            mix = 0.3 + 0.2 * torch.rand(n, 1, 1, 1, generator=g)
            colour = 0.7 + 0.6 * torch.rand(n, 3, 1, 1, generator=g)
            noise = 0.25 * torch.randn(n, 3, 32, 32, generator=g)
            x = ((1 - mix) * own + mix * other) * colour + noise
            images[start:start + n] = (x.clamp(0, 1) * 255).round().to(torch.uint8)
        return ImageSet(images, labels, augment=False)

    return sample(train_size, 1), sample(val_size, 2)


def load_cifar100(data_dir: str, ctx: utils.DistContext, comm_device: torch.device) -> tuple[ImageSet, ImageSet]:
    """torchvision's CIFAR-100: local rank 0 of each node downloads while the others wait; the test split validates."""
    import torchvision

    failure = ""
    if ctx.local_rank == 0:
        quiet = contextlib.redirect_stdout(io.StringIO()) if ctx.rank != 0 else contextlib.nullcontext()
        previous_timeout = socket.getdefaulttimeout()
        socket.setdefaulttimeout(30)  # torchvision's download sets none: an unreachable mirror must not hang
        try:
            with quiet:
                for train in (True, False):
                    torchvision.datasets.CIFAR100(data_dir, train=train, download=True)
        except Exception as exc:  # no network, bad folder, corrupt archive: all end in the same advice
            failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            socket.setdefaulttimeout(previous_timeout)
    failed = torch.tensor([1 if failure else 0], device=comm_device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # also the barrier the other local ranks wait at
    if failed.item():
        raise UsageError(f"CIFAR-100 is not in --data-dir {data_dir!r} and could not be downloaded"
                         f"{' (' + failure + ')' if failure else ' on another node'}; put it there or use "
                         f"--dataset synthetic")
    sets = []
    for train in (True, False):
        raw = torchvision.datasets.CIFAR100(data_dir, train=train, download=False)
        images = torch.from_numpy(raw.data).permute(0, 3, 1, 2).contiguous()
        sets.append(ImageSet(images, torch.tensor(raw.targets, dtype=torch.int64), augment=train))
    return sets[0], sets[1]


def epoch_order(dataset_size: int, rank: int, world_size: int, seed: int, epoch: int) -> torch.Tensor:
    """This rank's sample indices for ``epoch``: DistributedSampler's shuffled, padded, strided shard."""
    sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=False)
    sampler.set_epoch(epoch)
    return torch.tensor(list(sampler), dtype=torch.int64)


# ----------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------
class Net(nn.Module):
    """The assignment's net; ``dropout`` is dropout2's rate and dropout1 gets half of it (0.25 and 0.5 as given)."""

    def __init__(self, dropout: float = 0.5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 32, 3, 1)
        self.dropout1 = nn.Dropout(dropout / 2)
        self.dropout2 = nn.Dropout(dropout)
        self.fc1 = nn.Linear(6272, 128)
        self.fc2 = nn.Linear(128, NUM_CLASSES)
        self.bn1 = nn.BatchNorm1d(128, affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.fc1(torch.flatten(x, 1))
        x = self.dropout2(F.relu(self.bn1(x)))
        return self.fc2(x)


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A small CIFAR ResNet: a 3x3 stem and one BasicBlock per stage (16, 32, 64 channels), BatchNorm2d throughout."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        blocks, channels = [], widths[0]
        for i, width in enumerate(widths):
            blocks.append(BasicBlock(channels, width, 1 if i == 0 else 2))
            channels = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(channels, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_model(name: str, dropout: float, norm: str) -> nn.Module:
    """The model with its BatchNorm layers as --norm says (local = plain per-process BatchNorm)."""
    model = Net(dropout) if name == "net" else ResNet()
    if norm == "custom":
        model = SyncBatchNorm.convert_sync_batchnorm(model)
    elif norm == "torch":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


# ----------------------------------------------------------------------------------------------------------
# Hand-written gradient averaging
# ----------------------------------------------------------------------------------------------------------
class GradientSync:
    """Averages gradients over the process group in flat buckets, one all_reduce per bucket (see the docstring
    at the top). Call ``prepare(sync)`` before each backward, ``finish()`` before the optimizer step of a window
    and ``zero_grad()`` after it; parameters' .grad are views into the buckets and must not be set to None.

    Buckets follow DistributedDataParallel's sizing: reverse parameter order, the first at most 1 MB, the others
    at most ``bucket_mb``.
    """

    def __init__(self, model: nn.Module, bucket_mb: float, overlap: bool):
        self.world_size = dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        cap_bytes = int(bucket_mb * 2**20)
        buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):
            limit = min(cap_bytes, 2**20) if len(buckets) == 1 else cap_bytes
            nbytes = p.numel() * p.element_size()
            if buckets[-1] and (size + nbytes > limit or p.dtype != buckets[-1][0].dtype):
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        self.flats: list[torch.Tensor] = []
        self.sizes = [len(b) for b in buckets]
        for index, bucket in enumerate(buckets):
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            offset = 0
            for p in bucket:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if overlap:
                    p.register_post_accumulate_grad_hook(partial(self._grad_ready, index))
            self.flats.append(flat)
        self.sync = False
        self.pending: list[int] = []
        self.launched = 0
        self.handles: list[Any] = []

    def prepare(self, sync: bool) -> None:
        """Before a backward: ``sync`` is True only on the last micro-batch of a window."""
        self.sync = sync
        if sync:
            self.pending = list(self.sizes)
            self.launched = 0
            self.handles = []

    def _grad_ready(self, index: int, _param: torch.Tensor) -> None:
        if not self.sync:
            return
        self.pending[index] -= 1
        while self.launched < len(self.flats) and self.pending[self.launched] == 0:
            self._launch()

    def _launch(self) -> None:
        flat = self.flats[self.launched]
        flat.div_(self.world_size)
        self.handles.append(dist.all_reduce(flat, async_op=True))
        self.launched += 1

    def finish(self) -> None:
        """Launch what the hooks have not (all of it in after-backward mode) and wait for every bucket."""
        while self.launched < len(self.flats):
            self._launch()
        for handle in self.handles:
            handle.wait()
        self.handles = []
        self.sync = False

    def zero_grad(self) -> None:
        for flat in self.flats:
            flat.zero_()


def broadcast_state(model: nn.Module, buffers_only: bool = False) -> None:
    """Rank 0's parameters (unless ``buffers_only``) and buffers to every rank."""
    with torch.no_grad():
        tensors = list(model.buffers()) + ([] if buffers_only else list(model.parameters()))
        for t in tensors:
            dist.broadcast(t, src=0)


# ----------------------------------------------------------------------------------------------------------
# Validation: index shards scattered from rank 0, sums reduced to rank 0
# ----------------------------------------------------------------------------------------------------------
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
def evaluate(model: nn.Module, data: ImageSet, batch_size: int, device: torch.device, comm_device: torch.device,
             amp_dtype: torch.dtype | None) -> dict[str, Any]:
    """Loss and accuracy over the whole of ``data`` (exact on rank 0; the other ranks get their shard's figures)."""
    was_training = model.training
    model.eval()
    shard = scatter_shard(len(data), comm_device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # correct, seen
    for start in range(0, len(shard), batch_size):
        images, labels = data.batch(shard[start:start + batch_size])
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits = model(images)
        loss_sum += F.cross_entropy(logits.float() if amp_dtype else logits, labels, reduction="none").double().sum()
        counts[0] += (logits.argmax(1) == labels).sum()
        counts[1] += len(labels)
    loss_sum, counts = loss_sum.to(comm_device), counts.to(comm_device)
    dist.reduce(loss_sum, dst=0)
    dist.reduce(counts, dst=0)
    model.train(was_training)
    correct, total = int(counts[0]), int(counts[1])
    return {"val_loss": float(loss_sum) / max(total, 1), "val_acc": correct / max(total, 1),
            "val_correct": correct, "val_total": total}


# ----------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------
def trajectory_config(args: argparse.Namespace, world_size: int, schedule_steps: int) -> dict[str, Any]:
    """The settings that decide the sequence of weights; a checkpoint resumes only a run that agrees on all."""
    config = {key: getattr(args, key) for key in
              ("model", "dataset", "batch_size", "grad_accum", "epochs", "lr", "momentum", "weight_decay",
               "scheduler", "amp", "seed")}
    config["dropout"] = args.dropout if args.model == "net" else None
    config["sizes"] = [args.train_size, args.val_size] if args.dataset == "synthetic" else None
    config["norm"] = "local" if args.norm == "local" else "synchronized"  # custom and torch compute the same
    config["world_size"] = world_size
    config["schedule_steps"] = schedule_steps if args.scheduler == "onecycle" else None
    return config


def fingerprint(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically: a crash leaves the old file or the new one, never half of one."""
    with utils.atomic_write(path, "wb") as f:
        torch.save(state, f)


def read_checkpoint(path: str) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UsageError(f"cannot read checkpoint {path}: corrupt or not written by torch.save "
                         f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}); "
                         f"delete it to start afresh") from None
    required = ("model", "optimizer", "scheduler", "scaler", "epoch", "micro_batch", "optimizer_steps",
                "micro_batches_total", "fingerprint", "config", "history", "epoch_sums")
    if not isinstance(state, dict) or any(key not in state for key in required):
        raise UsageError(f"cannot read checkpoint {path}: not a checkpoint of this script; delete it to start afresh")
    return state


def load_on_rank0(path: str) -> dict[str, Any] | None:
    """Rank 0 reads ``path`` (if it exists) and broadcasts it, so other nodes need not see the file."""
    message: list[Any] = [None]
    if dist.get_rank() == 0 and os.path.exists(path):
        try:
            message[0] = ("ok", read_checkpoint(path))
        except UsageError as exc:
            message[0] = ("error", str(exc))
    dist.broadcast_object_list(message, src=0)
    if message[0] is None:
        return None
    status, payload = message[0]
    if status == "error":
        raise UsageError(payload)
    return payload


def check_compatible(state: dict[str, Any], config: dict[str, Any], path: str) -> None:
    if state["fingerprint"] == fingerprint(config):
        return
    saved = state["config"]
    differences = [f"{key} {saved.get(key)!r} != {config.get(key)!r}" for key in sorted(config)
                   if saved.get(key) != config.get(key)]
    raise UsageError(f"checkpoint {path} is from another configuration ({', '.join(differences) or 'fingerprint'})"
                     f"; use another --checkpoint-dir or delete it")


# ----------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------
@dataclass
class StepTimer:
    """Optimizer-step times: perf_counter on the CPU, CUDA events on a GPU (read once per epoch, no extra syncs)."""
    device: torch.device
    times_ms: list[float] = field(default_factory=list)
    _events: list[Any] = field(default_factory=list)
    _start: Any = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self.times_ms.append((time.perf_counter() - self._start) * 1e3)

    def collect(self) -> None:
        if self._events:
            self._events[-1][1].synchronize()
            self.times_ms.extend(start.elapsed_time(end) for start, end in self._events)
            self._events = []


def step_seed(seed: int, rank: int, step: int) -> int:
    """The dropout seed of one optimizer step on one rank: a function of nothing that would need saving."""
    return ((seed * 1_000_003 + rank) * 1_000_003 + step) % (2**63)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the training (or evaluation) ``args`` describe; returns the metrics and, on every rank, the model."""
    wall_start = time.perf_counter()
    ctx = utils.init_distributed(args.device, args.backend, args.timeout)
    device, world_size, rank = ctx.device, ctx.world_size, ctx.rank
    comm_device = device if ctx.backend == "nccl" else torch.device("cpu")
    if args.norm == "torch" and device.type != "cuda":
        raise UsageError(NORM_TORCH_ON_CPU)
    amp_dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]

    if args.dataset == "synthetic":
        train_set, val_set = make_synthetic(args.train_size, args.val_size, args.seed)
    else:
        train_set, val_set = load_cifar100(args.data_dir, ctx, comm_device)
    train_set, val_set = train_set.to(device), val_set.to(device)

    torch.manual_seed(args.seed)
    model = build_model(args.model, args.dropout, args.norm).to(device)
    broadcast_state(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    per_rank = len(epoch_order(len(train_set), rank, world_size, args.seed, 0))
    micro_batches_per_epoch = math.ceil(per_rank / args.batch_size)
    steps_per_epoch = math.ceil(micro_batches_per_epoch / args.grad_accum)
    schedule_steps = args.epochs * steps_per_epoch
    if args.max_steps:
        schedule_steps = min(schedule_steps, args.max_steps)
    scheduler = None
    if args.scheduler == "onecycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=schedule_steps)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    config = trajectory_config(args, world_size, schedule_steps)

    checkpoint_path = os.path.join(args.checkpoint_dir, "last.pt") if args.checkpoint_dir else None
    epoch, micro_batch, optimizer_steps, micro_batches_done = 0, 0, 0, 0
    history: list[dict[str, Any]] = []
    epoch_sums = [0.0, 0.0, 0.0]  # loss sum, correct, samples of the current epoch on this rank
    state = load_on_rank0(checkpoint_path) if checkpoint_path else None
    if state is not None:
        if args.eval_only:
            try:
                model.load_state_dict(state["model"])
            except RuntimeError as exc:
                raise UsageError(f"checkpoint {checkpoint_path} does not fit --model {args.model}: "
                                 f"{str(exc).splitlines()[0]}") from None
            optimizer_steps, micro_batches_done = state["optimizer_steps"], state["micro_batches_total"]
            history = list(state["history"])
        else:
            check_compatible(state, config, checkpoint_path)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            if scheduler is not None:
                scheduler.load_state_dict(state["scheduler"])
            scaler.load_state_dict(state["scaler"])
            epoch, micro_batch = state["epoch"], state["micro_batch"]
            optimizer_steps, micro_batches_done = state["optimizer_steps"], state["micro_batches_total"]
            history = list(state["history"])
            epoch_sums = list(state["epoch_sums"][rank]) if micro_batch else [0.0, 0.0, 0.0]
            utils.print0(f"resuming from {checkpoint_path}: epoch {epoch + 1}, micro-batch {micro_batch}, "
                         f"optimizer step {optimizer_steps}")

    grad_sync = None
    train_model: nn.Module = model
    if args.grad_sync == "ddp":
        train_model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                              bucket_cap_mb=args.bucket_mb, forward_sync_buffers=False,
                                              gradient_as_bucket_view=True)
    else:
        grad_sync = GradientSync(model, args.bucket_mb, overlap=args.sync_mode == "overlap")

    writer = None
    if rank == 0 and args.log_dir:
        from torch.utils.tensorboard import SummaryWriter  # slow to import; only when asked for
        writer = SummaryWriter(args.log_dir)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    utils.print0(f"{args.model} ({trainable:,} parameters) on {world_size} x {device.type} ({ctx.backend}), "
                 f"grad-sync {args.grad_sync}, norm {args.norm}, {args.batch_size} x {args.grad_accum} x "
                 f"{world_size} samples per step, {steps_per_epoch} steps per epoch")

    def gather_epoch_sums(sums: list[float]) -> list[list[float]]:
        gathered = torch.tensor(sums, dtype=torch.float64, device=comm_device)
        everyone = [torch.empty_like(gathered) for _ in range(world_size)]
        dist.all_gather(everyone, gathered)
        return [t.tolist() for t in everyone]

    def checkpoint(next_epoch: int, next_micro_batch: int, sums: list[list[float]]) -> None:
        if checkpoint_path is None:
            return
        if rank == 0:
            save_checkpoint(checkpoint_path, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "scaler": scaler.state_dict(), "epoch": next_epoch, "micro_batch": next_micro_batch,
                "optimizer_steps": optimizer_steps, "micro_batches_total": micro_batches_done,
                "history": history, "epoch_sums": sums, "fingerprint": fingerprint(config), "config": config,
                "rng_seed": args.seed,  # every random draw derives from it and the position (module docstring)
            })

    fault_rank, fault_step = -1, -1
    if os.environ.get(FAULT_ENV) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        fault_rank, fault_step = (int(v) for v in os.environ[FAULT_ENV].split(":"))

    timer = StepTimer(device)
    utils.reset_peak_memory(device)
    train_time, samples_trained, run_steps = 0.0, 0, 0
    final = None  # the figures of an epoch cut short by --max-steps

    def steps_left() -> bool:
        return epoch < args.epochs and not (args.max_steps and optimizer_steps >= args.max_steps)

    while not args.eval_only and final is None and steps_left():
        epoch_start = time.perf_counter()
        order = epoch_order(len(train_set), rank, world_size, args.seed, epoch)
        batches = list(torch.split(order, args.batch_size))
        sums = torch.tensor(epoch_sums, dtype=torch.float64, device=device)
        epoch_samples, next_micro_batch, stopped = 0, micro_batch, False
        bar = tqdm(total=steps_per_epoch, initial=micro_batch // args.grad_accum, desc=f"epoch {epoch + 1}",
                   disable=not (rank == 0 and sys.stderr.isatty()), leave=False)
        model.train()
        for window_start in range(micro_batch, len(batches), args.grad_accum):
            window = range(window_start, min(window_start + args.grad_accum, len(batches)))
            window_samples = sum(len(batches[j]) for j in window)
            torch.manual_seed(step_seed(args.seed, rank, optimizer_steps))  # dropout
            timer.start()
            for j in window:
                augment = torch.Generator().manual_seed(step_seed(args.seed + epoch, rank, j))
                images, labels = train_set.batch(batches[j], augment)
                last = j == window[-1]
                if grad_sync is not None:
                    grad_sync.prepare(sync=last)
                no_sync = train_model.no_sync() if grad_sync is None and not last else contextlib.nullcontext()
                with no_sync:
                    with torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                                        enabled=amp_dtype is not None):
                        logits = train_model(images)
                        per_sample = F.cross_entropy(logits.float() if amp_dtype else logits, labels,
                                                     reduction="none")
                    scaler.scale(per_sample.sum() / window_samples).backward()
                with torch.no_grad():
                    sums[0] += per_sample.detach().double().sum()
                    sums[1] += (logits.argmax(1) == labels).sum()
                    sums[2] += len(labels)
            if grad_sync is not None:
                grad_sync.finish()
            scaler.unscale_(optimizer)  # after the sync: every rank unscales (and inf-checks) the same gradients
            scaler.step(optimizer)
            scaler.update()
            if scheduler is not None:
                scheduler.step()
            if grad_sync is not None:
                grad_sync.zero_grad()
            else:
                optimizer.zero_grad(set_to_none=True)
            timer.stop()
            optimizer_steps += 1
            run_steps += 1
            micro_batches_done += len(window)
            epoch_samples += window_samples * world_size
            next_micro_batch = window[-1] + 1
            bar.update(1)
            if not bar.disable and bar.n % 10 == 0:
                bar.set_postfix(loss=f"{float(sums[0] / sums[2]):.3f}")
            stopped = bool(args.max_steps) and optimizer_steps >= args.max_steps
            at_interval = args.checkpoint_every and optimizer_steps % args.checkpoint_every == 0
            if (stopped or at_interval) and next_micro_batch < len(batches):
                checkpoint(epoch, next_micro_batch, gather_epoch_sums(sums.tolist()))
            if rank == fault_rank and optimizer_steps == fault_step:
                os.kill(os.getpid(), signal.SIGKILL)  # fault injection (see the module docstring)
            if stopped:
                break
        bar.close()
        timer.collect()
        epoch_train_time = time.perf_counter() - epoch_start
        train_time += epoch_train_time
        samples_trained += epoch_samples
        all_sums = gather_epoch_sums(sums.tolist())
        loss_sum, correct, seen = (sum(column) for column in zip(*all_sums))
        broadcast_state(model, buffers_only=True)  # evaluate with rank 0's running statistics everywhere
        val = evaluate(model, val_set, max(args.batch_size, 256), device, comm_device, amp_dtype)
        entry = {"epoch": epoch + 1, "optimizer_steps": optimizer_steps, "train_loss": loss_sum / max(seen, 1),
                 "train_acc": correct / max(seen, 1), **val, "epoch_time_s": time.perf_counter() - epoch_start,
                 "samples_per_s": epoch_samples / max(epoch_train_time, 1e-9), "lr": optimizer.param_groups[0]["lr"]}
        complete = next_micro_batch >= len(batches)
        if complete:
            history.append(entry)
            epoch, micro_batch, epoch_sums = epoch + 1, 0, [0.0, 0.0, 0.0]
            checkpoint(epoch, 0, [[0.0, 0.0, 0.0]] * world_size)
        else:
            final = dict(entry, complete=False)
        if writer is not None:
            for key in ("train_loss", "train_acc", "val_loss", "val_acc", "samples_per_s", "lr"):
                writer.add_scalar(key, entry[key], optimizer_steps)
        utils.print0(f"epoch {entry['epoch']}/{args.epochs}{'' if complete else ' (stopped by --max-steps)'} | "
                     f"train loss {entry['train_loss']:.4f} acc {100 * entry['train_acc']:.2f}% | "
                     f"val loss {entry['val_loss']:.4f} acc {100 * entry['val_acc']:.2f}% "
                     f"({entry['val_correct']}/{entry['val_total']}) | {entry['samples_per_s']:.0f} samples/s | "
                     f"{entry['epoch_time_s']:.1f} s")
    if writer is not None:
        writer.close()

    if final is None and run_steps and history:
        final = history[-1]
    if final is None:  # --eval-only, or a checkpoint with nothing left to train
        broadcast_state(model, buffers_only=True)
        val = evaluate(model, val_set, max(args.batch_size, 256), device, comm_device, amp_dtype)
        final = {"train_loss": history[-1]["train_loss"] if history else None, **val}
        utils.print0(f"evaluation | val loss {val['val_loss']:.4f} acc {100 * val['val_acc']:.2f}% "
                     f"({val['val_correct']}/{val['val_total']})")
    steps = timer.times_ms[WARMUP_STEPS:] if len(timer.times_ms) > WARMUP_STEPS else timer.times_ms
    metrics = {
        "world_size": world_size, "device": device.type, "backend": ctx.backend,
        "optimizer_steps": optimizer_steps, "micro_batches": micro_batches_done,
        "trainable_parameters": trainable,
        "train_loss": final["train_loss"], "val_loss": final["val_loss"], "val_acc": final["val_acc"],
        "val_correct": final["val_correct"], "val_total": final["val_total"],
        "peak_memory_mb": utils.max_across_ranks(utils.peak_memory_mb(device)),
        "wall_time_s": time.perf_counter() - wall_start, "train_time_s": train_time,
        "samples_per_s": samples_trained / train_time if train_time else 0.0,
        "step_time_ms_median": statistics.median(steps) if steps else None,
        "step_time_ms_p10": percentile(steps, 10), "step_time_ms_p90": percentile(steps, 90),
        "step_time_ms_mean": statistics.fmean(steps) if steps else None,
        "step_time_warmup_steps": len(timer.times_ms) - len(steps), "step_times_ms": [round(t, 4) for t in steps],
        "epochs": history + ([final] if final.get("complete") is False else []),
        "fingerprint": fingerprint(config), "config": vars(args),
    }
    if rank == 0 and args.metrics_out:
        utils.write_json(args.metrics_out, metrics)
    metrics["model"] = model  # for in-process callers (tests); not part of the JSON
    return metrics


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line, from rank 0) instead of printing usage on every rank."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--dataset", choices=("cifar100", "synthetic"), default="cifar100")
    add("--data-dir", default="data", help="where CIFAR-100 is (or is downloaded to by local rank 0)")
    add("--train-size", type=int, default=10000, help="synthetic training set size")
    add("--val-size", type=int, default=2000, help="synthetic validation set size")
    add("--model", choices=("net", "resnet"), default="net")
    add("--dropout", type=float, default=0.5, help="net: dropout2 rate, dropout1 gets half (0 disables both)")
    add("--grad-sync", choices=("custom", "ddp"), default="custom")
    add("--sync-mode", choices=("overlap", "after"), default="overlap",
        help="custom: all_reduce buckets from gradient hooks during backward, or after it")
    add("--bucket-mb", type=float, default=25.0, help="gradient bucket size cap (DDP's bucket_cap_mb)")
    add("--norm", choices=("custom", "torch", "local"), default="custom")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add("--batch-size", type=int, default=128, help="per-process micro-batch")
    add("--epochs", type=int, default=10)
    add("--max-steps", type=int, default=0, help="stop after this many optimizer steps in all (0: no limit)")
    add("--lr", type=float, default=0.05)
    add("--momentum", type=float, default=0.9)
    add("--weight-decay", type=float, default=5e-4)
    add("--scheduler", choices=("none", "onecycle"), default="none")
    add("--amp", choices=("off", "bf16", "fp16"), default="off")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    add("--seed", type=int, default=0)
    add("--checkpoint-dir", default=None, help="DIR/last.pt is written by rank 0 and resumed from when present")
    add("--checkpoint-every", type=int, default=0, help="also checkpoint every N optimizer steps (0: epoch ends)")
    add("--eval-only", action="store_true", help="evaluate DIR/last.pt (or the fresh model) and exit")
    add("--log-dir", default=None, help="TensorBoard scalars from rank 0")
    add("--metrics-out", default=None, help="JSON summary from rank 0")
    add("--timeout", type=float, default=1800.0, help="seconds, for process-group set-up and collectives")
    args = parser.parse_args(argv)
    positive = {"--grad-accum": args.grad_accum, "--batch-size": args.batch_size, "--epochs": args.epochs,
                "--train-size": args.train_size, "--val-size": args.val_size, "--lr": args.lr,
                "--bucket-mb": args.bucket_mb, "--timeout": args.timeout}
    for flag, value in positive.items():
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    for flag, value in {"--max-steps": args.max_steps, "--checkpoint-every": args.checkpoint_every,
                        "--momentum": args.momentum, "--weight-decay": args.weight_decay}.items():
        if value < 0:
            raise UsageError(f"{flag} must not be negative, got {value}")
    if not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
    return args


def is_distributed_failure(exc: BaseException) -> bool:
    """A peer that never joined, died or stalled past --timeout (gloo raises some of these as RuntimeError)."""
    if isinstance(exc, dist.DistError):
        return True
    message = str(exc).lower()
    return any(marker in message for marker in ("gloo", "nccl", "connection closed by peer", "connection reset",
                                                "timed out", "timeout"))


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", 0))
    launched_by_torchrun = utils.launched_by_torchrun()
    try:
        args = parse_args(argv)
        if args.norm == "torch" and (args.device == "cpu" or not torch.cuda.is_available()):
            raise UsageError(NORM_TORCH_ON_CPU)  # before the process group: no rank waits for another
        train(args)
        dist.barrier()  # destroy the group together (rank 0 may still be writing the metrics), as c10d advises
        return 0
    except UsageError as exc:
        if rank == 0:
            print(f"ddp_cifar100.py: error: {exc}", file=sys.stderr, flush=True)
        elif launched_by_torchrun:
            time.sleep(5)  # torchrun stops the group when one worker exits: let rank 0 be heard first
        return 2
    except RuntimeError as exc:
        if not is_distributed_failure(exc):
            raise  # a bug: keep its traceback
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"ddp_cifar100.py: rank {rank}: distributed failure (peer missing, dead or past --timeout): "
              f"{first_line[:300]}", file=sys.stderr, flush=True)
        return 1
    finally:
        utils.cleanup_distributed()


if __name__ == "__main__":
    sys.exit(main())
