"""A sharded run that loses a rank: 3 replica groups of 2 processes at --zero 3 (each group sharding the byte GPT over
its own 2 processes, fault tolerance across the groups), one rank of group 1 SIGKILLed once every group has committed
--kill-at steps; torchrun restarts group 1, which takes its places' shards from a healthy group, place j from place
j. Written to results/sharded-faults-<machine>.json (``--out``); the report shows it.

What it measures, from the commit logs, the metrics and the checkpoints:
- the survivors: steps committed without the killed group, their stall (their last step before the kill to the first
  after it) and the steps they took again (0 where no progress was lost);
- the killed group: seconds from the kill to its join request and to its first committed step, the bytes each of its
  places received (its own shards: the weights' and AdamW's two moments' 1/P each) against the whole state's;
- per rank, the peak resident memory above the process's start while it received and loaded its shards (the
  "recovery" phase) against its steady state (the steps' phase), in MB (VmHWM, reset per phase:
  measure.memory.PhasePeaks);
- whether every group ends with the same weights, bit for bit (each group's last checkpoint, read whole);
- once the killed group is back, every trainer's and every zygote's memory (--warm-restarts: a zygote per local rank,
  forked from its first start, which the restart is forked from in turn): RSS, PSS and private memory in MiB.

    python3 -m benchmarks.sharded_faults [--steps 60] [--kill-at 20] [--model gpt]
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from typing import Any

import torch

from benchmarks.fault_benchmark import read_json, text_folder
from benchmarks.replica_runs import ROOT, ReplicaRun, final_weights
from files import write_json
from measure.machine import machine_info, machine_tag
from measure.memory import process_memory_mib
from replicas import MESSAGE_BYTES

PROG = "sharded_faults"
GROUPS, PROCESSES = 3, 2


def recipe(args: argparse.Namespace, text: str) -> list[str]:
    return ["--device", "cpu", "--dataset", "text", "--data-dir", text, "--model", args.model, "--val-fraction",
            "0.01", "--batch-size", "4", "--optimizer", "adamw", "--lr", "1e-3", "--epochs", "1000", "--max-steps",
            str(args.steps), "--seed", "0", "--timeout", "120", "--zero", "3", "--checkpoint-every", "10"]


def processes_memory(run: ReplicaRun) -> dict[str, Any]:
    """Every group's trainers and zygotes (--warm-restarts), RSS, PSS and private memory in MiB
    (measure.memory.process_memory_mib), once the killed group is back: group 1's zygotes then serve a trainer forked
    from them, the others' still share their pages with the first start they were forked from."""
    per_group = {str(g): {"trainers": [process_memory_mib(pid) for pid in run.workers(g)],
                          "zygotes": [process_memory_mib(pid) for pid in run.zygotes(g)]}
                 for g in range(GROUPS)}
    every = [(kind, m) for group in per_group.values() for kind, ms in group.items() for m in ms]
    return {"memory_mib": per_group, "zygotes": sum(1 for kind, _ in every if kind == "zygotes"),
            **{f"{kind[:-1]}_{field}_mib_max": max((m[field] for k, m in every if k == kind), default=None)
               for kind in ("trainers", "zygotes") for field in ("rss", "pss", "private")}}


def measure(args: argparse.Namespace, workdir: str, text: str) -> dict[str, Any]:
    run = ReplicaRun(workdir, GROUPS, recipe(args, text), processes=PROCESSES, min_groups=1, fault_timeout_s=10,
                     max_restarts=10)
    try:
        run.start()
        for group in range(GROUPS):
            run.wait_for_step(group, args.kill_at, args.timeout)
        victim = max(run.workers(1))  # the newer worker: local rank 1, say
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        run.wait_for(1, "its recovery", lambda entries: any(
            e.get("recovered", {}).get("asked", 0) > killed_at for e in entries), args.timeout)
        memory = processes_memory(run)
        codes = run.wait(args.timeout)
    finally:
        run.close()
    logs = {g: run.committed(g, steps_only=False) for g in range(GROUPS)}
    steps = [e for e in logs[0] if "step" in e]
    before = [e for e in steps if e["time"] <= killed_at]
    after = [e for e in steps if e["time"] > killed_at]
    back = next((e for e in after if 1 in e["participants"]), None)
    note = next((n["recovered"] for n in logs[1] if "recovered" in n and n["recovered"]["asked"] > killed_at), {})
    metrics = {g: read_json(run.path(g, "metrics")) or {} for g in range(GROUPS)}
    phases = metrics[1].get("memory_by_phase_mb", {})
    weights = [final_weights(run.path(g, "checkpoints")) for g in range(GROUPS)]
    whole_state_bytes = 3 * sum(t.numel() * t.element_size() for t in weights[0].values())  # weights, 2 moments
    return {"codes": {str(g): c for g, c in codes.items()}, "steps": len(steps),
            "survivors_alone": sum(1 for e in after if 1 not in e["participants"]),
            "stall_s": after[0]["time"] - before[-1]["time"] if before and after else None,
            "steps_again": before[-1]["step"] + 1 - after[0]["step"] if before and after else None,
            "asked_s": note["asked"] - killed_at if note else None,
            "timeline_s": {name: note[name] - killed_at for name in ("started", "imported", "built", "connected")
                           if name in note},
            "rejoined_s": back["time"] - killed_at if back else None,
            "received_bytes_place0": note.get("bytes"), "whole_state_bytes": whole_state_bytes,
            "recovery_peak_mb": phases.get("recovery"), "steps_peak_mb": phases.get("steps"),
            "message_mb": MESSAGE_BYTES / 2**20, **memory,
            "same_weights": all(all(torch.equal(w[k], weights[0][k]) for k in w) for w in weights[1:])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of the run")
    parser.add_argument("--kill-at", type=int, default=20, help="the kill, once every group committed this step")
    parser.add_argument("--model", default="gpt", help="the trainer's --model (a byte GPT)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the run may take")
    parser.add_argument("--out", default=None, help="the JSON (default: results/sharded-faults-<machine>.json)")
    args = parser.parse_args(argv)
    if not 0 < args.kill_at < args.steps:
        parser.error(f"--kill-at must be between 1 and --steps - 1 = {args.steps - 1}, got {args.kill_at}")
    out = args.out or os.path.join(ROOT, "results", f"sharded-faults-{machine_tag()}.json")
    with tempfile.TemporaryDirectory(prefix="shardedfaults-") as tmp:
        figures = measure(args, os.path.join(tmp, "run"), text_folder(tmp, megabytes=1.0))
    for key, value in figures.items():
        print(f"{key:>24}: {value}")
    command = "python3 -m benchmarks.sharded_faults " + " ".join(argv if argv is not None else sys.argv[1:])
    write_json(out, {"benchmark": PROG, "command": command.strip(), "machine": machine_info(),
                     "groups": GROUPS, "processes": PROCESSES, "zero": 3, "model": args.model,
                     "steps": args.steps, "kill_at": args.kill_at, **figures})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
