"""Data parallelism over slow links: replicas that train alone for H steps and then meet (DiLoCo), with the meeting
compressed on our ring and streamed in fragments. A library for your own loop, beside zero's.

    outer = diloco.DiLoCo(model, group=across, local_steps=50, outer_lr=0.7, outer_momentum=0.9,
                          compress="int4", fragments=4, delay=1)
    for batch in data:                      # the replica's ordinary data-parallel step (zero.shard over `within`)
        loss_fn(model, batch).backward(); optimizer.step(); optimizer.zero_grad()
        outer.step()                        # counts the inner step; meets the other replicas when one is due
    with outer.global_weights():            # the shared point the replicas last agreed on, for evaluation
        evaluate(model)
    outer.state_dict(); outer.load_state_dict(state)    # this rank's outer state: exact resume mid-window
    outer.close()

The world is R replicas of W/R processes. Inside a replica every step is ordinary data parallelism over its group
(``within``); across replicas, ``group`` (``across``) holds this rank and the rank at the same position in every
other replica, and nothing crosses it but the outer all-reduce. The training state of every replica is whole on each
of its ranks (zero.shard's stages 0-2), so the R-rank rings of the W/R positions run side by side on identical
inputs: each rank sends what one ring sends. At stage 3 (``params=`` the stage's master shards, ``after_write=`` its
drop_gathered) each rank's ring carries its shard: the ranks at one place in every replica hold the same shard.

DiLoCo (Douillard et al., 2023, arXiv:2311.08105). Every replica starts a window from the shared point theta,
takes H inner steps with its own optimizer (AdamW, its state kept across windows), reaching theta_r, and then

    Delta_r = theta - theta_r                      the pseudo-gradient: minus the replica's progress
    Delta   = 1/R sum_r Delta_r                     one all-reduce across the replicas
    theta  <- OuterOpt(theta, Delta)                SGD with Nesterov momentum (lr 0.7, momentum 0.9: the paper's)

and every replica starts its next window from the new theta. Outer SGD with lr 1 and no momentum makes theta the
mean of the theta_r: model averaging every H steps (local SGD, ``localsgd``), and with H = 1 and plain inner SGD
that is data parallelism's step exactly. The sign matters: theta - lr * Delta moves toward the replicas' mean
(torchft's first version stepped away from it: torchtitan #1507).

The outer all-reduce (``ring_allreduce_compressed``) is the ring of allreduce.py with every message encoded:
``none`` (the values as they are), ``bf16``, ``int8`` or ``int4`` (round to nearest on a scale per block of
BLOCK = 256 elements, absmax / 127 or absmax / 7, the scale sent as float32 beside the codes; int4's codes in
[-7, 7] two to a byte). Partial sums are decoded, added in the flat's dtype (float32) and encoded again at each
hop; the owner of a chunk divides the sum by R and encodes it once more, and the all-gather forwards that message
unchanged, so every rank decodes the same bits. Every rounding is charged to the rank that made it: ``error``
receives, on each rank, what its encodings lost, in units of the sum, so that

    R * result + sum_r error_r = sum_r input_r          (up to the adds' own rounding)

Error feedback adds each rank's ``error`` to its next pseudo-gradient, so what the rounding lost in one window is
sent in a later one: over T windows, R * sum_t applied_t + sum_r error_r(T) = sum_t sum_r Delta_r,t, and nothing
is lost over time (Seide et al. 2014; Karimireddy et al. 2019). An encoding of values v with scale s = absmax / L
errs by at most s / 2 per element; the sum a hop encodes after k contributions is at most k M in size (M: the
largest |input| in the block), so the sum's error is at most sum_{k=1}^{R-1} k M / (2L) and the mean's at most
that / R plus M / (2L) for the final encoding: (R - 1) / 4 + 1/2 of M / L (to first order: a partial sum also
carries the earlier hops' errors). For bf16 (8 significant bits) each encoding errs by at most 2^-8 of the value.
Bytes: what each rank sends per all-reduce of n elements in R chunks c_i is
sum_{i != r} b(c_i) + sum_{i != r+1} b(c_i), with b(c) = 4c (none, float32), 2c (bf16), c + 4 ceil(c / 256)
(int8), ceil(c / 2) + 4 ceil(c / 256) (int4) (``encoded_bytes``); data parallelism sends 2 (W-1)/W of the model
in float32 every step.

Streaming DiLoCo (Douillard et al., 2025, arXiv:2501.18512). ``fragments`` F splits the parameters, in the model's
order, into F runs of about equal size; fragment f meets after inner steps t with t = (f + 1) floor(H / F) (mod H)
(fragment F-1 at the window's end, as plain DiLoCo; each fragment's first window is shorter), so one fragment is on
the wire at a time and the peak bytes in flight are 1/F of the model's. Its all-reduce runs on a thread of its own
(AllreduceThread, over a group of its own) while the next ``delay`` inner steps compute, and is applied after
inner step t + delay; the local progress made meanwhile is kept on top of the new point,

    theta_f_local <- theta_f_new + (theta_f_local(now) - theta_f_local(at launch)),

so every inner step's update enters exactly one pseudo-gradient (the paper mixes the two with a weight instead).
delay <= floor(H / F) keeps one fragment in flight at a time. With delay 0 the update is applied at once, and the
schedule is a fixed function of the inner step: a run stopped anywhere resumes exactly from ``state_dict``, which
holds the shared point, the outer momentum, this rank's error feedback, the inner-step count and any fragment in
flight (landed, not yet applied).

Fault-tolerant replica groups (``meets_outside``, trainer/replica_groups.py) run the same schedule, each meeting
through a quorum of the caller's (``meet_through``): formed at the launch, the average on the same ring over the
quorum's process group, the vote at the application (delay steps later). The exact rule for a fault between launch
and landing: the meeting is not applied by anyone, and is averaged again at the landing step in a new quorum, every
replica bringing the pseudo-gradient it launched (the progress since the launch kept as above); a meeting in flight
in a checkpoint is met again so too. A replica found behind in a quorum takes a peer's state and the peer's place in
its meeting (weight 0), and brings nothing to each fragment's next launch (``brings``).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from allreduce import AllreduceThread, split_bounds

CODECS = ("none", "bf16", "int8", "int4")
REPLACED = object()  # meets_outside: a landing during which this replica took a peer's live state instead
BLOCK = 256  # elements per scale (int8, int4)
LEVELS = {"int8": 127, "int4": 7}  # codes in [-L, L]


# ----------------------------------------------------------------------------------------------------------
# Encodings: a chunk of float values <-> one uint8 message
# ----------------------------------------------------------------------------------------------------------
def encoded_bytes(numel: int, codec: str, dtype: torch.dtype = torch.float32) -> int:
    """The bytes of one message carrying ``numel`` values of ``dtype`` under ``codec``."""
    blocks = -(-numel // BLOCK)
    return {"none": numel * dtype.itemsize, "bf16": 2 * numel, "int8": numel + 4 * blocks,
            "int4": -(-numel // 2) + 4 * blocks}[codec]


def encode(values: torch.Tensor, codec: str) -> torch.Tensor:
    """``values`` (1-D) as one uint8 message of encoded_bytes(numel) bytes: [float32 scale per block | codes] (the
    scales first, so that they are 4-aligned)."""
    if codec == "none":
        return values.contiguous().view(torch.uint8)
    if codec == "bf16":
        return values.to(torch.bfloat16).view(torch.uint8)
    levels, n = LEVELS[codec], values.numel()
    blocks = torch.zeros(-(-n // BLOCK) * BLOCK, dtype=values.dtype)
    blocks[:n] = values
    blocks = blocks.view(-1, BLOCK)
    scales = (blocks.abs().amax(1) / levels).float()  # sent as float32; the divisor below is that same number
    divisor = torch.where(scales > 0, scales, 1.0).to(values.dtype)
    codes = torch.round(blocks / divisor[:, None]).clamp_(-levels, levels).to(torch.int8).view(-1)[:n]
    if codec == "int8":
        packed = codes.view(torch.uint8)
    else:  # two codes a byte, each + 8 in 4 bits (1..15); an odd count leaves the last high half 0
        shifted = (codes + 8).to(torch.uint8)
        if n % 2:
            shifted = torch.cat([shifted, shifted.new_zeros(1)])
        packed = shifted[0::2] | (shifted[1::2] << 4)
    return torch.cat([scales.view(torch.uint8), packed])


def decode(message: torch.Tensor, codec: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``numel`` values of ``dtype`` a message from ``encode`` carries (every rank decodes the same bits)."""
    if codec == "none":
        return message.view(dtype)
    if codec == "bf16":
        return message.view(torch.bfloat16).to(dtype)
    blocks = -(-numel // BLOCK)
    scales = message[:4 * blocks].view(torch.float32).to(dtype)
    if codec == "int8":
        codes = message[4 * blocks:].view(torch.int8)
    else:
        packed = message[4 * blocks:]
        codes = torch.stack([packed & 15, packed >> 4], 1).view(-1)[:numel].to(torch.int8) - 8
    padded = torch.zeros(blocks * BLOCK, dtype=dtype)
    padded[:numel] = codes.to(dtype)
    return (padded.view(blocks, BLOCK) * scales[:, None]).view(-1)[:numel]


# ----------------------------------------------------------------------------------------------------------
# The ring, with every message encoded
# ----------------------------------------------------------------------------------------------------------
def ring_bytes(numel: int, rank: int, size: int, codec: str, dtype: torch.dtype = torch.float32) -> int:
    """What ``ring_allreduce_compressed`` makes ``rank`` send for a flat of ``numel`` elements (module docstring)."""
    bounds = split_bounds(numel, size)
    widths = [b - a for a, b in zip(bounds, bounds[1:])]
    if size == 1:
        return 0
    return sum(encoded_bytes(widths[i], codec, dtype) for i in range(size) if i != rank) + \
        sum(encoded_bytes(widths[i], codec, dtype) for i in range(size) if i != (rank + 1) % size)


def ring_allreduce_compressed(flat: torch.Tensor, rank: int, size: int, group: dist.ProcessGroup | None = None,
                              segment_elements: int | None = None, *, codec: str = "int8",
                              error: torch.Tensor | None = None) -> int:
    """Average the 1-D CPU tensor ``flat`` in place over ``group`` with a ring whose messages are ``codec``-encoded
    (module docstring); the result is the same bits on every rank. ``error`` (``flat``'s shape, or None) is SET to
    what this rank's encodings lost, in units of the sum. Returns the bytes this rank sent. ``segment_elements`` is
    ignored (AllreduceThread's signature): each step sends one chunk as one message, the outer all-reduce being
    rare and its chunks small next to a slow link's bandwidth-delay product.

    Rank r owns chunk r. Reduce-scatter step s = 0 .. R-2: send chunk r-1-s (step 0 this rank's own values, later
    the partial sum just made), receive chunk r-2-s and add it to this rank's values of that chunk; after R-1 steps
    chunk r holds the sum. All-gather step s: send the message of chunk r-s (step 0: the owned chunk's mean, encoded
    once), receive chunk r-1-s's message, decode it into place and forward it unchanged at step s+1."""
    if codec not in CODECS:
        raise ValueError(f"codec is one of {', '.join(CODECS)}, not {codec!r}")
    if flat.dim() != 1 or flat.device.type != "cpu" or not flat.is_floating_point():
        raise ValueError(f"ring_allreduce_compressed takes a 1-D floating CPU tensor, got {flat.dtype} "
                         f"{tuple(flat.shape)} on {flat.device}")
    if error is not None:
        error.zero_()
    bounds = split_bounds(flat.numel(), size)

    def chunk(i: int) -> torch.Tensor:
        i %= size
        return flat[bounds[i]:bounds[i + 1]]

    def charge(i: int, exact: torch.Tensor, sent_as: torch.Tensor) -> None:  # what this rank's encoding lost
        if error is not None:
            error[bounds[i % size]:bounds[i % size + 1]] += exact - sent_as

    sent = 0

    def exchange(outgoing: torch.Tensor, incoming_bytes: int, tag: int) -> torch.Tensor:
        nonlocal sent
        incoming = torch.empty(incoming_bytes, dtype=torch.uint8)
        recv = dist.irecv(incoming, group=group, group_src=(rank - 1) % size, tag=tag) if incoming_bytes else None
        send = dist.isend(outgoing, group=group, group_dst=(rank + 1) % size, tag=tag) if outgoing.numel() else None
        sent += outgoing.numel()
        for request in (send, recv):
            if request is not None:
                request.wait()
        return incoming

    if size == 1:
        return 0
    # reduce-scatter: encoded partial sums travel, decoded and added in flat's dtype at each hop
    message = encode(chunk(rank - 1), codec)
    charge(rank - 1, chunk(rank - 1), decode(message, codec, chunk(rank - 1).numel(), flat.dtype))
    for step in range(size - 1):
        target = chunk(rank - 2 - step)
        incoming = exchange(message, encoded_bytes(target.numel(), codec, flat.dtype), step)
        target += decode(incoming, codec, target.numel(), flat.dtype)
        if step < size - 2:  # forward the partial sum, encoded again
            message = encode(target, codec)
            charge(rank - 2 - step, target, decode(message, codec, target.numel(), flat.dtype))
    # the owner's mean, encoded once: what every rank (the owner too) ends with
    owned = chunk(rank)
    total = owned.clone()
    message = encode(owned / size, codec).clone()  # "none" views its input: keep the bytes apart from ``flat``
    owned.copy_(decode(message, codec, owned.numel(), flat.dtype))
    charge(rank, total, size * owned)
    # all-gather: messages forwarded unchanged, so every rank decodes the same bits
    for step in range(size - 1):
        target = chunk(rank - 1 - step)
        message = exchange(message, encoded_bytes(target.numel(), codec, flat.dtype), size - 1 + step)
        target.copy_(decode(message, codec, target.numel(), flat.dtype))
    return sent


# ----------------------------------------------------------------------------------------------------------
# DiLoCo: the outer loop
# ----------------------------------------------------------------------------------------------------------
def split_fragments(params: list[nn.Parameter], fragments: int) -> list[list[nn.Parameter]]:
    """``params`` in order, cut into ``fragments`` consecutive non-empty runs of about equal element counts (a cut
    at the first parameter that reaches k/F of the total)."""
    if not 1 <= fragments <= len(params):
        raise ValueError(f"fragments must be between 1 and the {len(params)} parameters, got {fragments}")
    total, seen, runs = sum(p.numel() for p in params), 0, [[]]
    for i, p in enumerate(params):
        left, to_start = len(params) - i, fragments - len(runs)  # parameters to place (this one too), runs to start
        if runs[-1] and to_start and (seen >= len(runs) * total / fragments or left <= to_start):
            runs.append([])
        runs[-1].append(p)
        seen += p.numel()
    return runs


@dataclass
class InFlight:
    """One fragment's outer all-reduce between its launch and its application."""
    fragment: int
    apply_at: int  # the inner step after which it is applied
    average: torch.Tensor  # the pseudo-gradient, averaged in place once landed
    at_launch: torch.Tensor | None  # the fragment's local weights at the launch (delay > 0)
    future: Any = None  # the thread's; None once landed (meets_outside: the meeting's; None: not launched in a quorum)
    entry: dict[str, Any] | None = None  # its line in DiLoCo.log (None: launched before a resume, counted there)
    brings: bool = True  # meets_outside: whether ``average`` is this replica's own (else it takes part with weight 0)


class DiLoCo:
    """The outer loop of DiLoCo (module docstring) over ``model``'s parameters, across ``group``.

    ``local_steps`` H; ``outer_lr``, ``outer_momentum`` and ``nesterov``: the outer SGD's; ``compress``: the outer
    all-reduce's encoding (with error feedback unless "none"); ``fragments`` F and ``delay`` (inner steps between an
    all-reduce's launch and its application). The outer state (shared point, momentum, error feedback) lives on the
    CPU in the parameters' dtype. Call ``step()`` after every inner optimizer step. ``meets_outside``: the meetings
    are the caller's (fault-tolerant replica groups), given once by ``meet_through``; else the ring's, across
    ``group``."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None, local_steps: int = 500,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True, compress: str = "none",
                 fragments: int = 1, delay: int = 0, timeout_s: float | None = None,
                 params: list[torch.Tensor] | None = None, after_write: Callable[[], None] | None = None,
                 meets_outside: bool = False):
        if compress not in CODECS:
            raise ValueError(f"compress is one of {', '.join(CODECS)}, not {compress!r}")
        if local_steps < 1 or fragments < 1 or local_steps < fragments:
            raise ValueError(f"local_steps ({local_steps}) must be at least fragments ({fragments}) and 1")
        if not 0 <= delay <= local_steps // fragments:
            raise ValueError(f"delay must be in [0, local_steps // fragments = {local_steps // fragments}] (one "
                             f"fragment in flight at a time), got {delay}")
        self.model, self.local_steps, self.compress, self.delay = model, local_steps, compress, delay
        self.per_rank = params is not None  # the outer state is this rank's shards' (ZeRO-3 inside the replicas)
        # the tensors the outer step reads and writes: the model's parameters, or (ZeRO-3 inside the replicas)
        # this rank's master shards, which the rank at the same place in every other replica holds too
        params = [p for p in model.parameters() if p.requires_grad] if params is None else params
        self.after_write = after_write  # e.g. stage 3 dropping units gathered before the write
        self.fragments = split_fragments(params, fragments)
        # fragment f meets after inner steps t = offsets[f] (mod H)
        self.offsets = [((f + 1) * (local_steps // fragments)) % local_steps for f in range(fragments)]
        self.offsets[-1] = 0  # the last fragment at the window's end, whatever H mod F
        self.start = [self._flatten(f).clone() for f in range(fragments)]  # the shared point, per fragment
        self.error = [torch.zeros_like(s) for s in self.start] if compress != "none" else None
        self.outer_optimizer = torch.optim.SGD(self.start, lr=outer_lr, momentum=outer_momentum,
                                               nesterov=nesterov and outer_momentum > 0)
        # meets_outside: the meetings are the caller's (fault-tolerant replica groups: trainer/replica_groups.py),
        # which gives the meeting once it holds one (meet_through); else our ring, on its thread
        self.meets_outside = meets_outside
        self.meet: Any = None
        self.thread = None if meets_outside else AllreduceThread("ring", timeout_s, group=group)
        self.inner_steps = 0
        # meets_outside: per fragment, whether this replica's progress on it since its last launch is its own (a
        # replica that took a peer's live state holds the peer's: it brings nothing until the fragment's next launch)
        self.brings = [True] * fragments
        self.launched = 0  # the inner step of the last launch (a joiner that launched with its peers launches once)
        self.meeting_now: str | None = None  # meets_outside: "first", "launch" or "land" while in a quorum's join
        self.in_flight: list[InFlight] = []
        self.log: list[dict[str, Any]] = []  # one entry per outer all-reduce: step, fragment, bytes, wait

    def meet_through(self, meet: Any) -> None:
        """The caller's meeting (``meets_outside``), given once, before the first: ``meet.join()`` forms a new quorum
        (True: this replica was behind and has taken a peer's live state in it, ``load_state_dict`` done);
        ``meet.start(sent, weight, codec)`` launches the weighted average of ``sent`` (None: of nothing) across the
        quorum, on a thread; ``meet.finish(handle)`` waits for it and votes: (committed, the average or None where
        no replica brought one, this rank's new error feedback or None, the bytes sent)."""
        if not self.meets_outside or self.meet is not None:
            raise RuntimeError("DiLoCo.meet_through: a meeting is given once, to a DiLoCo made with meets_outside")
        self.meet = meet

    def _meeting(self) -> Any:
        if self.meet is None:
            raise RuntimeError("DiLoCo meets outside (meets_outside) and no meeting was given yet (meet_through)")
        return self.meet

    def _flatten(self, f: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.fragments[f]])

    def _write(self, f: int, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.fragments[f]:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        if self.after_write is not None:
            self.after_write()

    def due(self, step: int) -> list[int]:
        """The fragments that meet after inner step ``step`` (counted from 1)."""
        return [f for f, offset in enumerate(self.offsets) if step % self.local_steps == offset]

    def step(self) -> None:
        """Count one inner step; launch the fragments due now, apply those whose delay is over."""
        self.inner_steps += 1
        self._rest_of_step()

    def _rest_of_step(self) -> None:
        self._apply_due()  # first, so that a launch at the step another lands keeps one fragment in flight
        if self.launched < self.inner_steps:  # (a joiner may have launched already, with its peers)
            for f in self.due(self.inner_steps):
                self._launch(f)
        self._apply_due()  # delay 0: at once

    def _apply_due(self) -> None:
        while self.in_flight and self.in_flight[0].apply_at <= self.inner_steps:
            self._apply(self.in_flight[0])

    def _launch(self, f: int) -> None:
        if self.meets_outside:
            self._launch_outside(f)
            return
        self.launched = self.inner_steps
        local = self._flatten(f)
        pseudo = self.start[f] - local  # Delta_r: the shared point minus this replica's
        if self.error is not None:
            pseudo += self.error[f]  # error feedback: what earlier roundings lost, sent now
        operation = partial(ring_allreduce_compressed, codec=self.compress,
                            error=None if self.error is None else self.error[f])
        entry = {"step": self.inner_steps, "fragment": f, "elements": pseudo.numel(), "bytes": None,
                 "launched_s": time.perf_counter()}
        self.log.append(entry)
        self.in_flight.append(InFlight(f, self.inner_steps + self.delay, pseudo, local if self.delay else None,
                                       self.thread.submit(pseudo, operation=operation), entry))

    def _land(self, item: InFlight) -> None:
        if item.future is None:
            return
        waited = time.perf_counter()
        sent = item.future.result()
        landed = time.perf_counter()
        if item.entry is not None:
            item.entry.update(bytes=sent, wait_ms=(landed - waited) * 1e3,
                              in_flight_ms=(landed - item.entry.pop("launched_s")) * 1e3)
        item.future = None

    def _apply(self, item: InFlight) -> None:
        if self.meets_outside:
            average = self._land_outside(item)
            if average is REPLACED:  # this replica took a peer's state meanwhile, and met with it
                return
        else:
            self._land(item)
            average = item.average
        self.in_flight = [i for i in self.in_flight if i is not item]
        f = item.fragment
        if average is None:  # a meeting where no replica brought anything: no outer step
            return
        # the outer step on this fragment alone: torch.optim.SGD skips tensors whose .grad is None
        self.start[f].grad = average
        self.outer_optimizer.step()
        self.start[f].grad = None
        new = self.start[f]
        if item.at_launch is not None:  # keep the inner steps taken while the all-reduce was on the wire
            new = new + (self._flatten(f) - item.at_launch)
        self._write(f, new)

    # ------------------------------------------------------------------------------------------------------
    # meets_outside: each meeting through a quorum of the caller's (fault-tolerant replica groups)
    # ------------------------------------------------------------------------------------------------------
    def _launch_outside(self, f: int, joined: bool = False) -> None:
        """Fragment ``f``'s meeting: a new quorum (``joined``: this replica is in its peers' already), then its
        average launched on the meeting's thread, voted on and applied after inner step t + delay."""
        if not joined and self._join_as("launch"):  # behind: a peer's state and its place in its meeting taken
            return
        self.launched = self.inner_steps
        local = self._flatten(f)
        sent = self.start[f] - local  # Delta_r, and what earlier roundings lost
        if self.error is not None:
            sent += self.error[f]
        brings, self.brings[f] = self.brings[f], True  # from now on this replica's progress on f is its own
        if not brings:
            sent.zero_()
        entry = {"step": self.inner_steps, "fragment": f, "elements": sent.numel(), "bytes": None}
        self.log.append(entry)
        item = InFlight(f, self.inner_steps + self.delay, sent, local if self.delay else None, None, entry, brings)
        item.future = self.meet.start(sent, float(brings), self.compress)
        self.in_flight.append(item)

    def _land_outside(self, item: InFlight) -> Any:
        """The committed average of ``item``'s meeting (None: nobody brought one), or REPLACED. An aborted quorum
        (a peer lost between the launch and now, or before) is followed by another, at this step, which averages
        the same pseudo-gradients again; a replica found behind in it takes a peer's state and that peer's
        meeting."""
        while True:
            if item.future is None:  # not launched in a live quorum (aborted, or resumed from a checkpoint)
                if self._join_as("land"):
                    return REPLACED
                item.future = self.meet.start(item.average, float(item.brings), self.compress)
            committed, average, error, sent = self.meet.finish(item.future)
            item.future = None
            if committed:
                if error is not None:
                    self.error[item.fragment].copy_(error)
                if item.entry is not None:
                    item.entry["bytes"] = (item.entry["bytes"] or 0) + sent
                return average

    def meet_first(self) -> bool:
        """This process's first quorum (fault-tolerant replica groups): True where it took a peer's live state
        there, and then took part in the peer's meeting as it stood (``_meet_as_joiner``); else every member has
        just started (or resumed) too, and the quorum meets with nothing to average."""
        if self._join_as("first"):
            return True
        self.meet.finish(self.meet.start(None, 0.0, self.compress))  # aborted or not: nothing to apply
        return False

    def _join_as(self, now: str) -> bool:
        """A new quorum for this replica's meeting, ``now`` ("first", "launch" or "land") where it stands in it, as
        its live state says to a joiner; True where this replica was behind and took a peer's live state there (the
        peer's ``meeting_now`` with it), and then the peer's place in its meeting (``_meet_as_joiner``)."""
        self.meeting_now = now
        if self._meeting().join():
            self._meet_as_joiner()
            return True
        self.meeting_now = None
        return False

    def _meet_as_joiner(self) -> None:
        """This replica has just taken a peer's live state in the quorum the peer was forming: it takes the peer's
        place in the meeting (``meeting_now``, the peer's) with nothing of its own (weight 0), and finishes the
        peer's step. Every fragment's progress is the peer's until its next launch: brought as nothing then, the
        fragment heals to the replicas' average (plus, with a delay, this replica's own steps since)."""
        now, self.meeting_now = self.meeting_now, None
        self.brings = [False] * len(self.fragments)
        if now == "first":  # a peer that has just started: a meeting of nothing
            self.meet.finish(self.meet.start(None, 0.0, self.compress))
            return
        if now == "land":  # the peer lands a meeting aborted before: the peer's in-flight item, brought as nothing
            item = next(i for i in self.in_flight if i.apply_at <= self.inner_steps)
            item.brings, item.average = False, torch.zeros_like(item.average)
            item.future = self.meet.start(item.average, 0.0, self.compress)
            self._apply(item)
        else:  # "launch": the fragment due at the peer's step, launched in this quorum
            self._launch_outside(self.due(self.inner_steps)[0], joined=True)
        self._rest_of_step()

    @contextlib.contextmanager
    def global_weights(self) -> Iterator[None]:
        """The model holds the shared point (as last applied) inside the block, its own weights again after."""
        own = [self._flatten(f) for f in range(len(self.fragments))]
        for f, start in enumerate(self.start):
            self._write(f, start)
        try:
            yield
        finally:
            for f, weights in enumerate(own):
                self._write(f, weights)

    def wait(self) -> None:
        """Wait until every outer all-reduce in flight has landed (they stay unapplied until their step). Not the
        meetings through a quorum: theirs land at their step, where they are voted on."""
        for item in self.in_flight:
            if not self.meets_outside:
                self._land(item)

    def sent_bytes(self) -> int:
        """Bytes this rank has sent in outer all-reduces that have landed."""
        return sum(entry["bytes"] or 0 for entry in self.log)

    def state_dict(self) -> dict[str, Any]:
        """This rank's outer state (an all-reduce in flight is waited for, and kept unapplied)."""
        self.wait()
        return {"inner_steps": self.inner_steps, "start": [s.clone() for s in self.start],
                "outer_optimizer": self.outer_optimizer.state_dict(),
                "error": None if self.error is None else [e.clone() for e in self.error],
                "in_flight": [{"fragment": i.fragment, "apply_at": i.apply_at, "average": i.average.clone(),
                               "at_launch": i.at_launch, "brings": i.brings} for i in self.in_flight],
                "brings": list(self.brings), "launched": self.launched, "meeting_now": self.meeting_now}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["start"]) != len(self.start) or any(a.shape != b.shape for a, b in zip(state["start"],
                                                                                            self.start)):
            raise ValueError(f"the outer state has {len(state['start'])} fragments of "
                             f"{[s.numel() for s in state['start']]} elements, this model "
                             f"{[s.numel() for s in self.start]}")
        if (state["error"] is None) != (self.error is None):
            raise ValueError("the outer state and this DiLoCo disagree on error feedback (compress none or not)")
        self.inner_steps = state["inner_steps"]
        with torch.no_grad():
            for mine, saved in zip(self.start, state["start"]):
                mine.copy_(saved)
            for mine, saved in zip(self.error or [], state["error"] or []):
                mine.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.in_flight = [InFlight(i["fragment"], i["apply_at"], i["average"].clone(),
                                   None if i["at_launch"] is None else i["at_launch"].clone(),
                                   brings=i.get("brings", True)) for i in state["in_flight"]]
        self.brings = list(state.get("brings", [True] * len(self.start)))
        self.launched = state.get("launched", self.inner_steps)
        self.meeting_now = state.get("meeting_now")

    def close(self) -> None:
        """Wait for what is in flight (unapplied), stop the thread and its group; a second call does nothing."""
        self.wait()
        if self.thread is not None:
            self.thread.close()


class DiLoCoSync:
    """A replica's inner sync (``inner``: any of zero.shard's stages over the replica's group) with DiLoCo's outer
    loop beside it, as one sync: the loop trains through the inner sync (every method but the checkpoints' is its
    own), and steps ``outer`` after each optimizer step.

    Checkpoints (every sync's save_checkpoint / load_checkpoint): one file, since the replicas' weights differ and
    no folder of one model's shards describes them. Each replica's first rank sends its replica's model and
    optimizer state (the whole state dicts, gathered in the replica) and outer state to rank 0, which writes
    ``{"model": the shared point, "replicas": [{"model", "optimizer", "outer"}, ...], "optimizer": replica 0's,
    **extra}``; with ZeRO-3 inside the replicas every rank's outer state is its shards' (``outer.per_rank``), so every
    rank sends it and a replica's "outer" is the list of its ranks' in order. A load gives every replica its own
    again; without an optimizer (weights only) the shared point and the outer state, what evaluation reads."""

    holds_shards = False

    def __init__(self, inner: Any, outer: DiLoCo, replica_size: int):
        self.inner, self.outer, self.replica_size = inner, outer, replica_size

    def __getattr__(self, name: str) -> Any:  # the inner sync's interface (module, optimizer, clipping, ...)
        return getattr(self.inner, name)

    def save_checkpoint(self, path: str, optimizer: Any = None, extra: Any = None, *, one_file: bool = True,
                        writer: Any = None) -> Any:
        from zero.checkpoint import write_file
        if not one_file:
            raise ValueError("DiLoCo's replicas hold weights of their own: its checkpoint is one file (one_file)")
        optimizer_state = optimizer.state_dict() if optimizer is not None else None  # gathered in the replica
        replicas = self._gather_replicas(self.inner.model_state_dict(), optimizer_state)
        with self.outer.global_weights():  # ZeRO-3: the shards hold it, gathered one unit at a time
            shared = (self.inner.model_state_dict() if self.outer.per_rank else
                      {key: value.clone() for key, value in self.inner.model.state_dict().items()})
        if dist.get_rank() == 0:  # with ``writer``: staged, written in its thread (zero.checkpoint.AsyncWriter)
            return write_file(path, {"model": shared, "replicas": replicas, "optimizer": optimizer_state,
                                     **(extra or {})}, writer)
        return None

    def _gather_replicas(self, model_state: dict[str, Any], optimizer_state: Any) -> list[Any] | None:
        """Each replica's state on rank 0, in replica order (the others get None)."""
        rank, per = dist.get_rank(), self.replica_size
        first, outer = rank % per == 0, self.outer.state_dict()
        mine = {"model": model_state, "optimizer": optimizer_state, "outer": outer} if first else None
        if self.outer.per_rank:
            mine = {"outer": outer, **({"model": model_state, "optimizer": optimizer_state} if first else {})}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
        if rank != 0:
            return None
        if self.outer.per_rank:
            return [{**gathered[i * per], "outer": [state["outer"] for state in gathered[i * per:(i + 1) * per]]}
                    for i in range(len(gathered) // per)]
        return [state for state in gathered if state is not None]

    def load_checkpoint(self, path: str, optimizer: Any = None, *, stepped: bool = False) -> Any:
        import os

        from zero.checkpoint import KEYS, CheckpointError, check_complete, load_model, load_optimizer, read_shared
        if not os.path.isfile(path):
            raise CheckpointError(f"zero.checkpoint.load: checkpoint {path} is a folder of a sharded sync's state; "
                                  f"DiLoCo keeps each replica's own weights and outer state, which it does not hold: "
                                  f"resume it with a sharded sync, or start afresh in an empty folder")
        state, mapped = read_shared(path, None)  # mapped where every rank sees it (zero/checkpoint/whole.py)
        rank, replicas = dist.get_rank(), state.get("replicas")
        index, place = divmod(rank, self.replica_size)
        replica = replicas[index] if replicas is not None and index < len(replicas) else None
        if optimizer is not None:  # checked before anything is loaded
            if replica is None:
                raise CheckpointError(f"zero.checkpoint.load: checkpoint {path}: no state of replica {index} (not "
                                      f"saved by DiLoCo over as many replicas)")
            check_complete(path, self.inner, optimizer, replica["optimizer"], stepped)
        if replica is not None:
            self.outer.load_state_dict(replica["outer"][place] if self.outer.per_rank else replica["outer"])
        if optimizer is None:  # the weights alone: the shared point, what evaluation reads
            load_model(path, self.inner, state["model"], mapped)
        else:
            load_model(path, self.inner, replica["model"], mapped)
            load_optimizer(optimizer, replica["optimizer"], mapped)
        return {key: value for key, value in state.items() if key not in (*KEYS, "replicas")}


def outer_step_bytes(numel: int, size: int, codec: str, dtype: torch.dtype = torch.float32) -> int:
    """The most any rank of ``size`` sends in one outer all-reduce of ``numel`` elements."""
    return max(ring_bytes(numel, r, size, codec, dtype) for r in range(size))


def data_parallel_bytes(numel: int, world_size: int, dtype: torch.dtype = torch.float32) -> int:
    """What an ideal ring all-reduce of the whole gradient sends per rank and step: 2 (W-1)/W of it."""
    return math.ceil(2 * (world_size - 1) * numel * dtype.itemsize / world_size)
