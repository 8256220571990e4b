"""The three collectives data parallelism is made of, in one place: average a flat tensor over a process group
(all-reduce), average it into this rank's chunk (reduce-scatter), and give every rank every rank's chunk
(all-gather); and a fourth for the whole-matrix optimizers (zero/matrix.py): send each rank its own segment
(all-to-all). zero's stages 0 (zero/stage0.py) to 3 move their buckets with nothing else.

    comm = Collectives(group=None, kind="torch")       # or "ring" / "butterfly" (allreduce.py's, on a thread)
    pending = comm.reduce_scatter(flat, "reduce_scatter bucket 3 (1.0 MB)")
    pending.wait()                                     # comm.chunk(flat) now holds the average of that chunk

A flat given to reduce_scatter or all_gather has ``size`` equal chunks (zero pads it); chunk r is rank r's.
Each call is asynchronous and returns a Pending. Under torch.profiler (the trainer's --profile) it is a range
named by the caller that opens at the launch and closes when the result has landed, whichever thread lands it;
one launched under a profiler is waited for before that profiler stops (zero's [Note: a profiler's window]).

kind "torch" runs torch.distributed's collectives in place on ``group`` (the output is this rank's chunk of the
input: NCCL's in-place convention, which gloo follows too). Gloo's own reduce_scatter_tensor and
all_gather_into_tensor each make a whole bucket of their own while they run (the first all-reduces a copy of its
input, the second gathers into a new buffer and copies it out), so on gloo a reduce-scatter is an all-reduce of
``flat`` in place (this rank's chunk bit for bit as gloo's reduce-scatter gives it) and an all-gather is W
broadcasts in place, chunk r from rank r (the same bytes, bit for bit). "ring" and "butterfly" run allreduce.py's
algorithms, point-to-point messages only, on an AllreduceThread: a thread and a process group of its own over the
same ranks, so they overlap backward and never interleave with the caller's collectives (SyncBatchNorm's) on
``group``. A ``group`` made directly over a store (the replica groups' quorums, outside torch.distributed's registry)
comes with its ``thread_group``, a second such group over the same processes.
``all_to_all`` is torch's all_to_all_single, or allreduce.py's pairwise_all_to_all on the thread.
``launched``, where set (a callable of the collective's kind: "all_reduce", "reduce_scatter", "all_gather",
"all_to_all"), is called once each collective is launched and before it lands: where the trainer's faults
(trainer/faults.py) kill a process inside one.
``sent_bytes()`` is what this rank has sent: the ring's own isend payloads, counted where they are posted, on this
object's thread only (so two Collectives in one process, a shard group's and a replicate group's, count apart); for
torch's collectives what an ideal ring sends, (W-1)/W of the buffer per reduce-scatter or all-gather and twice
that per all-reduce (gloo's reduce_scatter_tensor actually all-reduces: it sends twice that), and for an all-to-all
the segments that leave this rank.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist

from allreduce import AllreduceThread, pairwise_all_to_all, place_in, ring_all_gather, ring_reduce_scatter
from measure.timing import profiled

KINDS = ("torch", "ring", "butterfly")


class Pending:
    """One collective in flight: ``wait()`` once, and its result is in place (a second wait does nothing)."""

    def __init__(self, work: Any, on_thread: bool, ends_range: torch.futures.Future | None = None):
        self.work, self.on_thread, self.ends_range = work, on_thread, ends_range

    def wait(self) -> None:
        if self.work is None:
            return
        self.work.result() if self.on_thread else self.work.wait()  # result() re-raises the thread's error
        self.work = None
        if self.ends_range is not None:  # a Work without a future (gloo's reduce-scatter): its range ends here
            self.ends_range.set_result(None)


class Works:
    """Several collectives in flight as one Work: waited for in order, its future done when all of theirs are."""

    def __init__(self, works: list[Any]):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([work.get_future() for work in self.works])


class Collectives:
    """All-reduce, reduce-scatter and all-gather of flat tensors over ``group`` (module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None = None, kind: str = "torch",
                 timeout_s: float | None = None, thread_group: dist.ProcessGroup | None = None):
        if kind not in KINDS:
            raise ValueError(f"collectives are one of {', '.join(KINDS)}, not {kind!r}")
        self.group, self.kind = group, kind
        self.rank, self.size = place_in(group)
        self.thread = None if kind == "torch" else AllreduceThread(kind, timeout_s, group=group,
                                                                   own_group=thread_group)
        self.nominal_sent = 0
        self.launched: Callable[[str], None] | None = None  # (module docstring)
        self.in_place_on_gloo = kind == "torch" and (group or dist.group.WORLD).name() == "gloo"

    def chunk(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a flat tensor of ``size`` equal chunks (a view)."""
        width = flat.numel() // self.size
        return flat[self.rank * width:(self.rank + 1) * width]

    def all_reduce(self, flat: torch.Tensor, name: str) -> Pending:
        """Average ``flat`` over the group in place."""
        def start() -> Any:
            if self.thread is not None:
                return self.thread.submit(flat)  # the ring and the butterfly average: no division here
            flat.div_(self.size)
            self.nominal_sent += 2 * (self.size - 1) * flat.numel() * flat.element_size() // self.size
            return dist.all_reduce(flat, group=self.group, async_op=True)
        return self._launch(name, start, "all_reduce")

    def reduce_scatter(self, flat: torch.Tensor, name: str) -> Pending:
        """Average chunk ``rank`` of ``flat`` over the group into that chunk (divide by W first, then sum)."""
        def start() -> Any:
            flat.div_(self.size)
            if self.thread is not None:
                return self.thread.submit(flat, operation=ring_reduce_scatter)
            self.nominal_sent += self._one_way_bytes(flat)
            if self.in_place_on_gloo:  # gloo's own would all-reduce a copy of flat
                return dist.all_reduce(flat, group=self.group, async_op=True)
            return dist.reduce_scatter_tensor(self.chunk(flat), flat, group=self.group, async_op=True)
        return self._launch(name, start, "reduce_scatter")

    def all_gather(self, flat: torch.Tensor, name: str) -> Pending:
        """Every rank's chunk r of ``flat`` into chunk r of every rank's ``flat``, bit for bit."""
        def start() -> Any:
            if self.thread is not None:
                return self.thread.submit(flat, operation=ring_all_gather)
            self.nominal_sent += self._one_way_bytes(flat)
            if self.in_place_on_gloo:  # gloo's own would gather into a flat of its own, then copy it into ours
                width = flat.numel() // self.size
                return Works([dist.broadcast(flat[r * width:(r + 1) * width], group=self.group, group_src=r,
                                             async_op=True) for r in range(self.size)])
            return dist.all_gather_into_tensor(flat, self.chunk(flat), group=self.group, async_op=True)
        with torch.no_grad():  # a flat behind parameters: gloo's in-place copies must not be recorded
            return self._launch(name, start, "all_gather")

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                   name: str) -> tuple[Pending, torch.Tensor]:
        """Segment d of ``send`` (send_counts[d] elements, segments in rank order) to rank d; returns the Pending
        and the tensor that receives, once waited for, recv_counts[s] elements from each rank s in rank order.
        Every rank's counts must agree (what r sends to s is what s expects from r)."""
        received = sum(recv_counts)
        if self.thread is not None:  # one buffer, what leaves and what lands, in place on the thread
            buffer = torch.cat([send.reshape(-1), send.new_empty(received)])
            operation = partial(pairwise_all_to_all, send_counts=send_counts, recv_counts=recv_counts)
            return self._launch(name, lambda: self.thread.submit(buffer, operation=operation), "all_to_all"), \
                buffer[send.numel():]
        output = send.new_empty(received)

        def start() -> Any:
            self.nominal_sent += (send.numel() - send_counts[self.rank]) * send.element_size()
            return dist.all_to_all_single(output, send, recv_counts, send_counts, group=self.group, async_op=True)
        return self._launch(name, start, "all_to_all"), output

    def _launch(self, name: str, start: Any, kind: str) -> Pending:
        with profiled(name) as span:
            work = start()
            if self.launched is not None:
                self.launched(kind)
            if span is None:
                return Pending(work, self.thread is not None)
            # the range ends when the result lands, not when the launch returns: record_function's hand-over to a
            # future (what torch.distributed.rpc's profiling uses)
            landed: torch.futures.Future = torch.futures.Future()
            ends_range = None
            if self.thread is not None:  # the thread's concurrent.futures.Future, bridged
                work.add_done_callback(lambda _: landed.set_result(None))
            else:
                try:
                    landed = work.get_future()
                except RuntimeError:  # a Work without one: "Work::getFuture not implemented"
                    ends_range = landed  # completed by Pending.wait once it has waited
            span._call_end_callbacks_on_future(landed)
        return Pending(work, self.thread is not None, ends_range)

    def _one_way_bytes(self, flat: torch.Tensor) -> int:
        """What a ring sends per rank in one reduce-scatter or all-gather of ``flat``: W-1 of its W chunks."""
        return flat.numel() // self.size * (self.size - 1) * flat.element_size()

    def sent_bytes(self) -> int:
        """Bytes this rank has sent in these collectives since they were made."""
        if self.thread is not None:
            return self.thread.sent_bytes()  # its own thread's: another Collectives' ring is not counted
        return self.nominal_sent

    def close(self) -> None:
        """Stop the thread and its process group (a second call does nothing)."""
        if self.thread is not None:
            self.thread.close()
            self.thread = None
