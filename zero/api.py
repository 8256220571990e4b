"""``zero.shard``, the entry: the arguments checked as named steps (each refusal one line, before any collective, the
same on every rank), the model placed (broadcast from rank 0, or materialized from the meta device: zero/init.py),
and the stage built (zero/stage0.py's stage 0, zero/stages.py's 1-2, zero/stage3.py's 3). Also what a rank holds, in
bytes (``state_bytes``), for every sync.

What a rank holds, for Psi parameters trained with AdamW (two state tensors per parameter), in bytes, with fp32
masters and state and weights in fp32 (p = 4) or bf16 (p = 2, param_dtype=torch.bfloat16; the masters, and at
stage 1 the fp32 gradient shards, are then 4 Psi / W more each, tensors of their own):

    stage   weights             gradients       optimizer state   total (fp32)         total (bf16 weights)
    0       4 Psi               4 Psi           8 Psi             16 Psi               (zero.stage0.GradientSync, DDP)
    1       p Psi (+ 4 Psi / W) p Psi (+ 4 Psi / W) 8 Psi / W     8 Psi + 8 Psi / W    4 Psi + 16 Psi / W
    2       p Psi (+ 4 Psi / W) 4 Psi / W (+)   8 Psi / W         4 Psi + 12 Psi / W   2 Psi + 16 Psi / W
    3       4 Psi / W           4 Psi / W (+)   8 Psi / W         16 Psi / W           16 Psi / W
    (+ the gradient buffers in flight during backward, in reduce_dtype; stage 3, during a step: the root and two
    units, in param_dtype)

Sent per rank and optimizer step of K micro-batches, in elements: stage 0 and 1, 2 (W-1)/W Psi (one all-reduce,
or a reduce-scatter and an all-gather); stage 2, (K+1)(W-1)/W Psi; stage 3, about 3K (W-1)/W Psi (every unit
gathered for its forward and its backward, and reduce-scattered, on every micro-batch). The gathers move
param_dtype's bytes (bf16: half of fp32's), the reductions reduce_dtype's. Hybrid, with W = S inside a replica:
the same inside the shard group, plus 2 (R-1)/R Psi / S across replicas (one all-reduce of each rank's shard).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from collectives import Collectives
from zero import init as init_module
from zero.broadcast import broadcast_state
from zero.buckets import assign_buckets
from zero.hybrid import Replicas, check_grid
from zero.offload.folder import open_store
from zero.optimizer_kinds import as_optimizers
from zero.precision import resolve
from zero.stage0 import GradientSync
from zero.stage3 import ZeroStage3
from zero.stages import ZeroStage1, ZeroStage2


def shard(model: nn.Module, stage: int, units: list[nn.Module] | None = None,
          group: dist.ProcessGroup | None = None, collectives: str = "torch",
          replicate_group: dist.ProcessGroup | None = None, param_dtype: torch.dtype | None = None,
          reduce_dtype: torch.dtype | None = None, init: Callable[[nn.Module], None] | None = None, *,
          device: torch.device | str | None = None, init_device: torch.device | str | None = None,
          bucket_mb: float = 25.0, overlap: bool = True, accumulate: str = "sharded",
          timeout_s: float | None = None, offload: str | None = None, offload_dir: str | None = None) -> Any:
    """Data parallelism at ZeRO ``stage`` over ``group`` (default: the world) for ``model``, in place: the group's
    rank 0's weights and buffers are broadcast first (as DistributedDataParallel does), then the model's
    parameters become views of flat buckets (stages 1-3), and hooks do the rest (zero's docstring).

    ``init`` (a model built on the meta device): ``init(module)`` initializes one module's own parameters and
    buffers, and the model is materialized module by module (zero/init.py): at stage 3 no rank holds it whole,
    and the weights are bit for bit ``model.to_empty(device=init_device); for m in model.modules(): init(m)`` on
    one process, at any world size. ``device``: where the model then lives (default: this process's GPU under
    NCCL, else the CPU); ``init_device``: where ``init`` runs (default: ``device``).

    ``replicate_group`` (stages 1-3): hybrid sharding, the state sharded over ``group`` and replicated over the
    ranks holding the same shard (zero/hybrid.py); the two must tile the world as a grid. ``param_dtype`` (stages
    1-3): the dtype the weights are kept, gathered and computed in, over masters and optimizer state in the
    model's own dtype; ``reduce_dtype`` (default: ``param_dtype``): the dtype gradients are reduced in
    (zero/precision.py).

    ``units`` (stage 3): the modules gathered one at a time (default: default_units); the root owns the
    parameters no unit does. ``collectives``: "torch" (torch.distributed's), "ring" (allreduce.py's, on a thread
    of its own), or at stage 0 "butterfly". ``bucket_mb`` (stages 0-2): the largest bucket; ``overlap`` (stages
    0, 1): average each bucket as backward completes it, rather than after backward; ``accumulate`` (stage 3):
    "sharded" (reduce-scatter every micro-batch) or "unsharded" (keep full gradients over the window).

    ``offload="disk"`` (stages 1-3; ZeRO-Offload's and ZeRO-Infinity's idea, zero/offload/): the optimizer's state,
    and at stage 3 the master weights' and gradients' shards too, kept in a file per rank under ``offload_dir`` and
    streamed through a few buffers by a background I/O thread; only the storage moves, so the weights are bit for
    bit those of the same run without it. ``offload="cpu"``: the same state in host memory (pinned under a GPU: a
    GPU's memory freed of it), the step still run where the model is (zero/offload/host.py)."""
    check_options(stage, collectives, overlap, accumulate, units, replicate_group)
    check_offload(offload, offload_dir, stage, replicate_group, accumulate)
    check_trainable(model)
    deferred = check_init(model, init)
    precision = resolve(model, stage, param_dtype, reduce_dtype)
    given = (default_units(model) if units is None else list(units)) if stage == 3 else None
    if given is not None:
        stage_3_units(model, given)  # refused before any collective, if they do not fit
    if replicate_group is not None:
        check_grid(group, replicate_group)  # before any broadcast: on every rank, the same verdict
    store = None
    if offload is not None:  # the folder, the file and the disk's room for the shards: before any tensor is made
        where = next(model.parameters()).device if not deferred else \
            torch.device(device) if device is not None else init_module.default_device(group)
        store = open_store(offload, offload_dir, where, group, shard_bytes(model, stage, dist.get_world_size(group)))
    if deferred:  # materialized (stages 0-2) or given placeholders (stage 3), the same on every rank: no broadcast
        device, init_device = place_deferred(model, stage, init, group, device, init_device)
    else:
        broadcast_state(model, group=group)
    comm = Collectives(group, collectives, timeout_s)
    if stage == 0:
        return GradientSync(model, bucket_mb, overlap, comm)
    replicas = None
    if replicate_group is not None:
        replicas = Replicas(replicate_group, collectives, timeout_s, precision.reduce)
        if not deferred:
            replicas.broadcast(model)  # then every rank of the grid holds replica 0's rank 0's weights
    if stage == 1:
        return ZeroStage1(model, bucket_mb, overlap, comm, precision, replicas, store)
    if stage == 2:
        trainable = [p for p in model.parameters() if p.requires_grad]
        return ZeroStage2(model, assign_buckets(trainable, bucket_mb), comm, precision, replicas, store=store)
    units, owner = stage_3_units(model, given)  # the owners of the parameters as they are now
    sharded = ZeroStage3(model, units, owner, comm, accumulate, precision, replicas, deferred, store)
    if deferred:
        init_module.initialize_shards(sharded, init, init_device)
        init_module.move_buffers(model, device)
    return sharded


# ----------------------------------------------------------------------------------------------------------
# The steps of shard(): checks, each one line, and the placement of a deferred model
# ----------------------------------------------------------------------------------------------------------
def check_options(stage: int, collectives: str, overlap: bool, accumulate: str, units: Any,
                  replicate_group: Any) -> None:
    """The stage and the options that depend on it."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero.shard: stage is 0, 1, 2 or 3, not {stage!r}")
    kinds = ("torch", "ring", "butterfly") if stage == 0 else ("torch", "ring")
    if collectives not in kinds:
        raise ValueError(f"zero.shard: stage {stage} runs on {' or '.join(kinds)} collectives, not {collectives!r}"
                         + (" (the butterfly has no reduce-scatter and all-gather)" if stage else ""))
    if stage >= 2 and not overlap:
        raise ValueError(f"zero.shard: stage {stage} reduce-scatters gradients as backward produces them "
                         f"(overlap=False would keep every full gradient: that is stage 1)")
    if accumulate not in ("sharded", "unsharded") or (accumulate == "unsharded" and stage != 3):
        raise ValueError(f"zero.shard: accumulate is 'sharded', or 'unsharded' at stage 3; not {accumulate!r} at "
                         f"stage {stage}")
    if units is not None and stage != 3:
        raise ValueError(f"zero.shard: units are stage 3's; stage {stage} shards flat buckets")
    if stage == 0 and replicate_group is not None:
        raise ValueError("zero.shard: replicate_group is for stages 1-3 (state sharded over group, replicated "
                         "across it); at stage 0 every rank holds everything: pass the whole world as group")


def check_offload(offload: str | None, offload_dir: str | None, stage: int, replicate_group: Any,
                  accumulate: str) -> None:
    """offload= and what it works with (the folder itself is checked by every rank together: zero/offload/)."""
    if offload is None:
        if offload_dir is not None:
            raise ValueError("zero.shard: offload_dir is where offload='disk' keeps the state; pass offload='disk'")
        return
    if offload not in ("disk", "cpu"):
        raise ValueError(f"zero.shard: offload is 'disk' or 'cpu', not {offload!r}")
    if offload == "cpu" and offload_dir is not None:
        raise ValueError("zero.shard: offload='cpu' keeps the state in host memory; offload_dir is for "
                         "offload='disk'")
    if offload == "disk" and offload_dir is None:
        raise ValueError("zero.shard: offload='disk' needs offload_dir, the folder its files go in")
    if stage == 0:
        raise ValueError("zero.shard: offload is for the sharded stages 1-3 (stage 0 keeps everything on every "
                         "rank, to read it every step)")
    if replicate_group is not None:
        raise ValueError("zero.shard: offload with replicate_group (hybrid sharding) is not built yet")
    if accumulate == "unsharded":
        raise ValueError("zero.shard: offload with accumulate='unsharded' would keep every unit's full gradient in "
                         "memory over the window (4 Psi bytes): use the default, 'sharded'")


def shard_bytes(model: nn.Module, stage: int, world_size: int) -> int:
    """The bytes a rank's offload file holds before any optimizer: at stage 3 its weights' and gradients' shards
    (padding aside: at most W - 1 elements a unit), nothing at stages 1-2."""
    if stage != 3:
        return 0
    return 2 * sum(-(-p.numel() // world_size) * p.element_size() for p in model.parameters() if p.requires_grad)


def check_trainable(model: nn.Module) -> None:
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("zero.shard: the model has no trainable parameter")


def check_init(model: nn.Module, init: Callable[[nn.Module], None] | None) -> bool:
    """Whether the model is on the meta device (deferred), which init= must then be given for, and only then."""
    deferred = init_module.on_meta(model)
    if deferred and init is None:
        raise ValueError("zero.shard: the model is on the meta device; pass init=fn, fn(module) initializing that "
                         "module's own parameters and buffers (its reset_parameters, say), to materialize it shard "
                         "by shard")
    if init is not None and not deferred:
        raise ValueError(f"zero.shard: init= is for a model built on the meta device (with torch.device('meta'): "
                         f"...); this one is on {next(model.parameters()).device} already")
    return deferred


def place_deferred(model: nn.Module, stage: int, init: Callable[[nn.Module], None], group: Any, device: Any,
                   init_device: Any) -> tuple[torch.device, torch.device]:
    """A meta-device model, the same on every rank (the generators agree: checked): materialized whole (stages
    0-2), or given placeholder parameters for stage 3 to lay its units out on (zero/init.py). Returns the devices."""
    device = torch.device(device) if device is not None else init_module.default_device(group)
    init_device = torch.device(init_device) if init_device is not None else device
    init_module.check_same_generator(group, init_device)
    if stage < 3:
        init_module.initialize_whole(model, init, device, init_device)
    else:
        init_module.replace_parameters(model, lambda p: init_module.placeholder(p, device))
        init_module.materialize_buffers(model, init_device)
    return device, init_device


def default_units(model: nn.Module) -> list[nn.Module]:
    """Stage 3's units when none are given: every module directly inside an nn.ModuleList of the model (the
    transformer's convention for its blocks)."""
    return [child for module in model.modules() if isinstance(module, nn.ModuleList) for child in module]


def stage_3_units(model: nn.Module, units: list[nn.Module]) -> tuple[list[nn.Module], dict[int, nn.Module]]:
    """The root (if it owns a trainable parameter no unit does) and the units, and each parameter's owner: a unit
    claims its parameters from the root, an inner unit from an outer one. A unit that is not in the model, or
    owns nothing, is refused in one line."""
    names = {id(m): name for name, m in model.named_modules()}
    owner: dict[int, nn.Module] = {}
    for module in [model, *units]:
        if id(module) not in names:
            raise ValueError(f"zero.shard: a unit ({type(module).__name__}) is not a submodule of the model")
        owner.update((id(p), module) for p in module.parameters())
    for unit in units:
        if not any(owner[id(p)] is unit for p in unit.parameters()):
            raise ValueError(f"zero.shard: unit {names[id(unit)]!r} ({type(unit).__name__}) owns no parameter "
                             f"(none, or all claimed by units inside it)")
    root_owns = any(owner[id(p)] is model for p in model.parameters())
    return ([model] if root_owns else []) + list(units), owner


# ----------------------------------------------------------------------------------------------------------
# What a rank holds
# ----------------------------------------------------------------------------------------------------------
def state_bytes(model: nn.Module, optimizer: Any, sync: Any) -> dict[str, int]:
    """Bytes this rank holds for the weights, the gradients and the optimizer state: the storages behind the
    model's parameters and the optimizer's (one or several: zero.optimizer_kinds.as_optimizers), behind every .grad they
    have and the sync's gradient buffers (its ``held_gradient_buffers``) and other shards (``held_shards``: stage
    3's frozen parameters), and behind the optimizer's state tensors (ZeroRedundancyOptimizer: its local
    optimizer's), each storage counted once. Taken just before a step: the gradients averaged, stage 3's units all
    freed (the step's prefetch of the next forward's first units is not yet launched)."""
    def held(tensors: Iterable[torch.Tensor | None]) -> int:
        storages = {}
        for t in tensors:
            t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor: this rank's shard
            if t is not None and not t.is_meta:  # (offload's placeholders: the store holds those bytes)
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    optimizers = as_optimizers(optimizer)
    optimized = [p for o in optimizers for group in o.param_groups for p in group["params"]]
    states = [getattr(o, "optim", o).state for o in optimizers]
    grads = [p.grad for p in list(model.parameters()) + optimized] + sync.held_gradient_buffers()
    return {"params": held(list(model.parameters()) + optimized + sync.held_shards()), "grads": held(grads),
            "optimizer": held(v for state in states for values in state.values() for v in values.values()
                              if torch.is_tensor(v))}
