"""Benchmark of allreduce.py's algorithms against torch.distributed's collectives (gloo, CPU).

    python -m benchmarks.allreduce_benchmark            # all-reduce: ring, butterfly, torch; 2, 4, 8 workers
    python -m benchmarks.allreduce_benchmark --collectives reduce_scatter,all_gather --workers 2,4 --sizes 1e6,1e7

``--collectives`` picks what is timed (default allreduce):
- allreduce: ring_allreduce and butterfly_allreduce against torch.distributed.all_reduce (SUM then a division,
  since gloo has no AVG), which runs up to --torch-max-workers;
- reduce_scatter: ring_reduce_scatter against torch.distributed.reduce_scatter_tensor (on gloo an all-reduce of
  the whole vector that keeps one chunk: twice the ring's traffic), which writes a new chunk-sized output;
- all_gather: ring_all_gather against torch.distributed.all_gather_into_tensor, both in place.
For the halves every length is rounded up to a multiple of the worker count (p equal chunks).

One harness.LocalGroup (gloo over a FileStore) per worker count is started and reused for every size; it first
fits alpha and beta to a ping-pong between ranks 0 and 1. For each (collective, workers, size) every algorithm's
accuracy, bit-identity across ranks and extra memory (bytes of new tensor storage made by torch calls during one
call, tracked with a TorchFunctionMode; see ``tracked_allocation_bytes``) are taken first: for the all-reduce the
max error against the float64 mean of the inputs, for the reduce-scatter against the float64 sum of the ranks'
chunks, for the all-gather bit-equality with every rank's own chunk. Then the timed calls (each after a barrier;
adaptive count from 3 probe calls and --budget-s) are spread over --rounds rounds in alternating algorithm order,
and the slowest rank's median counts. The reduce-scatters are timed on a vector of zeros: the ring sums in place,
so random inputs would grow by up to p times per call into infinities, and an add takes the same time whatever
finite values it adds (zeros are not subnormal). The table prints the alpha-beta model's prediction
(``predicted_ms``) beside each measured median.

Where the time goes: the benchmark reads every thread's scheduler accounting (Linux schedstat) around its timed
calls and reports, per call, the CPU time of the calling thread, the time that thread was ready to run but waited
for a CPU, and the CPU time of the process's other threads (gloo's I/O and work threads). ``--cpus`` pins the
workers, ``--segment-sweep`` times the ring all-reduce with several segment sizes at the largest length.
Results go to results/allreduce-<machine>.json (collectives-<machine>.json when a half is timed); the report
reads them.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import threading
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import harness
from allreduce import (ALGORITHMS, RECEIVE_SLOTS, SEGMENT_ELEMENTS, ring_all_gather, ring_allreduce,
                       ring_reduce_scatter)
from files import write_json
from measure.machine import machine_info, machine_tag
from measure.summary import max_across_ranks, median, percentile
from measure.timing import time_calls_ms


class _AllocationTracker(TorchFunctionMode):
    """Adds up the bytes of every new tensor storage returned by a torch function or Tensor method called from
    Python (outputs not sharing an input's storage: views are free, .contiguous() copies are not). Memory that
    C++ allocates out of sight (gloo's own scratch inside torch.distributed.all_reduce) is not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage.data_ptr() not in inputs and storage.nbytes():
                inputs.add(storage.data_ptr())
                self.bytes += storage.nbytes()
        return out


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def tracked_allocation_bytes(fn) -> int:
    """Bytes of new tensor storage made by torch calls from Python while ``fn()`` runs. A sum, so an upper bound on the
    extra peak; for ring and butterfly, which allocate one buffer, it is the peak."""
    with _AllocationTracker() as tracker:
        fn()
    return tracker.bytes


def benchmark_inputs(rank: int, size: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s float32 input, and the float64 mean of all ranks' inputs (each rank rebuilds it)."""
    def make(r: int) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(seed * 100_003 + r))

    total = torch.zeros(n, dtype=torch.float64)
    for r in range(size):
        total += make(r)  # float32 into float64: exact
    return make(rank), total.div_(size)


def torch_reduce_scatter(flat: torch.Tensor, rank: int, size: int, group: dist.ProcessGroup | None = None,
                         segment_elements: int = SEGMENT_ELEMENTS) -> torch.Tensor:
    """The baseline: torch.distributed.reduce_scatter_tensor (SUM) into a new chunk, which it returns."""
    out = torch.empty(flat.numel() // size, dtype=flat.dtype)
    dist.reduce_scatter_tensor(out, flat, group=group)
    return out


def torch_all_gather(flat: torch.Tensor, rank: int, size: int, group: dist.ProcessGroup | None = None,
                     segment_elements: int = SEGMENT_ELEMENTS) -> torch.Tensor:
    """The baseline: torch.distributed.all_gather_into_tensor in place (the input is this rank's chunk of flat)."""
    chunk = flat.numel() // size
    dist.all_gather_into_tensor(flat, flat[rank * chunk:(rank + 1) * chunk], group=group)
    return flat


# What --collectives can time: per collective, the algorithms by name, each fn(flat, rank, size, segment_elements=)
COLLECTIVES = {
    "allreduce": ALGORITHMS,
    "reduce_scatter": {"ring": ring_reduce_scatter, "torch": torch_reduce_scatter},
    "all_gather": {"ring": ring_all_gather, "torch": torch_all_gather},
}
SHORT = {"allreduce": "", "reduce_scatter": "rs-", "all_gather": "ag-"}  # the table's algorithm column


def collective_inputs(collective: str, rank: int, size: int, n: int, seed: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's float32 input, what the result must be close to or equal, the input of the timed calls).

    allreduce: the float64 mean of all ranks' inputs; reduce_scatter: the float64 sum of all ranks' chunk
    ``rank``; all_gather: every rank's own chunk, concatenated (float32: the result must equal it bit for bit)."""
    data, mean = benchmark_inputs(rank, size, n, seed)
    if collective == "allreduce":
        return data, mean, data.clone()
    chunk = n // size
    if collective == "reduce_scatter":
        # Timed on zeros: the ring sums in place, and repeated sums of random inputs grow into infinities.
        return data, mean[rank * chunk:(rank + 1) * chunk] * size, torch.zeros(n)
    gathered = torch.cat([benchmark_inputs(r, 1, n, seed)[0][r * chunk:(r + 1) * chunk] for r in range(size)])
    return data, gathered, data.clone()


PINGPONG_LENGTHS = [10_000, 100_000, 1_000_000, 4_000_000]


def pingpong_worker(rank: int, size: int, lengths: list[int], reps: int) -> list[dict]:
    """One-way message time between ranks 0 and 1 (half the round trip; the other ranks wait at a barrier), as
    the least time over ``reps`` round trips per length: the alpha-beta model describes an unhindered message."""
    rows = []
    for n in lengths:
        buffer, times = torch.zeros(n), []
        for _ in range(reps + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            elif rank == 1:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            times.append((time.perf_counter() - start) / 2 * 1e3)
        rows.append({"elements": n, "one_way_ms_min": min(times[1:]),
                     "one_way_ms_median": median(times[1:])})
    return rows


def fit_alpha_beta(rows: list[dict]) -> dict:
    """Least squares t = alpha + beta * n over the ping-pong's (elements, one-way ms) points."""
    xs, ys = [r["elements"] for r in rows], [r["one_way_ms_min"] for r in rows]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    beta = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    beta = max(beta, 0.0)  # short lengths only: noise can outweigh the per-element cost and tilt the slope
    alpha = max(mean_y - beta * mean_x, min(ys))  # a steep fit can push the intercept below any measurement
    return {"alpha_ms": alpha, "beta_ms_per_element": beta, "beta_gb_per_s": 4 / (beta * 1e6) if beta else None,
            "points": rows}


def predicted_ms(algo: str, p: int, n: int, model: dict, segment: int, collective: str = "allreduce") -> float:
    """The alpha-beta model of allreduce.py's docstring for one call (the adds are not modelled)."""
    alpha, beta = model["alpha_ms"], model["beta_ms_per_element"]
    if p == 1:
        return 0.0
    if algo == "butterfly":
        q = 1 << (p.bit_length() - 1)
        extra = 0 if q == p else 2 * alpha + 2 * n * beta
        return 2 * math.log2(q) * alpha + 2 * n * (q - 1) / q * beta + extra
    # Every rank sends 2(p - 1) chunks of n/p elements in sequence, K segments each; gloo's ring (torch) is
    # modelled unsegmented, K = 1. Segments add messages; what they save (the adds overlapped) is not alpha-beta.
    # A half is one of the two phases, except gloo's reduce-scatter, which is a whole all-reduce.
    pieces = -(-math.ceil(n / p) // segment) if algo == "ring" else 1
    phases = 2 if collective == "allreduce" or (collective, algo) == ("reduce_scatter", "torch") else 1
    return phases * (p - 1) * (pieces * alpha + n / p * beta)


@contextlib.contextmanager
def pinned(rank: int, cpus: list[int] | None):
    """Every thread of this process (gloo's included) on CPU cpus[rank % len(cpus)] for the block; None: as is."""
    if not cpus:
        yield
        return
    threads = [int(t) for t in os.listdir("/proc/self/task")]
    before = {t: os.sched_getaffinity(t) for t in threads}
    for t in threads:
        os.sched_setaffinity(t, {cpus[rank % len(cpus)]})
    try:
        yield
    finally:
        for t, mask in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(t, mask)


def thread_schedstat_ns() -> dict[int, tuple[int, int]]:
    """Per thread of this process: (ns run on a CPU, ns spent runnable but waiting on a run queue), from Linux's
    /proc/self/task/*/schedstat; {} where it does not exist. Shows where a call's time goes: computing, waiting
    for a message (neither), or ready to run but waiting for a CPU."""
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    run_ns, wait_ns = map(int, f.read().split()[:2])
                out[int(tid)] = (run_ns, wait_ns)
    return out


def _thread_deltas_us(before: dict, after: dict, caller: int) -> tuple[float, float, float]:
    """(caller's CPU, caller's run-queue wait, every other thread's CPU) between two thread_schedstat_ns, in us."""
    def delta(tid: int, field: int) -> float:
        return (after[tid][field] - before.get(tid, (0, 0))[field]) / 1e3

    others = sum(delta(t, 0) for t in after if t != caller)
    return (delta(caller, 0), delta(caller, 1), others) if caller in after else (0.0, 0.0, others)


def bench_worker(rank: int, size: int, n: int, algos: list[str], seed: int, budget_s: float, min_iters: int,
                 max_iters: int, rounds: int, segment: int, cpus: list[int] | None = None,
                 collective: str = "allreduce") -> list[dict]:
    with pinned(rank, cpus):
        return _bench(rank, size, n, algos, seed, budget_s, min_iters, max_iters, rounds, segment, collective)


def _bench(rank: int, size: int, n: int, algos: list[str], seed: int, budget_s: float, min_iters: int,
           max_iters: int, rounds: int, segment: int, collective: str = "allreduce") -> list[dict]:
    """Every algorithm of one collective at one (size, n) on every rank of a LocalGroup; rank 0's list is the
    result rows.

    Timed calls are spread over ``rounds`` rounds, the algorithms' order reversed every other round, so that a
    change in the machine's load falls on all of them alike; each row's median pools all its rounds."""
    data, reference, timed = collective_inputs(collective, rank, size, n, seed)
    functions = COLLECTIVES[collective]
    rows = {}
    for algo in algos:
        run = functions[algo]
        # Accuracy and identity on a fresh copy of the inputs, before the timing loop keeps working in place.
        result = run(data.clone(), rank, size, segment_elements=segment)
        error = max_across_ranks(float((result.double() - reference.double()).abs().max()))
        if collective == "reduce_scatter":  # each rank holds a different chunk; none is copied
            identical = None
        else:  # the all-gather must also equal every rank's own chunk, bit for bit
            rank0 = result.clone()
            dist.broadcast(rank0, 0)
            same = torch.equal(rank0, result) and (collective != "all_gather" or torch.equal(result, reference))
            identical = max_across_ranks(float(not same)) == 0.0
            del rank0
        work = timed.clone()
        extra_bytes = max_across_ranks(tracked_allocation_bytes(
            lambda: run(work, rank, size, segment_elements=segment)))
        probe = time_calls_ms(lambda: run(work, rank, size, segment_elements=segment),
                              torch.device("cpu"), iters=3, warmup=1)
        probe_ms = max_across_ranks(median(probe))
        iters = int(min(max_iters, max(min_iters, budget_s * 1e3 / max(probe_ms, 1e-3))))
        rows[algo] = {"workers": size, "elements": n, "algo": algo, "iters": -(-iters // rounds) * rounds,
                      "extra_peak_bytes": int(extra_bytes), "max_abs_error": error,
                      "identical_across_ranks": identical, "times": []}
        if collective != "allreduce":
            rows[algo]["collective"] = collective
        del result, work
    work = timed.clone()
    caller = threading.get_native_id()
    threads_us = {algo: [0.0, 0.0, 0.0] for algo in algos}
    for round_index in range(rounds):
        for algo in (algos if round_index % 2 == 0 else algos[::-1]):
            run = functions[algo]
            before = thread_schedstat_ns()
            rows[algo]["times"] += time_calls_ms(
                lambda: run(work, rank, size, segment_elements=segment), torch.device("cpu"),
                iters=rows[algo]["iters"] // rounds, warmup=1)
            deltas = _thread_deltas_us(before, thread_schedstat_ns(), caller)
            threads_us[algo] = [a + b for a, b in zip(threads_us[algo], deltas)]
    out = []
    for algo in algos:
        row = rows[algo]
        times = row.pop("times")
        calls = len(times) + rounds  # each round's warm-up call falls inside the accounting too
        row["caller_cpu_us"], row["caller_runqueue_us"], row["other_threads_cpu_us"] = (
            max_across_ranks(v / calls) for v in threads_us[algo])
        row["median_ms"] = max_across_ranks(median(times))
        row["min_ms"] = max_across_ranks(min(times))
        # The spread shows two-mode timings (calls whose wake-ups waited for a busy CPU, and calls that did not).
        row["p10_ms"] = max_across_ranks(percentile(times, 10))
        row["p90_ms"] = max_across_ranks(percentile(times, 90))
        out.append(row)
    return out


def segment_sweep_worker(rank: int, size: int, n: int, segments: list[int], rounds: int, iters: int) -> list[dict]:
    """The ring's median time at length n for each segment size, alternating rounds as in bench_worker."""
    work = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    times: dict[int, list[float]] = {s: [] for s in segments}
    for round_index in range(rounds):
        for segment in (segments if round_index % 2 == 0 else segments[::-1]):
            times[segment] += time_calls_ms(lambda: ring_allreduce(work, rank, size, segment_elements=segment),
                                            torch.device("cpu"), iters=iters, warmup=1)
    return [{"workers": size, "elements": n, "segment_elements": s,
             "median_ms": max_across_ranks(median(times[s]))} for s in segments]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(float(v)) if "e" in v.lower() else int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _cpu_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated CPU numbers, got {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if not values or not set(values) <= allowed:
        raise argparse.ArgumentTypeError(f"CPUs {text!r} not all in this process's set {sorted(allowed)}")
    return values


def _choice_list(choices, what: str):
    """An argparse type: a comma-separated non-empty subset of ``choices`` (``what`` names them in the error)."""
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        unknown = [v for v in values if v not in choices]
        if not values or unknown:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown or text!r}: choose from {','.join(choices)}")
        return values
    return parse


_algo_list, _collective_list = _choice_list(ALGORITHMS, "algorithm"), _choice_list(COLLECTIVES, "collective")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Benchmark allreduce.py's ring and butterfly all-reduce and the "
                                                 "ring's reduce-scatter and all-gather against torch.distributed "
                                                 "(gloo, CPU).")
    parser.add_argument("--collectives", type=_collective_list, default=["allreduce"],
                        help="comma-separated subset of allreduce,reduce_scatter,all_gather (default allreduce)")
    parser.add_argument("--workers", type=_int_list, default=[2, 4, 8],
                        help="comma-separated world sizes (default 2,4,8)")
    parser.add_argument("--sizes", type=_int_list, default=[1000, 10000, 100000, 1000000, 10000000, 25000000],
                        help="comma-separated vector lengths in float32 elements, 1e6 notation allowed "
                             "(default 1e3,1e4,1e5,1e6,1e7,2.5e7)")
    parser.add_argument("--algos", type=_algo_list, default=list(ALGORITHMS),
                        help="comma-separated subset of ring,butterfly,torch (default all; the halves have no "
                             "butterfly)")
    parser.add_argument("--torch-max-workers", type=int, default=16,
                        help="run torch.distributed's collectives only up to this many workers (default 16)")
    parser.add_argument("--budget-s", type=float, default=1.0,
                        help="timed seconds per configuration; sets the iteration count (default 1.0)")
    parser.add_argument("--min-iters", type=int, default=6)
    parser.add_argument("--max-iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds the timed calls are spread over (default 3)")
    parser.add_argument("--segment", type=int, default=SEGMENT_ELEMENTS,
                        help=f"ring and butterfly segment, elements (default {SEGMENT_ELEMENTS})")
    parser.add_argument("--segment-sweep", type=_int_list, default=None, metavar="SEGMENTS",
                        help="also time the ring with each of these segment sizes at the largest length")
    parser.add_argument("--cpus", type=_cpu_list, default=None,
                        help="pin worker r (all its threads) to CPU cpus[r %% len] while timing, e.g. 0 puts every "
                             "worker on CPU 0 (default: the scheduler places them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for any one group call")
    parser.add_argument("--json", default=None,
                        help=f"results file (default results/allreduce-{machine_tag()}.json, or "
                             f"collectives-{machine_tag()}.json when a half is timed)")
    args = parser.parse_args(argv)
    if args.budget_s <= 0 or args.min_iters < 1 or args.max_iters < args.min_iters or args.rounds < 1:
        parser.error("need --budget-s > 0, 1 <= --min-iters <= --max-iters and --rounds >= 1")
    if args.segment < 1:
        parser.error("--segment must be positive")
    return args


def _ratios(rows: list[dict]) -> list[dict]:
    """ring / torch (and ring / butterfly for the all-reduce) per (collective, workers, elements)."""
    by_key = {(r.get("collective", "allreduce"), r["workers"], r["elements"], r["algo"]): r["median_ms"] for r in rows}
    out = []
    for (collective, workers, n, algo), ring_ms in sorted(by_key.items()):
        if algo != "ring":
            continue
        torch_ms = by_key.get((collective, workers, n, "torch"))
        butterfly_ms = by_key.get((collective, workers, n, "butterfly"))
        ratio = {"workers": workers, "elements": n, "ring_over_torch": ring_ms / torch_ms if torch_ms else None}
        if collective == "allreduce":
            ratio["ring_over_butterfly"] = ring_ms / butterfly_ms if butterfly_ms else None
        else:
            ratio["collective"] = collective
        out.append(ratio)
    return out


def measure(args: argparse.Namespace, say: Any, progress: Any) -> tuple[list[dict], dict[int, dict], list[dict]]:
    """Each worker count in a group of its own: the ping-pong's alpha-beta fit, then every collective x size x
    algorithm (a row each, printed as it comes), then the ring's segment sweep."""
    rows: list[dict] = []
    models: dict[int, dict] = {}
    sweep: list[dict] = []
    for workers in args.workers:
        with harness.LocalGroup(workers, timeout_s=args.timeout, start_timeout_s=args.timeout) as group:
            if workers > 1:
                # Lengths up to the largest benchmarked (at least two points for the fit).
                lengths = [1] + [m for m in PINGPONG_LENGTHS if m <= max(10_000, max(args.sizes))]
                points = group.run(pingpong_worker, lengths, 10)[0]
                models[workers] = fit_alpha_beta(points)
                m = models[workers]
                say(f"{workers:>7} ping-pong: alpha {m['alpha_ms'] * 1e3:.0f} us, "
                    f"beta {m['beta_ms_per_element'] * 1e6:.2f} ns/element"
                    + (f" ({m['beta_gb_per_s']:.2f} GB/s)" if m["beta_gb_per_s"] else ""))
            for collective in args.collectives:
                algos = [a for a in args.algos if a in COLLECTIVES[collective]
                         and not (a == "torch" and workers > args.torch_max_workers)]
                for size in args.sizes:
                    # The halves need p equal chunks: the length rounded up to a multiple of the workers.
                    n = size if collective == "allreduce" else -(-size // workers) * workers
                    for row in group.run(bench_worker, n, algos, args.seed, args.budget_s, args.min_iters,
                                         args.max_iters, args.rounds, args.segment, args.cpus, collective)[0]:
                        row["predicted_ms"] = predicted_ms(row["algo"], workers, n, models[workers], args.segment,
                                                           collective) if workers > 1 else 0.0
                        rows.append(row)
                        say(f"{workers:>7} {n:>9} {SHORT[collective] + row['algo']:>9} {row['median_ms']:>10.3f} "
                            f"{row['predicted_ms']:>9.3f} {row['iters']:>5} {row['extra_peak_bytes'] / 1024:>9.1f} "
                            f"{row['max_abs_error']:>11.2e} {str(row['identical_across_ranks']):>9}")
                    if progress is not None:
                        progress.update()
            if args.segment_sweep and workers > 1 and "allreduce" in args.collectives:
                for row in group.run(segment_sweep_worker, max(args.sizes), args.segment_sweep, args.rounds, 2)[0]:
                    sweep.append(row)
                    say(f"{workers:>7} {row['elements']:>9} ring with segment {row['segment_elements']:>8}: "
                        f"{row['median_ms']:.1f} ms")
    return rows, models, sweep


def print_ratios(rows: list[dict], ratios: list[dict]) -> None:
    """The ring against torch's and the butterfly (all-reduce), the halves against torch's, and where the CPU went."""
    fmt = lambda v: f"{v:.2f}" if v is not None else "-"
    if any("ring_over_butterfly" in r for r in ratios):
        print("\nring / torch and ring / butterfly (median times; < 1 means the ring is faster)")
        for r in ratios:
            if "collective" not in r:
                print(f"{r['workers']:>7} {r['elements']:>9}  ring/torch {fmt(r['ring_over_torch']):>6}  "
                      f"ring/butterfly {fmt(r['ring_over_butterfly']):>6}")
    if any("collective" in r for r in ratios):
        print("\nthe ring's halves / torch.distributed's (median times; < 1 means the ring is faster)")
        for r in ratios:
            if "collective" in r:
                print(f"{r['workers']:>7} {r['elements']:>9}  {r['collective']:>14}  ring/torch "
                      f"{fmt(r['ring_over_torch']):>6}")
    if rows and any(r["caller_cpu_us"] for r in rows):
        print("\nper call, us (largest across ranks; the barrier before each call included): the calling thread's CPU "
              "time, its wait for a CPU while ready to run, and the CPU time of the process's other threads (gloo's)")
        for r in rows:
            label = SHORT[r.get("collective", "allreduce")] + r["algo"]
            print(f"{r['workers']:>7} {r['elements']:>9} {label:>9}  caller CPU {r['caller_cpu_us']:>8.0f}  "
                  f"waiting for a CPU {r['caller_runqueue_us']:>8.0f}  "
                  f"gloo threads CPU {r['other_threads_cpu_us']:>8.0f}")


# How each figure of the JSON is measured (its "method")
METHOD = {
        "time": "median over the timed calls of one rank's wall time per call (each call starts after a "
                "barrier), the largest such median across ranks; iterations adaptive: 3 probe calls, then "
                "budget_s / probe median, clamped to [min_iters, max_iters], spread over `rounds` rounds in "
                "alternating algorithm order",
        "p10_ms/p90_ms": "10th and 90th percentile of one rank's call times, the largest across ranks",
        "predicted_ms": "alpha-beta model (predicted_ms in allreduce_benchmark.py) with alpha and beta fitted per "
                        "worker count to a ping-pong between ranks 0 and 1 (least one-way time per length)",
        "extra_peak_bytes": "bytes of new tensor storage returned by torch functions and Tensor methods "
                            "during one call (a TorchFunctionMode), max over ranks; a sum of allocations, "
                            "so an upper bound on the peak; gloo's internal scratch in "
                            "torch.distributed.all_reduce is invisible to it, so the torch figure is a "
                            "lower bound",
        "caller_cpu_us/caller_runqueue_us/other_threads_cpu_us": "per timed call (barrier and each round's "
            "warm-up call included), from Linux schedstat: CPU time of the thread that calls the all-reduce, the "
            "time it was ready to run but waiting for a CPU, and the CPU time of the process's other threads "
            "(gloo's I/O and work threads); largest across ranks; 0 where /proc has no schedstat",
        "max_abs_error": "max over ranks and elements of |result - float64 mean of all ranks' float32 inputs|",
        "torch": "torch.distributed.all_reduce(SUM) on gloo, then a division by the world size; for the halves "
                 "(rows with a 'collective'), torch.distributed.reduce_scatter_tensor into a new chunk and "
                 "torch.distributed.all_gather_into_tensor in place",
        "halves": "reduce_scatter: max_abs_error against the float64 sum of the ranks' chunk `rank`, "
                  "identical_across_ranks None (each rank keeps its own chunk), timed on a vector of zeros (the "
                  "ring sums in place: random inputs would grow to infinities over the timed calls); "
                  "all_gather: identical_across_ranks true when every rank's result equals every rank's own "
                  "chunk bit for bit; elements rounded up to a multiple of the workers",
    
}


def main(argv=None) -> dict:
    args = parse_args(argv)
    stem = "allreduce" if args.collectives == ["allreduce"] else "collectives"
    json_path = args.json or os.path.join("results", f"{stem}-{machine_tag()}.json")
    progress = None
    if sys.stderr.isatty():
        from tqdm import tqdm
        progress = tqdm(total=len(args.workers) * len(args.sizes) * len(args.collectives), file=sys.stderr,
                        desc="collectives", leave=False)
    say = progress.write if progress is not None else partial(print, flush=True)

    header = f"{'workers':>7} {'elements':>9} {'algo':>9} {'median ms':>10} {'model ms':>9} {'iters':>5} " \
             f"{'extra KiB':>9} {'max abs err':>11} {'identical':>9}"
    started, load_before = time.perf_counter(), os.getloadavg()
    if stem == "collectives":
        print("algo: rs- reduce-scatter, ag- all-gather (torch: reduce_scatter_tensor, all_gather_into_tensor), "
              "no prefix all-reduce; identical: None for the reduce-scatter (each rank keeps its own chunk)")
    print(header, flush=True)
    rows, models, sweep = measure(args, say, progress)
    if progress is not None:
        progress.close()

    ratios = _ratios(rows)
    print_ratios(rows, ratios)
    payload = {
        "benchmark": stem,
        "command": " ".join(["python", "-m", "benchmarks.allreduce_benchmark"]
                            + (sys.argv[1:] if argv is None else list(argv))),
        "machine": machine_info(),
        "settings": {"collectives": args.collectives, "workers": args.workers, "sizes": args.sizes,
                     "algos": args.algos, "dtype": "float32",
                     "torch_max_workers": args.torch_max_workers, "budget_s": args.budget_s,
                     "min_iters": args.min_iters, "max_iters": args.max_iters, "rounds": args.rounds,
                     "segment_elements": args.segment, "receive_slots": RECEIVE_SLOTS, "cpus": args.cpus,
                     "seed": args.seed},
        "method": METHOD,
        "wall_time_s": time.perf_counter() - started,
        # The machine may be shared: the 1/5/15-minute load averages say how busy it was around the run.
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "alpha_beta": {str(w): m for w, m in models.items()},
        "segment_sweep": sweep,
        "results": rows,
        "ratios": ratios,
    }
    write_json(json_path, payload)
    print(f"\nwrote {json_path} ({payload['wall_time_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
