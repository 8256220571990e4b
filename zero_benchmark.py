"""ZeRO stages against the replicated run, DDP and PyTorch's ZeroRedundancyOptimizer: what each rank holds, what it
sends, how long a step takes, and where the weights end.

    python zero_benchmark.py [--quick] [--models vit,resnet] [--nprocs 2,4] [--grad-accums 1,2] [--json FILE]
    python zero_benchmark.py --device cuda --models vit_b_16,resnet50 --nprocs 2 --grad-accums 1 --amp bf16

Each configuration is one ``torchrun --standalone --nproc_per_node W ddp_cifar100.py ...`` run (training_benchmark.
run_trainer) on the synthetic set with AdamW, SyncBatchNorm (``--norm custom``; the ViT has none) and buckets of at
most --bucket-mb; for every (model, W, K = --grad-accum):

- ``ddp``: DistributedDataParallel with AdamW; ``zero-redundancy``: the same with ZeroRedundancyOptimizer
  (``--grad-sync ddp --zero 1``), PyTorch's stage 1: DDP's all-reduce, then each parameter broadcast by its owner;
- ``stage S torch`` / ``stage S ring``: ``--grad-sync custom --zero S`` for S = 0, 1, 2 on torch.distributed's
  collectives or on allreduce.py's ring (all-reduce at stage 0, its reduce-scatter and all-gather halves above).

Per row: ``state_bytes`` (the largest rank's weights, gradients and optimizer state between steps, from the
trainer's metrics) beside the formula of zero.py's docstring; bytes each rank sends per step (counted at the ring's
isend calls; for torch's collectives the trainer gives what a ring would send, and for DDP nothing: it is not
counted) beside 2 (W-1)/W Psi x 4 bytes; the peak memory (the process's resident set on the CPU,
torch.cuda.max_memory_allocated on a GPU, the largest rank's); the median optimizer-step time after the warm-up and its ratio to
``stage 0 torch``; the loss over the steps run; and the largest difference of the final weights from ``stage 0
torch`` (read from each run's checkpoint). Configurations run in alternating order over --repeats and each keeps
its median run. Writes ``results/zero-<machine>.json``, which report.ipynb draws as stacked bars of memory per rank.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import torch

from models import MODELS
from training_benchmark import HERE, run_trainer
from utils import machine_info, machine_tag, write_json


def configurations(model: str, nproc: int, grad_accum: int, allreduces: list[str]) -> list[dict]:
    rows = [("ddp", ["--grad-sync", "ddp"]), ("zero-redundancy", ["--grad-sync", "ddp", "--zero", "1"])]
    rows += [(f"stage {stage} {allreduce}", ["--zero", str(stage), "--allreduce", allreduce])
             for stage in (0, 1, 2) for allreduce in allreduces]
    return [{"name": f"{model}/w{nproc}/k{grad_accum}/{name}", "label": name, "model": model, "nproc": nproc,
             "grad_accum": grad_accum, "grad_sync": "ddp" if name in ("ddp", "zero-redundancy") else "custom",
             "norm": "custom", "sync_mode": None, "flags": flags} for name, flags in rows]


def expected_bytes(label: str, psi: int, world_size: int, grad_accum: int) -> dict[str, Any]:
    """zero.py's formulas for fp32 AdamW: weights, gradients, state (two tensors) per rank, and bytes sent."""
    stage = {"ddp": 0, "zero-redundancy": 1}.get(label) if not label.startswith("stage") else int(label.split()[1])
    sharded = world_size if stage >= 1 else 1
    one_way = 4 * psi * (world_size - 1) / world_size
    sends = 2 * one_way if stage < 2 else (grad_accum + 1) * one_way
    return {"params": 4 * psi, "grads": 4 * psi / (world_size if stage == 2 else 1), "optimizer": 8 * psi / sharded,
            "sent_bytes_per_step": None if label in ("ddp", "zero-redundancy") else sends}


def max_weight_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def run_with_weights(config: dict, args: argparse.Namespace) -> tuple[dict, dict[str, torch.Tensor]]:
    """One trainer run; its metrics and its final weights (the checkpoint written when --max-steps stops it)."""
    with tempfile.TemporaryDirectory(prefix="zerobench-") as tmp:
        run = dict(config, flags=config["flags"] + ["--checkpoint-dir", tmp])
        metrics = run_trainer(run, args)
        weights = torch.load(os.path.join(tmp, "last.pt"), map_location="cpu", weights_only=True)["model"]
    metrics["command"] = metrics["command"].replace(tmp, "DIR")
    return metrics, weights


def summarize(config: dict, metrics: dict, weights_difference: float | None) -> dict:
    psi, world_size = metrics["trainable_parameters"], config["nproc"]
    return {"name": config["name"], "label": config["label"], "model": config["model"], "nproc": world_size,
            "grad_accum": config["grad_accum"], "trainable_parameters": psi,
            "state_bytes": metrics["state_bytes"],
            "expected": expected_bytes(config["label"], psi, world_size, config["grad_accum"]),
            "sent_bytes_per_step": metrics["sent_bytes_per_step"],
            "step_time_ms_median": metrics["step_time_ms_median"],
            "step_time_ms_p10": metrics["step_time_ms_p10"], "step_time_ms_p90": metrics["step_time_ms_p90"],
            "peak_memory_mb": metrics["peak_memory_mb"], "train_loss": metrics["train_loss"],
            "max_weight_difference_vs_stage0": weights_difference, "command": metrics["command"],
            "attempts": metrics["attempts"]}


def print_rows(rows: list[dict], reference: str) -> None:
    header = (f"{'configuration':<34}{'weights MB':>11}{'grads MB':>9}{'state MB':>9}{'(formula)':>20}"
              f"{'sent MB':>8}{'(2Psi)':>7}{'step ms':>9}{'vs st.0':>8}{'loss':>8}{'max |dw|':>10}")
    print(header)
    print("-" * len(header))
    baseline = {(r["model"], r["nproc"], r["grad_accum"]): r["step_time_ms_median"] for r in rows
                if r["label"] == reference}
    for r in rows:
        held, expected = r["state_bytes"], r["expected"]
        mb = lambda b: f"{b / 1e6:.2f}" if b is not None else "-"  # noqa: E731
        formula = f"{mb(expected['params'])}/{mb(expected['grads'])}/{mb(expected['optimizer'])}"
        ratio = r["step_time_ms_median"] / baseline[(r["model"], r["nproc"], r["grad_accum"])]
        difference = r["max_weight_difference_vs_stage0"]
        print(f"{r['name']:<34}{mb(held['params']):>11}{mb(held['grads']):>9}{mb(held['optimizer']):>9}"
              f"{formula:>20}{mb(r['sent_bytes_per_step']):>8}{mb(expected['sent_bytes_per_step']):>7}"
              f"{r['step_time_ms_median']:>9.1f}{ratio:>7.2f}x{r['train_loss']:>8.4f}"
              f"{difference if difference is not None else float('nan'):>10.1e}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="seconds per run: 2 processes, tiny sizes (a test)")
    parser.add_argument("--models", default="vit,resnet",
                        help="comma-separated models that take 32-pixel images (default vit,resnet; e.g. vit_b_16, "
                             "resnet50)")
    parser.add_argument("--allreduces", default="torch,ring",
                        help="our collectives: torch, ring or both (default torch,ring; the first is the reference)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: on a one-GPU machine the processes share it over gloo")
    parser.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off")
    parser.add_argument("--nprocs", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--grad-accums", default="1,2", help="comma-separated --grad-accum values (default 1,2)")
    parser.add_argument("--batch-size", type=int, default=8, help="per-process micro-batch (default 8)")
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps per run, after 3 warm-up")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="bucket cap for every sync, DDP's too")
    parser.add_argument("--repeats", type=int, default=1, help="run the list this many times; keep medians")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="seconds allowed for one trainer run")
    parser.add_argument("--json", default=None, help="default results/zero-<machine>.json")
    args = parser.parse_args(argv)
    try:
        args.models, args.allreduces = args.models.split(","), args.allreduces.split(",")
        args.nprocs = [int(v) for v in args.nprocs.split(",")]
        args.grad_accums = [int(v) for v in args.grad_accums.split(",")]
    except ValueError:
        parser.error("--nprocs and --grad-accums take comma-separated integers")
    if set(args.models) - set(MODELS) or not args.allreduces \
            or set(args.allreduces) - {"torch", "ring"} or min(args.nprocs) < 2 or min(args.grad_accums) < 1 \
            or min(args.batch_size, args.steps, args.repeats) < 1:
        parser.error(f"--models from {','.join(MODELS)}; --allreduces from torch,ring; --nprocs at least 2; --grad-accums, --batch-size, --steps and "
                     "--repeats at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")
    if args.quick:
        args.models, args.nprocs, args.grad_accums, args.steps, args.batch_size = ["resnet"], [2], [2], 2, 4
    tag = machine_tag(args.device) + (f"-{max(args.nprocs)}xgloo" if args.device == "cuda" else "")
    args.json = args.json or os.path.join(HERE, "results", f"zero-{tag}.json")
    return args


def trainer_settings(args: argparse.Namespace, config: dict) -> SimpleNamespace:
    """What training_benchmark.trainer_command reads, for this configuration."""
    steps = args.steps + 3  # the trainer leaves 3 warm-up steps out of its step-time statistics
    samples = steps * args.batch_size * config["grad_accum"] * config["nproc"]
    return SimpleNamespace(
        nproc=config["nproc"], dataset="synthetic", model=config["model"], device=args.device,
        batch_size=args.batch_size, epochs=1, seed=0, data_dir=None, imagenet=False, amp=args.amp,
        train_size=samples, val_size=64,
        threads_per_process=1, run_timeout=args.run_timeout)


def main(argv=None) -> dict:
    args = parse_args(argv)
    configs = [c for model in args.models for nproc in args.nprocs for accum in args.grad_accums
               for c in configurations(model, nproc, accum, args.allreduces)]
    for config in configs:
        config["flags"] = config["flags"] + ["--optimizer", "adamw", "--lr", str(args.lr), "--weight-decay", "0.01",
                                             "--bucket-mb", str(args.bucket_mb), "--max-steps", str(args.steps + 3)]
    runs: dict[str, list[tuple[dict, dict]]] = {c["name"]: [] for c in configs}
    started, load_before = time.time(), os.getloadavg()
    progress = None
    if sys.stderr.isatty():
        from tqdm import tqdm
        progress = tqdm(total=len(configs) * args.repeats, desc="zero_benchmark", leave=False)
    for repeat in range(args.repeats):
        for config in configs if repeat % 2 == 0 else configs[::-1]:
            if progress is None:
                print(f"[{sum(map(len, runs.values())) + 1}/{len(configs) * args.repeats}] {config['name']} ...",
                      file=sys.stderr, flush=True)
            runs[config["name"]].append(run_with_weights(config, trainer_settings(args, config)))
            if progress is not None:
                progress.update()
    if progress is not None:
        progress.close()
    chosen = {}
    for config in configs:
        by_step_time = sorted(runs[config["name"]], key=lambda run: run[0]["step_time_ms_median"])
        chosen[config["name"]] = by_step_time[len(by_step_time) // 2]
    rows = []
    for config in configs:
        metrics, weights = chosen[config["name"]]
        reference = chosen[config["name"].rsplit("/", 1)[0] + f"/stage 0 {args.allreduces[0]}"][1]
        rows.append(summarize(config, metrics, max_weight_difference(reference, weights)))
    print_rows(rows, f"stage 0 {args.allreduces[0]}")
    payload = {"benchmark": "zero", "machine": machine_info(args.device), "machine_tag": machine_tag(args.device),
               "command": " ".join(["python", "zero_benchmark.py"] + (sys.argv[1:] if argv is None else list(argv))),
               "settings": {k: v for k, v in vars(args).items() if k != "json"},
               "wall_time_s": time.time() - started, "load_average_before": list(load_before),
               "load_average_after": list(os.getloadavg()),
               "step_time_spread_ms": {name: [m["step_time_ms_median"] for m, _ in ms] for name, ms in runs.items()},
               "rows": rows}
    write_json(args.json, payload)
    print(f"wrote {os.path.relpath(args.json, HERE)}")
    return payload


if __name__ == "__main__":
    main()
