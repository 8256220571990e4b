"""Data parallelism over a slow link, measured on a real one: the trainer's DDP against DiLoCo (several H, with and
without int4 and streaming) on a byte-level GPT, each run over loopback shaped by Linux traffic control inside a
network namespace of its own, and over plain loopback.

    python -m benchmarks.slowlink_benchmark                       # every run below, about 25 minutes on 2 cores
    python -m benchmarks.slowlink_benchmark --runs ddp diloco-h50 --steps 300 --link shaped

The link: ``unshare -rn`` gives each run a network namespace with only its own loopback (no root needed: a user
namespace maps us to root inside it), ``ip link set lo up``, and ``tc qdisc add dev lo root tbf rate 100mbit burst
256kb latency 100ms``: a token bucket that lets 100 Mbit/s through. Every rank's traffic crosses that one loopback,
so the ring's W links share 100 Mbit/s: a slower network than W nodes with 100 Mbit/s each. The benchmark first
measures the link (a TCP transfer inside a shaped namespace). Where ``unshare``, ``ip`` or ``tc`` is missing or
refused, it says so in one line and runs every run unshaped.

Each run is ``torchrun --nproc_per_node W ddp_cifar100.py`` on the standard library's text with the same recipe
(AdamW, cosine schedule, clipping) and the same samples: W processes, one per replica for DiLoCo, B windows per
process and inner step, ``--steps`` steps, validated every ``--eval-every`` steps. The trainer's metrics give the
validation loss against seconds of training (evaluations left out) and against the bytes the busiest rank has sent
(DDP: what an ideal ring all-reduce sends, 2 (W-1)/W of the model per step; DiLoCo: the outer ring's own count).
The table gives each run's final loss against DDP's, its bytes against DDP's, and the training time it took to
reach DDP's final loss (interpolated between evaluations) against DDP's on the same link. JSON:
``results/slowlink-<machine>.json``; the report plots it.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
from typing import Any

from tqdm import tqdm

from benchmarks.trainer_runs import TrainerRunFailed, run_trainer
from files import write_json
from measure.machine import machine_info, machine_tag

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
RATE = "100mbit"
# name -> the trainer's flags that make it (the recipe below is common to all)
RUNS = {
    "ddp": ["--grad-sync", "ddp"],
    "diloco-h10": ["--grad-sync", "diloco", "--local-steps", "10"],
    "diloco-h50": ["--grad-sync", "diloco", "--local-steps", "50"],
    "diloco-h100": ["--grad-sync", "diloco", "--local-steps", "100"],
    "diloco-h50-int4": ["--grad-sync", "diloco", "--local-steps", "50", "--outer-compress", "int4"],
    "diloco-h50-f4": ["--grad-sync", "diloco", "--local-steps", "50", "--fragments", "4", "--outer-delay", "1"],
    "diloco-h50-f4-int4": ["--grad-sync", "diloco", "--local-steps", "50", "--fragments", "4", "--outer-delay", "1",
                           "--outer-compress", "int4"],
    # three times the steps (and samples; its own cosine): how long DiLoCo takes to reach DDP's loss on the link
    "diloco-h50-int4-3x": ["--grad-sync", "diloco", "--local-steps", "50", "--outer-compress", "int4", "3x"],
}
DEFAULT_RUNS = [name for name in RUNS if not name.endswith("-3x")]
UNSHAPED = ("ddp", "diloco-h50")  # also run on plain loopback
PROBE = """
import socket, threading, time
size = 25_000_000
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen(1)
def receive():
    connection, _ = server.accept(); left = size
    while left > 0:
        left -= len(connection.recv(1 << 20))
thread = threading.Thread(target=receive); thread.start()
client = socket.create_connection(server.getsockname()); start = time.perf_counter()
client.sendall(b"\\0" * size); thread.join(); print(size * 8 / (time.perf_counter() - start) / 1e6)
"""


def recipe(args: argparse.Namespace) -> list[str]:
    """The training every run shares: the tiny GPT, AdamW with the LLM recipe, the same steps and samples."""
    return ["--device", "cpu", "--dataset", "text", "--model", "gpt-tiny", "--batch-size", str(args.batch_size),
            "--optimizer", "adamw", "--lr", "3e-3", "--betas", "0.9", "0.95", "--weight-decay", "0.1",
            "--norm-weight-decay", "0", "--clip-grad-norm", "1", "--scheduler", "cosine", "--warmup-steps", "50",
            "--min-lr", "3e-4", "--decay-steps", str(args.steps), "--max-steps", str(args.steps), "--epochs", "1",
            "--val-fraction", "0.01", "--eval-every", str(args.eval_every), "--seed", "0", "--timeout", "600"]


def shaped(command: list[str], rate: str) -> list[str]:
    """``command`` in a network namespace of its own whose loopback lets ``rate`` through."""
    setup = f"ip link set lo up && tc qdisc add dev lo root tbf rate {rate} burst 256kb latency 100ms"
    return ["unshare", "-rn", "sh", "-c", f"{setup} && exec {shlex.join(command)}"]


def shaping_refused(rate: str) -> str | None:
    """Why a shaped link cannot be made here (one line), or None."""
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found"
    done = subprocess.run(shaped(["true"], rate), capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["refused"])[-1]


def measure_link(rate: str | None) -> float:
    """Mbit/s of one TCP transfer over the (shaped) loopback."""
    command = [sys.executable, "-c", PROBE]
    done = subprocess.run(shaped(command, rate) if rate else command, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def train(name: str, rate: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """One torchrun of the trainer, over a loopback shaped to ``rate`` (None: plain); its metrics JSON."""
    flags = RUNS[name]
    if flags[-1] == "3x":  # later flags win: a longer run with a cosine of its own length
        flags = flags[:-1] + ["--decay-steps", str(3 * args.steps), "--max-steps", str(3 * args.steps)]
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}  # the namespace has no other interface
    try:
        return run_trainer([*recipe(args), *flags], args.processes, label=f"run {name} ({rate or 'loopback'})",
                           env=env, wrap=functools.partial(shaped, rate=rate) if rate else None).metrics
    except TrainerRunFailed as failure:
        raise SystemExit(str(failure)) from None


def time_to_reach(evals: list[dict[str, Any]], target: float) -> float | None:
    """The seconds of training at which the validation loss first reaches ``target``, interpolated linearly
    between the evaluations around it (None: never)."""
    previous = None
    for entry in evals:
        if entry["val_loss"] <= target:
            if previous is None or previous["val_loss"] == entry["val_loss"]:
                return entry["time_s"]
            share = (previous["val_loss"] - target) / (previous["val_loss"] - entry["val_loss"])
            return previous["time_s"] + share * (entry["time_s"] - previous["time_s"])
        previous = entry
    return None


def summary(name: str, link: str, metrics: dict[str, Any]) -> dict[str, Any]:
    evals = metrics["evals"]
    if not evals or evals[-1]["step"] != metrics["optimizer_steps"]:
        raise SystemExit(f"run {name}: --steps must be a multiple of --eval-every (the last evaluation is the final "
                         f"loss)")
    return {"name": name, "link": link, "flags": RUNS[name], "world_size": metrics["world_size"],
            "steps": metrics["optimizer_steps"], "val_loss": evals[-1]["val_loss"],
            "val_bits_per_byte": evals[-1]["val_bits_per_byte"], "train_time_s": evals[-1]["time_s"],
            "wall_time_s": metrics["wall_time_s"], "sent_bytes": metrics["sent_bytes"],
            "data_parallel_sent_bytes": metrics["data_parallel_sent_bytes"],
            "outer_all_reduces": len(metrics.get("outer_all_reduces") or []),
            "peak_in_flight_bytes": metrics.get("peak_in_flight_bytes"), "model_bytes": metrics.get("model_bytes"),
            "gzip_bits_per_byte": metrics.get("val_gzip_bits_per_byte"), "evals": evals}


def compare(runs: list[dict[str, Any]]) -> None:
    """Each run against DDP on the same link: loss ratio, bytes ratio, time to DDP's final loss."""
    for run in runs:
        ddp = next((r for r in runs if r["name"] == "ddp" and r["link"] == run["link"]), None)
        if ddp is None:
            continue
        run["loss_vs_ddp"] = run["val_loss"] / ddp["val_loss"]
        run["bytes_fewer_than_ddp"] = ddp["sent_bytes"] / max(run["sent_bytes"], 1)
        reached = time_to_reach(run["evals"], ddp["val_loss"])
        run["time_to_ddp_loss_s"] = reached
        run["time_to_ddp_loss_vs_ddp"] = None if reached is None else reached / ddp["train_time_s"]


def print_table(runs: list[dict[str, Any]]) -> None:
    print(f"{'run':<20} {'link':<9} {'bits/byte':>9} {'vs DDP':>7} {'MB sent':>9} {'x fewer':>8} "
          f"{'train s':>8} {'to DDP loss':>12}")
    for run in runs:
        reached = run.get("time_to_ddp_loss_vs_ddp")
        print(f"{run['name']:<20} {run['link']:<9} {run['val_bits_per_byte']:>9.4f} "
              f"{100 * (run.get('loss_vs_ddp', 1) - 1):>+6.2f}% {run['sent_bytes'] / 1e6:>9.2f} "
              f"{run.get('bytes_fewer_than_ddp', 1):>8.1f} {run['train_time_s']:>8.1f} "
              f"{'never' if reached is None else f'{reached:.2f}x':>12}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", choices=tuple(RUNS), default=DEFAULT_RUNS,
                        help=f"default: all but {', '.join(sorted(set(RUNS) - set(DEFAULT_RUNS)))}")
    parser.add_argument("--link", choices=("both", "shaped", "loopback"), default="both",
                        help=f"shaped: {RATE} (tc tbf in a namespace); loopback: unshaped; both: every run shaped and "
                             f"{', '.join(UNSHAPED)} also unshaped")
    parser.add_argument("--rate", default=RATE, help="the shaped link's rate, as tc writes it")
    parser.add_argument("--processes", type=int, default=4, help="W: processes (one replica each for DiLoCo)")
    parser.add_argument("--steps", type=int, default=1500, help="inner optimizer steps of every run")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validations (divides --steps)")
    parser.add_argument("--batch-size", type=int, default=16, help="windows of 64 bytes per process and step")
    parser.add_argument("--out", default=None, help="JSON (default results/slowlink-<machine>.json)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the runs already in --out that this invocation does not repeat (same recipe)")
    args = parser.parse_args(argv)
    if args.steps % args.eval_every:
        parser.error(f"--eval-every {args.eval_every} must divide --steps {args.steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refused = shaping_refused(args.rate) if args.link != "loopback" else None
    if refused:
        print(f"no shaped link here ({refused}): every run goes over plain loopback")
    plan = []
    for name in args.runs:
        if args.link in ("both", "shaped") and not refused:
            plan.append((name, args.rate))
        if args.link == "loopback" or refused or (args.link == "both" and name in UNSHAPED):
            plan.append((name, None))
    link = {"rate": None if refused or args.link == "loopback" else args.rate, "refused": refused}
    if link["rate"]:
        link["measured_mbit_s"] = measure_link(args.rate)
        print(f"shaped loopback: {link['measured_mbit_s']:.0f} Mbit/s measured ({args.rate} asked)")
    link["loopback_mbit_s"] = measure_link(None)
    runs = []
    for name, rate in tqdm(plan, desc="runs", disable=not sys.stderr.isatty()):
        runs.append(summary(name, rate or "loopback", train(name, rate, args)))
        tqdm.write(f"{name} ({rate or 'loopback'}): {runs[-1]['val_bits_per_byte']:.4f} bits/byte, "
                   f"{runs[-1]['sent_bytes'] / 1e6:.1f} MB sent, {runs[-1]['train_time_s']:.0f} s")
    out = args.out or os.path.join(HERE, "results", f"slowlink-{machine_tag()}.json")
    command = "python -m " + shlex.join(["benchmarks.slowlink_benchmark", *(argv or sys.argv[1:])])
    commands = [command]
    if args.merge and os.path.exists(out):
        with open(out) as f:
            earlier = json.load(f)
        if earlier["recipe"] != recipe(args) or earlier["processes"] != args.processes:
            raise SystemExit(f"--merge: {out} holds runs of another recipe or number of processes")
        done = {(r["name"], r["link"]) for r in runs}
        runs = [r for r in earlier["runs"] if (r["name"], r["link"]) not in done] + runs
        commands = earlier.get("commands", [earlier["command"]]) + commands
        link = earlier["link"]
    compare(runs)
    print_table(runs)
    write_json(out, {"benchmark": "slowlink", "machine": machine_info(), "link": link,
                     "command": " && ".join(commands), "commands": commands, "recipe": recipe(args),
                     "processes": args.processes, "runs": runs})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
