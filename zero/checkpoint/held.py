"""What one rank holds, as it holds it, for a peer of the same layout: the live state a fault-tolerant replica group
sends a group that joins, place j to place j (replicas/, trainer/replica_groups.py).

    state = held_state(sync, optimizer)          # on the rank that holds the state: views, nothing copied
    load_held_state(sync, optimizer, state)      # on the rank of the same place in a group of the same layout

A checkpoint (zero.checkpoint.save) is written in the model's own layout (every tensor in its global shape) so that
any stage at any world size reads it; here both ends hold the state alike (the same model, stage, world size and
buckets: the replica groups refuse a group of another identity), so a rank's own pieces travel as they are, with
no gather and no cut, and each lands where the peer keeps the same piece:

    {"model":      {name: tensor | [piece, ...]},   every name of model.state_dict(): a tensor whole on this rank
                                                    (buffers, frozen parameters at stages 1-2, all of stage 0)
                                                    as it is; a parameter kept in flat buckets as this rank's pieces
                                                    of it (held_pieces: 1-D views of the masters; [] where none)
     "optimizers": [state, ...]}                    each optimizer's (as_optimizers): stage 0's plain torch.optim
                                                    state_dict; at stages 1-3 the inner optimizer's over this rank's
                                                    runs (torch.optim's packing, the runs numbered group by group)

Every tensor is a view of what the rank holds (the masters' pieces, the optimizer's own state tensors), so a sender
copies nothing, and a receiver that reads into the tensors of its own ``held_state`` (replicas/transfer.py's
``into``) holds nothing beyond its steady state either: ``load_held_state`` then finds each value already in place
(a copy_ of a tensor onto itself returns at once). Afterwards the stage makes the model ready as after a checkpoint's
load (``shards_loaded``: stages 1-2 gather the weights whole, stage 3 drops what was gathered).
"""
from __future__ import annotations

from typing import Any

import torch

from zero.optimizer_kinds import as_optimizers


def held_model(sync: Any) -> dict[str, Any]:
    """The "model" part (module docstring): the sync's ``held_pieces`` and, for every other name of the model's
    state_dict, its tensor (keep_vars: stage 3's refusal of a plain state_dict reads no tensor here)."""
    held = sync.held_pieces()
    return {name: [piece.values for piece in held[name]] if name in held
            else value.detach() if torch.is_tensor(value) else value
            for name, value in sync.model.state_dict(keep_vars=True).items()}


def run_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's own state in torch.optim's packing (its tensors numbered in order, group by group), without
    the state-dict hooks: stage 0's plain optimizer's state_dict, and for a sharded stage's inner optimizer the state
    of this rank's runs as it holds it (its ``state_dict()`` would gather the whole to rank 0). Its tensors are the
    optimizer's own."""
    numbered, state, groups = 0, {}, []
    for group in optimizer.param_groups:
        indices = list(range(numbered, numbered + len(group["params"])))
        for index, p in zip(indices, group["params"]):
            if optimizer.state.get(p):
                state[index] = dict(optimizer.state[p])
        groups.append({**{key: value for key, value in group.items() if key != "params"}, "params": indices})
        numbered += len(indices)
    return {"state": state, "param_groups": groups}


def held_state(sync: Any, optimizer: Any) -> dict[str, Any]:
    """What this rank holds of the model and of ``optimizer`` (one, several, None), as views (module docstring)."""
    return {"model": held_model(sync), "optimizers": [run_state(o) for o in as_optimizers(optimizer)]}


def load_held_state(sync: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """A peer's ``held_state`` into this rank's model and optimizers (the same layout: anything else is refused
    before a tensor is written, in one line), then the model made ready to train (``shards_loaded``). Every rank of
    the group calls it (stages 1-2 gather)."""
    mine, theirs = held_model(sync), state["model"]
    problem = layout_problem(mine, theirs, len(as_optimizers(optimizer)), len(state["optimizers"]))
    if problem:
        raise ValueError(f"load_held_state: the state is of another layout: {problem}")
    sync.shards_loading()
    with torch.no_grad():
        for name, value in mine.items():
            if isinstance(value, list):
                for own, given in zip(value, theirs[name]):
                    own.copy_(given)
            elif torch.is_tensor(value):
                value.copy_(theirs[name])
    sync.shards_loaded()
    for own_optimizer, given in zip(as_optimizers(optimizer), state["optimizers"]):
        if sync.optimizer_view(own_optimizer).runs is not None:
            sync.load_run_state(own_optimizer, given)
        else:
            own_optimizer.load_state_dict(given)


def layout_problem(mine: dict[str, Any], theirs: dict[str, Any], optimizers: int, given: int) -> str | None:
    """Where a peer's model part differs from this rank's in names, pieces or shapes (None: alike)."""
    if set(mine) != set(theirs):
        return f"names {sorted(set(mine) ^ set(theirs))[:3]} held by one side only"
    if optimizers != given:
        return f"{given} optimizers' state for {optimizers}"
    for name, value in mine.items():
        other = theirs[name]
        if isinstance(value, list) != isinstance(other, list):
            return f"{name} is in pieces on one side only"
        pairs = zip(value, other) if isinstance(value, list) else [(value, other)]
        if isinstance(value, list) and len(value) != len(other):
            return f"{name}: {len(other)} pieces for {len(value)}"
        for own, peer in pairs:
            if torch.is_tensor(own) and (not torch.is_tensor(peer) or own.shape != peer.shape):
                return f"{name}: {tuple(getattr(peer, 'shape', ()))} for {tuple(own.shape)}"
    return None
