"""The coordinator's process: a TCPStore server and the lighthouse beside it (coordinator.py), until it is stopped.

    python -m replicas serve --port 29400 [--host 0.0.0.0] [--new-run] [--runs-file PATH]
"""
from __future__ import annotations

import argparse
import sys
from datetime import timedelta

from torch.distributed import TCPStore

from replicas.coordinator import Lighthouse
from replicas.protocol import SERVE, one_line
from replicas.runs_file import RunsFile, RunsFileError


def serve(port: int, host: str = "0.0.0.0", new_run: bool = False, runs_file: str | None = None) -> None:
    """The coordinator: a TCPStore server on HOST:PORT and the lighthouse, until the process is stopped; with
    ``runs_file``, the lighthouse keeps its runs there and resumes them from it (RunsFileError: it cannot)."""
    kept = RunsFile(runs_file) if runs_file is not None else None  # (read before the port is taken)
    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    print(f"replicas serve: coordinator on {host}:{store.port}", flush=True)
    if kept is not None and kept.kept is not None:
        end = kept.kept["finished"]
        print(f"replicas serve: resumed from {runs_file}: run {kept.kept['run']}, "
              f"{'not finished' if end is None else 'finished at step %d' % end['step']}, "
              f"{len(kept.kept['finished_runs'])} run(s) before it", flush=True)
    Lighthouse(store, new_run, host, kept).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replicas", description="the coordinator of fault-tolerant "
                                     "replica groups (see the package docstring)")
    commands = parser.add_subparsers(dest="command", required=True)
    serving = commands.add_parser("serve", help="a TCPStore and the lighthouse that forms the quorums")
    serving.add_argument("--port", type=int, required=True, help="the port to listen on (0: one the OS picks)")
    serving.add_argument("--host", default="0.0.0.0", help="the address to listen on")
    serving.add_argument("--new-run", action="store_true", help="once the run finished, start a new run's groups "
                         "afresh (its late groups still told it finished) instead of refusing them")
    serving.add_argument("--runs-file", metavar="PATH", help="a JSON file where the coordinator keeps the run's id, "
                         "whether and at which step it finished, and the runs before it, and which it reads again "
                         "when restarted (a missing file: a fresh coordinator). Pass it to a coordinator that may be "
                         "restarted after the groups have gone: it still tells a late group of a finished run that "
                         "the run finished, and still refuses a new run (or, with --new-run, starts it)")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:  # (a TypeError from the store's constructor else)
        print(f"{SERVE}: error: --port must be between 0 (one the OS picks) and 65535, got {args.port}",
              file=sys.stderr, flush=True)
        return 2
    try:
        serve(args.port, args.host, args.new_run, runs_file=args.runs_file)
    except KeyboardInterrupt:
        return 0
    except RunsFileError as error:
        print(f"{SERVE}: error: {error}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as error:
        print(f"replicas serve: {one_line(error)}", file=sys.stderr, flush=True)
        return 1
    return 0
