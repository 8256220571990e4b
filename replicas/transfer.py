"""The live state's transfer: how a member that holds the quorum's state sends it to one behind, place j to place j
(the package docstring's step 2), and the wire format both ends share.

The member sees one small interface, StateTransport (torchft's CheckpointTransport is the model): ``send(state,
joiner)`` on the source, ``receive(source) -> Received`` on the joiner, both peers named by their rank in the
quorum. Today's, PGTransport, goes over the quorum's process group (made afresh per quorum); another (at the
wire's speed, with a checksum; or with ZeRO inside the groups, rank j's shards from rank j) would take its place
without the member changing.

The wire format: a state (any nesting of dicts, lists and tuples of tensors and picklable leaves) is split into a
skeleton, its tensors replaced by numbered places (TensorPlace), and the tensors in that order (split_tensors);
the skeleton goes pickled, then the tensors in messages of about MESSAGE_BYTES (messages_of: both ends group them
alike from the skeleton), and the receiver puts them back in place (join_tensors)."""
from __future__ import annotations

import math
import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

MESSAGE_BYTES = 64 * 2**20  # a state transfer's message


@dataclass(frozen=True)
class Received:
    """What a receive brought: the state the source sent, its tensors' bytes, and the seconds from the receive's
    start until the last byte was in place."""
    state: Any
    bytes: int
    seconds: float


class StateTransport(Protocol):
    """A live state's way from the member that holds it to a member behind, within one quorum."""

    def send(self, state: Any, joiner: int) -> None:
        """``state`` to the quorum's member of rank ``joiner`` (this place's peer there); returns once it is sent,
        raises RuntimeError where the joiner is lost."""

    def receive(self, source: int) -> Received:
        """The state the quorum's member of rank ``source`` sends; raises RuntimeError where it is lost (nothing
        half-received is given back)."""


class PGTransport:
    """StateTransport over the quorum's process group (a ProcessGroupGloo made directly over the store): a pickled
    skeleton, then the tensors in messages of about MESSAGE_BYTES (gloo moves one large message over loopback about
    twice as fast as many small ones: 0.8 against 0.4 GB/s measured here), a tensor larger than that alone. The
    group's own send and recv (allreduce.place_in: torch.distributed's blocking send refuses a group it did not
    make). ``fault("send")``: called with half the messages sent, where a test kills the process."""

    def __init__(self, pg: Any, fault: Callable[[str], None] | None = None):
        self.pg, self.fault = pg, fault or (lambda point: None)

    def send(self, state: Any, joiner: int) -> None:
        skeleton, tensors = split_tensors(state)
        header = torch.frombuffer(bytearray(pickle.dumps(skeleton)), dtype=torch.uint8)
        messages = [[torch.tensor([header.numel()], dtype=torch.int64)], [header]]
        messages += [[tensors[i] for i in message] for message in messages_of(skeleton["tensors"])]
        for n, message in enumerate(messages):
            if n == len(messages) // 2:
                self.fault("send")
            flat = message[0].detach().reshape(-1) if len(message) == 1 else torch.cat(
                [t.detach().reshape(-1) for t in message])
            self.pg.send([flat.contiguous().cpu()], joiner, 0).wait()

    def receive(self, source: int) -> Received:
        started = time.perf_counter()

        def receive(count: int, dtype: torch.dtype) -> torch.Tensor:
            flat = torch.empty(count, dtype=dtype)
            self.pg.recv([flat], source, 0).wait()
            return flat

        length = receive(1, torch.int64)
        skeleton = pickle.loads(receive(int(length), torch.uint8).numpy().tobytes())
        shapes = skeleton["tensors"]
        tensors: list[torch.Tensor] = [torch.empty(0)] * len(shapes)
        for message in messages_of(shapes):
            sizes = [math.prod(shapes[i][0]) for i in message]
            flat = receive(sum(sizes), shapes[message[0]][1])
            for i, part in zip(message, flat.split(sizes)):
                tensors[i] = part.view(shapes[i][0])  # a view of the message: nothing copied here
        state, seconds = join_tensors(skeleton, tensors), time.perf_counter() - started
        return Received(state, int(sum(t.numel() * t.element_size() for t in tensors)), seconds)


def messages_of(tensors: list[tuple[tuple[int, ...], torch.dtype]]) -> list[list[int]]:
    """The tensors (shape, dtype) a state transfer sends, grouped into messages: consecutive tensors of one dtype
    up to MESSAGE_BYTES together, a larger one alone. Both ends group them alike, from the skeleton."""
    messages: list[list[int]] = []
    size = 0
    for i, (shape, dtype) in enumerate(tensors):
        nbytes = math.prod(shape) * dtype.itemsize
        if messages and tensors[messages[-1][0]][1] == dtype and size + nbytes <= MESSAGE_BYTES:
            messages[-1].append(i)
            size += nbytes
        else:
            messages.append([i])
            size = nbytes
    return messages


def split_tensors(value: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``value`` (dicts, lists, tuples; tensors and picklable leaves) as a skeleton whose tensors are numbered
    places, and the tensors in that order."""
    tensors: list[torch.Tensor] = []

    def walk(item: Any) -> Any:
        if torch.is_tensor(item):
            tensors.append(item)
            return TensorPlace(len(tensors) - 1)
        if isinstance(item, dict):
            return {key: walk(v) for key, v in item.items()}
        if isinstance(item, (list, tuple)):
            return type(item)(walk(v) for v in item)
        return item

    body = walk(value)
    return {"body": body, "tensors": [(tuple(t.shape), t.dtype) for t in tensors]}, tensors


@dataclass(frozen=True)
class TensorPlace:
    index: int


def join_tensors(skeleton: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    def walk(item: Any) -> Any:
        if isinstance(item, TensorPlace):
            return tensors[item.index]
        if isinstance(item, dict):
            return {key: walk(v) for key, v in item.items()}
        if isinstance(item, (list, tuple)):
            return type(item)(walk(v) for v in item)
        return item
    return walk(skeleton["body"])

