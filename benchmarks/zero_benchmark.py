"""ZeRO stages against the replicated run, DDP, PyTorch's ZeroRedundancyOptimizer and FSDP2: what each rank holds,
what it sends, how long a step takes, and where the weights end.

    python -m benchmarks.zero_benchmark [--quick] [--models vit,resnet] [--nprocs 2,4] [--grad-accums 1,2] [--rows ...]
    python -m benchmarks.zero_benchmark --device cuda --models vit_b_16,resnet50 --nprocs 2 --grad-accums 1 --amp bf16
    python -m benchmarks.zero_benchmark --models vit,gpt --nprocs 2 --rows stage0,stage3-bf16,fsdp3-bf16 ...  # bf16
    python -m benchmarks.zero_benchmark --models gpt --nprocs 4 --rows stage0,hybrid3,hsdp ...  # 2 replicas x 2
    python -m benchmarks.zero_benchmark --trace   # one profiled stage 3 run -> results/trace-zero3-<machine>.json

Each configuration is one ``torchrun --standalone --nproc_per_node W ddp_cifar100.py ...`` run
(benchmarks/trainer_runs.py) on the synthetic set with AdamW, SyncBatchNorm (``--norm custom``; the ViT has none)
and buckets of at most --bucket-mb; for every (model, W, K = --grad-accum), the rows (--rows picks groups; all by
default):

- ``ddp`` (group ddp): DistributedDataParallel with AdamW; ``zero-redundancy`` (zero-redundancy): the same with
  ZeroRedundancyOptimizer (``--grad-sync ddp --zero 1``), PyTorch's stage 1: DDP's all-reduce, then each parameter
  broadcast by its owner;
- ``stage S torch`` / ``stage S ring`` (stageS): ``--grad-sync custom --zero S`` for S = 0, 1, 2, 3 on
  torch.distributed's collectives or on allreduce.py's ring (all-reduce at stage 0, its reduce-scatter and
  all-gather halves above). Stage 3's units are the model's blocks and the root, each gathered around its forward
  and its backward;
- ``stage 3 torch unsharded`` / ``... ring unsharded`` (stage3u): stage 3 with ``--zero3-accumulate unsharded``,
  each unit's full gradient kept over the window and reduce-scattered once (2K + 1 one-ways per step);
- ``fsdp 3`` / ``fsdp 2`` (fsdp3, fsdp2): PyTorch's FSDP2, ``fully_shard`` on the same units (``--grad-sync fsdp
  --zero 3|2``: parameters resharded after forward, or kept gathered until backward ends);

and, only when --rows names them, mixed precision and hybrid sharding:

- ``stage S torch|ring bf16`` (stageS-bf16, S = 1, 2, 3): ``--param-dtype bf16 --reduce-dtype fp32``, bf16
  weights kept (1, 2) or gathered (3) and computed in, over fp32 masters and AdamW state, gradients reduced in
  fp32; ``fsdp 3 bf16`` (fsdp3-bf16): FSDP2 with the same policy (``MixedPrecisionPolicy(bf16, fp32)``);
- ``stage S torch|ring hybrid`` (hybridS): ``--replicas 2``, the W processes as 2 replicas of S = W/2 shards
  (state sharded over a replica's S consecutive ranks, replicated across the 2), and ``hsdp`` (hsdp): FSDP2's
  HSDP on the same 2 x W/2 mesh (``--grad-sync fsdp --zero 3 --replicas 2``). W must be even and at least 4.

Columns, per row: ``state_bytes`` (the largest rank's weights, gradients and optimizer state between steps, from
the trainer's metrics) beside the formula (zero's docstring: 4/4/8 Psi bytes replicated, 8 Psi / W of state from
stage 1, 4 Psi / W of gradients from stage 2, 4 Psi / W of weights at stage 3 and in both FSDP2 rows, which shard
the parameters between steps); the bytes each rank sends per optimizer step (counted at the ring's isend calls;
for torch's collectives the trainer gives what a ring would send; DDP and FSDP2: not counted) beside the formula,
with one-way = (W-1)/W Psi x 4 bytes: 2 one-ways at stages 0 and 1, K + 1 at stage 2, 3K at stage 3 (per micro-batch
an all-gather in forward, one in backward and a reduce-scatter). The measured stage 3 figure is the run's total
over its optimizer steps, so it also holds the two whole-model all-gathers after the last step (the evaluation's
forward and the checkpoint's gather; the runs stop at the epoch's end), padding, and misses the root, which
backward does not gather again. Then the gathered peak (stage 3 ours: the most units whose full parameters were in
place at once besides the root, and the most bytes of full parameters, root included); the peak memory (the
process's resident set on the CPU, torch.cuda.max_memory_allocated on a GPU, the largest rank's); the median
optimizer-step time after the warm-up and its ratio to ``stage 0 torch``; the loss over the steps run; and the
largest difference of the final weights from ``stage 0 torch`` (read from each run's checkpoint). The bf16 and
hybrid rows' formulas (expected_bytes) take their weights' bytes and replicas; a second table gives, for zero's
stages 1-3, the bytes the busiest rank sends per step inside its shard group and across replicas (the trainer's
``sent_bytes_by_group_per_step``) beside the formula, and the goals' ratios follow: bf16 stage 3's median step
over ``fsdp 3 bf16``'s, hybrid stage 3's over ``hsdp``'s. Last, GPT-2 small's and medium's bytes per rank and
stage from the formula, fp32 and bf16 weights, at 2 and 8 processes and 8 as 2 replicas x 4 shards.
Configurations run in alternating order over --repeats and each keeps its median run. Writes
``results/zero-<machine>.json``, which report.ipynb draws as stacked bars of memory per rank (files with bf16 or
hybrid rows in a section of their own).

``--trace`` profiles instead one ``stage 3`` run (the first of --models, --nprocs, --grad-accums and --allreduces:
by default the small ViT, 2 processes, K = 1, torch's collectives) over optimizer steps 3 and 4, keeps of each
rank's Chrome trace only the named ranges (trainer_traces.merge_ranks: unit I forward / backward, all_gather
unit I and reduce_scatter unit I from launch until landed, the waits, micro-batches, the optimizer step), and
writes them as ``results/trace-zero3-<machine>.json``; it prints, per pair of units run one after the other,
whether the next unit's all-gather began before this unit's compute ended (``unit_pairs``), which report.ipynb
reads beside its timeline.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import torch

from files import write_json
from measure.machine import machine_info, machine_tag
from trainer.config import WARMUP_STEPS
from data import path_rank, read_text_files, default_text_dir
from models import GPT, GPT_SIZES, LANGUAGE_MODELS, MODELS
from benchmarks.trainer_runs import run_configuration
from benchmarks.trainer_traces import merge_ranks

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root

DEFAULT_ROWS = ("ddp", "zero-redundancy", "stage0", "stage1", "stage2", "stage3", "stage3u", "fsdp3", "fsdp2")
PRECISION_ROWS = ("stage1-bf16", "stage2-bf16", "stage3-bf16", "fsdp3-bf16")  # bf16 weights over fp32 masters
HYBRID_ROWS = ("hybrid1", "hybrid2", "hybrid3", "hsdp")  # 2 replicas x W/2 shards
ROW_GROUPS = DEFAULT_ROWS + PRECISION_ROWS + HYBRID_ROWS
REPLICAS = 2  # the hybrid rows' grid: 2 replicas (across nodes, say) of W/2 shards (within one)
BF16 = ["--param-dtype", "bf16", "--reduce-dtype", "fp32"]  # FSDP2's MixedPrecisionPolicy(bf16, fp32), ours alike
TRACE_STEPS = (WARMUP_STEPS, WARMUP_STEPS + 2)  # --trace: optimizer steps 3 and 4, after the trainer's warm-up


def row_kinds(allreduces: list[str]) -> list[tuple[str, str, str, list[str]]]:
    """Every row the benchmark knows, in table order: (its --rows group, label, --grad-sync, the other flags)."""
    kinds = [("ddp", "ddp", "ddp", []), ("zero-redundancy", "zero-redundancy", "ddp", ["--zero", "1"])]
    kinds += [(f"stage{stage}", f"stage {stage} {allreduce}", "custom",
               ["--zero", str(stage), "--allreduce", allreduce]) for stage in (0, 1, 2, 3) for allreduce in allreduces]
    kinds += [("stage3u", f"stage 3 {allreduce} unsharded", "custom",
               ["--zero", "3", "--allreduce", allreduce, "--zero3-accumulate", "unsharded"]) for allreduce in allreduces]
    kinds += [(f"fsdp{stage}", f"fsdp {stage}", "fsdp", ["--zero", str(stage)]) for stage in (3, 2)]
    kinds += [(f"stage{stage}-bf16", f"stage {stage} {allreduce} bf16", "custom",
               ["--zero", str(stage), "--allreduce", allreduce, *BF16])
              for stage in (1, 2, 3) for allreduce in allreduces]
    kinds += [("fsdp3-bf16", "fsdp 3 bf16", "fsdp", ["--zero", "3", *BF16])]
    kinds += [(f"hybrid{stage}", f"stage {stage} {allreduce} hybrid", "custom",
               ["--zero", str(stage), "--allreduce", allreduce, "--replicas", str(REPLICAS)])
              for stage in (1, 2, 3) for allreduce in allreduces]
    kinds += [("hsdp", "hsdp", "fsdp", ["--zero", "3", "--replicas", str(REPLICAS)])]
    return kinds


def configurations(model: str, nproc: int, grad_accum: int, allreduces: list[str],
                   rows: tuple[str, ...] | list[str] = DEFAULT_ROWS) -> list[dict]:
    """The runs of one (model, W, K) in table order, each with what its formulas need: the bytes of a weight
    element (``param_bytes``, 2 under --param-dtype bf16) and the number of replicas."""
    return [{"name": f"{model}/w{nproc}/k{grad_accum}/{label}", "label": label, "model": model, "nproc": nproc,
             "grad_accum": grad_accum, "grad_sync": grad_sync, "norm": "custom", "sync_mode": None, "flags": flags,
             "param_bytes": 2 if "bf16" in flags else 4,
             "replicas": int(flags[flags.index("--replicas") + 1]) if "--replicas" in flags else 1}
            for group, label, grad_sync, flags in row_kinds(allreduces) if group in rows]


def stage_of(label: str) -> int:
    """The ZeRO stage a row's label names: ddp 0, zero-redundancy 1, hsdp 3, "stage S ..." and "fsdp S ..." S."""
    named = {"ddp": 0, "zero-redundancy": 1, "hsdp": 3}
    return named[label] if label in named else int(label.split()[1])


def expected_bytes(label: str, psi: int, world_size: int, grad_accum: int, param_bytes: int = 4,
                   replicas: int = 1) -> dict[str, Any]:
    """zero's formulas for AdamW over fp32 masters: what a rank holds between steps (weights, gradients, state of
    two tensors) and the bytes it sends per optimizer step, for Psi parameters on W ranks in R replicas of S = W/R
    shards, weights of p = ``param_bytes`` bytes (4: fp32; 2: bf16 over fp32 masters) and fp32 reduction:

        stage   weights            gradients          optimizer   (bytes a rank holds between steps)
        0       4 Psi              4 Psi              8 Psi
        1       p Psi (+ 4 Psi/S)  p Psi (+ 4 Psi/S)  8 Psi / S   (+: the fp32 masters and gradient shards, bf16)
        2       p Psi (+ 4 Psi/S)  4 Psi / S          8 Psi / S
        3       4 Psi / S          4 Psi / S          8 Psi / S   (FSDP2 and HSDP, both stages: the same)

    so with bf16 weights stage 1 holds 4 Psi + 16 Psi/S, stage 2 2 Psi + 16 Psi/S and stage 3 16 Psi/S, as fp32's
    stage 3 (its masters are fp32; the bf16 units exist only while gathered). Sent inside the shard group, with
    one-way = (S-1)/S Psi elements, gathers in p bytes and reductions in 4: stages 0 and 1 a reduce-scatter and
    an all-gather (4 + p one-ways), stage 2 K reduce-scatters and one all-gather (4 K + p), stage 3 per
    micro-batch two all-gathers and a reduce-scatter (K (2 p + 4); reduce-scattering once a window, 2 K p + 4).
    Across replicas (R > 1): one all-reduce of the rank's fp32 gradient shard, 2 (R-1)/R x 4 Psi/S. A rank's
    total is the two added (expected_sent_by_group). ``sent_bytes_per_step`` is None where the run does not count
    (DDP, ZeroRedundancyOptimizer, FSDP2)."""
    stage, shards = stage_of(label), world_size // replicas
    params_sharded = stage == 3 or label.startswith("fsdp") or label == "hsdp"  # FSDP2 at 2 too: sharded
    masters = 4 * psi / shards if param_bytes != 4 else 0  # fp32 masters of their own beside lower-precision weights
    sent = expected_sent_by_group(label, psi, world_size, grad_accum, param_bytes, replicas)
    return {"params": 4 * psi / shards if params_sharded else param_bytes * psi + masters,
            "grads": 4 * psi / shards if stage >= 2 or params_sharded else param_bytes * psi + masters,
            "optimizer": 8 * psi / (shards if stage >= 1 else 1),
            "sent_bytes_per_step": sum(sent.values()) if label.startswith("stage") else None}


def expected_sent_by_group(label: str, psi: int, world_size: int, grad_accum: int, param_bytes: int = 4,
                           replicas: int = 1) -> dict[str, float]:
    """The bytes a rank sends per optimizer step inside its shard group of S = W/R ranks and across the R
    replicas (expected_bytes's formulas): {"shard_group": ..., "replicas": ...}, the replicas' 0 without them."""
    stage, shards = stage_of(label), world_size // replicas
    one_way = psi * (shards - 1) / shards  # elements
    shard_group = {0: (4 + param_bytes) * one_way, 1: (4 + param_bytes) * one_way,
                   2: (4 * grad_accum + param_bytes) * one_way,
                   3: grad_accum * (2 * param_bytes + 4) * one_way}[stage]
    if label.endswith("unsharded"):  # stage 3 reduce-scattering once per window
        shard_group = (2 * grad_accum * param_bytes + 4) * one_way
    return {"shard_group": shard_group, "replicas": 2 * (replicas - 1) / replicas * 4 * psi / shards}


GPT2_SHAPES = {"GPT-2 small": GPT_SIZES["gpt2"],  # models.py's gpt2 is GPT-2 small's shape; medium is wider and deeper
               "GPT-2 medium": dict(GPT_SIZES["gpt2"], layers=24, width=1024, heads=16)}


MEMORY_LAYOUTS = ((2, 1), (8, 1), (8, 2))  # (W, R): 2 and 8 processes, and 8 as 2 replicas x 4 shards
MEMORY_PRECISIONS = {"fp32": 4, "bf16": 2}  # the weights' bytes an element; masters and AdamW state fp32 in both


def gpt2_memory(layouts: tuple[tuple[int, int], ...] = MEMORY_LAYOUTS) -> list[dict]:
    """What a rank holds of GPT-2 small and medium (models.GPT at their shapes, GPT-2's vocabulary of 50257 and
    context of 1024, the head tied) at each stage with AdamW over W processes in R replicas (W/R shards), with
    fp32 weights and with bf16 weights over fp32 masters (stages 1-3; stage 0 has neither masters nor replicas,
    and R x S holds what S processes do): expected_bytes's arithmetic on the parameter count, built on the meta
    device (no memory). Weights, gradients and optimizer state only: activations, the buckets in flight and stage
    3's gathered units come on top."""
    rows = []
    for name, shape in GPT2_SHAPES.items():
        with torch.device("meta"):
            psi = sum(p.numel() for p in GPT(vocab_size=50257, **shape).parameters())
        rows += memory_rows(name, psi, layouts)
    return rows


def memory_rows(model: str, psi: int, layouts: tuple[tuple[int, int], ...] = MEMORY_LAYOUTS) -> list[dict]:
    """gpt2_memory's rows for one model of ``psi`` parameters: per precision, (W, R) and stage, the bytes held."""
    rows = []
    for precision, param_bytes in MEMORY_PRECISIONS.items():
        for world_size, replicas in layouts:
            for stage in range(0 if param_bytes == 4 and replicas == 1 else 1, 4):  # stage 0: whole, in fp32
                held = expected_bytes(f"stage {stage} torch", psi, world_size, 1, param_bytes, replicas)
                parts = {key: held[key] for key in ("params", "grads", "optimizer")}
                rows.append({"model": model, "parameters": psi, "precision": precision, "nproc": world_size,
                             "replicas": replicas, "stage": stage, **parts, "total": sum(parts.values())})
    return rows


def print_gpt2_memory(rows: list[dict]) -> None:
    print("\nper rank, AdamW over fp32 masters (weights + gradients + optimizer state), GB; W as R x S: R replicas "
          "of S shards:")
    print(f"{'model':<14}{'parameters':>13}{'weights':>9}{'W':>6}" + "".join(f"{f'stage {s}':>10}" for s in range(4)))
    for key in dict.fromkeys((r["model"], r["precision"], r["nproc"], r["replicas"]) for r in rows):
        mine = {r["stage"]: r for r in rows if (r["model"], r["precision"], r["nproc"], r["replicas"]) == key}
        model, precision, world_size, replicas = key
        layout = str(world_size) if replicas == 1 else f"{replicas}x{world_size // replicas}"
        print(f"{model:<14}{next(iter(mine.values()))['parameters']:>13,}{precision:>9}{layout:>6}"
              + "".join(f"{mine[s]['total'] / 1e9:>10.2f}" if s in mine else f"{'-':>10}" for s in range(4)))


def max_weight_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def run_with_weights(config: dict, args: argparse.Namespace) -> tuple[dict, dict[str, torch.Tensor]]:
    """One trainer run; its metrics and its final weights (the checkpoint written at the epoch's end: last.pt, or
    the sharded stages' folder read whole)."""
    from trainer.checkpoint import read_alone

    with tempfile.TemporaryDirectory(prefix="zerobench-") as tmp:
        run = dict(config, flags=config["flags"] + ["--checkpoint-dir", tmp])
        metrics = run_configuration(run, args)
        weights = read_alone(tmp)[1]["model"]
    metrics["command"] = metrics["command"].replace(tmp, "DIR")
    return metrics, weights


def summarize(config: dict, metrics: dict, weights_difference: float | None) -> dict:
    psi, world_size = metrics["trainable_parameters"], config["nproc"]
    shape = (config["label"], psi, world_size, config["grad_accum"], config["param_bytes"], config["replicas"])
    by_group = metrics.get("sent_bytes_by_group_per_step")  # zero's stages 1-3 only
    return {"name": config["name"], "label": config["label"], "model": config["model"], "nproc": world_size,
            "grad_accum": config["grad_accum"], "param_bytes": config["param_bytes"], "replicas": config["replicas"],
            "trainable_parameters": psi,
            "state_bytes": metrics["state_bytes"],
            "expected": expected_bytes(*shape),
            "sent_bytes_per_step": metrics["sent_bytes_per_step"],
            "sent_bytes_by_group_per_step": by_group,
            "expected_sent_by_group": expected_sent_by_group(*shape) if by_group is not None else None,
            "optimizer_steps": metrics["optimizer_steps"],  # what sent_bytes_per_step divides by
            "gathered_peak": metrics.get("gathered_peak"),
            "step_time_ms_median": metrics["step_time_ms_median"],
            "step_time_ms_p10": metrics["step_time_ms_p10"], "step_time_ms_p90": metrics["step_time_ms_p90"],
            "peak_memory_mb": metrics["peak_memory_mb"], "train_loss": metrics["train_loss"],
            "max_weight_difference_vs_stage0": weights_difference, "command": metrics["command"],
            "attempts": metrics["attempts"]}


def gathered_text(peak: dict | None) -> str:
    """"units / MB" of a row's gathered_peak, "-" where the run has none (every sync but our stage 3)."""
    return "-" if peak is None else f"{peak['units']} / {peak['bytes'] / 1e6:.2f}"


def print_rows(rows: list[dict], reference: str) -> None:
    header = (f"{'configuration':<40}{'weights MB':>11}{'grads MB':>9}{'state MB':>9}{'(formula)':>20}"
              f"{'sent MB':>8}{'(formula)':>10}{'gathered u/MB':>14}{'step ms':>9}{'vs st.0':>8}{'loss':>8}"
              f"{'max |dw|':>10}")
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
        print(f"{r['name']:<40}{mb(held['params']):>11}{mb(held['grads']):>9}{mb(held['optimizer']):>9}"
              f"{formula:>20}{mb(r['sent_bytes_per_step']):>8}{mb(expected['sent_bytes_per_step']):>10}"
              f"{gathered_text(r.get('gathered_peak')):>14}"
              f"{r['step_time_ms_median']:>9.1f}{ratio:>7.2f}x{r['train_loss']:>8.4f}"
              f"{difference if difference is not None else float('nan'):>10.1e}")


def print_sent_by_group(rows: list[dict]) -> None:
    """The bytes the busiest rank sends per optimizer step inside its shard group and across replicas, beside
    expected_sent_by_group's formula, for the rows whose sync counts them (zero's stages 1-3), and the difference
    in bytes: the measured figure is the run's total over its steps, so it holds what runs after the last step
    (the checkpoint's gather: of the fp32 masters under bf16, of every unit at stage 3; stage 3's evaluation
    forward), less the root, which stage 3's backward does not gather again, and the buckets' padding to a
    multiple of S."""
    mine = [r for r in rows if r.get("sent_bytes_by_group_per_step") is not None]
    if not mine:
        return
    header = (f"{'bytes sent per step and rank':<40}{'shard group':>13}{'(formula)':>13}{'diff':>9}"
              f"{'replicas':>11}{'(formula)':>11}{'diff':>7}")
    print("\n" + header)
    print("-" * len(header))
    for r in mine:
        sent, formula = r["sent_bytes_by_group_per_step"], r["expected_sent_by_group"]
        print(f"{r['name']:<40}{sent['shard_group']:>13,.0f}{formula['shard_group']:>13,.0f}"
              f"{sent['shard_group'] - formula['shard_group']:>9,.0f}{sent['replicas']:>11,.0f}"
              f"{formula['replicas']:>11,.0f}{sent['replicas'] - formula['replicas']:>7,.0f}")


GOALS = (("stage 3 {} bf16", "fsdp 3 bf16"), ("stage 3 {} hybrid", "hsdp"))  # ours at most 1.0x the reference


def goal_ratios(rows: list[dict], allreduces: list[str]) -> list[dict]:
    """The issue's goals, per (model, W, K) and collective: bf16 stage 3's median step over FSDP2's with the same
    policy, and hybrid stage 3's over HSDP's (each at most 1.0x), for the pairs the rows hold."""
    step = {r["name"]: r["step_time_ms_median"] for r in rows}
    ratios = []
    for r in rows:
        prefix = r["name"].rsplit("/", 1)[0]
        for ours, reference in GOALS:
            for allreduce in allreduces:
                if r["label"] == ours.format(allreduce) and f"{prefix}/{reference}" in step:
                    ratios.append({"ours": r["name"], "reference": f"{prefix}/{reference}",
                                   "ratio": step[r["name"]] / step[f"{prefix}/{reference}"]})
    return ratios


def print_goals(ratios: list[dict]) -> None:
    for ratio in ratios:
        print(f"{ratio['ours']} / {ratio['reference'].rsplit('/', 1)[1]}: {ratio['ratio']:.2f}x median step "
              f"(goal at most 1.00x)")


# ----------------------------------------------------------------------------------------------------------
# --trace: stage 3's units on a timeline, and what the prefetch hid
# ----------------------------------------------------------------------------------------------------------
UNIT_COMPUTE = re.compile(r"unit (\d+) (forward|backward)")
UNIT_COLLECTIVE = re.compile(r"(all_gather|reduce_scatter) unit (\d+) ")


def encloses(outer: dict, inner: dict) -> bool:
    return outer is not inner and outer["ts"] <= inner["ts"] and \
        inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def rank_units(events: list[dict], rank: int) -> tuple[list[dict], list[dict]]:
    """One rank's block compute ranges (``unit I forward|backward`` with ``unit`` and ``kind``; the root's left
    out: they enclose the whole pass, as the root stays gathered through it) and its units' collectives
    (``all_gather|reduce_scatter unit I`` with ``unit`` and ``op``), each ordered by start."""
    mine = sorted((e for e in events if e["pid"] == rank and e.get("ph", "X") == "X"), key=lambda e: e["ts"])
    computes = [dict(e, unit=int(m[1]), kind=m[2]) for e in mine if (m := UNIT_COMPUTE.fullmatch(e["name"]))]
    blocks = [c for c in computes if not any(encloses(c, other) for other in computes if other["kind"] == c["kind"])]
    collectives = [dict(e, unit=int(m[2]), op=m[1]) for e in mine if (m := UNIT_COLLECTIVE.match(e["name"]))]
    return blocks, collectives


def serving_gather(collectives: list[dict], block: dict) -> dict | None:
    """The all-gather that put ``block``'s unit in place for it: the unit's latest one begun before the block's
    compute ended."""
    end = block["ts"] + block["dur"]
    gathers = [c for c in collectives if c["op"] == "all_gather" and c["unit"] == block["unit"] and c["ts"] < end]
    return gathers[-1] if gathers else None


def unit_pairs(events: list[dict]) -> list[dict]:
    """Per rank, every pair of blocks computed one after the other in one pass (forward in module order, backward
    in reverse): ``first``, then ``next``, with the all-gather that served ``next``. Each pair says whether that
    gather began before ``first``'s compute ended (prefetched while it ran), whether it had landed when ``next``
    began (nothing left to wait for), how long ``next`` waited for it (ms), and in backward whether ``first``'s
    reduce-scatter landed before ``next``'s backward ended (hidden behind it)."""
    pairs = []
    for rank in sorted({e["pid"] for e in events}):
        blocks, collectives = rank_units(events, rank)
        for first, next_ in zip(blocks, blocks[1:]):
            gather = serving_gather(collectives, next_)
            if first["kind"] != next_["kind"] or gather is None:
                continue  # forward's last block, then backward's first (or a backward, then the next forward)
            landed = gather["ts"] + gather["dur"]
            pair = {"rank": rank, "kind": first["kind"], "first": first["unit"], "next": next_["unit"],
                    "gather_began_before_first_ended": gather["ts"] < first["ts"] + first["dur"],
                    "gather_landed_before_next_began": landed <= next_["ts"],
                    "wait_ms": max(0.0, landed - next_["ts"]) / 1e3}
            if first["kind"] == "backward":
                scatter = next((c for c in collectives if c["op"] == "reduce_scatter" and c["unit"] == first["unit"]
                                and c["ts"] >= first["ts"]), None)
                pair["scatter_landed_before_next_ended"] = None if scatter is None \
                    else scatter["ts"] + scatter["dur"] <= next_["ts"] + next_["dur"]
            pairs.append(pair)
    return pairs


def first_backward_gathers(events: list[dict]) -> list[dict]:
    """Per rank and backward pass, the gather of backward's first block, which has no block before it to hide
    behind: whether it began inside that block's backward range (gathered on demand, not prefetched) and the ms
    from the backward's start until it landed."""
    found = []
    for rank in sorted({e["pid"] for e in events}):
        blocks, collectives = rank_units(events, rank)
        for previous, block in zip([None] + blocks, blocks):
            starts_backward = block["kind"] == "backward" and (previous is None or previous["kind"] != "backward")
            gather = serving_gather(collectives, block)
            if not starts_backward or gather is None:
                continue
            found.append({"rank": rank, "unit": block["unit"], "began_inside": gather["ts"] >= block["ts"],
                          "ms_until_landed": max(0.0, gather["ts"] + gather["dur"] - block["ts"]) / 1e3})
    return found


def trace_settings(args: argparse.Namespace) -> tuple[dict, SimpleNamespace]:
    """--trace's one configuration (stage 3 on the first model, world size, grad-accum and collective of the
    lists) and its trainer settings: the trainer stops after the profiled steps."""
    model, nproc, grad_accum, allreduce = args.models[0], args.nprocs[0], args.grad_accums[0], args.allreduces[0]
    config = configurations(model, nproc, grad_accum, [allreduce], ["stage3"])[0]
    first, end = TRACE_STEPS
    config["flags"] = config["flags"] + common_flags(args, end, model) + ["--profile-steps", f"{first}:{end}"]
    settings = trainer_settings(args, config, end)
    return config, settings


def main_trace(args: argparse.Namespace, argv) -> dict:
    """--trace: one profiled stage 3 run; both ranks' named ranges -> results/trace-zero3-<machine>.json."""
    config, settings = trace_settings(args)
    first, end = TRACE_STEPS
    print(f"[{config['name']}] profiling steps {first} to {end - 1} ...", file=sys.stderr, flush=True)
    load_before = os.getloadavg()
    metrics = run_configuration(config, settings, profile=True)
    events = merge_ranks(metrics.pop("traces"))
    payload = {
        "traceEvents": events, "displayTimeUnit": "ms",
        "benchmark": "trace-zero3", "machine": machine_info(args.device), "machine_tag": machine_tag(args.device),
        "command": " ".join(["python", "-m", "benchmarks.zero_benchmark"]
                            + (sys.argv[1:] if argv is None else list(argv))),
        "trainer_command": metrics["command"],
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "config": config, "nproc": config["nproc"], "profiled_steps": list(TRACE_STEPS),
        "trainable_parameters": metrics["trainable_parameters"], "gathered_peak": metrics["gathered_peak"],
        "state_bytes": metrics["state_bytes"],
        "load_average_before": list(load_before), "load_average_after": list(os.getloadavg())}
    write_json(args.json, payload)
    print_pairs(events)
    print(f"wrote {os.path.relpath(args.json, HERE)}")
    return payload


def print_pairs(events: list[dict]) -> None:
    """--trace's summary of unit_pairs and first_backward_gathers, both ranks together."""
    pairs = unit_pairs(events)
    for kind in ("forward", "backward"):
        mine = [p for p in pairs if p["kind"] == kind]
        if mine:
            print(f"{kind}: the next unit's all-gather began before this unit's {kind} ended in "
                  f"{sum(p['gather_began_before_first_ended'] for p in mine)} of {len(mine)} pairs, had landed "
                  f"when the next began in {sum(p['gather_landed_before_next_began'] for p in mine)}; median wait "
                  f"{statistics.median(p['wait_ms'] for p in mine):.2f} ms")
    for gather in first_backward_gathers(events):
        print(f"rank {gather['rank']}: backward's first block, unit {gather['unit']}, "
              f"{'gathered on demand' if gather['began_inside'] else 'prefetched'}: landed "
              f"{gather['ms_until_landed']:.2f} ms after its backward began")


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="seconds per run: 2 processes, tiny sizes (a test)")
    parser.add_argument("--models", default="vit,resnet",
                        help="comma-separated models (default vit,resnet; e.g. vit_b_16, resnet50 on 32-pixel "
                             "images, or gpt and gpt2 on text cut from the standard library's source)")
    parser.add_argument("--context", type=int, default=None, help="the GPTs' context (default: the model's)")
    parser.add_argument("--allreduces", default="torch,ring",
                        help="our collectives: torch, ring or both (default torch,ring; the first is the reference)")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                        help=f"comma-separated row groups from {','.join(ROW_GROUPS)} (default "
                             f"{','.join(DEFAULT_ROWS)}; stage0 is the reference and must be one; the hybrid ones, "
                             f"{','.join(HYBRID_ROWS)}, need every --nprocs a multiple of {REPLICAS} and at least "
                             f"{2 * REPLICAS})")
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
    parser.add_argument("--trace", action="store_true",
                        help="profile one stage 3 run instead (see above); writes results/trace-zero3-<machine>.json")
    parser.add_argument("--json", default=None,
                        help="default results/zero-<machine>.json (--trace: results/trace-zero3-<machine>.json)")
    args = parser.parse_args(argv)
    try:
        args.models, args.allreduces = args.models.split(","), args.allreduces.split(",")
        args.rows = args.rows.split(",")
        args.nprocs = [int(v) for v in args.nprocs.split(",")]
        args.grad_accums = [int(v) for v in args.grad_accums.split(",")]
    except ValueError:
        parser.error("--nprocs and --grad-accums take comma-separated integers")
    if set(args.models) - set(MODELS) or not args.allreduces \
            or set(args.allreduces) - {"torch", "ring"} or min(args.nprocs) < 2 or min(args.grad_accums) < 1 \
            or min(args.batch_size, args.steps, args.repeats) < 1:
        parser.error(f"--models from {','.join(MODELS)}; --allreduces from torch,ring; --nprocs at least 2; "
                     "--grad-accums, --batch-size, --steps and --repeats at least 1")
    if set(args.rows) - set(ROW_GROUPS):
        parser.error(f"--rows from {','.join(ROW_GROUPS)}, got {','.join(args.rows)}")
    hybrid = sorted(set(args.rows) & set(HYBRID_ROWS), key=HYBRID_ROWS.index)
    uneven = [n for n in args.nprocs if n % REPLICAS or n < 2 * REPLICAS]
    if hybrid and uneven:
        parser.error(f"--rows {','.join(hybrid)} run {REPLICAS} replicas of at least 2 shards: --nprocs must be "
                     f"multiples of {REPLICAS} from {2 * REPLICAS}, got {','.join(map(str, uneven))}")
    if "stage0" not in args.rows and not args.trace:
        parser.error("--rows must include stage0: every row's step time and final weights are compared with "
                     f"stage 0 {args.allreduces[0]}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")
    if args.quick:
        args.models, args.nprocs, args.grad_accums, args.steps, args.batch_size = ["resnet"], [2], [2], 2, 4
    tag = machine_tag(args.device) + (f"-{max(args.nprocs)}xgloo" if args.device == "cuda" else "")
    stem = "trace-zero3" if args.trace else "zero"
    args.json = args.json or os.path.join(HERE, "results", f"{stem}-{tag}.json")
    return args


def common_flags(args: argparse.Namespace, max_steps: int, model: str) -> list[str]:
    """The trainer flags every configuration of ``model`` shares: AdamW, the bucket cap, where the run stops, and
    a GPT's context and split."""
    flags = ["--optimizer", "adamw", "--lr", str(args.lr), "--weight-decay", "0.01", "--bucket-mb",
             str(args.bucket_mb), "--max-steps", str(max_steps)]
    if model in LANGUAGE_MODELS:
        flags += ["--context", str(context_of(args, model)), "--val-fraction", "0.01"]
    return flags


def trainer_settings(args: argparse.Namespace, config: dict, steps: int) -> SimpleNamespace:
    """What trainer_runs.run_configuration reads, for this configuration: a set of exactly ``steps``
    optimizer steps, so the run ends at the epoch's end (evaluation and checkpoint included): synthetic images,
    or for a GPT a text folder (text_folder) of exactly that many windows."""
    samples = steps * args.batch_size * config["grad_accum"] * config["nproc"]
    text = config["model"] in LANGUAGE_MODELS
    return SimpleNamespace(
        nproc=config["nproc"], dataset="text" if text else "synthetic", model=config["model"], device=args.device,
        batch_size=args.batch_size, epochs=1, seed=0, imagenet=False, amp=args.amp,
        data_dir=text_folder(args.text_dir, samples, context_of(args, config["model"])) if text else None,
        train_size=samples, val_size=64,
        threads_per_process=1, run_timeout=args.run_timeout)


def context_of(args: argparse.Namespace, model: str) -> int:
    """A GPT's context in these runs: --context, or the model's own."""
    return args.context or GPT_SIZES[model]["context"]


def text_folder(root: str, windows: int, context: int) -> str:
    """A folder under ``root`` of two files cut from the standard library's source (its NUL-free text): one of
    exactly ``windows`` training windows of ``context`` bytes (the file and its separator make windows * context
    + 1 bytes), and one of 64 windows that the trainer's split (with --val-fraction 0.01: the first file in the
    hash ranking) takes for validation. Made once per size."""
    folder = os.path.join(root, f"text-{windows}x{context}")
    if not os.path.isdir(folder):
        source = b"".join(read_text_files(default_text_dir())[1])
        names = sorted(("one.txt", "two.txt"), key=path_rank)  # names[0] is the validation file
        os.makedirs(folder)
        with open(os.path.join(folder, names[0]), "wb") as f:
            f.write(source[:64 * context])
        with open(os.path.join(folder, names[1]), "wb") as f:
            f.write(source[64 * context:64 * context + windows * context])
    return folder


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zerobench-text-") as args.text_dir:  # the GPTs' text folders
        return main_trace(args, argv) if args.trace else main_table(args, argv)


def main_table(args: argparse.Namespace, argv) -> dict:
    configs = [c for model in args.models for nproc in args.nprocs for accum in args.grad_accums
               for c in configurations(model, nproc, accum, args.allreduces, args.rows)]
    steps = args.steps + WARMUP_STEPS  # the trainer leaves the warm-up steps out of its step-time statistics
    for config in configs:
        config["flags"] = config["flags"] + common_flags(args, steps, config["model"])
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
            runs[config["name"]].append(run_with_weights(config, trainer_settings(args, config, steps)))
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
    print_sent_by_group(rows)
    ratios = goal_ratios(rows, args.allreduces)
    print_goals(ratios)
    memory = gpt2_memory()
    print_gpt2_memory(memory)
    payload = {"benchmark": "zero", "machine": machine_info(args.device), "machine_tag": machine_tag(args.device),
               "command": " ".join(["python", "-m", "benchmarks.zero_benchmark"]
                                   + (sys.argv[1:] if argv is None else list(argv))),
               "settings": {k: v for k, v in vars(args).items() if k != "json"},
               "wall_time_s": time.time() - started, "load_average_before": list(load_before),
               "load_average_after": list(os.getloadavg()),
               "step_time_spread_ms": {name: [m["step_time_ms_median"] for m, _ in ms] for name, ms in runs.items()},
               "rows": rows, "goal_ratios": ratios, "gpt2_memory": memory}
    write_json(args.json, payload)
    print(f"wrote {os.path.relpath(args.json, HERE)}")
    return payload


if __name__ == "__main__":
    main()
