"""Memory over a training run's whole life, per rank and phase: ZeRO stages 0-3 (zero.shard) against FSDP2, on a plain
loop of one's own (no trainer), with and without the allocator setting that makes freed memory go back.

    python -m benchmarks.memory_benchmark [--model gpt2] [--worlds 2,4,8] [--rows stage0,stage1,stage2,stage3,fsdp3]
                                          [--allocator both|default|pinned] [--steps 2] [--json results/....json]
    python -m benchmarks.memory_benchmark --trainer [--model gpt2-large] [--worlds 4] [--rows zero3,fsdp3]

Each (row, W, allocator) is W fresh processes (spawned: no allocator history from another row) over gloo on the CPU,
training models.py's GPT (``--model``: GPT-2 small's shape by default, 86M parameters) with AdamW on random bytes,
``--context`` 64 and one sequence per rank per step. The phases, in each process:

    start   imports and the process group (the baseline: every figure below is above it)
    build   the model and its sync: stage 0 builds it whole on every rank (as DDP users do) and shard(model, 0);
            stages 1-3 build it on the meta device and zero.shard(..., init=models.initializer(model)); FSDP2
            materializes it one unit at a time and fully_shards each (references.shard_as_initialized)
    steps   --steps optimizer steps (forward, backward, step)
    save    a sharded checkpoint: zero.checkpoint.save, or FSDP2's get_state_dict + torch.distributed.checkpoint.save
    load    the resume: the model and optimizer dropped, built again as in build, and the checkpoint loaded
            (zero.checkpoint.load; FSDP2's dcp.load + set_state_dict; timed alone too), then one more step

and per phase each rank's peak resident set above the start (VmHWM, reset at each phase's start by writing 5 to
/proc/self/clear_refs), the phase's seconds, and the formula's bytes for what ZeRO says a rank holds (zero's module
docstring: 16 Psi / W at stage 3, plus two units gathered and the root, their gradient buffers and the activations;
16 Psi at stage 0).

[Note: the allocator] glibc's malloc serves blocks of 128 kB and more by mmap, and returns them to the system when
freed; but the first time such a block (up to 32 MB) is freed it raises that threshold to the block's size, so
later blocks of that size come from the heap, and a freed heap block stays in the process (the resident set then
reports the allocator's history, not what is alive). ``pinned`` sets the threshold once (mallopt(M_MMAP_THRESHOLD,
128 kB), what the environment variable MALLOC_MMAP_THRESHOLD_=131072 does at start-up), which also stops it from
moving: every large block is mmapped and given back when freed (measure.malloc.pin_mmap_threshold). ``default`` leaves
glibc as it is. Both are measured, each in fresh processes.

``stage3-file`` (only when --rows names it) is stage 3 with the checkpoint as it was before zero.checkpoint: the
whole state dicts gathered on rank 0 and written there as one file (torch.save), every rank then reading the whole
file: the figure a sharded save and load are measured against. ``stage3-ring`` (the same) is stage 3 on
allreduce.py's ring (zero.shard(..., collectives="ring")), whose all-gather and reduce-scatter work in place in the
unit's buffers, where gloo's copy each unit into a buffer of its own first (``--view`` names them).

Writes results/memory-<machine>.json; prints a table per phase (the largest rank's peak, MB above start), and with
``--view`` a second: each phase's peak read as the allocators see it (benchmarks/allocator_view.py: the tensors
held as it began, their peak in it and what made them, glibc's kept heap, the rest), so every MB above the formula
has a name.

``--trainer``: the same question asked of the trainer at the scale ZeRO-3 is for (GPT-2 large's shape by default,
710M parameters, 11.4 GB of fp32 weights, gradients and AdamW state), per row (``zero3``: --grad-sync custom
--zero 3; ``fsdp3``: --grad-sync fsdp --zero 3; when --rows names them, ``zero0``: --zero 0, whose checkpoint is
rank 0's single file, and ``zero3-ac``: zero3 with --activation-checkpointing): ``torchrun --nproc_per_node W
ddp_cifar100.py`` for --steps steps and a checkpoint, then a resume on W / 2 processes with the batch doubled (the
same global batch) to twice the steps; from each run's metrics, each rank's peak per phase (the trainer's
memory_by_phase_mb: build, restore, steps, checkpoint, evaluation, MB above its start), its absolute peak and the
median step. Each phase is also read against the formula plus the activations autograd keeps for the run's
batch (activation_mb: measured once here), the bound the issue sets at 1.25x. Beside them, what --zero 0 (or DDP)
would need per rank by the formula (16 Psi bytes). The text is a few files of the standard library (--context bytes
a window), of which one is the validation split, so evaluation at the default batch (the micro-batch) is short.
Writes results/memory-trainer-<machine>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import queue
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from benchmarks.allocator_view import AllocatorView, glibc_heap, held_tensor_bytes, reading

ROWS = ("stage0", "stage1", "stage2", "stage3", "fsdp3")
EXTRA_ROWS = ("stage3-file", "stage3-ring")  # only when --rows names them
TRAINER_ROWS = {"zero3": ["--grad-sync", "custom", "--zero", "3"], "fsdp3": ["--grad-sync", "fsdp", "--zero", "3"],
                "zero0": ["--grad-sync", "custom", "--zero", "0"],  # zero0, zero3-ac: only when --rows names them
                "zero3-ac": ["--grad-sync", "custom", "--zero", "3", "--activation-checkpointing"]}
PHASES = ("build", "steps", "save", "load")
MB = 1e6


# ----------------------------------------------------------------------------------------------------------
# One process of a row
# ----------------------------------------------------------------------------------------------------------
def build(row: str, model_name: str, context: int) -> tuple[Any, Any, Any]:
    """The model, its sync and AdamW over it, as the row builds them."""
    import models
    import zero
    from references import FSDPSync

    torch.manual_seed(0)
    if row == "stage0":
        model = models.build_model(model_name, 0.0, "local", 256, context=context)
        sync = zero.shard(model, 0)
    else:
        with torch.device("meta"):
            model = models.build_model(model_name, 0.0, "local", 256, context=context)
        stage = int(row[5]) if row.startswith("stage") else 3
        if row == "fsdp3":
            sync = FSDPSync(model, models.blocks(model), reshard_after_forward=True, init=models.initializer(model))
        else:
            sync = zero.shard(model, stage, models.blocks(model) if stage == 3 else None,
                              collectives="ring" if row.endswith("-ring") else "torch", init=models.initializer(model))
    params = [p for p in model.parameters() if p.requires_grad]
    if row == "fsdp3":  # a plain one over the DTensors, as FSDP2's users build it (get_state_dict reads its state)
        return model, sync, torch.optim.AdamW(params, lr=1e-4)
    return model, sync, sync.optimizer(torch.optim.AdamW, params, lr=1e-4)


def step(model: Any, optimizer: Any, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def save(row: str, path: str, model: Any, sync: Any, optimizer: Any) -> None:
    if row == "stage3-file":  # the whole state dicts on rank 0, one file
        state = {"model": sync.model_state_dict(), "optimizer": optimizer.state_dict()}
        if dist.get_rank() == 0:
            torch.save(state, path)
    elif row == "fsdp3":  # FSDP2's way: get_state_dict, dcp.save
        sync.save_checkpoint(path, [optimizer])
    else:
        import zero.checkpoint
        zero.checkpoint.save(path, sync, optimizer)


def load(row: str, path: str, model: Any, sync: Any, optimizer: Any) -> None:
    if row == "stage3-file":  # every rank reads the whole file
        state = torch.load(path, map_location="cpu", weights_only=True)
        sync.load_model_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    elif row == "fsdp3":  # FSDP2's way: get_state_dict, dcp.load, set_state_dict
        sync.load_checkpoint(path, [optimizer])
    else:
        import zero.checkpoint
        zero.checkpoint.load(path, sync, optimizer)


def worker(rank: int, world_size: int, store_path: str, settings: dict, results: Any) -> None:
    """One rank of a row: its phases' peaks and seconds into ``results``."""
    from measure.malloc import pin_mmap_threshold
    from measure.memory import proc_status_mb, reset_peak_resident

    torch.set_num_threads(1)
    if settings["pinned"]:
        pin_mmap_threshold()
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    import models  # noqa: F401  (imported before the baseline, as the trainer's start-up does)
    import references  # noqa: F401
    import zero  # noqa: F401
    from zero.checkpoint import save  # noqa: F401  (its modules, and torch.distributed.checkpoint)
    row, steps, context = settings["row"], settings["steps"], settings["context"]
    tokens = torch.randint(0, 256, (steps + 1, 1, context + 1), generator=torch.Generator().manual_seed(rank))
    start_held = held_tensor_bytes() if settings["view"] else 0
    dist.barrier()
    out: dict[str, Any] = {"start_mb": proc_status_mb("VmRSS"),
                           "start_rss_file_mb": proc_status_mb("RssFile")}

    def phase(name: str, work: Any) -> Any:
        gc.collect()
        dist.barrier()
        # FSDP2's own functions are torch's, which a name leaves out: its ranges (FSDP::...) name its tensors
        view = AllocatorView(stacks=row != "fsdp3") if settings["view"] else contextlib.nullcontext()
        with view:
            start_mb = proc_status_mb("VmRSS")
            reset_peak_resident()
            began = time.perf_counter()
            value = work()
            dist.barrier()
            peak_mb = proc_status_mb("VmHWM") - out["start_mb"]
        out[name] = {"peak_mb": peak_mb, "rss_before_mb": start_mb - out["start_mb"],
                     "seconds": time.perf_counter() - began, "glibc_mb": glibc_heap(),
                     # the resident set at the phase's end: anonymous (the heap, mmapped blocks) against file-backed
                     # (the libraries' code and data, paged in as the phase first runs them)
                     "rss_anon_mb": proc_status_mb("RssAnon"), "rss_file_mb": proc_status_mb("RssFile")}
        if settings["view"]:  # one rank at a time: reading a profile's events takes a few GB while it lasts
            for reader in range(world_size):
                if reader == rank:
                    out[name]["tensors"] = view.figures(start_held)
                    del view
                    gc.collect()
                dist.barrier()
        return value

    model, sync, optimizer = phase("build", lambda: build(row, settings["model"], context))
    phase("steps", lambda: [step(model, optimizer, tokens[i]) for i in range(steps)])
    path = settings["checkpoint"]
    phase("save", lambda: save(row, path, model, sync, optimizer))

    def resume() -> None:
        nonlocal model, sync, optimizer
        for hook in getattr(sync, "hooks", []):  # ours: dropped without close(), which would gather the model
            hook.remove()
        model = sync = optimizer = None
        gc.collect()
        model, sync, optimizer = build(row, settings["model"], context)
        dist.barrier()
        began = time.perf_counter()
        load(row, path, model, sync, optimizer)
        dist.barrier()
        out["load_call_seconds"] = time.perf_counter() - began
        step(model, optimizer, tokens[steps])

    phase("load", resume)
    out["psi"] = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) if row == "stage0" else None
    results.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def run_row(row: str, world_size: int, pinned: bool, args: argparse.Namespace, view: bool = False) -> list[dict]:
    """W fresh processes running ``row``; each rank's figures (``view``: under AllocatorView, tensors named)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        settings = {"row": row, "pinned": pinned, "steps": args.steps, "context": args.context, "view": view,
                    "model": args.model, "checkpoint": os.path.join(tmp, "checkpoint")}
        store = os.path.join(tmp, "store")
        procs = [context.Process(target=worker, args=(rank, world_size, store, settings, results))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        out: list[Any] = [None] * world_size
        deadline = time.monotonic() + args.timeout
        while any(figures is None for figures in out) and time.monotonic() < deadline:
            try:
                rank, figures = results.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):  # a rank died: its peers wait in vain
                    break
                continue
            out[rank] = figures
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if any(figures is None for figures in out):
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"memory_benchmark: {row} on {world_size} processes failed (exit codes {codes})")
    return out


# ----------------------------------------------------------------------------------------------------------
# The formula
# ----------------------------------------------------------------------------------------------------------
def model_shape(name: str, context: int) -> dict[str, int]:
    """Psi, the largest block's parameters and the root's, of models.py's GPT ``name``."""
    import models
    with torch.device("meta"):
        model = models.build_model(name, 0.0, "local", 256, context=context)
    blocks = models.blocks(model)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    psi = sum(p.numel() for p in model.parameters())
    return {"psi": psi, "block": max(sum(p.numel() for p in b.parameters()) for b in blocks),
            "root": sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)}


def expected_mb(row: str, shape: dict[str, int], world_size: int) -> float:
    """What ZeRO's formula says a rank holds between steps, fp32 and AdamW (16 bytes a parameter), plus at stage 3
    the gathered root and two units with their gradient buffers in flight (4 + 4 bytes a parameter each)."""
    psi, row = shape["psi"], "stage3" if row in EXTRA_ROWS else row
    held = {"stage0": 16 * psi, "stage1": 8 * psi + 8 * psi / world_size, "stage2": 4 * psi + 12 * psi / world_size,
            "stage3": 16 * psi / world_size, "fsdp3": 16 * psi / world_size}[row]
    if row in ("stage3", "fsdp3"):
        held += 8 * (shape["root"] + 2 * shape["block"])
    return held / MB


def saved_bytes(forward: Any, parameters: Any) -> int:
    """The bytes autograd saves for the backward of ``forward()``: the storages of the tensors it keeps, each once,
    those of ``parameters`` left out (they are held anyway)."""
    held = {p.untyped_storage().data_ptr() for p in parameters}
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        forward()
    return sum(saved.values())


def activation_mb(name: str, context: int, batches: tuple[int, ...]) -> dict[int, float]:
    """For each batch size, what autograd keeps for the backward of one forward of that many windows of models.py's
    GPT ``name``, its loss included (saved_bytes), measured in this process on one model of real tensors (on the meta
    device storages cannot be told apart)."""
    import models
    model = models.build_model(name, 0.0, "local", 256, context=context)
    found = {}
    for batch in batches:
        windows = torch.randint(0, 256, (batch, context))
        found[batch] = saved_bytes(lambda: F.cross_entropy(model(windows).flatten(0, 1), windows.flatten()),
                                   model.parameters()) / MB
    return found


# ----------------------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", action="store_true", help="the trainer at GPT-2 large's scale (see above)")
    parser.add_argument("--model", default=None, help="a GPT of models.py (default gpt2, GPT-2 small's shape; "
                                                      "--trainer: gpt2-large)")
    parser.add_argument("--worlds", default=None, help="numbers of processes (default 2,4,8; --trainer: 4, resumed "
                                                       "on half as many)")
    parser.add_argument("--rows", default=None,
                        help=f"of {', '.join(ROWS + EXTRA_ROWS)} (default: {', '.join(ROWS)}); --trainer: of "
                             f"{', '.join(TRAINER_ROWS)} (default zero3, fsdp3)")
    parser.add_argument("--allocator", default="both", choices=("both", "default", "pinned"),
                        help="glibc as it is, its mmap threshold pinned at 128 kB, or both (default)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps before the checkpoint (default 2)")
    parser.add_argument("--context", type=int, default=64, help="bytes per sequence (default 64)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per row (default 1800)")
    parser.add_argument("--json", default=None, help="output (default results/memory-<machine>.json)")
    parser.add_argument("--view", action="store_true",
                        help="also name what each phase's peak is made of (benchmarks/allocator_view.py: the tensors "
                             "held, those in use at their peak by the function or range that made them, glibc's "
                             "kept heap): each row runs a second time under torch.profiler for the tensors' names")
    parser.add_argument("--merge", action="store_true",
                        help="keep the records already in --json's file that this run does not repeat")
    args = parser.parse_args(argv)
    args.model = args.model or ("gpt2-large" if args.trainer else "gpt2")
    args.worlds = args.worlds or ("4" if args.trainer else "2,4,8")
    known = tuple(TRAINER_ROWS) if args.trainer else ROWS + EXTRA_ROWS
    rows = args.rows.split(",") if args.rows else (["zero3", "fsdp3"] if args.trainer else list(ROWS))
    unknown = [row for row in rows if row not in known]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)} (of {', '.join(known)})")
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        parser.error(f"--worlds takes numbers of processes, such as 2,4,8; got {args.worlds!r}")
    if any(w < 1 for w in worlds) or args.steps < 1 or args.context < 1:
        parser.error("--worlds, --steps and --context must be positive")
    args.rows_list, args.worlds_list = rows, worlds
    return args


def print_table(records: list[dict]) -> None:
    print(f"{'row':8} {'W':>2} {'allocator':9} {'formula':>8} " + " ".join(f"{p:>9}" for p in PHASES)
          + f" {'save s':>7} {'load s':>7}")
    for r in records:
        peaks = " ".join(f"{r['peak_mb'][p]:9.0f}" for p in PHASES)
        print(f"{r['row']:8} {r['world_size']:>2} {r['allocator']:9} {r['formula_mb']:8.0f} {peaks} "
              f"{r['seconds']['save']:7.2f} {r['load_call_seconds']:7.2f}")
    print("(MB above each process's start, the largest rank's peak; formula: what ZeRO says a rank holds between "
          "steps, at stage 3 with the root and two units gathered; save s: the checkpoint's save, load s: its load "
          "alone, the slowest rank's)")


def print_view(records: list[dict]) -> None:
    """--view: each phase's peak as the allocators read it (the busiest rank), the biggest ranges in use."""
    print(f"{'row':8} {'W':>2} {'allocator':9} {'phase':6} {'formula':>8} {'peak':>6} {'held':>6} {'tensors':>7} "
          f"{'heap':>6} {'rest':>6}  in use at the tensors' peak, by range")
    for r in records:
        for p in PHASES:
            v = r["view"][p]
            ranges = ", ".join(f"{name} {mb:.0f}" for name, mb in list(v["in_use_by_range_mb"].items())[:3])
            print(f"{r['row']:8} {r['world_size']:>2} {r['allocator']:9} {p:6} {r['formula_mb']:8.0f} "
                  f"{r['peak_mb'][p]:6.0f} {v['tensors_held_mb']:6.0f} {v['tensors_peak_mb']:7.0f} "
                  f"{v['heap_kept_mb']:6.0f} {v['rest_mb']:6.0f}  {ranges}")
    print("(MB above the start; held: tensors alive as the phase begins; tensors: their peak in the phase; heap: "
          "glibc's free bytes kept at its end; rest: the peak less tensors and heap)")


# ----------------------------------------------------------------------------------------------------------
# --trainer: the trainer at the scale ZeRO-3 is for
# ----------------------------------------------------------------------------------------------------------
def text_folder(root: str) -> str:
    """A dozen modules of the standard library (their first 20 kB), in files of 4 kB: enough windows for a few
    steps, and with --val-fraction 0.01 a validation split of one file (at most 62 windows of 64 bytes), which the
    evaluation's default batch (the micro-batch, gathering the whole model at each forward at --zero 3) gets through
    in a minute or two."""
    import data
    folder = os.path.join(root, "text")
    os.makedirs(folder)
    for name in ("abc", "ast", "bisect", "calendar", "colorsys", "copy", "enum", "functools", "heapq", "os",
                 "random", "string"):
        with open(os.path.join(data.default_text_dir(), f"{name}.py"), "rb") as f:
            text = f.read()[:20000]
        for part in range(0, len(text), 4000):  # the shorter modules in fewer files
            with open(os.path.join(folder, f"{name}_{part // 4000}.py"), "wb") as out:
                out.write(text[part:part + 4000])
    return folder


def trainer_run(row: str, world_size: int, batch: int, steps: int, folder: str, checkpoint_dir: str,
                args: argparse.Namespace) -> dict:
    """One torchrun of the trainer; its metrics, and the command."""
    # here, as measure is: the rows' spawned workers import this module, and nothing more before their own set-up
    from benchmarks.trainer_runs import run_trainer

    flags = ["--device", "cpu", "--dataset", "text", "--data-dir", folder, "--model", args.model,
             "--context", str(args.context), "--val-fraction", "0.01", "--optimizer", "adamw", "--lr", "1e-4",
             "--batch-size", str(batch), "--epochs", "1", "--max-steps", str(steps), "--checkpoint-dir",
             checkpoint_dir, *TRAINER_ROWS[row]]
    run = run_trainer(flags, world_size, label=f"memory_benchmark --trainer: {row} on {world_size} processes",
                      timeout_s=args.timeout)
    figures = run.metrics
    return {"command": run.command.replace(folder, "TEXT").replace(checkpoint_dir, "DIR"),
            "world_size": world_size, "batch_size": batch, "steps": steps, "seconds": run.wall_s,
            "memory_by_phase_mb": figures["memory_by_phase_mb"], "peak_memory_mb": figures["peak_memory_mb"],
            "step_time_ms_median": figures["step_time_ms_median"], "state_bytes": figures["state_bytes"],
            "optimizer_steps": figures["optimizer_steps"], "train_loss": figures["train_loss"]}


def main_trainer(args: argparse.Namespace) -> dict:
    from files import write_json
    from measure.machine import machine_info, machine_tag
    shape = model_shape(args.model, args.context)
    activations = activation_mb(args.model, args.context, (1, 2))  # the first run's batch, the resumed run's
    records = []
    with tempfile.TemporaryDirectory(prefix="memory-trainer-") as tmp:
        folder = text_folder(tmp)
        for world_size in args.worlds_list:
            for row in args.rows_list:
                checkpoint_dir = os.path.join(tmp, f"{row}-{world_size}")
                os.makedirs(checkpoint_dir)
                first = trainer_run(row, world_size, 1, args.steps, folder, checkpoint_dir, args)
                resumed = trainer_run(row, world_size // 2, 2, 2 * args.steps, folder, checkpoint_dir, args)
                stage = "stage0" if row == "zero0" else "stage3"  # zero3-ac: the same state
                formula = {"held": expected_mb(stage, shape, world_size),
                           "held_resumed": expected_mb(stage, shape, world_size // 2),
                           "zero0_per_rank": expected_mb("stage0", shape, world_size)}
                records.append({"row": row, "world_size": world_size, "first": first, "resumed": resumed,
                                "formula_mb": formula})
                for run, held in ((first, formula["held"]), (resumed, formula["held_resumed"])):
                    # zero3-ac keeps less than a batch's activations: the bound is taken without its saving
                    bound = held + activations[run["batch_size"]]
                    phases = ", ".join(f"{phase} {max(peaks):.0f} ({max(peaks) / bound:.2f}x)"
                                       for phase, peaks in run["memory_by_phase_mb"].items())
                    print(f"{row} on {run['world_size']}: {phases} MB above start (the largest rank; x: of the "
                          f"formula {held:.0f} + the batch's activations {activations[run['batch_size']]:.0f} MB); "
                          f"absolute peak {run['peak_memory_mb']:.0f} MB; median step "
                          f"{run['step_time_ms_median'] / 1e3:.1f} s", flush=True)
    print(f"--zero 0 or DDP would hold 16 Psi = {expected_mb('stage0', shape, 1) / 1e3:.1f} GB a rank "
          f"({shape['psi'] / 1e6:.0f}M parameters)")
    payload = {"benchmark": "memory-trainer", "command": "python -m benchmarks.memory_benchmark " + " ".join(
        sys.argv[1:]), "machine": machine_info(), "model": args.model, "shape": shape,
        "context": args.context, "activations_mb": {str(b): round(mb, 1) for b, mb in activations.items()},
        "records": records}
    path = args.json or os.path.join("results", f"memory-trainer-{machine_tag()}.json")
    write_json(path, merged(path, payload, ("row", "world_size")) if args.merge else payload)
    print(f"wrote {path}")
    return payload


def merged(path: str, payload: dict, key: tuple[str, ...]) -> dict:
    """--merge: the records already in ``path`` that this run does not repeat, kept (this run's replace theirs),
    and both commands; refused in one line where the file holds another benchmark, model, context or steps."""
    if not os.path.exists(path):
        return payload
    with open(path) as f:
        earlier = json.load(f)
    same = ("benchmark", "model", "context", "steps")
    if any(earlier.get(k) != payload.get(k) for k in same):
        raise SystemExit(f"memory_benchmark --merge: {path} holds another run ({', '.join(same)} differ)")
    mine = {tuple(r[k] for k in key) for r in payload["records"]}
    kept = [r for r in earlier["records"] if tuple(r[k] for k in key) not in mine]
    return dict(payload, command=earlier["command"] + " && " + payload["command"], records=kept + payload["records"])


def main(argv: list[str] | None = None) -> dict:
    from files import write_json
    from measure.machine import machine_info, machine_tag
    args = parse_args(argv)
    if args.trainer:
        return main_trainer(args)
    shape = model_shape(args.model, args.context)
    allocators = ["default", "pinned"] if args.allocator == "both" else [args.allocator]
    records = []
    for world_size in args.worlds_list:
        for row in args.rows_list:
            for allocator in allocators:
                ranks = run_row(row, world_size, allocator == "pinned", args)
                records.append({
                    "row": row, "world_size": world_size, "allocator": allocator,
                    "formula_mb": expected_mb(row, shape, world_size),
                    "start_mb": [r["start_mb"] for r in ranks],
                    "peak_mb": {p: max(r[p]["peak_mb"] for r in ranks) for p in PHASES},
                    "peak_mb_per_rank": {p: [r[p]["peak_mb"] for r in ranks] for p in PHASES},
                    "seconds": {p: max(r[p]["seconds"] for r in ranks) for p in PHASES},
                    "load_call_seconds": max(r["load_call_seconds"] for r in ranks),
                })
                records[-1]["glibc_mb"] = {p: [r[p]["glibc_mb"] for r in ranks] for p in PHASES}
                records[-1]["rss_file_above_start_mb"] = {p: [r[p]["rss_file_mb"] - r["start_rss_file_mb"]
                                                              for r in ranks] for p in PHASES}
                records[-1]["rss_anon_at_end_mb"] = {p: [r[p]["rss_anon_mb"] for r in ranks] for p in PHASES}
                if args.view:  # the same work again under the profiler; each phase read on its busiest rank
                    viewed = run_row(row, world_size, allocator == "pinned", args, view=True)
                    busiest = {p: max(range(world_size), key=lambda i: ranks[i][p]["peak_mb"]) for p in PHASES}
                    records[-1]["view"] = {p: reading(ranks[i][p]["peak_mb"], ranks[i][p]["glibc_mb"],
                                                      viewed[i][p]["tensors"]) for p, i in busiest.items()}
                print(f"{row} W={world_size} {allocator}: " + ", ".join(
                    f"{p} {records[-1]['peak_mb'][p]:.0f} MB" for p in PHASES), flush=True)
    print_table(records)
    if args.view:
        print_view(records)
    payload = {"benchmark": "memory", "command": "python -m benchmarks.memory_benchmark " + " ".join(
        sys.argv[1:] if argv is None else argv), "machine": machine_info(), "model": args.model,
        "shape": shape, "context": args.context, "steps": args.steps, "records": records}
    path = args.json or os.path.join("results", f"memory-{machine_tag()}.json")
    write_json(path, merged(path, payload, ("row", "world_size", "allocator")) if args.merge else payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
