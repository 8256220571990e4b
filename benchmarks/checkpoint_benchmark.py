"""What a checkpoint costs the training loop: the stall of a synchronous save against a save in the background, ours
(zero.checkpoint's AsyncWriter at stage 3) beside FSDP2's (dcp.save; DCP's async_save with its thread and with its
process writer), on the same model and state.

    python -m benchmarks.checkpoint_benchmark [--model gpt2] [--world 4] [--saves 3] [--json results/....json]

One harness.LocalGroup of --world processes (gloo on the CPU, one intra-op thread each) builds models.py's GPT
(``--model``: GPT-2 small's shape by default) on the meta device, shards it (``zero3``: zero.shard(model, 3);
``fsdp3``: fully_shard per block), takes one AdamW step on random bytes (so the optimizer has its state), and then,
per way of saving, --saves saves each into a folder of its own. For each save:

    stall      the seconds the loop spends in the save call (a synchronous save: all of it; a background one: the
               copy into its staging buffers, and any wait for the save before it); the largest rank's
    write      from the call until the save is on disk (every rank's future done)
    overlap    the steps the loop takes while a background save writes (one at least, then until every rank's is
               done), each step's seconds against the median of --steps steps with nothing in flight
    rss        the rank's resident set after the save, above the one before the first save of its way (MB): the
               staging buffers are one more copy of the rank's state, and must not grow from save to save

The ways: ``sync`` (zero.checkpoint.save), ``async`` (zero.checkpoint.save with an AsyncWriter), and for fsdp3
``dcp`` (get_state_dict + dcp.save), ``dcp-async`` (DCP's async_save: a thread), ``dcp-async-process`` (DCP's
async_save with AsyncCheckpointerType.PROCESS: a writer process per rank, which DCP starts at the first save: the
first save's stall includes that start). Every background way saves over a gloo group of its own (the loop's
collectives run meanwhile on the loop's).

Writes results/checkpoint-<machine>.json (or --json); prints a table of the medians over saves.

``--alternate``: the synchronous save time alone, ours against FSDP2's where the disk and the machine are the same:
both models built in the same processes, ``sync`` and ``dcp`` saves alternated (which goes first swaps from round to
round), each folder removed after its save; per way the largest rank's seconds per save, their median and the ratio,
and where rank 0's time went (cProfile over its saves: building the state dict, DCP's planning with its exchange of
plans, the write of the items, the fsyncs among them, the metadata's finish). Writes
results/checkpoint-save-time-<machine>.json (or --json).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

WAYS = {"zero3": ("sync", "async"), "fsdp3": ("dcp", "dcp-async", "dcp-async-process")}
MB = 1e6


def save_once(way: str, path: str, sync: Any, optimizer: Any, writer: Any) -> Any:
    """One save of ``way``; the future of a background one (None: written when it returns)."""
    import zero.checkpoint
    if way == "sync":
        return zero.checkpoint.save(path, sync, optimizer)
    if way == "async":
        return zero.checkpoint.save(path, sync, optimizer, writer=writer)
    if way == "dcp":
        return sync.save_checkpoint(path, [optimizer])
    if way == "dcp-async":
        return sync.save_checkpoint(path, [optimizer], writer=writer)
    # DCP's process writer: the same state dict, handed to its own process
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    writer.wait()
    with sync._fsdp2_state_dicts():
        model_state, optimizer_state = get_state_dict(sync.model, [optimizer])
    return writer.adopt(dcp.async_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path,
                                       process_group=writer.writer_group(None),
                                       async_checkpointer_type=AsyncCheckpointerType.PROCESS))


def all_done(future: Any) -> bool:
    """Whether every rank's save is written (one all-reduce: the loop's ranks agree to go on stepping or not)."""
    done = torch.tensor([int(future.done())])
    dist.all_reduce(done, op=dist.ReduceOp.MIN)
    return bool(done.item())


def measure(rank: int, world_size: int, row: str, settings: dict) -> dict:
    """One rank of ``row``: each way's saves, with their stalls, writes, overlapped steps and resident sets."""
    from measure.malloc import pin_mmap_threshold
    from measure.memory import proc_status_mb
    import zero.checkpoint
    from benchmarks.memory_benchmark import build, step
    from zero.checkpoint import save  # noqa: F401  (its modules and DCP's, imported before anything is measured)

    pin_mmap_threshold()  # freed blocks go back: the resident set is what is alive ([Note: the allocator])
    context, saves = settings["context"], settings["saves"]
    tokens = torch.randint(0, 256, (1, context + 1), generator=torch.Generator().manual_seed(rank))
    model, sync, optimizer = build(row, settings["model"], context)
    step(model, optimizer, tokens)

    def timed_step() -> float:
        began = time.perf_counter()
        step(model, optimizer, tokens)
        return time.perf_counter() - began

    quiet = [timed_step() for _ in range(settings["steps"])]
    out: dict[str, Any] = {"step_s": statistics.median(quiet), "ways": {}}
    for way in WAYS[row]:
        writer = zero.checkpoint.AsyncWriter() if way != "sync" and way != "dcp" else None
        gc.collect()
        dist.barrier()
        before = proc_status_mb("VmRSS")
        records = []
        for index in range(saves):
            path = os.path.join(settings["root"], f"{row}-{way}-{index}")
            dist.barrier()
            began = time.perf_counter()
            future = save_once(way, path, sync, optimizer, writer)
            stall = time.perf_counter() - began
            overlapped = []
            if future is not None:  # every rank steps alike (the steps are collectives) until every write is done
                while not overlapped or not all_done(future):
                    overlapped.append(timed_step())
                writer.wait()
            written = time.perf_counter() - began
            dist.barrier()
            records.append({"stall_s": stall, "write_s": written, "overlapped_steps_s": overlapped,
                            "rss_above_mb": proc_status_mb("VmRSS") - before})
        if writer is not None:
            out["staged_mb"] = writer.staging.nbytes() / MB if way == "async" else out.get("staged_mb")
            writer.close()
        out["ways"][way] = records
    dist.barrier()
    return out


SPLIT = {  # where a save's seconds go: (file's tail, function) in cProfile's view of rank 0
    "state dict": [("zero/checkpoint/state_dict.py", "model_entries"), ("zero/checkpoint/state_dict.py",
                   "optimizer_entries"), ("checkpoint/state_dict.py", "get_state_dict")],
    "planning": [("checkpoint/state_dict_saver.py", "local_step"), ("checkpoint/state_dict_saver.py", "global_step")],
    "write": [("checkpoint/state_dict_saver.py", "write_data")],
    "fsync": [("~", "<built-in method posix.fsync>")],
    "finish": [("checkpoint/state_dict_saver.py", "finish_checkpoint")],
}


def split_of(profile: cProfile.Profile, saves: int) -> dict[str, float]:
    """Seconds per save in each part of SPLIT (cumulative: fsync is inside write)."""
    stats = pstats.Stats(profile).stats  # (file, line, function) -> (calls, primitive calls, own, cumulative, ...)
    out = {part: sum(ct for (file, _, function), (_, _, _, ct, _) in stats.items()
                     for tail, name in names if file.endswith(tail) and function == name) / saves
           for part, names in SPLIT.items()}
    return {part: round(seconds, 4) for part, seconds in out.items()}


def measure_alternate(rank: int, world_size: int, settings: dict) -> dict:
    """One rank of --alternate: ours (zero3, sync) and FSDP2's (fsdp3, dcp) saves, alternated."""
    from measure.malloc import pin_mmap_threshold
    from benchmarks.memory_benchmark import build, step

    pin_mmap_threshold()
    tokens = torch.randint(0, 256, (1, settings["context"] + 1), generator=torch.Generator().manual_seed(rank))
    built = {}
    for way, row in (("sync", "zero3"), ("dcp", "fsdp3")):
        model, sync, optimizer = build(row, settings["model"], settings["context"])
        step(model, optimizer, tokens)
        built[way] = (sync, optimizer)
    seconds: dict[str, list[float]] = {way: [] for way in built}
    profiles = {way: cProfile.Profile() for way in built}
    for index in range(settings["saves"]):
        for way in (("sync", "dcp") if index % 2 == 0 else ("dcp", "sync")):
            path = os.path.join(settings["root"], f"{way}-{index}")
            gc.collect()
            dist.barrier()
            began = time.perf_counter()
            if rank == 0:
                profiles[way].enable()
            save_once(way, path, *built[way], None)
            profiles[way].disable()
            seconds[way].append(time.perf_counter() - began)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    return {"seconds": seconds,
            "split": {way: split_of(profile, settings["saves"]) for way, profile in profiles.items()}
            if rank == 0 else None}


def main_alternate(args: argparse.Namespace, argv: list[str] | None) -> dict:
    import harness
    from files import write_json
    from measure.machine import machine_info, machine_tag

    with tempfile.TemporaryDirectory(prefix="checkpoint-benchmark-") as root:
        with harness.LocalGroup(args.world, timeout_s=args.timeout, start_timeout_s=args.timeout) as group:
            settings = {"model": args.model, "context": args.context, "saves": args.saves, "root": root}
            ranks = group.run(measure_alternate, settings, timeout_s=args.timeout)
    ways = {}
    for way in ("sync", "dcp"):
        per_save = [max(rank["seconds"][way][i] for rank in ranks) for i in range(args.saves)]
        ways[way] = {"seconds": per_save, "median_s": statistics.median(per_save), "rank0_split_s":
                     ranks[0]["split"][way]}
    ratio = ways["sync"]["median_s"] / ways["dcp"]["median_s"]
    print(f"{'way':5} {'median s':>8}  per save (the largest rank's)  rank 0's split per save (s)")
    for way, figures in ways.items():
        split = ", ".join(f"{part} {s:.2f}" for part, s in figures["rank0_split_s"].items())
        print(f"{way:5} {figures['median_s']:8.3f}  {', '.join(f'{s:.2f}' for s in figures['seconds']):28}  {split}")
    print(f"ours (zero.checkpoint.save, stage 3) / FSDP2's (get_state_dict + dcp.save): {ratio:.2f}x")
    payload = {"benchmark": "checkpoint-save-time", "command": "python -m benchmarks.checkpoint_benchmark " +
               " ".join(argv if argv is not None else sys.argv[1:]), "machine": machine_info(torch.device("cpu")),
               "model": args.model, "world": args.world, "context": args.context, "saves": args.saves,
               "ways": ways, "ratio_ours_to_fsdp2": ratio}
    path = args.json or os.path.join("results", f"checkpoint-save-time-{machine_tag()}.json")
    write_json(path, payload)
    print(f"wrote {path}")
    return payload


def summarize(row: str, ranks: list[dict]) -> list[dict]:
    """Per way: the medians over saves of the largest rank's stall and write, the overlapped steps against the
    quiet ones, the largest rank's resident set after the last save."""
    rows = []
    step_s = max(rank["step_s"] for rank in ranks)
    for way in WAYS[row]:
        saves = len(ranks[0]["ways"][way])
        stalls = [max(rank["ways"][way][i]["stall_s"] for rank in ranks) for i in range(saves)]
        writes = [max(rank["ways"][way][i]["write_s"] for rank in ranks) for i in range(saves)]
        overlapped = [s for rank in ranks for record in rank["ways"][way] for s in record["overlapped_steps_s"]]
        quiet = statistics.median(rank["step_s"] for rank in ranks)
        rows.append({"row": row, "way": way, "stall_s": stalls, "write_s": writes,
                     "stall_s_median": statistics.median(stalls), "write_s_median": statistics.median(writes),
                     "step_s": step_s, "overlapped_step_ratio": (statistics.median(overlapped) / quiet
                                                                  if overlapped else None),
                     "rss_above_mb": [max(rank["ways"][way][i]["rss_above_mb"] for rank in ranks)
                                      for i in range(saves)],
                     "staged_mb": max(rank.get("staged_mb") or 0 for rank in ranks) if way == "async" else None})
    return rows


def print_table(rows: list[dict]) -> None:
    sync = {row["row"]: row["stall_s_median"] for row in rows if row["way"] in ("sync", "dcp")}
    print(f"{'row':6} {'way':18} {'stall s':>8} {'/ sync':>7} {'write s':>8} {'step x':>7} {'rss MB after each save'}")
    for row in rows:
        ratio = row["overlapped_step_ratio"]
        print(f"{row['row']:6} {row['way']:18} {row['stall_s_median']:8.3f} "
              f"{row['stall_s_median'] / sync[row['row']]:7.3f} {row['write_s_median']:8.3f} "
              f"{'' if ratio is None else f'{ratio:7.2f}':>7} "
              f"{', '.join(f'{mb:.0f}' for mb in row['rss_above_mb'])}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", help="models.py's GPT (default: GPT-2 small's shape)")
    parser.add_argument("--world", type=int, default=4, help="processes (default 4)")
    parser.add_argument("--saves", type=int, default=3, help="saves per way (default 3)")
    parser.add_argument("--steps", type=int, default=3, help="quiet steps timed before the saves (default 3)")
    parser.add_argument("--context", type=int, default=64, help="bytes per sequence (one sequence per rank)")
    parser.add_argument("--rows", default="zero3,fsdp3", help="zero3 (ours), fsdp3 (FSDP2 and DCP's)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for each row")
    parser.add_argument("--alternate", action="store_true",
                        help="the synchronous save's time alone, ours and FSDP2's alternated (see above)")
    parser.add_argument("--json", default=None, help="default: results/checkpoint-<machine>.json")
    args = parser.parse_args(argv)
    unknown = set(args.rows.split(",")) - set(WAYS)
    if unknown or args.world < 1 or args.saves < 1 or args.steps < 1:
        parser.error(f"--rows takes {', '.join(WAYS)}; --world, --saves and --steps are positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    import harness
    from files import write_json
    from measure.machine import machine_info, machine_tag

    args = parse_args(argv)
    if args.alternate:
        return main_alternate(args, argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="checkpoint-benchmark-") as root:
        with harness.LocalGroup(args.world, timeout_s=args.timeout, start_timeout_s=args.timeout) as group:
            for row in args.rows.split(","):
                settings = {"model": args.model, "context": args.context, "saves": args.saves,
                            "steps": args.steps, "root": root}
                rows += summarize(row, group.run(measure, row, settings, timeout_s=args.timeout))
    print_table(rows)
    payload = {"benchmark": "checkpoint", "command": "python -m benchmarks.checkpoint_benchmark " + " ".join(
                   argv if argv is not None else sys.argv[1:]),
               "machine": machine_info(torch.device("cpu")), "model": args.model, "world": args.world,
               "context": args.context, "allocator": "pinned (mallopt M_MMAP_THRESHOLD 128 kB)", "rows": rows}
    path = args.json or os.path.join("results", f"checkpoint-{machine_tag()}.json")
    write_json(path, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
