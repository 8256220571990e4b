"""The trainer's parts, a room each; ddp_cifar100.py is the loop that calls them.

config (the flags as one dataclass) <- build (the parts of a run) <- checkpoint, evaluation <- metrics; generation
reads a checkpoint. Each imports only the rooms to its left and the library (data, models, gradsync, zero,
references, diloco, utils), which imports none of them."""
