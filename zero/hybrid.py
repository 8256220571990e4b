"""Hybrid sharding for stages 1-3 (``zero.shard(..., group=SHARD_GROUP, replicate_group=...)``): FSDP2's HSDP on a
2-D mesh (replicate, shard), DeepSpeed's ZeRO++ hpZ.

The world is a grid of R replicas x S shards. ``group`` is this rank's replica (S ranks, which shard the state
among themselves as if alone); ``replicate_group`` is its column (the R ranks, one per replica, that hold the
same shard). A gradient is reduce-scattered within the replica, then its 1/S shard averaged over the column:

    shard group   reduce-scatter (every micro-batch at stages 2-3; the window's last at stage 1) and the weights'
                  all-gathers, as without replicas
    replicas      one all-reduce per bucket of the accumulated 1/S gradient shard, on the window's last backward:
                  2 (R-1)/R of Psi / S elements sent per rank and optimizer step

Averaging the R column means of S-rank means is the mean over all R S ranks (every mean is over equal counts),
so the step is the one data parallelism over the world would take; the replicas then hold equal shards and step
them identically, and stay equal. Hence the clipping norm sums over the shard group only, and the whole state
dicts are on the shard group's rank 0 of every replica. The slow links (between nodes) carry only the replicas'
all-reduce of a 1/S shard, instead of stage 3's gathers and scatters of the whole model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from collectives import Collectives
from zero.broadcast import broadcast_state


def check_grid(group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup) -> None:
    """Refuse, in one line and the same on every rank, groups that do not tile the world as a grid: every rank
    in both; |group| x |replicate_group| = world; each replicate group holds exactly one rank of every shard
    group, all at the same shard index. Every rank of the world calls this (one all_gather_object), so none is
    left waiting where another raised."""
    world = dist.get_world_size()
    mine = (dist.get_process_group_ranks(group) if group is not None else list(range(world)),
            dist.get_process_group_ranks(replicate_group))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    problem = grid_problem(everyone)
    if problem:
        raise ValueError(f"zero.shard: group and replicate_group must tile the world as a grid (replicas x shards); "
                         f"{problem}")


def grid_problem(groups: list[tuple[list[int], list[int]]]) -> str | None:
    """What makes ``groups`` (each rank's (shard group's ranks, replicate group's ranks), global ranks in group
    order) not a grid, in words, or None."""
    world = len(groups)
    for rank, (shard, replicas) in enumerate(groups):
        if rank not in shard or rank not in replicas:
            return f"rank {rank} is not in both of its groups"
        if len(shard) * len(replicas) != world:
            return f"rank {rank}'s groups are {len(shard)} x {len(replicas)} ranks, and the world is {world}"
        for other in shard:
            if groups[other][0] != shard:
                return f"ranks {rank} and {other} disagree on their shard group"
        for other in replicas:
            if groups[other][1] != replicas:
                return f"ranks {rank} and {other} disagree on their replicate group"
            if groups[other][0].index(other) != shard.index(rank):
                return (f"replicate group {replicas} holds rank {rank} (shard {shard.index(rank)} of its replica) "
                        f"and rank {other} (shard {groups[other][0].index(other)}): a replicate group is one "
                        f"shard index across replicas")
        if len({tuple(groups[other][0]) for other in replicas}) != len(replicas):
            return f"replicate group {replicas} holds two ranks of one replica"
    return None


class Replicas:
    """The replicate group's side of a hybrid stage: a Collectives over the column (torch's, or the ring on a
    thread of its own), and the average of the gradient shards across it."""

    def __init__(self, replicate_group: dist.ProcessGroup, kind: str, timeout_s: float | None,
                 reduce_dtype: torch.dtype):
        self.comm = Collectives(replicate_group, kind, timeout_s)
        self.reduce_dtype = reduce_dtype

    def average(self, grads: list[torch.Tensor], names: list[str]) -> None:
        """Average each gradient shard over the replicas, in the reduce dtype (cast there and back when the
        shards are kept in another): every all-reduce launched, then every one waited for, in the same order on
        every rank of the column."""
        buffers = [g if g.dtype == self.reduce_dtype else g.to(self.reduce_dtype) for g in grads]
        pending = [self.comm.all_reduce(buffer, name) for buffer, name in zip(buffers, names)]
        for handle in pending:
            handle.wait()
        for g, buffer in zip(grads, buffers):
            if buffer is not g:
                g.copy_(buffer)

    def broadcast(self, model: torch.nn.Module) -> None:
        """The column's rank 0's parameters and buffers to the column (after the shard group's own broadcast:
        then every rank of the grid starts from replica 0's rank 0's weights)."""
        broadcast_state(model, group=self.comm.group)

    def sent_bytes(self) -> int:
        return self.comm.sent_bytes()

    def close(self) -> None:
        self.comm.close()
