"""Checkpoints and exact resume. The loop makes one ``Checkpointer`` and calls it on every rank:

    checkpointer = Checkpointer.of(parts)            # the sync (model, optimizer), scheduler, scaler, run state
    position, history, sums = checkpointer.restore()  # from --checkpoint-dir's current checkpoint, if there is one
    checkpointer.save(every_ranks_sums)               # at epoch ends, every --checkpoint-every steps, at --max-steps
    checkpointer.failed()                             # --async-checkpoint: whether this rank's background save failed
    checkpointer.finish(); checkpointer.close()       # the last save written; the writer and the folder's lock let go

    manager.py    Checkpointer: the folder's lock, the format, the background writer, the stall timings, and every
                  collective a save or a resume makes
    folders.py    --checkpoint-dir's layout (step-N, .partial, .removing, latest, last.pt): which checkpoint is
                  current, publishing one, removing what it supersedes; plain file-system code, no process group
    run_state.py  the position, the trajectory and its fingerprint, the checks between a checkpoint and the flags
    reading.py    a checkpoint read in one process: its run state, and read_alone (--generate, trainer.export)

Two formats of one content: the model, the optimizer's state, and the run's state beside them (the scheduler, the
scaler, the position in the epoch, the finished epochs, every rank's sums of the current one, the run's record and
fingerprint, the world size and the seed). Either is written and read by the sync itself (every sync's
``save_checkpoint`` / ``load_checkpoint``: zero.checkpoint.Checkpoints), so the checkpointer never asks which sync
runs; it decides where a checkpoint goes, which is current, and what the run carries.

- Folders of torch.distributed.checkpoint (DCP; zero.checkpoint's format, which FSDP2 and torch's tools read), where
  the sync holds shards (``sync.holds_shards``: --grad-sync custom --zero 1-3 and fsdp) and every rank sees the same
  --checkpoint-dir (checked once: rank 0 leaves a marker, the others look for it). Every rank writes its own shards
  and nothing is gathered: AdamW's 12 Psi bytes leave as 12 Psi / W per rank, where a file would gather all of them
  on rank 0 (9.3 GB for GPT-2 large's shape). A save is a complete folder DIR/step-N, written as DIR/step-N.partial
  and renamed once every rank's part and DCP's .metadata are in; then DIR/latest, a one-line file naming it (written
  atomically: DeepSpeed's pointer), makes it current, and what it supersedes is removed (folders.py). The run state
  is the folder's extra. --keep-checkpoints K keeps the K newest.
- DIR/last.pt, one file that rank 0 writes atomically (temporary file, flush, fsync, os.replace), at the syncs that
  keep the whole model on every rank (custom --zero 0, ddp, diloco, localsgd), and at the sharded ones when the
  nodes share no folder: the model and the optimizer gathered to rank 0, the run state beside them. Its "model" is
  the bare model's full state_dict and "optimizer" torch.optim's state_dict over the model's trainable parameters
  numbered group by group, whatever --zero or --grad-sync (FSDP2's DTensors made whole), so any stage at any world
  size loads it; diloco and localsgd keep each replica's weights, optimizer and outer state under "replicas". A
  folder holds get_state_dict's form: every tensor by name in its global shape (zero/checkpoint/). Either holds only
  tensors and Python builtins.

Resume. Rank 0 finds the current checkpoint (the folder DIR/latest names, or last.pt; the newer, should a run have
stopped between making one current and removing the other), reads its run state (a folder's extra alone: a few kB)
and broadcasts it, and every rank checks it (the global batch and the fingerprint: run_state.check_compatible) before
a tensor is read. Then ``sync.load_checkpoint`` reads it, any sync either format at any world size: the sharded ones
read only what their shards overlap, the others read the folder whole; last.pt is read by rank 0 and sent to every
rank, so other nodes need no shared file system; diloco and localsgd refuse a folder (their replicas' own weights
and outer state are not in it). A checkpoint that is torn, incomplete, corrupt (bytes flipped inside it: the CRC32s
every torch.save record carries, checked before a tensor is read, each rank a share: zero/checkpoint/checksums.py;
at resume, --eval-only and --generate alike), of another model or another configuration stops every rank with one
line naming it (UsageError), never a silent fresh start.

The disk's errors. A save the disk stops (a full disk, a quota, a read-only or unwritable folder: ENOSPC, EDQUOT,
EROFS, EACCES) stops every rank with one line naming it and the checkpoint that stays current ("cannot save
checkpoint DIR/step-N: no space left on device (the previous checkpoint DIR/step-M is still current)"); the failed
DIR/step-N.partial is removed, last.pt's temporary file too, and nothing current was touched. A --checkpoint-dir
this run cannot write in is refused at the start, before any step, at every sync (folders.unwritable).

Nothing random is carried from step to step: the data order comes from (seed, epoch), each sample's augmentation (in
memory or from an image folder) from (seed, epoch, sample index) and dropout from a reseed with (seed, rank,
optimizer step) before every step, so the checkpoint (model, optimizer, scheduler, scaler, position in the epoch) is
all a resumed run needs to continue bit for bit; a resumed image-folder run decodes none of the samples it skips.
Bit-for-bit claims (resume, restarts, two nodes, custom == DDP) are facts of the CPU kernels. On CUDA, convolutions
pick nondeterministic algorithms unless asked: --deterministic (build.make_deterministic) asks.
"""
from trainer.checkpoint.folders import Found, current, make_current, mark_behind
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.reading import non_finite, read_alone, read_state
from trainer.checkpoint.run_state import NO_SUMS, Position, RunState, fingerprint, trajectory

__all__ = ["Checkpointer", "Found", "NO_SUMS", "Position", "RunState", "current", "fingerprint", "make_current",
           "mark_behind", "non_finite", "read_alone", "read_state", "trajectory"]
