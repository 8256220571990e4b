"""The state dict of one rank, as torch.distributed.checkpoint sees it: get_state_dict's layout of what the sync
holds, built from what the sync says it holds (``Checkpointable``), and the places a load reads into.

    {"model":     {fqn: tensor or Shards},             model_entries
     "optimizer": {"state": {fqn: {key: value}},        optimizer_entries (save), sharded_destinations and
                   "param_groups": [...]},              plain_destinations (load)
     "extra":     anything}                            encode_extra / decode_extra ([Note: extra])

A sync tells its checkpoint what it holds through ``Checkpointable``'s methods, and nothing here reads a sync's
internals: zero.shard's stage 0 (zero/stage0.py) holds every tensor whole and plain optimizers; stages 1-3
(zero/stages.py, zero/stage3.py) hold pieces of the parameters kept in flat buckets, and optimizers over runs of
those pieces (zero/optimizer.py), each run's ``covers`` the one translation from runs to parameters.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint._traverse import set_element  # DCP's own rebuilding (dcp_to_torch_save's)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from zero.checkpoint.checks import Slot
from zero.pieces import OptimizerView, Piece, Shards, shards_by_name


@runtime_checkable
class Checkpointable(Protocol):
    """What a sync tells its checkpoint (zero.shard's stages 0-3 implement it: zero.stage0.BucketedSync for stage 0,
    zero/stages.py's ShardedStage for 1-3)."""

    model: nn.Module

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The ranks that save and load together."""

    def held_pieces(self) -> dict[str, list[Piece]]:
        """Under each name of each parameter the sync keeps in pieces, this rank's pieces (none where it holds none
        of it); every other tensor of the model's state_dict is whole on every rank."""

    def optimizer_view(self, optimizer: torch.optim.Optimizer) -> OptimizerView:
        """The optimizer's class, parameters and (for a sharded one) runs; one not of this sync refused in one
        line."""

    def load_run_state(self, optimizer: torch.optim.Optimizer, inner: dict[str, Any]) -> None:
        """A sharded optimizer's state in its runs' own form (state by run number)."""

    def shards_saving(self) -> None:
        """Before a save reads the held pieces."""

    def shards_loading(self) -> None:
        """Before a load writes into the held pieces."""

    def shards_loaded(self) -> None:
        """After a load wrote into them: the model made ready to train."""


def model_entries(sync: Checkpointable, saving: bool = False) -> dict[str, Any]:
    """The "model" part, name by name as in model.state_dict(): a Shards of this rank's pieces where the sync
    keeps the tensor in pieces (nothing where it holds none of it), else the whole tensor (buffers, frozen
    parameters at stages 0-2, stage 0's parameters). ``saving``: the buffers are offered by the group's rank 0
    alone ([Note: one definition of a buffer])."""
    held = sync.held_pieces()
    pieces = shards_by_name(piece for pieces in held.values() for piece in pieces)
    others = saving and dist.get_rank(sync.checkpoint_group()) != 0
    buffers = {name for name, _ in sync.model.named_buffers()} if others else set()
    entries = {}
    for name, value in sync.model.state_dict(keep_vars=True).items():
        if name in buffers:
            continue
        if not torch.is_tensor(value):
            raise ValueError(f"zero.checkpoint: the model's state_dict holds {name!r}, a {type(value).__name__} "
                             f"(a module's extra state), which these checkpoints do not carry")
        if name in pieces:
            entries[name] = pieces[name]
        elif name not in held:
            entries[name] = value.detach()
    return entries


# [Note: one definition of a buffer] A buffer (BatchNorm's running statistics) is whole on every rank, but with
# per-process normalization (--norm local) every rank's differs, and DCP keeps whichever identical-looking copy its
# planner picks: a checkpoint would hold some rank's, another sync's another's, and a resumed run evaluate otherwise.
# So the group's rank 0 alone offers them, as last.pt holds rank 0's and DistributedDataParallel broadcasts rank 0's
# before each forward; the trainer evaluates with rank 0's too (its validation broadcasts them first).


def first_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's first name (a tied one's: get_state_dict's for the optimizer), by id."""
    return {id(p): name for name, p in model.named_parameters()}


def slots(sync: Checkpointable, optimizers: list[torch.optim.Optimizer]) -> list[Slot]:
    """Every optimizer's parameters in torch.optim's order (group by group), as the sync's optimizer_view gives
    them, refusing in one line a parameter in two optimizers."""
    names = first_names(sync.model)
    out = [Slot(names[id(p)], optimizer, g, p, view.torch_class)
           for optimizer in optimizers for view in [sync.optimizer_view(optimizer)] for g, p in view.parameters]
    seen: set[str] = set()
    for slot in out:
        if slot.name in seen:
            raise ValueError(f"zero.checkpoint: parameter {slot.name} is in two optimizers")
        seen.add(slot.name)
    return out


def packed_groups(slots_: list[Slot], optimizers: list[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    """Every optimizer's param_groups as torch.optim's state_dict packs them (every setting, then "params"), the
    parameters named, one optimizer after another (get_state_dict's merge)."""
    names: dict[tuple[int, int], list[str]] = {}
    for slot in slots_:
        names.setdefault((id(slot.optimizer), slot.group), []).append(slot.name)
    return [{**{key: value for key, value in group.items() if key != "params"},
             "params": names.get((id(optimizer), g), [])}
            for optimizer in optimizers for g, group in enumerate(optimizer.param_groups)]


def optimizer_shards(pieces: dict[str, list[Piece]]) -> dict[str, dict[str, Shards]]:
    """{state key: pieces} as {parameter name: {state key: Shards}}."""
    entries: dict[str, dict[str, Shards]] = {}
    for key, key_pieces in pieces.items():
        for name, shards in shards_by_name(key_pieces).items():
            entries.setdefault(name, {})[key] = shards
    return entries


def optimizer_entries(sync: Checkpointable, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """The "optimizer" part: get_state_dict's layout of this rank's state. A plain optimizer's (stage 0) state as it
    is, under each parameter's name; a sharded one's per run: element-wise tensors (1-D over the run) cut into the
    parameters' pieces (Shards), scalars (step) and the tensors kept whole (Adafactor's row_var and col_var) under
    every parameter the run covers.

    [Note: state kept whole] Adafactor's factored statistics are not one number per element: every rank holding a
    piece of a matrix keeps the whole ``row_var`` and ``col_var``, alike (zero/matrix.py), in torch's shapes. That is
    what FSDP2 holds too (torch 2.15: DTensors of Replicate placement, their global shapes), and get_state_dict gives
    them as whole tensors: each rank that holds one offers it whole, and DCP's de-duplication of identical write
    items writes it once. A load reads it whole on every rank that holds a piece (a few hundred numbers)."""
    names, state = first_names(sync.model), {}
    slots_ = slots(sync, optimizers)
    for optimizer in optimizers:
        view = sync.optimizer_view(optimizer)
        runs = view.runs
        if runs is None:
            held = optimizer.state if view.state is None else view.state
            state.update((slot.name, dict(held[slot.param])) for slot in slots_
                         if slot.optimizer is optimizer and held.get(slot.param))
            continue
        pieces: dict[str, list[Piece]] = {}
        for number, run in enumerate(runs):
            values = optimizer.state.get(run.param)
            stored = view.stored.held(number) if view.stored is not None else {}  # offload: in the store
            for cover in run.covers if values or stored else []:
                name = names[id(cover.param)]
                entry = state.setdefault(name, {})
                for key, (meta, source) in stored.items():
                    pieces.setdefault(key, []).append(cover.piece(name, meta, source))
                    entry[key] = None
                for key, value in (values or {}).items():
                    if torch.is_tensor(value) and value.dim() == 1:  # element-wise: 1-D over the run
                        pieces.setdefault(key, []).append(cover.piece(name, value))
                        entry[key] = None  # its place in the entry's order of keys, for the Shards below
                    else:  # a scalar, or a tensor kept whole ([Note: state kept whole]): the run's, the same for
                        entry.setdefault(key, value)  # all it covers
        for name, keys in optimizer_shards(pieces).items():
            state[name].update(keys)
    return {"state": state, "param_groups": packed_groups(slots_, optimizers)}


def small_entries(metadata: Metadata, with_optimizer: bool) -> dict[str, Any]:
    """The first read's state dict, rebuilt from the metadata's paths (as dcp_to_torch_save rebuilds all of it):
    extra, and the optimizer's param_groups and scalars (every 0-dim tensor and pickled value of its state)."""
    small: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        path = metadata.planner_data.get(key, (key,))
        tensor = isinstance(md, TensorStorageMetadata)
        if path[0] == "extra" or (with_optimizer and path[0] == "optimizer" and (not tensor or len(md.size) == 0)):
            set_element(small, path, torch.empty(md.size, dtype=md.properties.dtype) if tensor else None)
    return small


Install = Callable[[list[dict[str, Any]]], None]  # given the saved groups matched to the optimizer's, loads it


def sharded_destinations(sync: Checkpointable, optimizer: torch.optim.Optimizer, runs: list[Any],
                         layout: dict[str, dict[str, Any]], scalars: dict[str, dict[str, Any]],
                         kinds: dict[str, dict[str, bool]], stored: Any = None) -> tuple[Install, dict[str, Any]]:
    """Stages 1-3: for each run whose parameters have state in the checkpoint (``layout``: checks.saved_optimizer's),
    a new tensor per element-wise key (the run's length and dtype), cut into the parameters' pieces to read into; a
    new tensor of the saved shape per key kept whole ([Note: state kept whole]: a piece of a matrix, the only run of
    its parameter on this rank), read whole; the scalars from the first read (``scalars``). Returns
    (install(groups), what to read), where install loads the runs' state and the groups' settings through
    torch.optim's load_state_dict. ``stored`` (offload: the view's): an element-wise key's destination is the run's
    range of its slot in the store ([Note: stored pieces]), and the run's state keeps a meta tensor for it."""
    names = first_names(sync.model)
    runs_state: dict[int, dict[str, Any]] = {}
    pieces: dict[str, list[Piece]] = {}
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for number, run in enumerate(runs):
        name = names[id(run.covers[0].param)]  # a group's parameters all have state or none, one scalar each
        if name not in layout:
            continue
        state: dict[str, Any] = {}
        for key, md in layout[name].items():
            if kinds[name][key]:
                meta, source = stored.destination(number, key) if stored is not None else (None, None)
                state[key] = meta if meta is not None else torch.empty(run.end - run.start, dtype=run.param.dtype,
                                                                       device=run.param.device)
                pieces.setdefault(key, []).extend(cover.piece(names[id(cover.param)], state[key], source)
                                                  for cover in run.covers)
            elif isinstance(md, TensorStorageMetadata) and len(md.size):
                state[key] = whole.setdefault(name, {})[key] = torch.empty(md.size, dtype=md.properties.dtype)
            else:  # the first read's tensor, the run's own (no two runs begin with one parameter)
                state[key] = scalars[name][key]
        runs_state[number] = state

    def install(groups: list[dict[str, Any]]) -> None:
        inner_groups = [{**{k: v for k, v in saved_group.items() if k != "params"},
                         "params": [n for n, run in enumerate(runs) if run.group == g]}
                        for g, saved_group in enumerate(groups)]
        sync.load_run_state(optimizer, {"state": runs_state, "param_groups": inner_groups})
    entries = optimizer_shards(pieces)
    for name, keys in whole.items():
        entries.setdefault(name, {}).update(keys)
    return install, entries


def plain_destinations(optimizer: torch.optim.Optimizer, slots_: list[Slot], layout: dict[str, dict[str, Any]],
                       scalars: dict[str, dict[str, Any]]) -> tuple[Install, dict[str, Any]]:
    """Stage 0's plain optimizer: each parameter's state tensors whole (element-wise, and those kept whole:
    Adafactor's row_var and col_var), read into new tensors (torch.optim's load then casts and places them as the
    parameter is); the scalars from the first read. ``slots_``: this optimizer's."""
    state: dict[int, dict[str, Any]] = {}
    entries: dict[str, dict[str, Any]] = {}
    for index, slot in enumerate(slots_):
        if slot.name not in layout:
            continue
        state[index] = {}
        for key, md in layout[slot.name].items():
            if isinstance(md, TensorStorageMetadata) and len(md.size):
                tensor = torch.empty(md.size, dtype=md.properties.dtype)
                state[index][key] = entries.setdefault(slot.name, {})[key] = tensor
            else:
                state[index][key] = scalars[slot.name][key]

    def install(groups: list[dict[str, Any]]) -> None:
        numbered, count = [], 0
        for group in optimizer.param_groups:
            numbered.append(list(range(count, count + len(group["params"]))))
            count += len(group["params"])
        optimizer.load_state_dict({"state": state, "param_groups": [
            {**{k: v for k, v in saved_group.items() if k != "params"}, "params": indices}
            for saved_group, indices in zip(groups, numbered)]})
    return install, entries


# ----------------------------------------------------------------------------------------------------------
# extra: the caller's structure, through DCP's flattening and back ([Note: extra])
# ----------------------------------------------------------------------------------------------------------
KEPT_WHOLE = "zero.checkpoint: a mapping kept whole"  # the first item of a tuple that stands for a dict


def encode_extra(value: Any) -> Any:
    """[Note: extra] DCP flattens nested dicts into one key per leaf (each tensor an item of its own, each other
    leaf pickled whole: a tuple, a number, a scheduler's list of rates) and rebuilds them from the paths in its
    metadata, with every key made a str and an empty dict gone. So a plain dict of str keys and a list are opened;
    any other mapping (empty, a key that is not a str) is kept whole as a tuple, (KEPT_WHOLE, ((key, value), ...)),
    one pickled leaf of Python's builtins and tensors: what load returns equals what was saved (a plain dict, its
    tensors on the CPU), and a checkpoint holds nothing but tensors and builtins, so torch.load(weights_only=True)
    reads what dcp_to_torch_save makes of it, without this repository."""
    if type(value) is dict and value and all(type(key) is str for key in value):
        return {key: encode_extra(item) for key, item in value.items()}
    if isinstance(value, Mapping):
        return (KEPT_WHOLE, tuple((key, encode_extra(item)) for key, item in value.items()))
    if type(value) is list:
        return [encode_extra(item) for item in value]
    return value


def decode_extra(value: Any) -> Any:
    if type(value) is tuple and len(value) == 2 and value[0] == KEPT_WHOLE:
        return {key: decode_extra(item) for key, item in value[1]}
    if type(value) is dict:
        return {key: decode_extra(item) for key, item in value.items()}
    if type(value) is list:
        return [decode_extra(item) for item in value]
    return value
