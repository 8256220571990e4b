"""Ring and butterfly all-reduce on point-to-point primitives, and their benchmark against torch.distributed.

Both functions AVERAGE a floating-point tensor in place over a process group (the default one, or ``group=``),
for any shape and any number of elements n (also n < p, the group's size, and n not divisible by p), and leave
bit-identical values on every rank: each piece of the result is summed and divided by p on exactly one rank
(its owner), and the other ranks only copy it. ``AllreduceThread`` runs them on a thread of its own over a
group of its own, for overlapping communication with computation (the trainer's --allreduce ring|butterfly).

Ring (reduce-scatter, then all-gather), pipelined
    The flat vector is cut into p chunks, chunk i holding floor(n/p) or ceil(n/p) elements (the first n mod p
    chunks get the extra one; with n < p some chunks are empty and are simply not sent), and every chunk into
    the same number K = ceil(ceil(n/p) / S) of near-equal segments of at most S = segment_elements elements.
    Rank r sends to r+1 and receives from r-1 (mod p).
    - reduce-scatter, steps s = 0 .. p-2: send chunk (r - s), receive chunk (r - s - 1) and add it to the
      local chunk. After p-1 steps chunk (r + 1) on rank r holds the sum over all ranks; rank r divides it by p.
    - all-gather, steps s = 0 .. p-2: send chunk (r + 1 - s), receive chunk (r - s) straight into place.
    Elements sent per rank 2n - |chunk r+1| - |chunk r+2| = 2n(p-1)/p when p divides n.
    Pipelining: a step works segment by segment, and segment k is forwarded to the next step as soon as it is
    reduced, so receiving segment k + 1 overlaps adding segment k and the next hop starts after one segment,
    not one chunk. Receives land in RECEIVE_SLOTS (2) buffers of one segment, used in turn: the receive of
    message m + 2 is posted when message m has been added. Extra memory is therefore at most 2 S elements
    (2 ceil(n/p) when a chunk is one segment), whatever n: 8 MiB of float32 at the default S = 2^20, where
    the unsegmented ring needed 2 ceil(n/p) (40 MB at n = 1e7, p = 2). Every receive is posted before its
    message can arrive: gloo moves a payload only once the receiver has posted its buffer, so a late receive
    costs a round trip of notices on the critical path (posting early halved the unsegmented ring's time at 8
    and 16 workers here). Each all-gather receive is posted as soon as the reduce-scatter has sent what was
    in that place, and before this rank's own all-gather send with the same tag: at p = 2 the first
    all-gather receive used to follow that send, so both ranks' first all-gather message waited for a
    round trip, and moving it ahead took the 2-worker ring from 1.27 / 2.16 ms to 0.58 / 0.75 ms at 1e4 / 1e5
    elements (``python allreduce.py --workers 2 --sizes 1e3,1e4,1e5,1e6``, before and after). Every message
    has its own tag, so receives posted early cannot match the wrong message.

    alpha-beta model, per message alpha, per element beta: every rank sends 2(p-1) chunks of n/p elements in
    sequence, and every link is busy at every step, so T = 2(p-1) alpha + 2n(p-1)/p beta: bandwidth-optimal,
    latency linear in p. Segments do not shorten that path: with K segments per chunk a rank sends 2(p-1)K
    messages, T = 2(p-1) K alpha + 2n(p-1)/p beta (``predicted_ms``). What they buy lies outside alpha and beta:
    the extra memory is fixed, and the adds (gamma per element) of segment k overlap the arrival of segment
    k + 1, so only one segment's add per step stays on the critical path instead of a whole chunk's:
    T ~ 2(p-1) K alpha + 2n(p-1)/p beta + (p-1) n gamma / (p K). Minimal at K* = sqrt(n gamma / (2 p alpha)),
    i.e. a segment S* = n/(pK*) = sqrt(2 n alpha / (p gamma)): shorter segments pay alpha too often, longer ones
    leave the adds unoverlapped. The benchmark's ping-pong (ranks 0 and 1, least one-way time over lengths
    1 .. 4e6) fitted alpha = 57 / 68 / 139 us and beta = 1.01 / 1.19 / 0.81 ns per float32 element with
    2 / 4 / 8 workers (results/allreduce-cpu-2core-gradients.json); gamma is not measured, but an in-place add
    moves about as many bytes per element as a receive, so with gamma ~ beta: S* ~ 1.2e6 / 8.5e5 / 1.0e6
    (p = 2 / 4 / 8) at n = 2.5e7, 2.4e5 / 1.7e5 / 2.1e5 at n = 1e6. S* grows as sqrt(n) while the memory budget
    needs a fixed S. Measured with ``python allreduce.py --segment-sweep 262144,1048576,4194304`` (ring at
    n = 2.5e7, S = 2^18 / 2^20 / 2^22, median ms): 2 workers 89.3 / 84.4 / 93.0, 4 workers 212.3 / 188.9 /
    185.9, 8 workers 498.7 / 469.8 / 486.9 (an earlier sweep, 2^16 / 2^18 / 2^20: 2 workers 172 / 117 / 111,
    4 workers 576 / 292 / 226, 8 workers 1116 / 501 / 495). Short segments lose: every message costs CPU
    time on both ends (see "Where the time goes"), and on 2 cores that is paid in full; 2^20 is the fastest or
    within 2% of it at every worker count, as the model's S* ~ 1e6 at gradient lengths says. At 1e6 elements
    a chunk then fits one segment (S* ~ 2e5 there), but the benchmark shows no loss: the ring / torch ratio
    at 1e6 was 1.36 / 1.31 with 2^18 and 1.33 / 1.23 with 2^20 (2 / 4 workers, ``--segment`` on each side).
    So S = 2^20 = 1,048,576: a fixed budget of 8 MiB (float32), which does not grow with n.

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
    volume as the ring). T_butterfly = 2 log2(p) alpha + 2 n (p-1)/p beta: fewer, larger messages.
    Non-power-of-two p: let q = 2^floor(log2 p) and e = p - q. Fold: each extra rank q + j (j < e) sends its
    whole vector to rank j, which adds it in; the q core ranks run the butterfly; unfold: rank j sends the
    final vector back to rank q + j. Two more steps and n more elements each way on the paired ranks:
    T = (2 log2 q + 2) alpha + (2n(q-1)/q + 2n) beta on the paired ranks.
    Halving and folding receive segment by segment through the same 2 slots of min(S, ceil(n/2)) elements
    (one slot of ceil(n/2) when half the vector fits in a segment), adding one while the next arrives: extra
    memory at most 2 S, as the ring. The doubling receives land in place and are all posted up front.

Ring against butterfly: both send the same volume, 2n(p-1)/p per rank, but the ring needs 2(p-1) messages in
sequence and the butterfly 2 log2 p, so for a power-of-two p in the alpha-beta model the ring is never faster:
T_ring - T_butterfly = 2(p - 1 - log2 p) alpha >= 0. The ring's advantages lie elsewhere: only neighbour links
(no contention on a real network), any p without folding, and every step's adds overlapped in segments.

Extra memory is what the algorithm allocates: the receive slots, allocated once per call, and in-place adds
into views of the input (no .contiguous() copies). A non-contiguous input is averaged in a contiguous copy and
copied back (n more elements).

Where the time goes on this machine (2 vCPUs, loopback TCP, gloo): the benchmark reads every thread's scheduler
accounting (Linux schedstat) around its timed calls and reports, per call, the CPU time of the calling thread,
the time that thread was ready to run but waited for a CPU, and the CPU time of the process's other threads
(gloo's I/O and work threads). At 1e4 elements and 2 workers (results/allreduce-cpu-2core-gradients.json, the
barrier before each call included) the ring takes 364 / 957 / 1072 us of those, gloo's all_reduce 164 / 85 /
330 us. The ring sends fewer messages than gloo's own ring (2 per rank; gloo cuts the vector into 2p
segments, 4 per rank), yet costs three times the CPU: every message is a hand-off between our Python thread and
gloo's I/O thread (a post, a sleep in wait(), a wake-up), and the Python code that runs after each wake-up meets
cold caches. Two processes then ask for more CPU time than 2 CPUs have while a call lasts, ready threads queue,
and one that finds no free CPU runs when the scheduler next looks, at the latest at its tick (250 Hz here:
4 ms). That is the 2-process bimodality: ring at 1e4 and 2 workers p10 / p90 0.40 / 4.0 ms against gloo's
0.32 / 0.51 ms. gloo runs the whole collective in C++ inside its own threads, cheaply enough that the CPUs
rarely run out. What beat part of it is fewer and earlier hand-offs: the all-gather receive posted before its
send (above) and segments of 2^20 instead of 2^18 took the 2-worker ring at 1e5 elements from a median of 1.88
to 0.82 ms and a p90 of 6.5 to 4.0 ms, and at 1e3 from 1.09 to 0.61 ms (p90 5.1 to 2.7 ms) (this JSON against
its previous version, both on a quiet machine). What stays is the hand-off itself: a gloo point-to-point
receive cannot be polled (its Work.is_completed() is False until wait() is called), so every receive sleeps and
wakes. From 4 workers on the 2 CPUs are oversubscribed and every algorithm is CPU-bound: at 8 workers and
2.5e7 elements the ring's threads use 48 + 68 = 116 ms of CPU per call and rank, gloo's 11 + 89 = 99 ms, and
8 ranks x that / 2 CPUs is close to the measured medians (484 and 381 ms). Pinning makes it worse, as the
hand-offs predict (a process's Python thread and gloo's I/O thread then share one CPU): ring at 1e3 and 2
workers, median 0.66 ms unpinned, 2.98 ms with one CPU per worker (``--cpus 0,1``), 7.35 ms with both on CPU 0
(``--cpus 0``), gloo's 0.31-0.46 ms throughout (results/allreduce-cpu-2core-unpinned.json, -cpu-per-worker.json,
-one-cpu.json). The model, fitted to the fastest ping-pong, describes the fast mode only.

Benchmark: ``python allreduce.py`` (default: 2, 4, 8 workers x 1e3 .. 1e7 and 2.5e7 float32 x ring, butterfly,
torch) starts one utils.LocalGroup (gloo over a FileStore) per worker count, reused for every size, and first
fits alpha and beta to a ping-pong between ranks 0 and 1. For each (workers, size) every algorithm's accuracy
(max error against the float64 mean of the inputs), bit-identity across ranks and extra memory (bytes of new
tensor storage made by torch calls during one call, tracked with a TorchFunctionMode; see
``tracked_allocation_bytes``) are taken first; then the timed calls (each after a barrier; adaptive count from
3 probe calls and --budget-s) are spread over --rounds rounds in alternating algorithm order, and the slowest
rank's median counts. The table prints the model's prediction (``predicted_ms``) beside each measured median.
torch.distributed.all_reduce (gloo, SUM then a division, since gloo has no AVG) runs up to --torch-max-workers.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import utils


# ----------------------------------------------------------------------------------------------------------
# The algorithms
# ----------------------------------------------------------------------------------------------------------
SEGMENT_ELEMENTS = 1 << 20  # the pipeline's unit, 4 MiB of float32: chosen by measurement (module docstring)
RECEIVE_SLOTS = 2  # receive buffers of one segment each: segment k + 1 lands while segment k is added


def _post_recv(into: torch.Tensor, src: int, tag: int, group):
    """irecv, or None for an empty piece (both ends know every piece's length and skip the same messages)."""
    return dist.irecv(into, group=group, group_src=src, tag=tag) if into.numel() else None


def _post_send(outgoing: torch.Tensor, dst: int, tag: int, group):
    return dist.isend(outgoing, group=group, group_dst=dst, tag=tag) if outgoing.numel() else None


def _wait(request) -> None:
    # Call once per request: a second wait on a finished gloo receive blocks for a message that never comes.
    if request is not None:
        request.wait()


def _split_bounds(length: int, pieces: int) -> list[int]:
    """Boundaries of ``pieces`` consecutive parts of ``length`` elements; the first length % pieces get one more."""
    base, extra = divmod(length, pieces)
    return [i * base + min(i, extra) for i in range(pieces + 1)]


def _segments(region: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    bounds = _split_bounds(region.numel(), pieces)
    return [region[a:b] for a, b in zip(bounds, bounds[1:])]


def _cut(region: torch.Tensor, width: int) -> list[torch.Tensor]:
    """``region`` in the fewest near-equal segments of at most ``width`` elements (one if it is empty)."""
    return _segments(region, max(1, -(-region.numel() // width)))


def _check_args(send: torch.Tensor, rank: int, size: int, group, segment_elements: int, name: str) -> None:
    if not isinstance(send, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(send).__name__}")
    if not send.is_floating_point():
        raise TypeError(f"{name}: averaging needs a floating-point tensor, got dtype {send.dtype}")
    if not dist.is_initialized():
        raise RuntimeError(f"{name}: the default process group is not initialized")
    if size != dist.get_world_size(group) or rank != dist.get_rank(group):
        which = "the default group" if group is None else "the given group"
        raise ValueError(f"{name}: rank={rank}, size={size} do not match {which} "
                         f"(rank {dist.get_rank(group)} of {dist.get_world_size(group)})")
    if segment_elements < 1:
        raise ValueError(f"{name}: segment_elements must be positive, got {segment_elements}")


def _in_place_on_contiguous(algorithm, send: torch.Tensor, *args) -> torch.Tensor:
    # view(-1) needs contiguous memory; anything else is averaged in a contiguous copy and written back.
    if send.is_contiguous():
        algorithm(send.view(-1), *args)
    else:
        work = send.contiguous()
        algorithm(work.view(-1), *args)
        send.copy_(work)
    return send


def _ring(flat: torch.Tensor, rank: int, size: int, group, segment: int) -> None:
    n = flat.numel()
    if size == 1 or n == 0:
        return
    bounds = _split_bounds(n, size)
    largest = bounds[1] - bounds[0]  # ceil(n / p)
    pieces = -(-largest // segment)  # segments per chunk, the same for every chunk
    segs = [_segments(flat[bounds[c]:bounds[c + 1]], pieces) for c in range(size)]
    steps = size - 1
    messages = steps * pieces  # per phase; message i = (step, segment) = divmod(i, pieces); its tag is i
    slots = torch.empty(min(RECEIVE_SLOTS, messages), -(-largest // pieces), dtype=flat.dtype, device=flat.device)
    right, left = (rank + 1) % size, (rank - 1) % size

    def reduce_target(i: int) -> torch.Tensor:  # reduce-scatter step s receives chunk rank - s - 1
        step, k = divmod(i, pieces)
        return segs[(rank - step - 1) % size][k]

    def post_reduce_recv(i: int):
        if i >= messages:
            return None
        return _post_recv(slots[i % len(slots), :reduce_target(i).numel()], left, i, group)

    # Receives are posted before their message can arrive (gloo moves a payload only into a posted buffer).
    reduce_recvs = {i: post_reduce_recv(i) for i in range(len(slots))}
    reduce_sends = {k: _post_send(segs[rank][k], right, k, group) for k in range(pieces)}  # step 0: own data
    gather_recvs, gather_sends = {}, []
    for i in range(messages):
        step, k = divmod(i, pieces)
        target = reduce_target(i)
        _wait(reduce_recvs.pop(i))
        # What this rank sent at this step (chunk rank - step) is final for the reduce-scatter: once the send is
        # done, the all-gather receive for that segment (at step `step`) can be posted into place, early.
        _wait(reduce_sends.pop(i))
        gather_recvs[i] = _post_recv(segs[(rank - step) % size][k], left, messages + i, group)
        target.add_(slots[i % len(slots), :target.numel()])
        reduce_recvs[i + len(slots)] = post_reduce_recv(i + len(slots))  # the slot is free again
        if step < steps - 1:  # forward the partial sum at once: the pipeline
            reduce_sends[i + pieces] = _post_send(target, right, i + pieces, group)
        else:  # chunk rank + 1 is complete here: its owner divides, and starts the all-gather with it
            target.div_(size)
            gather_sends.append(_post_send(target, right, messages + k, group))
    for i in range(messages):  # all-gather step t receives chunk rank - t and forwards it at step t + 1
        step, k = divmod(i, pieces)
        _wait(gather_recvs.pop(i))
        if step < steps - 1:
            gather_sends.append(_post_send(segs[(rank - step) % size][k], right, messages + i + pieces, group))
    for request in gather_sends:
        _wait(request)


def ring_allreduce(send: torch.Tensor, rank: int, size: int, group: dist.ProcessGroup | None = None,
                   segment_elements: int = SEGMENT_ELEMENTS) -> torch.Tensor:
    """Average ``send`` in place with a pipelined ring reduce-scatter + all-gather.

    ``rank`` and ``size`` are this process's rank in ``group`` (default: the default group) and the group's size.
    Point-to-point messages only (dist.isend/irecv) of at most ``segment_elements`` elements; extra memory
    at most RECEIVE_SLOTS segments. See the module docstring for the steps and costs. Returns ``send``.
    """
    _check_args(send, rank, size, group, segment_elements, "ring_allreduce")
    return _in_place_on_contiguous(_ring, send, rank, size, group, segment_elements)


def _receive_and_add(target: torch.Tensor, src: int, slots: torch.Tensor, tag: int, group,
                     outgoing: torch.Tensor | None = None, dst: int = -1) -> None:
    """Add the message from ``src`` into ``target`` one segment (a row of ``slots``) at a time, receiving the
    next segments while adding this one; meanwhile send ``outgoing`` to ``dst`` segmented the same way (the
    peer receives it as its ``target``). Segment k has tag ``tag + k``."""
    incoming = _cut(target, slots.shape[1])

    def post(k: int):  # segment k lands in slot k mod the number of slots
        return _post_recv(slots[k % len(slots), :incoming[k].numel()], src, tag + k, group)

    recvs = {k: post(k) for k in range(min(len(slots), len(incoming)))}
    sends = []
    if outgoing is not None:
        sends = [_post_send(piece, dst, tag + k, group) for k, piece in enumerate(_cut(outgoing, slots.shape[1]))]
    for k, piece in enumerate(incoming):
        _wait(recvs.pop(k))
        piece.add_(slots[k % len(slots), :piece.numel()])
        if k + len(slots) < len(incoming):
            recvs[k + len(slots)] = post(k + len(slots))  # the slot just added from is free again
    for request in sends:
        _wait(request)


def _butterfly(flat: torch.Tensor, rank: int, size: int, group, segment: int) -> None:
    n = flat.numel()
    if size == 1 or n == 0:
        return
    core = 1 << (size.bit_length() - 1)  # largest power of two <= size
    steps = core.bit_length() - 1  # log2(core)
    half = (n + 1) // 2
    width = min(segment, half)  # no message is longer than this, so every segment fits a slot
    stride = -(-n // width)  # tags: each exchange gets `stride` of them (enough for its segments)
    fold_tag, unfold_tag = 2 * steps * stride, (2 * steps + 1) * stride
    if rank >= core:  # fold into rank - core, wait for the result, done
        for k, piece in enumerate(_cut(flat, width)):
            _wait(_post_send(piece, rank - core, fold_tag + k, group))
        _wait(_post_recv(flat, rank - core, unfold_tag, group))
        return
    slots = torch.empty(1 if width == half else RECEIVE_SLOTS, width, dtype=flat.dtype, device=flat.device)
    partner_extra = rank + core if rank + core < size else None
    if partner_extra is not None:
        _receive_and_add(flat, partner_extra, slots, fold_tag, group)

    lo, hi = 0, n
    segments = []  # (parent segment, sibling segment) per halving step
    for step in range(steps):
        distance = core >> (step + 1)
        partner = rank ^ distance
        mid = lo + (hi - lo) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & distance else ((lo, mid), (mid, hi))
        segments.append(((lo, hi), give))
        _receive_and_add(flat[keep[0]:keep[1]], partner, slots, step * stride, group,
                         outgoing=flat[give[0]:give[1]], dst=partner)
        lo, hi = keep
    flat[lo:hi].div_(size)

    # Recursive doubling retraces the halving: at each step the partner sends back the sibling segment this
    # rank gave away. Those regions are final for the halving, so every receive is posted up front, in place.
    segments.reverse()
    recvs = [_post_recv(flat[give[0]:give[1]], rank ^ (1 << step), (steps + step) * stride, group)
             for step, (_, give) in enumerate(segments)]
    sends = []
    for step, (parent, _) in enumerate(segments):
        if step > 0:
            _wait(recvs[step - 1])
        sends.append(_post_send(flat[lo:hi], rank ^ (1 << step), (steps + step) * stride, group))
        lo, hi = parent
    for request in recvs[-1:] + sends:  # the other receives were waited for already (gloo: wait once only)
        _wait(request)

    if partner_extra is not None:
        _wait(_post_send(flat, partner_extra, unfold_tag, group))


def butterfly_allreduce(send: torch.Tensor, rank: int, size: int, group: dist.ProcessGroup | None = None,
                        segment_elements: int = SEGMENT_ELEMENTS) -> torch.Tensor:
    """Average ``send`` in place with recursive halving + doubling (a butterfly), over ``group`` (default: the
    default group; ``rank`` and ``size`` are this process's rank in it and its size).

    Non-power-of-two sizes fold the extra ranks into the power-of-two core first and unfold at the end; the
    halving and folding receive through RECEIVE_SLOTS segments of at most ``segment_elements`` (one of ceil(n/2)
    when n/2 fits in a segment). See the module docstring. Returns ``send``.
    """
    _check_args(send, rank, size, group, segment_elements, "butterfly_allreduce")
    return _in_place_on_contiguous(_butterfly, send, rank, size, group, segment_elements)


def torch_allreduce(send: torch.Tensor, rank: int, size: int, group: dist.ProcessGroup | None = None,
                    segment_elements: int = SEGMENT_ELEMENTS) -> torch.Tensor:
    """The baseline: torch.distributed.all_reduce (SUM; gloo has no AVG) and a division, in place.
    (``segment_elements`` is ignored: gloo segments on its own.)"""
    dist.all_reduce(send, group=group)
    return send.div_(size)


ALGORITHMS = {"ring": ring_allreduce, "butterfly": butterfly_allreduce, "torch": torch_allreduce}


class AllreduceThread:
    """Averages tensors with one of ALGORITHMS on a background thread, over a process group of its own.

    ``submit(tensor)`` queues an in-place average and returns a concurrent.futures.Future (``.result()`` waits
    and re-raises the thread's exception; once it returns, ``tensor`` holds the average for any stream). Jobs
    run one at a time in submission order, so every rank that submits the same sequence runs the same sequence
    of messages. The group is made here with dist.new_group, which every rank of the default group must call at
    the same point: the thread's messages then cannot mix with collectives the caller's thread issues on the
    default group meanwhile (gloo requires one order of operations per group, and ours is on another thread).
    ``close()`` stops the thread and destroys the group.

    CUDA tensors: ``submit`` records an event on the caller's stream (the kernels that wrote the tensor), and the
    thread works on a CUDA stream of its own that waits for it, so the caller's stream runs on meanwhile. gloo's
    point-to-point calls take host memory only (a CUDA pointer makes gloo's I/O thread abort the process), so
    over gloo the tensor travels through a pinned host buffer: a non-blocking copy to the host, a wait for it on
    this thread only, the algorithm on the host copy, a non-blocking copy back. Over nccl the algorithm runs on
    the CUDA tensor itself, its messages ordered after the thread's stream.
    """

    def __init__(self, algorithm: str, timeout_s: float | None = None, segment_elements: int | None = None):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce {algorithm!r}: choose from {', '.join(ALGORITHMS)}")
        self._algorithm = ALGORITHMS[algorithm]
        self._segment = segment_elements or SEGMENT_ELEMENTS
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend=dist.get_backend(), timeout=timeout)
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"allreduce-{algorithm}")
        self._host_only = dist.get_backend(self.group) == "gloo"
        self._stream: Any = None  # the thread's CUDA stream, made with the first CUDA tensor
        self._pinned: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def submit(self, tensor: torch.Tensor) -> Future:
        if tensor.device.type != "cuda":
            return self._executor.submit(self._algorithm, tensor, self.rank, self.size, self.group, self._segment)
        written = torch.cuda.Event()
        written.record()  # on the caller's current stream, after the kernels that wrote ``tensor``
        return self._executor.submit(self._average_cuda, tensor, written)

    def _average_cuda(self, tensor: torch.Tensor, written: Any) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        stream = self._stream
        with torch.cuda.stream(stream):
            stream.wait_event(written)
            if self._host_only:
                host = self._pinned_like(tensor)
                host.copy_(tensor, non_blocking=True)
                stream.synchronize()  # the host copy has landed (this thread waits, nothing else does)
                self._algorithm(host, self.rank, self.size, self.group, self._segment)
                tensor.copy_(host, non_blocking=True)
            else:
                self._algorithm(tensor, self.rank, self.size, self.group, self._segment)
        # The result is in ``tensor`` before result() returns. It also keeps a pinned buffer from being refilled
        # by the next job while its copy back may still be reading it.
        stream.synchronize()

    def _pinned_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pinned host buffer of ``tensor``'s shape and dtype, made once and reused (jobs run one at a time)."""
        key = (tensor.dtype, tuple(tensor.shape))
        if key not in self._pinned:
            self._pinned[key] = torch.empty(tensor.shape, dtype=tensor.dtype).pin_memory()
        return self._pinned[key]

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


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


def benchmark_inputs(rank: int, size: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s float32 input, and the float64 mean of all ranks' inputs (each rank rebuilds it)."""
    def make(r: int) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(seed * 100_003 + r))

    total = torch.zeros(n, dtype=torch.float64)
    for r in range(size):
        total += make(r)  # float32 into float64: exact
    return make(rank), total.div_(size)


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
                     "one_way_ms_median": utils.median(times[1:])})
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


def predicted_ms(algo: str, p: int, n: int, model: dict, segment: int) -> float:
    """The alpha-beta model of the module docstring for one call (the adds are not modelled)."""
    alpha, beta = model["alpha_ms"], model["beta_ms_per_element"]
    if p == 1:
        return 0.0
    if algo == "butterfly":
        q = 1 << (p.bit_length() - 1)
        extra = 0 if q == p else 2 * alpha + 2 * n * beta
        return 2 * math.log2(q) * alpha + 2 * n * (q - 1) / q * beta + extra
    # Every rank sends 2(p - 1) chunks of n/p elements in sequence, K segments each; gloo's ring (torch) is
    # modelled unsegmented, K = 1. Segments add messages; what they save (the adds overlapped) is not alpha-beta.
    pieces = -(-math.ceil(n / p) // segment) if algo == "ring" else 1
    return 2 * (p - 1) * pieces * alpha + 2 * (p - 1) * n / p * beta


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
                 max_iters: int, rounds: int, segment: int, cpus: list[int] | None = None) -> list[dict]:
    with pinned(rank, cpus):
        return _bench(rank, size, n, algos, seed, budget_s, min_iters, max_iters, rounds, segment)


def _bench(rank: int, size: int, n: int, algos: list[str], seed: int, budget_s: float, min_iters: int,
           max_iters: int, rounds: int, segment: int) -> list[dict]:
    """Every algorithm at one (size, n) on every rank of a LocalGroup; rank 0's list is the result rows.

    Timed calls are spread over ``rounds`` rounds, the algorithms' order reversed every other round, so that a
    change in the machine's load falls on all of them alike; each row's median pools all its rounds."""
    data, reference = benchmark_inputs(rank, size, n, seed)
    rows = {}
    for algo in algos:
        allreduce = ALGORITHMS[algo]
        # Accuracy and identity on a fresh copy of the inputs, before the timing loop keeps averaging in place.
        result = allreduce(data.clone(), rank, size, segment_elements=segment)
        error = utils.max_across_ranks(float((result.double() - reference).abs().max()))
        rank0 = result.clone()
        dist.broadcast(rank0, 0)
        identical = utils.max_across_ranks(float(not torch.equal(rank0, result))) == 0.0
        work = data.clone()
        extra_bytes = utils.max_across_ranks(tracked_allocation_bytes(
            lambda: allreduce(work, rank, size, segment_elements=segment)))
        probe = utils.time_calls_ms(lambda: allreduce(work, rank, size, segment_elements=segment),
                                    torch.device("cpu"), iters=3, warmup=1)
        probe_ms = utils.max_across_ranks(utils.median(probe))
        iters = int(min(max_iters, max(min_iters, budget_s * 1e3 / max(probe_ms, 1e-3))))
        rows[algo] = {"workers": size, "elements": n, "algo": algo, "iters": -(-iters // rounds) * rounds,
                      "extra_peak_bytes": int(extra_bytes), "max_abs_error": error,
                      "identical_across_ranks": identical, "times": []}
        del result, rank0, work
    work = data.clone()
    caller = threading.get_native_id()
    threads_us = {algo: [0.0, 0.0, 0.0] for algo in algos}
    for round_index in range(rounds):
        for algo in (algos if round_index % 2 == 0 else algos[::-1]):
            allreduce = ALGORITHMS[algo]
            before = thread_schedstat_ns()
            rows[algo]["times"] += utils.time_calls_ms(
                lambda: allreduce(work, rank, size, segment_elements=segment), torch.device("cpu"),
                iters=rows[algo]["iters"] // rounds, warmup=1)
            deltas = _thread_deltas_us(before, thread_schedstat_ns(), caller)
            threads_us[algo] = [a + b for a, b in zip(threads_us[algo], deltas)]
    out = []
    for algo in algos:
        row = rows[algo]
        times = row.pop("times")
        calls = len(times) + rounds  # each round's warm-up call falls inside the accounting too
        row["caller_cpu_us"], row["caller_runqueue_us"], row["other_threads_cpu_us"] = (
            utils.max_across_ranks(v / calls) for v in threads_us[algo])
        row["median_ms"] = utils.max_across_ranks(utils.median(times))
        row["min_ms"] = utils.max_across_ranks(min(times))
        # The spread shows two-mode timings (calls whose wake-ups waited for a busy CPU, and calls that did not).
        row["p10_ms"] = utils.max_across_ranks(utils.percentile(times, 10))
        row["p90_ms"] = utils.max_across_ranks(utils.percentile(times, 90))
        out.append(row)
    return out


def segment_sweep_worker(rank: int, size: int, n: int, segments: list[int], rounds: int, iters: int) -> list[dict]:
    """The ring's median time at length n for each segment size, alternating rounds as in bench_worker."""
    work = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    times: dict[int, list[float]] = {s: [] for s in segments}
    for round_index in range(rounds):
        for segment in (segments if round_index % 2 == 0 else segments[::-1]):
            times[segment] += utils.time_calls_ms(lambda: ring_allreduce(work, rank, size, segment_elements=segment),
                                                  torch.device("cpu"), iters=iters, warmup=1)
    return [{"workers": size, "elements": n, "segment_elements": s,
             "median_ms": utils.max_across_ranks(utils.median(times[s]))} for s in segments]


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
    parser.add_argument("--workers", type=_int_list, default=[2, 4, 8],
                        help="comma-separated world sizes (default 2,4,8)")
    parser.add_argument("--sizes", type=_int_list, default=[1000, 10000, 100000, 1000000, 10000000, 25000000],
                        help="comma-separated vector lengths in float32 elements, 1e6 notation allowed "
                             "(default 1e3,1e4,1e5,1e6,1e7,2.5e7)")
    parser.add_argument("--algos", type=_algo_list, default=list(ALGORITHMS),
                        help="comma-separated subset of ring,butterfly,torch (default all)")
    parser.add_argument("--torch-max-workers", type=int, default=16,
                        help="run torch.distributed.all_reduce only up to this many workers (default 16)")
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
                        help=f"results file (default results/allreduce-{utils.machine_tag()}.json)")
    args = parser.parse_args(argv)
    if args.budget_s <= 0 or args.min_iters < 1 or args.max_iters < args.min_iters or args.rounds < 1:
        parser.error("need --budget-s > 0, 1 <= --min-iters <= --max-iters and --rounds >= 1")
    if args.segment < 1:
        parser.error("--segment must be positive")
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
    progress = None
    if sys.stderr.isatty():
        from tqdm import tqdm
        progress = tqdm(total=len(args.workers) * len(args.sizes), file=sys.stderr, desc="all-reduce", leave=False)
    say = progress.write if progress is not None else partial(print, flush=True)

    header = f"{'workers':>7} {'elements':>9} {'algo':>9} {'median ms':>10} {'model ms':>9} {'iters':>5} " \
             f"{'extra KiB':>9} {'max abs err':>11} {'identical':>9}"
    rows, models, sweep, started, load_before = [], {}, [], time.perf_counter(), os.getloadavg()
    print(header, flush=True)
    for workers in args.workers:
        algos = [a for a in args.algos if not (a == "torch" and workers > args.torch_max_workers)]
        with utils.LocalGroup(workers, timeout_s=args.timeout, start_timeout_s=args.timeout) as group:
            if workers > 1:
                # Lengths up to the largest benchmarked (at least two points for the fit).
                lengths = [1] + [m for m in PINGPONG_LENGTHS if m <= max(10_000, max(args.sizes))]
                points = group.run(pingpong_worker, lengths, 10)[0]
                models[workers] = fit_alpha_beta(points)
                m = models[workers]
                say(f"{workers:>7} ping-pong: alpha {m['alpha_ms'] * 1e3:.0f} us, "
                    f"beta {m['beta_ms_per_element'] * 1e6:.2f} ns/element"
                    + (f" ({m['beta_gb_per_s']:.2f} GB/s)" if m["beta_gb_per_s"] else ""))
            for n in args.sizes:
                for row in group.run(bench_worker, n, algos, args.seed, args.budget_s, args.min_iters,
                                     args.max_iters, args.rounds, args.segment, args.cpus)[0]:
                    row["predicted_ms"] = predicted_ms(row["algo"], workers, n, models[workers], args.segment) \
                        if workers > 1 else 0.0
                    rows.append(row)
                    say(f"{workers:>7} {n:>9} {row['algo']:>9} {row['median_ms']:>10.3f} {row['predicted_ms']:>9.3f} "
                        f"{row['iters']:>5} {row['extra_peak_bytes'] / 1024:>9.1f} {row['max_abs_error']:>11.2e} "
                        f"{str(row['identical_across_ranks']):>9}")
                if progress is not None:
                    progress.update()
            if args.segment_sweep and workers > 1:
                for row in group.run(segment_sweep_worker, max(args.sizes), args.segment_sweep, args.rounds, 2)[0]:
                    sweep.append(row)
                    say(f"{workers:>7} {row['elements']:>9} ring with segment {row['segment_elements']:>8}: "
                        f"{row['median_ms']:.1f} ms")
    if progress is not None:
        progress.close()

    ratios = _ratios(rows)
    if ratios:
        print("\nring / torch and ring / butterfly (median times; < 1 means the ring is faster)")
        for r in ratios:
            fmt = lambda v: f"{v:.2f}" if v is not None else "-"
            print(f"{r['workers']:>7} {r['elements']:>9}  ring/torch {fmt(r['ring_over_torch']):>6}  "
                  f"ring/butterfly {fmt(r['ring_over_butterfly']):>6}")
    if rows and any(r["caller_cpu_us"] for r in rows):
        print("\nper call, us (largest across ranks; the barrier before each call included): the calling thread's CPU "
              "time, its wait for a CPU while ready to run, and the CPU time of the process's other threads (gloo's)")
        for r in rows:
            print(f"{r['workers']:>7} {r['elements']:>9} {r['algo']:>9}  caller CPU {r['caller_cpu_us']:>8.0f}  "
                  f"waiting for a CPU {r['caller_runqueue_us']:>8.0f}  "
                  f"gloo threads CPU {r['other_threads_cpu_us']:>8.0f}")
    payload = {
        "benchmark": "allreduce",
        "command": " ".join(["python", "allreduce.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "machine": utils.machine_info(),
        "settings": {"workers": args.workers, "sizes": args.sizes, "algos": args.algos, "dtype": "float32",
                     "torch_max_workers": args.torch_max_workers, "budget_s": args.budget_s,
                     "min_iters": args.min_iters, "max_iters": args.max_iters, "rounds": args.rounds,
                     "segment_elements": args.segment, "receive_slots": RECEIVE_SLOTS, "cpus": args.cpus,
                     "seed": args.seed},
        "method": {
            "time": "median over the timed calls of one rank's wall time per call (each call starts after a "
                    "barrier), the largest such median across ranks; iterations adaptive: 3 probe calls, then "
                    "budget_s / probe median, clamped to [min_iters, max_iters], spread over `rounds` rounds in "
                    "alternating algorithm order",
            "p10_ms/p90_ms": "10th and 90th percentile of one rank's call times, the largest across ranks",
            "predicted_ms": "alpha-beta model (predicted_ms in allreduce.py) with alpha and beta fitted per "
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
            "torch": "torch.distributed.all_reduce(SUM) on gloo, then a division by the world size",
        },
        "wall_time_s": time.perf_counter() - started,
        # The machine may be shared: the 1/5/15-minute load averages say how busy it was around the run.
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "alpha_beta": {str(w): m for w, m in models.items()},
        "segment_sweep": sweep,
        "results": rows,
        "ratios": ratios,
    }
    utils.write_json(json_path, payload)
    print(f"\nwrote {json_path} ({payload['wall_time_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
