"""Ring and butterfly all-reduce on point-to-point primitives, and their benchmark against torch.distributed.

Both functions AVERAGE a floating-point tensor in place over the default process group, for any shape and any
number of elements n (also n < p, the world size, and n not divisible by p), and leave bit-identical values on
every rank: each piece of the result is summed and divided by p on exactly one rank (its owner), and the other
ranks only copy it.

Ring (reduce-scatter, then all-gather)
    The flat vector is cut into p chunks, chunk i holding floor(n/p) or ceil(n/p) elements (the first n mod p
    chunks get the extra one; with n < p some chunks are empty and are simply not sent). Rank r sends to
    r+1 and receives from r-1 (mod p).
    - reduce-scatter, steps s = 0 .. p-2: send chunk (r - s), receive chunk (r - s - 1) into a preallocated
      buffer of ceil(n/p) elements and add it to the local chunk. After p-1 steps chunk (r + 1) on rank r
      holds the sum over all ranks; rank r divides it by p.
    - all-gather, steps s = 0 .. p-2: send chunk (r + 1 - s), receive chunk (r - s) straight into place.
    Steps 2(p-1); elements sent per rank 2n - |chunk r+1| - |chunk r+2| = 2n(p-1)/p when p divides n.
    With a per-message cost alpha and a per-element cost beta, T_ring = 2(p-1) alpha + 2n(p-1)/p beta:
    bandwidth-optimal, but the latency term grows linearly in p.
    Every receive is posted before its message can arrive. Gloo moves a payload only once the receiver has
    posted its buffer, so a receive posted after the sender's send adds a round trip of notices (and two
    thread wake-ups) to each of the 2(p-1) steps on the critical path; posting early halved the ring's time
    at 8 and 16 workers here. So the reduce-scatter double-buffers (the receive for step s + 1 is posted
    before step s is reduced: extra memory two chunks, 2 ceil(n/p) elements), each all-gather receive is
    posted as soon as the reduce-scatter has sent that chunk, and every message has its own tag so that
    receives posted early cannot match the wrong message.

Butterfly (recursive halving, then recursive doubling; Rabenseifner's algorithm)
    The assignment's butterfly exchanges with partner r XOR d, one element per rank; here the elements are
    segments of a vector of any length. With p = 2^k:
    - recursive halving, d = p/2, p/4, .., 1: both partners hold the same segment [lo, hi); split it at
      mid = lo + (hi - lo) // 2; the rank whose bit d is clear keeps [lo, mid) and sends [mid, hi), its
      partner keeps [mid, hi) and sends [lo, mid); each adds what it receives into the half it keeps.
      After k steps every rank owns a distinct segment of about n/p elements, summed over all ranks,
      and divides it by p.
    - recursive doubling, d = 1, 2, .., p/2: partners swap their segments (received straight into place),
      retracing the halving in reverse, until every rank holds the whole vector.
    Steps 2 log2 p; elements sent per rank n/2 + n/4 + .. = n(p-1)/p per phase, 2n(p-1)/p in all (the same
    volume as the ring); extra memory ceil(n/2) elements (the first halving step's receive buffer).
    T_butterfly = 2 log2(p) alpha + 2 n (p-1)/p beta: fewer, larger messages than the ring.
    Non-power-of-two p: let q = 2^floor(log2 p) and e = p - q. Fold: each extra rank q + j (j < e) sends its
    whole vector to rank j, which adds it in (received in two halves through the same ceil(n/2) buffer); the
    q core ranks run the butterfly; unfold: rank j sends the final vector back to rank q + j. That costs two
    more steps and n more elements each way on the paired ranks:
    T = (2 log2 q + 2) alpha + (2n(q-1)/q + 2n) beta on the paired ranks.

The doubling-phase receives are posted up front too (they land in place, so that costs no memory); the
halving phase posts each receive just before its send, as the buffer is reused.

Ring against butterfly: both send the same volume, 2n(p-1)/p per rank, but the ring needs 2(p-1) messages in
sequence and the butterfly 2 log2 p, so for a power-of-two p in the alpha-beta model the ring is never faster:
T_ring - T_butterfly = 2(p - 1 - log2 p) alpha >= 0. The ring's advantages lie elsewhere (only neighbour links,
so no contention on a real network; any p without folding; one message size). On one machine over loopback
TCP with more processes than cores, alpha (two thread wake-ups and a TCP round of syscalls, about 0.2 ms of
CPU per message) dominates at these sizes, so the ring loses to the butterfly there and the benchmark shows it.

Extra memory is what the algorithm allocates: one receive buffer each, allocated up front, and in-place adds
into views of the input (no .contiguous() copies). A non-contiguous input is averaged in a
contiguous copy and copied back (n more elements).

Benchmark: ``python allreduce.py --workers 1,2,4,8,16,32 --sizes 1000,10000,100000 --algos ring,butterfly,torch
--json results/allreduce-cpu-2core.json`` starts one utils.LocalGroup (gloo over a FileStore) per worker count,
reused for every size and algorithm, and for each configuration reports the median time of one call (every call
starts after a barrier; the slowest rank's median counts), the extra memory (bytes of new tensor storage made
by torch calls during one call, tracked with a TorchFunctionMode; see ``tracked_allocation_bytes``) and the max
error against the float64 mean of the inputs. torch.distributed.all_reduce (gloo, SUM then a division, since gloo
has no AVG) runs up to --torch-max-workers (16).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import utils


# ----------------------------------------------------------------------------------------------------------
# The algorithms
# ----------------------------------------------------------------------------------------------------------
def _post_recv(into: torch.Tensor, src: int, tag: int):
    """irecv, or None for an empty piece (both ends know every piece's length and skip the same messages)."""
    return dist.irecv(into, src, tag=tag) if into.numel() else None


def _post_send(outgoing: torch.Tensor, dst: int, tag: int):
    return dist.isend(outgoing, dst, tag=tag) if outgoing.numel() else None


def _wait(request) -> None:
    # Call once per request: a second wait on a finished gloo receive blocks for a message that never comes.
    if request is not None:
        request.wait()


def _exchange(outgoing: torch.Tensor, dst: int, incoming: torch.Tensor, src: int, tag: int) -> None:
    """Send ``outgoing`` to dst while receiving ``incoming`` from src."""
    recv = _post_recv(incoming, src, tag)
    send = _post_send(outgoing, dst, tag)
    _wait(recv)
    _wait(send)


def _check_args(send: torch.Tensor, rank: int, size: int, name: str) -> None:
    if not isinstance(send, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(send).__name__}")
    if not send.is_floating_point():
        raise TypeError(f"{name}: averaging needs a floating-point tensor, got dtype {send.dtype}")
    if not dist.is_initialized():
        raise RuntimeError(f"{name}: the default process group is not initialized")
    if size != dist.get_world_size() or rank != dist.get_rank():
        raise ValueError(f"{name}: rank={rank}, size={size} do not match the default group "
                         f"(rank {dist.get_rank()} of {dist.get_world_size()})")


def _in_place_on_contiguous(algorithm, send: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    # view(-1) needs contiguous memory; anything else is averaged in a contiguous copy and written back.
    if send.is_contiguous():
        algorithm(send.view(-1), rank, size)
    else:
        work = send.contiguous()
        algorithm(work.view(-1), rank, size)
        send.copy_(work)
    return send


def _ring(flat: torch.Tensor, rank: int, size: int) -> None:
    n = flat.numel()
    if size == 1 or n == 0:
        return
    base, extra = divmod(n, size)
    bounds = [i * base + min(i, extra) for i in range(size + 1)]
    chunks = [flat[bounds[i]:bounds[i + 1]] for i in range(size)]
    right, left = (rank + 1) % size, (rank - 1) % size
    # Every receive is posted before the matching send can arrive: gloo moves a payload only once the
    # receiver has posted its buffer, so a late irecv costs a round trip of notices on the critical path.
    # Hence two receive buffers (the receive for step s + 1 is posted while step s is reduced) and one tag
    # per message, so that receives posted early cannot be matched to the wrong message.
    buffers = torch.empty(2, base + (extra > 0), dtype=flat.dtype, device=flat.device)

    def post_reduce_recv(step: int):
        if step >= size - 1:
            return None
        target = chunks[(rank - step - 1) % size]
        return _post_recv(buffers[step % 2, :target.numel()], left, tag=step)

    reduce_recvs = [post_reduce_recv(0), post_reduce_recv(1)]
    gather_recvs = []
    for step in range(size - 1):
        sent = chunks[(rank - step) % size]
        _wait(_post_send(sent, right, tag=step))  # prompt: the receive at the other end is already posted
        # The chunk just sent is not touched again by the reduce-scatter: all-gather step `step` may land in
        # it, and posting that receive now puts it well ahead of its message.
        gather_recvs.append(_post_recv(sent, left, tag=size + step))
        _wait(reduce_recvs[step % 2])
        target = chunks[(rank - step - 1) % size]
        target.add_(buffers[step % 2, :target.numel()])
        reduce_recvs[step % 2] = post_reduce_recv(step + 2)
    chunks[(rank + 1) % size].div_(size)

    gather_sends = []
    for step in range(size - 1):
        if step > 0:  # what this step forwards is what the previous step received
            _wait(gather_recvs[step - 1])
        gather_sends.append(_post_send(chunks[(rank + 1 - step) % size], right, tag=size + step))
    _wait(gather_recvs[-1])
    for send in gather_sends:
        _wait(send)


def ring_allreduce(send: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Average ``send`` in place over the default group with a ring reduce-scatter + all-gather.

    Point-to-point messages only (dist.isend/irecv); see the module docstring for the steps and costs.
    Returns ``send``.
    """
    _check_args(send, rank, size, "ring_allreduce")
    return _in_place_on_contiguous(_ring, send, rank, size)


def _butterfly(flat: torch.Tensor, rank: int, size: int) -> None:
    n = flat.numel()
    if size == 1 or n == 0:
        return
    core = 1 << (size.bit_length() - 1)  # largest power of two <= size
    steps = core.bit_length() - 1  # log2(core)
    fold_tag, unfold_tag = 2 * steps, 2 * steps + 2  # tags 0 .. 2 steps - 1 are the butterfly's own
    halves = (flat[:(n + 1) // 2], flat[(n + 1) // 2:])
    if rank >= core:  # fold into rank - core, wait for the result, done
        for i, half in enumerate(halves):
            _wait(_post_send(half, rank - core, tag=fold_tag + i))
        _wait(_post_recv(flat, rank - core, tag=unfold_tag))
        return
    received = torch.empty((n + 1) // 2, dtype=flat.dtype, device=flat.device)
    partner_extra = rank + core if rank + core < size else None
    if partner_extra is not None:
        for i, half in enumerate(halves):
            incoming = received[:half.numel()]
            _wait(_post_recv(incoming, partner_extra, tag=fold_tag + i))
            half.add_(incoming)

    lo, hi = 0, n
    segments = []  # (parent segment, sibling segment) per halving step
    for step in range(steps):
        distance = core >> (step + 1)
        partner = rank ^ distance
        mid = lo + (hi - lo) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & distance else ((lo, mid), (mid, hi))
        segments.append(((lo, hi), give))
        incoming = received[:keep[1] - keep[0]]
        _exchange(flat[give[0]:give[1]], partner, incoming, partner, tag=step)
        flat[keep[0]:keep[1]].add_(incoming)
        lo, hi = keep
    flat[lo:hi].div_(size)

    # Recursive doubling retraces the halving: at each step the partner sends back the sibling segment this
    # rank gave away. Those regions are final for the halving, so every receive is posted up front.
    segments.reverse()
    recvs = [_post_recv(flat[give[0]:give[1]], rank ^ (1 << step), tag=steps + step)
             for step, (_, give) in enumerate(segments)]
    sends = []
    for step, (parent, _) in enumerate(segments):
        if step > 0:
            _wait(recvs[step - 1])
        sends.append(_post_send(flat[lo:hi], rank ^ (1 << step), tag=steps + step))
        lo, hi = parent
    for request in recvs[-1:] + sends:  # the other receives were waited for already (gloo: wait once only)
        _wait(request)

    if partner_extra is not None:
        _wait(_post_send(flat, partner_extra, tag=unfold_tag))


def butterfly_allreduce(send: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Average ``send`` in place over the default group with recursive halving + doubling (a butterfly).

    Non-power-of-two sizes fold the extra ranks into the power-of-two core first and unfold at the end; see
    the module docstring. Returns ``send``.
    """
    _check_args(send, rank, size, "butterfly_allreduce")
    return _in_place_on_contiguous(_butterfly, send, rank, size)


def torch_allreduce(send: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The baseline: torch.distributed.all_reduce (SUM; gloo has no AVG) and a division, in place."""
    dist.all_reduce(send)
    return send.div_(size)


ALGORITHMS = {"ring": ring_allreduce, "butterfly": butterfly_allreduce, "torch": torch_allreduce}


# ----------------------------------------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------------------------------------
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


_reference_cache: dict[tuple[int, int, int], torch.Tensor] = {}


def benchmark_inputs(rank: int, size: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s float32 input, and the float64 mean of all ranks' inputs (each rank rebuilds it)."""
    def make(r: int) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(seed * 100_003 + r))

    key = (size, n, seed)
    if key not in _reference_cache:
        total = torch.zeros(n, dtype=torch.float64)
        for r in range(size):
            total += make(r).double()
        _reference_cache.clear()  # one reference at a time is enough: configurations go size by size
        _reference_cache[key] = total / size
    return make(rank), _reference_cache[key]


def bench_worker(rank: int, size: int, algo: str, n: int, seed: int, budget_s: float,
                 min_iters: int, max_iters: int) -> dict:
    """One configuration on every rank of a LocalGroup; rank 0's dict is the result row."""
    allreduce = ALGORITHMS[algo]
    data, reference = benchmark_inputs(rank, size, n, seed)

    # Accuracy and identity on a fresh copy of the inputs, before the timing loop keeps averaging in place.
    result = data.clone()
    allreduce(result, rank, size)
    error = utils.max_across_ranks(float((result.double() - reference).abs().max()))
    rank0 = result.clone()
    dist.broadcast(rank0, 0)
    identical = utils.max_across_ranks(float(not torch.equal(rank0, result))) == 0.0

    work = data.clone()
    extra_bytes = utils.max_across_ranks(tracked_allocation_bytes(lambda: allreduce(work, rank, size)))

    # Adaptive iteration count: a few probe calls, then as many as fit in budget_s (all ranks agree).
    probe = utils.time_calls_ms(lambda: allreduce(work, rank, size), torch.device("cpu"), iters=3, warmup=1)
    probe_ms = utils.max_across_ranks(utils.median(probe))
    iters = int(min(max_iters, max(min_iters, budget_s * 1e3 / max(probe_ms, 1e-3))))
    times = utils.time_calls_ms(lambda: allreduce(work, rank, size), torch.device("cpu"), iters=iters, warmup=2)
    median_ms = utils.max_across_ranks(utils.median(times))
    return {"workers": size, "elements": n, "algo": algo, "median_ms": median_ms,
            "min_ms": utils.max_across_ranks(min(times)), "iters": iters,
            "extra_peak_bytes": int(extra_bytes), "max_abs_error": error, "identical_across_ranks": identical}


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _algo_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if v not in ALGORITHMS]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"unknown algorithm(s) {unknown or text!r}: choose from "
                                         f"{','.join(ALGORITHMS)}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Benchmark ring and butterfly all-reduce against "
                                                 "torch.distributed.all_reduce (gloo, CPU).")
    parser.add_argument("--workers", type=_int_list, default=[1, 2, 4, 8, 16, 32],
                        help="comma-separated world sizes (default 1,2,4,8,16,32)")
    parser.add_argument("--sizes", type=_int_list, default=[1000, 10000, 100000],
                        help="comma-separated vector lengths in float32 elements (default 1000,10000,100000)")
    parser.add_argument("--algos", type=_algo_list, default=list(ALGORITHMS),
                        help="comma-separated subset of ring,butterfly,torch (default all)")
    parser.add_argument("--torch-max-workers", type=int, default=16,
                        help="run torch.distributed.all_reduce only up to this many workers (default 16)")
    parser.add_argument("--budget-s", type=float, default=1.0,
                        help="timed seconds per configuration; sets the iteration count (default 1.0)")
    parser.add_argument("--min-iters", type=int, default=5)
    parser.add_argument("--max-iters", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for any one group call")
    parser.add_argument("--json", default=None,
                        help=f"results file (default results/allreduce-{utils.machine_tag()}.json)")
    args = parser.parse_args(argv)
    if args.budget_s <= 0 or args.min_iters < 1 or args.max_iters < args.min_iters:
        parser.error("need --budget-s > 0 and 1 <= --min-iters <= --max-iters")
    return args


def _ratios(rows: list[dict]) -> list[dict]:
    by_key = {(r["workers"], r["elements"], r["algo"]): r["median_ms"] for r in rows}
    out = []
    for (workers, n, algo), ring_ms in sorted(by_key.items()):
        if algo != "ring":
            continue
        torch_ms, butterfly_ms = by_key.get((workers, n, "torch")), by_key.get((workers, n, "butterfly"))
        out.append({"workers": workers, "elements": n,
                    "ring_over_torch": ring_ms / torch_ms if torch_ms else None,
                    "ring_over_butterfly": ring_ms / butterfly_ms if butterfly_ms else None})
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    json_path = args.json or os.path.join("results", f"allreduce-{utils.machine_tag()}.json")
    configs = [(w, n, a) for w in args.workers for n in args.sizes for a in args.algos
               if not (a == "torch" and w > args.torch_max_workers)]
    progress = None
    if sys.stderr.isatty():
        from tqdm import tqdm
        progress = tqdm(total=len(configs), file=sys.stderr, desc="all-reduce", leave=False)

    header = f"{'workers':>7} {'elements':>9} {'algo':>9} {'median ms':>10} {'iters':>5} " \
             f"{'extra KiB':>9} {'max abs err':>11} {'identical':>9}"
    rows, started, load_before = [], time.perf_counter(), os.getloadavg()
    print(header, flush=True)
    for workers in args.workers:
        mine = [c for c in configs if c[0] == workers]
        if not mine:
            continue
        with utils.LocalGroup(workers, timeout_s=args.timeout, start_timeout_s=args.timeout) as group:
            for _, n, algo in mine:
                row = group.run(bench_worker, algo, n, args.seed, args.budget_s, args.min_iters,
                                args.max_iters)[0]
                rows.append(row)
                line = (f"{workers:>7} {n:>9} {algo:>9} {row['median_ms']:>10.3f} {row['iters']:>5} "
                        f"{row['extra_peak_bytes'] / 1024:>9.1f} {row['max_abs_error']:>11.2e} "
                        f"{str(row['identical_across_ranks']):>9}")
                if progress is not None:
                    progress.write(line)
                    progress.update()
                else:
                    print(line, flush=True)
    if progress is not None:
        progress.close()

    ratios = _ratios(rows)
    if ratios:
        print("\nring / torch and ring / butterfly (median times; < 1 means the ring is faster)")
        for r in ratios:
            fmt = lambda v: f"{v:.2f}" if v is not None else "-"
            print(f"{r['workers']:>7} {r['elements']:>9}  ring/torch {fmt(r['ring_over_torch']):>6}  "
                  f"ring/butterfly {fmt(r['ring_over_butterfly']):>6}")
    payload = {
        "benchmark": "allreduce",
        "command": " ".join(["python", "allreduce.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "machine": utils.machine_info(),
        "settings": {"workers": args.workers, "sizes": args.sizes, "algos": args.algos, "dtype": "float32",
                     "torch_max_workers": args.torch_max_workers, "budget_s": args.budget_s,
                     "min_iters": args.min_iters, "max_iters": args.max_iters, "seed": args.seed},
        "method": {
            "time": "median over the timed calls of one rank's wall time per call (each call starts after a "
                    "barrier), the largest such median across ranks; iterations adaptive: 3 probe calls, then "
                    "budget_s / probe median, clamped to [min_iters, max_iters], so oversubscribed runs "
                    "(up to 32 processes on this machine's cores) finish in minutes",
            "extra_peak_bytes": "bytes of new tensor storage returned by torch functions and Tensor methods "
                                "during one call (a TorchFunctionMode), max over ranks; a sum of allocations, "
                                "so an upper bound on the peak; gloo's internal scratch in "
                                "torch.distributed.all_reduce is invisible to it, so the torch figure is a "
                                "lower bound",
            "max_abs_error": "max over ranks and elements of |result - float64 mean of all ranks' float32 inputs|",
            "torch": "torch.distributed.all_reduce(SUM) on gloo, then a division by the world size",
        },
        "wall_time_s": time.perf_counter() - started,
        # The machine may be shared: the 1/5/15-minute load averages say how busy it was around the run.
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "results": rows,
        "ratios": ratios,
    }
    utils.write_json(json_path, payload)
    print(f"\nwrote {json_path} ({payload['wall_time_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
