"""Offload (``zero.shard(..., offload="disk", offload_dir=PATH)``): a rank's training state kept on a disk and streamed
through a few buffers, so a model whose state is larger than the machine's memory trains, bit for bit as it would in
memory. Where each part is, as DCP's storage layer sits under its planner:
    zero/offload/files.py    one rank's file: slots, O_DIRECT, CRC32Cs, the disk's errors named
    zero/offload/host.py     offload="cpu": the same slots in host memory (pinned under a GPU)
    zero/offload/store.py    named tensors over the file: read ahead, written behind, by two I/O threads
    zero/offload/folder.py   the folder and the disk's room, one verdict for every rank
    zero/offload/shards.py   what a stage keeps there, and the optimizer's step streamed bucket by bucket
    zero/offload/gradients.py  stage 3's gradient shards there, with their norms and clipping factors
    zero/offload/slots.py    a checkpoint's window on the store: its boxes read and written slot by slot
"""
from zero.offload.files import OffloadError, OffloadRefused
from zero.offload.store import Store

__all__ = ["OffloadError", "OffloadRefused", "Store"]
