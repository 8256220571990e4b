"""Deferred initialization, ``zero.shard(model, stage, init=fn)``: a model built on the meta device (shapes only: no
memory, no random draws) is materialized one module at a time, so that at stage 3 no rank ever holds the whole
model, and its weights are bit for bit the ones a single process would give.

    with torch.device("meta"):
        model = GPT(...)
    sharded = zero.shard(model, 3, init=model.init_weights)      # fn(module): initializes that module's own tensors

The contract. The weights equal what one process gets from

    model.to_empty(device=init_device)            # tied parameters kept tied
    for module in model.modules():
        fn(module)

started from the same generator state, at any world size and any stage, tied weights included (a tied tensor is
written by every module that holds it, the last write wins, as on one process). Every rank calls ``fn`` on every
module in that order and so consumes its generator as that one process does; the ranks must start in the same state
(checked: one object all-gather, refused in one line otherwise). ``fn`` initializes the module's own parameters and
buffers (those of ``module.named_parameters(recurse=False)``, as ``reset_parameters`` does); at stage 3 touching
another module's is refused in one line (their storage is not there).

[Note: deferred initialization at stage 3] The stage is built first around placeholder parameters: real tensors of
the right shape, strides and dtype on the target device with no memory behind them, so the units, buckets, shards
and hooks are laid out as for an eager model, and each unit's flat is whole only for a moment, one at a time. Then,
for each module in ``model.modules()`` order, every part holding one of its own parameters (a unit's trainable
bucket, or one of its frozen parts) gets an initialization buffer, whole, in the dtype of the part's shards (the
masters': the model's own dtype, whatever param_dtype is) on ``init_device``, and the part's parameters point into
it; ``fn(module)`` writes them; once the last module holding one of the part's parameters has run, this rank's chunk
goes into its shard and the buffer is dropped. A rank therefore holds, besides its shards, the parts whose modules
are under way: the root's (its modules open and close the model: embeddings first, head last) and one unit's, the
same as during a step. FSDP2 cannot offer this equality: its DTensor random generator draws each shard from an
offset, so another world size gives other values (pytorch issue 168058); torchtitan answers with a seed checkpoint
written by one process.

Stages 0-2 keep the whole weights on every rank anyway: there the model is materialized whole (ties kept), ``fn`` is
run over it, and it is sharded as an eager model is.

``Replay`` helps make a meta build equal an EAGER build of the same model (one whose constructor draws random
numbers, in an order other than module by module): models.py uses it for its models.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Init = Callable[[nn.Module], None]


# ----------------------------------------------------------------------------------------------------------
# What zero.shard checks and prepares
# ----------------------------------------------------------------------------------------------------------
def on_meta(model: nn.Module) -> bool:
    """Whether the model is on the meta device; one that is partly there is refused in one line."""
    tensors = list(model.parameters()) + list(model.buffers())
    meta = [t.is_meta for t in tensors]
    if any(meta) and not all(meta):
        where = sorted({str(t.device) for t in tensors if not t.is_meta})
        raise ValueError(f"zero.shard: the model is partly on the meta device and partly on {', '.join(where)}; "
                         f"build it wholly under torch.device('meta') for init=, or wholly on a device without")
    return bool(meta) and all(meta)


def default_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a meta model is materialized when no device is given: this process's GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def generator_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def check_same_generator(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Every rank of the group must draw the same numbers in ``fn``: their generators' states are compared (a hash
    each, one object all-gather), and a difference refused in one line, the same on every rank."""
    digest = hashlib.sha256(generator_state(device).numpy().tobytes()).hexdigest()
    digests: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    differing = [rank for rank, theirs in enumerate(digests) if theirs != digests[0]]
    if differing:
        raise ValueError(f"zero.shard(init=...): the random generator ({device.type}) of rank(s) "
                         f"{', '.join(map(str, differing))} is in another state than rank 0's; seed every rank alike "
                         f"(torch.manual_seed) before zero.shard, so that all of them initialize one model")


def replace_parameters(model: nn.Module, make: Callable[[nn.Parameter], nn.Parameter]) -> None:
    """Every parameter replaced by ``make(parameter)``, one new Parameter per old one (so tied ones stay tied: the
    same object under each module that holds it; ``to_empty`` would untie them)."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = make(p)
                module._parameters[name] = new[id(p)]


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer on ``device``, uninitialized (``fn`` fills them), whole on every rank as buffers are."""
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=device)


def move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)


def whole(p: nn.Parameter, device: torch.device) -> nn.Parameter:
    """A parameter like ``p`` (shape, strides, dtype, requires_grad) on ``device``, its values uninitialized."""
    data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
    return nn.Parameter(data, requires_grad=p.requires_grad)


def placeholder(p: nn.Parameter, device: torch.device) -> nn.Parameter:
    """A parameter like ``p`` on ``device`` with no memory behind it: the stage makes it a view of its unit's flat
    (allocated for a moment: a view cannot be made of a storage of 0 bytes), and the initialization points it into
    a buffer while its module's ``fn`` runs."""
    data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
    data.untyped_storage().resize_(0)
    return nn.Parameter(data, requires_grad=p.requires_grad)


def initialize_whole(model: nn.Module, fn: Init, device: torch.device, init_device: torch.device) -> None:
    """Stages 0-2 (and the contract's one process): the meta model materialized whole on ``init_device``, ties kept,
    ``fn`` run over ``model.modules()``, then moved to ``device``."""
    replace_parameters(model, lambda p: whole(p, init_device))
    materialize_buffers(model, init_device)
    with torch.no_grad():
        for module in model.modules():
            fn(module)
        if device != init_device:
            for p in {id(p): p for p in model.parameters()}.values():
                p.data = p.data.to(device)
            move_buffers(model, device)


# ----------------------------------------------------------------------------------------------------------
# Stage 3: module by module into the shards ([Note: deferred initialization at stage 3])
# ----------------------------------------------------------------------------------------------------------
class OnlyMaterialized(TorchDispatchMode):
    """While ``fn(module)`` runs: an operation on a tensor with no memory behind it (another module's parameter at
    stage 3) is refused in one line, naming it, instead of crashing the process."""

    def __init__(self, names: dict[int, str], module_name: str):
        super().__init__()
        self.names, self.module_name = names, module_name

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.numel() and not t.is_meta and t.untyped_storage().nbytes() == 0:
                raise ValueError(f"zero.shard(init=...): fn({self.module_name or 'the model'}) touched "
                                 f"{self.names.get(id(t), 'a tensor')} of another module; fn(module) initializes "
                                 f"the module's own parameters and buffers only (recurse=False), as "
                                 f"reset_parameters does")
        return func(*args, **(kwargs or {}))


def initialize_shards(stage: Any, fn: Init, init_device: torch.device) -> None:
    """Run ``fn`` over ``stage.model.modules()`` writing each part's values into this rank's shard, one part's
    buffer at a time besides the root's ([Note: deferred initialization at stage 3])."""
    model = stage.model
    part_of = {id(p): part for part in [part for unit in stage.units for part in [unit, *unit.frozen]]
               for p in part.params}
    modules = list(model.named_modules(remove_duplicate=False))
    holds = [[part_of[id(p)] for p in module._parameters.values() if p is not None] for _, module in modules]
    last = {id(part): i for i, parts in enumerate(holds) for part in parts}  # the last module holding each part
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    open_parts: dict[int, tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]]]] = {}
    with torch.no_grad():
        for i, ((name, module), parts) in enumerate(zip(modules, holds)):
            for part in parts:
                if id(part) not in open_parts:
                    open_parts[id(part)] = open_part(part, stage.shard_of(part), init_device)
            with OnlyMaterialized(names, name):
                fn(module)
            for part in {id(part): part for part in parts}.values():
                if last[id(part)] == i:
                    close_part(part, stage.write_shard, stage.comm.chunk, *open_parts.pop(id(part)))


def open_part(part: Any, shard: torch.Tensor,
              init_device: torch.device) -> tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]]]:
    """The part's initialization buffer (whole, the shard's dtype, zeros: the padding stays zero) and its
    parameters pointed into it; returns the buffer and each parameter's placeholder, to point back to."""
    buffer = torch.zeros(part.length, dtype=shard.dtype, device=init_device)
    placeholders = [(p, p.data) for p in part.params]
    for p in part.params:
        p.data = part.view(buffer, p)
    return buffer, placeholders


def close_part(part: Any, write_shard: Callable[[Any, torch.Tensor], None],
               chunk: Callable[[torch.Tensor], torch.Tensor], buffer: torch.Tensor,
               placeholders: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """This rank's chunk of the initialized part into its shard (the stage's ``write_shard``: in place, or into
    the offload store); the parameters back to their placeholders."""
    write_shard(part, chunk(buffer))
    for p, data in placeholders:
        p.data = data


# ----------------------------------------------------------------------------------------------------------
# Replay: a meta build equal to an eager one
# ----------------------------------------------------------------------------------------------------------
class Replay:
    """An ``fn`` for zero.shard(init=) that gives a meta-built model the weights an EAGER build gives it, for a
    model whose construction draws random numbers in an order other than module by module (nn.Linear's
    reset_parameters as each layer is made, then the model's own loop over all of them, as nanoGPT, torchvision's
    ResNets and ViTs do).

    ``steps``: the eager build's initializations in the order it runs them, each (module, f) with f(module)
    initializing that module's own tensors (the module's reset_parameters; a line of the model's own loop), or
    (module, f, False) for one whose draws the eager build takes but whose values it drops (a layer made, then
    replaced by another: a tied head's own weight).
    A generator state holds the whole order: where step k starts is the state after steps 0..k-1, found once by
    a dry run over scratch tensors, one module's at a time (so no memory beyond the largest module; the random
    draws' cost twice). Then ``fn(module)`` runs that module's steps, each from its own state, and leaves the
    generator where the eager build leaves it: a tensor written by several steps ends with the last one's values,
    as eagerly. Equality holds when each step's draws depend only on the generator state and the shapes, which is
    so for torch.nn.init's functions on one device."""

    def __init__(self, steps: Iterable[tuple[Any, ...]], device: torch.device | str = "cpu"):
        self.steps = [(module, f, *(keep or (True,))) for module, f, *keep in steps]  # (module, f, keep)
        self.device = torch.device(device)  # where fn runs: the generator it draws from
        self.starts: list[torch.Tensor] | None = None
        self.end: torch.Tensor | None = None

    def _dry_run(self) -> None:
        """Each step's starting state: every step run in order on scratch tensors of its module's own shapes."""
        device, self.starts = self.device, []
        for module, step, _ in self.steps:
            self.starts.append(generator_state(device).clone())
            real = dict(module._parameters), dict(module._buffers)
            for name, p in real[0].items():
                if p is not None:
                    module._parameters[name] = whole(p, device)
            for name, b in real[1].items():
                if b is not None:
                    module._buffers[name] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=device)
            with torch.no_grad():
                step(module)
            module._parameters.update(real[0])
            module._buffers.update(real[1])
        self.end = generator_state(device).clone()

    def __call__(self, module: nn.Module) -> None:
        tensors = [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]
        if any(t.device.type != self.device.type for t in tensors):
            raise ValueError(f"zero.init.Replay: {type(module).__name__}'s tensors are on {tensors[0].device}, and "
                             f"this Replay draws from the {self.device.type} generator (Replay(..., device=))")
        if self.starts is None:
            self._dry_run()
        for (owner, step, keep), start in zip(self.steps, self.starts):
            if owner is module and keep:
                set_generator_state(start, self.device)
                step(module)
        set_generator_state(self.end, self.device)


def set_generator_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def reset_parameters(module: nn.Module) -> None:
    """A module's own reset_parameters (an nn.Linear's, a LayerNorm's, a BatchNorm's), if it has one: what its
    constructor ran."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
