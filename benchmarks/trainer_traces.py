"""The trainer's --profile traces as the benchmarks keep them: each rank's named ranges, every rank in one Chrome trace.

torch.profiler writes one Chrome trace per rank (``rankR.pt.trace.json`` in the --profile folder), mostly operator
and kernel events; the named ranges (record_function: the trainer's ProfilerStep#N, micro-batches, forward,
backward, buckets and waits, SyncBatchNorm's and c10d's collectives, zero's units) are what the report draws as a
timeline. training_benchmark.py --trace and zero_benchmark.py --trace keep those, both ranks in one trace.
"""
from __future__ import annotations

import json
import os


def rank_traces(folder: str, nproc: int) -> list[dict]:
    """The Chrome trace of each of ``nproc`` ranks that a run's --profile wrote into ``folder``, in rank order."""
    traces = []
    for rank in range(nproc):
        with open(os.path.join(folder, f"rank{rank}.pt.trace.json")) as f:
            traces.append(json.load(f))
    return traces


def named_ranges(trace: dict) -> list[dict]:
    """The named ranges of a torch.profiler Chrome trace (record_function's "user_annotation" events: ours,
    SyncBatchNorm's, c10d's, the profiler's ProfilerStep#N), ordered by start; times in microseconds."""
    return sorted((e for e in trace["traceEvents"] if e.get("cat") == "user_annotation" and e.get("ph") == "X"),
                  key=lambda e: e["ts"])


def merge_ranks(traces: list[dict]) -> list[dict]:
    """Every rank's named ranges in one Chrome trace's events: pid = rank, threads numbered per rank in order of
    appearance, times from the first event (the ranks share this machine's clock), plus the names Perfetto and
    chrome://tracing show for each process and thread."""
    ranges = [named_ranges(trace) for trace in traces]
    origin = min(r[0]["ts"] for r in ranges if r)
    events = []
    for rank, rank_ranges in enumerate(ranges):
        threads: dict[int, int] = {}
        for e in rank_ranges:
            tid = threads.setdefault(e["tid"], len(threads))
            events.append({"ph": "X", "cat": "user_annotation", "name": e["name"], "pid": rank, "tid": tid,
                           "ts": round(e["ts"] - origin, 3), "dur": round(e["dur"], 3)})
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for original, tid in threads.items():
            names = {e["name"] for e in rank_ranges if e["tid"] == original}
            role = ("training thread" if tid == 0 else "c10d work thread" if all(":" in n for n in names)
                    else "thread")  # c10d names its ranges backend:collective (gloo:all_reduce)
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": f"{role} {original}"}})
    return events
