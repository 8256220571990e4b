"""Warm restarts (--warm-restarts): a worker that torchrun restarts is forked from a process that has already imported
torch and the trainer, instead of importing them again.

torchrun restarts a failed worker group by starting its processes afresh. On 2 CPU cores a fresh trainer spends about
2.1-2.4 s importing torch and the trainer, and 1.0 s more importing torch._dynamo (torch.optim's first
add_param_group does), before it can ask its replica groups' coordinator to join: seconds its replica group is away,
and CPU that the groups still training lose to it. So the first start of each local rank, once its imports are done
and while it is still one thread, forks a *zygote* (``keep_zygote``): a process that imports what the run will import
later (PRELOAD), then only waits on a Unix socket named by its torchrun agent and local rank. A restart of that rank
(``serve_restart``, at the script's start, before torch is imported) is a thin process: it sends the zygote its
command line, its environment, its working folder and its standard streams (the descriptors themselves,
SCM_RIGHTS), and the zygote forks a child that takes them on and goes on from the script's ``keep_zygote`` call as a
fresh start would from there: into ``main()``, nothing of a run done yet (the zygote never runs one).

    torchrun --nproc-per-node P --max-restarts K ddp_cifar100.py --warm-restarts FLAGS

The thin process stays what torchrun watches: it passes torchrun's signals on to the child and ends as the child did
(its exit code, or killed by the same signal), so torchrun's restarts, --max-restarts and its stop of a failed group
are as they were; if the thin process is killed, the child kills itself (it watches it through a pidfd), and if the
zygote is killed, the thin process kills the child and fails (it can no longer learn how the child ends). A restart is
served only if it is the same command with the same environment as the first start's but for the variables torchrun
sets per attempt (PER_ATTEMPT): a variable read while torch is imported (OMP_NUM_THREADS, ATEN_CPU_CAPABILITY,
TORCH_CPP_LOG_LEVEL) could otherwise differ from what the child has. A restart not served (no zygote: the agent's
first attempt failed before forking one; another environment) starts cold, as without the flag.

Why a fork is safe here: a fork copies only the calling thread, so a lock another thread held stays held in the
child forever, and OpenMP's pool does not survive a fork; the zygote is forked only from a process that is a single
thread (with OMP_NUM_THREADS unset, importing torch already starts one more thread: then warm restarts are off, said
in one line). The zygote's own children share its memory copy-on-write. Python reseeds ``random`` in a forked child;
torch's generators are seeded by the trainer. Only this torchrun agent's own processes of this user are served
(SO_PEERCRED). The zygote ends with its agent, once no child of its own is running.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import select
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any

import trainer

FLAG = "--warm-restarts"
PRELOAD = ("torch._dynamo", "torch.distributed.checkpoint")  # imported later by every run: torch.optim, a DCP save
PER_ATTEMPT = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
               "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
ENVIRONMENT_AT_START = dict(os.environ)  # this module is imported before the script's first line that sets any


def address(agent: int, local_rank: int | str) -> str:
    """The zygote's socket: Linux's abstract namespace (no file to remove), named by the agent's PID and the rank."""
    return f"\0ddp_cifar100-warm-start/{os.getuid()}/{agent}/{local_rank}"


def _requested(argv: list[str]) -> bool:
    """--warm-restarts given, under a torchrun agent that may restart this process."""
    return FLAG in argv[1:] and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0


def _attempt() -> int:
    """torchrun's attempt of this worker: 0 for the first start, N for its Nth restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _comparable(environment: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environment.items() if k not in PER_ATTEMPT and not k.startswith("TORCHELASTIC_")}


# ----------------------------------------------------------------------------------------------------------
# the messages: a 4-byte length, then JSON; a request carries the three standard streams' descriptors
# ----------------------------------------------------------------------------------------------------------
def _send(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    data = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):  # (not an empty send: the peer may have answered and closed already, EPIPE)
        sock.sendall(data[sent:])


def _receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) at the end of the connection."""
    data, fds = b"", []
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        chunk, more, _, _ = socket.recv_fds(sock, 1 << 16, max_fds) if max_fds and not fds else (sock.recv(1 << 16),
                                                                                                    [], 0, None)
        fds += more
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None, []
        data += chunk
    return json.loads(data[4:]), fds


# ----------------------------------------------------------------------------------------------------------
# a restart: the thin process
# ----------------------------------------------------------------------------------------------------------
def serve_restart(argv: list[str], started: float) -> None:
    """At the script's start, before torch is imported: a restart of a --warm-restarts torchrun is forked by its
    zygote, and this process waits for that child and ends as it did (never returns). Returns at once otherwise
    (not asked, the first attempt, no zygote, a zygote that refuses): this process starts cold."""
    if not _requested(argv) or _attempt() == 0:
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # held until they can be passed on to the child
    try:
        sock.connect(address(os.getppid(), os.environ.get("LOCAL_RANK", "0")))
        _send(sock, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "started": started}, (0, 1, 2))
        answer, _ = _receive(sock)
    except OSError:
        answer = None
    if answer is None or "pid" not in answer:
        sock.close()
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # (one that came meanwhile acts now, as on a cold start)
        if answer is not None:
            _note(argv, f"{FLAG}: this restart starts cold: {answer['refused']}")
        return
    child = answer["pid"]
    for sig in FORWARDED:  # torchrun's stop of the group (SIGTERM to this process's group), a user's ^C
        signal.signal(sig, lambda number, _: os.kill(child, number))
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    status, _ = _receive(sock)  # (a signal's handler runs, and the wait goes on: PEP 475)
    if status is None:  # the zygote is gone (killed): the child's end is unknown, and none may outlive this process
        print(f"{os.path.basename(argv[0])}: error: {FLAG}: the zygote that forked this worker is gone",
              file=sys.stderr, flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        os._exit(1)
    code = status["code"]
    if code < 0:  # killed: by the same signal, so that torchrun sees the same failure
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # (their handlers cannot be set: they are the default)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal whose default is to go on (SIGCHLD, SIGWINCH): the shell's code for it
    os._exit(code)


# ----------------------------------------------------------------------------------------------------------
# the first start: the zygote
# ----------------------------------------------------------------------------------------------------------
def keep_zygote(argv: list[str], preload: tuple[str, ...] = PRELOAD) -> dict[str, Any] | None:
    """In the first start of a --warm-restarts torchrun's worker, after the script's imports: import ``preload``,
    fork the zygote, and return None here (the worker goes on with its run). In a child the zygote forked for a
    restart, return the request it was forked for, the process now that restart's (streams, environment, command
    line, folder), after a line on rank 0's stderr."""
    if not _requested(argv) or _attempt() != 0:
        return None
    for name in preload:
        __import__(name)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child of such a process cannot use CUDA
        _note(argv, f"{FLAG} is off: CUDA was initialized before the zygote could be forked")
        return None
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        _note(argv, f"{FLAG} is off: this process runs {threads} threads after its imports, and only one thread "
                    f"can be forked safely (OMP_NUM_THREADS=1 keeps torch's import to one)")
        return None
    # what the script's first lines set before importing torch: the child sets it again over the restart's own
    changed = {k: v for k, v in os.environ.items() if ENVIRONMENT_AT_START.get(k) != v}
    expected = {"argv": argv, "env": _comparable(ENVIRONMENT_AT_START)}
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() != 0:
        return None
    try:  # the zygote: a new session, so that torchrun's stop of this worker's process group does not reach it
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        request = _Zygote(os.getppid(), expected, changed).serve()
    except BaseException:  # noqa: BLE001 - nothing of the zygote's may run on in the worker's code
        os._exit(0)
    if request is None:
        os._exit(0)
    _note(argv, f"restart {_attempt()} is warm: forked by the zygote "
                f"{trainer.FORKED - trainer.STARTED:.2f} s after its start")
    return request


def _note(argv: list[str], line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"{os.path.basename(argv[0])}: note: {line}", file=sys.stderr, flush=True)


class _Zygote:
    """Waits for restarts of its local rank and forks one child per restart; tells each restart's thin process
    the child's PID, then how it ended. Ends when its agent has ended and no child of its own runs."""

    def __init__(self, worker: int, expected: dict[str, Any], changed: dict[str, str]):
        self.agent = _parent(worker)
        self.expected, self.changed = expected, changed
        self.children: dict[int, tuple[int, socket.socket, int]] = {}  # pidfd -> child, its thin process's
        # connection (only the zygote holds it: the thin process sees its end if the zygote dies) and PID
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(address(self.agent, os.environ.get("LOCAL_RANK", "0")))  # taken: another zygote
        self.listener.listen(8)
        self.agent_fd = os.pidfd_open(self.agent)

    def serve(self) -> dict[str, Any] | None:
        """Returns only in a forked child (its request); None once the zygote is to end."""
        self.selector.register(self.listener, selectors.EVENT_READ, "listener")
        self.selector.register(self.agent_fd, selectors.EVENT_READ, "agent")
        agent_alive = True
        while agent_alive or self.children:
            for key, _ in self.selector.select():
                if key.data == "agent":
                    agent_alive = False
                    self.selector.unregister(self.agent_fd)
                elif key.data == "listener":
                    request = self._accept()
                    if request is not None:
                        return request
                else:
                    self._reap(key.fileobj)
        return None

    def _accept(self) -> dict[str, Any] | None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(10)
            try:
                pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  struct.calcsize("3i")))
                message, fds = _receive(conn, max_fds=3) if uid == os.getuid() else (None, [])
            except OSError:
                return None
            try:
                if message is None:
                    return None
                if "who" in message:  # a fault injector asks which process a thin process stands for
                    _send(conn, {"pid": next((c for c, _, thin in self.children.values() if thin == message["who"]),
                                             None)})
                    return None
                why = self._refusal(pid, message, fds)
                if why is not None:
                    _send(conn, {"refused": why})
                    return None
                child = os.fork()
                if child == 0:
                    try:
                        conn.close()  # the zygote's alone: the thin process sees its end if the zygote dies
                        return self._become(message, fds, pid)
                    except BaseException:  # noqa: BLE001 - a child that cannot become the restart fails as one
                        traceback.print_exc()  # on the restart's stderr, once it has it
                        sys.stderr.flush()
                        os._exit(70)
                pidfd = os.pidfd_open(child)
                self.children[pidfd] = (child, socket.socket(fileno=conn.detach()), pid)  # kept for the child's end
                self.selector.register(pidfd, selectors.EVENT_READ, "child")
                _send(self.children[pidfd][1], {"pid": child})
                return None
            except OSError:
                return None
            finally:
                for fd in fds:
                    os.close(fd)
                fds.clear()

    def _refusal(self, pid: int, message: dict[str, Any], fds: list[int]) -> str | None:
        if _parent(pid) != self.agent:
            return "not a worker of this torchrun agent"
        if len(fds) != 3:
            return "no standard streams"
        if message.get("argv") != self.expected["argv"]:
            return "another command line"
        if _comparable(message.get("env", {})) != self.expected["env"]:
            return "another environment"
        return None

    def _reap(self, pidfd: int) -> None:
        child, conn, _ = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(child, 0)
        try:
            _send(conn, {"code": os.waitstatus_to_exitcode(status)})
        except OSError:  # the thin process is gone (killed: the child killed itself)
            pass
        conn.close()

    def _become(self, request: dict[str, Any], fds: list[int], thin: int) -> dict[str, Any]:
        """In the forked child: leave the zygote's sockets, take on the restart's streams, environment, folder and
        command line; die with the thin process."""
        self.selector.close()
        self.listener.close()
        os.close(self.agent_fd)
        for pidfd, (_, other, _) in self.children.items():
            os.close(pidfd)
            other.close()
        os.setsid()
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        fds.clear()
        sys.stdin, sys.stdout, sys.stderr = (_stream(0, sys.stdin), _stream(1, sys.stdout), _stream(2, sys.stderr))
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**request["env"], **self.changed})
        sys.argv = list(request["argv"])
        trainer.STARTED, trainer.FORKED = request["started"], time.time()  # its clock: its thin process's start
        try:
            watched = os.pidfd_open(thin)
        except ProcessLookupError:  # gone already
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=_die_with, args=(watched,), name="warm-start: the thin process", daemon=True).start()
        return request


def _parent(pid: int) -> int:
    """A process's parent's PID (/proc/PID/stat: the field after the state, past the command's parenthesis)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _die_with(pidfd: int) -> None:
    """The child's watch on its thin process: its end (the thin process killed) kills the child."""
    select.select([pidfd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def _stream(fd: int, old: Any) -> io.TextIOWrapper:
    """A standard stream over descriptor ``fd`` as Python makes it at a start: stdout line-buffered on a terminal,
    stderr always line-buffered, both unbuffered as the zygote's were (-u, PYTHONUNBUFFERED: the same command and
    environment)."""
    raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
    if fd == 0:
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=old.encoding, errors=old.errors)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding=old.encoding, errors=old.errors,
                            line_buffering=fd == 2 or os.isatty(fd), write_through=old.write_through)


def served(agent: int, local_rank: int, thin: int) -> int | None:
    """The PID of the child a zygote forked for thin process ``thin`` (a restart of local rank ``local_rank`` of
    torchrun agent ``agent``), or None (none: the thin process is the worker itself, or it is not served yet)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect(address(agent, local_rank))
        _send(sock, {"who": thin})
        answer, _ = _receive(sock)
    except OSError:
        return None
    finally:
        sock.close()
    return None if answer is None else answer.get("pid")


def zygote(agent: int, local_rank: int) -> int | None:
    """The PID of the zygote of local rank ``local_rank`` of torchrun agent ``agent`` (the peer of its socket), or None
    where there is none (a benchmark reads its memory)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address(agent, local_rank))
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return None
    finally:
        sock.close()
    return pid
