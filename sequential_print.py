"""Deterministic rank-ordered printing.

    torchrun --nproc_per_node N sequential_print.py [--num-iter K]

prints, K times, the lines ``Process 0`` ... ``Process N-1``, with a line ``---`` between iterations (none after
the last), byte for byte the same on every run.

Why it needs an algorithm: the N processes share one stdout, and whoever writes first is up to the scheduler.
Order is imposed by passing a token around a ring with point-to-point messages:

    rank r waits for the token from rank r-1 (rank 0, from rank N-1 after the first iteration),
    prints its line and flushes it, then sends the token to rank (r+1) mod N.

The flush finishes the write(2) into the shared pipe or terminal before the token leaves, so rank r+1 cannot
write before rank r's bytes are in place. Rank N-1 writes the separator before passing the token back to rank 0.
One iteration costs N messages in sequence (a barrier per line would cost N barriers, each log N rounds or more).
"""
import argparse

import torch
import torch.distributed as dist

from utils import cleanup_distributed, init_distributed


def run_sequential(rank: int, size: int, num_iter: int = 10) -> None:
    """Print ``Process {rank}`` in rank order, ``num_iter`` times, ``---`` between iterations."""
    token = torch.zeros(1)
    for iteration in range(num_iter):
        last_iteration = iteration == num_iter - 1
        if size > 1 and (rank > 0 or iteration > 0):
            dist.recv(token, src=(rank - 1) % size)
        print(f"Process {rank}", flush=True)
        if rank == size - 1 and not last_iteration:
            print("---", flush=True)
        # The last rank's last token would have no receiver: rank 0 does not wait after the final iteration.
        if size > 1 and not (rank == size - 1 and last_iteration):
            dist.send(token, dst=(rank + 1) % size)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-iter", type=int, default=10, help="how many times every rank prints (default 10)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a peer before failing")
    args = parser.parse_args(argv)
    if args.num_iter < 0:
        parser.error("--num-iter must be >= 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    ctx = init_distributed(device="cpu", backend="gloo", timeout_s=args.timeout)
    try:
        run_sequential(ctx.rank, ctx.world_size, args.num_iter)
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    main()
