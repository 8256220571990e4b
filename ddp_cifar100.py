"""Data-parallel training of image classifiers and byte-level GPTs: hand-written gradient averaging and ZeRO sharding
next to PyTorch's DistributedDataParallel, ZeroRedundancyOptimizer and FSDP2, on CIFAR-100, a synthetic set, any
image folder up to ImageNet scale, or text.

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

The averaging itself is gradsync.py's: flat buckets all-reduced from gradient hooks while backward runs, none on
the K-1 other micro-batches (--sync-mode, --bucket-mb, --allreduce torch|ring|butterfly); --grad-sync ddp does
the same with DistributedDataParallel. Parameters and buffers are broadcast from rank 0 at start.

Data (data.py): CIFAR-100 and the synthetic set in memory on the training device, or an image folder
(--dataset imagefolder) decoded and augmented by DataLoader workers (--workers). Models: models.py.

Language models (--dataset text --model gpt|gpt2): a sample is a window of --context bytes of text and its labels
the next byte at each position; the loss of a window is the mean over its positions, so with every window of the
same length the formula above holds per byte, and val_loss is in nats per byte (val_bits_per_byte = val_loss /
ln 2, printed beside gzip -9's bits per byte on the same validation bytes). The recipe is flags: --optimizer adamw
--betas, --norm-weight-decay (decay on matrices only), --clip-grad-norm, --scheduler cosine --warmup-steps
--min-lr --decay-steps. --generate N samples N bytes from a checkpoint's GPT and exits.

Data parallelism over slow links (--grad-sync diloco|localsgd, diloco.py): --replicas R groups of W/R processes,
each trained by the loop above over its own process group (zero.shard's group=, --zero 0-2; SyncBatchNorm over the
replica), meeting every --local-steps H optimizer steps: an outer all-reduce of the pseudo-gradients over the
ranks at the same place in every replica (on diloco.py's ring, --outer-compress, --fragments, --outer-delay) and
an outer step (--outer-optimizer, --outer-lr, --outer-momentum; localsgd: averaging). Validation evaluates the
shared point; a checkpoint holds each replica's weights, optimizer and outer state. --eval-every N validates every
N steps for curves of loss against training time and bytes sent.

Validation: rank 0 splits the validation indices into W contiguous shards (sizes differ by at most one), pads
them to equal length with the true length in front, and sends them with dist.scatter; every rank evaluates its
shard with the running BatchNorm statistics (broadcast from rank 0 first) and the float64 loss sums and int64
top-1/top-5 counts are dist.reduce'd to rank 0, so the accuracy equals a single-process evaluation for any world
size.

Sharded data parallelism (--zero 1|2|3): zero.shard, whose contract this loop uses and nothing else:
sync.set_requires_gradient_sync before each backward, sync.clip_grad_norm_ (--clip-grad-norm), the optimizer
built by sync.optimizer over the model's own parameters (--norm-weight-decay: two groups), optimizer.step() and
zero_grad(), the state dicts; the loop is the same at every stage. --grad-sync ddp (--zero 1:
ZeroRedundancyOptimizer) and fsdp (FSDP2's fully_shard on the same units as stage 3) are references.py's, behind
the same interface. With the parameters sharded every forward is a collective: the scattered validation has
every rank run as many forwards as the busiest (empty batches for the others). --metrics-out reports
state_bytes, sent_bytes_per_step and at stage 3 gathered_peak (zero.py and the README say what they count).

Checkpoints and exact resume: rank 0 writes DIR/last.pt atomically (temporary file, flush, fsync, os.replace)
at epoch ends, every --checkpoint-every steps and when --max-steps stops the run. Nothing random is carried from
step to step: the data order comes from (seed, epoch), each sample's augmentation (in memory or from an image folder)
from (seed, epoch, sample index) and dropout from a reseed with (seed, rank,
optimizer step) before every step, so the checkpoint (model, optimizer, scheduler, scaler, position in the epoch)
is all a resumed run needs to continue bit for bit; a resumed image-folder run decodes none of the samples it
skips. On resume rank 0 reads the file and broadcasts it, so other nodes need no shared file system.
"model" is the bare model's full state_dict and "optimizer" torch.optim's state_dict over the model's trainable
parameters numbered group by group, whatever --zero or --grad-sync (the sharded stages gather their shards to rank
0's CPU one bucket or unit at a time; FSDP2's DTensors are made whole), so any stage at any world size loads it.
A run is identified by its global batch (batch size x grad-accum x processes), not by its number of processes:
micro-batch j of an epoch holds the same B x W samples (the sampler's order, rank r taking every W-th) and
SyncBatchNorm normalizes over all of them, however they are split, so a run stopped on 2 processes resumes on 4 with
--batch-size halved and ends where it would have, up to float summation order; this is what torchrun's elastic
restarts need when a node is lost (--nnodes MIN:MAX). A resume that changes the global batch is refused with the
--batch-size that keeps it; one whose weights depend on the split (--norm local, dropout) says so and goes on. (The
micro-batches are the same where the training set divides evenly over both numbers of processes; otherwise
DistributedSampler pads each rank's shard by repeating samples, and how many depends on W.)

Bit-for-bit claims (resume, restarts, two nodes, custom == DDP) are facts of the CPU kernels. On CUDA,
convolutions pick nondeterministic algorithms unless asked: --deterministic sets
torch.use_deterministic_algorithms (warn_only: ops without a deterministic CUDA kernel, such as adaptive average
pooling's backward in the ResNets, warn instead of stopping, and break the claim where they warn), turns off
cuDNN benchmarking and sets CUBLAS_WORKSPACE_CONFIG.

Seeing inside a step: every --log-every N optimizer steps rank 0 writes the means of those steps (train/loss over
its own samples, train/lr, train/step_ms, train/data_wait_ms, train/samples_per_s) to TensorBoard and the bar,
reading the device's loss sum once per N steps. --profile DIR runs torch.profiler over --profile-steps A:B on
every rank (DIR/rank<R>.pt.trace.json) with named ranges: micro-batch i/K (sync or no sync), forward, backward,
gradsync.py's "allreduce bucket I (S)" and "allreduce wait" (zero.py's "reduce_scatter"/"all_gather bucket I",
and at stage 3 "unit I forward", "unit I backward", "all_gather unit I (S)", "reduce_scatter unit I (S)"),
syncbn's collectives, optimizer step. Without
--profile no profiler exists and no range is made.

torch.compile: --compile (or --compile forward) compiles the model's forward into one graph at its first call,
--compile blocks each block's forward apart; hooks stay eager either way (compile_forward says what each keeps of
the gradient buckets' overlap with the backward). --compile-backend picks the backend (inductor by default).

Fault injection, for tests of elastic restarts: DDP_CIFAR100_FAULT="RANK:STEP" makes that rank SIGKILL itself
right after optimizer step STEP, but only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT
unset or 0), so that the restarted group runs through.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import itertools
import json
import math
import os
import signal
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import utils
import zero
from diloco import DiLoCo, data_parallel_bytes, encoded_bytes
from data import FolderData, MemoryData, TextData, default_text_dir, derive_seed, load_data
from gradsync import DataParallel, broadcast_state
from models import GPT, GPT_SIZES, LANGUAGE_MODELS, MODELS, blocks, build_model
from references import DDPSync, FSDPSync
from utils import UsageError

WARMUP_STEPS = 3  # optimizer steps left out of the step-time statistics (allocator and autograd warm-up)
PROFILE_STEPS = f"{WARMUP_STEPS}:{WARMUP_STEPS + 3}"  # --profile's default window: 3 steps after the warm-up
FAULT_ENV = "DDP_CIFAR100_FAULT"
OURS = ("custom", "diloco", "localsgd")  # the syncs built on zero.shard
COMPILE_SCOPES = ("forward", "blocks")  # what --compile compiles: the model's forward, or each block's
DILOCO_FLAGS = ("grad_sync", "replicas", "local_steps", "outer_optimizer", "outer_lr", "outer_momentum",
                "outer_compress", "fragments", "outer_delay")
NORM_TORCH_ON_CPU = ("--norm torch (nn.SyncBatchNorm) needs CUDA: use --device cuda (with a GPU), or --norm custom "
                     "or --norm local on the CPU")


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
def evaluate(model: nn.Module, data: MemoryData | FolderData, batch_size: int, device: torch.device,
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
    if empty_batch is not None:
        own = math.ceil(len(shard) / batch_size)
        forwards = torch.tensor([own], device=comm_device)
        dist.all_reduce(forwards, op=dist.ReduceOp.MAX)
        batches = itertools.chain(batches, itertools.repeat(empty_batch, int(forwards) - own))
    for images, labels in batches:
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


# ----------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------
def trajectory_config(args: argparse.Namespace, world_size: int, schedule_steps: int,
                      data: MemoryData | FolderData) -> dict[str, Any]:
    """The settings that decide the sequence of weights; a checkpoint resumes only a run that agrees on all."""
    config = {key: getattr(args, key) for key in
              ("model", "dataset", "grad_accum", "epochs", "optimizer", "lr", "momentum", "weight_decay",
               "scheduler", "amp", "seed", "augment", "image_size")}
    # named only when given, so that a checkpoint from before these flags existed still resumes without them
    config.update({key: getattr(args, key) for key in ("norm_weight_decay", "clip_grad_norm", "betas",
                                                       "warmup_steps", "min_lr") if getattr(args, key) is not None})
    if args.dataset == "text":  # the GPT's shape too, so that --generate can rebuild it from the checkpoint
        config.update(context=args.context, val_fraction=args.val_fraction,
                      gpt=dict(GPT_SIZES[args.model], context=args.context))
    # A run is its global batch, not its number of processes: B x K x W samples per step (the same sample
    # order, and SyncBatchNorm's statistics over the same B x W samples per micro-batch, for any split).
    config["global_batch"] = args.batch_size * args.grad_accum * world_size
    config["dropout"] = args.dropout if args.model == "net" else None
    config["sizes"] = [len(data.train), data.val_size, data.num_classes] if args.dataset != "cifar100" else None
    config["norm"] = "local" if args.norm == "local" else "synchronized"  # custom and torch compute the same
    config["schedule_steps"] = schedule_steps if args.scheduler in ("onecycle", "cosine") else None
    if args.grad_sync in ("diloco", "localsgd"):  # the replicas are processes: their number is the run's too
        config.update(world_size=world_size, diloco={key: getattr(args, key) for key in DILOCO_FLAGS})
    return config


def split_dependent(args: argparse.Namespace) -> list[str]:
    """What makes the weights depend on how the global batch is split over processes, not on the batch alone."""
    reasons = []
    if args.norm == "local":
        reasons.append("--norm local (each process normalizes its own samples)")
    if args.model == "net" and args.dropout > 0:
        reasons.append("dropout (masks drawn per process)")
    return reasons


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


def check_compatible(state: dict[str, Any], config: dict[str, Any], path: str, args: argparse.Namespace,
                     world_size: int) -> None:
    """Refuse a checkpoint of another run in one line; a changed global batch names the --batch-size that keeps
    it on this many processes."""
    if state["fingerprint"] == fingerprint(config):
        return
    saved = state["config"]
    if "global_batch" in saved and saved["global_batch"] != config["global_batch"] \
            and saved.get("grad_accum") == args.grad_accum:
        saved_size, saved_world = saved["global_batch"] // (args.grad_accum * state["world_size"]), state["world_size"]
        per_process, rest = divmod(saved["global_batch"], args.grad_accum * world_size)
        advice = (f"--batch-size {per_process} keeps it on {world_size} processes" if per_process and not rest else
                  f"no --batch-size keeps it on {world_size} processes with --grad-accum {args.grad_accum}")
        raise UsageError(f"checkpoint {path} is from a run with a global batch of {saved['global_batch']} "
                         f"(batch size x grad-accum x processes = {saved_size} x {args.grad_accum} x {saved_world}), "
                         f"not {config['global_batch']}: {advice}")
    differences = [f"{key} {saved.get(key)!r} != {config.get(key)!r}" for key in sorted(config)
                   if saved.get(key) != config.get(key)]
    raise UsageError(f"checkpoint {path} is from another configuration ({', '.join(differences) or 'fingerprint'})"
                     f"; use another --checkpoint-dir or delete it")


# ----------------------------------------------------------------------------------------------------------
# Training: set-up, resume, one epoch of optimizer steps, evaluation, checkpoint, summary
# ----------------------------------------------------------------------------------------------------------
def check_optimizer_state(state: dict[str, Any], path: str, args: argparse.Namespace, position: "Position") -> None:
    """Refuse, in one line, a checkpoint whose optimizer state lacks what --optimizer keeps for every parameter it
    has stepped (SGD's momentum, AdamW's moments and step), rather than train on from another state: the sharded
    stages once wrote SGD's without its momentum. Under --amp fp16 the scaler may have skipped every step so far,
    so there a state with no entry at all is accepted."""
    stepped = position.optimizer_steps > 0 and (args.amp != "fp16" or bool(state["state"]))
    problem = zero.missing_optimizer_state(OPTIMIZERS[args.optimizer], state, every_parameter=stepped)
    if problem:
        raise UsageError(f"checkpoint {path} cannot resume this run: its optimizer state is incomplete ({problem}); "
                         f"resume from another checkpoint, or start afresh in an empty --checkpoint-dir")


@dataclass
class Position:
    """Where a run stands: the epoch, its next micro-batch, and the totals so far (with the weights, all a resume
    needs)."""
    epoch: int = 0
    micro_batch: int = 0
    optimizer_steps: int = 0
    micro_batches: int = 0


@dataclass
class EpochSums:
    """This rank's running sums over the epoch so far, float64 on the device (adding never waits for it)."""
    loss: torch.Tensor
    correct: torch.Tensor
    seen: torch.Tensor

    @classmethod
    def of(cls, values: list[float], device: torch.device) -> "EpochSums":
        return cls(*(torch.tensor(v, dtype=torch.float64, device=device) for v in values))

    @torch.no_grad()
    def add(self, per_sample_loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Adds a micro-batch; returns its loss sum (float64, on the device)."""
        loss = per_sample_loss.detach().double().sum()
        self.loss += loss
        hits = logits.argmax(-1) == labels  # text: (B, T), each window counts its share of bytes right
        self.correct += hits.flatten(1).double().mean(1).sum() if hits.dim() > 1 else hits.sum()
        self.seen += len(labels)
        return loss

    def gather(self, comm_device: torch.device) -> list[list[float]]:
        """Every rank's [loss, correct, seen]: what a checkpoint keeps, and what the epoch's figures sum."""
        mine = torch.stack([self.loss, self.correct, self.seen]).to(comm_device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        return [t.tolist() for t in everyone]


@dataclass
class RecentSteps:
    """--log-every's window on rank 0: the optimizer steps since the last log. The loss is summed on the device
    and read once per window, so logging adds no host-device sync per step."""
    loss: torch.Tensor
    samples: int = 0  # rank 0's samples in the window: the loss's denominator
    global_samples: int = 0  # every rank's
    steps: int = 0
    lr: float = 0.0  # the last step's

    def add_step(self, samples: int, world_size: int, lr: float) -> None:
        self.samples, self.global_samples = self.samples + samples, self.global_samples + samples * world_size
        self.steps, self.lr = self.steps + 1, lr

    def figures(self, step_ms: list[float], data_wait_ms: list[float]) -> dict[str, float]:
        """The window's means (the TensorBoard scalars train/<name>); reads the device's loss sum once."""
        return {"loss": float(self.loss) / max(self.samples, 1), "lr": self.lr,
                "step_ms": statistics.fmean(step_ms), "data_wait_ms": statistics.fmean(data_wait_ms),
                "samples_per_s": self.global_samples / max(sum(step_ms) / 1e3, 1e-9)}

    def reset(self) -> None:
        self.loss.zero_()
        self.samples = self.global_samples = self.steps = 0


@dataclass
class Run:
    """What the set-up builds; the loop changes only the model's state, the Position and the timings."""
    args: argparse.Namespace
    ctx: utils.DistContext
    comm_device: torch.device  # where collectives' tensors live: the GPU with nccl, else the CPU
    data: MemoryData | FolderData
    model: nn.Module  # the bare model: checkpoints and evaluation
    sync: DataParallel  # zero.shard's stages, DDP (with ZeroRedundancyOptimizer) or FSDP2
    optimizer: torch.optim.Optimizer  # built by sync.optimizer over the model's parameters
    scheduler: Any
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None
    steps_per_epoch: int
    config: dict[str, Any]
    checkpoint_path: str | None
    writer: Any = None
    timer: utils.IntervalTimer = None  # type: ignore[assignment]
    data_wait_ms: list[float] = field(default_factory=list)  # per optimizer step, host time waiting for batches
    recent: RecentSteps | None = None  # rank 0, when something shows --log-every's figures
    profiler: Any = None  # torch.profiler.profile with --profile
    state_bytes: dict[str, int] | None = None  # what this rank holds at an optimizer step (zero.state_bytes)
    grad_norms: list[torch.Tensor] = field(default_factory=list)  # --clip-grad-norm: each step's norm, unclipped
    first_step: int = 0  # the optimizer step this run started from (a resumed run: the checkpoint's)
    outer: DiLoCo | None = None  # --grad-sync diloco|localsgd: the replicas' outer loop
    replica: int = 0  # which replica this rank belongs to (diloco, localsgd) ...
    replica_size: int = 1  # ... and how many ranks each replica has
    evals: list[dict[str, Any]] = field(default_factory=list)  # --eval-every's evaluations (rank 0's figures)
    train_start: float = 0.0  # perf_counter() when training began ...
    eval_seconds: float = 0.0  # ... and the seconds --eval-every's evaluations have taken since
    baselines: dict[str, float] = field(default_factory=dict)  # text: gzip's and the unigram's bits/byte (rank 0)
    compile_counts: dict[str, int] | None = None  # --compile: Dynamo's counters before the run (compile_figures)

    @property
    def device(self) -> torch.device:
        return self.ctx.device


OPTIMIZERS = {"sgd": torch.optim.SGD, "sgd_nesterov": torch.optim.SGD, "adamw": torch.optim.AdamW}  # --optimizer


def make_optimizer(args: argparse.Namespace, model: nn.Module, sync: DataParallel) -> torch.optim.Optimizer:
    """--optimizer over the model's trainable parameters, through the sync (which shards it, or not). With
    --norm-weight-decay, two parameter groups: the matrices and tensors of higher rank (--weight-decay), and the
    vectors, biases and normalization weights (--norm-weight-decay), as torchvision's reference scripts split
    them (and nanoGPT, by the same test on p.dim())."""
    sgd = {"lr": args.lr, "momentum": args.momentum, "weight_decay": args.weight_decay}
    settings = {"sgd": sgd, "sgd_nesterov": {**sgd, "nesterov": True},
                "adamw": {"lr": args.lr, "weight_decay": args.weight_decay,
                          **({"betas": tuple(args.betas)} if args.betas else {})}}[args.optimizer]
    kind = OPTIMIZERS[args.optimizer]
    trainable = [p for p in model.parameters() if p.requires_grad]
    params: list[Any] = trainable
    if args.norm_weight_decay is not None:
        params = [{"params": [p for p in trainable if p.dim() >= 2]},
                  {"params": [p for p in trainable if p.dim() < 2], "weight_decay": args.norm_weight_decay}]
        params = [group for group in params if group["params"]]
    return sync.optimizer(kind, params, **settings)


def make_scheduler(args: argparse.Namespace, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """--scheduler: None, OneCycleLR over ``total_steps``, or cosine: step s (from 0) takes --lr times (s + 1) /
    (N + 1) during the N warm-up steps (nanoGPT's ramp), then eta + (1 - eta) (1 + cos(pi p)) / 2 with p = (s - N)
    / (S - 1 - N) going from 0 to 1 and eta = --min-lr / --lr, so step S - 1 (S = ``total_steps``, --decay-steps)
    and any after it take --min-lr."""
    if args.scheduler == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)
    if args.scheduler != "cosine":
        return None
    warmup, floor = args.warmup_steps or 0, (args.min_lr or 0.0) / args.lr

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_scaler(args: argparse.Namespace, device: torch.device, **settings: Any) -> torch.amp.GradScaler:
    """--amp fp16's gradient scaler (disabled otherwise). With sharded gradients each rank sees its shard alone,
    so whether any is inf must be agreed on: ShardedGradScaler all-reduces it. Replicated gradients are the same
    everywhere. (Imported only then: torch.distributed.fsdp takes about a second to import, in every process.)"""
    sharded = (args.grad_sync in OURS and args.zero > 0) or args.grad_sync == "fsdp"
    if sharded and args.amp == "fp16":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, **settings)
    return torch.amp.GradScaler(device.type, enabled=args.amp == "fp16", **settings)


def make_deterministic() -> None:
    """--deterministic: deterministic kernels on CUDA (the CPU ones used here already are; see the docstring)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read by cuBLAS when it starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def set_up(args: argparse.Namespace) -> Run:
    """Process group, data, model (same weights everywhere), optimizer, schedule and gradient sync."""
    try:
        ctx = utils.init_distributed(args.device, args.backend, args.timeout)
    except ValueError as exc:  # e.g. --device cuda on a machine without a GPU: before any collective
        raise UsageError(str(exc)) from None
    device = ctx.device
    comm_device = device if ctx.backend == "nccl" else torch.device("cpu")
    if args.norm == "torch" and device.type != "cuda":
        raise UsageError(NORM_TORCH_ON_CPU)
    if args.deterministic:
        make_deterministic()
    data = load_data(args, ctx, comm_device)

    torch.manual_seed(args.seed)
    model = build_model(args.model, args.dropout, args.norm, data.num_classes, args.image_size or 32, args.context)
    model = model.to(device, memory_format=data.memory_format)
    broadcast_state(model)
    # the gradient sync, and the optimizer through it
    within, across, replica, replica_size = replica_groups(args, ctx)
    if within is not None:  # SyncBatchNorm normalizes over its replica's samples alone
        for module in model.modules():
            if hasattr(module, "process_group"):
                module.process_group = within
    if args.grad_sync == "ddp":
        sync: DataParallel = DDPSync(model, device, args.bucket_mb, zero_redundancy=args.zero == 1)
    elif args.grad_sync == "fsdp":
        sync = FSDPSync(model, blocks(model), reshard_after_forward=args.zero == 3)
    else:
        sync = zero.shard(model, args.zero, blocks(model) if args.zero == 3 else None, group=within,
                          collectives=args.allreduce, bucket_mb=args.bucket_mb, overlap=args.sync_mode == "overlap",
                          accumulate=args.zero3_accumulate, timeout_s=args.timeout)
    outer = None
    if across is not None:
        try:
            outer = DiLoCo(model, across, args.local_steps, args.outer_lr, args.outer_momentum,
                           args.outer_optimizer == "nesterov", args.outer_compress, args.fragments, args.outer_delay,
                           args.timeout)
        except ValueError as exc:  # e.g. more fragments than the model has parameters
            raise UsageError(f"--grad-sync {args.grad_sync}: {exc}") from None
    compile_counts = compile_forward(args, model)
    optimizer = make_optimizer(args, model, sync)
    steps_per_epoch = math.ceil(len(data.batch_sizes()) / args.grad_accum)
    schedule_steps = args.epochs * steps_per_epoch  # the learning-rate schedule's length
    if args.scheduler == "cosine":
        schedule_steps = args.decay_steps or schedule_steps
    elif args.max_steps:  # OneCycleLR ends where the run ends
        schedule_steps = min(schedule_steps, args.max_steps)
    scheduler = make_scheduler(args, optimizer, schedule_steps)
    scaler = make_scaler(args, device)
    writer = None
    if ctx.rank == 0 and args.log_dir:
        from torch.utils.tensorboard import SummaryWriter  # slow to import; only when asked for
        writer = SummaryWriter(args.log_dir)
    recent = None
    if ctx.rank == 0 and (writer is not None or sys.stderr.isatty()):  # someone will see the figures
        recent = RecentSteps(torch.zeros((), dtype=torch.float64, device=device))
    return Run(args, ctx, comm_device, data, model, sync, optimizer, scheduler, scaler,
               {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp], steps_per_epoch,
               trajectory_config(args, ctx.world_size, schedule_steps, data),
               os.path.join(args.checkpoint_dir, "last.pt") if args.checkpoint_dir else None, writer,
               utils.IntervalTimer(device), recent=recent, outer=outer, replica=replica,
               replica_size=replica_size, compile_counts=compile_counts)


def dynamo_counts() -> dict[str, int]:
    """Dynamo's process-wide counters: graphs compiled (a frame each, forward; AOTAutograd's backward graphs are
    not counted apart) and graph breaks."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def compile_figures(run: Run) -> dict[str, Any] | None:
    """--compile's figures for the metrics: the scope, and the graphs and graph breaks of this run (rank 0's)."""
    if run.compile_counts is None:
        return None
    now = dynamo_counts()
    return {"scope": run.args.compile, "backend": run.args.compile_backend,
            **{key: now[key] - run.compile_counts[key] for key in now}}


def compile_forward(args: argparse.Namespace, model: nn.Module) -> dict[str, int] | None:
    """--compile: torch.compile a forward method, at its first call. The module, its state_dict keys and the syncs'
    hooks stay as they are and run eagerly (compiling the module's whole call would trace the syncs' forward
    pre-hooks, which re-attach gradient views parameter by parameter: a recompile for each).

    forward: the model's, one graph, whose backward is one autograd node: every gradient comes out at its end, so
    the hand-written sync's hooks launch all buckets together after the computation (DDP keeps its overlap:
    Dynamo's DDPOptimizer splits the graph at DDP's buckets). blocks: each block's (models.blocks: the units
    stage 3 and FSDP2 gather), a graph and a backward node per block: the gradients of a block are out when its
    backward ends, the buckets overlap the earlier blocks' backward again, and stage 3's gathers stay in the
    blocks' module hooks, outside the graphs. Blocks of one class share a code object, so Dynamo keeps one
    compiled entry per shape and mode (training, evaluation) under it: the recompile limit is raised to cover
    two per block. Returns Dynamo's counters before any compiling (None without --compile)."""
    if not args.compile:
        return None
    counts = dynamo_counts()
    if args.compile == "forward":
        model.forward = torch.compile(model.forward, backend=args.compile_backend)
    elif args.compile == "blocks":
        import torch._dynamo as dynamo

        units = blocks(model)
        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 2 * len(units))
        for unit in units:
            unit.forward = torch.compile(unit.forward, backend=args.compile_backend)
    return counts


def replica_groups(args: argparse.Namespace, ctx: utils.DistContext) -> tuple[Any, Any, int, int]:
    """--grad-sync diloco|localsgd: the process group of this rank's replica (ranks R_i = i W/R .. (i+1) W/R - 1,
    the inner data parallelism), the group across replicas (this rank and the ranks at its place in every other
    replica: the outer all-reduce, always gloo: its ring works on host memory), the replica's index and its number of
    ranks. Every rank makes every group, in one order (torch.distributed's rule). (None, None, 0, 1) for the other
    syncs."""
    if args.grad_sync not in ("diloco", "localsgd"):
        return None, None, 0, 1
    world, replicas = ctx.world_size, args.replicas or ctx.world_size
    if world % replicas:
        raise UsageError(f"--replicas {replicas} does not divide the {world} processes into equal replicas")
    per = world // replicas
    within = across = None
    for i in range(replicas):
        group = dist.new_group(list(range(i * per, (i + 1) * per)))
        within = group if ctx.rank // per == i else within
    for place in range(per):
        group = dist.new_group([i * per + place for i in range(replicas)], backend="gloo")
        across = group if ctx.rank % per == place else across
    return within, across, ctx.rank // per, per


def resume(run: Run) -> tuple[Position, list[dict[str, Any]], list[float]]:
    """Position, finished epochs and this rank's sums of the current epoch, from DIR/last.pt if there is one."""
    path = run.checkpoint_path
    state = load_on_rank0(path) if path else None
    if state is None:
        return Position(), [], [0.0, 0.0, 0.0]
    position = Position(optimizer_steps=state["optimizer_steps"], micro_batches=state["micro_batches_total"])
    if run.args.eval_only:
        try:
            if run.outer is not None and "replicas" in state:  # the shared point is what validation evaluates
                run.outer.load_state_dict(state["replicas"][run.replica]["outer"])
            run.sync.load_model_state_dict(state["model"])
        except RuntimeError as exc:
            raise UsageError(f"checkpoint {path} does not fit --model {run.args.model}: "
                             f"{str(exc).splitlines()[0]}") from None
        return position, list(state["history"]), [0.0, 0.0, 0.0]
    world_size = run.ctx.world_size
    check_compatible(state, run.config, path, run.args, world_size)
    replica = state["replicas"][run.replica] if run.outer is not None else state  # its own weights and optimizer
    run.sync.load_model_state_dict(replica["model"])
    check_optimizer_state(replica["optimizer"], path, run.args, position)
    run.optimizer.load_state_dict(replica["optimizer"])
    if run.outer is not None:
        run.outer.load_state_dict(replica["outer"])
    if run.scheduler is not None:
        run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    position.epoch, position.micro_batch = state["epoch"], state["micro_batch"]
    utils.print0(f"resuming from {path}: epoch {position.epoch + 1}, micro-batch {position.micro_batch}, "
                 f"optimizer step {position.optimizer_steps}")
    saved_sums = state["epoch_sums"] if position.micro_batch else [[0.0, 0.0, 0.0]]
    if state["world_size"] == world_size:
        return position, list(state["history"]), list(saved_sums[run.ctx.rank])
    # Another number of processes, the same global batch: the same samples in the same micro-batches, split
    # differently. The epoch's figures are sums over ranks, so rank 0 carries them all on.
    reasons = split_dependent(run.args)
    if reasons:
        utils.print0(f"note: resuming a run of {state['world_size']} processes on {world_size}: with "
                     f"{' and '.join(reasons)} the weights depend on the split, so they will differ from an "
                     f"uninterrupted run's")
    totals = [sum(column) for column in zip(*saved_sums)]
    return position, list(state["history"]), totals if run.ctx.rank == 0 else [0.0, 0.0, 0.0]


def checkpoint(run: Run, position: Position, history: list[dict[str, Any]], sums: list[list[float]]) -> None:
    """Rank 0 writes the run's state at ``position`` (every rank's epoch sums included) to DIR/last.pt; the
    optimizer's state in the form every --zero and world size loads (the sharded stages gather it first, so every
    rank calls this)."""
    if run.checkpoint_path is None:
        return
    optimizer_state = run.optimizer.state_dict()  # the sharded stages gather it to rank 0, every rank calls it
    model_state = run.sync.model_state_dict()  # --zero 3, fsdp: gathered one unit at a time
    replicas = None
    if run.outer is not None:  # every replica's own weights, optimizer and outer state; "model": the shared point
        replicas = gather_replicas(run, model_state, optimizer_state)
        with run.outer.global_weights():
            model_state = {key: value.clone() for key, value in run.model.state_dict().items()}
    if run.ctx.rank != 0:
        return
    save_checkpoint(run.checkpoint_path, {
        "model": model_state, **({"replicas": replicas} if replicas is not None else {}),
        "optimizer": optimizer_state, "world_size": run.ctx.world_size,
        "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
        "scaler": run.scaler.state_dict(), "epoch": position.epoch, "micro_batch": position.micro_batch,
        "optimizer_steps": position.optimizer_steps, "micro_batches_total": position.micro_batches,
        "history": history, "epoch_sums": sums, "fingerprint": fingerprint(run.config), "config": run.config,
        "rng_seed": run.args.seed,  # every random draw derives from it and the position (module docstring)
    })


def gather_replicas(run: Run, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> list[Any] | None:
    """Each replica's first rank sends its replica's state to rank 0 (the others hold the same: module docstring);
    rank 0 gets them in replica order, the others None."""
    first = run.ctx.rank % run.replica_size == 0
    mine = {"model": model_state, "optimizer": optimizer_state, "outer": run.outer.state_dict()} if first else None
    gathered: list[Any] = [None] * run.ctx.world_size
    dist.gather_object(mine, gathered if run.ctx.rank == 0 else None, dst=0)
    return [state for state in gathered if state is not None] if run.ctx.rank == 0 else None


def per_sample_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per sample: an image's, or a text window's mean over its positions (nats per byte; every
    window has the same number of positions, so the mean over windows is the mean over bytes)."""
    losses = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
    return losses.view(labels.shape).flatten(1).mean(1) if labels.dim() > 1 else losses


def optimizer_step(run: Run, position: Position, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
                   sizes: list[int], sums: EpochSums) -> int:
    """The window of up to K micro-batches from ``position``, then one update; returns the global sample count."""
    args = run.args
    window = range(position.micro_batch, min(position.micro_batch + args.grad_accum, len(sizes)))
    window_samples = sum(sizes[j] for j in window)  # the n of the module docstring
    torch.manual_seed(derive_seed(args.seed, run.ctx.rank, position.optimizer_steps))  # dropout
    run.timer.start()
    waited = 0.0
    for count, j in enumerate(window, 1):
        # next micro-batch (already being decoded by the loader's workers on the streaming path)
        start = time.perf_counter()
        images, labels = next(batches)
        waited += time.perf_counter() - start
        # forward and backward; the gradient average starts on the window's last micro-batch only
        sync = j == window[-1]
        run.sync.set_requires_gradient_sync(sync)
        with utils.profiled(f"micro-batch {count}/{len(window)} ({'sync' if sync else 'no sync'})"):
            with utils.profiled("forward"), torch.autocast(run.device.type, enabled=run.amp_dtype is not None,
                                                           dtype=run.amp_dtype or torch.float32):
                logits = run.sync.module(images)  # the model, or DDP around it
                per_sample = per_sample_loss(logits.float() if run.amp_dtype else logits, labels)
            with utils.profiled("backward"):
                run.scaler.scale(per_sample.sum() / window_samples).backward()
        loss = sums.add(per_sample, logits, labels)
        if run.recent is not None:
            run.recent.loss += loss
    # the gradients are averaged now (the last backward waited for it): clip, update
    lr = run.optimizer.param_groups[0]["lr"]  # this step's: the scheduler sets the next one's below
    with utils.profiled("optimizer step"):
        run.scaler.unscale_(run.optimizer)  # fp16: every rank unscales (and inf-checks) its averaged gradients ...
        if args.clip_grad_norm:  # ... before the clipping sees them: the norm of the true gradient
            run.grad_norms.append(run.sync.clip_grad_norm_(args.clip_grad_norm))
        if run.state_bytes is None or not run.state_bytes["optimizer"]:  # until the optimizer has state
            run.state_bytes = zero.state_bytes(run.model, run.optimizer, run.sync)
        run.scaler.step(run.optimizer)  # --zero 1-3: this rank's shards, then the model made whole again
        run.scaler.update()
        if run.scheduler is not None:
            run.scheduler.step()
        run.optimizer.zero_grad()
    if run.outer is not None:  # diloco, localsgd: the replicas meet when one of their all-reduces is due
        with utils.profiled("outer step"):
            run.outer.step()
    run.timer.stop()
    run.data_wait_ms.append(waited * 1e3)
    if run.recent is not None:
        run.recent.add_step(window_samples, run.ctx.world_size, lr)
    position.optimizer_steps += 1
    position.micro_batches += len(window)
    position.micro_batch = window[-1] + 1
    return window_samples * run.ctx.world_size


def stop_requested(args: argparse.Namespace, position: Position) -> bool:
    return bool(args.max_steps) and position.optimizer_steps >= args.max_steps


def train_epoch(run: Run, position: Position, history: list[dict[str, Any]], sums: EpochSums) -> tuple[int, int]:
    """Optimizer steps from ``position`` to the epoch's end or --max-steps; returns (steps, samples) taken."""
    args, rank = run.args, run.ctx.rank
    fault_rank, fault_step = -1, -1
    if os.environ.get(FAULT_ENV) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        fault_rank, fault_step = (int(v) for v in os.environ[FAULT_ENV].split(":"))
    sizes = run.data.batch_sizes()
    batches = run.data.train_batches(position.epoch, position.micro_batch)
    bar = tqdm(total=run.steps_per_epoch, initial=position.micro_batch // args.grad_accum,
               desc=f"epoch {position.epoch + 1}", disable=not (rank == 0 and sys.stderr.isatty()), leave=False)
    steps, samples = 0, 0
    run.model.train()
    while position.micro_batch < len(sizes) and not stop_requested(args, position):
        # one optimizer step
        samples += optimizer_step(run, position, batches, sizes, sums)
        steps += 1
        # progress: the profiler's window, the bar and --log-every's figures
        if run.profiler is not None:
            run.profiler.step()
        bar.update(1)
        if run.recent is not None and position.optimizer_steps % args.log_every == 0:
            log_recent_steps(run, position.optimizer_steps, bar)
        # checkpoint inside the epoch (its end is checkpointed after evaluation)
        at_interval = args.checkpoint_every and position.optimizer_steps % args.checkpoint_every == 0
        if (stop_requested(args, position) or at_interval) and position.micro_batch < len(sizes):
            epoch_sums = sums.gather(run.comm_device)
            checkpoint(run, position, history, epoch_sums)
        if args.eval_every and position.optimizer_steps % args.eval_every == 0:
            evaluate_during_training(run, position)
        # fault injection (see the module docstring)
        if rank == fault_rank and position.optimizer_steps == fault_step:
            os.kill(os.getpid(), signal.SIGKILL)
    batches.close()  # a run stopped mid-epoch leaves the rest undecoded
    bar.close()
    run.timer.collect()
    return steps, samples


def evaluate_during_training(run: Run, position: Position) -> None:
    """--eval-every: the validation loss now, against the seconds of training so far (these evaluations left out)
    and the bytes the busiest rank has sent so far: the curves of loss against time and against bytes."""
    start = time.perf_counter()
    entry = {"step": position.optimizer_steps, "time_s": start - run.train_start - run.eval_seconds,
             "sent_bytes": int(utils.max_across_ranks(bytes_sent(run, position)))}
    entry.update(validate(run))
    if run.args.dataset == "text":
        entry["val_bits_per_byte"] = entry["val_loss"] / math.log(2)
    run.evals.append(entry)
    run.model.train()
    utils.print0(f"step {entry['step']} | val loss {entry['val_loss']:.4f} | {entry['time_s']:.1f} s of training | "
                 f"{entry['sent_bytes'] / 1e6:.2f} MB sent")
    run.eval_seconds += time.perf_counter() - start


def log_recent_steps(run: Run, step: int, bar: tqdm) -> None:
    """--log-every: rank 0's means over the steps since the last log, to TensorBoard and the bar."""
    recent = run.recent
    figures = recent.figures(run.timer.collect()[-recent.steps:], run.data_wait_ms[-recent.steps:])
    if run.writer is not None:
        for name, value in figures.items():
            run.writer.add_scalar(f"train/{name}", value, step)
    bar.set_postfix(loss=f"{figures['loss']:.3f}", lr=f"{figures['lr']:.3g}",
                    step_ms=f"{figures['step_ms']:.1f}", wait_ms=f"{figures['data_wait_ms']:.1f}",
                    samples_s=f"{figures['samples_per_s']:.0f}")
    recent.reset()


def start_profiler(run: Run, position: Position) -> Any:
    """--profile: torch.profiler over this run's optimizer steps A..B-1 (--profile-steps) on every rank, written
    as DIR/rank<R>.pt.trace.json (Chrome trace format) when the window closes or the run ends inside it."""
    args = run.args
    if args.profile is None:
        return None
    first, end = args.profile_steps
    total = args.epochs * run.steps_per_epoch if not args.eval_only else 0
    left = max(0, min(total, args.max_steps or total) - position.optimizer_steps)
    if first >= left:
        raise UsageError(f"--profile-steps {first}:{end} starts past this run's {left} optimizer steps")
    os.makedirs(args.profile, exist_ok=True)
    path = os.path.join(args.profile, f"rank{run.ctx.rank}.pt.trace.json")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if run.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    warmup = min(first, 1)  # a step recorded and dropped, so the profiler's own start-up stays out of the trace
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Profiler won't be using warmup")  # A = 0: no step before the window
        schedule = torch.profiler.schedule(wait=first - warmup, warmup=warmup, active=end - first, repeat=1)
    profiler = torch.profiler.profile(activities=activities, schedule=schedule,
                                      on_trace_ready=lambda p: p.export_chrome_trace(path))
    profiler.start()
    return profiler


def validate(run: Run) -> dict[str, Any]:
    broadcast_state(run.model, buffers_only=True)  # evaluate with rank 0's running statistics everywhere
    args = run.args
    empty = None
    if args.zero == 3 or args.grad_sync == "fsdp":  # parameters gathered in every forward
        if args.dataset == "text":
            empty = 2 * (torch.zeros(0, args.context, dtype=torch.int64, device=run.device),)
        else:
            empty = (torch.zeros(0, 3, args.image_size, args.image_size, device=run.device),
                     torch.zeros(0, dtype=torch.int64, device=run.device))
    # diloco, localsgd: the replicas differ inside a window; the model evaluated is their shared point
    with run.outer.global_weights() if run.outer is not None else contextlib.nullcontext():
        return evaluate(run.model, run.data, max(args.batch_size, 256), run.device, run.comm_device,
                        run.amp_dtype, empty)


def end_epoch(run: Run, position: Position, history: list[dict[str, Any]], sums: EpochSums,
              samples: int, train_time: float, epoch_start: float) -> dict[str, Any]:
    """Evaluate, record and print an epoch (or the part of it --max-steps allowed); checkpoint a finished one."""
    args = run.args
    loss_sum, correct, seen = (sum(column) for column in zip(*sums.gather(run.comm_device)))
    val = validate(run)
    entry = {"epoch": position.epoch + 1, "optimizer_steps": position.optimizer_steps,
             "train_loss": loss_sum / max(seen, 1), "train_acc": correct / max(seen, 1), **val,
             "epoch_time_s": time.perf_counter() - epoch_start, "samples_per_s": samples / max(train_time, 1e-9),
             "lr": run.optimizer.param_groups[0]["lr"]}
    complete = position.micro_batch >= len(run.data.batch_sizes())
    if complete:
        history.append(entry)
        position.epoch, position.micro_batch = position.epoch + 1, 0
        checkpoint(run, position, history, [[0.0, 0.0, 0.0]] * run.ctx.world_size)
    else:
        entry["complete"] = False
    if run.writer is not None:
        for key in ("train_loss", "train_acc", "val_loss", "val_acc", "val_acc5", "samples_per_s", "lr"):
            run.writer.add_scalar(key, entry[key], position.optimizer_steps)
    stopped = '' if complete else ' (stopped by --max-steps)'
    if args.dataset == "text":
        entry["val_bits_per_byte"] = entry["val_loss"] / math.log(2)
        entry["tokens_per_s"] = entry["samples_per_s"] * args.context
        utils.print0(f"epoch {entry['epoch']}/{args.epochs}{stopped} | train loss {entry['train_loss']:.4f} | "
                     f"val loss {entry['val_loss']:.4f} nats/byte = {entry['val_bits_per_byte']:.3f} bits/byte "
                     f"(gzip -9 {run.baselines.get('gzip_bits_per_byte', math.nan):.3f}), next-byte acc "
                     f"{100 * entry['val_acc']:.2f}% ({entry['val_total']} bytes) | "
                     f"{entry['tokens_per_s']:.0f} tokens/s | {entry['epoch_time_s']:.1f} s")
        return entry
    utils.print0(f"epoch {entry['epoch']}/{args.epochs}{stopped} | "
                 f"train loss {entry['train_loss']:.4f} acc {100 * entry['train_acc']:.2f}% | "
                 f"val loss {entry['val_loss']:.4f} acc {100 * entry['val_acc']:.2f}% "
                 f"top-5 {100 * entry['val_acc5']:.2f}% ({entry['val_correct']}/{entry['val_total']}) | "
                 f"{entry['samples_per_s']:.0f} samples/s | {entry['epoch_time_s']:.1f} s")
    return entry


def describe_text(run: Run) -> None:
    """Rank 0 measures what the validation bytes cost without a model (gzip -9, the unigram entropy) and says
    what the text set holds."""
    if run.ctx.rank != 0:
        return
    data = run.data
    run.baselines = data.baselines()
    utils.print0(f"text: {data.root}: {len(data.files['train'])} files for training ({len(data.train.stream):,} "
                 f"bytes, {len(data.train):,} windows of {data.context}), {len(data.files['val'])} for validation "
                 f"({len(data.val.stream):,} bytes); validation costs {run.baselines['gzip_bits_per_byte']:.3f} "
                 f"bits/byte under gzip -9 and {run.baselines['unigram_bits_per_byte']:.3f} by byte frequencies "
                 f"alone (unigram entropy)")


def describe_outer(run: Run) -> str:
    """diloco, localsgd: the replicas and how they meet, for the run's first line."""
    args = run.args
    if run.outer is None:
        return ""
    replicas = run.ctx.world_size // run.replica_size
    text = f" ({replicas} replicas of {run.replica_size}, meeting every {args.local_steps} steps"
    if args.grad_sync == "diloco":
        text += f", outer {args.outer_optimizer} lr {args.outer_lr} momentum {args.outer_momentum}"
    if args.outer_compress != "none":
        text += f", {args.outer_compress} with error feedback"
    if args.fragments > 1 or args.outer_delay:
        text += f", {args.fragments} fragments applied {args.outer_delay} steps after launch"
    return text + ")"


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the training (or evaluation) ``args`` describe; returns the metrics and, on every rank, the model."""
    wall_start = time.perf_counter()
    # set-up and resume
    run = set_up(args)
    try:
        position, history, epoch_sums = resume(run)
        run.first_step = position.optimizer_steps
        trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        if isinstance(run.data, TextData):
            describe_text(run)
        utils.print0(f"{args.model} ({trainable:,} parameters, {run.data.num_classes} classes) on "
                     f"{run.ctx.world_size} x {run.device.type} ({run.ctx.backend}), grad-sync {args.grad_sync}"
                     f"{describe_outer(run)}"
                     f"{f' --zero {args.zero}' if args.zero else ''}, {args.optimizer}, "
                     f"norm {args.norm}, {args.batch_size} x {args.grad_accum} x {run.ctx.world_size} samples "
                     f"per step, {run.steps_per_epoch} steps per epoch")
        utils.reset_peak_memory(run.device)
        run.profiler = start_profiler(run, position)
        run.train_start = time.perf_counter()
        train_time, samples_trained, run_steps, final = 0.0, 0, 0, None
        while not args.eval_only and final is None and position.epoch < args.epochs \
                and not stop_requested(args, position):
            # train until the epoch ends or --max-steps
            epoch_start = time.perf_counter()
            sums = EpochSums.of(epoch_sums if position.micro_batch else [0.0, 0.0, 0.0], run.device)
            steps, samples = train_epoch(run, position, history, sums)
            epoch_time = time.perf_counter() - epoch_start
            train_time, samples_trained = train_time + epoch_time, samples_trained + samples
            run_steps += steps
            # evaluate, log, checkpoint
            entry = end_epoch(run, position, history, sums, samples, epoch_time, epoch_start)
            final = entry if entry.get("complete") is False else None
        if run.profiler is not None:  # a window that the run's end cut short is written now
            run.profiler.stop()
            run.profiler = None
        # the final figures: the last epoch's, or one evaluation when nothing was trained
        if run.writer is not None:
            run.writer.close()
        if final is None and run_steps and history:
            final = history[-1]
        if final is None:  # --eval-only, or a checkpoint with nothing left to train
            val = validate(run)
            final = {"train_loss": history[-1]["train_loss"] if history else None, **val}
            utils.print0(f"evaluation | val loss {val['val_loss']:.4f} acc {100 * val['val_acc']:.2f}% top-5 "
                         f"{100 * val['val_acc5']:.2f}% ({val['val_correct']}/{val['val_total']})")
        metrics = summarize(run, position, history, final, trainable, train_time, samples_trained, wall_start)
    finally:
        try:  # hooks off, --zero 3's units gathered, --allreduce ring|butterfly's thread stopped
            run.sync.close()  # before the profiler stops: what it launched under the profiler lands first
        finally:
            if run.profiler is not None:  # stopped by an error: leave no profiler running in this process
                run.profiler.stop()
            if run.outer is not None:
                run.outer.close()
            run.data.close()
    if run.ctx.rank == 0 and args.metrics_out:
        utils.write_json(args.metrics_out, metrics)
    metrics["model"] = run.model  # for in-process callers (tests), whole (sync.close()); not part of the JSON
    return metrics


def summarize(run: Run, position: Position, history: list[dict[str, Any]], final: dict[str, Any], trainable: int,
              train_time: float, samples_trained: int, wall_start: float) -> dict[str, Any]:
    """The metrics JSON: the final figures, step-time statistics (warm-up left out) and the configuration."""
    times = run.timer.times_ms
    steps = times[WARMUP_STEPS:] if len(times) > WARMUP_STEPS else times
    waits = run.data_wait_ms[len(times) - len(steps):]
    return {
        "world_size": run.ctx.world_size, "device": run.device.type, "backend": run.ctx.backend,
        "machine": utils.machine_info(run.device),  # where the figures came from (CPU model, GPU, versions)
        "optimizer_steps": position.optimizer_steps, "micro_batches": position.micro_batches,
        "trainable_parameters": trainable, "num_classes": run.data.num_classes,
        **{key: final[key] for key in ("train_loss", "val_loss", "val_acc", "val_acc5", "val_correct",
                                       "val_correct5", "val_total")},
        "peak_memory_mb": utils.max_across_ranks(utils.peak_memory_mb(run.device)),
        "state_bytes": {key: int(utils.max_across_ranks(value)) for key, value in (run.state_bytes or
                        {"params": 0, "grads": 0, "optimizer": 0}).items()},
        "sent_bytes_per_step": sent_per_step(run, position),
        **sent_figures(run, position, trainable),
        "grad_norms": [float(norm) for norm in run.grad_norms],  # --clip-grad-norm: this run's, before clipping
        **text_figures(run, final, samples_trained, train_time),
        "gathered_peak": gathered_peak(run), "compile": compile_figures(run),
        "wall_time_s": time.perf_counter() - wall_start, "train_time_s": train_time,
        "samples_per_s": samples_trained / train_time if train_time else 0.0,
        "step_time_ms_median": statistics.median(steps) if steps else None,
        "step_time_ms_p10": utils.percentile(steps, 10), "step_time_ms_p90": utils.percentile(steps, 90),
        "step_time_ms_mean": statistics.fmean(steps) if steps else None,
        "step_time_warmup_steps": len(times) - len(steps), "step_times_ms": [round(t, 4) for t in steps],
        "data_wait_ms_median": statistics.median(waits) if waits else None,
        "epochs": history + ([final] if final.get("complete") is False else []),
        "fingerprint": fingerprint(run.config), "config": vars(run.args),
    }


def text_figures(run: Run, final: dict[str, Any], samples_trained: int, train_time: float) -> dict[str, float]:
    """--dataset text: bits per byte (validation, and gzip's and the unigram's on the same bytes), tokens/s."""
    if run.args.dataset != "text":
        return {}
    return {"val_bits_per_byte": final["val_loss"] / math.log(2),
            "tokens_per_s": samples_trained * run.args.context / train_time if train_time else 0.0,
            **{f"val_{key}": value for key, value in run.baselines.items()}}


def sent_figures(run: Run, position: Position, trainable: int) -> dict[str, Any]:
    """sent_bytes: the most any rank sent over this run, gradient sync and outer all-reduces together (DDP: what an
    ideal ring sends, 2 (W-1)/W of the model per step, the figure to compare with); data_parallel_sent_bytes: that
    ideal ring's figure over the same steps (data_parallel_bytes_per_step: per step; an outer step at H replaces H of
    them). diloco, localsgd: the outer all-reduces, each with the bytes the busiest rank sent, the time the step
    waited for it to land and the steps it was in flight."""
    if run.outer is not None:
        run.outer.wait()  # an all-reduce still in flight at the end has its bytes counted too
    steps = position.optimizer_steps - run.first_step
    per_step = data_parallel_bytes(trainable, run.ctx.world_size)
    figures: dict[str, Any] = {"sent_bytes": int(utils.max_across_ranks(bytes_sent(run, position))),
                               "data_parallel_sent_bytes": steps * per_step,
                               "data_parallel_bytes_per_step": per_step, "evals": run.evals}
    if run.outer is not None:
        log = run.outer.log
        busiest = [int(utils.max_across_ranks(entry["bytes"] or 0)) for entry in log]  # every rank has each entry
        figures["outer_all_reduces"] = [
            {"step": entry["step"], "fragment": entry["fragment"], "elements": entry["elements"], "bytes": sent,
             "wait_ms": entry.get("wait_ms"), "delay_steps": run.args.outer_delay}
            for entry, sent in zip(log, busiest)]
        figures["peak_in_flight_bytes"] = max(encoded_bytes(len(start), run.args.outer_compress)
                                              for start in run.outer.start)
        figures["model_bytes"] = encoded_bytes(trainable, "none")
    return figures


def bytes_sent(run: Run, position: Position) -> int:
    """What this rank has sent in this run: its gradient sync's count (DDP, FSDP2: an ideal ring's figure) and
    its outer all-reduces that have landed."""
    sent = run.sync.sent_bytes()
    if sent is None:
        trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        sent = (position.optimizer_steps - run.first_step) * data_parallel_bytes(trainable, run.ctx.world_size)
    return sent + (run.outer.sent_bytes() if run.outer is not None else 0)


def gathered_peak(run: Run) -> dict[str, int] | None:
    """--zero 3: the most units gathered at once besides the root, and the most bytes of full parameters
    (root included), on the busiest rank; None for the other syncs."""
    peak = run.sync.gathered_peak()
    return None if peak is None else {key: int(utils.max_across_ranks(value)) for key, value in peak.items()}


def sent_per_step(run: Run, position: Position) -> float | None:
    """Bytes the busiest rank sent per optimizer step in the gradient sync (None: DDP, not counted)."""
    sent = run.sync.sent_bytes()
    steps = position.optimizer_steps - run.first_step
    if sent is None or not steps:
        return None
    return utils.max_across_ranks(sent) / steps


# ----------------------------------------------------------------------------------------------------------
# A sample from a trained GPT
# ----------------------------------------------------------------------------------------------------------
@torch.no_grad()
def generate(args: argparse.Namespace) -> bytes:
    """--generate N: the GPT of --checkpoint-dir's last.pt continues --prompt by N bytes, each drawn from its
    softmax(logits / --temperature) (among the --top-k likeliest), on the CPU with a generator seeded by --seed.
    The text set ends every file with a 0 byte, so an empty prompt starts from that: the beginning of a file."""
    path = os.path.join(args.checkpoint_dir, "last.pt")
    if not os.path.exists(path):
        raise UsageError(f"--generate: no checkpoint at {path}")
    state = read_checkpoint(path)
    config = state["config"]
    if config.get("model") not in LANGUAGE_MODELS:
        raise UsageError(f"--generate: {path} holds a {config.get('model')}, not a GPT trained on --dataset text")
    model = GPT(vocab_size=256, **config["gpt"]).eval()
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise UsageError(f"--generate: {path} does not hold the GPT its configuration names: "
                         f"{str(exc).splitlines()[1].strip()}") from None
    prompt = args.prompt.encode()
    tokens = torch.tensor([list(b"\0" + prompt)], dtype=torch.int64)
    generator = torch.Generator().manual_seed(args.seed)
    for _ in tqdm(range(args.generate), desc="sampling", unit="B", disable=not sys.stderr.isatty(), leave=False):
        logits = model(tokens[:, -model.context:])[0, -1] / args.temperature
        if args.top_k is not None and args.top_k < len(logits):
            logits[logits < logits.topk(args.top_k).values[-1]] = -math.inf
        drawn = torch.multinomial(torch.softmax(logits, dim=0), 1, generator=generator)
        tokens = torch.cat([tokens, drawn[None]], dim=1)
    return bytes(tokens[0, 1:].tolist())


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
    add("--dataset", choices=("cifar100", "synthetic", "imagefolder", "text"), default="cifar100",
        help="imagefolder: DIR/train/<class>/* and DIR/val/<class>/* (torchvision's ImageFolder layout); text: "
             "every text file under DIR as bytes, split by file into training and validation (--model gpt)")
    add("--data-dir", default=None,
        help="where CIFAR-100 is (or is downloaded to by local rank 0; default ./data), the image folder, or the "
             "text folder (default: the Python standard library's source)")
    add("--train-size", type=int, default=10000, help="synthetic training set size")
    add("--val-size", type=int, default=2000, help="synthetic validation set size")
    add("--image-size", type=int, default=None, help="imagefolder: side of the crops (default 224)")
    add("--augment", choices=("imagenet", "cifar", "none"), default=None,
        help="training augmentation: imagenet = RandomResizedCrop + flip (validation: Resize + CenterCrop), cifar "
             "= RandomCrop with padding S/8 + flip; default imagenet for folders, cifar for cifar100, none for "
             "synthetic")
    add("--workers", type=int, default=0, help="imagefolder: DataLoader processes that decode and augment")
    add("--context", type=int, default=None,
        help="text: bytes per window, the GPT's context (default: the model's, 128 for gpt, 64 for gpt-tiny, 1024 "
             "for gpt2)")
    add("--val-fraction", type=float, default=0.1,
        help="text: the share of the bytes, in whole files chosen by a hash of their path, kept for validation")
    add("--model", choices=MODELS, default="net",
        help="net, resnet and vit: small models for 32-pixel images; resnet18..., vit_b_16...: torchvision's "
             "(weights=None; a ViT takes --image-size, which its patch size must divide); gpt (1.3M parameters), "
             "gpt-tiny (0.12M) and gpt2 (GPT-2 small's shape, 86M with 256 bytes for vocabulary): byte-level GPTs "
             "for --dataset text")
    add("--channels-last", action="store_true", help="model and batches in channels-last memory format")
    add("--compile", nargs="?", const="forward", choices=COMPILE_SCOPES, default=None,
        help="torch.compile at the first call, hooks left eager: the model's forward as one graph (forward, the "
             "default; SyncBatchNorm compiles without a graph break; the hand-written sync's bucket all-reduces then "
             "wait for the whole backward), or each block's forward apart (blocks: a backward per block, so the "
             "buckets overlap the backward again; takes --zero 3)")
    add("--compile-backend", default="inductor", metavar="NAME",
        help="--compile's backend: inductor (default), aot_eager (no code generation: the tests'), eager")
    add("--dropout", type=float, default=0.5, help="net: dropout2 rate, dropout1 gets half (0 disables both)")
    add("--grad-sync", choices=("custom", "ddp", "fsdp", "diloco", "localsgd"), default="custom",
        help="custom: gradsync.py / zero.py, by hand; ddp: DistributedDataParallel; fsdp: FSDP2's fully_shard "
             "on the model's blocks and the root (with --zero 2 or 3); diloco: --replicas that train alone (custom "
             "inside each, --zero 0-2) and meet every --local-steps through an outer optimizer (diloco.py); "
             "localsgd: the same, meeting by averaging their weights")
    add("--replicas", type=int, default=None, metavar="R",
        help="diloco, localsgd: the number of replicas, each of W/R processes (default: one process each)")
    add("--local-steps", type=int, default=None, metavar="H",
        help="diloco, localsgd: inner optimizer steps between two meetings of the replicas (default 50)")
    add("--outer-optimizer", choices=("sgd", "nesterov"), default=None,
        help="diloco: SGD on the averaged pseudo-gradient, with Nesterov momentum (default, the paper's) or "
             "heavy-ball momentum")
    add("--outer-lr", type=float, default=None, help="diloco: the outer learning rate (default 0.7)")
    add("--outer-momentum", type=float, default=None, help="diloco: the outer momentum (default 0.9)")
    add("--outer-compress", choices=("none", "bf16", "int8", "int4"), default=None,
        help="diloco, localsgd: how the outer all-reduce's messages travel on the ring: float32, bfloat16, or "
             "int8/int4 codes with a float32 scale per 256 values; with error feedback (default none)")
    add("--fragments", type=int, default=None, metavar="F",
        help="diloco, localsgd: streaming: the parameters in F runs, meeting at staggered steps (default 1)")
    add("--outer-delay", type=int, default=None, metavar="D",
        help="diloco, localsgd: inner steps an outer all-reduce runs on its thread before it is applied, the "
             "progress made meanwhile kept (default 0: at once; at most --local-steps / --fragments)")
    add("--zero", type=int, choices=(0, 1, 2, 3), default=0,
        help="ZeRO stage (zero.py): 0 replicated; 1 optimizer state sharded over the processes; 2 gradients too; "
             "3 parameters too, gathered one unit (block) at a time with prefetch (--bucket-mb plays no part). "
             "With --grad-sync ddp, 1 is PyTorch's ZeroRedundancyOptimizer; with fsdp, 3 reshards after forward "
             "and 2 does not")
    add("--zero3-accumulate", choices=("sharded", "unsharded"), default=None,
        help="--zero 3 with --grad-accum > 1: reduce-scatter every micro-batch into the shard accumulators "
             "(sharded, the default: gradients Psi/W), or keep each unit's full gradient over the window and "
             "reduce-scatter it once (unsharded: 4 Psi more during the window, K-1 fewer reduce-scatters, stage 0's "
             "summation order; what FSDP2 does)")
    add("--optimizer", choices=("sgd", "sgd_nesterov", "adamw"), default="sgd",
        help="SGD with --momentum and --weight-decay (sgd_nesterov: Nesterov's momentum, as torchvision's reference "
             "scripts name it), or AdamW with --weight-decay (decoupled)")
    add("--allreduce", choices=("torch", "ring", "butterfly"), default="torch",
        help="custom: which collectives sync the buckets: torch.distributed's, or allreduce.py's own (--zero 1/2: "
             "torch's reduce-scatter and all-gather, or the ring's)")
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
    add("--betas", type=float, nargs=2, default=None, metavar=("B1", "B2"),
        help="AdamW's betas (default 0.9 0.999, PyTorch's; language models are trained with 0.9 0.95)")
    add("--norm-weight-decay", type=float, default=None,
        help="the weight decay of biases and normalization weights (every parameter of fewer than 2 dimensions), "
             "in a parameter group of their own (default: --weight-decay, one group)")
    add("--clip-grad-norm", type=float, default=None, metavar="X",
        help="clip the gradient to global 2-norm X before each step (the whole model's norm at every --zero; "
             "after fp16's unscaling); default off")
    add("--scheduler", choices=("none", "onecycle", "cosine"), default="none",
        help="onecycle: PyTorch's OneCycleLR to --lr; cosine: linear warm-up over --warmup-steps to --lr, then a "
             "cosine down to --min-lr at the last step (the recipe of GPT trainers)")
    add("--warmup-steps", type=int, default=None, metavar="N", help="--scheduler cosine: warm-up steps (default 0)")
    add("--min-lr", type=float, default=None, help="--scheduler cosine: the learning rate at the end (default 0)")
    add("--decay-steps", type=int, default=None, metavar="N",
        help="--scheduler cosine: the step at which the cosine reaches --min-lr (default: the last step of --epochs). "
             "--max-steps only stops the run, so a run stopped by it resumes exactly with a larger one")
    add("--amp", choices=("off", "bf16", "fp16"), default="off")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    add("--seed", type=int, default=0)
    add("--deterministic", action="store_true",
        help="deterministic CUDA kernels, so that bit-for-bit resume holds on a GPU too (slower)")
    add("--checkpoint-dir", default=None, help="DIR/last.pt is written by rank 0 and resumed from when present")
    add("--checkpoint-every", type=int, default=0, help="also checkpoint every N optimizer steps (0: epoch ends)")
    add("--eval-only", action="store_true", help="evaluate DIR/last.pt (or the fresh model) and exit")
    add("--generate", type=int, default=None, metavar="N",
        help="print N bytes sampled from the GPT in --checkpoint-dir's last.pt after --prompt, and exit")
    add("--prompt", default="", help="--generate: the text to continue (default: the start of a file)")
    add("--temperature", type=float, default=0.8, help="--generate: logits are divided by it before sampling")
    add("--top-k", type=int, default=None, help="--generate: sample among the K likeliest bytes only")
    add("--log-dir", default=None, help="TensorBoard scalars from rank 0")
    add("--log-every", type=int, default=10, metavar="N",
        help="every N optimizer steps rank 0 shows train/loss (over its samples), train/lr, train/step_ms, "
             "train/data_wait_ms and train/samples_per_s, means over those steps: TensorBoard and the bar")
    add("--profile", default=None, metavar="DIR",
        help="torch.profiler on every rank over --profile-steps: DIR/rank<R>.pt.trace.json, a Chrome trace "
             "(ui.perfetto.dev, chrome://tracing) with named ranges for forward, backward, each bucket's "
             "all-reduce, SyncBatchNorm's collectives and the optimizer step")
    add("--profile-steps", default=None, metavar="A:B",
        help=f"with --profile: this run's optimizer steps A to B-1, counted from 0 (default {PROFILE_STEPS}: "
             f"after the warm-up)")
    add("--metrics-out", default=None, help="JSON summary from rank 0")
    add("--eval-every", type=int, default=0, metavar="N",
        help="also evaluate every N optimizer steps: the metrics' evals list each one's step, seconds of training "
             "so far (evaluations left out), bytes sent so far by the busiest rank and validation figures")
    add("--timeout", type=float, default=1800.0, help="seconds, for process-group set-up and collectives")
    args = parser.parse_args(argv)
    positive = {"--grad-accum": args.grad_accum, "--batch-size": args.batch_size, "--epochs": args.epochs,
                "--train-size": args.train_size, "--val-size": args.val_size, "--lr": args.lr,
                "--bucket-mb": args.bucket_mb, "--timeout": args.timeout, "--log-every": args.log_every}
    for flag, value in positive.items():
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    for flag, value in {"--max-steps": args.max_steps, "--checkpoint-every": args.checkpoint_every,
                        "--momentum": args.momentum, "--eval-every": args.eval_every,
                        "--weight-decay": args.weight_decay,
                        "--norm-weight-decay": args.norm_weight_decay or 0}.items():
        if value < 0:
            raise UsageError(f"{flag} must not be negative, got {value}")
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:
        raise UsageError(f"--clip-grad-norm must be positive, got {args.clip_grad_norm}")
    check_recipe_flags(args)
    if not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
    check_outer_flags(args)
    if args.allreduce != "torch" and args.grad_sync not in OURS:
        raise UsageError(f"--allreduce {args.allreduce} is for --grad-sync custom ({args.grad_sync} uses its own "
                         f"collectives)")
    if args.grad_sync == "fsdp" and args.zero not in (2, 3):
        raise UsageError(f"--grad-sync fsdp takes --zero 2 (no reshard after forward) or 3 (reshard after "
                         f"forward), got --zero {args.zero}")
    if args.grad_sync == "ddp" and args.zero > 1:
        raise UsageError(f"--grad-sync ddp takes --zero 0 or 1 (ZeroRedundancyOptimizer); --zero {args.zero} is "
                         f"--grad-sync custom")
    if args.zero and args.allreduce == "butterfly":
        raise UsageError(f"--zero {args.zero} runs on reduce-scatter and all-gather: --allreduce torch or ring "
                         f"(the butterfly has no halves here)")
    if args.zero >= 2 and args.sync_mode == "after" and args.grad_sync in OURS:
        raise UsageError(f"--zero {args.zero} reduce-scatters gradients as backward completes them; --sync-mode "
                         f"after would keep every full gradient (use --zero 1)")
    if args.compile == "forward" and args.zero == 3:
        raise UsageError(f"--compile forward does not take --zero 3 (--grad-sync {args.grad_sync}): its parameters "
                         f"are gathered in the blocks' module hooks, which compiling the model's forward would "
                         f"trace; --compile blocks leaves them outside the graphs")
    if args.compile and args.grad_sync == "ddp" and args.bucket_mb < 1:  # an AssertionError deep in Dynamo else
        raise UsageError(f"--compile with --grad-sync ddp takes --bucket-mb 1 or more, not {args.bucket_mb:g}: "
                         f"torch's DDPOptimizer splits the compiled graph at DDP's buckets and requires the first "
                         f"(1 MB) to be no larger than the others")
    if args.zero3_accumulate is not None and (args.zero != 3 or args.grad_sync != "custom"):
        raise UsageError(f"--zero3-accumulate is for --grad-sync custom --zero 3, not --grad-sync {args.grad_sync} "
                         f"--zero {args.zero}")
    args.zero3_accumulate = args.zero3_accumulate or "sharded"
    if args.log_dir and importlib.util.find_spec("tensorboard") is None:  # every rank, before any collective
        raise UsageError("--log-dir needs the tensorboard package (pip install tensorboard)")
    args.profile_steps = parse_profile_steps(args.profile_steps, args.profile)
    return resolve_data_flags(args)


def check_outer_flags(args: argparse.Namespace) -> None:
    """diloco and localsgd's flags: refused elsewhere, defaults filled in, one line when they do not fit."""
    given = [f"--{key.replace('_', '-')}" for key in DILOCO_FLAGS[1:] if getattr(args, key) is not None]
    if args.grad_sync not in ("diloco", "localsgd"):
        if given:
            raise UsageError(f"{given[0]} is for --grad-sync diloco or localsgd")
        return
    if args.grad_sync == "localsgd":  # averaging the weights is outer SGD with lr 1 and no momentum
        outer = [flag for flag in given if flag in ("--outer-optimizer", "--outer-lr", "--outer-momentum")]
        if outer:
            raise UsageError(f"{outer[0]} is diloco's: localsgd averages the weights (outer SGD, lr 1, no momentum)")
        args.outer_optimizer, args.outer_lr, args.outer_momentum = "sgd", 1.0, 0.0
    defaults = {"local_steps": 50, "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9,
                "outer_compress": "none", "fragments": 1, "outer_delay": 0}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.zero == 3:
        raise UsageError(f"--grad-sync {args.grad_sync} takes --zero 0, 1 or 2 inside the replicas (stage 3 keeps no "
                         f"whole weights between steps for the outer step to read)")
    if args.replicas is not None and args.replicas < 1:
        raise UsageError(f"--replicas must be positive, got {args.replicas}")
    if not 1 <= args.fragments <= args.local_steps:
        raise UsageError(f"--fragments {args.fragments} must be between 1 and --local-steps {args.local_steps}")
    if not 0 <= args.outer_delay <= args.local_steps // args.fragments:
        raise UsageError(f"--outer-delay {args.outer_delay} must be between 0 and --local-steps / --fragments = "
                         f"{args.local_steps // args.fragments} (one fragment in flight at a time)")
    if not args.outer_lr > 0 or args.outer_momentum < 0:
        raise UsageError(f"--outer-lr must be positive and --outer-momentum not negative, got {args.outer_lr} and "
                         f"{args.outer_momentum}")


def check_recipe_flags(args: argparse.Namespace) -> None:
    """--betas, the cosine schedule's flags and --generate's, in one line each when they do not fit."""
    if args.betas is not None and (args.optimizer != "adamw" or not all(0 <= b < 1 for b in args.betas)):
        raise UsageError(f"--betas is AdamW's (--optimizer adamw), two numbers in [0, 1), got {args.betas}")
    for flag, value in (("--warmup-steps", args.warmup_steps), ("--min-lr", args.min_lr),
                        ("--decay-steps", args.decay_steps)):
        if value is not None and args.scheduler != "cosine":
            raise UsageError(f"{flag} is for --scheduler cosine")
        if value is not None and value < 0:
            raise UsageError(f"{flag} must not be negative, got {value}")
    if args.decay_steps is not None and args.decay_steps <= (args.warmup_steps or 0):
        raise UsageError(f"--decay-steps {args.decay_steps} must be above --warmup-steps {args.warmup_steps or 0}")
    if args.min_lr is not None and args.min_lr > args.lr:
        raise UsageError(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    if args.generate is not None:
        if args.generate < 1 or args.checkpoint_dir is None:
            raise UsageError("--generate N takes N >= 1 and --checkpoint-dir (the run whose last.pt to sample)")
        if not args.temperature > 0 or (args.top_k is not None and args.top_k < 1):
            raise UsageError(f"--temperature must be positive and --top-k at least 1, got {args.temperature} and "
                             f"{args.top_k}")


def parse_profile_steps(text: str | None, profile_dir: str | None) -> tuple[int, int]:
    """--profile-steps A:B -> (A, B), 0 <= A < B."""
    if text is not None and profile_dir is None:
        raise UsageError("--profile-steps is for --profile DIR")
    first, colon, end = (text or PROFILE_STEPS).partition(":")
    try:
        steps = int(first), int(end)
    except ValueError:
        steps = (-1, -1)
    if not colon or not 0 <= steps[0] < steps[1]:
        raise UsageError(f"--profile-steps takes A:B, optimizer steps with 0 <= A < B, got {text!r}")
    return steps


def resolve_data_flags(args: argparse.Namespace) -> argparse.Namespace:
    """Dataset-dependent defaults (--data-dir, --augment, --image-size, --context), and the flags that only an
    image folder or text takes."""
    if args.workers < 0:
        raise UsageError(f"--workers must not be negative, got {args.workers}")
    text = args.dataset == "text"
    if text != (args.model in LANGUAGE_MODELS):
        raise UsageError(f"--model {args.model} does not take --dataset {args.dataset}: the GPTs "
                         f"({', '.join(LANGUAGE_MODELS)}) train on --dataset text, the image models on images")
    if not text and (args.context is not None or args.val_fraction != 0.1):
        raise UsageError("--context and --val-fraction are for --dataset text")
    if text:
        for flag, value in (("--augment", args.augment), ("--image-size", args.image_size),
                            ("--workers", args.workers or None)):
            if value is not None:
                raise UsageError(f"{flag} is for image sets, not --dataset text")
        args.data_dir = args.data_dir or default_text_dir()
        args.context = args.context or GPT_SIZES[args.model]["context"]
        if args.context < 1 or not 0 < args.val_fraction < 1:
            raise UsageError(f"--context must be positive and --val-fraction in (0, 1), got {args.context} and "
                             f"{args.val_fraction}")
        args.augment, args.image_size = "none", None
        return args
    args.data_dir = args.data_dir or "data"
    if args.dataset == "imagefolder":
        args.augment = args.augment or "imagenet"
        args.image_size = 224 if args.image_size is None else args.image_size
        minimum = 10 if args.model == "net" else 1  # net: two 3x3 convolutions and a 2x2 pool before fc1
        if args.image_size < minimum:
            raise UsageError(f"--image-size must be at least {minimum} for --model {args.model}, "
                             f"got {args.image_size}")
        return args
    if args.augment == "imagenet":
        raise UsageError("--augment imagenet is for --dataset imagefolder; in-memory sets take cifar or none")
    if args.image_size not in (None, 32):
        raise UsageError(f"--image-size is for --dataset imagefolder ({args.dataset} images are 32 pixels)")
    if args.workers:
        raise UsageError(f"--workers is for --dataset imagefolder ({args.dataset} sits in memory)")
    args.augment = args.augment or ("cifar" if args.dataset == "cifar100" else "none")
    args.image_size = 32
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
        if args.generate is not None:  # no process group: rank 0 samples, any other rank has nothing to do
            if rank == 0:
                sys.stdout.buffer.write(generate(args) + b"\n")
                sys.stdout.flush()
            return 0
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
