"""Trainer speed, memory and quality: our pipeline against PyTorch's, on the same data, seed and schedule.

    python training_benchmark.py [--quick] [--device cpu|cuda] [--nproc 2] [--grad-accum 2] [--json FILE]
    python training_benchmark.py --imagenet [--device cuda] [--data-dir DIR] [--steps 40] [--json FILE]
    python training_benchmark.py --trace [--device cuda]

Each configuration is one ``torchrun --standalone --nproc_per_node W ddp_cifar100.py ...`` run whose rank 0 writes
the trainer's metrics JSON (benchmarks/trainer_runs.py, which tries a failed run once more); this script reads those
files, prints one table and writes ``results/training-<machine>.json`` (the per-configuration metrics, accuracy
curves included, and the machine).

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

``--imagenet`` measures instead where a step goes at ImageNet scale: an image folder of 224-pixel JPEGs
(``--data-dir``, or a synthetic one written first by make_image_folder.py), ResNet-50, bf16 autocast,
channels-last, one process per GPU; every ``--norm custom|torch|local`` x ``--grad-sync custom|ddp`` pair
(``--norms``, ``--grad-syncs``; nn.SyncBatchNorm needs CUDA, so the CPU leaves ``torch`` out), and a plain PyTorch
loop on random tensors already on the device (no data, no synchronization: the compute ceiling). Each row gives
the median step time, the trainer's median wait for data per step, and peak memory; the JSON goes to
``results/imagenet-<machine>.json``. ``--image-size 32 --model resnet18 --batch-size 4 --steps 2 --classes 4`` runs
it in seconds on a CPU (the folder needs an image of every class: 20 images for 100 would fail).

``--trace`` profiles instead the trainer's steps 3 to 5 (``--profile``, 2 processes, net, grad-accum 2, buckets of
at most 1 MB) with ``--sync-mode overlap`` and with ``after``, and keeps of each rank's Chrome trace only the named
ranges (torch.profiler.record_function: ProfilerStep#N, micro-batch i/K, forward, backward, allreduce bucket I
(S), allreduce wait, syncbn.*.all_reduce, optimizer step, and c10d's gloo/nccl:all_reduce): both ranks in one
Chrome trace (pid = rank, times in microseconds from the first event), ``results/trace-<mode>-<machine>.json``,
which the report draws as a timeline and ui.perfetto.dev or chrome://tracing open as they are.

The headline figure is the optimizer-step time (median over steps after warm-up, all K micro-batches, the
gradient sync and the step included), measured by the trainer itself. This machine is shared and noisy, so
``--repeats R`` runs the whole list R times, in alternating order, and keeps each configuration's median run.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks.trainer_runs import run_configuration
from benchmarks.trainer_traces import merge_ranks
from files import write_json
from measure.machine import machine_info, machine_tag
from measure.memory import peak_memory_mb, reset_peak_memory
from measure.summary import median
from measure.timing import time_calls_ms
from trainer.config import WARMUP_STEPS  # the plain loop leaves out as many steps as the trainer
from models import TORCHVISION_RESNETS, build_model

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE_STEPS = WARMUP_STEPS + 3  # --trace: the trainer's default --profile-steps window, 3:6, and nothing after it
TRACE_BUCKET_MB = 1.0  # --trace: a few buckets for the small net (3.3 MB of gradients), not one


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


def imagenet_configurations(norms: list[str], grad_syncs: list[str]) -> list[dict]:
    return [{"name": f"{grad_sync}/{norm}", "grad_sync": grad_sync, "norm": norm,
             "sync_mode": "overlap" if grad_sync == "custom" else None, "grad_accum": 1}
            for norm in norms for grad_sync in grad_syncs]


def main_trace(args: argparse.Namespace, argv) -> None:
    """--trace: one profiled run per --sync-mode; each rank's named ranges -> results/trace-<mode>-<machine>.json."""
    for mode in ("overlap", "after"):
        config = {"name": f"ours-{mode}", "grad_sync": "custom", "norm": "custom", "sync_mode": mode,
                  "grad_accum": args.grad_accum, "bucket_mb": TRACE_BUCKET_MB, "max_steps": TRACE_STEPS}
        print(f"[{config['name']}] profiling steps {WARMUP_STEPS} to {TRACE_STEPS - 1} ...", file=sys.stderr,
              flush=True)
        load_before = os.getloadavg()
        metrics = run_configuration(config, args, profile=True)
        path = os.path.join(HERE, "results", f"trace-{mode}-{machine_tag(args.device)}.json")
        write_json(path, {
            "traceEvents": merge_ranks(metrics.pop("traces")), "displayTimeUnit": "ms",
            "benchmark": "trace", "machine": machine_info(args.device), "machine_tag": machine_tag(args.device),
            "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
            "trainer_command": metrics["command"],
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "config": config, "nproc": args.nproc, "profiled_steps": [WARMUP_STEPS, TRACE_STEPS],
            "load_average_before": load_before, "load_average_after": os.getloadavg()})
        print(f"wrote {os.path.relpath(path, HERE)}")


def summarize(config: dict, metrics: dict) -> dict:
    return {
        "name": config["name"],
        "config": config,
        "step_time_ms_median": metrics["step_time_ms_median"],
        "samples_per_s": metrics["samples_per_s"],
        "data_wait_ms_median": metrics["data_wait_ms_median"],
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


def plain_loop(args: argparse.Namespace) -> dict:
    """The compute ceiling: the benchmark's model, batch, autocast and channels-last in this process, on random
    tensors already on the device; no loader, no gradient sync, plain BatchNorm; SGD as the trainer's defaults."""
    device = torch.device(args.device)
    torch.set_num_threads(args.threads_per_process)  # as the trainer's processes get
    torch.manual_seed(args.seed)
    model = build_model(args.model, 0.0, "local", args.classes, args.image_size)
    model = model.to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, args.classes, (args.batch_size,), device=device)
    amp_dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]

    def step() -> None:
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    reset_peak_memory(device)
    times = time_calls_ms(step, device, iters=args.steps, warmup=WARMUP_STEPS)
    return {"name": "plain", "config": {"name": "plain", "grad_sync": None, "norm": "local"},
            "step_time_ms_median": median(times), "samples_per_s": args.batch_size / median(times) * 1e3,
            "data_wait_ms_median": None, "peak_memory_mb": peak_memory_mb(device),
            "step_times_ms": [round(v, 4) for v in times]}


def write_imagenet_folder(args: argparse.Namespace, root: str) -> None:
    """A synthetic folder with enough training images for every process's steps (warm-up included), stored at
    256/224 of the crop size as JPEGs, as ImageNet's recipe resizes before cropping."""
    from benchmarks.make_image_folder import write_image_folder

    train_size = args.nproc * args.batch_size * (args.steps + WARMUP_STEPS)
    size = round(args.image_size * 256 / 224)
    print(f"writing {train_size} + {args.val_size} synthetic {size}-pixel JPEGs to {root} ...", file=sys.stderr,
          flush=True)
    write_image_folder(root, args.classes, train_size, args.val_size, size, "jpg", args.seed)


def print_imagenet_table(rows: list[dict]) -> None:
    ceiling = rows[0]["step_time_ms_median"]
    header = f"{'configuration':<16}{'step ms':>10}{'vs plain':>10}{'data wait ms':>14}{'peak MB':>10}"
    print(header)
    print("-" * len(header))
    for row in rows:
        wait = "-" if row["data_wait_ms_median"] is None else f"{row['data_wait_ms_median']:.1f}"
        print(f"{row['name']:<16}{row['step_time_ms_median']:>10.1f}{row['step_time_ms_median'] / ceiling:>9.2f}x"
              f"{wait:>14}{row['peak_memory_mb']:>10.0f}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few minutes on a 2-core CPU: small synthetic set")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes per run: default 2 (at least 2); with --imagenet one per GPU (1 on a CPU)")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step (at least 2)")
    parser.add_argument("--dataset", choices=["synthetic", "cifar100"], default="synthetic")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--model", choices=["net", "resnet", *TORCHVISION_RESNETS], default=None,
                        help="default net; resnet50 with --imagenet")
    parser.add_argument("--batch-size", type=int, default=None, help="per-process micro-batch")
    parser.add_argument("--imagenet", action="store_true",
                        help="the ImageNet-scale decomposition instead (see above); its flags follow")
    parser.add_argument("--image-size", type=int, default=224, help="--imagenet: side of the crops")
    parser.add_argument("--steps", type=int, default=40, help="--imagenet: timed steps per run (after the warm-up)")
    parser.add_argument("--workers", type=int, default=None, help="--imagenet: loader workers per process")
    parser.add_argument("--classes", type=int, default=100, help="--imagenet: classes of the synthetic folder")
    parser.add_argument("--norms", default=None, help="--imagenet: comma-separated, default custom,torch,local "
                                                      "(custom,local on the CPU)")
    parser.add_argument("--grad-syncs", default="custom,ddp", help="--imagenet: comma-separated")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--train-size", type=int, default=None)
    parser.add_argument("--val-size", type=int, default=None)
    parser.add_argument("--amp", choices=["off", "bf16", "fp16"], default=None, help="default off; bf16 with --imagenet")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="run the list this many times; keep medians")
    parser.add_argument("--threads-per-process", type=int, default=1)
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds allowed for one trainer run")
    parser.add_argument("--trace", action="store_true",
                        help="profile ours (overlap and after) instead; writes results/trace-<mode>-<machine>.json")
    parser.add_argument("--compare-allreduce", action="store_true",
                        help="compare ours with --allreduce torch, ring and butterfly instead (see above)")
    parser.add_argument("--json", default=None, help="default: results/training-<machine>.json, or "
                                                     "results/trainer-allreduce-<machine>.json")
    args = parser.parse_args(argv)
    if args.imagenet:
        return resolve_imagenet_args(parser, args)
    args.model, args.amp, args.nproc = args.model or "net", args.amp or "off", args.nproc or 2
    if args.model not in ("net", "resnet"):
        parser.error("--model resnet18 ... is for --imagenet (the synthetic set is 32 pixels: net or resnet)")
    if args.nproc < 2:
        parser.error("--nproc must be at least 2: the point is to compare distributed pipelines")
    if args.grad_accum < 2:
        parser.error("--grad-accum must be at least 2 (grad-accum 1 runs anyway, for reference)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.trace and (args.compare_allreduce or args.json):
        parser.error("--trace writes results/trace-<mode>-<machine>.json: no --compare-allreduce, no --json")
    quick = args.quick or args.trace  # --trace: 6 steps of the quick set
    defaults = {"batch_size": 32 if quick else 64, "epochs": 1 if args.trace else 3 if quick else 10,
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


def resolve_imagenet_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.compare_allreduce or args.trace:
        parser.error("--imagenet, --compare-allreduce and --trace are separate benchmarks: pick one")
    args.dataset, args.epochs, args.train_size = "imagefolder", 1, None
    args.model, args.amp = args.model or "resnet50", args.amp or "bf16"
    args.nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 1)
    args.batch_size = args.batch_size or 128
    args.val_size = args.val_size or args.nproc * args.batch_size
    if args.workers is None:  # the cores left beside one main process per rank, at most 12
        args.workers = max(1, min(12, (os.cpu_count() or 2) // args.nproc - 1))
    args.norms = (args.norms or ("custom,torch,local" if args.device == "cuda" else "custom,local")).split(",")
    args.grad_syncs = args.grad_syncs.split(",")
    for flag, values, allowed in (("--norms", args.norms, ("custom", "torch", "local")),
                                  ("--grad-syncs", args.grad_syncs, ("custom", "ddp"))):
        if not values or any(v not in allowed for v in values):
            parser.error(f"{flag} takes a comma-separated list of {', '.join(allowed)}, got {','.join(values)}")
    if "torch" in args.norms and args.device != "cuda":
        parser.error("--norms torch (nn.SyncBatchNorm) needs --device cuda")
    for flag, value in (("--nproc", args.nproc), ("--batch-size", args.batch_size), ("--steps", args.steps),
                        ("--image-size", args.image_size), ("--classes", args.classes), ("--repeats", args.repeats),
                        ("--val-size", args.val_size)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.json is None:
        args.json = os.path.join(HERE, "results", f"imagenet-{machine_tag(args.device)}.json")
    return args


def main_imagenet(args: argparse.Namespace, argv) -> None:
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="imagenet-folder-") as tmp:
        if args.data_dir is None:
            args.data_dir = os.path.join(tmp, "folder")
            write_imagenet_folder(args, args.data_dir)
        configs = imagenet_configurations(args.norms, args.grad_syncs)
        print("[plain] the compute ceiling ...", file=sys.stderr, flush=True)
        rows = [plain_loop(args)]
        runs: dict[str, list[dict]] = {c["name"]: [] for c in configs}
        for repeat in range(args.repeats):
            for config in configs if repeat % 2 == 0 else configs[::-1]:
                print(f"[{config['name']}] repeat {repeat + 1}/{args.repeats} ...", file=sys.stderr, flush=True)
                runs[config["name"]].append(run_configuration(config, args))
        synthetic_folder = args.data_dir.startswith(tmp)
    for config in configs:
        by_step_time = sorted(runs[config["name"]], key=lambda m: m["step_time_ms_median"])
        rows.append(summarize(config, by_step_time[len(by_step_time) // 2]))
    print_imagenet_table(rows)
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    settings["data_dir"] = "a synthetic folder (make_image_folder.py)" if synthetic_folder else args.data_dir
    write_json(args.json, {
        "benchmark": "imagenet-throughput", "machine": machine_info(args.device),
        "machine_tag": machine_tag(args.device),
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "settings": settings, "nproc": args.nproc, "wall_time_s": time.time() - started,
        "step_time_spread_ms": {name: [m["step_time_ms_median"] for m in ms] for name, ms in runs.items()},
        "rows": rows})
    print(f"wrote {os.path.relpath(args.json, HERE)}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.imagenet:
        return main_imagenet(args, argv)
    if args.trace:
        return main_trace(args, argv)
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
            runs[config["name"]].append(run_configuration(config, args))
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
