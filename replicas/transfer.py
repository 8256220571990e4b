"""The live state's transfer: how a member that holds the quorum's state sends it to one behind, place j to place j
(the package docstring's step 2), and the wire format both ends share.

The member sees one small interface, StateTransport (torchft's CheckpointTransport is the model): ``send(state,
joiner)`` on the source, ``receive(source, into) -> Received`` on the joiner, both peers named by their rank in the
quorum. SocketTransport (the default) streams over a TCP connection of its own at the wire's speed, each message
checked against its CRC32, and writes every tensor straight into the joiner's own tensor at the same place of
``into`` (the joiner's own state: its weights, its optimizer's moments), so that a joiner holds nothing beyond its
steady state but what it had no tensor for; PGTransport goes over the quorum's process group (gloo's send and recv)
and gives new tensors. With ZeRO inside the groups each place's state is its own shards (zero.checkpoint.held_state),
sent place j to place j: no rank ever holds more than its own.

The wire format: a state (any nesting of dicts, lists and tuples of tensors and picklable leaves) is split into a
skeleton, its tensors replaced by numbered places (TensorPlace), and the tensors in that order (split_tensors);
the skeleton goes pickled, then the tensors in messages of about MESSAGE_BYTES (messages_of: both ends group them
alike from the skeleton), and the receiver puts them back in place (join_tensors). A tensor that appears twice in a
state (a tied weight under two names) is sent once.

[Note: a torn transfer] A transfer that fails before any tensor was written into the joiner's own state (the
source lost, a message whose CRC32 differs) leaves the joiner as it was: it asks again. One that fails after
(TornTransfer) has overwritten part of it: the member stops its group, which torchrun restarts from its checkpoint,
rather than let a state that is half one step and half another ever be a source."""
from __future__ import annotations

import concurrent.futures
import fcntl
import math
import os
import pickle
import socket
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

MESSAGE_BYTES = 64 * 2**20  # a state transfer's message


class TornTransfer(RuntimeError):
    """A transfer failed after it had begun writing into the joiner's own tensors ([Note: a torn transfer])."""


@dataclass(frozen=True)
class Received:
    """What a receive brought: the state the source sent, its tensors' bytes, and the seconds from the receive's
    start until the last byte was in place."""
    state: Any
    bytes: int
    seconds: float


@dataclass(frozen=True)
class Recovery:
    """The live state a process received in joining a quorum: the quorum's step, the group it came from, the
    seconds it took to arrive and to load, and its tensors' bytes."""
    step: int
    source: int
    seconds: float
    load_s: float
    bytes: int


class StateTransport(Protocol):
    """A live state's way from the member that holds it to a member behind, within one quorum."""

    def send(self, state: Any, joiner: int) -> None:
        """``state`` to the quorum's member of rank ``joiner`` (this place's peer there); returns once it is sent,
        raises RuntimeError where the joiner is lost."""

    def receive(self, source: int, into: Any = None) -> Received:
        """The state the quorum's member of rank ``source`` sends; raises RuntimeError where it is lost (nothing
        half-received is given back), TornTransfer where it had begun writing into ``into``'s tensors. ``into``: a
        state of the same form (this member's own), whose tensors may receive the tensors at the same place, of the
        same shape and dtype, in place."""


class PGTransport:
    """StateTransport over the quorum's process group (a ProcessGroupGloo made directly over the store): a pickled
    skeleton, then the tensors in messages of about MESSAGE_BYTES (gloo moves one large message over loopback about
    twice as fast as many small ones: 0.8 against 0.4 GB/s measured here), a tensor larger than that alone. The
    group's own send and recv (allreduce.place_in: torch.distributed's blocking send refuses a group it did not
    make). It receives into new tensors (``into`` is not used). ``fault("send")``: called with half the messages
    sent, where a test kills the process."""

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

    def receive(self, source: int, into: Any = None) -> Received:
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


def advertised_host(coordinator: str) -> str:
    """The address a joiner gives its sources to connect to: where GLOO_SOCKET_IFNAME names interfaces (the quorums'
    process groups then use them), the first one's IPv4 address; else this host's address on its route to the
    coordinator (``HOST:PORT``), which the groups on other hosts reach it by as the coordinator does (read from a UDP
    socket connected there: nothing is sent). Not the host's name: a host whose name resolves to a loopback address
    (many do, in /etc/hosts) would send its peers to their own machine."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if interface:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:  # Linux's SIOCGIFADDR: the interface's address, at offset 20 of the struct ifreq it fills
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", interface[:15].encode()))
            except OSError as error:
                raise ValueError(f"GLOO_SOCKET_IFNAME={interface}: no IPv4 address on that interface "
                                 f"({error.strerror})") from None
        return socket.inet_ntoa(packed[20:24])
    host, _, port = coordinator.rpartition(":")
    try:
        family, _, _, _, where = socket.getaddrinfo(host.strip("[]") or "127.0.0.1", int(port),
                                                    type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(where)
            return probe.getsockname()[0]
    except (OSError, ValueError):  # no route there: the host's name, as gloo's default device takes it
        return socket.gethostname()


class SocketTransport:
    """StateTransport over a plain TCP connection between the two places, at the wire's speed: the joiner listens on
    a port the OS hands out and sends ``host:port`` over the quorum's process group (so a quorum's transfer needs no
    key of its own), the source connects and streams a pickled skeleton, then the tensors' bytes straight from their
    storage, message by message (messages_of), each followed by its CRC32: no torch.cat on the sender (a
    non-contiguous or GPU tensor alone is copied), and the receiver reads each tensor's bytes straight into the joiner's
    own tensor at its place in ``into`` (``destinations``), or a new one where it has none. A message whose checksum
    differs is refused (RuntimeError: the member aborts the quorum and asks again; TornTransfer where it had begun
    writing into ``into``: [Note: a torn transfer]); the checksums run in a thread beside the socket (zlib.crc32 lets
    the GIL go), so that they cost nothing while the next message moves. Every socket call waits at most the process
    group's timeout (the quorum's fault timeout): a peer killed or hung mid-transfer is a RuntimeError, never a joiner
    waiting for ever.
    ``host``: the name or address the source reaches this place by (the member passes advertised_host's; by default
    the host's name, as gloo's default device). ``fault("send")``: called with half the messages sent, where a test
    kills the process."""

    ADDRESS_BYTES = 320  # a padded ``host:port`` (a host name is at most 253 characters)

    def __init__(self, pg: Any, fault: Callable[[str], None] | None = None, host: str | None = None):
        self.pg, self.fault = pg, fault or (lambda point: None)
        self.host = host or socket.gethostname()
        self.timeout_s = pg.options._timeout.total_seconds()  # the member's set_timeout: the quorum's fault timeout

    def send(self, state: Any, joiner: int) -> None:
        skeleton, tensors = split_tensors(state)
        address = torch.zeros(self.ADDRESS_BYTES, dtype=torch.uint8)
        self.pg.recv([address], joiner, 0).wait()
        host, port = bytes(address.numpy()).rstrip(b"\0").decode().rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=self.timeout_s) as conn, \
                    concurrent.futures.ThreadPoolExecutor(1) as checksums:
                header = pickle.dumps(skeleton)
                conn.sendall(struct.pack("!QI", len(header), zlib.crc32(header)) + header)
                messages = messages_of(skeleton["tensors"])
                for n, message in enumerate(messages):
                    if n == len(messages) // 2:
                        self.fault("send")
                    views = [byte_view(tensors[i]) for i in message]
                    crc = checksums.submit(crc32, views)  # beside the socket: both let the GIL go
                    for view in views:
                        conn.sendall(view)
                    conn.sendall(struct.pack("!I", crc.result()))
                if not messages:
                    self.fault("send")
        except OSError as e:
            raise RuntimeError(f"the live state's transfer to rank {joiner} at {host}:{port} failed: {e!r}") from e

    def receive(self, source: int, into: Any = None) -> Received:
        started = time.perf_counter()
        dual = socket.has_dualstack_ipv6()
        with socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET,
                                  dualstack_ipv6=dual) as server:
            server.settimeout(self.timeout_s)
            address = f"{self.host}:{server.getsockname()[1]}".encode()
            self.pg.send([torch.frombuffer(bytearray(address.ljust(self.ADDRESS_BYTES, b"\0")), dtype=torch.uint8)],
                         source, 0).wait()
            written = [False]  # whether a byte went into ``into``'s tensors ([Note: a torn transfer])
            try:
                conn, _ = server.accept()
                with conn, concurrent.futures.ThreadPoolExecutor(1) as checksums:
                    conn.settimeout(self.timeout_s)
                    skeleton, tensors = read_stream(conn, checksums, into, written)
            except (OSError, RuntimeError) as e:
                why = f"the live state's transfer from rank {source} failed: {e!r}"
                raise (TornTransfer(f"{why}, after it had begun writing into this member's own state") if written[0]
                       else RuntimeError(why)) from e
        state, seconds = join_tensors(skeleton, tensors), time.perf_counter() - started
        return Received(state, int(sum(t.numel() * t.element_size() for t in tensors)), seconds)


def read_stream(conn: socket.socket, checksums: concurrent.futures.Executor, into: Any = None,
                written: list[bool] | None = None) -> tuple[dict[str, Any], list]:
    """What SocketTransport.send streams: the skeleton and its tensors, each read into its place in ``into``
    (``destinations``) or a new tensor, each message checked against its CRC32 (in ``checksums``' thread while the
    next message arrives); RuntimeError on a checksum that differs. ``written[0]`` is set once a byte goes into one
    of ``into``'s tensors."""
    length, expected = struct.unpack("!QI", read_exactly(conn, 12))
    header = read_exactly(conn, length)
    if zlib.crc32(header) != expected:
        raise RuntimeError("the live state's skeleton arrived corrupted (its CRC32 differs): refused")
    skeleton = pickle.loads(header)
    shapes = skeleton["tensors"]
    tensors = destinations(skeleton, into)
    checks = []
    for n, message in enumerate(messages_of(shapes)):
        views = []
        for i in message:
            if tensors[i] is None:
                tensors[i] = torch.empty(shapes[i][0], dtype=shapes[i][1])
            elif written is not None:
                written[0] = True
            views.append(byte_view(tensors[i]))
            read_exactly(conn, len(views[-1]), into=views[-1])
        expected = struct.unpack("!I", read_exactly(conn, 4))[0]
        checks.append((n, expected, checksums.submit(crc32, views)))
    for n, expected, crc in checks:
        if crc.result() != expected:
            raise RuntimeError(f"the live state's message {n} arrived corrupted (its CRC32 differs): refused")
    return skeleton, tensors


def destinations(skeleton: dict[str, Any], into: Any) -> list[torch.Tensor | None]:
    """For each tensor of the skeleton, the tensor at the same place of ``into`` (the same keys and positions) where
    it has the same shape and dtype and is contiguous on the CPU (its bytes then receive it in place); else None."""
    found: list[torch.Tensor | None] = [None] * len(skeleton["tensors"])

    def walk(item: Any, own: Any) -> None:
        if isinstance(item, TensorPlace):
            shape, dtype = skeleton["tensors"][item.index]
            if (torch.is_tensor(own) and tuple(own.shape) == shape and own.dtype == dtype and own.is_contiguous()
                    and own.device.type == "cpu" and found[item.index] is None):
                found[item.index] = own.detach()
        elif isinstance(item, dict) and isinstance(own, dict):
            for key, value in item.items():
                if key in own:
                    walk(value, own[key])
        elif isinstance(item, (list, tuple)) and isinstance(own, (list, tuple)):
            for value, mine in zip(item, own):
                walk(value, mine)
    if into is not None:
        walk(skeleton["body"], into)
    return found


def read_exactly(conn: socket.socket, count: int, into: memoryview | None = None) -> bytes | None:
    """``count`` bytes from ``conn`` (into ``into`` where given, without a copy); ConnectionError where the peer
    closes before."""
    buffer = memoryview(bytearray(count)) if into is None else into
    got = 0
    while got < count:
        n = conn.recv_into(buffer[got:], count - got)
        if n == 0:
            raise ConnectionError(f"the peer closed the connection with {count - got} of {count} bytes to come")
        got += n
    return bytes(buffer) if into is None else None


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes, without a copy where it is contiguous and on the CPU (any dtype: bf16 and bool too)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def crc32(views: list[memoryview]) -> int:
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    return crc


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
    places, and the tensors in that order; a tensor met again (the same memory, shape and strides: a tied weight
    under two names) takes its first number."""
    tensors: list[torch.Tensor] = []
    numbers: dict[tuple, int] = {}

    def walk(item: Any) -> Any:
        if torch.is_tensor(item):
            key = (item.device, item.data_ptr(), item.dtype, tuple(item.shape), item.stride())
            if item.numel() == 0 or key not in numbers:
                tensors.append(item)
                numbers[key] = len(tensors) - 1
                return TensorPlace(len(tensors) - 1)
            return TensorPlace(numbers[key])
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

