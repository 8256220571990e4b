"""A member's liveness, as the coordinator sees it: its heartbeat (Heartbeat: a key set every HEARTBEAT_S, which a
hung process stops setting) and its death, known at once: each member holds a TCP connection to the coordinator for
its life, and the lighthouse takes a connection closed as the process gone, without waiting STALE_S for its
heartbeat to go silent.

    server = LivenessServer(store, host)     # the coordinator's (Lighthouse): a thread, its port in the store
    link = open_link(store, address, key, incarnation)   # a member's (Heartbeat): one connection, open until it dies
    server.closed(key, incarnation)           # True once that process's connection closed

Why: a member SIGKILLed mid-step makes the survivors' average fail at once (their connections to it reset), but the
next quorum waited until the dead process's heartbeat had been silent for STALE_S (1 s): most of the survivors'
stall per kill. The kernel closes every socket of a process that dies, however it dies, so the coordinator sees the
end of the stream within a round trip. A hung process (SIGSTOP, starved) keeps its connection open: it is found by
its silence, given the fault timeout, as a quorum's member silent mid-step is ([Note: hung or gone] in
coordinator.py). A member that cannot reach the server (a coordinator without one, a firewall) is watched by its
heartbeat alone.

The wire: the member sends one line, ``KEY INCARNATION\\n`` (its heartbeat's key and incarnation), then nothing; the
server reads until the end of the stream. A coordinator restarted on its address has a new server, which the
members' heartbeats reach again as they reconnect (Heartbeat, below)."""
from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from typing import Any

from replicas.protocol import HEARTBEAT_S, PREFIX, connect, one_line, reconnect

KEY = PREFIX + "liveness"  # the server's port, in the store


class LivenessServer:
    """The coordinator's side (module docstring): one thread that accepts the members' connections and notes when
    each one ends."""

    def __init__(self, store: Any, host: str = "0.0.0.0"):
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.lock = threading.Lock()
        self.ended: dict[tuple[str, str], float] = {}  # (key, incarnation) -> when its connection closed
        self.open: set[tuple[str, str]] = set()  # (key, incarnation) whose connection is open now
        self.pending: dict[socket.socket, bytes] = {}  # a connection whose line has not all arrived -> its bytes
        self.named: dict[socket.socket, tuple[str, str]] = {}
        self.stop = threading.Event()
        store.set(KEY, str(self.listener.getsockname()[1]))
        self.thread = threading.Thread(target=self._serve, name="replica-liveness", daemon=True)
        self.thread.start()

    def closed(self, key: str, incarnation: str) -> bool:
        """Whether the process of that heartbeat key and incarnation has closed its connection (it is gone)."""
        with self.lock:
            return (key, incarnation) in self.ended

    def connected(self, key: str, incarnation: str) -> bool:
        """Whether that process holds its connection open now: alive, however long its heartbeat has been silent (a
        process stopped or starved of CPU keeps it; one that died cannot)."""
        with self.lock:
            return (key, incarnation) in self.open

    def _serve(self) -> None:
        while not self.stop.is_set():
            for ready, _ in self.selector.select(timeout=0.1):
                if ready.fileobj is self.listener:
                    try:
                        conn, _ = self.listener.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    self.pending[conn] = b""
                    self.selector.register(conn, selectors.EVENT_READ)
                else:
                    self._read(ready.fileobj)

    def _read(self, conn: Any) -> None:
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if conn in self.pending and data:
            self.pending[conn] += data
            if b"\n" in self.pending[conn]:
                line = self.pending.pop(conn).split(b"\n", 1)[0].decode(errors="replace").split()
                if len(line) == 2:
                    self.named[conn] = (line[0], line[1])
                    with self.lock:
                        self.open.add(self.named[conn])
            return
        if data:  # nothing more is expected of a member
            return
        self.selector.unregister(conn)
        conn.close()
        self.pending.pop(conn, None)
        name = self.named.pop(conn, None)
        if name is not None:
            with self.lock:
                self.ended[name] = time.monotonic()
                self.open.discard(name)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for conn in list(self.pending) + list(self.named):
            conn.close()
        self.listener.close()
        self.selector.close()


def open_link(store: Any, address: str, key: str, incarnation: str, timeout_s: float = 5.0) -> socket.socket | None:
    """A member's connection to the coordinator's LivenessServer (its host from ``address``, HOST:PORT; its port
    from the store), named by its heartbeat key and incarnation; None where the coordinator has none or it cannot be
    reached (the heartbeat alone watches this process then)."""
    try:
        if not store.check([KEY]):
            return None
        port = int(store.get(KEY))
        host = address.rpartition(":")[0] or "127.0.0.1"
        link = socket.create_connection((host, port), timeout=timeout_s)
        link.sendall(f"{key} {incarnation}\n".encode())
        return link
    except (OSError, RuntimeError, ValueError):
        return None


class Heartbeat:
    """A thread that sets this process's heartbeat key every HEARTBEAT_S, on a store client of its own, to
    INCARNATION/COUNT (a restarted process told from the one it replaced), beside a connection held open to the
    coordinator for the process's life (open_link: its death seen at once). The coordinator lost, it beats to the
    next one at the address, if one comes within the fault timeout (else ``lost`` says why)."""

    def __init__(self, address: str, key: str, timeout_s: float, incarnation: str = "", fault_timeout_s: float = 60.0):
        self.store, self.key, self.incarnation = connect(address, timeout_s), key, incarnation
        self.address, self.fault_timeout_s = address, fault_timeout_s
        self.stop, self.lost = threading.Event(), None
        self.carried: tuple[str, str] | None = None  # a key set again on every new coordinator (the run's end)
        self.store.set(key, f"{incarnation}/0")
        self.link = open_link(self.store, address, key, incarnation)
        self.thread = threading.Thread(target=self._beat, name="replica-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        beats = 0
        while not self.stop.wait(HEARTBEAT_S):
            beats += 1
            try:
                self.store.set(self.key, f"{self.incarnation}/{beats}")
            except RuntimeError as error:  # the coordinator is gone: wait for the next one
                self.store = reconnect(self.address, self.fault_timeout_s)
                if self.store is None:  # not back in time: the main thread says so at its next call
                    self.lost = one_line(error)
                    return
                self._relink()
                if self.carried is not None:  # the new coordinator's store knows nothing of it (lost again at
                    with contextlib.suppress(RuntimeError):  # once: the next beat fails and reconnects)
                        self.store.compare_set(self.carried[0], "", self.carried[1])

    def _relink(self) -> None:
        """The liveness connection to a new coordinator (the lost one's closed with it)."""
        if self.link is not None:
            self.link.close()
        self.link = open_link(self.store, self.address, self.key, self.incarnation)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        if self.link is not None:
            self.link.close()
