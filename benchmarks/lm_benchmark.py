"""The byte-level GPT against gzip -9 in 10 minutes: AdamW and the Muon recipe, each at the learning rate a sweep
chose, bits per byte against wall time on this machine.

    python -m benchmarks.lm_benchmark                                  # the sweep, then the two timed runs
    python -m benchmarks.lm_benchmark --optimizers muon --lrs muon=0.02 --budget-s 600   # one timed run, no sweep

The task: models.py's small GPT (``--model gpt``: 4 pre-LayerNorm blocks of width 160, 5 heads, context 128,
1.3M parameters, the head tied to the byte embedding) on the Python standard library's source (the trainer's
``--dataset text``; 1% of the bytes, whole files chosen by the hash of their path, for validation), 2 processes
(gloo, one intra-op thread each), 8 windows per process and step: 2,048 bytes predicted per step. The goal is the
validation bits per byte of ``gzip -9`` on the same validation bytes (1.850 here) within ``--budget-s`` (600 s) of
wall time, the whole ``torchrun`` counted (start-up, the data, the run's own validation at its end) but for the
evaluations that draw the curve (``--eval-every``: about 10 s each here), which a run for the result alone would
not make.

Why this shape. On 2 shared cores a step of this model takes about 0.2 s, so 10 minutes are about 3,000 steps:
about 6M bytes, 5 bytes per parameter. With AdamW at 4e-3 it reached 2.069 bits per byte after 5.7M bytes and went
below gzip's only between 9.2M and 12.3M bytes (docs/language-models.md): the 10 minutes have to come from learning
more per byte (the optimizer, its rate) and from more steps a second (a sync that does less than stage 3's
gathers), not from a larger model, which would see even fewer bytes per parameter.

The recipe (both optimizers): betas (0.9, 0.95), weight decay 0.1 on matrices and none on norms and biases, clipping
at 1.0, 50 warm-up steps then a cosine to a tenth of the peak at the run's last step. ``adamw``: AdamW on every
parameter at ``--lr``. ``muon``: torch.optim.Muon on the blocks' hidden matrices at ``--muon-lr`` (momentum 0.95,
decay 0.01), AdamW at ``--lr`` on the rest (embeddings, the tied head, norms, biases); one schedule for both rates.
Every run uses ``--grad-sync custom --zero 0`` (``--zero`` picks another stage: the weights are the same, the
time is not).

The sweep (each optimizer's rate): ``--sweep-steps`` steps (a cosine of that length) at each rate of ``--sweep``;
the rate with the lowest validation loss at the end wins (``muon``: Muon's rate, AdamW's part at the rate AdamW's
sweep chose). A short sweep favours rates a little high for a longer run; the timed run's cosine is longer but
starts from the same peak. The sweep's runs also give the step time, from which the timed run's number of steps is
chosen: the most that fit ``--budget-s`` with the start-up, the evaluations and a margin of ``--margin`` (5%).

The timed runs evaluate every tenth of the run (left out of their seconds of training and of the goal's clock,
reported beside it). Writes ``results/lm-<machine>.json`` (every run's curve: step, seconds of training, bits per byte);
prints the table; the report plots the curves against gzip's line.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from tqdm import tqdm

from benchmarks.slowlink_benchmark import time_to_reach
from benchmarks.trainer_runs import TrainerRunFailed, run_trainer
from files import write_json
from measure.machine import machine_info, machine_tag

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
PROCESSES = 2
SWEEP = {"adamw": [2e-3, 4e-3, 8e-3], "muon": [0.01, 0.02, 0.04]}
DEFAULT_ADAMW_LR = 4e-3  # the documented run's (docs/language-models.md), AdamW's part of muon without a sweep
WARMUP_STEPS = 50


def recipe(optimizer: str, lr: float, muon_lr: float | None, steps: int, eval_every: int, zero: int) -> list[str]:
    """The trainer's flags for one run (see the module's docstring)."""
    flags = ["--device", "cpu", "--dataset", "text", "--model", "gpt", "--context", "128", "--batch-size", "8",
             "--val-fraction", "0.01", "--grad-sync", "custom", "--zero", str(zero), "--optimizer", optimizer,
             "--lr", f"{lr:g}", "--betas", "0.9", "0.95", "--weight-decay", "0.1", "--norm-weight-decay", "0",
             "--clip-grad-norm", "1.0", "--scheduler", "cosine", "--warmup-steps", str(WARMUP_STEPS),
             "--min-lr", f"{lr / 10:g}", "--decay-steps", str(steps), "--max-steps", str(steps), "--epochs", "1",
             "--eval-every", str(eval_every), "--log-every", "100", "--seed", "0"]
    if optimizer == "muon":
        flags += ["--muon-lr", f"{muon_lr:g}", "--muon-momentum", "0.95", "--muon-weight-decay", "0.01"]
    return flags


def train(flags: list[str], name: str, timeout: float) -> tuple[dict[str, Any], float]:
    """One torchrun of the trainer: its metrics and the wall seconds of the whole command."""
    try:
        run = run_trainer(flags, PROCESSES, label=f"lm_benchmark: run {name}", timeout_s=timeout,
                          env={"OMP_NUM_THREADS": "1"})
    except TrainerRunFailed as failure:
        raise SystemExit(str(failure)) from None
    return run.metrics, run.wall_s


def summary(name: str, kind: str, optimizer: str, lr: float, muon_lr: float | None, flags: list[str],
            metrics: dict[str, Any], wall: float) -> dict[str, Any]:
    evals = metrics["evals"]
    gzip = metrics["val_gzip_bits_per_byte"]
    final = evals[-1] if evals and evals[-1]["step"] == metrics["optimizer_steps"] else None
    bits = final["val_bits_per_byte"] if final else metrics["val_bits_per_byte"]
    reached = time_to_reach([{"time_s": e["time_s"], "val_loss": e["val_bits_per_byte"]} for e in evals], gzip)
    training = final["time_s"] if final else metrics["train_time_s"]  # the --eval-every evaluations left out
    curve_seconds = metrics["train_time_s"] - training  # what those evaluations took
    return {"name": name, "kind": kind, "optimizer": optimizer, "lr": lr, "muon_lr": muon_lr,
            "command": "torchrun --standalone --nproc_per_node 2 ddp_cifar100.py " + shlex.join(flags),
            "steps": metrics["optimizer_steps"], "val_bits_per_byte": bits, "gzip_bits_per_byte": gzip,
            "train_time_s": training, "wall_time_s": wall, "curve_evaluation_s": curve_seconds,
            "clock_s": wall - curve_seconds,
            "step_time_ms_median": metrics["step_time_ms_median"], "tokens_per_s": metrics["tokens_per_s"],
            "training_seconds_to_gzip": reached,
            "evals": [{k: e[k] for k in ("step", "time_s", "val_bits_per_byte")} for e in evals]}


def parse_lrs(text: list[str] | None) -> dict[str, float]:
    chosen = {}
    for item in text or []:
        name, _, value = item.partition("=")
        try:
            chosen[name] = float(value)
        except ValueError:
            raise SystemExit(f"--lrs takes optimizer=rate, such as adamw=4e-3 muon=0.02; got {item!r}") from None
        if name not in SWEEP:
            raise SystemExit(f"--lrs: {name!r} is not one of {', '.join(SWEEP)}")
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", nargs="+", choices=tuple(SWEEP), default=list(SWEEP))
    parser.add_argument("--lrs", nargs="+", metavar="OPTIMIZER=RATE",
                        help="skip the sweep for these (adamw: --lr; muon: --muon-lr)")
    parser.add_argument("--sweep", nargs="+", metavar="OPTIMIZER=R1,R2,...",
                        help="the rates each sweep tries (default: " + "; ".join(
                            f"{k}={','.join(f'{r:g}' for r in v)}" for k, v in SWEEP.items()) + ")")
    parser.add_argument("--sweep-steps", type=int, default=600, help="steps of each sweep run (default 600)")
    parser.add_argument("--budget-s", type=float, default=600.0, help="wall seconds of each timed run (default 600)")
    parser.add_argument("--steps", type=int, default=None,
                        help="the timed runs' steps (default: the most that fit --budget-s at the sweep's step time)")
    parser.add_argument("--margin", type=float, default=0.05, help="of --budget-s kept free (default 0.05)")
    parser.add_argument("--zero", type=int, choices=range(4), default=0, help="the ZeRO stage of every run (0)")
    parser.add_argument("--out", default=None, help="JSON (default results/lm-<machine>.json)")
    args = parser.parse_args(argv)
    args.chosen = parse_lrs(args.lrs)
    args.grid = dict(SWEEP)
    for item in args.sweep or []:
        name, _, values = item.partition("=")
        try:
            args.grid[name] = [float(v) for v in values.split(",")]
        except ValueError:
            parser.error(f"--sweep takes optimizer=r1,r2,..., such as muon=0.01,0.02; got {item!r}")
        if name not in SWEEP:
            parser.error(f"--sweep: {name!r} is not one of {', '.join(SWEEP)}")
    if args.sweep_steps <= 2 * WARMUP_STEPS or args.budget_s <= 0 or not 0 <= args.margin < 1:
        parser.error(f"--sweep-steps must exceed {2 * WARMUP_STEPS}, --budget-s be positive, --margin in [0, 1)")
    if args.steps is not None and args.steps <= 2 * WARMUP_STEPS:
        parser.error(f"--steps must exceed {2 * WARMUP_STEPS}")
    return args


def steps_within(budget_s: float, margin: float, runs: list[dict[str, Any]]) -> int:
    """The most steps of the slowest optimizer that fit the budget: its sweep runs' clock seconds outside training
    (start-up, the data, the run's own last validation, the end) kept, the rest divided by its seconds per step,
    a margin kept free."""
    fits = []
    for optimizer in {r["optimizer"] for r in runs}:
        mine = [r for r in runs if r["optimizer"] == optimizer]
        per_step = max(r["train_time_s"] / r["steps"] for r in mine)
        outside = max(r["clock_s"] - r["train_time_s"] for r in mine)
        fits.append(int((budget_s * (1 - margin) - outside) / per_step))
    return max(100 * (min(fits) // 100), 2 * WARMUP_STEPS + 100)


def print_table(runs: list[dict[str, Any]]) -> None:
    print(f"{'run':<24} {'steps':>6} {'bits/byte':>9} {'gzip':>6} {'train s':>8} {'clock s':>8} {'wall s':>7} "
          f"{'s to gzip':>9}")
    for r in runs:
        reached = "never" if r["training_seconds_to_gzip"] is None else f"{r['training_seconds_to_gzip']:.0f}"
        print(f"{r['name']:<24} {r['steps']:>6} {r['val_bits_per_byte']:>9.4f} {r['gzip_bits_per_byte']:>6.3f} "
              f"{r['train_time_s']:>8.1f} {r['clock_s']:>8.1f} {r['wall_time_s']:>7.1f} {reached:>9}")
    print("(train s: training alone; clock s: the whole run's wall time less the curve's evaluations, what the goal "
          "counts; s to gzip: seconds of training when the curve crossed gzip's bits per byte)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs: list[dict[str, Any]] = []
    chosen = dict(args.chosen)
    sweeping = [o for o in ["adamw", "muon"] if o in args.optimizers and o not in chosen]
    if "muon" in sweeping and "adamw" not in chosen and "adamw" not in sweeping:
        chosen["adamw"] = DEFAULT_ADAMW_LR
    plan = [(o, rate) for o in sweeping for rate in args.grid[o]]
    bar = tqdm(total=len(plan) + len(args.optimizers), desc="runs", disable=not sys.stderr.isatty())
    for optimizer in sweeping:  # adamw first: muon's AdamW part takes its rate
        for rate in args.grid[optimizer]:
            lr, muon_lr = (rate, None) if optimizer == "adamw" else (chosen.get("adamw", DEFAULT_ADAMW_LR), rate)
            flags = recipe(optimizer, lr, muon_lr, args.sweep_steps, args.sweep_steps // 4, args.zero)
            name = f"sweep {optimizer} {rate:g}"
            metrics, wall = train(flags, name, timeout=4 * args.budget_s)
            runs.append(summary(name, "sweep", optimizer, lr, muon_lr, flags, metrics, wall))
            bar.update(1)
            tqdm.write(f"{name}: {runs[-1]['val_bits_per_byte']:.4f} bits/byte, {wall:.0f} s")
        best = min((r for r in runs if r["optimizer"] == optimizer), key=lambda r: r["val_bits_per_byte"])
        chosen[optimizer] = best["lr"] if optimizer == "adamw" else best["muon_lr"]
    steps = args.steps or (steps_within(args.budget_s, args.margin, runs) if runs else None)
    if steps is None:
        raise SystemExit("lm_benchmark: without a sweep the timed runs need --steps")
    for optimizer in args.optimizers:
        lr, muon_lr = ((chosen["adamw"], None) if optimizer == "adamw"
                       else (chosen.get("adamw", DEFAULT_ADAMW_LR), chosen["muon"]))
        flags = recipe(optimizer, lr, muon_lr, steps, max(steps // 10, 1), args.zero)
        metrics, wall = train(flags, f"timed {optimizer}", timeout=4 * args.budget_s)
        runs.append(summary(f"timed {optimizer}", "timed", optimizer, lr, muon_lr, flags, metrics, wall))
        bar.update(1)
        tqdm.write(f"timed {optimizer}: {runs[-1]['val_bits_per_byte']:.4f} bits/byte after {steps} steps, "
                   f"{wall:.0f} s")
    bar.close()
    print_table(runs)
    for r in runs:
        if r["kind"] == "timed":
            met = r["val_bits_per_byte"] <= r["gzip_bits_per_byte"] and r["clock_s"] <= args.budget_s
            print(f"{r['optimizer']}: {r['val_bits_per_byte']:.3f} bits/byte against gzip -9's "
                  f"{r['gzip_bits_per_byte']:.3f} in {r['clock_s']:.0f} s (the curve's evaluations left out; "
                  f"{r['wall_time_s']:.0f} s with them): goal {'met' if met else 'missed'}")
    out = args.out or os.path.join(HERE, "results", f"lm-{machine_tag()}.json")
    write_json(out, {"benchmark": "lm", "machine": machine_info(),
                     "command": "python -m " + shlex.join(["benchmarks.lm_benchmark", *(argv or sys.argv[1:])]),
                     "processes": PROCESSES, "zero": args.zero, "budget_s": args.budget_s,
                     "sweep_steps": args.sweep_steps, "chosen": chosen, "runs": runs})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
