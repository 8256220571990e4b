"""Data-parallel training of image classifiers and byte-level GPTs: hand-written gradient averaging and ZeRO sharding
next to PyTorch's DistributedDataParallel, ZeroRedundancyOptimizer and FSDP2, on CIFAR-100, a synthetic set, any
image folder up to ImageNet scale, or text.

    torchrun --standalone --nproc_per_node N ddp_cifar100.py [flags]     (python ddp_cifar100.py: a world of 1)

This file is the loop; each part of the trainer lives in a room of its own under trainer/:
    trainer/config.py      the flags: Config (one frozen dataclass), parse_args and every check between flags
    trainer/build.py       process and replica groups, data, model, sync, compile, optimizer, scheduler, scaler
    trainer/checkpoint/    the Checkpointer (save, restore, the lock, the background writer), the folder's layout,
                           the run state, the trajectory's fingerprint and its compatibility
    trainer/evaluation.py  the scattered shard, evaluate, validate (exact at any world size)
    trainer/metrics.py     epoch sums, recent steps, the bar, TensorBoard, the profiler, the metrics JSON
    trainer/finite.py      a non-finite loss or gradient norm stops the run (fp16's skipped steps do not)
    trainer/generation.py  --generate: bytes sampled from a checkpoint's GPT
    trainer/export.py      python -m trainer.export: a checkpoint out as transformers' GPT-2 or safetensors;
                           --init-from reads them back
The data (in memory, image folders, text) is data.py's, the models models.py's, the syncs zero's (zero/),
references.py's and diloco.py's.

Every rank holds a full replica of the model and sees its own shard of each epoch's data (DistributedSampler,
seeded by --seed and the epoch). A micro-batch is B samples per rank; K = --grad-accum micro-batches make one
optimizer step, so one step consumes K*B*W samples on W ranks. Let n be the number of samples this rank sees in
the current window of K micro-batches (the same on every rank: the sampler pads the shards to equal length). Each
micro-batch's loss is its summed cross-entropy divided by n, so after K backward passes a rank holds
sum_i grad l_i / n over its n samples; averaging that over W ranks gives

    g = 1/W sum_r 1/n sum_{i in window of r} grad l_i = 1/(W n) sum_{i in window} grad l_i,

the gradient of the mean loss of one batch of K*B*W samples. An epoch whose last window is shorter than K
micro-batches (or whose last micro-batch is short) gets the same formula with its own n, so it still steps with
the exact mean. BatchNorm statistics are taken per micro-batch (over all ranks with SyncBatchNorm), which is what
a single process would do with micro-batches of B*W. Language models (--dataset text --model gpt|gpt2): a sample is
a window of --context bytes and its labels the next byte at each position; the loss of a window is the mean over
its positions, so the formula holds per byte, and val_loss is in nats per byte.

Fault injection, for tests of elastic restarts and of fault-tolerant replica groups: DDP_CIFAR100_FAULT="RANK:STEP"
makes that rank SIGKILL itself right after optimizer step STEP, and "[GROUP/]RANK:STEP:POINT" at another point of a
step (inside forward, backward, the all-reduce across replica groups, the optimizer's step, a state transfer, a
save), but only in the first attempt of a torchrun job, so that the restarted group runs through
(trainer/faults.py).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

import trainer
from trainer import refusals, warm_start  # (import no torch)


def before_torch(argv: list[str]) -> None:
    """The script's start, before torch is imported (so that none of it waits for torch's import): a restart of a
    replica group the coordinator refused says the same line and stops (trainer/refusals.py); a restart of a
    --warm-restarts torchrun is forked by the zygote its first start kept, and this process only stands for it
    (trainer/warm_start.py); with --coordinator, a lost coordinator is said in one line, not after a C++ stack per
    failed store call (c10d's client logs each at warning level, and reads the level once, as torch is imported)."""
    refusals.exit_if_refused(argv[1:])
    warm_start.serve_restart(argv, trainer.STARTED)
    if "--coordinator" in argv:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


if __name__ == "__main__":  # (imported, the script does nothing)
    before_torch(sys.argv)
import torch  # noqa: E402
import torch.distributed as dist
import torch.nn.functional as F

import replicas
import utils
from data import derive_seed
from files import write_json
from measure.memory import measured_phase
from measure.timing import profiled
from trainer.build import Parts, build
from trainer.checkpoint import NO_SUMS, Checkpointer, Position
from trainer.config import Config, parse_args
from trainer.evaluation import validate
from trainer.generation import generate
from trainer.metrics import EpochSums, Meter, summarize
from trainer.replica_groups import ReplicaGroups
from utils import UsageError, one_line
from zero.offload import OffloadError, OffloadRefused

__all__ = ["Config", "Trained", "UsageError", "main", "parse_args", "train"]


@dataclass(frozen=True)
class Trained:
    """What ``train`` gives back, on every rank: the metrics (what --metrics-out writes: rank 0's are the run's),
    and for callers in the same process (tests) the model, whole again (``sync.close()``), and --grad-sync
    diloco's outer state (its shared point and momentum; None without it)."""
    metrics: dict[str, Any]
    model: torch.nn.Module
    outer: dict[str, Any] | None


def train(config: Config) -> Trained:
    """Run the training (or evaluation) ``config`` describes; returns its metrics and, on every rank, the model."""
    wall_start = time.perf_counter()
    parts = build(config)  # process group, data, model, sync, optimizer, schedule, scaler
    meter = Meter(parts)  # step times, --log-every's window, TensorBoard
    checkpointer = Checkpointer.of(parts)  # saves and restores the sync, the scheduler, the scaler, the run state
    checkpointer.before_saving(meter.finite.settle)  # nothing non-finite saved: the last step's check read first
    checkpointer.when_published(meter.finite.saved)  # ... and its stop names the checkpoint that stays current
    meter.finite.watch(checkpointer.failed, checkpointer.wait_for_saves)  # a failed background save: every rank stops
    replica_groups: ReplicaGroups | None = None  # fault-tolerant replica groups: made once the run is restored
    try:
        # resume from --checkpoint-dir's checkpoint when there is one; say what runs; start --profile's window
        position, history, saved_sums = checkpointer.restore()
        parts.faults.watch(parts.sync, lambda: position.optimizer_steps)  # inside the sync's collectives, where named
        if config.coordinator:  # fault-tolerant replica groups: this group trains with the others through it
            replica_groups = ReplicaGroups(parts, checkpointer.fingerprint, position.optimizer_steps)
            checkpointer.when_published(replica_groups.replica.saved)  # what a restart of this group brings back
        meter.start(position, replica_groups)
        epoch, final = None, None
        while not config.eval_only and position.epoch < config.epochs and not stop_requested(config, position):
            # replica groups: this step's quorum; a group behind it takes the live state and goes on from there
            if replica_groups is not None and replica_groups.join(position, history, epoch):
                epoch, saved_sums = None, replica_groups.sums
            # an epoch begins (or goes on from the checkpoint's micro-batch)
            if epoch is None:
                epoch = Epoch(parts, meter, position, saved_sums if position.micro_batch else NO_SUMS)
            # one optimizer step: the window of micro-batches, forward and backward, clipping, the update (with
            # replica groups, if the quorum commits it; else the same micro-batches again, in the next quorum)
            if not optimizer_step(parts, meter, position, epoch, replica_groups):
                epoch.rewind(parts, position)
                continue
            # a checkpoint inside the epoch when due (the epoch's end is checkpointed after its validation): the
            # position and the history restore returned, every rank's sums of the epoch
            due = config.checkpoint_every and position.optimizer_steps % config.checkpoint_every == 0
            if (due or stop_requested(config, position)) and not epoch.over(position):
                checkpointer.save(epoch.sums.gather(parts.comm_device))
            # --eval-every: the validation loss against the time and the bytes sent so far
            if config.eval_every and position.optimizer_steps % config.eval_every == 0:
                start, entry = time.perf_counter(), meter.eval_entry(position)
                meter.record_eval({**entry, **validate(parts)}, time.perf_counter() - start)
            # fault injection (see the module docstring)
            parts.faults.at("after", position.optimizer_steps)
            # the epoch's end (or --max-steps'): validate and record it, checkpoint it when finished, show it
            if epoch.over(position) or stop_requested(config, position):
                finished, train_time = epoch.over(position), epoch.close(meter)
                sums = epoch.sums.gather(parts.comm_device)
                final = meter.epoch_entry(position, sums, validate(parts), epoch.samples, train_time, epoch.start)
                if finished:
                    history.append(final)
                    position.epoch, position.micro_batch = position.epoch + 1, 0
                    checkpointer.save([NO_SUMS] * parts.ctx.world_size)
                else:
                    final["complete"] = False
                meter.show_epoch(final, position.optimizer_steps)
                epoch = None
        checkpointer.finish()  # --async-checkpoint: the last save written before the run ends
        if replica_groups is not None:  # a replica group that comes back later has no one left to rejoin
            replica_groups.finish(position)
        meter.close()  # the profiler's window written, TensorBoard flushed
        # the final figures: the last epoch's, or one evaluation when nothing was trained
        if final is None:  # --eval-only, or a checkpoint with nothing left to train
            final = {"train_loss": history[-1]["train_loss"] if history else None, **validate(parts)}
            utils.print0(f"evaluation | val loss {final['val_loss']:.4f} acc {100 * final['val_acc']:.2f}% top-5 "
                         f"{100 * final['val_acc5']:.2f}% ({final['val_correct']}/{final['val_total']})")
        metrics = summarize(meter, checkpointer, position, history, final, wall_start)
    finally:
        try:  # hooks off, --zero 3's units gathered, --allreduce ring|butterfly's thread stopped
            parts.sync.close()  # before the profiler stops: what it launched under the profiler lands first
        finally:
            meter.stop_profiler()  # stopped by an error: leave no profiler running in this process
            if parts.outer is not None:
                parts.outer.close()
            if replica_groups is not None:
                replica_groups.close()
            parts.data.close()
            checkpointer.close()  # stopped by an error: its save in flight left unpublished; the lock released
    if parts.ctx.rank == 0 and config.metrics_out:
        write_json(config.metrics_out, metrics)
    return Trained(metrics, parts.model, parts.outer.state_dict() if parts.outer is not None else None)


class Epoch:
    """An epoch under way: its batches from the position on, this rank's sums, the bar, and its time and
    samples."""

    def __init__(self, parts: Parts, meter: Meter, position: Position, sums: list[float]):
        self.start = time.perf_counter()
        self.sizes = parts.data.batch_sizes()  # each micro-batch's samples on this rank
        self.sums = EpochSums.of(sums, parts.device)
        self.batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = parts.data.train_batches(position.epoch,
                                                                                             position.micro_batch)
        self.bar = meter.bar(position)
        self.samples = 0  # every rank's, in this run
        parts.model.train()

    def over(self, position: Position) -> bool:
        return position.micro_batch >= len(self.sizes)

    def rewind(self, parts: Parts, position: Position) -> None:
        """The batches from ``position`` again: a step its replica groups' quorum did not commit is taken again."""
        self.batches.close()
        self.batches = parts.data.train_batches(position.epoch, position.micro_batch)

    def close(self, meter: Meter) -> float:
        """The batches left undecoded (a run stopped mid-epoch), the bar closed, the step times collected; returns
        the seconds the epoch's steps took."""
        self.batches.close()
        self.bar.close()
        meter.timer.collect()
        return time.perf_counter() - self.start


def stop_requested(config: Config, position: Position) -> bool:
    return bool(config.max_steps) and position.optimizer_steps >= config.max_steps


def per_sample_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per sample: an image's, or a text window's mean over its positions (nats per byte; every
    window has the same number of positions, so the mean over windows is the mean over bytes)."""
    losses = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
    return losses.view(labels.shape).flatten(1).mean(1) if labels.dim() > 1 else losses


@measured_phase("steps")
def optimizer_step(parts: Parts, meter: Meter, position: Position, epoch: Epoch,
                   replica_groups: ReplicaGroups | None = None) -> bool:
    """The window of up to K micro-batches from ``position``, then one update (the module docstring's g); False
    where the fault-tolerant ``replica_groups``' quorum did not commit it (nothing applied, nothing counted)."""
    config, sync, optimizer, scaler = parts.config, parts.sync, parts.optimizer, parts.scaler
    window = range(position.micro_batch, min(position.micro_batch + config.grad_accum, len(epoch.sizes)))
    window_samples = sum(epoch.sizes[j] for j in window)  # the n of the module docstring
    window_sums = EpochSums.of(NO_SUMS, parts.device)  # added to the epoch's once the step is applied
    torch.manual_seed(derive_seed(config.seed, parts.data.placement()[0], position.optimizer_steps))  # dropout
    amp = {"device_type": parts.device.type, "enabled": parts.amp_dtype is not None,
           "dtype": parts.amp_dtype or torch.float32}
    meter.step_starts()
    waited = 0.0
    for count, j in enumerate(window, 1):
        # the next micro-batch (already being decoded by the loader's workers on the streaming path)
        start = time.perf_counter()
        inputs, labels = next(epoch.batches)
        waited += time.perf_counter() - start
        # forward and backward; the gradient average starts on the window's last micro-batch only
        last = j == window[-1]
        sync.set_requires_gradient_sync(last)
        with profiled(f"micro-batch {count}/{len(window)} ({'sync' if last else 'no sync'})"):
            with profiled("forward"), torch.autocast(**amp):
                logits = sync.module(inputs)  # the model, or DDP around it
                parts.faults.at("forward", position.optimizer_steps)
                per_sample = per_sample_loss(logits.float() if parts.amp_dtype else logits, labels)
                if parts.faults.named("nan", position.optimizer_steps):
                    per_sample = per_sample * float("nan")  # fault injection: a non-finite loss (trainer/finite.py)
            with profiled("backward"):
                scaler.scale(per_sample.sum() / window_samples).backward()
                parts.faults.at("backward", position.optimizer_steps)
        window_sums.add(per_sample, logits, labels)
    # replica groups: the gradients averaged across the quorum's groups too, and applied only if it commits
    if replica_groups is not None and not replica_groups.commit(replica_groups.average(), position, window):
        optimizer.zero_grad()
        return False
    epoch.sums.merge(window_sums)
    meter.add_loss(window_sums.loss, window_samples)
    # the gradients are averaged now (the last backward waited for it): clip, update, schedule
    lr = optimizer.param_groups[0]["lr"]  # this step's: the scheduler sets the next one's below
    with profiled("optimizer step"):
        scaler.unscale_(optimizer)  # fp16: every rank unscales (and inf-checks) its averaged gradients ...
        if config.clip_grad_norm:  # ... before the clipping sees them: the norm of the true gradient
            meter.grad_norms.append(sync.clip_grad_norm_(config.clip_grad_norm))
        meter.measure_state()
        scaler.step(optimizer)  # --zero 1-3: this rank's shards, then the model made whole again
        parts.faults.at("optimizer", position.optimizer_steps)
        # a non-finite loss or norm stops the run (read a step later, or before a save: trainer/finite.py)
        meter.finite.step(position.optimizer_steps + 1, window_sums.loss,
                          meter.grad_norms[-1] if config.clip_grad_norm else None, scaler, optimizer)
        scaler.update()
        if parts.scheduler is not None:
            parts.scheduler.step()
        optimizer.zero_grad()
    # where the run stands now
    position.optimizer_steps += 1
    position.micro_batches += len(window)
    position.micro_batch = window[-1] + 1
    epoch.samples += window_samples * parts.ctx.world_size
    # diloco, localsgd: the replicas meet when one of their all-reduces is due (replica groups: at this position)
    if parts.outer is not None:
        with profiled("outer step"):
            parts.outer.step()
    meter.timer.stop()
    # the profiler's window, the bar and --log-every's figures
    meter.step_taken(position, window_samples, waited, lr, epoch.bar)
    return True


def is_distributed_failure(exc: BaseException) -> bool:
    """A peer that never joined, died or stalled past --timeout (gloo raises some of these as RuntimeError)."""
    if isinstance(exc, dist.DistError):
        return True
    message = str(exc).lower()
    return any(marker in message for marker in ("gloo", "nccl", "connection closed by peer", "connection reset",
                                                "timed out", "timeout"))


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 when done, 2 for a usage error (one line from rank 0), 1 for a distributed failure.
    Called where a process group already exists (a LocalGroup worker), it trains on that group and leaves it."""
    joined = dist.is_initialized()  # a group of the caller's: ours to use, not to destroy
    rank = dist.get_rank() if joined else int(os.environ.get("RANK", 0))
    launched_by_torchrun = utils.launched_by_torchrun()
    try:
        earlier = refusals.earlier(argv)  # replica groups: refused at a previous start of this torchrun (callers
        if earlier is not None:  # in-process; under torchrun the script's start said it: trainer/refusals.py)
            raise replicas.ReplicaRefused(earlier)
        config = parse_args(argv)
        if config.generate is not None:  # no process group: rank 0 samples, any other rank has nothing to do
            if rank == 0:
                sys.stdout.buffer.write(generate(config) + b"\n")
                sys.stdout.flush()
            return 0
        train(config)
        dist.barrier()  # destroy the group together (rank 0 may still be writing the metrics), as c10d advises
        return 0
    except UsageError as exc:
        if rank == 0:
            print(f"ddp_cifar100.py: error: {exc}", file=sys.stderr, flush=True)
        elif launched_by_torchrun:
            time.sleep(5)  # torchrun stops the group when one worker exits: let rank 0 be heard first
        return 2
    except replicas.RunFinished as exc:  # replica groups: back after the others finished; nothing left to do
        if rank == 0:
            print(f"ddp_cifar100.py: note: {exc}", file=sys.stderr, flush=True)
        return 0
    except (replicas.GroupStops, replicas.ReplicaRefused) as exc:  # replica groups: each group's rank 0 says it
        if isinstance(exc, replicas.ReplicaRefused):  # final: a restart of this torchrun says it again at once
            refusals.remember(str(exc), argv)
        # every rank meets a refusal and the coordinator's loss (rank 0 says it); a torn transfer, its own place
        if rank == 0 or not isinstance(exc, (replicas.CoordinatorLost, replicas.ReplicaRefused)):
            print(f"ddp_cifar100.py: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except OffloadRefused as exc:  # --offload-dir refused by every rank alike: said once
        if rank == 0:
            print(f"ddp_cifar100.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except OffloadError as exc:  # this rank's offload file failed or changed under the run: its own line
        print(f"ddp_cifar100.py: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as exc:
        if not is_distributed_failure(exc):
            raise  # a bug: keep its traceback
        print(f"ddp_cifar100.py: rank {rank}: distributed failure (peer missing, dead or past --timeout): "
              f"{one_line(exc)}", file=sys.stderr, flush=True)
        return 1
    finally:
        if not joined:
            utils.cleanup_distributed()


if __name__ == "__main__":
    warm_start.keep_zygote(sys.argv)  # --warm-restarts: the zygote forked here; a restart it forks goes on here
    sys.exit(main())
