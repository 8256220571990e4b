"""Offload (zero/offload/, the trainer's --offload disk) measured: what a step costs with the state on the disk against
the same step with it in memory, and a model whose training state is larger than the machine trained inside a
memory limit, checkpointed, and resumed on another number of processes.

    python -m benchmarks.offload_benchmark speed [--model gpt2-large] [--nproc 2] [--context 256] [--batch-size 1]
                                                 [--steps 6] [--offload-dir /var/tmp/offload] [--out results/....json]
    python -m benchmarks.offload_benchmark larger [--model gpt2-xl] [--limit-gb 12] [--steps 2] [--more-steps 2]
                                                  [--offload-dir ...] [--checkpoint-dir ...] [--out results/....json]
    python -m benchmarks.offload_benchmark timeline [--model gpt2-medium] [--nproc 2] [--steps 3] [--out ...]

``speed``: the disk's bandwidth first (O_DIRECT, 64 MB writes then reads of 2 GB in the offload folder: what the disk
gives, no checksum), then the trainer at --zero 3 with AdamW twice, in memory and with --offload disk, the same
flags, one after the other in this one call; per run its step times (the trainer's, warm-up left out), and for the
offloaded one every rank's traffic per step and the time its loop waited on the disk. It prints, and writes:
    memory_step_s     the in-memory run's median step
    offload_step_s    the offloaded run's
    ratio             offload_step_s / memory_step_s
    compute_s         the offloaded step less its loop's waits on the disk (what it computed)
    disk_s            the step's bytes over the disk's measured bandwidth (every rank's reads and writes: one disk)
    bound_ratio       offload_step_s / max(compute_s, disk_s): how close the step is to what the disk allows
    hidden            where the disk cannot hide (disk_s > memory_step_s), says by how much it cannot

``larger``: the whole torchrun inside a cgroup-v1 memory group of --limit-gb (its processes and every file's page
cache: the limit kills a process past it), three runs of the trainer (--zero 3, AdamW, --offload disk): --nproc
processes for --steps + --more-steps steps with a checkpoint after --steps (the uninterrupted run), then that
checkpoint resumed on one process for the --more-steps steps (the global batch kept: --batch-size times --nproc).
Per run: the group's peaks (memory.max_usage_in_bytes, which counts the page cache: the libraries' pages, the data,
the checkpoints' writes, reclaimed at the limit, so it reaches the limit itself in a long run; and, sampled every
second from memory.stat, its processes' own memory, rss, and the cache beside it), how often the limit made the kernel
reclaim (memory.failcnt) and whether it killed (oom_kill), each step's loss and clipping norm, the step times. The
resumed losses are compared with the uninterrupted ones: another world size sums in another order, so they agree to
float32's rounding for a step or two (docs/platform.md: training is chaotic), not bit for bit. Needs root (the
cgroup) and the disk for the state, the offload files and two checkpoints (16 + 12 + 12 Psi bytes: 59 GB at XL).

``timeline``: where a step's time and memory go. A plain loop (no trainer) on --nproc processes of a LocalGroup:
the model on the meta device, zero.shard(..., 3, init=, offload="disk"), AdamW, clipping, --steps steps; each rank
logs every read and write its store makes (start, end, bytes) and samples its resident set every 20 ms, and marks
when each forward, backward and step begins and ends. The report plots the last step of rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

from benchmarks.trainer_runs import TrainerRun, run_trainer
from files import write_json
from measure.machine import machine_info
from zero.offload.files import ALIGN, aligned_empty

CGROUP_ROOT = "/sys/fs/cgroup/memory"
PASSES = 3  # of the disk's bandwidth, each a write and a read of 2 GB


def disk_bandwidth(folder: str, total_bytes: int = 2 * 2**30, block: int = 64 * 2**20) -> dict[str, float]:
    """The disk's write and read bandwidth in ``folder``, GB/s: ``total_bytes`` in ``block`` writes with O_DIRECT
    into blocks reserved first (posix_fallocate, as the offload files reserve theirs) and written once before (the
    offload files are overwritten step after step: a first write into fresh blocks runs at half the speed here),
    then fsync, then read back the same way; the file removed."""
    path = os.path.join(folder, f"bandwidth-{os.getpid()}.bin")
    buffer = aligned_empty(block)
    buffer.random_(0, 255)
    view = memoryview(buffer.numpy())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, total_bytes)
        for offset in range(0, total_bytes, block):
            os.pwritev(fd, [view], offset)
        os.fsync(fd)
        writes, reads = [], []
        for _ in range(PASSES):  # this VM's disk varies 2x from one pass to the next: the median of a few
            start = time.perf_counter()
            for offset in range(0, total_bytes, block):
                os.pwritev(fd, [view], offset)
            os.fsync(fd)
            writes.append(total_bytes / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            for offset in range(0, total_bytes, block):
                os.preadv(fd, [view], offset)
            reads.append(total_bytes / (time.perf_counter() - start) / 1e9)
    finally:
        os.close(fd)
        os.unlink(path)
    assert block % ALIGN == 0
    return {"write_gb_s": statistics.median(writes), "read_gb_s": statistics.median(reads), "writes_gb_s": writes,
            "reads_gb_s": reads, "bytes": total_bytes}


def write_corpus(folder: str, total_bytes: int = 8_000_000, size: int = 2048) -> str:
    """The runs' text: the standard library's top-level .py files in name order, the first ``total_bytes`` of them
    cut into files of ``size`` bytes, so that --val-fraction 0.0002 keeps one file (2 kB) for validation: an
    evaluation of a billion-parameter model on the 385 kB of the trainer's default split would take longer than
    its training here. Made once; returns the folder."""
    import glob
    import sysconfig

    if os.path.isdir(folder) and os.listdir(folder):
        return folder
    os.makedirs(folder, exist_ok=True)
    text = b""
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            text += f.read()
        if len(text) > total_bytes:
            break
    for start in range(0, len(text), size):
        with open(os.path.join(folder, f"part{start // size:05d}.txt"), "wb") as f:
            f.write(text[start:start + size])
    return folder


def trainer_flags(args: argparse.Namespace, steps: int, *extra: str) -> list[str]:
    return ["--model", args.model, "--dataset", "text", "--data-dir", args.data_dir,
            "--context", str(args.context), "--val-fraction", str(args.val_fraction), "--batch-size",
            str(args.batch_size), "--zero", "3", "--optimizer", "adamw", "--lr", str(args.lr), "--clip-grad-norm",
            "1.0",
            "--max-steps", str(steps), "--seed", "1", "--timeout", "1800", *extra]


def offload_figures(metrics: dict[str, Any], bandwidth: dict[str, float]) -> dict[str, Any]:
    """From an offloaded run's metrics: every rank's traffic in a step summed (one disk serves them all: each rank's
    median over its steps, a save's or an evaluation's left out), the waits of the slowest rank, and the disk's time
    for those bytes at the measured bandwidth."""
    ranks = metrics["offload"]["ranks"]
    read = sum(rank["step_read_bytes"] for rank in ranks)
    written = sum(rank["step_written_bytes"] for rank in ranks)
    wait = max(rank["step_read_wait_s"] + rank["step_write_wait_s"] for rank in ranks)
    return {"read_bytes_per_step": read, "written_bytes_per_step": written, "wait_s_per_step": wait,
            "disk_s": read / (bandwidth["read_gb_s"] * 1e9) + written / (bandwidth["write_gb_s"] * 1e9),
            "file_bytes": sum(rank["file_bytes"] for rank in ranks), "direct": all(r["direct"] for r in ranks)}


def speed(args: argparse.Namespace) -> dict[str, Any]:
    """The ``speed`` comparison (module docstring)."""
    os.makedirs(args.offload_dir, exist_ok=True)
    bandwidth = disk_bandwidth(args.offload_dir)
    print(f"disk: write {bandwidth['write_gb_s']:.2f} GB/s, read {bandwidth['read_gb_s']:.2f} GB/s (O_DIRECT)",
          flush=True)
    runs: dict[str, TrainerRun] = {}
    for name, extra in (("memory", []), ("offload", ["--offload", "disk", "--offload-dir", args.offload_dir])):
        runs[name] = run_trainer(trainer_flags(args, args.steps, *extra), args.nproc, label=f"offload: {name}",
                                 timeout_s=args.run_timeout, env={"OMP_NUM_THREADS": "1"})
        print(f"{name}: median step {runs[name].metrics['step_time_ms_median'] / 1e3:.2f} s", flush=True)
    memory_s = runs["memory"].metrics["step_time_ms_median"] / 1e3
    offload_s = runs["offload"].metrics["step_time_ms_median"] / 1e3
    traffic = offload_figures(runs["offload"].metrics, bandwidth)
    compute_s = offload_s - traffic["wait_s_per_step"]
    result = {"memory_step_s": memory_s, "offload_step_s": offload_s, "ratio": offload_s / memory_s,
              "compute_s": compute_s, "disk_s": traffic["disk_s"],
              "bound_ratio": offload_s / max(compute_s, traffic["disk_s"]),
              "hidden": traffic["disk_s"] <= memory_s,
              "disk_over_compute": traffic["disk_s"] / memory_s, **traffic, "bandwidth": bandwidth,
              "same_losses": runs["memory"].metrics["step_losses"] == runs["offload"].metrics["step_losses"],
              "runs": {name: {key: run.metrics[key] for key in ("step_times_ms", "step_losses", "peak_memory_mb",
                                                                   "state_bytes", "offload")} | {"command": run.command}
                       for name, run in runs.items()}}
    print_speed(result)
    return result


def print_speed(result: dict[str, Any]) -> None:
    print(f"{'in memory':>12} {'offload':>10} {'ratio':>7} {'compute':>9} {'disk':>7} {'bound':>7}  bytes/step "
          f"(read + written, every rank)")
    print(f"{result['memory_step_s']:11.2f}s {result['offload_step_s']:9.2f}s {result['ratio']:7.3f} "
          f"{result['compute_s']:8.2f}s {result['disk_s']:6.2f}s {result['bound_ratio']:7.3f}  "
          f"{result['read_bytes_per_step'] / 1e9:.2f} + {result['written_bytes_per_step'] / 1e9:.2f} GB")
    if not result["hidden"]:
        print(f"the disk cannot hide behind this step: its bytes take {result['disk_over_compute']:.2f}x the "
              f"in-memory step")
    print(f"losses equal step by step: {result['same_losses']}")


# ----------------------------------------------------------------------------------------------------------
# larger: a model larger than the machine, inside a memory limit
# ----------------------------------------------------------------------------------------------------------
def in_memory_group(name: str, limit_bytes: int):
    """A ``wrap`` for run_trainer: the command started inside a fresh cgroup-v1 memory group of ``limit_bytes``
    (its children inherit it). Returns (wrap, read_peak, remove)."""
    group = os.path.join(CGROUP_ROOT, name)
    if os.path.isdir(group):
        os.rmdir(group)
    os.mkdir(group)
    with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit_bytes))

    def wrap(command: list[str]) -> list[str]:
        return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *command]

    def read(key: str) -> int:
        with open(os.path.join(group, key)) as f:
            return int(f.read().split()[0])

    def remove() -> None:
        for _ in range(20):
            try:
                os.rmdir(group)
                return
            except OSError:
                time.sleep(0.5)
    return wrap, read, remove, group


def sample_group(group: str, peaks: dict[str, int], running: list[bool]) -> None:
    """Every second until ``running[0]`` is False: the group's largest total_rss and total_cache (memory.stat)."""
    while running[0]:
        try:
            with open(os.path.join(group, "memory.stat")) as f:
                stat = dict(line.split() for line in f)
            for key in ("total_rss", "total_cache"):
                peaks[key] = max(peaks.get(key, 0), int(stat[key]))
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(1.0)


def limited_run(args: argparse.Namespace, name: str, nproc: int, flags: list[str]) -> dict[str, Any]:
    """One trainer run inside the memory limit: its metrics' figures and the group's peak."""
    import threading

    wrap, read, remove, group = in_memory_group(f"offload-{name}-{os.getpid()}", int(args.limit_gb * 1e9))
    peaks: dict[str, int] = {}
    running = [True]
    sampler = threading.Thread(target=sample_group, args=(group, peaks, running), daemon=True)
    sampler.start()
    try:
        run = run_trainer(flags, nproc, label=f"offload larger: {name}", timeout_s=args.run_timeout,
                          env={"OMP_NUM_THREADS": "1"}, wrap=wrap)
        peak, failures = read("memory.max_usage_in_bytes"), read("memory.failcnt")
        with open(os.path.join(group, "memory.oom_control")) as f:
            killed = int(dict(line.split() for line in f).get("oom_kill", 0))
    finally:
        running[0] = False
        sampler.join()
        remove()
    m = run.metrics
    figures = {"command": run.command, "wall_s": run.wall_s, "group_peak_bytes": peak, "limit_bytes": args.limit_gb
               * 1e9, "limit_hits": failures, "oom_kills": killed, "group_rss_peak_bytes": peaks.get("total_rss"),
               "group_cache_peak_bytes": peaks.get("total_cache"), "first_step": m["first_step"],
               "step_losses": m["step_losses"],
               "grad_norms": m["grad_norms"], "step_times_ms": m["step_times_ms"], "val_loss": m["val_loss"],
               "all_step_times_ms": m["step_times_ms"] or [1e3 * m["train_time_s"] / max(
                   m["optimizer_steps"] - m["first_step"], 1)],  # (too few steps for a warm-up: the mean)
               "peak_memory_mb": m["peak_memory_mb"], "memory_by_phase_mb": m["memory_by_phase_mb"],
               "state_bytes": m["state_bytes"], "offload": m["offload"], "parameters": m["trainable_parameters"],
               "world_size": m["world_size"], "checkpoint_stalls_s": m["checkpoint_stalls_s"]}
    print(f"{name}: {nproc} process(es), steps {m['first_step']}-{m['optimizer_steps']}, group peak "
          f"{peak / 1e9:.2f} GB of {args.limit_gb:g} GB (its processes' own: {peaks.get('total_rss', 0) / 1e9:.2f} "
          f"GB; reclaimed at the limit {failures} times, {killed} killed), losses "
          f"{[round(x, 4) for x in m['step_losses']]}, {run.wall_s:.0f} s", flush=True)
    return figures


def larger(args: argparse.Namespace) -> dict[str, Any]:
    """The ``larger`` runs (module docstring)."""
    checkpoints = args.checkpoint_dir
    shutil.rmtree(checkpoints, ignore_errors=True)
    os.makedirs(args.offload_dir, exist_ok=True)
    bandwidth = disk_bandwidth(args.offload_dir)
    print(f"disk: write {bandwidth['write_gb_s']:.2f} GB/s, read {bandwidth['read_gb_s']:.2f} GB/s (O_DIRECT)",
          flush=True)
    total = args.steps + args.more_steps
    common = ["--offload", "disk", "--offload-dir", args.offload_dir, "--checkpoint-dir", checkpoints,
              "--checkpoint-every", str(args.steps), "--keep-checkpoints", "2",
              *(["--activation-checkpointing"] if args.activation_checkpointing else [])]
    uninterrupted = limited_run(args, "uninterrupted", args.nproc, trainer_flags(args, total, *common))
    final = os.path.join(checkpoints, f"step-{total}")  # the resume starts from the step-STEPS folder
    shutil.rmtree(final)
    os.unlink(os.path.join(checkpoints, "latest"))
    one = argparse.Namespace(**{**vars(args), "batch_size": args.batch_size * args.nproc})  # the global batch kept
    resumed = limited_run(args, "resumed", 1, trainer_flags(one, total, *common))
    shutil.rmtree(checkpoints, ignore_errors=True)
    tail = uninterrupted["step_losses"][args.steps:]
    for run in (uninterrupted, resumed):  # where each step's time went: the disk's share at its bandwidth
        traffic = offload_figures({"offload": run["offload"]}, bandwidth)
        step_s = statistics.median(run["all_step_times_ms"]) / 1e3
        run["bound"] = {"step_s": step_s, "compute_s": step_s - traffic["wait_s_per_step"], **traffic,
                        "bound_ratio": step_s / max(step_s - traffic["wait_s_per_step"], traffic["disk_s"])}
        moved = (traffic["read_bytes_per_step"] + traffic["written_bytes_per_step"]) / 1e9
        print(f"{run['world_size']} process(es): step {step_s:.1f} s, compute {run['bound']['compute_s']:.1f} s, "
              f"disk {traffic['disk_s']:.1f} s for {moved:.1f} GB: {run['bound']['bound_ratio']:.3f}x the larger")
    result = {"uninterrupted": uninterrupted, "resumed": resumed, "bandwidth": bandwidth,
              "loss_differences": [abs(a - b) for a, b in zip(resumed["step_losses"], tail)],
              "norm_differences": [abs(a - b) for a, b in zip(resumed["grad_norms"],
                                                                 uninterrupted["grad_norms"][args.steps:])]}
    print(f"resumed on 1 against the uninterrupted run on {args.nproc}: |loss difference| per step "
          f"{[f'{d:.2e}' for d in result['loss_differences']]}, |norm difference| "
          f"{[f'{d:.2e}' for d in result['norm_differences']]}")
    return result


# ----------------------------------------------------------------------------------------------------------
# timeline: a step's disk traffic and memory, as they happen
# ----------------------------------------------------------------------------------------------------------
def timeline_in_group(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """A rank's timeline (module docstring): marks, reads and writes, resident set samples, times from its start."""
    import threading

    import torch
    import torch.nn.functional as F

    import models
    import zero

    folder = os.path.join(args.offload_dir, "timeline")
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = models.build_model(args.model, 0.0, "custom", 256, context=args.context)
    sharded = zero.shard(model, 3, init=models.initializer(model), offload="disk", offload_dir=folder)
    sharded.store.trace = True
    optimizer = sharded.optimizer(torch.optim.AdamW, model.parameters(), lr=1e-4)
    origin, marks, samples, running = time.perf_counter(), [], [], [True]

    def sample() -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while running[0]:
            with open("/proc/self/statm") as f:
                samples.append((time.perf_counter() - origin, int(f.read().split()[1]) * page))
            time.sleep(0.02)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        tokens = torch.randint(0, 256, (args.batch_size, args.context + 1), generator=generator)
        start = time.perf_counter() - origin
        logits = model(tokens[:, :-1])
        marks.append((step, "forward", start, time.perf_counter() - origin))
        start = time.perf_counter() - origin
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        marks.append((step, "backward", start, time.perf_counter() - origin))
        start = time.perf_counter() - origin
        sharded.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        marks.append((step, "step", start, time.perf_counter() - origin))
    running[0] = False
    sampler.join()
    log = [(end - origin, kind, nbytes, began - origin) for end, kind, nbytes, began in sharded.store.traffic.log]
    sharded.close()
    return {"marks": marks, "io": log, "rss": samples}


def timeline(args: argparse.Namespace) -> dict[str, Any]:
    """The ``timeline`` runs (module docstring)."""
    import harness

    with harness.LocalGroup(args.nproc, timeout_s=args.run_timeout, start_timeout_s=600) as group:
        ranks = group.run(timeline_in_group, args, timeout_s=args.run_timeout)
    last = [m for m in ranks[0]["marks"] if m[0] == args.steps - 1]
    began, ended = min(m[2] for m in last), max(m[3] for m in last)
    moved = {kind: sum(n for t, k, n, _ in ranks[0]["io"] if k == kind and began <= t <= ended)
             for kind in ("read", "write")}
    print(f"rank 0's last step: {ended - began:.1f} s, {moved['read'] / 1e9:.2f} GB read, "
          f"{moved['write'] / 1e9:.2f} GB written; " + ", ".join(f"{phase} {end - start:.1f} s"
                                                                for _, phase, start, end in last))
    return {"ranks": ranks, "last_step": {"began_s": began, "ended_s": ended, **moved}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("speed", "larger", "timeline"))
    parser.add_argument("--model", default=None, help="speed: gpt2-large; larger: gpt2-xl")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="speed: 6 (3 of them warm-up); larger: 2")
    parser.add_argument("--more-steps", type=int, default=2, help="larger: the steps after the checkpoint")
    parser.add_argument("--data-dir", default=None, help="text for the trainer (default: write_corpus's, made in "
                                                         "/var/tmp/offload-benchmark-corpus)")
    parser.add_argument("--val-fraction", type=float, default=0.0002)
    parser.add_argument("--limit-gb", type=float, default=12.0)
    parser.add_argument("--lr", type=float, default=None, help="AdamW's (speed: 1e-4; larger: 1e-6, as a billion "
                                                               "parameters' first steps take it)")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--offload-dir", default="/var/tmp/offload-benchmark")
    parser.add_argument("--checkpoint-dir", default="/var/tmp/offload-benchmark-checkpoints")
    parser.add_argument("--run-timeout", type=float, default=3 * 3600)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.model = args.model or {"speed": "gpt2-large", "larger": "gpt2-xl", "timeline": "gpt2-medium"}[args.what]
    args.steps = args.steps or {"speed": 6, "larger": 2, "timeline": 3}[args.what]
    args.data_dir = args.data_dir or write_corpus("/var/tmp/offload-benchmark-corpus")
    args.lr = args.lr or (1e-4 if args.what == "speed" else 1e-6)
    result = {"speed": speed, "larger": larger, "timeline": timeline}[args.what](args)
    result = {"benchmark": args.what, "settings": vars(args), "machine": machine_info("cpu"), **result}
    out = args.out or os.path.join("results", f"offload-{args.what}-{args.model}-cpu-2core.json")
    write_json(out, result)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
