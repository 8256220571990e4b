"""The live state's transfer (replicas/transfer.py), between two threads of this process over a pair of gloo process
groups made on a TCPStore on a port the OS hands out: every dtype and odd shape round-trips bit for bit, into the
joiner's own tensors where it has them, a tied tensor once; a message corrupted on the wire is refused, and a source
that dies or hangs mid-transfer is a RuntimeError within the fault timeout, never a joiner waiting for ever (a
TornTransfer once it had begun writing into the joiner's own tensors)."""
import concurrent.futures
import socket
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import ProcessGroupGloo, TCPStore

import replicas
from replicas import transfer
from replicas.transfer import PGTransport, SocketTransport

TIMEOUT_S = 3.0  # the quorum's fault timeout here


def pair(timeout_s: float = TIMEOUT_S) -> list:
    """Two ranks' gloo process groups (rank 0: the source, rank 1: the joiner), their timeouts the fault timeout's."""
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    stores = [master, TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))]  # a client
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each rank its own client: one blocks while it waits
        groups = list(pool.map(lambda rank: ProcessGroupGloo(stores[rank], rank, 2, timedelta(seconds=10)), (0, 1)))
    for pg in groups:
        pg.set_timeout(timedelta(seconds=timeout_s))
    return groups


def move(kind, state, fault=None, timeout_s: float = TIMEOUT_S, into=None):
    """``state`` sent by rank 0 to rank 1 with transports of ``kind`` (received into ``into``'s tensors where they
    fit): (what rank 1 received or raised, what rank 0 raised or None, the receive's seconds)."""
    source, joiner = pair(timeout_s)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sent = pool.submit(kind(source, fault).send, state, 1)
        started = time.monotonic()
        try:
            received = pool.submit(kind(joiner).receive, 0, into).result(timeout=10 * timeout_s + 30)
        except RuntimeError as e:
            received = e
        seconds = time.monotonic() - started
        return received, sent.exception(timeout=10 * timeout_s + 30), seconds


def odd_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "float32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "float64": torch.randn(4, 3, dtype=torch.float64, generator=g).t(),  # non-contiguous
        "int64": torch.randint(-2**62, 2**62, (6,), dtype=torch.int64, generator=g),
        "uint8": torch.randint(0, 256, (3, 3, 3), dtype=torch.uint8, generator=g)[:, ::2],  # non-contiguous
        "bool": torch.rand(17, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "nested": [(torch.arange(10, dtype=torch.int32)[::3], "a leaf", 7), {"x": None}],
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
    }


def same_bits(a, b) -> bool:
    if torch.is_tensor(a):
        return (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy())
                == bytes(b.contiguous().reshape(-1).view(torch.uint8).numpy()))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("kind", [SocketTransport, PGTransport])
def test_every_dtype_and_odd_shape_round_trips_bit_for_bit(kind):
    state = odd_state()
    received, failed, _ = move(kind, state)
    assert failed is None and not isinstance(received, Exception), (failed, received)
    assert same_bits(state, received.state)
    assert received.bytes == sum(t.numel() * t.element_size() for t in transfer.split_tensors(state)[1])


def test_a_message_corrupted_on_the_wire_is_refused(monkeypatch):
    """One byte of the second message flipped between the source's sendall and the socket: the joiner raises a
    RuntimeError (the member then aborts the quorum and asks again) instead of loading it."""
    connect = socket.create_connection

    class Flipping:
        def __init__(self, conn):
            self.conn, self.large = conn, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.conn.close()

        def sendall(self, data):
            if len(data) > 64:  # a tensor's bytes, not a header or a checksum
                self.large += 1
                if self.large == 2:
                    data = bytearray(data)
                    data[len(data) // 2] ^= 0x10
            self.conn.sendall(data)

    monkeypatch.setattr(transfer.socket, "create_connection", lambda *a, **k: Flipping(connect(*a, **k)))
    received, _, _ = move(SocketTransport, odd_state())
    assert isinstance(received, RuntimeError) and "CRC32" in str(received), received


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_source_lost_mid_transfer_is_a_runtime_error_within_the_timeout(how):
    """The source's fault point "send" (half the messages sent): it dies there (its socket closed: what a SIGKILL
    does) or hangs there past the fault timeout. The joiner raises RuntimeError, at once or within the timeout."""
    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(4)}
    transfer.MESSAGE_BYTES, saved = 4000, transfer.MESSAGE_BYTES  # one tensor a message: 4 messages
    hang = concurrent.futures.Future()

    def fault(point):
        assert point == "send"
        if how == "dies":
            raise ConnectionAbortedError("killed at the fault point")
        hang.result(timeout=3 * TIMEOUT_S)  # hung past the fault timeout

    try:
        received, _, seconds = move(SocketTransport, state, fault)
    finally:
        transfer.MESSAGE_BYTES = saved
        hang.set_result(None)
    assert isinstance(received, RuntimeError), received
    assert seconds < (2 if how == "dies" else TIMEOUT_S + 2), seconds


def test_the_joiners_own_tensors_receive_in_place_and_a_tied_tensor_travels_once():
    """Each tensor whose place in ``into`` holds a contiguous tensor of its shape and dtype lands in that tensor's
    memory (no new one); the others (another shape, a place ``into`` lacks) are new; all bit for bit. A tensor under
    two names (a tied weight) is sent once and received as one."""
    g = torch.Generator().manual_seed(5)
    tied = torch.randn(6, 4, generator=g)
    state = {"model": {"embed": tied, "head": tied, "bias": torch.randn(4, generator=g)},
             "moments": [torch.randn(3, generator=g).to(torch.bfloat16), torch.randn(2, 2, generator=g)],
             "step": 7}
    own_embed, own_head, own_bias = torch.zeros(6, 4), torch.zeros(6, 4), torch.zeros(5)  # bias: another shape
    own_moment = torch.zeros(3, dtype=torch.bfloat16)
    into = {"model": {"embed": own_embed, "head": own_head, "bias": own_bias}, "moments": [own_moment]}
    received, failed, _ = move(SocketTransport, state, into=into)
    assert failed is None and not isinstance(received, Exception), (failed, received)
    assert same_bits(state, received.state)
    got = received.state
    assert got["model"]["embed"].data_ptr() == own_embed.data_ptr() and torch.equal(own_embed, tied)
    assert got["model"]["head"] is got["model"]["embed"]  # once: the head's place is the embedding's tensor
    assert got["moments"][0].data_ptr() == own_moment.data_ptr()
    assert got["model"]["bias"].data_ptr() != own_bias.data_ptr() and not own_bias.any()
    assert received.bytes == sum(t.numel() * t.element_size() for t in (tied, state["model"]["bias"],
                                                                        *state["moments"]))


@pytest.mark.parametrize("into", [False, True])
def test_a_transfer_lost_after_writing_into_the_joiners_state_is_torn(into):
    """The source dies with half the messages sent: received into new tensors, a RuntimeError (the joiner asks
    again, its state intact); into its own tensors, a TornTransfer (its group stops and restarts from its
    checkpoints: [Note: a torn transfer])."""
    state = {f"t{i}": torch.full((1000,), float(i + 1)) for i in range(4)}
    own = {f"t{i}": torch.zeros(1000) for i in range(4)}
    transfer.MESSAGE_BYTES, saved = 4000, transfer.MESSAGE_BYTES

    def fault(point):
        raise ConnectionAbortedError("killed at the fault point")
    try:
        received, _, _ = move(SocketTransport, state, fault, into=own if into else None)
    finally:
        transfer.MESSAGE_BYTES = saved
    assert isinstance(received, RuntimeError), received
    assert isinstance(received, transfer.TornTransfer) == into, received
    assert own["t0"].eq(0).all() != into  # the first message had landed in the joiner's own tensor


def this_hosts_address() -> str | None:
    """This host's address on its default route (a UDP socket's, connected: nothing is sent), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # (TEST-NET-1: any address off this host)
        except OSError:
            return None
        return probe.getsockname()[0]


def test_a_joiner_gives_its_sources_the_address_it_reaches_the_coordinator_from(monkeypatch):
    """advertised_host: the joiner's address on its route to the coordinator, not its host's name (which here
    resolves to a loopback address: a source on another host would connect to itself); GLOO_SOCKET_IFNAME's
    interface where set; an interface without an address refused in one line, by the member too, before it
    connects."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert transfer.advertised_host("127.0.0.1:29500") == "127.0.0.1"
    assert transfer.advertised_host("[::1]:29500") in ("::1", socket.gethostname())  # (a host without IPv6)
    address = this_hosts_address()
    if address is not None and not address.startswith("127."):
        assert transfer.advertised_host(f"{address}:29500") == address
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
        assert transfer.advertised_host(f"{address}:29500") == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0,lo")
    with pytest.raises(ValueError, match="^GLOO_SOCKET_IFNAME=nosuch0: no IPv4 address on that interface"):
        transfer.advertised_host("127.0.0.1:29500")
    with pytest.raises(replicas.ReplicaRefused, match="^replica group 1: GLOO_SOCKET_IFNAME=nosuch0"):
        replicas.Replica("127.0.0.1:1", 1, 2, "identity", dict, lambda state: None)
