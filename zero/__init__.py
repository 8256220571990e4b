"""ZeRO: data parallelism that shards the training state over the W ranks of a process group, as a library for
your own training loop.

    import zero
    sharded = zero.shard(model, stage, units=None, group=None, collectives="torch",   # stage 0..3; "ring" too
                         replicate_group=None, param_dtype=None, reduce_dtype=None,    # stages 1-3: hybrid, bf16
                         init=None,                                                   # a meta-device model: fn(module)
                         offload=None, offload_dir=None)                              # "disk" (a file), "cpu"
    optimizer = sharded.optimizer(torch.optim.AdamW, params_or_groups, lr=3e-4)        # over the MODEL's params
    for i, batch in enumerate(window):
        sharded.set_requires_gradient_sync(i == len(window) - 1)
        loss_fn(model, batch).backward()                 # averaged over the group when the last backward returns
    total_norm = sharded.clip_grad_norm_(max_norm)       # the norm of the whole model's gradient
    optimizer.step(); optimizer.zero_grad()              # the model is whole after step(): nothing else to call
    sharded.model_state_dict(); sharded.load_model_state_dict(state)   # full, on the group's rank 0
    optimizer.state_dict(); optimizer.load_state_dict(state)           # torch.optim's ordinary, unsharded form
    sharded.save_checkpoint(path, optimizer, extra); sharded.load_checkpoint(path, optimizer)   # every sync's
    zero.checkpoint.save(path, sharded, optimizer, extra=None)         # sharded, torch.distributed.checkpoint's
    extra = zero.checkpoint.load(path, sharded, optimizer)             # format, any stage and world size
    sharded.close()                                      # every hook removed, the model left whole (offload at
                                                         # stage 3: close(whole=True), as it may not fit)

Every element-wise torch.optim optimizer is exact at every stage, its state dict torch.optim's own, and so are Muon
and Adafactor; parameter groups keep their hyperparameters; several optimizers may share one model.

Where each part is, by concern (FSDP2's ``_fully_shard/`` and DCP's split):
    zero/api.py           shard(): its checks as named steps, the units, state_bytes (and the memory formula)
    zero/stage0.py        stage 0: gradients averaged in flat buckets from autograd's hooks (GradientSync); the
                          hooks and the end of backward every stage builds on; the training interface (DataParallel)
    zero/buckets.py       parameters as one flat tensor (Bucket), sized as DDP sizes them: what every stage moves
    zero/broadcast.py     a whole state dict given on the group's rank 0, sent to every rank
    zero/stages.py        stages 1 and 2 (what each adds to stage 0), and what 1-3 share
    zero/stage3.py        stage 3: units gathered around their forward and backward, prefetch, frozen parameters
    zero/units.py         stage 3's units (Unit, UnitState), the end of a unit's backward, no model.state_dict()
    zero/optimizer.py     the optimizer side of stages 1-3: runs of the shards, groups, clipping, the step
    zero/optimizer_state.py  the runs' layout, and the optimizer's state in torch.optim's ordinary form and back
    zero/optimizer_kinds.py  which optimizers the shards carry, and what state each keeps
    zero/matrix.py        Muon and Adafactor on pieces of whole matrices
    zero/precision.py     param_dtype and reduce_dtype over fp32 masters
    zero/hybrid.py        replicate_group: hybrid sharding across replicas
    zero/init.py          a model built on the meta device, materialized shard by shard (init=)
    zero/pieces.py        what a rank holds of each tensor: flat ranges as parameters' pieces and n-D boxes
    zero/offload/         offload="disk": the state kept in a file per rank, streamed through a few buffers (files,
                          store, folder, shards: the step bucket by bucket; slots: checkpoints streamed from it);
                          offload="cpu": the same in host memory (host)
    zero/checkpoint/      checkpoints: sharded in torch.distributed.checkpoint's format (api, state_dict, planner,
                          checks), or one file of the whole state dicts (whole); the checkpoint methods every sync
                          offers (methods: Checkpoints, WholeCheckpoints); its names imported at first use
Names are imported at their first use (``__getattr__``): ``import zero.init`` (models.py's) loads no stage.
"""
from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
EXPORTS = {
    "shard": "zero.api", "default_units": "zero.api", "stage_3_units": "zero.api", "state_bytes": "zero.api",
    "GradientSync": "zero.stage0", "DataParallel": "zero.stage0", "Bucket": "zero.buckets",
    "ZeroStage1": "zero.stages", "ZeroStage2": "zero.stages", "ZeroStage3": "zero.stage3", "Unit": "zero.units",
    "UnitState": "zero.units", "ShardedOptimizer": "zero.optimizer", "ShardRun": "zero.optimizer_state",
    "ELEMENTWISE": "zero.optimizer_kinds", "WHOLE_PARAMETER": "zero.optimizer_kinds",
    "check_optimizer_class": "zero.optimizer_kinds", "state_kinds": "zero.optimizer_kinds",
    "missing_optimizer_state": "zero.optimizer_kinds",
}
SUBMODULES = ("api", "stage0", "buckets", "broadcast", "stages", "stage3", "units", "optimizer", "optimizer_state",
              "optimizer_kinds", "matrix", "precision", "hybrid", "init", "pieces", "checkpoint", "offload")

__all__ = [*EXPORTS, *SUBMODULES]


def __getattr__(name: str) -> Any:
    """``zero.NAME``, imported at its first use: the stages bring the collectives with them, and zero.checkpoint's
    functions bring torch.distributed.checkpoint (about half a second of every process's start-up)."""
    if name in EXPORTS:
        return getattr(importlib.import_module(EXPORTS[name]), name)
    if name in SUBMODULES:
        return importlib.import_module(f"zero.{name}")
    raise AttributeError(f"module 'zero' has no attribute {name!r}")
