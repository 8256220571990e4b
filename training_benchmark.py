"""Trainer speed, memory and quality: our pipeline against PyTorch's, on the same data, seed and schedule.

    python training_benchmark.py [--quick] [--device cpu|cuda] [--nproc 2] [--grad-accum 2] [--json FILE]

Each configuration is one ``torchrun --standalone --nproc_per_node W ddp_cifar100.py ...`` run whose rank 0 writes
the trainer's metrics JSON; this script reads those files, prints one table and writes
``results/training-<machine>.json`` (the per-configuration metrics, accuracy curves included, and the machine).

Configurations, all with the same seed, data order and initial weights:
- ``ours``:    ``--grad-sync custom --norm custom`` (hand-written bucketed all-reduce, overlapped with backward,
  skipped on accumulation micro-batches; our SyncBatchNorm);
- ``ours-after``: the same, syncing after backward instead of from gradient hooks (what the overlap buys);
- ``pytorch``: ``--grad-sync ddp`` with ``--norm torch`` (nn.SyncBatchNorm) on a GPU; on the CPU ``--norm custom``,
  since nn.SyncBatchNorm refuses CPU tensors, so there the comparison isolates gradient synchronization;
- each at ``--grad-accum K`` (K >= 2) and at ``--grad-accum 1`` for reference.

``--compare-allreduce`` runs instead ``ours`` with each all-reduce the hand-written sync can use
(``--allreduce torch|ring|butterfly``: torch.distributed's, or allreduce.py's ring and butterfly on a
communication thread) at ``--grad-accum K``, compared against ``--allreduce torch``, and writes
``results/trainer-allreduce-<machine>.json``.

The headline figure is the optimizer-step time (median over steps after warm-up, all K micro-batches, the
gradient sync and the step included), measured by the trainer itself. This machine is shared and noisy, so
``--repeats R`` runs the whole list R times, in alternating order, and keeps each configuration's median run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from utils import machine_info, machine_tag, write_json

HERE = os.path.dirname(os.path.abspath(__file__))


def configurations(device: str, grad_accum: int) -> list[dict]:
    pytorch_norm = "torch" if device == "cuda" else "custom"
    rows = []
    for accum in (grad_accum, 1):
        rows += [
            {"name": f"ours/accum{accum}", "grad_sync": "custom", "norm": "custom", "sync_mode": "overlap",
             "grad_accum": accum},
            {"name": f"ours-after/accum{accum}", "grad_sync": "custom", "norm": "custom", "sync_mode": "after",
             "grad_accum": accum},
            {"name": f"pytorch/accum{accum}", "grad_sync": "ddp", "norm": pytorch_norm, "sync_mode": None,
             "grad_accum": accum},
        ]
    return rows


def allreduce_configurations(grad_accum: int) -> list[dict]:
    return [{"name": f"ours-{name}/accum{grad_accum}" if name != "torch" else f"ours/accum{grad_accum}",
             "grad_sync": "custom", "norm": "custom", "sync_mode": "overlap", "grad_accum": grad_accum,
             "allreduce": name} for name in ("torch", "ring", "butterfly")]


def trainer_command(config: dict, args: argparse.Namespace, metrics_path: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.join(HERE, "ddp_cifar100.py"),
           "--dataset", args.dataset, "--model", args.model, "--device", args.device,
           "--grad-sync", config["grad_sync"], "--norm", config["norm"],
           "--grad-accum", str(config["grad_accum"]), "--batch-size", str(args.batch_size),
           "--epochs", str(args.epochs), "--seed", str(args.seed), "--metrics-out", metrics_path]
    if args.dataset == "synthetic":
        cmd += ["--train-size", str(args.train_size), "--val-size", str(args.val_size)]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    if config["sync_mode"]:
        cmd += ["--sync-mode", config["sync_mode"]]
    if config.get("allreduce"):
        cmd += ["--allreduce", config["allreduce"]]
    if args.amp != "off":
        cmd += ["--amp", args.amp]
    return cmd


def run_trainer(config: dict, args: argparse.Namespace, attempts: int = 2) -> dict:
    """One trainer run; a failed run is retried once (said on stderr and recorded as "attempts"): a shared
    machine can fail a run for reasons of its own, and one lost run should not cost the whole table."""
    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryDirectory(prefix="trainbench-") as tmp:
            metrics_path = os.path.join(tmp, "metrics.json")
            cmd = trainer_command(config, args, metrics_path)
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_process))
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE, timeout=args.run_timeout)
            if proc.returncode == 0 and os.path.exists(metrics_path):
                with open(metrics_path) as f:
                    metrics = json.load(f)
                metrics["command"] = " ".join(cmd[1:]).replace(metrics_path, "METRICS.json")
                metrics["attempts"] = attempt
                return metrics
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-40:])
        print(f"training_benchmark: {config['name']} attempt {attempt} failed (exit {proc.returncode}):\n{tail}",
              file=sys.stderr, flush=True)
    raise SystemExit(f"training_benchmark: {config['name']} failed {attempts} times; see above")


def summarize(config: dict, metrics: dict) -> dict:
    return {
        "name": config["name"],
        "config": config,
        "step_time_ms_median": metrics["step_time_ms_median"],
        "samples_per_s": metrics["samples_per_s"],
        "peak_memory_mb": metrics["peak_memory_mb"],
        "val_acc": metrics["val_acc"],
        "val_loss": metrics["val_loss"],
        "train_loss": metrics["train_loss"],
        "val_acc_curve": [epoch["val_acc"] for epoch in metrics["epochs"]],
        "train_loss_curve": [epoch["train_loss"] for epoch in metrics["epochs"]],
        "optimizer_steps": metrics["optimizer_steps"],
        "micro_batches": metrics["micro_batches"],
        "wall_time_s": metrics["wall_time_s"],
        "command": metrics["command"],
        "attempts": metrics["attempts"],
        "metrics": metrics,
    }


def print_table(rows: list[dict], baseline_prefix: str = "pytorch/") -> None:
    baseline = {row["config"]["grad_accum"]: row["step_time_ms_median"] for row in rows
                if row["name"].startswith(baseline_prefix)}
    vs = "vs " + baseline_prefix.rstrip("/")
    header = f"{'configuration':<22}{'step ms':>10}{vs:>12}{'samples/s':>12}{'peak MB':>10}{'val acc':>9}"
    print(header)
    print("-" * len(header))
    for row in rows:
        ratio = row["step_time_ms_median"] / baseline[row["config"]["grad_accum"]]
        print(f"{row['name']:<22}{row['step_time_ms_median']:>10.1f}{ratio:>11.2f}x{row['samples_per_s']:>12.1f}"
              f"{row['peak_memory_mb']:>10.0f}{row['val_acc']:>9.4f}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few minutes on a 2-core CPU: small synthetic set")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run (at least 2)")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step (at least 2)")
    parser.add_argument("--dataset", choices=["synthetic", "cifar100"], default="synthetic")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--model", choices=["net", "resnet"], default="net")
    parser.add_argument("--batch-size", type=int, default=None, help="per-process micro-batch")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--train-size", type=int, default=None)
    parser.add_argument("--val-size", type=int, default=None)
    parser.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="run the list this many times; keep medians")
    parser.add_argument("--threads-per-process", type=int, default=1)
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds allowed for one trainer run")
    parser.add_argument("--compare-allreduce", action="store_true",
                        help="compare ours with --allreduce torch, ring and butterfly instead (see above)")
    parser.add_argument("--json", default=None, help="default: results/training-<machine>.json, or "
                                                     "results/trainer-allreduce-<machine>.json")
    args = parser.parse_args(argv)
    if args.nproc < 2:
        parser.error("--nproc must be at least 2: the point is to compare distributed pipelines")
    if args.grad_accum < 2:
        parser.error("--grad-accum must be at least 2 (grad-accum 1 runs anyway, for reference)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    quick = args.quick
    defaults = {"batch_size": 32 if quick else 64, "epochs": 3 if quick else 10,
                "train_size": 2048 if quick else 20000, "val_size": 512 if quick else 5000}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in defaults:
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1")
    if args.json is None:
        stem = "trainer-allreduce" if args.compare_allreduce else "training"
        args.json = os.path.join(HERE, "results", f"{stem}-{machine_tag(args.device)}.json")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.compare_allreduce:
        configs = allreduce_configurations(args.grad_accum)
    else:
        configs = configurations(args.device, args.grad_accum)
    runs: dict[str, list[dict]] = {c["name"]: [] for c in configs}
    total = len(configs) * args.repeats
    started = time.time()
    for repeat in range(args.repeats):
        order = configs if repeat % 2 == 0 else configs[::-1]
        for config in order:
            done = sum(len(v) for v in runs.values())
            print(f"[{done + 1}/{total}] {config['name']} ...", file=sys.stderr, flush=True)
            runs[config["name"]].append(run_trainer(config, args))
    rows = []
    for config in configs:
        by_step_time = sorted(runs[config["name"]], key=lambda m: m["step_time_ms_median"])
        rows.append(summarize(config, by_step_time[len(by_step_time) // 2]))
    print_table(rows, "ours/" if args.compare_allreduce else "pytorch/")
    payload = {
        "benchmark": "trainer-allreduce" if args.compare_allreduce else "training",
        "machine": machine_info(args.device),
        "machine_tag": machine_tag(args.device),
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "nproc": args.nproc,
        "wall_time_s": time.time() - started,
        "step_time_spread_ms": {name: [m["step_time_ms_median"] for m in ms] for name, ms in runs.items()},
        "rows": rows,
    }
    write_json(args.json, payload)
    print(f"wrote {os.path.relpath(args.json, HERE)}")


if __name__ == "__main__":
    main()
