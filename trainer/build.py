"""Building the trainer's parts from a Config: the process group and the replicas' groups, the data, the model (the
same weights on every rank: the seed's, or --init-from's), the gradient sync, torch.compile, the optimizer through
the sync, the learning-rate schedule and the gradient scaler. ``build`` makes them all, once, as ``Parts``; the
loop changes only the model's and the optimizer's state.

The syncs (--grad-sync, --zero) share one interface, zero.shard's contract: set_requires_gradient_sync before each
backward, clip_grad_norm_, an optimizer built by sync.optimizer over the model's own parameters, the state dicts and
close(). custom, diloco and localsgd are zero.shard's stages (zero/stage0.py at stage 0); ddp (with --zero 1,
ZeroRedundancyOptimizer) and fsdp (FSDP2's fully_shard on the same units as stage 3) are references.py's.

Data parallelism over slow links (--grad-sync diloco|localsgd, diloco.py): --replicas R groups of W/R processes,
each trained by the loop over its own process group (zero.shard's group=, --zero 0-2; SyncBatchNorm over the
replica), meeting every --local-steps H optimizer steps: an outer all-reduce of the pseudo-gradients over the ranks
at the same place in every replica (on diloco.py's ring, --outer-compress, --fragments, --outer-delay) and an outer
step (--outer-optimizer, --outer-lr, --outer-momentum; localsgd: averaging). Validation evaluates the shared point.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import utils
import zero
from data import FolderData, MemoryData, TextData, load_data
from diloco import DiLoCo, DiLoCoSync
from measure.malloc import pin_mmap_threshold
from measure.memory import PhasePeaks
from models import blocks, build_model, initializer
from references import DDPSync, FSDPSync
from trainer.checkpoint import current
from trainer.config import DTYPES, OURS, OUTER_SYNCS, Config
from trainer.export import InitFrom
from trainer.faults import FaultPlan
from utils import UsageError
from zero.broadcast import broadcast_state
from zero.stage0 import DataParallel

AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Parts:
    """What ``build`` makes of a Config."""
    config: Config
    ctx: utils.DistContext
    comm_device: torch.device  # where collectives' tensors live: the GPU with nccl, else the CPU
    data: MemoryData | FolderData | TextData
    model: nn.Module  # the bare model: checkpoints and evaluation
    sync: DataParallel  # zero.shard's stages, DDP (with ZeroRedundancyOptimizer), FSDP2, or DiLoCoSync around one
    optimizer: torch.optim.Optimizer  # built by sync.optimizer over the model's parameters
    scheduler: Any
    scaler: torch.amp.GradScaler
    steps_per_epoch: int
    schedule_steps: int  # the learning-rate schedule's length
    outer: DiLoCo | None  # --grad-sync diloco|localsgd: the replicas' outer loop
    replica: int  # which replica this rank belongs to (diloco, localsgd) ...
    replica_size: int  # ... and how many ranks each replica has
    compile_counts: dict[str, int] | None  # --compile: Dynamo's counters before the run
    phases: PhasePeaks  # each phase's peak resident memory (build, restore, steps, checkpoint, evaluation)
    faults: FaultPlan  # the faults asked of this process, on purpose (trainer/faults.py; none: FaultPlan())

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return AMP_DTYPES[self.config.amp]


def build(config: Config) -> Parts:
    """Process group, data, model (same weights everywhere), gradient sync, optimizer, schedule and scaler."""
    phases = PhasePeaks()  # the process's start: what every phase's peak is measured above
    if config.malloc_mmap_threshold:  # before anything large is allocated (measure.malloc.pin_mmap_threshold)
        pin_mmap_threshold(config.malloc_mmap_threshold * 1024)
    try:
        ctx = utils.init_distributed(config.device, config.backend, config.timeout)
    except ValueError as exc:  # e.g. --device cuda on a machine without a GPU: before any collective
        raise UsageError(str(exc)) from None
    comm_device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    try:  # the faults asked of this process (trainer/faults.py): read once, here
        faults = FaultPlan.of(ctx.rank, config.replica_group)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if config.deterministic:
        make_deterministic()
    data = load_data(config, ctx, comm_device)
    if config.coordinator:  # replica group I's place j takes the data of rank I P + j of R P (replica_groups.py)
        data.placed = (config.replica_group * ctx.world_size + ctx.rank, config.replica_groups * ctx.world_size)
    # the model, the same on every rank: built whole, or on the meta device for the sync to materialize
    model, init = make_model(config, ctx, data)
    check_batch_statistics(config, ctx, data, model)
    # the gradient sync (and the replicas' outer loop), torch.compile, the optimizer through the sync
    within, across, replica, replica_size = replica_groups(config, ctx)
    sync = make_sync(config, model, ctx, within, across, init)
    outer = make_outer(config, model, across, sync)
    if outer is not None:  # the replicas' checkpoints hold each replica's own weights and outer state
        sync = DiLoCoSync(sync, outer, replica_size)
    compile_counts = compile_forward(config, model)
    optimizer = make_optimizer(config, model, sync)
    # the schedule and the scaler
    steps_per_epoch = math.ceil(len(data.batch_sizes()) / config.grad_accum)
    schedule_steps = schedule_length(config, steps_per_epoch)
    phases.end("build")
    return Parts(config=config, ctx=ctx, comm_device=comm_device, data=data, model=model, sync=sync,
                 optimizer=optimizer, scheduler=make_scheduler(config, optimizer, schedule_steps),
                 scaler=make_scaler(config, ctx.device), steps_per_epoch=steps_per_epoch,
                 schedule_steps=schedule_steps, outer=outer, replica=replica, replica_size=replica_size,
                 compile_counts=compile_counts, phases=phases, faults=faults)


def check_batch_statistics(config: Config, ctx: utils.DistContext, data: Any, model: nn.Module) -> None:
    """A BatchNorm model cannot train on a micro-batch of one sample where the statistics are taken over it alone
    (--norm local: each process's; custom and torch: the processes' together): nn.BatchNorm1d and ours raise "more
    than 1 value per channel" there, after a whole epoch, and a mean over one sample is no batch statistic anyway.
    So an epoch whose last micro-batch leaves one (DistributedSampler's shard of ceil(N / W) samples, cut into
    --batch-size pieces) is refused at the build, in one line, with the sizes that fix it; not dropped or merged,
    which would change every other run's batches (docs/trainer.md)."""
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    together = 1 if config.norm == "local" else ctx.world_size
    smallest = min(data.batch_sizes())
    if smallest * together < 2:
        processes = data.placement()[1]
        raise UsageError(f"{len(data.train)} training samples over {processes} process(es) give each "
                         f"{math.ceil(len(data.train) / processes)} an epoch, which --batch-size {config.batch_size} "
                         f"cuts into a last micro-batch of one sample: --model {config.model}'s BatchNorm cannot take "
                         f"its statistics over one sample (--norm {config.norm}); choose a --batch-size (or a training "
                         f"set) that leaves 2 or more")


def on_meta_device(config: Config, data: Any) -> bool:
    """Whether the model is built on the meta device and materialized by the sync one module at a time (the
    sharded syncs: custom --zero 1-3, fsdp), so that no rank ever holds it whole at --zero 3. Channels-last models
    are built whole: the eager build draws their weights in the contiguous layout, which the shards do not have."""
    sharded = (config.grad_sync == "custom" and config.zero > 0) or config.grad_sync == "fsdp"
    return sharded and data.memory_format == torch.contiguous_format


def make_model(config: Config, ctx: utils.DistContext, data: Any) -> tuple[nn.Module, Any]:
    """The model and, where it is built on the meta device, the fn that initializes it module by module
    (models.initializer: the eager build's weights bit for bit, drawn on the CPU as the eager build draws them;
    with --init-from, each module's tensors then read from the file); else the model built whole, on its device
    (--init-from's weights read into it on every rank), rank 0's weights broadcast; --activation-checkpointing
    wraps each block's forward."""
    torch.manual_seed(config.seed)
    meta = on_meta_device(config, data)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = build_model(config.model, config.dropout, config.norm, data.num_classes, config.image_size or 32,
                            config.context)
    init = initializer(model, "cpu") if meta else None
    start = init_from(config, model)
    if meta and start is not None:  # each module's tensors from the file as the sync materializes it
        init = start.around(init, model)
    if not meta:
        model = model.to(ctx.device, memory_format=data.memory_format)
        if start is not None:
            start.load(model)
        broadcast_state(model)
    if config.activation_checkpointing:
        checkpoint_blocks(model)
    return model, init


def init_from(config: Config, model: nn.Module) -> Any:
    """--init-from's weights for ``model`` (trainer.export.InitFrom: the file's header checked against the model,
    the tensors read later), or None: without the flag, or where --checkpoint-dir holds a checkpoint, which wins (a
    resume must continue it exactly; said in one line). Rank 0 decides and checks the file, and every rank hears
    the same answer before any rank reads a tensor; then every rank opens the file itself."""
    if config.init_from is None:
        return None
    answer: list[Any] = [None]  # ("read" | "resume" | "error", what rank 0 says)
    start = None
    if dist.get_rank() == 0:
        try:
            resumes = config.checkpoint_dir is not None and current(config.checkpoint_dir) is not None
        except Exception:  # noqa: BLE001 - a torn folder, an unreadable one: restore says which in one line
            resumes = True
        try:
            if resumes:
                answer[0] = ("resume", f"note: --init-from {config.init_from} not read: --checkpoint-dir "
                                       f"{config.checkpoint_dir} holds a checkpoint, and the run resumes from it")
            else:
                start = InitFrom(config.init_from, model, config.model)  # a file that does not fit: refused here
                answer[0] = ("read", None)
        except UsageError as exc:
            answer[0] = ("error", str(exc))
    dist.broadcast_object_list(answer, src=0)
    kind, message = answer[0]
    if kind == "error":
        raise UsageError(message)
    if kind == "resume":
        utils.print0(message)
        return None
    return start or InitFrom(config.init_from, model, config.model)


def checkpoint_blocks(model: nn.Module) -> None:
    """--activation-checkpointing: each block's forward under torch.utils.checkpoint (non-reentrant): its
    activations are dropped after the forward and recomputed in its backward. The module's own call, and so the
    syncs' hooks on it (--zero 3's gathers), stay outside: the recomputation runs while the block is gathered for
    its backward."""
    for block in blocks(model):
        block.forward = partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)


def make_deterministic() -> None:
    """--deterministic: deterministic kernels on CUDA (the CPU ones used here already are). torch's
    use_deterministic_algorithms with warn_only: ops without a deterministic CUDA kernel (adaptive average pooling's
    backward in the ResNets) warn instead of stopping, and break bit-for-bit resume where they warn."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read by cuBLAS when it starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def replica_groups(config: Config, ctx: utils.DistContext) -> tuple[Any, Any, int, int]:
    """The world as a grid of R replicas (--replicas) x W/R processes: replica i is ranks i W/R .. (i+1) W/R - 1
    (consecutive: a node), and "across" holds this rank and the ranks at its place in every other replica (strided).
    That is FSDP2's 2-D mesh (replicate, shard) as torchtitan lays it out. Returns the group of this rank's replica,
    the group across replicas, the replica's index and its number of ranks; every rank makes every group, in one
    order (torch.distributed's rule).

    diloco, localsgd: the replica trains alone (the inner data parallelism) and the group across carries the outer
    all-reduce, always on gloo (its ring works on host memory). custom --zero 1-3: hybrid sharding, the state
    sharded over the replica and replicated across (zero.shard's group and replicate_group). fsdp: make_sync builds
    its DeviceMesh itself. (None, None, 0, 1) without replicas."""
    hybrid = config.replicas is not None and config.grad_sync == "custom"
    if config.grad_sync not in OUTER_SYNCS and not hybrid or config.coordinator:  # replica groups: this torchrun is one
        return None, None, 0, ctx.world_size if config.coordinator else 1
    world, replicas = ctx.world_size, config.replicas or ctx.world_size
    if world % replicas:
        raise UsageError(f"--replicas {replicas} does not divide the {world} processes into equal replicas")
    per = world // replicas
    within = across = None
    for i in range(replicas):
        group = dist.new_group(list(range(i * per, (i + 1) * per)))
        within = group if ctx.rank // per == i else within
    for place in range(per):
        group = dist.new_group([i * per + place for i in range(replicas)],
                               backend="gloo" if config.grad_sync in OUTER_SYNCS else None)
        across = group if ctx.rank % per == place else across
    return within, across, ctx.rank // per, per


def device_mesh(config: Config, ctx: utils.DistContext) -> Any:
    """--grad-sync fsdp --replicas R: FSDP2's 2-D DeviceMesh (replicate, shard) of R x W/R, shard groups of
    consecutive ranks as replica_groups lays them out (HSDP); None (fully_shard's 1-D default) otherwise."""
    if config.replicas is None or config.replicas == 1:
        return None
    if ctx.world_size % config.replicas:
        raise UsageError(f"--replicas {config.replicas} does not divide the {ctx.world_size} processes into equal "
                         f"replicas")
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(ctx.device.type, (config.replicas, ctx.world_size // config.replicas),
                            mesh_dim_names=("replicate", "shard"))


def make_sync(config: Config, model: nn.Module, ctx: utils.DistContext, within: Any, across: Any,
              init: Any = None) -> DataParallel:
    """--grad-sync and --zero's sync around ``model``. diloco, localsgd: over ``within``, the replica's group, over
    which SyncBatchNorm normalizes too. custom with --replicas: sharded over ``within``, replicated over ``across``
    (the replicas meet every step: SyncBatchNorm stays over the world). ``init``: the model is on the meta device,
    and the sync materializes it with ``init``, module by module."""
    param_dtype, reduce_dtype = DTYPES.get(config.param_dtype), DTYPES.get(config.reduce_dtype)
    if within is not None and config.grad_sync in OUTER_SYNCS:
        for module in model.modules():
            if hasattr(module, "process_group"):
                module.process_group = within
    if config.grad_sync == "ddp":
        return DDPSync(model, ctx.device, config.bucket_mb, zero_redundancy=config.zero == 1)
    if config.grad_sync == "fsdp":
        return FSDPSync(model, blocks(model), reshard_after_forward=config.zero == 3, mesh=device_mesh(config, ctx),
                        param_dtype=param_dtype, reduce_dtype=reduce_dtype, init=init)
    hybrid = config.grad_sync == "custom" and across is not None and dist.get_world_size(across) > 1
    return zero.shard(model, config.zero, blocks(model) if config.zero == 3 else None, group=within,
                      collectives=config.allreduce, replicate_group=across if hybrid else None,
                      param_dtype=param_dtype, reduce_dtype=reduce_dtype, bucket_mb=config.bucket_mb,
                      overlap=config.sync_mode == "overlap", accumulate=config.zero3_accumulate,
                      timeout_s=config.timeout, init=init, device=ctx.device, init_device="cpu",
                      offload=config.offload, offload_dir=config.offload_dir)


def make_outer(config: Config, model: nn.Module, across: Any, sync: DataParallel) -> DiLoCo | None:
    """diloco, localsgd: the outer loop over the group across replicas (None for the other syncs). With --zero 3
    inside the replicas the model keeps no whole weights between steps: the outer step acts on this rank's master
    shards (sync.weights), which the ranks at its place in the other replicas (its group across) hold too, and
    drops the units gathered before it wrote them (a prefetch from the step's edge would bring back the old)."""
    if config.grad_sync not in OUTER_SYNCS:
        return None
    sharded = {"params": sync.weights, "after_write": sync.drop_gathered} if config.zero == 3 else {}
    # replica groups meet through their quorum: trainer/replica_groups.py gives DiLoCo that meeting (meet_through)
    try:
        return DiLoCo(model, across, config.local_steps, config.outer_lr, config.outer_momentum,
                      config.outer_optimizer == "nesterov", config.outer_compress, config.fragments,
                      config.outer_delay, config.timeout, **sharded, meets_outside=bool(config.coordinator))
    except ValueError as exc:  # e.g. more fragments than the model has parameters
        raise UsageError(f"--grad-sync {config.grad_sync}: {exc}") from None


def dynamo_counts() -> dict[str, int]:
    """Dynamo's process-wide counters: graphs compiled (a frame each, forward; AOTAutograd's backward graphs are
    not counted apart) and graph breaks."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def compile_forward(config: Config, model: nn.Module) -> dict[str, int] | None:
    """--compile: torch.compile a forward method, at its first call. The module, its state_dict keys and the syncs'
    hooks stay as they are and run eagerly (compiling the module's whole call would trace the syncs' forward
    pre-hooks, which re-attach gradient views parameter by parameter: a recompile for each).

    forward: the model's, one graph, whose backward is one autograd node: every gradient comes out at its end, so
    the hand-written sync's hooks launch all buckets together after the computation (DDP keeps its overlap:
    Dynamo's DDPOptimizer splits the graph at DDP's buckets). blocks: each block's (models.blocks: the units
    stage 3 and FSDP2 gather), a graph and a backward node per block: the gradients of a block are out when its
    backward ends, the buckets overlap the earlier blocks' backward again, and stage 3's gathers stay in the
    blocks' module hooks, outside the graphs. Blocks of one class share a code object, so Dynamo keeps one
    compiled entry per shape and mode (training, evaluation) under it: the recompile limit is raised to cover
    two per block. Returns Dynamo's counters before any compiling (None without --compile)."""
    if not config.compile:
        return None
    counts = dynamo_counts()
    if config.compile == "forward":
        model.forward = torch.compile(model.forward, backend=config.compile_backend)
    elif config.compile == "blocks":
        import torch._dynamo as dynamo

        units = blocks(model)
        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 2 * len(units))
        for unit in units:
            unit.forward = torch.compile(unit.forward, backend=config.compile_backend)
    return counts


OPTIMIZERS = {"sgd": torch.optim.SGD, "sgd_nesterov": torch.optim.SGD, "adamw": torch.optim.AdamW}  # --optimizer


class Optimizers(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, as one: --optimizer muon's AdamW and Muon (``optimizers``, in
    that order; ``named`` adamw and muon). step() and zero_grad() run each; ``param_groups`` is every one's
    groups in turn, the very dicts, so an LR scheduler sets every group's rate by its own factor of its own base
    (LambdaLR: the same factor on --lr and --muon-lr), a gradient scaler unscales every gradient and steps all or
    none, and the loop's lr (param_groups[0]) is AdamW's, --lr's; state_dict() is {name: each one's state_dict()}.

    [Note: two optimizers as one] The loop, the scheduler, the scaler, the clipping and the checkpoints each take
    one optimizer; a class that is one keeps every one of them as it is (the other way, lists, would reach into
    each). It is a torch.optim.Optimizer because LRScheduler requires one, and it holds no parameters of its own:
    torch.optim.Optimizer's __init__ is not run, its param_groups is a property (an optimizer's load_state_dict
    makes new group dicts: a list kept here would go stale), and the sharded stages see the optimizers that
    sync.optimizer built, each stepping its own shards ([Note: several optimizers] in zero/optimizer.py).
    zero.checkpoint and zero.state_bytes take it as the list ``optimizers``."""

    def __init__(self, **named: torch.optim.Optimizer):  # torch.optim.Optimizer.__init__ is not run (the Note)
        self.named = named
        self.optimizers = list(named.values())
        self.defaults: dict[str, Any] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("Optimizers.step takes no closure: it steps several optimizers")
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {name: optimizer.state_dict() for name, optimizer in self.named.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        held = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        if held != sorted(self.named):
            raise ValueError(f"the optimizer state holds {held}, not the state dicts of {sorted(self.named)}")
        for name, optimizer in self.named.items():
            optimizer.load_state_dict(state_dict[name])

    def __repr__(self) -> str:
        return f"Optimizers({', '.join(f'{name}={type(o).__name__}' for name, o in self.named.items())})"


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The trainable 2-D parameters inside the model's blocks (models.blocks: a transformer's attention and MLP
    matrices; not the embeddings, the head, norms or biases): what --optimizer muon's Muon steps."""
    return [p for block in blocks(model) for p in block.parameters() if p.requires_grad and p.dim() == 2]


def make_optimizer(config: Config, model: nn.Module, sync: DataParallel) -> torch.optim.Optimizer:
    """--optimizer over the model's trainable parameters, through the sync (which shards it, or not). With
    --norm-weight-decay, two parameter groups: the matrices and tensors of higher rank (--weight-decay), and the
    vectors, biases and normalization weights (--norm-weight-decay), as torchvision's reference scripts split
    them (and nanoGPT, by the same test on p.dim()). muon: Muon over the blocks' hidden matrices and AdamW over the
    rest (split so as AdamW is), as one (Optimizers), each built by the sync (at --zero 1-3, sharded.optimizer once
    per optimizer; ddp and fsdp: torch's over whole parameters or DTensors)."""
    sgd = {"lr": config.lr, "momentum": config.momentum, "weight_decay": config.weight_decay}
    adamw = {"lr": config.lr, "weight_decay": config.weight_decay,
             **({"betas": tuple(config.betas)} if config.betas else {})}
    trainable = [p for p in model.parameters() if p.requires_grad]
    matrices = hidden_matrices(model) if config.optimizer == "muon" else []
    muons = {id(p) for p in matrices}
    rest = [p for p in trainable if id(p) not in muons]
    params: list[Any] = rest
    if config.norm_weight_decay is not None:
        params = [{"params": [p for p in rest if p.dim() >= 2]},
                  {"params": [p for p in rest if p.dim() < 2], "weight_decay": config.norm_weight_decay}]
        params = [group for group in params if group["params"]]
    if config.optimizer == "muon":
        return Optimizers(adamw=sync.optimizer(torch.optim.AdamW, params, **adamw),
                          muon=sync.optimizer(torch.optim.Muon, matrices, lr=config.muon_lr,
                                              momentum=config.muon_momentum, weight_decay=config.muon_weight_decay,
                                              nesterov=True))
    settings = {"sgd": sgd, "sgd_nesterov": {**sgd, "nesterov": True}, "adamw": adamw}[config.optimizer]
    return sync.optimizer(OPTIMIZERS[config.optimizer], params, **settings)


def schedule_length(config: Config, steps_per_epoch: int) -> int:
    """The learning-rate schedule's steps: --epochs' (cosine: --decay-steps if given; OneCycleLR ends where
    --max-steps ends the run)."""
    steps = config.epochs * steps_per_epoch
    if config.scheduler == "cosine":
        return config.decay_steps or steps
    return min(steps, config.max_steps) if config.max_steps else steps


def make_scheduler(config: Config, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """--scheduler: None, OneCycleLR over ``total_steps``, or cosine: step s (from 0) takes --lr times (s + 1) /
    (N + 1) during the N warm-up steps (nanoGPT's ramp), then eta + (1 - eta) (1 + cos(pi p)) / 2 with p = (s - N)
    / (S - 1 - N) going from 0 to 1 and eta = --min-lr / --lr, so step S - 1 (S = ``total_steps``, --decay-steps)
    and any after it take --min-lr."""
    if config.scheduler == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.lr, total_steps=total_steps)
    if config.scheduler != "cosine":
        return None
    warmup, floor = config.warmup_steps or 0, (config.min_lr or 0.0) / config.lr

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_scaler(config: Config, device: torch.device, **settings: Any) -> torch.amp.GradScaler:
    """--amp fp16's gradient scaler (disabled otherwise). With sharded gradients each rank sees its shard alone,
    so whether any is inf must be agreed on: ShardedGradScaler all-reduces it. Replicated gradients are the same
    everywhere. (Imported only then: torch.distributed.fsdp takes about a second to import, in every process.)"""
    sharded = (config.grad_sync in OURS and config.zero > 0) or config.grad_sync == "fsdp"
    if sharded and config.amp == "fp16":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, **settings)
    return torch.amp.GradScaler(device.type, enabled=config.amp == "fp16", **settings)
