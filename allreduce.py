"""Ring and butterfly all-reduce, and the ring's two halves (reduce-scatter, all-gather), on point-to-point
primitives.

Both all-reduce functions AVERAGE a floating-point tensor in place over a process group (the default one, or
``group=``), for any shape and any number of elements n (also n < p, the group's size, and n not divisible by
p), and leave bit-identical values on every rank: each piece of the result is summed and divided by p on exactly
one rank (its owner), and the other ranks only copy it. The halves work on a flat vector of p equal chunks:
``ring_reduce_scatter`` leaves on rank r the SUM over ranks of chunk r, ``ring_all_gather`` gives every rank
every rank's own chunk (ZeRO's sharded optimizer is built on the pair: reduce-scatter the gradients, update one
shard, all-gather the parameters). ``pairwise_all_to_all`` sends each rank its own segment of a buffer (zero's
whole-matrix optimizers bring a matrix's pieces to the rank that orthogonalizes it, and the result back).
``AllreduceThread`` runs any of them on a thread of its own over a group of its own, for overlapping
communication with computation (the trainer's --allreduce ring|butterfly).
The benchmark against torch.distributed is ``benchmarks/allreduce_benchmark.py``; its figures are in docs/ and the
report.

Ring (reduce-scatter, then all-gather), pipelined
    The flat vector is cut into p chunks, chunk i holding floor(n/p) or ceil(n/p) elements (the first n mod p
    chunks get the extra one; with n < p some chunks are empty and are simply not sent), and every chunk into
    the same number K = ceil(ceil(n/p) / S) of near-equal segments of at most S = segment_elements elements.
    Rank r sends to r+1 and receives from r-1 (mod p). Rank r owns chunk o(r) = r + shift: the chunk it
    completes in the reduce-scatter and sends first in the all-gather.
    - reduce-scatter, steps s = 0 .. p-2: send chunk (o(r) - 1 - s), receive chunk (o(r) - 2 - s) and add it to
      the local chunk. Step 0 sends this rank's own data; every later step forwards the partial sum it has just
      made; after p-1 steps chunk o(r) holds the sum over all ranks.
    - all-gather, steps s = 0 .. p-2: send chunk (o(r) - s), receive chunk (o(r) - 1 - s) straight into place
      and forward it at the next step.
    ``ring_reduce_scatter`` and ``ring_all_gather`` run one phase each with shift 0 (rank r owns chunk r, as
    ZeRO needs); ``ring_allreduce`` runs both with shift 1 (the schedule it has always had: chunk r+1) and
    divides the owned chunk by p between them. Each phase sends p-1 chunks per rank (every chunk but o(r) in
    the reduce-scatter, every chunk but o(r) + 1 in the all-gather): each half sends (p-1)/p of the vector,
    half of an all-reduce's 2n(p-1)/p elements (p dividing n).
    Pipelining: a step works segment by segment, and segment k is forwarded to the next step as soon as it is
    reduced, so receiving segment k + 1 overlaps adding segment k and the next hop starts after one segment,
    not one chunk. Reduce-scatter receives land in RECEIVE_SLOTS (2) buffers of one segment, used in turn: the
    receive of message m + 2 is posted when message m has been added. Extra memory is therefore at most 2 S
    elements (2 ceil(n/p) when a chunk is one segment), whatever n: 8 MiB of float32 at the default S = 2^20.
    All-gather receives land in place and need none. Every receive is posted before its message can arrive:
    gloo moves a payload only once the receiver has posted its buffer, so a late receive costs a round trip of
    notices on the critical path. In the all-reduce each all-gather receive is posted as soon as the
    reduce-scatter has sent what was in that place, and so before this rank's own all-gather send with the same
    tag (posted after that send, the first all-gather message of both ranks at p = 2 waited for a round trip);
    the all-gather alone posts all its receives up front. Every message has its own tag, so receives posted
    early cannot match the wrong message.

    alpha-beta model, per message alpha, per element beta: every rank sends 2(p-1) chunks of n/p elements in
    sequence, and every link is busy at every step, so T = 2(p-1) alpha + 2n(p-1)/p beta: bandwidth-optimal,
    latency linear in p; each half costs half of it, (p-1) alpha + n(p-1)/p beta. Segments do not shorten that
    path: with K segments per chunk a rank sends 2(p-1)K messages, T = 2(p-1) K alpha + 2n(p-1)/p beta. What they
    buy lies outside alpha and beta: the extra memory is fixed, and the adds (gamma per element) of segment k
    overlap the arrival of segment k + 1, so only one segment's add per step stays on the critical path instead
    of a whole chunk's: T ~ 2(p-1) K alpha + 2n(p-1)/p beta + (p-1) n gamma / (p K). Minimal at
    K* = sqrt(n gamma / (2 p alpha)), i.e. a segment S* = n/(pK*) = sqrt(2 n alpha / (p gamma)): shorter
    segments pay alpha too often, longer ones leave the adds unoverlapped. S* grows as sqrt(n), while a fixed
    memory budget needs a fixed S; with alpha and beta fitted on the development machine and gamma ~ beta (an
    in-place add moves about as many bytes per element as a receive), S* is about 1e6 at gradient lengths
    (2.5e7). Measured, 2^20 was the fastest segment or within 2% of it at every worker count, and cost nothing
    at 1e6 elements, where a chunk fits one segment (the segment sweep in docs/benchmarks-and-results.md). Short
    segments lose for a reason outside the model: every message costs CPU time on both ends (below). So
    S = 2^20 = 1,048,576: a fixed budget of 8 MiB (float32), which does not grow with n.

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
(no contention on a real network), any p without folding, every step's adds overlapped in segments, and halves
that are useful on their own.

Extra memory is what the algorithm allocates: the receive slots, allocated once per call, and in-place adds
into views of the input (no .contiguous() copies). A non-contiguous input to the all-reduce is averaged in a
contiguous copy and copied back (n more elements); the halves take only 1-D contiguous vectors, since their
result is a view of the input.

Where the time goes beyond the model (measured by the benchmark's per-thread CPU accounting; figures in
docs/benchmarks-and-results.md): every message is a hand-off between our Python thread and gloo's I/O thread (a
post, a sleep in wait(), a wake-up), which costs CPU time on both sides, while gloo's own collectives run whole in
C++ inside its threads. A gloo point-to-point receive cannot be polled (its Work.is_completed() is False until wait() is
called), so every receive sleeps and wakes. On a machine with fewer cores than those threads, ready threads
queue for a CPU, and a thread that finds none runs at the scheduler's next look: the two-mode call times of
small vectors. Hence the design's bias towards fewer and earlier hand-offs: long segments, and receives posted
before their messages. The model, fitted to the fastest ping-pong, describes the fast mode only.

``python allreduce.py`` under torchrun (``torchrun --standalone --nproc_per_node 4 allreduce.py``) averages one
vector with each algorithm and says on rank 0 whether every rank agrees with the float64 mean.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from itertools import accumulate
from typing import Any, Callable

import torch
import torch.distributed as dist

import utils
from measure.summary import max_across_ranks


# ----------------------------------------------------------------------------------------------------------
# The algorithms
# ----------------------------------------------------------------------------------------------------------
SEGMENT_ELEMENTS = 1 << 20  # the pipeline's unit, 4 MiB of float32: chosen by measurement (module docstring)
RECEIVE_SLOTS = 2  # receive buffers of one segment each: segment k + 1 lands while segment k is added

_sent_bytes = 0  # payload bytes posted with isend by this process's algorithms (sent_bytes())
_sent_by_thread: dict[int, int] = {}  # the same, per posting thread (an AllreduceThread reads its own)
_sent_lock = threading.Lock()  # the algorithms may run on several threads (AllreduceThread) at once


def sent_bytes() -> int:
    """Payload bytes this process has posted with isend in this module's algorithms since import, on every thread
    (a running total: read it before and after a step for the step's bytes)."""
    return _sent_bytes


def _post_recv(into: torch.Tensor, src: int, tag: int, group):
    """irecv, or None for an empty piece (both ends know every piece's length and skip the same messages)."""
    return dist.irecv(into, group=group, group_src=src, tag=tag) if into.numel() else None


def _post_send(outgoing: torch.Tensor, dst: int, tag: int, group):
    global _sent_bytes
    if not outgoing.numel():
        return None
    request = dist.isend(outgoing, group=group, group_dst=dst, tag=tag)
    with _sent_lock:  # += on a global is not atomic across threads
        _sent_bytes += outgoing.numel() * outgoing.element_size()
        thread = threading.get_ident()
        _sent_by_thread[thread] = _sent_by_thread.get(thread, 0) + outgoing.numel() * outgoing.element_size()
    return request


def _wait(request) -> None:
    # Call once per request: a second wait on a finished gloo receive blocks for a message that never comes.
    if request is not None:
        request.wait()


def split_bounds(length: int, pieces: int) -> list[int]:
    """Boundaries of ``pieces`` consecutive parts of ``length`` elements; the first length % pieces get one more."""
    base, extra = divmod(length, pieces)
    return [i * base + min(i, extra) for i in range(pieces + 1)]


def _segments(region: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    bounds = split_bounds(region.numel(), pieces)
    return [region[a:b] for a, b in zip(bounds, bounds[1:])]


def _cut(region: torch.Tensor, width: int) -> list[torch.Tensor]:
    """``region`` in the fewest near-equal segments of at most ``width`` elements (one if it is empty)."""
    return _segments(region, max(1, -(-region.numel() // width)))


def place_in(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size: the default group (None), a group torch.distributed
    made, or a process group made directly over a store of its own (a ProcessGroupGloo: the replica groups' quorums,
    which torch.distributed's registry does not know; its point-to-point calls take ``group_dst``/``group_src``)."""
    if group is None:
        return dist.get_rank(), dist.get_world_size()
    return group.rank(), group.size()


def _check_args(send: torch.Tensor, rank: int, size: int, group, segment_elements: int, name: str) -> None:
    if not isinstance(send, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(send).__name__}")
    if not send.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {send.dtype}")
    if not dist.is_initialized():
        raise RuntimeError(f"{name}: the default process group is not initialized")
    if (rank, size) != place_in(group):
        which = "the default group" if group is None else "the given group"
        raise ValueError(f"{name}: rank={rank}, size={size} do not match {which} "
                         f"(rank {place_in(group)[0]} of {place_in(group)[1]})")
    if segment_elements < 1:
        raise ValueError(f"{name}: segment_elements must be positive, got {segment_elements}")


def _check_chunked(flat: torch.Tensor, rank: int, size: int, group, segment_elements: int, name: str) -> None:
    """The halves' input: a 1-D contiguous floating vector of ``size`` equal chunks (their results are views)."""
    _check_args(flat, rank, size, group, segment_elements, name)
    if flat.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(flat.shape)}")
    if not flat.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (its chunks are views of it)")
    if flat.numel() % size:
        raise ValueError(f"{name}: {flat.numel()} elements do not make {size} equal chunks (pad to a multiple of "
                         f"{size})")


def _in_place_on_contiguous(algorithm, send: torch.Tensor, *args) -> torch.Tensor:
    # view(-1) needs contiguous memory; anything else is averaged in a contiguous copy and written back.
    if send.is_contiguous():
        algorithm(send.view(-1), *args)
    else:
        work = send.contiguous()
        algorithm(work.view(-1), *args)
        send.copy_(work)
    return send


def _ring(flat: torch.Tensor, rank: int, size: int, group, segment: int, shift: int,
          reduce: bool, gather: bool, divide: bool = False) -> None:
    """The ring's phases on ``flat``'s p chunks (module docstring): rank r owns chunk (r + shift) mod p.

    reduce: the reduce-scatter, after which the owned chunk holds the sum (divided by p with ``divide``); gather:
    the all-gather of every rank's owned chunk. Both: the all-gather's receives are posted during the
    reduce-scatter, as soon as their place has been sent on, and its first sends start as each segment of the
    owned chunk is complete. Message i of a phase is (step, segment) = divmod(i, K); reduce-scatter tags are i,
    all-gather tags messages + i (messages = (p - 1) K per phase)."""
    n = flat.numel()
    if size == 1 or n == 0:
        return
    bounds = split_bounds(n, size)
    largest = bounds[1] - bounds[0]  # ceil(n / p)
    pieces = -(-largest // segment)  # segments per chunk, the same for every chunk
    segs = [_segments(flat[bounds[c]:bounds[c + 1]], pieces) for c in range(size)]
    steps = size - 1
    messages = steps * pieces  # per phase
    right, left = (rank + 1) % size, (rank - 1) % size
    owned = rank + shift  # reduce-scatter step s sends chunk owned - 1 - s; all-gather step s sends owned - s

    def piece(chunk: int, k: int) -> torch.Tensor:
        return segs[chunk % size][k]

    gather_recvs, gather_sends = {}, []
    if reduce:
        slots = torch.empty(min(RECEIVE_SLOTS, messages), -(-largest // pieces), dtype=flat.dtype,
                            device=flat.device)

        def reduce_target(i: int) -> torch.Tensor:  # reduce-scatter step s receives chunk owned - 2 - s
            step, k = divmod(i, pieces)
            return piece(owned - 2 - step, k)

        def post_reduce_recv(i: int):
            if i >= messages:
                return None
            return _post_recv(slots[i % len(slots), :reduce_target(i).numel()], left, i, group)

        # Receives are posted before their message can arrive (gloo moves a payload only into a posted buffer).
        reduce_recvs = {i: post_reduce_recv(i) for i in range(len(slots))}
        reduce_sends = {k: _post_send(piece(owned - 1, k), right, k, group) for k in range(pieces)}  # own data
        for i in range(messages):
            step, k = divmod(i, pieces)
            target = reduce_target(i)
            _wait(reduce_recvs.pop(i))
            # What this rank sent at this step (chunk owned - 1 - step) is final for the reduce-scatter: once the
            # send is done, the all-gather receive for that segment (at step `step`) can be posted into place.
            _wait(reduce_sends.pop(i))
            if gather:
                gather_recvs[i] = _post_recv(piece(owned - 1 - step, k), left, messages + i, group)
            target.add_(slots[i % len(slots), :target.numel()])
            reduce_recvs[i + len(slots)] = post_reduce_recv(i + len(slots))  # the slot is free again
            if step < steps - 1:  # forward the partial sum at once: the pipeline
                reduce_sends[i + pieces] = _post_send(target, right, i + pieces, group)
            else:  # the owned chunk is complete here: divide, and start the all-gather with it
                if divide:
                    target.div_(size)
                if gather:
                    gather_sends.append(_post_send(target, right, messages + k, group))
    elif gather:  # the all-gather alone: every receive lands in place, so all are posted up front
        gather_recvs = {i: _post_recv(piece(owned - 1 - i // pieces, i % pieces), left, messages + i, group)
                        for i in range(messages)}
        gather_sends = [_post_send(piece(owned, k), right, messages + k, group) for k in range(pieces)]
    if gather:
        for i in range(messages):  # all-gather step s receives chunk owned - 1 - s and forwards it at step s + 1
            step, k = divmod(i, pieces)
            _wait(gather_recvs.pop(i))
            if step < steps - 1:
                gather_sends.append(_post_send(piece(owned - 1 - step, k), right, messages + i + pieces, group))
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
    return _in_place_on_contiguous(_ring, send, rank, size, group, segment_elements, 1, True, True, True)


def ring_reduce_scatter(flat: torch.Tensor, rank: int, size: int, group: dist.ProcessGroup | None = None,
                        segment_elements: int = SEGMENT_ELEMENTS) -> torch.Tensor:
    """Sum chunk ``rank`` of ``flat`` over the group, in place, with the ring's pipelined reduce-scatter.

    ``flat``: 1-D, contiguous, floating, of ``size`` equal chunks (the caller pads it to a multiple of ``size``).
    On return chunk ``rank``, flat[rank * c:(rank + 1) * c], holds the sum over ranks of their chunk ``rank``;
    that view is returned. The OTHER CHUNKS OF ``flat`` ARE SCRATCH afterwards (partial sums). Sends p - 1
    chunks per rank, (p-1)/p of the vector; extra memory at most RECEIVE_SLOTS segments; point-to-point only.
    Bad input raises before any message is sent.
    """
    _check_chunked(flat, rank, size, group, segment_elements, "ring_reduce_scatter")
    _ring(flat, rank, size, group, segment_elements, 0, True, False)
    chunk = flat.numel() // size
    return flat[rank * chunk:(rank + 1) * chunk]


def ring_all_gather(flat: torch.Tensor, rank: int, size: int, group: dist.ProcessGroup | None = None,
                    segment_elements: int = SEGMENT_ELEMENTS) -> torch.Tensor:
    """Gather every rank's own chunk into ``flat`` in place, with the ring's pipelined all-gather.

    ``flat``: 1-D, contiguous, floating, of ``size`` equal chunks. On return chunk i of ``flat`` on every rank is
    rank i's chunk i, bit for bit (copies only); the rest of ``flat`` was overwritten. Returns ``flat``. Sends
    p - 1 chunks per rank, (p-1)/p of the vector; no extra memory (receives land in place); point-to-point only.
    Bad input raises before any message is sent.
    """
    _check_chunked(flat, rank, size, group, segment_elements, "ring_all_gather")
    _ring(flat, rank, size, group, segment_elements, 0, False, True)
    return flat


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


def pairwise_all_to_all(buffer: torch.Tensor, rank: int, size: int, group: dist.ProcessGroup | None = None,
                        segment_elements: int = SEGMENT_ELEMENTS, *, send_counts: list[int],
                        recv_counts: list[int]) -> torch.Tensor:
    """All-to-all on point-to-point messages, in place in one ``buffer``: its first sum(send_counts) elements are
    what this rank sends (send_counts[d] for rank d, in rank order), the next sum(recv_counts) what it receives
    (recv_counts[s] from rank s, in rank order); that tail is returned as a view. Every receive is posted first,
    then the sends, rank + 1 first (so no rank is every rank's first peer), then all are waited for; this rank's own
    segment is copied. Each message is one isend of its whole segment (the whole-matrix optimizers' pieces: small
    beside a bucket), empty ones are not sent. Sends what leaves this rank, sum(send_counts) - send_counts[rank]
    elements. (``segment_elements`` is ignored: the signature is AllreduceThread's.)"""
    sent, received = sum(send_counts), sum(recv_counts)
    if len(send_counts) != size or len(recv_counts) != size or buffer.numel() != sent + received:
        raise ValueError(f"pairwise_all_to_all: {size} send and receive counts and a buffer of their sum, not "
                         f"{send_counts}, {recv_counts} and {buffer.numel()} elements")
    outgoing, incoming = buffer[:sent], buffer[sent:]
    send_at = [0, *accumulate(send_counts)]
    recv_at = [0, *accumulate(recv_counts)]
    peers = [(rank + step) % size for step in range(1, size)]
    receives = [_post_recv(incoming[recv_at[s]:recv_at[s + 1]], s, 0, group) for s in peers]
    sends = [_post_send(outgoing[send_at[d]:send_at[d + 1]], d, 0, group) for d in peers]
    incoming[recv_at[rank]:recv_at[rank + 1]].copy_(outgoing[send_at[rank]:send_at[rank + 1]])
    for request in receives + sends:
        _wait(request)
    return incoming


def torch_allreduce(send: torch.Tensor, rank: int, size: int, group: dist.ProcessGroup | None = None,
                    segment_elements: int = SEGMENT_ELEMENTS) -> torch.Tensor:
    """The baseline: torch.distributed.all_reduce (SUM; gloo has no AVG) and a division, in place.
    (``segment_elements`` is ignored: gloo segments on its own.)"""
    dist.all_reduce(send, group=group)
    return send.div_(size)


ALGORITHMS = {"ring": ring_allreduce, "butterfly": butterfly_allreduce, "torch": torch_allreduce}
# What AllreduceThread.submit runs: fn(flat, rank, size, group, segment_elements), in place.
Operation = Callable[[torch.Tensor, int, int, Any, int], Any]


class AllreduceThread:
    """Averages tensors with one of ALGORITHMS on a background thread, over a process group of its own.

    ``submit(tensor)`` queues an in-place average and returns a concurrent.futures.Future (``.result()`` waits
    and re-raises the thread's exception; once it returns, ``tensor`` holds the average for any stream).
    ``submit(flat, operation=ring_reduce_scatter)`` (or ``ring_all_gather``, or any in-place
    ``fn(flat, rank, size, group, segment_elements)``) runs that instead, the same way. Jobs
    run one at a time in submission order, so every rank that submits the same sequence runs the same sequence
    of messages. The group is made here with dist.new_group, which every rank of the default group (of ``group``,
    when one is given) must call at the same point: the thread's messages then cannot mix with collectives the
    caller's thread issues on that group meanwhile (gloo requires one order of operations per group, and ours is
    on another thread).
    ``close()`` stops the thread and destroys the group.

    CUDA tensors: ``submit`` records an event on the caller's stream (the kernels that wrote the tensor), and the
    thread works on a CUDA stream of its own that waits for it, so the caller's stream runs on meanwhile. gloo's
    point-to-point calls take host memory only (a CUDA pointer makes gloo's I/O thread abort the process), so
    over gloo the tensor travels through a pinned host buffer: a non-blocking copy to the host, a wait for it on
    this thread only, the algorithm on the host copy, a non-blocking copy back. Over nccl the algorithm runs on
    the CUDA tensor itself, its messages ordered after the thread's stream.
    """

    def __init__(self, algorithm: str, timeout_s: float | None = None, segment_elements: int | None = None,
                 group: dist.ProcessGroup | None = None, own_group: dist.ProcessGroup | None = None):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce {algorithm!r}: choose from {', '.join(ALGORITHMS)}")
        self._algorithm = ALGORITHMS[algorithm]
        self._segment = segment_elements or SEGMENT_ELEMENTS
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        self._owns_group = own_group is None  # else made by the caller, over a store of its own (place_in)
        if own_group is not None:
            self.group = own_group
        elif group is None:
            self.group = dist.new_group(backend=dist.get_backend(), timeout=timeout)
        else:  # over the ranks of ``group`` alone: only they call this (a sub-group's replica trains on its own)
            self.group = dist.new_group(dist.get_process_group_ranks(group), backend=dist.get_backend(group),
                                        timeout=timeout, use_local_synchronization=True)
        self.rank, self.size = place_in(self.group)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"allreduce-{algorithm}")
        self._host_only = (own_group.name() if own_group is not None else dist.get_backend(self.group)) == "gloo"
        self._stream: Any = None  # the thread's CUDA stream, made with the first CUDA tensor
        self._pinned: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        # its worker thread's isend bytes so far: two threads in one process (a shard group's and a replicate
        # group's, under hybrid sharding) each count their own
        self._thread = self._executor.submit(threading.get_ident).result()
        self._sent_at_start = _sent_by_thread.get(self._thread, 0)

    def sent_bytes(self) -> int:
        """Payload bytes this thread's jobs have posted with isend since it was made."""
        return _sent_by_thread.get(self._thread, 0) - self._sent_at_start

    def submit(self, tensor: torch.Tensor, operation: Operation | None = None) -> Future:
        """Queue ``operation(tensor, rank, size, group, segment_elements)`` (default: this thread's all-reduce),
        in place on ``tensor``; the Future's result is the operation's (on a CUDA tensor: None)."""
        operation = operation or self._algorithm
        if tensor.device.type != "cuda":
            return self._executor.submit(operation, tensor, self.rank, self.size, self.group, self._segment)
        written = torch.cuda.Event()
        written.record()  # on the caller's current stream, after the kernels that wrote ``tensor``
        return self._executor.submit(self._run_cuda, operation, tensor, written)

    def _run_cuda(self, operation: Operation, tensor: torch.Tensor, written: Any) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        stream = self._stream
        with torch.cuda.stream(stream):
            stream.wait_event(written)
            if self._host_only:
                host = self._pinned_like(tensor)
                host.copy_(tensor, non_blocking=True)
                stream.synchronize()  # the host copy has landed (this thread waits, nothing else does)
                operation(host, self.rank, self.size, self.group, self._segment)
                tensor.copy_(host, non_blocking=True)
            else:
                operation(tensor, self.rank, self.size, self.group, self._segment)
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
        """Finish the queued jobs, stop the thread, destroy the group (the caller's own_group is the caller's to
        drop); a second call does nothing."""
        self._executor.shutdown(wait=True)
        group, self.group = self.group, None
        if group is not None and self._owns_group:
            dist.destroy_process_group(group)


# ----------------------------------------------------------------------------------------------------------
# A check under torchrun
# ----------------------------------------------------------------------------------------------------------
def _reduce_scatter_all_gather(flat: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The all-reduce from the halves, as ZeRO uses them: pad to p equal chunks, sum this rank's chunk, divide,
    gather."""
    padded = torch.zeros(-(-flat.numel() // size) * size, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    ring_reduce_scatter(padded, rank, size).div_(size)
    return ring_all_gather(padded, rank, size)[:flat.numel()]


def main() -> None:
    """Average one vector with each algorithm; rank 0 says whether every rank agrees with the float64 mean."""
    ctx = utils.init_distributed("cpu", "gloo")
    rank, size, n = ctx.rank, ctx.world_size, 1_000_003  # not divisible by 2, 3, 4, 5, 6, 7 or 8
    inputs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(size)]
    mean = torch.stack([x.double() for x in inputs]).mean(0)
    tolerance = 2 * (size + 1) * torch.finfo(torch.float32).eps * max(float(x.abs().max()) for x in inputs)
    runs = {"ring": lambda x: ring_allreduce(x, rank, size), "butterfly": lambda x: butterfly_allreduce(x, rank, size),
            "reduce-scatter + all-gather": lambda x: _reduce_scatter_all_gather(x, rank, size)}
    for name, run in runs.items():
        result = run(inputs[rank].clone())
        error = max_across_ranks(float((result.double() - mean).abs().max()))
        first = result.clone()
        dist.broadcast(first, 0)
        differ = max_across_ranks(float(not torch.equal(first, result)))
        utils.print0(f"{name:>28}: {size} ranks, {n} elements: max error vs the float64 mean {error:.1e} "
                     f"(tolerance {tolerance:.1e}), ranks bit-identical: {differ == 0} -> "
                     + ("agree" if error <= tolerance and differ == 0 else "DISAGREE"))
    utils.cleanup_distributed()


if __name__ == "__main__":
    main()
