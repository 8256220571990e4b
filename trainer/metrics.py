"""What the trainer measures and shows: the epoch's sums, --log-every's recent steps (the bar and TensorBoard),
--profile's profiler, the printed lines, and the metrics JSON.

Seeing inside a step: every --log-every N optimizer steps rank 0 writes the means of those steps (train/loss over
its own samples, train/lr, train/step_ms, train/data_wait_ms, train/samples_per_s) to TensorBoard and the bar,
reading the device's loss sum once per N steps. --profile DIR runs torch.profiler over --profile-steps A:B on
every rank (DIR/rank<R>.pt.trace.json) with named ranges: micro-batch i/K (sync or no sync), forward, backward,
stage 0's "allreduce bucket I (S)" and "allreduce wait" (zero's "reduce_scatter"/"all_gather bucket I",
and at stage 3 "unit I forward", "unit I backward", "all_gather unit I (S)", "reduce_scatter unit I (S)"),
syncbn's collectives, optimizer step, outer step. Without --profile no profiler exists and no range is made.

The metrics JSON (--metrics-out, rank 0): the final figures, step-time statistics (the first WARMUP_STEPS steps
left out), the bytes sent (zero's stages 1-3 also per group: ``sent_bytes_by_group_per_step``, inside the shard
group and across replicas), the memory, and the configuration. Its figures over ranks (the busiest rank's) are
collectives, made in one place, ``busiest_rank_figures``, in one order on every rank.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import utils
import zero
from data import TextData
from diloco import data_parallel_bytes, encoded_bytes
from measure.machine import machine_info
from measure.memory import peak_memory_mb, reset_peak_memory
from measure.summary import max_across_ranks, percentile
from measure.timing import IntervalTimer
from trainer.build import Parts, dynamo_counts
from trainer.checkpoint import Checkpointer, Position
from trainer.config import WARMUP_STEPS
from trainer.finite import FiniteCheck
from utils import UsageError

EPOCH_SCALARS = ("train_loss", "train_acc", "val_loss", "val_acc", "val_acc5", "samples_per_s", "lr")


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

    def merge(self, other: "EpochSums") -> None:
        self.loss += other.loss
        self.correct += other.correct
        self.seen += other.seen

    def values(self) -> list[float]:
        return [float(self.loss), float(self.correct), float(self.seen)]

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


def with_bits_per_byte(config: Any, figures: dict[str, Any]) -> dict[str, Any]:
    """--dataset text: val_bits_per_byte beside val_loss (nats per byte)."""
    if config.dataset == "text":
        figures["val_bits_per_byte"] = figures["val_loss"] / math.log(2)
    return figures


@dataclass
class Meter:
    """The run's measurements: step times and data waits, --log-every's window, TensorBoard, the profiler, the
    gradient norms, the state's bytes, --eval-every's evaluations, and the training time and samples."""
    parts: Parts
    timer: IntervalTimer = None  # type: ignore[assignment]
    data_wait_ms: list[float] = field(default_factory=list)  # per optimizer step, host time waiting for batches
    recent: RecentSteps | None = None  # rank 0, when something shows --log-every's figures
    writer: Any = None  # TensorBoard's SummaryWriter (rank 0, --log-dir)
    profiler: Any = None  # torch.profiler.profile with --profile
    grad_norms: list[torch.Tensor] = field(default_factory=list)  # --clip-grad-norm: each step's norm, unclipped
    window_losses: list[torch.Tensor] = field(default_factory=list)  # each step's (loss sum, samples) on this rank
    offload_steps: list[dict[str, float]] = field(default_factory=list)  # --offload: each step's own traffic
    traffic_at_start: dict[str, float] | None = None  # --offload: the store's counters when this step began
    state_bytes: dict[str, int] | None = None  # what this rank holds at an optimizer step (zero.state_bytes)
    evals: list[dict[str, Any]] = field(default_factory=list)  # --eval-every's evaluations (rank 0's figures)
    baselines: dict[str, float] = field(default_factory=dict)  # text: gzip's and the unigram's bits/byte (rank 0)
    first_step: int = 0  # the optimizer step this run started from (a resumed run: the checkpoint's)
    replicas: Any = None  # fault-tolerant replica groups (trainer/replica_groups.py): their averages' bytes count
    train_start: float = 0.0  # perf_counter() when training began ...
    eval_seconds: float = 0.0  # ... and the seconds --eval-every's evaluations have taken since
    train_time: float = 0.0  # seconds in epochs' steps
    samples_trained: int = 0  # every rank's samples in them
    finite: FiniteCheck = None  # type: ignore[assignment]  # every step's loss and norm checked (trainer/finite.py)

    def __post_init__(self) -> None:
        parts = self.parts
        self.timer = IntervalTimer(parts.device)
        self.finite = FiniteCheck(parts.ctx.world_size, parts.ctx.rank, parts.comm_device, parts.config.amp == "fp16")
        if parts.ctx.rank == 0 and parts.config.log_dir:
            from torch.utils.tensorboard import SummaryWriter  # slow to import; only when asked for
            self.writer = SummaryWriter(parts.config.log_dir)
        if parts.ctx.rank == 0 and (self.writer is not None or sys.stderr.isatty()):  # someone will see them
            self.recent = RecentSteps(torch.zeros((), dtype=torch.float64, device=parts.device))

    def start(self, position: Position, replicas: Any = None) -> None:
        """Training begins at ``position`` (with fault-tolerant ``replicas``, where the run has them): the run's first
        lines, the peak memory's count and the profiler."""
        self.first_step, self.replicas = position.optimizer_steps, replicas
        announce(self)
        reset_peak_memory(self.parts.device)
        self.profiler = start_profiler(self.parts, position)
        self.train_start = time.perf_counter()

    def bar(self, position: Position) -> tqdm:
        """The epoch's progress bar (rank 0, on a terminal)."""
        parts = self.parts
        return tqdm(total=parts.steps_per_epoch, initial=position.micro_batch // parts.config.grad_accum,
                    desc=f"epoch {position.epoch + 1}", disable=not (parts.ctx.rank == 0 and sys.stderr.isatty()),
                    leave=False)

    def step_starts(self) -> None:
        """An optimizer step begins: its timer, and with --offload the store's counters, so that a step's traffic
        is its own (a save's or an evaluation's, between steps, left out)."""
        self.timer.start()
        self.traffic_at_start = offload_counters(self.parts)

    def add_loss(self, loss: torch.Tensor, samples: int) -> None:
        """A step's training loss (this rank's sum over its ``samples``, on the device: read at the end)."""
        self.window_losses.append(torch.stack([loss, torch.tensor(float(samples), dtype=loss.dtype,
                                                                  device=loss.device)]))
        if self.recent is not None:
            self.recent.loss += loss

    def step_losses(self) -> list[float]:
        """Each optimizer step's training loss over every rank's samples (one gather, at the end), from the step
        this run started at (``first_step``)."""
        mine = [[float(loss), float(samples)] for loss, samples in self.window_losses]
        everyone: list[Any] = [None] * self.parts.ctx.world_size
        dist.all_gather_object(everyone, mine)
        return [sum(rank[i][0] for rank in everyone) / sum(rank[i][1] for rank in everyone)
                for i in range(len(mine))]

    def measure_state(self) -> None:
        """The bytes this rank holds at an optimizer step, until the optimizer has state."""
        if self.state_bytes is None or not self.state_bytes["optimizer"]:
            parts = self.parts
            self.state_bytes = zero.state_bytes(parts.model, parts.optimizer, parts.sync)

    def step_taken(self, position: Position, samples: int, waited_s: float, lr: float, bar: tqdm) -> None:
        """After an optimizer step: its data wait, the profiler's window, the bar and --log-every's figures."""
        self.data_wait_ms.append(waited_s * 1e3)
        now = offload_counters(self.parts)
        if now is not None and self.traffic_at_start is not None:
            self.offload_steps.append({key: now[key] - self.traffic_at_start[key] for key in now})
        if self.recent is not None:
            self.recent.add_step(samples, self.parts.ctx.world_size, lr)
        if self.profiler is not None:
            self.profiler.step()
        bar.update(1)
        if self.recent is not None and position.optimizer_steps % self.parts.config.log_every == 0:
            self.log_recent_steps(position.optimizer_steps, bar)

    def log_recent_steps(self, step: int, bar: tqdm) -> None:
        """--log-every: rank 0's means over the steps since the last log, to TensorBoard and the bar."""
        recent = self.recent
        figures = recent.figures(self.timer.collect()[-recent.steps:], self.data_wait_ms[-recent.steps:])
        if self.writer is not None:
            for name, value in figures.items():
                self.writer.add_scalar(f"train/{name}", value, step)
        bar.set_postfix(loss=f"{figures['loss']:.3f}", lr=f"{figures['lr']:.3g}",
                        step_ms=f"{figures['step_ms']:.1f}", wait_ms=f"{figures['data_wait_ms']:.1f}",
                        samples_s=f"{figures['samples_per_s']:.0f}")
        recent.reset()

    def epoch_entry(self, position: Position, sums: list[list[float]], val: dict[str, Any], samples: int,
                    train_time: float, epoch_start: float) -> dict[str, Any]:
        """An epoch's figures (or those of the part of it --max-steps allowed); counts its time and samples."""
        self.train_time, self.samples_trained = self.train_time + train_time, self.samples_trained + samples
        loss_sum, correct, seen = (sum(column) for column in zip(*sums))
        entry = {"epoch": position.epoch + 1, "optimizer_steps": position.optimizer_steps,
                 "train_loss": loss_sum / max(seen, 1), "train_acc": correct / max(seen, 1), **val,
                 "epoch_time_s": time.perf_counter() - epoch_start, "samples_per_s": samples / max(train_time, 1e-9),
                 "lr": self.parts.optimizer.param_groups[0]["lr"]}
        if self.parts.config.dataset == "text":
            with_bits_per_byte(self.parts.config, entry)
            entry["tokens_per_s"] = entry["samples_per_s"] * self.parts.config.context
        return entry

    def show_epoch(self, entry: dict[str, Any], step: int) -> None:
        """An epoch's figures to TensorBoard and one printed line."""
        config = self.parts.config
        if self.writer is not None:
            for key in EPOCH_SCALARS:
                self.writer.add_scalar(key, entry[key], step)
        stopped = " (stopped by --max-steps)" if entry.get("complete") is False else ""
        if config.dataset == "text":
            utils.print0(f"epoch {entry['epoch']}/{config.epochs}{stopped} | train loss {entry['train_loss']:.4f} | "
                         f"val loss {entry['val_loss']:.4f} nats/byte = {entry['val_bits_per_byte']:.3f} bits/byte "
                         f"(gzip -9 {self.baselines.get('gzip_bits_per_byte', math.nan):.3f}), next-byte acc "
                         f"{100 * entry['val_acc']:.2f}% ({entry['val_total']} bytes) | "
                         f"{entry['tokens_per_s']:.0f} tokens/s | {entry['epoch_time_s']:.1f} s")
            return
        utils.print0(f"epoch {entry['epoch']}/{config.epochs}{stopped} | "
                     f"train loss {entry['train_loss']:.4f} acc {100 * entry['train_acc']:.2f}% | "
                     f"val loss {entry['val_loss']:.4f} acc {100 * entry['val_acc']:.2f}% "
                     f"top-5 {100 * entry['val_acc5']:.2f}% ({entry['val_correct']}/{entry['val_total']}) | "
                     f"{entry['samples_per_s']:.0f} samples/s | {entry['epoch_time_s']:.1f} s")

    def eval_entry(self, position: Position) -> dict[str, Any]:
        """--eval-every: the step, the seconds of training so far (these evaluations left out) and the bytes the
        busiest rank has sent so far (a collective): the x axes of the curves of loss."""
        return {"step": position.optimizer_steps, "time_s": time.perf_counter() - self.train_start - self.eval_seconds,
                "sent_bytes": int(max_across_ranks(bytes_sent(self, position)))}

    def record_eval(self, entry: dict[str, Any], seconds: float) -> None:
        self.evals.append(with_bits_per_byte(self.parts.config, entry))
        utils.print0(f"step {entry['step']} | val loss {entry['val_loss']:.4f} | {entry['time_s']:.1f} s of training | "
                     f"{entry['sent_bytes'] / 1e6:.2f} MB sent")
        self.eval_seconds += seconds

    def stop_profiler(self) -> None:
        """A window that the run's end (or an error) cut short is written now."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def close(self) -> None:
        self.finite.settle()  # the last step's check (a run that ends without a save)
        self.stop_profiler()
        if self.writer is not None:
            self.writer.close()
            self.writer = None


# ----------------------------------------------------------------------------------------------------------
# The run's first lines and the profiler
# ----------------------------------------------------------------------------------------------------------
def announce(meter: Meter) -> None:
    """What runs, in one line from rank 0 (text: what the set holds and costs without a model, first)."""
    parts, config = meter.parts, meter.parts.config
    if isinstance(parts.data, TextData) and parts.ctx.rank == 0:
        data = parts.data
        meter.baselines = data.baselines()
        utils.print0(f"text: {data.root}: {len(data.files['train'])} files for training ({len(data.train.stream):,} "
                     f"bytes, {len(data.train):,} windows of {data.context}), {len(data.files['val'])} for "
                     f"validation ({len(data.val.stream):,} bytes); validation costs "
                     f"{meter.baselines['gzip_bits_per_byte']:.3f} bits/byte under gzip -9 and "
                     f"{meter.baselines['unigram_bits_per_byte']:.3f} by byte frequencies alone (unigram entropy)")
    world = parts.ctx.world_size
    groups = (f" as replica group {config.replica_group} of {config.replica_groups} (fault-tolerant, through "
              f"{config.coordinator})") if config.coordinator else ""
    per_step = f"{config.batch_size} x {config.grad_accum} x {world}" + (
        f" x {config.replica_groups} groups" if config.coordinator else "")
    utils.print0(f"{config.model} ({trainable_parameters(parts):,} parameters, {parts.data.num_classes} classes) on "
                 f"{world} x {parts.device.type} ({parts.ctx.backend}){groups}, grad-sync {config.grad_sync}"
                 f"{describe_outer(parts)}{f' --zero {config.zero}' if config.zero else ''}, {config.optimizer}, "
                 f"norm {config.norm}, {per_step} samples per step, {parts.steps_per_epoch} steps per epoch")


def describe_outer(parts: Parts) -> str:
    """diloco, localsgd: the replicas and how they meet, for the run's first line."""
    config = parts.config
    if parts.outer is None:  # custom --zero 1-3 and fsdp: hybrid sharding, or none
        replicas = config.replicas or 1
        return f" ({replicas} replicas x {parts.ctx.world_size // replicas} shards)" if replicas > 1 else ""
    replicas = config.replica_groups or parts.ctx.world_size // parts.replica_size
    text = f" ({replicas} replicas of {parts.replica_size}, meeting every {config.local_steps} steps"
    if config.grad_sync == "diloco":
        text += f", outer {config.outer_optimizer} lr {config.outer_lr} momentum {config.outer_momentum}"
    if config.outer_compress != "none":
        text += f", {config.outer_compress} with error feedback"
    if config.fragments > 1 or config.outer_delay:
        text += f", {config.fragments} fragments applied {config.outer_delay} steps after launch"
    return text + ")"


def trainable_parameters(parts: Parts) -> int:
    return sum(p.numel() for p in parts.model.parameters() if p.requires_grad)


def start_profiler(parts: Parts, position: Position) -> Any:
    """--profile: torch.profiler over this run's optimizer steps A..B-1 (--profile-steps) on every rank, written
    as DIR/rank<R>.pt.trace.json (Chrome trace format) when the window closes or the run ends inside it."""
    config = parts.config
    if config.profile is None:
        return None
    first, end = config.profile_steps
    total = config.epochs * parts.steps_per_epoch if not config.eval_only else 0
    left = max(0, min(total, config.max_steps or total) - position.optimizer_steps)
    if first >= left:
        raise UsageError(f"--profile-steps {first}:{end} starts past this run's {left} optimizer steps")
    os.makedirs(config.profile, exist_ok=True)
    path = os.path.join(config.profile, f"rank{parts.ctx.rank}.pt.trace.json")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if parts.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    warmup = min(first, 1)  # a step recorded and dropped, so the profiler's own start-up stays out of the trace
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Profiler won't be using warmup")  # A = 0: no step before the window
        schedule = torch.profiler.schedule(wait=first - warmup, warmup=warmup, active=end - first, repeat=1)
    profiler = torch.profiler.profile(activities=activities, schedule=schedule,
                                      on_trace_ready=lambda p: p.export_chrome_trace(path))
    profiler.start()
    return profiler


# ----------------------------------------------------------------------------------------------------------
# The metrics JSON
# ----------------------------------------------------------------------------------------------------------
def bytes_sent(meter: Meter, position: Position) -> int:
    """What this rank has sent in this run: its gradient sync's count (DDP, FSDP2: an ideal ring's figure), with
    replica groups the averages across them (an ideal ring's figure), and its outer all-reduces that have landed."""
    parts = meter.parts
    sent = parts.sync.sent_bytes()
    if sent is None:
        steps = position.optimizer_steps - meter.first_step
        sent = steps * data_parallel_bytes(trainable_parameters(parts), parts.ctx.world_size)
    across = meter.replicas.sent_bytes if meter.replicas is not None else 0  # replica groups' averages
    return sent + across + (parts.outer.sent_bytes() if parts.outer is not None else 0)


def busiest_rank_figures(meter: Meter, position: Position) -> dict[str, Any]:
    """The figures that are the busiest rank's: collectives (all-reduces of a maximum) that every rank makes here,
    in this order: the peak memory, the state's bytes, the gradient sync's bytes per step (and zero's stages 1-3:
    per group, inside the shard group and across replicas), the bytes sent, each outer all-reduce's bytes and
    --zero 3's gathered peak."""
    parts = meter.parts
    busiest = max_across_ranks
    on_cpu_phases = parts.device.type == "cpu" and parts.phases.peak_mb() is not None  # (its resets reset ru_maxrss)
    figures: dict[str, Any] = {"peak_memory_mb": busiest(parts.phases.peak_mb() if on_cpu_phases else
                                                         peak_memory_mb(parts.device))}
    everyone: list[Any] = [None] * parts.ctx.world_size  # each rank's peak per phase, MB above its start
    dist.all_gather_object(everyone, parts.phases.peaks)
    figures["memory_by_phase_mb"] = {phase: [round(peaks.get(phase, 0.0), 1) for peaks in everyone]
                                     for phase in everyone[0]}
    state = meter.state_bytes or {"params": 0, "grads": 0, "optimizer": 0}
    figures["state_bytes"] = {key: int(busiest(value)) for key, value in state.items()}
    sync_sent, steps = parts.sync.sent_bytes(), position.optimizer_steps - meter.first_step
    if sync_sent is not None and meter.replicas is not None:  # replica groups: the averages across them too
        sync_sent += meter.replicas.sent_bytes
    figures["sent_bytes_per_step"] = None if sync_sent is None or not steps else busiest(sync_sent) / steps
    if hasattr(parts.sync, "sent_bytes_by_group"):  # zero's stages 1-3 (every rank's sync has it, or none's)
        by_group = parts.sync.sent_bytes_by_group()
        figures["sent_bytes_by_group_per_step"] = {group: None if not steps else busiest(sent) / steps
                                                   for group, sent in by_group.items()}
    if parts.outer is not None:
        parts.outer.wait()  # an all-reduce still in flight at the end has its bytes counted too
    figures["sent_bytes"] = int(busiest(bytes_sent(meter, position)))
    if parts.outer is not None:  # every rank has each entry
        figures["outer_bytes"] = [int(busiest(entry["bytes"] or 0)) for entry in parts.outer.log]
    peak = parts.sync.gathered_peak()
    figures["gathered_peak"] = None if peak is None else {key: int(busiest(value)) for key, value in peak.items()}
    figures["offload"] = offload_figures(meter, steps)
    return figures


def offload_counters(parts: Any) -> dict[str, float] | None:
    """--offload: the store's counters now (zero/offload/store.py's Traffic), or None."""
    store = getattr(parts.sync, "store", None)
    if store is None:
        return None
    traffic = store.traffic
    return {"read_bytes": traffic.read_bytes, "written_bytes": traffic.written_bytes, "read_wait_s":
            traffic.read_wait_s, "write_wait_s": traffic.write_wait_s}


def offload_figures(meter: Any, steps: int) -> dict[str, Any] | None:
    """--offload: each rank's traffic through its offload file, per optimizer step: its steps' own, the median
    over the steps after the warm-up ("step_*": bytes read and written, the seconds its loop waited on them), and
    the whole run's (build, saves and evaluations included) over its steps; its file's and its buffers' bytes, and
    whether it bypassed the page cache (O_DIRECT); its tier ("disk", "cpu": host memory, where the "file" is host
    memory's slots). None without offload (on every rank alike)."""
    store = getattr(meter.parts.sync, "store", None)
    if store is None:
        return None
    traffic, per = store.traffic, max(steps, 1)
    kept = meter.offload_steps[WARMUP_STEPS:] or meter.offload_steps
    mine = {"read_bytes_per_step": traffic.read_bytes / per, "written_bytes_per_step": traffic.written_bytes / per,
            "read_wait_s_per_step": traffic.read_wait_s / per, "write_wait_s_per_step": traffic.write_wait_s / per,
            **{f"step_{key}": statistics.median(step[key] for step in kept) if kept else None
               for key in ("read_bytes", "written_bytes", "read_wait_s", "write_wait_s")},
            "steps": meter.offload_steps,
            "file_bytes": store.stored_bytes(), "buffer_bytes": store.buffer_bytes, "direct": store.file.direct,
            "tier": store.file.tier}
    everyone: list[Any] = [None] * meter.parts.ctx.world_size
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def summarize(meter: Meter, checkpointer: Checkpointer, position: Position, history: list[dict[str, Any]],
              final: dict[str, Any], wall_start: float) -> dict[str, Any]:
    """The metrics JSON: the final figures, step-time statistics (warm-up left out), the saves' stalls
    (``checkpointer``'s) and the configuration."""
    parts, config = meter.parts, meter.parts.config
    busiest = busiest_rank_figures(meter, position)  # every rank's collectives, in one place
    times = meter.timer.times_ms
    steps = times[WARMUP_STEPS:] if len(times) > WARMUP_STEPS else times
    waits = meter.data_wait_ms[len(times) - len(steps):]
    trainable, train_time = trainable_parameters(parts), meter.train_time
    return {
        "world_size": parts.ctx.world_size, "device": parts.device.type, "backend": parts.ctx.backend,
        "machine": machine_info(parts.device),  # where the figures came from (CPU model, GPU, versions)
        "optimizer_steps": position.optimizer_steps, "micro_batches": position.micro_batches,
        "trainable_parameters": trainable, "num_classes": parts.data.num_classes,
        **{key: final[key] for key in ("train_loss", "val_loss", "val_acc", "val_acc5", "val_correct",
                                       "val_correct5", "val_total")},
        "peak_memory_mb": busiest["peak_memory_mb"], "memory_by_phase_mb": busiest["memory_by_phase_mb"],
        "state_bytes": busiest["state_bytes"],
        "sent_bytes_per_step": busiest["sent_bytes_per_step"],
        **({"sent_bytes_by_group_per_step": busiest["sent_bytes_by_group_per_step"]}
           if "sent_bytes_by_group_per_step" in busiest else {}),
        **sent_figures(meter, position, trainable, busiest),
        "grad_norms": [float(norm) for norm in meter.grad_norms],  # --clip-grad-norm: this run's, before clipping
        "step_losses": meter.step_losses(), "first_step": meter.first_step,  # each step's mean training loss
        **text_figures(meter, final),
        "gathered_peak": busiest["gathered_peak"], "compile": compile_figures(parts), "offload": busiest["offload"],
        "wall_time_s": time.perf_counter() - wall_start, "train_time_s": train_time,
        "samples_per_s": meter.samples_trained / train_time if train_time else 0.0,
        "step_time_ms_median": statistics.median(steps) if steps else None,
        "step_time_ms_p10": percentile(steps, 10), "step_time_ms_p90": percentile(steps, 90),
        "step_time_ms_mean": statistics.fmean(steps) if steps else None,
        "step_time_warmup_steps": len(times) - len(steps), "step_times_ms": [round(t, 4) for t in steps],
        "data_wait_ms_median": statistics.median(waits) if waits else None,
        # the loop's pause in each save (--async-checkpoint: the copy, and any wait for the save before it) and the
        # run's end's wait for its last one
        "checkpoint_stalls_s": [round(t, 6) for t in checkpointer.stalls],
        "checkpoint_final_wait_s": round(checkpointer.final_wait, 6),
        "epochs": history + ([final] if final.get("complete") is False else []),
        "fingerprint": checkpointer.fingerprint, "config": vars(config),
    }


def sent_figures(meter: Meter, position: Position, trainable: int, busiest: dict[str, Any]) -> dict[str, Any]:
    """sent_bytes: the most any rank sent over this run, gradient sync and outer all-reduces together (DDP: what an
    ideal ring sends, 2 (W-1)/W of the model per step, the figure to compare with); data_parallel_sent_bytes: that
    ideal ring's figure over the same steps (data_parallel_bytes_per_step: per step; an outer step at H replaces H of
    them). diloco, localsgd: the outer all-reduces, each with the bytes the busiest rank sent, the time the step
    waited for it to land and the steps it was in flight."""
    parts, config = meter.parts, meter.parts.config
    per_step = data_parallel_bytes(trainable, parts.ctx.world_size)
    figures: dict[str, Any] = {"sent_bytes": busiest["sent_bytes"],
                               "data_parallel_sent_bytes": (position.optimizer_steps - meter.first_step) * per_step,
                               "data_parallel_bytes_per_step": per_step, "evals": meter.evals}
    if parts.outer is not None:
        figures["outer_all_reduces"] = [
            {"step": entry["step"], "fragment": entry["fragment"], "elements": entry["elements"], "bytes": sent,
             "wait_ms": entry.get("wait_ms"), "delay_steps": config.outer_delay}
            for entry, sent in zip(parts.outer.log, busiest["outer_bytes"])]
        figures["peak_in_flight_bytes"] = max(encoded_bytes(len(start), config.outer_compress)
                                              for start in parts.outer.start)
        figures["model_bytes"] = encoded_bytes(trainable, "none")
    return figures


def text_figures(meter: Meter, final: dict[str, Any]) -> dict[str, float]:
    """--dataset text: bits per byte (validation, and gzip's and the unigram's on the same bytes), tokens/s."""
    config = meter.parts.config
    if config.dataset != "text":
        return {}
    tokens_per_s = meter.samples_trained * config.context / meter.train_time if meter.train_time else 0.0
    return {**with_bits_per_byte(config, {"val_loss": final["val_loss"]}), "tokens_per_s": tokens_per_s,
            **{f"val_{key}": value for key, value in meter.baselines.items()}}


def compile_figures(parts: Parts) -> dict[str, Any] | None:
    """--compile's figures for the metrics: the scope, and the graphs and graph breaks of this run (rank 0's)."""
    if parts.compile_counts is None:
        return None
    now = dynamo_counts()
    return {"scope": parts.config.compile, "backend": parts.config.compile_backend,
            **{key: now[key] - parts.compile_counts[key] for key in now}}
