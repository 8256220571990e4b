"""Time and memory of syncbn.SyncBatchNorm against PyTorch's, forward + backward, on every rank of a torchrun job.

    torchrun --nproc_per_node 2 bn_benchmark.py [--device cpu|cuda] [--json results/bn-<machine>.json]

For hid_dim in {128, 256, 512, 1024} x per-rank batch in {32, 64}: an (batch, hid_dim) float32 input, one
forward and one backward (with a fixed random output gradient) per timed call. Time: the median over many calls
(each started after a barrier, see utils.time_calls_ms), then the max across ranks. The two implementations
are timed in alternating rounds, so a burst of load from elsewhere on the machine hits both alike.

What "theirs" is:
- CUDA: torch.nn.SyncBatchNorm (2 ranks on one GPU run gloo over CUDA tensors; 1 rank can run nccl).
- CPU: nn.SyncBatchNorm refuses CPU tensors, so the row compares against the floor of any synchronized
  BatchNorm: a local nn.BatchNorm1d forward + backward (PyTorch's fused native kernels) plus two all_reduce
  calls of 2C+1 floats (the fewest numbers that carry the statistics and the gradient sums). It is labelled
  "floor" in the table and the JSON.

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

HID_DIMS = (128, 256, 512, 1024)
BATCH_SIZES = (32, 64)


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
    utils.reset_peak_memory(device)
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

    times = {name: [] for name in steps}
    for round_index in range(rounds):
        for name, step in steps.items():
            times[name] += utils.time_calls_ms(step, device, iters // rounds, warmup=5 if round_index else 20)
    median_ms = {name: utils.max_across_ranks(utils.median(t)) for name, t in times.items()}

    if device.type == "cuda":
        memory_mb = {name: extra_peak_cuda_mb(step, device) for name, step in steps.items()}
    else:
        memory_mb = {"ours": kept_for_backward_mb(ours, x), "theirs": kept_for_backward_mb(theirs, x)}
    memory_mb = {name: utils.max_across_ranks(value) for name, value in memory_mb.items()}
    return {"hid_dim": hid_dim, "batch_size": batch_size, "global_batch": batch_size * dist.get_world_size(),
            "ours_ms": median_ms["ours"], "theirs_ms": median_ms["theirs"],
            "time_ratio": median_ms["ours"] / median_ms["theirs"],
            "ours_memory_mb": memory_mb["ours"], "theirs_memory_mb": memory_mb["theirs"],
            "memory_ratio": memory_mb["ours"] / memory_mb["theirs"], "timed_calls_each": len(times["ours"])}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", default=None, help="results file (default: results/bn-<machine_tag>.json; on "
                                                     "a GPU results/bn-<machine_tag>-<ranks>x<backend>.json)")
    parser.add_argument("--iters", type=int, default=2000, help="timed calls per implementation and size")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds the calls are split into")
    return parser.parse_args()


def main():
    args = parse_args()
    if args.iters < args.rounds:
        raise SystemExit(f"--iters ({args.iters}) must be at least --rounds ({args.rounds})")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    try:
        ctx = utils.init_distributed(device=args.device)
    except ValueError as exc:  # no GPU, or nccl with more processes than GPUs: one line, not a traceback
        raise SystemExit(f"bn_benchmark.py: error: {exc}") from None
    theirs_label = "nn.SyncBatchNorm" if ctx.device.type == "cuda" else "floor: nn.BatchNorm1d + 2 all_reduce(2C+1)"
    memory_label = ("extra peak torch.cuda.max_memory_allocated" if ctx.device.type == "cuda"
                    else "saved-for-backward + output bytes")
    utils.print0(f"bn_benchmark: {ctx.world_size} processes, {ctx.device.type}, backend {ctx.backend}; "
                 f"theirs = {theirs_label}; memory = {memory_label}")
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
    if ctx.is_main:
        # One GPU runs two ways (2 ranks over gloo, 1 rank over nccl): each gets a file of its own.
        suffix = f"-{ctx.world_size}x{ctx.backend}" if ctx.device.type == "cuda" else ""
        path = args.json or os.path.join("results", f"bn-{utils.machine_tag(ctx.device)}{suffix}.json")
        utils.write_json(path, {
            "benchmark": "bn_benchmark", "command": " ".join(["torchrun", f"--nproc_per_node {ctx.world_size}",
                                                              "bn_benchmark.py"] + sys.argv[1:]),
            "machine": utils.machine_info(ctx.device), "torch": torch.__version__,
            "processes": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type,
            "theirs": theirs_label, "memory_measure": memory_label,
            "time_measure": "median ms per forward+backward, max across ranks",
            "intra_op_threads": torch.get_num_threads(), "iters": args.iters, "rounds": args.rounds,
            "rows": rows})
        utils.print0(f"wrote {path}")
    utils.cleanup_distributed()


if __name__ == "__main__":
    main()
