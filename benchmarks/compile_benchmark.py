"""torch.compile against eager on this machine: our SyncBatchNorm alone, and the trainer's optimizer step.

    python -m benchmarks.compile_benchmark [--parts bn,trainer,overlap] [--backend inductor] [--iters 400] [--repeats 2]
                                [--json results/compile-<machine>.json]

``--parts bn``: syncbn.SyncBatchNorm's forward + backward at the assignment's (batch, hid_dim) grid (bn_benchmark.py's
HID_DIMS x BATCH_SIZES, per-rank batch, float32, affine off: the layer bn_benchmark times), 2 processes over gloo
(harness.LocalGroup, one intra-op thread each), eager against ``torch.compile(layer, backend=--backend,
fullgraph=True)`` on the same layer and tensors. Time: the median ms per forward + backward over ``--iters``
calls (each after a barrier, measure.timing.time_calls_ms), split into 4 rounds that visit eager, compiled and the
collectives in turn (the first round warms up longer), then the slowest rank's. "The collectives" are the pass's
two all_reduce calls of 2C+1 floats timed alone: what compiling cannot remove (``best_ratio``, their time over
eager's, is the ratio a compiled pass would reach if its computation took no time). Compile time: the first
compiled forward + backward of each shape (slowest rank), a shape of its own each time (torch._dynamo.reset()
between shapes, inductor's cache fresh for this run); the first compile of the process pays the compiler's
one-time start-up, so it is done apart, on a throwaway shape, and reported as ``first_compile_s``. Each row also
gives the largest difference between the compiled and the eager output and input gradient (same input). Once per
run: torch._dynamo.explain on the forward (graph count, graph breaks and their reasons) and the number of
all_reduce calls in the forward and backward graphs AOTAutograd hands to a backend; nn.SyncBatchNorm is tried on
the same CPU tensors (it refuses them: its graph count can only be taken on a GPU).

``--parts trainer``: the trainer's step, eager against ``--compile forward --compile-backend <--backend>``, for each of
``--models`` (default resnet, the small ResNet, and net, the assignment's), 2 processes:

    torchrun --standalone --nproc_per_node 2 ddp_cifar100.py --device cpu --dataset synthetic --model M
        --train-size 2048 --val-size 256 --batch-size 32 --epochs 1 --max-steps 40 --metrics-out FILE
        [--compile forward]

with OMP_NUM_THREADS=1 and a fresh inductor cache per run (every compiled run compiles from scratch, as a first
run does). Read from the metrics: step_time_ms_median (the trainer leaves its warm-up steps out) and wall_time_s.
``--repeats`` runs of each, eager and compiled in alternating order (the list forward, then backward: the machine
is shared and noisy); the row is each mode's median run by step time (with 2 runs, the slower: a real run, as in
training_benchmark.py), with every run's step time as the spread. Compile time, estimated from the steps the
trainer leaves out: train_time_s minus the sum of step_times_ms is the warm-up steps (where Dynamo and inductor
compile, the forward at the first call and the backward at the first backward) plus what lies between steps; its
median over compiled runs minus its median over eager runs. The wall-time difference is given beside it (it
also holds the evaluation's recompile for eval mode, and any change in step time). The compiled runs' Dynamo logs
(TORCH_LOGS=graph_breaks,recompiles, rank 0) are counted: graph breaks, recompiles and which functions recompiled.

``--parts overlap``: what compiling does to the gradient buckets' overlap with the backward, read from the trainer's
own --profile traces: ``--overlap-model`` (net) with --norm local (so every all_reduce inside backward is a gradient
bucket's) and ``--bucket-mb 1`` (several buckets; the smallest Dynamo's DDPOptimizer takes), 12 steps, steps 8-10
profiled; --grad-sync custom eager, --compile forward and --compile blocks, and --grad-sync ddp eager and --compile
forward. From rank 0's trace (overlap_in_trace): how much of the backward's computation ran with a bucket's
all_reduce already launched beside it, and what is left of the backward after its last launch.

Goals (printed met/missed, and in the JSON): compiled SyncBatchNorm forward + backward at most 0.8x eager, per
shape and by the median ratio over the grid; the compiled trainer step at most 0.9x eager for the small ResNet.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import harness
import syncbn
from benchmarks import trainer_runs
from bn_benchmark import BATCH_SIZES, HID_DIMS, make_step
from files import write_json
from measure.machine import machine_info, machine_tag
from measure.summary import max_across_ranks, median
from measure.timing import time_calls_ms
from utils import one_line

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
PROG = "compile_benchmark.py"
PARTS = ("bn", "trainer", "overlap")
MODELS = ("net", "resnet", "vit")  # the trainer's models for 32-pixel images
ROUNDS = 4  # alternating rounds the bn part's calls are split into
WARMUP = 10  # untimed calls before each round (4x before the first)
BN_GOAL, TRAINER_GOAL = 0.8, 0.9  # compiled / eager at most
FIRST_COMPILE_SHAPE = (4, 8)  # (batch, hid_dim): the throwaway shape that pays the compiler's start-up
NPROC = 2


class BenchmarkError(Exception):
    """Bad flags or a failed part: one line on stderr, exit status 2 (bad flags) or 1."""


# ----------------------------------------------------------------------------------------------------------
# Part 1: SyncBatchNorm alone, in a LocalGroup of 2
# ----------------------------------------------------------------------------------------------------------
def first_compile(rank: int, world_size: int, backend: str) -> float:
    """Seconds of the process's first compiled forward + backward (a throwaway shape), slowest rank."""
    import torch._dynamo

    batch, hid = FIRST_COMPILE_SHAPE
    x = torch.randn(batch, hid, requires_grad=True)
    compiled = torch.compile(syncbn.SyncBatchNorm(hid), backend=backend, fullgraph=True)
    dist.barrier()
    start = time.perf_counter()
    compiled(x).backward(torch.randn(batch, hid))
    seconds = time.perf_counter() - start
    torch._dynamo.reset()
    return max_across_ranks(seconds)


def graph_facts(rank: int, world_size: int, batch: int, hid: int) -> dict[str, Any]:
    """Ours: Dynamo's explain on the forward, and the all_reduce calls in the forward and backward graphs that
    AOTAutograd builds (captured, run as they are). nn.SyncBatchNorm: whether it takes these CPU tensors."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(1234 + rank)
    x = torch.randn(batch, hid, requires_grad=True)
    layer = syncbn.SyncBatchNorm(hid)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x)
    ours = {"graph_count": explained.graph_count, "graph_break_count": explained.graph_break_count,
            "break_reasons": [str(reason.reason) for reason in explained.break_reasons]}
    torch._dynamo.reset()
    graphs: dict[str, list[int]] = {"forward": [], "backward": []}

    def capture(kind):
        def compiler(graph_module, _):
            graphs[kind].append(sum("all_reduce" in str(node.target) for node in graph_module.graph.nodes
                                    if node.op == "call_function"))
            return make_boxed_func(graph_module.forward)
        return compiler

    captured = torch.compile(layer, backend=aot_autograd(fw_compiler=capture("forward"),
                                                         bw_compiler=capture("backward")), fullgraph=True)
    captured(x).backward(torch.randn(batch, hid))
    torch._dynamo.reset()
    ours["all_reduce_per_graph"] = graphs
    try:  # in training mode, in a group of 2: nn.SyncBatchNorm checks the device first
        nn.SyncBatchNorm(hid)(x.detach())
        theirs = {"runs_on_cpu": True, "error": None}
    except Exception as exc:  # noqa: BLE001 (what it raises is the finding)
        theirs = {"runs_on_cpu": False, "error": one_line(exc)}
    return {"ours": ours, "nn.SyncBatchNorm": theirs}


def bn_row(rank: int, world_size: int, batch: int, hid: int, backend: str, iters: int) -> dict[str, Any]:
    """One shape: compile time, compiled-vs-eager differences, then eager and compiled timed in alternating
    rounds (median ms per forward + backward, slowest rank)."""
    import torch._dynamo

    cpu = torch.device("cpu")
    torch._dynamo.reset()  # a graph of its own for this shape: static shapes, nothing reused from the last one
    torch.manual_seed(1234 + rank)
    x = torch.randn(batch, hid, requires_grad=True)
    grad_output = torch.randn(batch, hid)
    layer = syncbn.SyncBatchNorm(hid)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)

    dist.barrier()
    start = time.perf_counter()
    y_compiled = compiled(x)
    y_compiled.backward(grad_output)
    compile_s = time.perf_counter() - start
    dx_compiled, x.grad = x.grad, None
    y_eager = layer(x)
    y_eager.backward(grad_output)
    dx_eager, x.grad = x.grad, None
    output_diff = (y_compiled - y_eager).abs().max().item()
    grad_diff = (dx_compiled - dx_eager).abs().max().item()

    buffers = [torch.zeros(2 * hid + 1), torch.zeros(2 * hid + 1)]

    def collectives():  # what compiling cannot remove: the pass's two all_reduce calls of 2C+1 floats
        dist.all_reduce(buffers[0])
        dist.all_reduce(buffers[1])

    steps = {"eager": make_step(layer, x, grad_output), "compiled": make_step(compiled, x, grad_output),
             "collectives": collectives}
    rounds = min(ROUNDS, iters)
    warmup = min(WARMUP, max(iters // rounds, 1))  # a handful of timed calls (a test) gets as few warm-up calls
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_index in range(rounds):
        calls = iters // rounds + (1 if round_index < iters % rounds else 0)
        for name, step in steps.items():
            times[name] += time_calls_ms(step, cpu, calls, warmup=warmup if round_index else 4 * warmup)
    eager_ms = max_across_ranks(median(times["eager"]))
    compiled_ms = max_across_ranks(median(times["compiled"]))
    collectives_ms = max_across_ranks(median(times["collectives"]))
    torch._dynamo.reset()
    return {"hid_dim": hid, "batch_size": batch, "global_batch": batch * world_size,
            "eager_ms": eager_ms, "compiled_ms": compiled_ms, "ratio": compiled_ms / eager_ms,
            "collectives_ms": collectives_ms, "best_ratio": collectives_ms / eager_ms,
            "compile_s": max_across_ranks(compile_s),
            "max_abs_diff_output": max_across_ranks(output_diff),
            "max_abs_diff_grad_input": max_across_ranks(grad_diff),
            "timed_calls_each": len(times["eager"])}


def progress_bar(total: int, desc: str):
    """tqdm on a terminal, else None (the callers then print a line per item on stderr)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, leave=False)


def run_bn(args: argparse.Namespace) -> dict[str, Any]:
    shapes = args.shapes
    print(f"part bn: syncbn.SyncBatchNorm forward + backward, {NPROC} processes over gloo, 1 intra-op thread each; "
          f"eager vs torch.compile(backend={args.backend!r}, fullgraph=True); median of {args.iters} calls, "
          f"slowest rank", flush=True)
    load_before = os.getloadavg()
    rows = []
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(harness.LocalGroup(NPROC, timeout_s=args.run_timeout))
        progress = progress_bar(len(shapes) + 2, "bn")

        def run(what, fn, *fn_args):
            if progress is None:
                print(f"[bn] {what} ...", file=sys.stderr, flush=True)
            else:
                progress.set_postfix_str(what)
            result = group.run(fn, *fn_args)[0]
            if progress is not None:
                progress.update()
            return result

        first_s = run("first compile (the compiler's start-up)", first_compile, args.backend)
        facts = run("explain and graphs", graph_facts, *shapes[0])
        for batch, hid in shapes:
            rows.append(run(f"batch {batch} hid {hid}", bn_row, batch, hid, args.backend, args.iters))
        if progress is not None:
            progress.close()
    ratios = [row["ratio"] for row in rows]
    for row in rows:
        row["goal_met"] = row["ratio"] <= BN_GOAL
    median_ratio = median(ratios)

    print(f"first compile in the process (compiler start-up included, shape {FIRST_COMPILE_SHAPE[0]}x"
          f"{FIRST_COMPILE_SHAPE[1]}): {first_s:.1f} s")
    header = (f"{'hid':>5} {'batch':>5} | {'eager ms':>8} {'compiled ms':>11} {'ratio':>6} {'<=' + str(BN_GOAL):>6} | "
              f"{'2 AR ms':>7} {'best':>5} | {'compile s':>9} | {'max|dy|':>8} {'max|dx|':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['hid_dim']:>5} {row['batch_size']:>5} | {row['eager_ms']:>8.3f} {row['compiled_ms']:>11.3f} "
              f"{row['ratio']:>6.2f} {'met' if row['goal_met'] else 'missed':>6} | {row['collectives_ms']:>7.3f} "
              f"{row['best_ratio']:>5.2f} | {row['compile_s']:>9.2f} | "
              f"{row['max_abs_diff_output']:>8.1e} {row['max_abs_diff_grad_input']:>8.1e}")
    ours = facts["ours"]
    print(f"median ratio over {len(rows)} shape(s): {median_ratio:.2f}; 2 AR: the pass's two all_reduce calls "
          f"of 2C+1 floats alone, timed alike; best = 2 AR / eager, the ratio if compiled compute took no time")
    print(f"ours under torch._dynamo.explain (forward, batch {shapes[0][0]} hid {shapes[0][1]}): "
          f"{ours['graph_count']} graph(s), {ours['graph_break_count']} graph break(s)"
          + (f" ({'; '.join(ours['break_reasons'])})" if ours["break_reasons"] else "")
          + f"; all_reduce calls per AOT graph: forward {ours['all_reduce_per_graph']['forward']}, "
            f"backward {ours['all_reduce_per_graph']['backward']}")
    theirs = facts["nn.SyncBatchNorm"]
    if theirs["runs_on_cpu"]:
        print("nn.SyncBatchNorm ran on CPU tensors here (unexpected): no graph count taken for it")
    else:
        print(f"nn.SyncBatchNorm cannot run on CPU tensors (it raises {theirs['error']}): its graph "
              f"count is for a GPU machine")
    theirs["note"] = "its graph and graph-break count can only be taken on a GPU machine"
    return {"processes": NPROC, "backend": "gloo", "intra_op_threads": 1, "compile_backend": args.backend,
            "layer": "syncbn.SyncBatchNorm(hid_dim), affine off, training mode, float32 (batch, hid_dim) input",
            "time_measure": f"median ms per forward+backward over {args.iters} calls (each after a barrier) in "
                            f"{min(ROUNDS, args.iters)} alternating rounds, max across ranks",
            "collectives_measure": "collectives_ms: two all_reduce calls of 2C+1 floats alone (the pass's "
                                   "collectives, which compiling cannot remove), timed in the same rounds; "
                                   "best_ratio = collectives_ms / eager_ms",
            "compile_measure": "first compiled forward+backward of the shape (Dynamo + backend, forward and "
                               "backward graphs), max across ranks; fresh inductor cache for the run",
            "first_compile_s": first_s, "first_compile_shape": list(FIRST_COMPILE_SHAPE),
            "graphs": facts, "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "median_ratio": median_ratio, "rows": rows}


# ----------------------------------------------------------------------------------------------------------
# Part 2: the trainer, torchrun subprocesses
# ----------------------------------------------------------------------------------------------------------
def trainer_flags(args: argparse.Namespace, model: str, scope: str | None, extra: list[str] = ()) -> list[str]:
    """The trainer's flags: eager (``scope`` None) or --compile ``scope`` (forward, blocks)."""
    flags = ["--device", "cpu", "--dataset", "synthetic", "--model", model, "--train-size", str(args.train_size),
             "--val-size", str(args.val_size), "--batch-size", str(args.batch_size), "--epochs", "1",
             "--max-steps", str(args.max_steps), *extra]
    return flags + (["--compile", scope, "--compile-backend", args.backend] if scope else [])


def dynamo_log_counts(stderr: str) -> dict[str, Any]:
    """Rank 0's graph breaks and recompiles in a run's TORCH_LOGS=graph_breaks,recompiles output."""
    lines = [line for line in stderr.splitlines() if line.startswith("[rank0]")]
    recompiled = [m.group(1) for line in lines if (m := re.search(r"Recompiling function (.+)$", line))]
    return {"graph_breaks": sum("[__graph_breaks] Graph break in user code" in line for line in lines),
            "recompiles": len(recompiled),
            "recompiled_functions": {name: recompiled.count(name) for name in sorted(set(recompiled))},
            "recompile_limit_hit": sum("hit config.recompile_limit" in line for line in lines)}


def run_trainer_once(args: argparse.Namespace, model: str, scope: str | None, extra: list[str] = ()) -> dict[str, Any]:
    """One trainer run, eager or --compile ``scope`` (tried again once if it fails: a shared machine can fail a run
    for reasons of its own), with ``extra`` flags after the usual ones (the later of a flag given twice wins), and an
    inductor cache of its own, empty at the start: it compiles from scratch, as a first run does (a second attempt
    finds what the first left in it)."""
    mode = "eager" if scope is None else "compiled" if scope == "forward" else f"compiled {scope}"
    with tempfile.TemporaryDirectory(prefix="compilebench-inductor-") as cache:
        env = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": cache, "TORCH_LOGS": "graph_breaks,recompiles"}
        try:
            run = trainer_runs.run_trainer(trainer_flags(args, model, scope, extra), NPROC,
                                           label=f"trainer run ({model}, {mode})", timeout_s=args.run_timeout,
                                           env=env, attempts=2)
        except trainer_runs.TrainerRunFailed as failure:
            raise BenchmarkError(str(failure)) from None
    metrics, steps = run.metrics, run.metrics["step_times_ms"]
    return {
        "model": model, "mode": mode, "attempts": run.attempts, "command": run.command,
        "step_time_ms_median": metrics["step_time_ms_median"],
        "step_time_ms_p10": metrics.get("step_time_ms_p10"),
        "step_time_ms_p90": metrics.get("step_time_ms_p90"),
        "timed_steps": len(steps), "warmup_steps": metrics.get("step_time_warmup_steps"),
        "wall_time_s": metrics["wall_time_s"], "train_time_s": metrics["train_time_s"],
        # the steps the trainer leaves out (and the time between steps): where compiling happens
        "outside_timed_steps_s": metrics["train_time_s"] - sum(steps) / 1e3,
        "process_wall_s": run.wall_s, "train_loss": metrics.get("train_loss"),
        "val_loss": metrics.get("val_loss"), "optimizer_steps": metrics.get("optimizer_steps"),
        "trainer_compile_entry": metrics.get("compile"),
        "dynamo_log": dynamo_log_counts(run.stderr) if scope else None,
        "step_times_ms": steps}


def median_run(runs: list[dict]) -> dict:
    """The run with the median step time (of an even count, the upper one: a real run, not an average)."""
    return sorted(runs, key=lambda run: run["step_time_ms_median"])[len(runs) // 2]


def run_trainer_part(args: argparse.Namespace) -> dict[str, Any]:
    print(f"part trainer: ddp_cifar100.py, {NPROC} processes, CPU, synthetic {args.train_size}/{args.val_size}, "
          f"batch {args.batch_size} per process, 1 epoch, at most {args.max_steps} steps; eager vs --compile "
          f"--compile-backend {args.backend}; {args.repeats} run(s) each, alternating order", flush=True)
    load_before = os.getloadavg()
    configs = [(model, compiled) for model in args.models for compiled in (False, True)]
    runs: dict[tuple[str, bool], list[dict]] = {config: [] for config in configs}
    total = len(configs) * args.repeats
    progress = progress_bar(total, "trainer")
    for repeat in range(args.repeats):
        for model, compiled in configs if repeat % 2 == 0 else configs[::-1]:
            label = f"{model} {'compiled' if compiled else 'eager'} (repeat {repeat + 1}/{args.repeats})"
            if progress is None:
                print(f"[{sum(map(len, runs.values())) + 1}/{total}] {label} ...", file=sys.stderr, flush=True)
            else:
                progress.set_postfix_str(label)
            runs[(model, compiled)].append(run_trainer_once(args, model, "forward" if compiled else None))
            if progress is not None:
                progress.update()
    if progress is not None:
        progress.close()

    rows = []
    for model in args.models:
        eager, compiled = median_run(runs[(model, False)]), median_run(runs[(model, True)])
        outside = {mode: statistics.median(run["outside_timed_steps_s"] for run in runs[(model, flag)])
                   for mode, flag in (("eager", False), ("compiled", True))}
        walls = {mode: statistics.median(run["wall_time_s"] for run in runs[(model, flag)])
                 for mode, flag in (("eager", False), ("compiled", True))}
        logs = [run["dynamo_log"] for run in runs[(model, True)]]
        rows.append({
            "model": model,
            "eager_step_ms": eager["step_time_ms_median"], "compiled_step_ms": compiled["step_time_ms_median"],
            "ratio": compiled["step_time_ms_median"] / eager["step_time_ms_median"],
            "eager_step_ms_runs": [run["step_time_ms_median"] for run in runs[(model, False)]],
            "compiled_step_ms_runs": [run["step_time_ms_median"] for run in runs[(model, True)]],
            "eager_wall_s": eager["wall_time_s"], "compiled_wall_s": compiled["wall_time_s"],
            "eager_wall_s_runs": [run["wall_time_s"] for run in runs[(model, False)]],
            "compiled_wall_s_runs": [run["wall_time_s"] for run in runs[(model, True)]],
            "compile_s_estimate": outside["compiled"] - outside["eager"],
            "wall_difference_s": walls["compiled"] - walls["eager"],
            "graph_breaks": max(log["graph_breaks"] for log in logs),
            "recompiles": max(log["recompiles"] for log in logs),
            "recompiled_functions": logs[0]["recompiled_functions"],
            "recompile_limit_hit": max(log["recompile_limit_hit"] for log in logs),
            "eager_train_loss": eager["train_loss"], "compiled_train_loss": compiled["train_loss"],
            "timed_steps": eager["timed_steps"]})
    resnet = next((row for row in rows if row["model"] == "resnet"), None)
    if resnet is not None:
        resnet["goal_met"] = resnet["ratio"] <= TRAINER_GOAL

    header = (f"{'model':<7} | {'eager ms':>8} {'(runs)':>15} | {'compiled ms':>11} {'(runs)':>15} | {'ratio':>5} | "
              f"{'wall eager s':>12} {'compiled s':>10} | {'compile s':>9} {'wall diff s':>11} | "
              f"{'breaks':>6} {'recompiles':>10}")
    print(header)
    print("-" * len(header))
    for row in rows:
        spread_e = ",".join(f"{v:.0f}" for v in row["eager_step_ms_runs"])
        spread_c = ",".join(f"{v:.0f}" for v in row["compiled_step_ms_runs"])
        print(f"{row['model']:<7} | {row['eager_step_ms']:>8.1f} {'(' + spread_e + ')':>15} | "
              f"{row['compiled_step_ms']:>11.1f} {'(' + spread_c + ')':>15} | {row['ratio']:>5.2f} | "
              f"{row['eager_wall_s']:>12.1f} {row['compiled_wall_s']:>10.1f} | {row['compile_s_estimate']:>9.1f} "
              f"{row['wall_difference_s']:>11.1f} | {row['graph_breaks']:>6} {row['recompiles']:>10}")
    for row in rows:
        if row["recompiled_functions"]:
            print(f"{row['model']}: recompiled (rank 0, first compiled run): "
                  + ", ".join(f"{name} x{count}" for name, count in row["recompiled_functions"].items())
                  + (f"; recompile limit hit {row['recompile_limit_hit']}x" if row["recompile_limit_hit"] else ""))
    all_runs = [run for config in configs for run in runs[config]]
    return {"processes": NPROC, "compile_backend": args.backend, "intra_op_threads": 1,
            "command_template": all_runs[0]["command"] if all_runs else None,
            "time_measure": "the trainer's step_time_ms_median (warm-up steps left out); per mode the median run "
                            "by it (of 2, the slower), every run's beside it",
            "compile_measure": "median over compiled runs of (train_time_s - sum(step_times_ms)) minus the same "
                               "over eager runs: the excess of the warm-up steps the trainer leaves out; each "
                               "compiled run with a fresh inductor cache",
            "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "rows": rows, "runs": all_runs}


# ----------------------------------------------------------------------------------------------------------
# Part 3: what compiling does to the gradient hooks' overlap, read from the trainer's --profile traces
# ----------------------------------------------------------------------------------------------------------
def overlap_in_trace(path: str) -> dict[str, Any]:
    """The gradient buckets' timing in one rank's --profile trace (Chrome JSON), per profiled step.

    Every all_reduce launched inside the "backward" range is a gradient bucket's (the runs use --norm local, so
    no SyncBatchNorm collective is there): torch.profiler's "c10d::allreduce_" event marks its launch, for
    stage 0's hooks and DDP's reducer alike. The last bucket launches when the last gradient (the first layer's)
    is ready, so the backward's computation ends there: ``compute_ms`` = last launch - start of backward;
    ``overlapped_ms`` = last launch - first launch, the part of that computation with a bucket's all_reduce
    already running beside it; ``tail_ms`` = end of backward - last launch, what is left after the computation
    (the last buckets' transfer and the wait for them). Medians over the profiled steps."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = []
    for backward in (e for e in events if e["name"] == "backward"):
        start, end = backward["ts"], backward["ts"] + backward["dur"]
        launches = sorted(e["ts"] for e in events if e["name"] == "c10d::allreduce_" and start <= e["ts"] <= end)
        if launches:
            steps.append({"buckets": len(launches), "compute_ms": (launches[-1] - start) / 1e3,
                          "overlapped_ms": (launches[-1] - launches[0]) / 1e3, "tail_ms": (end - launches[-1]) / 1e3,
                          "backward_ms": backward["dur"] / 1e3})
    if not steps:
        raise BenchmarkError(f"{path}: no gradient all_reduce inside a backward range")
    row = {key: statistics.median(step[key] for step in steps) for key in steps[0]}
    row["overlapped_share"] = row["overlapped_ms"] / row["compute_ms"] if row["compute_ms"] > 0 else 0.0
    row["profiled_steps"] = len(steps)
    return row


OVERLAP_RUNS = [("custom", "eager"), ("custom", "forward"), ("custom", "blocks"), ("ddp", "eager"),
                ("ddp", "forward")]  # (--grad-sync, eager or --compile's scope)


def run_overlap_part(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--norm", "local", "--bucket-mb", str(args.overlap_bucket_mb), "--max-steps", "12",
             "--profile-steps", "8:11"]
    print(f"part overlap: ddp_cifar100.py --model {args.overlap_model} {' '.join(flags)} --profile DIR, "
          f"{NPROC} processes; the gradient buckets in rank 0's trace, eager vs --compile forward|blocks "
          f"(--grad-sync custom: the hooks of zero/stage0.py; ddp: DistributedDataParallel's reducer, for which "
          f"Dynamo's DDPOptimizer splits the compiled graph at the buckets)", flush=True)
    rows = []
    progress = progress_bar(len(OVERLAP_RUNS), "overlap")
    for sync, mode in OVERLAP_RUNS:
        if progress is None:
            print(f"[{len(rows) + 1}/{len(OVERLAP_RUNS)}] {sync} {mode} ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="compilebench-profile-") as tmp:
            extra = ["--grad-sync", sync, *flags, "--profile", os.path.join(tmp, "trace")]
            run = run_trainer_once(args, args.overlap_model, None if mode == "eager" else mode, extra=extra)
            row = overlap_in_trace(os.path.join(tmp, "trace", "rank0.pt.trace.json"))
        rows.append({"grad_sync": sync, "mode": mode, **row, "step_ms": run["step_time_ms_median"],
                     "command": run["command"].replace(tmp, "TMP")})
        if progress is not None:
            progress.update()
    if progress is not None:
        progress.close()
    print(f"{'sync':<6} {'mode':<7} | {'buckets':>7} | {'backward ms':>11} {'compute ms':>10} | "
          f"{'overlapped ms':>13} {'share':>5} | {'tail ms':>7} | {'step ms':>7}")
    for row in rows:
        print(f"{row['grad_sync']:<6} {row['mode']:<7} | {row['buckets']:>7.0f} | {row['backward_ms']:>11.1f} "
              f"{row['compute_ms']:>10.1f} | {row['overlapped_ms']:>13.1f} {row['overlapped_share']:>5.2f} | "
              f"{row['tail_ms']:>7.1f} | {row['step_ms']:>7.1f}")
    return {"model": args.overlap_model, "processes": NPROC, "compile_backend": args.backend, "flags": flags,
            "measure": "rank 0's --profile trace, median over its 3 profiled steps: buckets = all_reduce launches "
                       "inside backward; compute = last launch - backward start; overlapped = last launch - "
                       "first launch; share = overlapped / compute; tail = backward end - last launch",
            "step_measure": "the profiled run's step_time_ms_median (12 steps, 3 of them profiled: a rough figure; "
                            "the trainer part times steps)", "rows": rows}


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
def parse_shapes(text: str) -> list[tuple[int, int]]:
    if text == "grid":
        return [(batch, hid) for hid in HID_DIMS for batch in BATCH_SIZES]
    shapes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", item)
        if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
            raise BenchmarkError(f"--shapes takes 'grid' or a comma-separated list of BATCHxHID (positive "
                                 f"integers, e.g. 32x128), got {text!r}")
        shapes.append((int(match.group(1)), int(match.group(2))))
    return shapes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="bn,trainer,overlap",
                        help="comma-separated: bn, trainer, overlap (default all three)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--iters", type=int, default=400,
                        help="bn: timed forward+backward calls per mode and shape (default 400)")
    parser.add_argument("--shapes", default="grid",
                        help="bn: 'grid' (bn_benchmark's HID_DIMS x BATCH_SIZES) or BATCHxHID,... (per-rank batch)")
    parser.add_argument("--repeats", type=int, default=2, help="trainer: runs per model and mode (default 2)")
    parser.add_argument("--models", default="resnet,net", help=f"trainer: comma-separated of {', '.join(MODELS)}")
    parser.add_argument("--train-size", type=int, default=2048, help="trainer: synthetic training set size")
    parser.add_argument("--val-size", type=int, default=256, help="trainer: synthetic validation set size")
    parser.add_argument("--batch-size", type=int, default=32, help="trainer: per-process batch")
    parser.add_argument("--max-steps", type=int, default=40, help="trainer: at most this many steps (1 epoch)")
    parser.add_argument("--overlap-model", default="net", choices=MODELS,
                        help="overlap: the trainer's model (default net, the assignment's: 3.3 MB of gradients)")
    parser.add_argument("--overlap-bucket-mb", type=float, default=1.0,
                        help="overlap: --bucket-mb (default 1, the smallest DDPOptimizer takes)")
    parser.add_argument("--run-timeout", type=float, default=900.0,
                        help="seconds allowed for one trainer run or one bn shape")
    parser.add_argument("--json", default=None, help="results file (default: results/compile-<machine_tag>.json)")
    args = parser.parse_args(argv)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not args.parts or any(part not in PARTS for part in args.parts):
        raise BenchmarkError(f"--parts takes a comma-separated list of {', '.join(PARTS)}, got "
                             f"{','.join(args.parts) or 'nothing'}")
    args.models = [model.strip() for model in args.models.split(",") if model.strip()]
    if not args.models or any(model not in MODELS for model in args.models):
        raise BenchmarkError(f"--models takes a comma-separated list of {', '.join(MODELS)}, got "
                             f"{','.join(args.models) or 'nothing'}")
    args.shapes = parse_shapes(args.shapes)
    for flag in ("iters", "repeats", "train_size", "val_size", "batch_size", "max_steps"):
        if getattr(args, flag) < 1:
            raise BenchmarkError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.overlap_bucket_mb < 1:
        raise BenchmarkError(f"--overlap-bucket-mb must be at least 1 (DDPOptimizer's smallest), got "
                             f"{args.overlap_bucket_mb:g}")
    if args.run_timeout <= 0:
        raise BenchmarkError(f"--run-timeout must be positive, got {args.run_timeout}")
    import torch._dynamo  # here, not at the top: the LocalGroup's workers import this file and need none of it

    if args.backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise BenchmarkError(f"--backend {args.backend!r} is not a torch.compile backend here (known: "
                             f"{', '.join(torch._dynamo.list_backends())})")
    return args


def goals(bn: dict | None, trainer: dict | None) -> dict[str, Any]:
    verdicts: dict[str, Any] = {}
    if bn is None:
        verdicts["bn_compiled_at_most_0.8x_eager"] = None
    else:
        verdicts["bn_compiled_at_most_0.8x_eager"] = {
            "goal": BN_GOAL, "median_ratio": bn["median_ratio"], "met": bn["median_ratio"] <= BN_GOAL,
            "shapes_met": sum(row["goal_met"] for row in bn["rows"]), "shapes": len(bn["rows"]),
            "per_shape": {f"{row['batch_size']}x{row['hid_dim']}": {"ratio": row["ratio"], "met": row["goal_met"]}
                          for row in bn["rows"]}}
    resnet = None if trainer is None else next((row for row in trainer["rows"] if row["model"] == "resnet"), None)
    verdicts["trainer_resnet_compiled_at_most_0.9x_eager"] = None if resnet is None else {
        "goal": TRAINER_GOAL, "ratio": resnet["ratio"], "met": resnet["goal_met"]}
    return verdicts


def print_goals(verdicts: dict[str, Any]) -> None:
    print("goals:")
    bn = verdicts["bn_compiled_at_most_0.8x_eager"]
    if bn is None:
        print(f"  SyncBatchNorm compiled <= {BN_GOAL}x eager: not run (--parts)")
    else:
        print(f"  SyncBatchNorm compiled <= {BN_GOAL}x eager: {'met' if bn['met'] else 'missed'} (median ratio "
              f"{bn['median_ratio']:.2f}; met at {bn['shapes_met']} of {bn['shapes']} shapes)")
    trainer = verdicts["trainer_resnet_compiled_at_most_0.9x_eager"]
    if trainer is None:
        print(f"  trainer step, small ResNet, compiled <= {TRAINER_GOAL}x eager: not run (--parts, --models)")
    else:
        print(f"  trainer step, small ResNet, compiled <= {TRAINER_GOAL}x eager: "
              f"{'met' if trainer['met'] else 'missed'} (ratio {trainer['ratio']:.2f})")


def main(argv: list[str] | None = None) -> None:
    try:
        args = parse_args(argv)
    except BenchmarkError as exc:
        raise SystemExit(f"{PROG}: error: {exc}") from None
    started = time.perf_counter()
    command = shlex.join(["python", "-m", "benchmarks.compile_benchmark"]
                         + (argv if argv is not None else sys.argv[1:]))
    path = args.json or os.path.join(HERE, "results", f"compile-{machine_tag('cpu')}.json")
    # A fresh inductor cache for the run (the LocalGroup's workers inherit it): compile times are from scratch.
    cache = tempfile.mkdtemp(prefix="compilebench-inductor-")
    previous_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        bn = run_bn(args) if "bn" in args.parts else None
        trainer = run_trainer_part(args) if "trainer" in args.parts else None
        overlap = run_overlap_part(args) if "overlap" in args.parts else None
    except (BenchmarkError, harness.WorkerError, TimeoutError) as exc:
        if isinstance(exc, harness.WorkerError):
            print(exc, file=sys.stderr)  # the workers' tracebacks
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise SystemExit(f"{PROG}: error: {last}") from None
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if previous_cache is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous_cache
    verdicts = goals(bn, trainer)
    print_goals(verdicts)
    wall = time.perf_counter() - started
    settings = {key: value for key, value in vars(args).items() if key != "json"}
    write_json(path, {
        "benchmark": "compile", "command": command, "machine": machine_info("cpu"),
        "machine_tag": machine_tag("cpu"), "torch": torch.__version__, "settings": settings,
        "wall_time_s": wall, "bn": bn, "trainer": trainer, "overlap": overlap,
        "goals": verdicts})
    print(f"wrote {os.path.relpath(path, HERE) if path.startswith(HERE) else path} ({wall / 60:.1f} min)")


if __name__ == "__main__":
    main()
