"""The trainer's parts, a room each; ddp_cifar100.py is the loop that calls them.

config (the flags as one dataclass) <- build (the parts of a run) <- checkpoint, evaluation <- metrics; generation
reads a checkpoint, and export writes one out in other formats (and reads them back for build's --init-from). Each
imports only the rooms to its left and the library (data, models, zero, references, diloco, utils), which
imports none of them; build takes export's reader, and export checkpoint's, at the call (trainer.checkpoint imports
build)."""
