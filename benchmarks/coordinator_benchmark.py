"""One coordinator under many replica groups: ours (replicas/, ``python -m replicas serve``) and torchft's Lighthouse
(torchft 0.2.0's LighthouseServer, in this benchmark's own folder), each under the same simulated load at 8 to 1,024
groups: every group a real client of the protocol without training, so only the coordinator's work is measured.

What a simulated group does (a thread each, in a few simulator processes):
- ours: a real ``replicas.Replica`` of one process (its heartbeat thread every 0.1 s on a store client of its own, its
  liveness connection, its store client), and per step the member's own calls: the quorum request (``_ask``: a
  request into the coordinator's queue, the wait for its ticket's answer, the read of the quorum it names) and the
  commit (a vote, the decision set by the last voter, read by all). The process group a quorum names is never made (that is the groups' traffic,
  not the coordinator's), and no state moves (every group is at the same step).
- torchft: a LighthouseClient's heartbeat every 0.1 s (torchft's Manager's default interval) on a client of its own,
  and per step a ``quorum(replica_id, step=...)`` call on another (torchft's commit is the groups' own all-reduce:
  the lighthouse takes no part in it). The lighthouse: ``min_replicas`` = every group, its default quorum tick
  (100 ms), a heartbeat timeout of 5 s.

Figures per count of groups G (steps after ``--warmup``): a step's quorum latency from the LAST group's request to
the last group's answer (p50, p99: what the slowest group adds to every step), the step rate the groups keep
(steps a second, ours with its commit), the coordinator process's CPU per step (/proc/PID/stat, sampled every
0.2 s) and its peak resident memory. On this 2-core machine the simulators share the cores with the coordinator, so
the simulators' own CPU is measured beside it (what the machine had left is said, not guessed).

    python3 -m benchmarks.coordinator_benchmark [--groups 8,32,128,512,1024] [--steps 40] [--warmup 5]
        [--simulators 4] [--ways ours,torchft] [--torchft-dir DIR] [--out results/coordinator-scale-<machine>.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.fault_benchmark import free_port, install_torchft  # noqa: E402
from files import write_json  # noqa: E402
from measure.machine import machine_info, machine_tag  # noqa: E402
from measure.memory import process_memory_mib  # noqa: E402

WAYS = ("ours", "torchft")
HEARTBEAT_S = 0.1  # torchft's Manager beats every 100 ms; ours every HEARTBEAT_S (replicas/protocol.py), the same
TICKS = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------------------------------------
# The simulated groups (one simulator process holds a slice of them, a thread each)
# ----------------------------------------------------------------------------------------------------------
def simulate_ours(address: str, first: int, count: int, groups: int, steps: int, out: str) -> None:
    import replicas
    members = [replicas.Replica(address, g, groups, "coordinator-benchmark", dict, lambda state: None,
                                min_groups=groups, fault_timeout_s=120.0) for g in range(first, first + count)]
    times: dict[int, list[tuple[float, float, float]]] = {}

    def group(member: Any) -> None:
        mine = times.setdefault(member.group, [])
        for step in range(steps):
            asked = time.time()
            member._ask(step)  # the member's own quorum request (join() without the process group it would make)
            answered = time.time()
            member.commit(True)
            mine.append((asked, answered, time.time()))

    run_threads(group, members, out, times)
    for member in members:
        member.close()


def simulate_torchft(address: str, first: int, count: int, groups: int, steps: int, out: str) -> None:
    from torchft.coordination import LighthouseClient
    stop = threading.Event()
    times: dict[int, list[tuple[float, float, float]]] = {}

    def beat(g: int) -> None:
        client = LighthouseClient(address, connect_timeout=timedelta(seconds=60))
        while not stop.is_set():
            client.heartbeat(f"group-{g}")
            stop.wait(HEARTBEAT_S)

    beaters = [threading.Thread(target=beat, args=(g,), daemon=True) for g in range(first, first + count)]
    for thread in beaters:
        thread.start()

    def group(g: int) -> None:
        client, mine = LighthouseClient(address, connect_timeout=timedelta(seconds=60)), times.setdefault(g, [])
        for step in range(steps):
            asked = time.time()
            client.quorum(replica_id=f"group-{g}", timeout=timedelta(seconds=120), step=step, world_size=1)
            answered = time.time()
            mine.append((asked, answered, answered))

    run_threads(group, list(range(first, first + count)), out, times)
    stop.set()


def run_threads(body: Any, items: list[Any], out: str, times: dict[int, list]) -> None:
    """``body(item)`` on a thread each, then every group's (asked, answered, committed) times to ``out``."""
    threads = [threading.Thread(target=body, args=(item,), daemon=True) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with open(out, "w") as f:
        json.dump({str(g): entries for g, entries in times.items()}, f)


# ----------------------------------------------------------------------------------------------------------
# One count of groups, one way
# ----------------------------------------------------------------------------------------------------------
def start_coordinator(way: str, groups: int, args: argparse.Namespace, env: dict[str, str],
                      log: Any) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if way == "ours":
        command = [sys.executable, "-m", "replicas", "serve", "--port", str(port), "--host", "127.0.0.1"]
        address = f"127.0.0.1:{port}"
    else:  # the Rust lighthouse, alone in a process of its own (its console script reads the process's arguments)
        command = [os.path.join(args.torchft_dir, "bin", "torchft_lighthouse"), "--min_replicas", str(groups),
                   "--join_timeout_ms", "60000", "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", "5000",
                   "--bind", f"127.0.0.1:{port}"]
        address = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    time.sleep(1.5)  # listening (ours prints its port; torchft's binds at once)
    return process, address


def cpu_seconds(pid: int) -> float | None:
    """The process's user + system CPU time so far (/proc/PID/stat), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS
    except (OSError, IndexError, ValueError):
        return None


def measure(way: str, groups: int, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [p for p in (args.torchft_dir if way == "torchft" else None, ROOT) if p]))
    log = open(os.path.join(workdir, f"{way}-{groups}-coordinator.log"), "w")
    coordinator, address = start_coordinator(way, groups, args, env, log)
    samples: list[tuple[float, float | None, float]] = []  # (time, the coordinator's CPU s, its RSS MiB)
    simulators: list[subprocess.Popen] = []
    outs: list[str] = []
    simulator_cpu: dict[int, float] = {}  # pid -> its CPU s when last seen
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            cpu = cpu_seconds(coordinator.pid)
            rss = process_memory_mib(coordinator.pid)["rss"] if cpu is not None else 0.0
            samples.append((time.time(), cpu, rss))
            for simulator in simulators:
                simulator_cpu[simulator.pid] = cpu_seconds(simulator.pid) or simulator_cpu.get(simulator.pid, 0.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    count = min(args.simulators, groups)
    try:
        for i in range(count):
            first, last = groups * i // count, groups * (i + 1) // count
            outs.append(os.path.join(workdir, f"{way}-{groups}-{i}.json"))
            simulators.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.coordinator_benchmark", f"simulate-{way}", address, str(first),
                 str(last - first), str(groups), str(args.steps), outs[-1]], cwd=ROOT, env=env,
                stdout=log, stderr=subprocess.STDOUT))
        for simulator in simulators:
            simulator.wait(timeout=args.timeout)
    finally:
        for simulator in simulators:
            if simulator.poll() is None:
                simulator.kill()
        stop.set()
        sampler.join()
        coordinator.kill()
        coordinator.wait()
        log.close()
    failed = [s.returncode for s in simulators if s.returncode != 0]
    if failed:
        return {"way": way, "groups": groups, "error": f"simulators exited {failed}: see {log.name}"}
    times: dict[str, list] = {}
    for out in outs:
        with open(out) as f:
            times.update(json.load(f))
    return figures(way, groups, times, samples, list(simulator_cpu.values()), args)


def figures(way: str, groups: int, times: dict[str, list], samples: list[tuple[float, float | None, float]],
            simulator_cpu: list[float], args: argparse.Namespace) -> dict[str, Any]:
    """The step figures over the steps after the warm-up, and the coordinator's CPU and memory over them."""
    assert len(times) == groups and all(len(entries) == args.steps for entries in times.values()), "a group is short"
    steps = range(args.warmup, args.steps)
    last_asked = [max(times[g][s][0] for g in times) for s in steps]
    last_answered = [max(times[g][s][1] for g in times) for s in steps]
    last_done = [max(times[g][s][2] for g in times) for s in steps]
    latency_ms = sorted(1000 * (answer - ask) for ask, answer in zip(last_asked, last_answered))
    start, end = min(times[g][args.warmup][0] for g in times), last_done[-1]
    cpu_s = cpu_at([(t, cpu) for t, cpu, _ in samples if cpu is not None], end) - cpu_at(
        [(t, cpu) for t, cpu, _ in samples if cpu is not None], start)
    return {"way": way, "groups": groups, "steps": len(steps),
            "quorum_ms_p50": statistics.median(latency_ms),
            "quorum_ms_p99": latency_ms[min(len(latency_ms) - 1, round(0.99 * (len(latency_ms) - 1)))],
            "quorum_ms_max": latency_ms[-1],
            "steps_per_s": len(steps) / (end - start),
            "coordinator_cpu_ms_per_step": 1000 * cpu_s / len(steps),
            "coordinator_cpu_fraction": cpu_s / (end - start),
            "coordinator_peak_rss_mib": max((rss for _, _, rss in samples), default=0.0),
            "simulators_cpu_s": sum(simulator_cpu)}


def cpu_at(samples: list[tuple[float, float]], moment: float) -> float:
    """The CPU seconds a process had used at ``moment``, between the two samples around it (linear)."""
    before = max((sample for sample in samples if sample[0] <= moment), default=samples[0])
    after = min((sample for sample in samples if sample[0] >= moment), default=samples[-1])
    if after[0] == before[0]:
        return before[1]
    return before[1] + (after[1] - before[1]) * (moment - before[0]) / (after[0] - before[0])


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'way':<8} {'groups':>6} {'p50 ms':>8} {'p99 ms':>8} {'steps/s':>8} {'coord CPU ms/step':>17} "
             f"{'coord cores':>11} {'coord MiB':>9}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['way']:<8} {r['groups']:>6} {r['error']}")
            continue
        lines.append(f"{r['way']:<8} {r['groups']:>6} {r['quorum_ms_p50']:>8.1f} {r['quorum_ms_p99']:>8.1f} "
                     f"{r['steps_per_s']:>8.2f} {r['coordinator_cpu_ms_per_step']:>17.1f} "
                     f"{r['coordinator_cpu_fraction']:>11.2f} {r['coordinator_peak_rss_mib']:>9.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given and given[0].startswith("simulate-"):
        address, first, count, groups, steps, out = given[1:]
        simulate = simulate_ours if given[0] == "simulate-ours" else simulate_torchft
        simulate(address, int(first), int(count), int(groups), int(steps), out)
        return 0
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.coordinator_benchmark",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", default="8,32,128,512,1024", help="the counts of groups, comma-separated")
    parser.add_argument("--steps", type=int, default=40, help="steps at each count (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps not counted (default 5)")
    parser.add_argument("--simulators", type=int, default=4, help="processes holding the groups (default 4)")
    parser.add_argument("--ways", default="ours,torchft", help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--torchft-dir", default=os.path.join(tempfile.gettempdir(), "torchft-env"),
                        help="where torchft 0.2.0 is (installed there by pip --target if it is not)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a count may take (default 900)")
    parser.add_argument("--workdir", default=None, help="where the logs and the groups' times go (default: a "
                        "temporary folder, removed)")
    parser.add_argument("--out", default=None, help="the JSON (default results/coordinator-scale-<machine>.json)")
    args = parser.parse_args(given)
    try:
        counts = [int(g) for g in args.groups.split(",")]
    except ValueError:
        parser.error(f"--groups: comma-separated whole numbers, got {args.groups!r}")
    ways = args.ways.split(",")
    if any(way not in WAYS for way in ways) or any(g < 1 for g in counts) or not 0 <= args.warmup < args.steps:
        parser.error(f"--ways of {', '.join(WAYS)}, --groups of at least 1, 0 <= --warmup < --steps")
    if "torchft" in ways:
        why = install_torchft(args.torchft_dir)
        if why:
            parser.error(f"torchft cannot be installed in {args.torchft_dir}: {why}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="coordinator-benchmark-") as scratch:
        workdir = args.workdir or scratch
        os.makedirs(workdir, exist_ok=True)
        for groups in counts:
            for way in ways:
                print(f"{way}: {groups} groups ...", file=sys.stderr, flush=True)
                rows.append(measure(way, groups, args, workdir))
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(table(rows))
    out = args.out or os.path.join(ROOT, "results", f"coordinator-scale-{machine_tag()}.json")
    write_json(out, {"command": "python3 -m benchmarks.coordinator_benchmark " + " ".join(given),
                     "machine": machine_info(), "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
