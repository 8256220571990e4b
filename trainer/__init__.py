"""The trainer's parts, a room each; ddp_cifar100.py is the loop that calls them.

config (the flags as one dataclass), faults <- checkpoint (the Checkpointer: save and restore over the run's parts as
objects with state_dict(), never build's Parts) <- export (a checkpoint out in other formats, and back in for
--init-from) <- build (the parts of a run) <- evaluation, replica_groups <- metrics; generation reads a checkpoint.
Each imports only the rooms to its left and the library (data, models, zero, references, diloco, replicas, utils,
measure, files), which imports none of them. refusals and warm_start run at the script's start, before torch is
imported (they import no torch).
"""
import time

STARTED = time.time()  # this process's start, near enough: ddp_cifar100.py imports the package first, before torch
FORKED: float | None = None  # a warm restart's fork by its zygote, its imports all done (warm_start.py sets both)
