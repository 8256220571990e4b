"""Goodput under faults: the byte GPT (--model gpt) on 4 MB of the standard library's source, 3 replicas, one SIGKILL
of a random replica every --kill-every seconds (30) during the first --seconds (300), on one fault schedule, three
ways:

- ours: the fault-tolerant replica groups of replicas/ (3 torchruns of 1 process, a coordinator): the survivors go on,
  a restarted group, forked warm by its zygote (--warm-restarts), takes the live state from one of them
  (benchmarks/replica_runs.py); ``ours-cold``, run only when named, is the same without --warm-restarts;
- elastic: one torchrun of 3 processes with --max-restarts and --checkpoint-every 25, as the trainer is run today:
  every fault restarts every process, which resume from the last checkpoint and redo the steps since it;
- torchft: torchft 0.2.0 itself (its Manager, its Lighthouse, its ProcessGroupGloo, its HTTP checkpoint transport),
  the same model, data and optimizer, installed in this benchmark's own folder (--torchft-dir), not in
  requirements.txt (pip install --target; it needs opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http).

Each way runs the same --steps once without faults and once with them, in this call; the kills stop once its last
step is committed (ours, torchft: their commit logs; elastic: once its processes end). Per fault (ours, torchft): the
survivors' stall (their last committed step before the kill to the first after it), the steps they took again, and
the killed group's time to its first committed step after the kill, split into the process's start, its quorum
and its state transfer (torchft's Manager reports the last two together). Over a run: goodput, committed samples
per second against the same way's run without faults, and the final validation loss. Writes
results/faults-<machine>.json (``--out``); the report plots it.

    python3 -m benchmarks.fault_benchmark [--seconds 300] [--kill-every 30] [--steps 420] [--ways ours,elastic,torchft]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks.replica_runs import ROOT, ReplicaRun
from files import write_json
from measure.machine import child_pids, machine_info, machine_tag
from measure.memory import proc_status_mb
from measure.summary import median
from replicas import STALE_S

PROG = "fault_benchmark"
TORCHFT = ["torchft==0.2.0", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"]
WAYS = ("ours", "elastic", "torchft", "ours-cold")  # ours-cold (not run unless named): ours without --warm-restarts


def recipe(steps: int, text: str) -> list[str]:
    """The byte GPT's run every way trains: AdamW, 8 windows of 128 bytes per process and step, on ``text``."""
    return ["--device", "cpu", "--dataset", "text", "--data-dir", text, "--model", "gpt", "--val-fraction", "0.01",
            "--batch-size", "8", "--optimizer", "adamw", "--lr", "1e-3", "--weight-decay", "0.1", "--epochs", "1000",
            "--max-steps", str(steps), "--seed", "0", "--timeout", "120"]


def text_folder(root: str, megabytes: float = 4.0) -> str:
    """The standard library's .py files, in path order, up to ``megabytes``: the corpus every way reads (the whole
    of it takes a restarted process tens of seconds to read, which would measure the disk, not the recovery)."""
    from data import default_text_dir
    source, folder, total = default_text_dir(), os.path.join(root, "text"), 0
    for directory, _, files in sorted(os.walk(source)):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(directory, name)
            target = os.path.join(folder, os.path.relpath(path, source))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(path, "rb") as f, open(target, "wb") as out:
                total += out.write(f.read())
            if total > megabytes * 1e6:
                return folder
    return folder


def schedule(args: argparse.Namespace) -> list[tuple[float, int]]:
    """(seconds after the start, which replica): one kill every --kill-every seconds during --seconds."""
    rng = random.Random(args.seed)
    return [(t, rng.randrange(args.groups)) for t in range(args.kill_every, args.seconds + 1, args.kill_every)]


def killing(faults: list[tuple[float, int]], kill: Any, done: Any, started: float) -> list[dict[str, Any]]:
    """Run the schedule against a run until it is done (``done()``: its last step committed, where the way logs its
    steps; else its processes ended); each kill's time and target. A kill after the last step would cost a restart
    that trains nothing (the group is told the run finished), counted in the run's wall time."""
    record = []
    for at, target in faults:
        while not done() and time.time() - started < at:
            time.sleep(0.05)
        if done():
            return record
        pids = kill(target)
        record.append({"at_s": time.time() - started, "at": time.time(), "replica": target, "pids": pids})
    return record


# ----------------------------------------------------------------------------------------------------------
# ours
# ----------------------------------------------------------------------------------------------------------
def run_ours(args: argparse.Namespace, workdir: str, faults: list[tuple[float, int]], warm: bool = True
             ) -> dict[str, Any]:
    run = ReplicaRun(workdir, args.groups, recipe(args.steps, args.text), fault_timeout_s=10, max_restarts=100,
                     warm=warm)
    started = time.time()
    try:
        run.start()
        kills = killing(faults, lambda g: run.signal(g, signal.SIGKILL), lambda: all(
            a.poll() is not None for a in run.agents.values()) or any(
            last_step(run.path(g, "log")) >= args.steps - 1 for g in range(args.groups)), started)
        codes = run.wait(args.timeout)
    finally:
        run.close()
    wall = time.time() - started
    logs = {g: run.committed(g, steps_only=False) for g in range(args.groups)}
    committed = union_of_steps([e for e in logs[g] if "step" in e] for g in logs)
    metrics = read_json(run.path(0, "metrics"))
    return {"wall_s": wall, "codes": codes, "steps": len(committed), "warm_restarts": warm,
            "failed_outputs": {str(g): run.output(g)[-4000:] for g, code in codes.items() if code != 0},
            "samples": sum(len(e["participants"]) for e in committed) * 8,
            "final_val_loss": metrics.get("val_loss") if metrics else None,
            "faults": [fault_figures(k, committed, logs, started) for k in kills]}


def fault_figures(kill: dict[str, Any], committed: list[dict[str, Any]], logs: dict[int, list], started: float
                  ) -> dict[str, Any]:
    """A kill's figures from the commit logs: the survivors' stall and the steps they took again; the killed
    group's time to its first committed step, and its parts (start, imports, build, quorum, transfer: its recovery
    note)."""
    at, group = kill["at"], kill["replica"]
    before = [e for e in committed if e["time"] <= at]
    after = [e for e in committed if e["time"] > at]
    back = next((e for e in after if group in e["participants"]), None)
    # its recovery between the kill and its first step back, as any group's log kept it (a restart cuts the group's
    # own log back to its checkpoint, notes included; a later recovery's note would be another fault's)
    notes = [n["recovered"] for log in logs.values() for n in log if "recovered" in n
             and n["recovered"]["group"] == group and at < n["recovered"]["asked"]
             and (back is None or n["recovered"]["asked"] <= back["time"])]
    figures = {"at_s": kill["at_s"], "replica": group,
               "stall_s": after[0]["time"] - before[-1]["time"] if before and after else None,
               "steps_again": (before[-1]["step"] + 1 - after[0]["step"]) if before and after else None,
               "rejoined_s": back["time"] - at if back else None}
    if notes:
        note = notes[0]
        figures.update(start_s=note["started"] - at, quorum_s=note["quorum_s"], transfer_s=note["transfer_s"],
                       transfer_bytes=note["bytes"], asked_s=note["asked"] - at)
        # the restart's timeline, seconds after the kill: its imports done (torch's), built (the optimizer's first
        # use imports torch._dynamo) and its checkpoint read, connected to the coordinator
        figures.update({f"{name}_s": note[name] - at for name in ("imported", "built", "connected") if name in note})
    return figures


def union_of_steps(logs: Any) -> list[dict[str, Any]]:
    """Every committed step once, from the groups' commit logs, in step order: a group that joined late (or was
    restarted) holds only the steps since, so no one log is the run's; each step as the first group that logged it."""
    steps: dict[int, dict[str, Any]] = {}
    for log in logs:
        for entry in log:
            steps.setdefault(entry["step"], entry)
    return [steps[step] for step in sorted(steps)]


# ----------------------------------------------------------------------------------------------------------
# torchrun's elastic restart
# ----------------------------------------------------------------------------------------------------------
def run_elastic(args: argparse.Namespace, workdir: str, faults: list[tuple[float, int]]) -> dict[str, Any]:
    """One torchrun of --groups processes (the same global batch), --checkpoint-every 25, restarted whole."""
    metrics = os.path.join(workdir, "metrics.json")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.groups),
            "--max-restarts", "100", "--monitor-interval", "0.1", "ddp_cifar100.py", *recipe(args.steps, args.text),
            "--checkpoint-dir", os.path.join(workdir, "checkpoints"), "--checkpoint-every", "25",
            "--metrics-out", metrics]
    agent = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in agent.stdout), daemon=True)
    reader.start()
    started = time.time()

    def kill(rank: int) -> list[int]:
        workers = child_pids(agent.pid)
        if rank < len(workers):
            os.kill(sorted(workers)[rank], signal.SIGKILL)
            return [sorted(workers)[rank]]
        return []
    try:
        kills = killing(faults, kill, lambda: agent.poll() is not None, started)
        agent.wait(timeout=args.timeout)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        reader.join(timeout=5)
    resumed = [(t, line) for t, line in lines if line.startswith("resuming from")]
    for kill_ in kills:
        after = next(((t, line) for t, line in resumed if t > kill_["at"]), None)
        kill_.update(restart_s=after[0] - kill_["at"] if after else None,
                     resumed_step=int(after[1].rsplit("optimizer step", 1)[1]) if after else None)
    figures = read_json(metrics)
    return {"wall_s": time.time() - started, "code": agent.returncode, "steps": args.steps,
            "samples": args.steps * 8 * args.groups, "restarts": len(resumed),
            "final_val_loss": figures.get("val_loss") if figures else None,
            "faults": [{k: v for k, v in f.items() if k != "pids"} for f in kills]}


# ----------------------------------------------------------------------------------------------------------
# torchft
# ----------------------------------------------------------------------------------------------------------
def install_torchft(folder: str) -> str | None:
    """torchft and what it needs, in ``folder`` (pip install --target), once; None, or why it cannot be had."""
    if os.path.exists(os.path.join(folder, "torchft", "__init__.py")):
        return None
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", folder, "--no-deps",
                           *TORCHFT[:1]], capture_output=True, text=True)
    if done.returncode == 0:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", folder, *TORCHFT[1:]],
                              capture_output=True, text=True)
    return None if done.returncode == 0 else " ".join((done.stderr or done.stdout).split())[-300:]


def run_torchft(args: argparse.Namespace, workdir: str, faults: list[tuple[float, int]]) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([args.torchft_dir, ROOT]))
    port = free_port()
    # its console script (the Rust lighthouse reads the process's own arguments), with our liveness threshold
    lighthouse = subprocess.Popen([os.path.join(args.torchft_dir, "bin", "torchft_lighthouse"), "--min_replicas", "1",
                                   "--quorum_tick_ms", "100", "--join_timeout_ms", "10000", "--heartbeat_timeout_ms",
                                   str(int(1000 * STALE_S)), "--bind", f"127.0.0.1:{port}"], env=env,
                                  stdout=open(os.path.join(workdir, "lighthouse.log"), "w"), stderr=subprocess.STDOUT)
    agents: dict[int, subprocess.Popen] = {}
    started = time.time()
    try:
        time.sleep(2)
        for g in range(args.groups):
            log = open(os.path.join(workdir, f"group-{g}.log"), "w")
            agents[g] = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                 "--max-restarts", "100", "--monitor-interval", "0.1", "-m", "benchmarks.fault_benchmark",
                 "torchft-worker", str(g), str(args.groups), str(args.steps), f"http://127.0.0.1:{port}", workdir,
                 args.text],
                cwd=ROOT, env=dict(env, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}"), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        kills = killing(faults, lambda g: kill_all(child_pids(agents[g].pid)), lambda: all(
            a.poll() is not None for a in agents.values()) or any(
            last_step(os.path.join(workdir, f"commits-{g}.jsonl")) >= args.steps - 1 for g in range(args.groups)),
            started)
        for agent in agents.values():
            agent.wait(timeout=args.timeout)
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        lighthouse.kill()
    wall = time.time() - started
    logs = {g: read_lines(os.path.join(workdir, f"commits-{g}.jsonl")) for g in range(args.groups)}
    committed = union_of_steps(logs.values())
    figures = []
    for kill_ in kills:
        before = [e for e in committed if e["time"] <= kill_["at"]]
        after = [e for e in committed if e["time"] > kill_["at"]]
        mine = [e for e in logs[kill_["replica"]] if e["time"] > kill_["at"]]
        starts = [e for e in read_lines(os.path.join(workdir, f"starts-{kill_['replica']}.jsonl"))
                  if e["started"] > kill_["at"]]
        figures.append({"at_s": kill_["at_s"], "replica": kill_["replica"],
                        "stall_s": after[0]["time"] - before[-1]["time"] if before and after else None,
                        "steps_again": before[-1]["step"] + 1 - after[0]["step"] if before and after else None,
                        "rejoined_s": mine[0]["time"] - kill_["at"] if mine else None,
                        "start_s": starts[0]["started"] - kill_["at"] if starts else None,
                        "quorum_and_transfer_s": mine[0]["time"] - starts[0]["ready"] if mine and starts else None})
    final = read_json(os.path.join(workdir, "final-0.json"))
    return {"wall_s": wall, "steps": len(committed), "samples": sum(e["participants"] for e in committed) * 8,
            "final_val_loss": final.get("val_loss") if final else None, "faults": figures}


def kill_all(pids: list[int]) -> list[int]:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def torchft_worker(group: int, groups: int, steps: int, lighthouse: str, workdir: str, text_dir: str) -> None:
    """One torchft replica group of one process (under torchrun): the same GPT, data and AdamW, torchft's loop."""
    from datetime import timedelta

    import torch
    import torch.nn.functional as F
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    import data as data_module
    from models import build_model
    started = time.time()
    torch.manual_seed(0)
    text = data_module.TextData(text_dir, 128, 0.01, 0, 8, torch.device("cpu"))
    text.placed = (group, groups)
    model = build_model("gpt", 0.0, "local", 256, 32, 128)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                      load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                                     inner.load_state_dict(state["optimizer"])),
                      state_dict=lambda: {"model": model.state_dict(), "optimizer": inner.state_dict()},
                      replica_id=f"group{group}", timeout=timedelta(seconds=10), lighthouse_addr=lighthouse)
    optimizer = OptimizerWrapper(manager, inner)
    append_line(os.path.join(workdir, f"starts-{group}.jsonl"), {"started": started, "ready": time.time()})
    per_epoch = len(text.batch_sizes())
    while manager.current_step() < steps:
        step = manager.current_step()
        optimizer.zero_grad()  # starts the quorum (torchft's)
        batches = text.train_batches(step // per_epoch, step % per_epoch)
        inputs, targets = next(batches)
        batches.close()
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        for p in model.parameters():
            manager.allreduce(p.grad).wait()
        participants = manager.num_participants()
        optimizer.step()  # applied if the quorum should commit
        if manager.current_step() > step:
            append_line(os.path.join(workdir, f"commits-{group}.jsonl"),
                        {"step": step, "time": time.time(), "participants": participants})
    if group == 0:
        with torch.no_grad():
            shard = torch.arange(len(text.val))
            losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
                      for x, y in text.val_batches(shard, 64)]
        write_json(os.path.join(workdir, "final-0.json"),
                   {"val_loss": sum(losses) / (len(text.val) * 128)})
    manager.shutdown()


# ----------------------------------------------------------------------------------------------------------
# The state transfer alone: GPT-2 small's shape with AdamW's state, from a group at the step to one behind it
# ----------------------------------------------------------------------------------------------------------
def transfer(args: argparse.Namespace) -> dict[str, Any]:
    """Two processes (replica groups of one) and a coordinator on this machine: group 1 is at step 1, group 0 at
    step 0, so the first quorum has group 0 take group 1's live state, GPT-2 small's weights and AdamW's state
    (--model gpt2: 86M parameters, 1.03 GB with the two moments)."""
    import threading as threads
    from datetime import timedelta

    from torch.distributed import TCPStore

    import replicas
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    stop = threads.Event()
    lighthouse = threads.Thread(target=replicas.Lighthouse(store).run, args=(stop,), daemon=True)
    lighthouse.start()
    with tempfile.TemporaryDirectory(prefix="transfer-") as tmp:
        workers = [subprocess.Popen([sys.executable, "-m", "benchmarks.fault_benchmark", "transfer-worker", str(g),
                                     f"127.0.0.1:{store.port}", tmp, args.transport], cwd=ROOT,
                                    env=dict(os.environ, OMP_NUM_THREADS="1"))
                   for g in (0, 1)]
        for worker in workers:
            worker.wait(timeout=args.timeout)
        stop.set()
        found = read_json(os.path.join(tmp, "joiner.json"))
    if found is None:
        raise SystemExit(f"{PROG}: the transfer run failed (exit codes {[w.returncode for w in workers]})")
    fresh = sorted(tcp_stream(found["bytes"], fresh=True) for _ in range(3))
    wire = sorted(tcp_stream(found["bytes"], fresh=False) for _ in range(3))
    return {**found, "transport": args.transport, "tcp_stream_s": fresh[1], "tcp_stream_runs_s": fresh,
            "tcp_stream_gb_per_s": found["bytes"] / fresh[1] / 1e9, "ratio_to_tcp_stream": found["seconds"] / fresh[1],
            "tcp_wire_s": wire[1], "tcp_wire_runs_s": wire, "tcp_wire_gb_per_s": found["bytes"] / wire[1] / 1e9,
            "ratio_to_tcp_wire": found["seconds"] / wire[1]}


def tcp_stream(nbytes: int, fresh: bool) -> float:
    """The transfer's yardstick, in the same run: seconds a plain TCP stream over loopback takes to move ``nbytes``
    from one process to another (the sender's sendall of one written buffer, the receiver's recv_into one buffer),
    from the accepted connection to the last byte. ``fresh``: into a tensor allocated in the timed part, as the
    transfer's receiver does (its pages faulted in as the bytes land: about 0.3 s a GB on the 2-core VM); else
    into one written before (the wire alone)."""
    import multiprocessing
    import socket

    import torch
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = multiprocessing.get_context("fork").Process(target=send_bytes, args=(server.getsockname()[1], nbytes))
        buffer = None if fresh else torch.ones(nbytes, dtype=torch.uint8)
        sender.start()
        conn, _ = server.accept()
        with conn:
            started = time.perf_counter()
            view, got = memoryview((torch.empty(nbytes, dtype=torch.uint8) if fresh else buffer).numpy()), 0
            while got < nbytes:
                n = conn.recv_into(view[got:], nbytes - got)
                if n == 0:
                    raise SystemExit(f"{PROG}: the TCP stream's sender closed with {nbytes - got} bytes to come")
                got += n
            seconds = time.perf_counter() - started
        sender.join(60)
    return seconds


def send_bytes(port: int, nbytes: int) -> None:
    import socket

    import numpy as np
    data = np.ones(nbytes, dtype=np.uint8)  # written: its pages are real, as a state's are (numpy: a forked child
    with socket.create_connection(("127.0.0.1", port)) as conn:  # of a process whose OpenMP ran hangs in torch's)
        conn.sendall(memoryview(data))


def transfer_worker(group: int, address: str, workdir: str, transport: str) -> None:
    import torch

    import replicas
    from models import build_model
    torch.manual_seed(0)
    model = build_model("gpt2", 0.0, "local", 256, 32, 1024)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # AdamW's state, made by a step
        p.grad = torch.zeros_like(p)
    optimizer.step()
    step = [group]  # group 1 at step 1, group 0 behind it

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step[0] = state["step"]
    replica = replicas.Replica(address, group, 2, "gpt2", lambda: {"model": model.state_dict(), "optimizer":
                               optimizer.state_dict(), "step": step[0]}, load, min_groups=2, fault_timeout_s=120,
                               transport={"socket": replicas.SocketTransport, "pg": replicas.PGTransport}[transport])
    received = replica.join(step[0]).recovery  # group 0's: the state it received (group 1's: None)
    replica.commit(True)
    if group == 0:
        write_json(os.path.join(workdir, "joiner.json"), {
            "seconds": received.seconds, "load_s": received.load_s, "bytes": received.bytes,
            "gb_per_s": received.bytes / received.seconds / 1e9,
            "peak_rss_mb": proc_status_mb("VmHWM")})
    replica.close()


# ----------------------------------------------------------------------------------------------------------
# Helpers, the table, the command line
# ----------------------------------------------------------------------------------------------------------
def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def append_line(path: str, entry: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def last_step(path: str) -> int:
    """The last step a commit log (JSON lines) holds, from its tail; -1 where it holds none yet."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return -1
    for line in reversed(tail):
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut by the tail's start, or being written
            continue
        if isinstance(entry, dict) and "step" in entry:
            return entry["step"]
    return -1


def read_lines(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_json(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def summarize(way: str, clean: dict[str, Any], faulty: dict[str, Any]) -> dict[str, Any]:
    rate = {name: run["samples"] / run["wall_s"] for name, run in (("clean", clean), ("faulty", faulty))}
    return {"way": way, "clean": clean, "faulty": faulty, "samples_per_s": rate,
            "goodput": rate["faulty"] / rate["clean"], "kills": len(faulty["faults"])}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'way':9} {'clean s':>8} {'faulty s':>9} {'goodput':>8} {'kills':>6} {'stall s (median)':>17} "
             f"{'rejoin s (median)':>18} {'final val loss':>15}"]
    for row in rows:
        faults = row["faulty"]["faults"]
        stalls = [f["stall_s"] for f in faults if f.get("stall_s") is not None]
        rejoins = [f.get("rejoined_s") or f.get("restart_s") for f in faults]
        rejoins = [r for r in rejoins if r is not None]
        loss = row["faulty"].get("final_val_loss")
        lines.append(f"{row['way']:9} {row['clean']['wall_s']:8.1f} {row['faulty']['wall_s']:9.1f} "
                     f"{row['goodput']:8.3f} {row['kills']:6d} "
                     f"{(median(stalls) if stalls else float('nan')):17.2f} "
                     f"{(median(rejoins) if rejoins else float('nan')):18.2f} "
                     f"{(loss if loss is not None else float('nan')):15.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "torchft-worker":
        torchft_worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7])
        return 0
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "transfer-worker":
        transfer_worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
        return 0
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=300, help="how long the kills go on")
    parser.add_argument("--kill-every", type=int, default=30, help="seconds between kills")
    parser.add_argument("--groups", type=int, default=3, help="replicas (processes, for elastic)")
    parser.add_argument("--steps", type=int, default=420,
                        help="optimizer steps every run takes (the kills stop at the last one: at 420, ours' and "
                             "torchft's runs last 150-230 s on 2 cores, so 5-7 of the 10 kills land)")
    parser.add_argument("--ways", default=",".join(WAYS[:3]), help=f"which of {', '.join(WAYS)}")
    parser.add_argument("--seed", type=int, default=0, help="the fault schedule's")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    parser.add_argument("--torchft-dir", default=os.path.expanduser("~/.cache/dataparallel/torchft-0.2.0"),
                        help="where torchft is installed for this benchmark (pip install --target)")
    parser.add_argument("--out", default=None, help="the JSON (default: results/faults-<machine>.json)")
    parser.add_argument("--transfer-only", action="store_true",
                        help="measure only the state transfer of GPT-2 small's shape with AdamW (1.03 GB), and merge "
                             "it into --out")
    parser.add_argument("--transport", choices=("socket", "pg"), default="socket",
                        help="--transfer-only's: replicas.SocketTransport (the members' own) or PGTransport (gloo)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(ROOT, "results", f"faults-{machine_tag()}.json")
    if args.transfer_only:
        moved = transfer(args)
        print(f"state transfer: {moved['bytes'] / 1e9:.2f} GB in {moved['seconds']:.2f} s ({moved['gb_per_s']:.2f} "
              f"GB/s, {args.transport}), loaded in {moved['load_s']:.2f} s more; the joiner's peak RSS "
              f"{moved['peak_rss_mb']:.0f} MB\nplain TCP stream over loopback, the same bytes (medians of 3): into "
              f"fresh memory as the transfer's {moved['tcp_stream_s']:.2f} s "
              f"({moved['tcp_stream_gb_per_s']:.2f} GB/s), "
              f"the transfer {moved['ratio_to_tcp_stream']:.2f}x it; into memory written before (the wire alone) "
              f"{moved['tcp_wire_s']:.2f} s ({moved['tcp_wire_gb_per_s']:.2f} GB/s), the transfer "
              f"{moved['ratio_to_tcp_wire']:.2f}x it")
        payload = read_json(out) or {"machine": machine_info()}
        command = f"python3 -m benchmarks.fault_benchmark --transfer-only --transport {args.transport}"
        write_json(out, {**payload, "transfer": {**moved, "command": command}})
        print(f"wrote {out}")
        return 0
    ways = [w for w in args.ways.split(",") if w]
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        parser.error(f"--ways: {unknown[0]!r} is not one of {', '.join(WAYS)}")
    faults = schedule(args)
    rows, skipped = [], {}
    runners = {"ours": run_ours, "elastic": run_elastic, "torchft": run_torchft,
               "ours-cold": lambda *a: run_ours(*a, warm=False)}
    with tempfile.TemporaryDirectory(prefix="faultbench-") as tmp:
        args.text = text_folder(tmp)
        for way in ways:
            if way == "torchft":
                why = install_torchft(args.torchft_dir)
                if why:
                    skipped[way] = f"torchft could not be installed: {why}"
                    print(f"{PROG}: {skipped[way]}", file=sys.stderr)
                    continue
            runs = {}
            for name, schedule_ in (("clean", []), ("faulty", faults)):
                workdir = os.path.join(tmp, f"{way}-{name}")
                os.makedirs(workdir)
                print(f"{PROG}: {way}, {name} ({args.steps} steps, {len(schedule_)} kills) ...", file=sys.stderr,
                      flush=True)
                runs[name] = runners[way](args, workdir, schedule_)
            rows.append(summarize(way, runs["clean"], runs["faulty"]))
    print(table(rows))
    command = "python3 -m benchmarks.fault_benchmark " + " ".join(argv or sys.argv[1:])
    write_json(out, {**(read_json(out) or {}), "command": command, "machine": machine_info(),
                     "schedule": faults, "steps": args.steps, "groups": args.groups, "rows": rows,
                     "skipped": skipped})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
