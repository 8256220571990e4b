"""Time and memory of syncbn.SyncBatchNorm against PyTorch's, forward + backward, on every rank of a torchrun job.

    torchrun --nproc_per_node 2 bn_benchmark.py [--device cpu|cuda] [--json results/bn-<machine>.json]
    torchrun --nproc_per_node 1 bn_benchmark.py --shapes resnet50 --device cuda [--batch 128] [--dtype bf16]

``--shapes grid`` (the default), the assignment's grid: for hid_dim in {128, 256, 512, 1024} x per-rank batch
in {32, 64}: an (batch, hid_dim) float32 input, one forward and one backward (with a fixed random output
gradient) per timed call. Time: the median over many calls
(each started after a barrier, see measure.timing.time_calls_ms), then the max across ranks. The two implementations
are timed in alternating rounds, so a burst of load from elsewhere on the machine hits both alike.

What "theirs" is:
- CUDA: torch.nn.SyncBatchNorm (2 ranks on one GPU run gloo over CUDA tensors; 1 rank can run nccl).
- CPU: nn.SyncBatchNorm refuses CPU tensors, so the row compares against the floor of any synchronized
  BatchNorm: a local nn.BatchNorm1d forward + backward (PyTorch's fused native kernels) plus two all_reduce
  calls of 2C+1 floats (the fewest numbers that carry the statistics and the gradient sums). It is labelled
  "floor" in the table and the JSON.

``--shapes resnet50``: the five activation shapes ResNet-50's BatchNorm2d layers see (64x112x112 ... 2048x7x7, per
rank batch ``--batch``, default 128 split over the ranks on CUDA, 4 on the CPU), channels-last, the input in
``--dtype`` (default bf16) and the pass under autocast to it, as a mixed-precision ResNet-50 runs. Each row times
ours, nn.BatchNorm2d (this rank's batch only: no synchronization; on more than one rank it also runs the floor's
two all_reduce calls of 2C+1 floats) and, on CUDA, nn.SyncBatchNorm, all affine. It prints the floor of any
BatchNorm on this device: 8 passes over the activation (forward: a read for the statistics, a read and a write
to normalize; backward: a read of x and of the output gradient for the two sums, a read of each and a write for
the input gradient), each at the speed of a copy of the activation measured here (a copy is 2 passes).

Memory:
- CUDA: torch.cuda.max_memory_allocated during one forward + backward, minus what was allocated before it
  (the input, output gradient and module, shared by both): the extra peak the layer costs.
- CPU: there is no per-allocation peak counter for the CPU allocator, so the figure is the bytes the layer
  keeps alive between forward and backward: every tensor saved for backward (counted once per storage, via
  torch.autograd.graph.saved_tensors_hooks) plus the output. Transient buffers inside forward or backward are
  not counted, for either side.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import syncbn
import utils
from files import write_json
from measure.machine import machine_info, machine_tag
from measure.memory import reset_peak_memory
from measure.summary import max_across_ranks, median
from measure.timing import time_calls_ms

HID_DIMS = (128, 256, 512, 1024)
BATCH_SIZES = (32, 64)
# (channels, height = width) of the inputs of ResNet-50's BatchNorm2d layers at 224 px, one per stage and the stem
RESNET50_SHAPES = ((64, 112), (256, 56), (512, 28), (1024, 14), (2048, 7))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_step(norm, x, grad_output, stats_buffer=None, grad_buffer=None):
    """One forward + backward; with buffers, the floor's two all_reduce calls around a local BatchNorm."""
    def step():
        y = norm(x)
        if stats_buffer is not None:
            dist.all_reduce(stats_buffer)
        y.backward(grad_output)
        if grad_buffer is not None:
            dist.all_reduce(grad_buffer)
        x.grad = None
    return step


def time_alternating(steps, device, iters, rounds, warmup):
    """Median ms per call of each step (max across ranks), the calls split into ``rounds`` rounds that visit the
    steps in turn, so a burst of load from elsewhere hits them alike; the first round warms up longer."""
    times = {name: [] for name in steps}
    for round_index in range(rounds):
        for name, step in steps.items():
            times[name] += time_calls_ms(step, device, max(iters // rounds, 1),
                                         warmup=warmup if round_index else 4 * warmup)
    return {name: max_across_ranks(median(t)) for name, t in times.items()}, len(times["ours"])


def autocast_step(step, device, dtype):
    """step() under autocast to dtype (as a mixed-precision model runs its BatchNorm layers), or as it is."""
    if dtype == torch.float32:
        return step

    def autocast():
        with torch.autocast(device.type, dtype=dtype):
            step()
    return autocast


def floor_ms(x, device, iters):
    """8 passes over x at the speed of a copy of x (1 read + 1 write), measured here: the least any BatchNorm's
    forward + backward can cost on this device."""
    target = torch.empty_like(x)
    copy_ms = median(time_calls_ms(lambda: target.copy_(x), device, iters, warmup=3))
    return max_across_ranks(4 * copy_ms)


def resnet50_row(channels, side, batch_size, dtype, device, iters, rounds):
    torch.manual_seed(1234 + dist.get_rank())
    x = torch.randn(batch_size, channels, side, side, device=device).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    grad_output = torch.randn_like(x)
    synced = dist.get_world_size() > 1
    norms = {"ours": syncbn.SyncBatchNorm(channels, affine=True), "BatchNorm2d": nn.BatchNorm2d(channels)}
    if device.type == "cuda":
        norms["nn.SyncBatchNorm"] = nn.SyncBatchNorm(channels)
    buffers = {"BatchNorm2d": [torch.zeros(2 * channels + 1, device=device) for _ in range(2)] if synced else []}
    steps = {name: autocast_step(make_step(norm.to(device), x, grad_output, *buffers.get(name, [])), device, dtype)
             for name, norm in norms.items()}
    median_ms, _ = time_alternating(steps, device, iters, rounds, warmup=3)
    row = {"shape": [batch_size, channels, side, side], "dtype": str(dtype).replace("torch.", ""),
           "floor_ms": floor_ms(x.detach(), device, max(iters // rounds, 3))}
    for name, step in steps.items():
        row[f"{name}_ms"] = median_ms[name]
        memory = (extra_peak_cuda_mb(step, device) if device.type == "cuda"
                  else kept_for_backward_mb(norms[name], x))
        row[f"{name}_memory_mb"] = max_across_ranks(memory)
    for name in norms:
        if name != "ours":
            row[f"ours_over_{name}"] = row["ours_ms"] / row[f"{name}_ms"]
    return row


def run_resnet50(args, ctx):
    batch_size = args.batch or (max(128 // ctx.world_size, 1) if ctx.device.type == "cuda" else 4)
    dtype = DTYPES[args.dtype]
    names = ["ours", "BatchNorm2d"] + (["nn.SyncBatchNorm"] if ctx.device.type == "cuda" else [])
    utils.print0(f"bn_benchmark --shapes resnet50: {ctx.world_size} processes, {ctx.device.type}, backend "
                 f"{ctx.backend}; per-rank batch {batch_size}, {args.dtype} (autocast), channels-last, affine; "
                 f"BatchNorm2d is this rank's own" + (" + 2 all_reduce(2C+1)" if ctx.world_size > 1 else ""))
    utils.print0(f"{'shape':>18} | " + " ".join(f"{name + ' ms':>19}" for name in names) + f" | {'floor ms':>8} | "
                 + " ".join(f"{'/' + name:>17}" for name in names[1:]) + " | "
                 + " ".join(f"{name + ' MiB':>20}" for name in names))
    rows = []
    for channels, side in RESNET50_SHAPES:
        row = resnet50_row(channels, side, batch_size, dtype, ctx.device, args.iters, args.rounds)
        rows.append(row)
        shape = "x".join(str(v) for v in row["shape"])
        utils.print0(f"{shape:>18} | " + " ".join(f"{row[name + '_ms']:>19.3f}" for name in names)
                     + f" | {row['floor_ms']:>8.3f} | "
                     + " ".join(f"{row['ours_over_' + name]:>17.2f}" for name in names[1:]) + " | "
                     + " ".join(f"{row[name + '_memory_mb']:>20.1f}" for name in names))
    return rows, {"batch_size": batch_size, "dtype": args.dtype,
                  "theirs": names[1:], "batchnorm2d_includes_all_reduce": ctx.world_size > 1}


def kept_for_backward_mb(norm, x):
    """Bytes of the tensors saved for backward (once per storage) plus the output, in MiB."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = norm(x)
    storages[y.untyped_storage().data_ptr()] = y.untyped_storage().nbytes()
    return sum(storages.values()) / 2**20


def extra_peak_cuda_mb(step, device):
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    reset_peak_memory(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def benchmark_row(hid_dim, batch_size, device, iters, rounds):
    torch.manual_seed(1234 + dist.get_rank())
    x = torch.randn(batch_size, hid_dim, device=device, requires_grad=True)
    grad_output = torch.randn(batch_size, hid_dim, device=device)
    ours = syncbn.SyncBatchNorm(hid_dim).to(device)
    if device.type == "cuda":
        theirs = nn.SyncBatchNorm(hid_dim, affine=False).to(device)
        steps = {"ours": make_step(ours, x, grad_output), "theirs": make_step(theirs, x, grad_output)}
    else:
        theirs = nn.BatchNorm1d(hid_dim, affine=False)
        stats_buffer, grad_buffer = torch.zeros(2 * hid_dim + 1), torch.zeros(2 * hid_dim + 1)
        steps = {"ours": make_step(ours, x, grad_output),
                 "theirs": make_step(theirs, x, grad_output, stats_buffer, grad_buffer)}

    median_ms, timed_calls = time_alternating(steps, device, iters, rounds, warmup=5)

    if device.type == "cuda":
        memory_mb = {name: extra_peak_cuda_mb(step, device) for name, step in steps.items()}
    else:
        memory_mb = {"ours": kept_for_backward_mb(ours, x), "theirs": kept_for_backward_mb(theirs, x)}
    memory_mb = {name: max_across_ranks(value) for name, value in memory_mb.items()}
    return {"hid_dim": hid_dim, "batch_size": batch_size, "global_batch": batch_size * dist.get_world_size(),
            "ours_ms": median_ms["ours"], "theirs_ms": median_ms["theirs"],
            "time_ratio": median_ms["ours"] / median_ms["theirs"],
            "ours_memory_mb": memory_mb["ours"], "theirs_memory_mb": memory_mb["theirs"],
            "memory_ratio": memory_mb["ours"] / memory_mb["theirs"], "timed_calls_each": timed_calls}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shapes", choices=["grid", "resnet50"], default="grid",
                        help="the assignment's (batch, hid_dim) grid, or ResNet-50's 4-D activation shapes")
    parser.add_argument("--batch", type=int, default=None,
                        help="--shapes resnet50: per-rank batch (default: 128 split over the ranks on CUDA, 4 on "
                             "the CPU)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="--shapes resnet50: input dtype, and autocast to it (default bf16)")
    parser.add_argument("--json", default=None, help="results file (default: results/bn-<machine_tag>.json; on "
                                                     "a GPU results/bn-<machine_tag>-<ranks>x<backend>.json)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed calls per implementation and size (default 2000; 200 with --shapes resnet50)")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds the calls are split into")
    return parser.parse_args()


def run_grid(args, ctx):
    theirs_label = "nn.SyncBatchNorm" if ctx.device.type == "cuda" else "floor: nn.BatchNorm1d + 2 all_reduce(2C+1)"
    utils.print0(f"bn_benchmark: {ctx.world_size} processes, {ctx.device.type}, backend {ctx.backend}; "
                 f"theirs = {theirs_label}")
    utils.print0(f"{'hid':>5} {'batch':>5} | {'ours ms':>8} {'theirs ms':>9} {'ratio':>6} | "
                 f"{'ours MiB':>9} {'theirs MiB':>10} {'ratio':>6}")
    rows = []
    for hid_dim in HID_DIMS:
        for batch_size in BATCH_SIZES:
            row = benchmark_row(hid_dim, batch_size, ctx.device, args.iters, args.rounds)
            rows.append(row)
            utils.print0(f"{hid_dim:>5} {batch_size:>5} | {row['ours_ms']:>8.4f} {row['theirs_ms']:>9.4f} "
                         f"{row['time_ratio']:>6.2f} | {row['ours_memory_mb']:>9.4f} "
                         f"{row['theirs_memory_mb']:>10.4f} {row['memory_ratio']:>6.2f}")
    return rows, {"theirs": theirs_label}


def main():
    args = parse_args()
    if args.iters is None:
        args.iters = 200 if args.shapes == "resnet50" else 2000
    if args.iters < args.rounds:
        raise SystemExit(f"bn_benchmark.py: error: --iters ({args.iters}) must be at least --rounds ({args.rounds})")
    if args.shapes == "grid" and (args.batch is not None or args.dtype is not None):
        raise SystemExit("bn_benchmark.py: error: --batch and --dtype are for --shapes resnet50 (the grid is "
                         "float32, batches 32 and 64)")
    args.dtype = args.dtype or "bf16"
    if args.batch is not None and args.batch < 1:
        raise SystemExit(f"bn_benchmark.py: error: --batch must be at least 1, got {args.batch}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    try:
        ctx = utils.init_distributed(device=args.device)
    except ValueError as exc:  # no GPU, or nccl with more processes than GPUs: one line, not a traceback
        raise SystemExit(f"bn_benchmark.py: error: {exc}") from None
    memory_label = ("extra peak torch.cuda.max_memory_allocated" if ctx.device.type == "cuda"
                    else "saved-for-backward + output bytes")
    utils.print0(f"memory = {memory_label}")
    rows, described = (run_resnet50 if args.shapes == "resnet50" else run_grid)(args, ctx)
    if ctx.is_main:
        # One GPU runs two ways (2 ranks over gloo, 1 rank over nccl): each gets a file of its own.
        suffix = f"-{ctx.world_size}x{ctx.backend}" if ctx.device.type == "cuda" else ""
        name = "bn-resnet50" if args.shapes == "resnet50" else "bn"
        path = args.json or os.path.join("results", f"{name}-{machine_tag(ctx.device)}{suffix}.json")
        write_json(path, {
            "benchmark": "bn_benchmark", "command": " ".join(["torchrun", f"--nproc_per_node {ctx.world_size}",
                                                              "bn_benchmark.py"] + sys.argv[1:]),
            "machine": machine_info(ctx.device), "torch": torch.__version__,
            "processes": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type,
            "shapes": args.shapes, **described, "memory_measure": memory_label,
            "time_measure": "median ms per forward+backward, max across ranks",
            "intra_op_threads": torch.get_num_threads(), "iters": args.iters, "rounds": args.rounds,
            "rows": rows})
        utils.print0(f"wrote {path}")
    utils.cleanup_distributed()


if __name__ == "__main__":
    main()
