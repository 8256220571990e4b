"""Which optimizers ZeRO's flat shards can carry, and what state an optimizer keeps ([Note: which optimizers] in
zero/optimizer.py): ELEMENTWISE (exact on any run of a flat shard), zero/matrix.py's WHOLE_MATRIX (exact on pieces
of whole matrices), WHOLE_PARAMETER (refused, with the reason); ``state_kinds``, the probe that asks an optimizer
class what it keeps per parameter, and ``missing_optimizer_state``, which a resume uses to refuse a state cut short;
``as_optimizers`` and ``optimizer_parts``: the forms an optimizer argument takes (one, several, or None).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from zero.matrix import PROBE_DIMS, WHOLE_MATRIX

# Each element's update reads only that element's weight, gradient and state, and the parameter's scalars (a step
# count): exact on any run of any parameter. Add a class of your own that is element-wise: ELEMENTWISE.add(cls).
ELEMENTWISE: set[type[torch.optim.Optimizer]] = {getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")}
# Muon and Adafactor read whole matrices: zero/matrix.py steps them on per-parameter pieces, exactly (WHOLE_MATRIX).
# What each of these needs that neither runs nor pieces give: refused at sharded.optimizer().
WHOLE_PARAMETER: dict[type[torch.optim.Optimizer], str] = {
    torch.optim.LBFGS: "takes dot products over the whole model's gradient and re-evaluates the loss in a closure",
    torch.optim.SparseAdam: "steps sparse gradients, and the shards' gradients are dense",
}


def check_optimizer_class(optimizer_class: type[torch.optim.Optimizer], stage: int) -> None:
    """One line, at sharded.optimizer(), for an optimizer the runs of a flat shard would give another algorithm
    ([Note: which optimizers])."""
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    if optimizer_class in WHOLE_MATRIX:
        return
    if optimizer_class in WHOLE_PARAMETER:
        raise ValueError(f"sharded.optimizer: zero.shard stage {stage} cuts every parameter into flat runs spread "
                         f"over the ranks, and torch.optim.{name} {WHOLE_PARAMETER[optimizer_class]}: on runs it "
                         f"would be another algorithm; use stage 0 (whole parameters on every rank) or torch's "
                         f"ZeroRedundancyOptimizer (whole parameters placed on ranks; the trainer's --grad-sync ddp "
                         f"--zero 1)")
    if optimizer_class not in ELEMENTWISE:
        raise ValueError(f"sharded.optimizer: zero.shard stage {stage} gives {name} flat runs of the parameters, "
                         f"which is exact only if it updates each element from that element's weight, gradient and "
                         f"state alone; if {name} does, declare it first: zero.ELEMENTWISE.add({name})")


def state_kinds(optimizer_class: type[torch.optim.Optimizer], settings: dict[str, Any],
                device: torch.device | str = "cpu", dim: int = 1) -> dict[str, bool]:
    """The state ``optimizer_class`` keeps per parameter once it has stepped it with ``settings`` (a parameter
    group's hyperparameters): each key, True for a tensor of the parameter's shape (one number per element),
    False for anything else (a step count; Adafactor's row_var and col_var). Found by stepping a probe of two
    elements a side once, of ``dim`` dimensions (a 0-dim parameter keeps what a vector does): no table to keep, and
    right for every setting that adds state (amsgrad, momentum, centered)."""
    probe = torch.zeros((2,) * max(dim, 1), device=device, requires_grad=True)
    probe.grad = torch.ones_like(probe)
    optimizer = optimizer_class([{**{k: v for k, v in settings.items() if k != "params"}, "params": [probe]}])
    optimizer.step()
    return {key: torch.is_tensor(value) and value.shape == probe.shape
            for key, value in optimizer.state[probe].items()}


def missing_optimizer_state(optimizer_class: type[torch.optim.Optimizer], state: dict[str, Any],
                            every_parameter: bool,
                            kinds: Callable[[int], dict[str, bool]] | None = None) -> str | None:
    """What ``state`` (torch.optim's ordinary state_dict) lacks that ``optimizer_class`` keeps, in words, or None:
    a parameter whose entry lacks a key its group's settings make the optimizer keep, or, if ``every_parameter``
    (the run has stepped every parameter), a parameter with no entry at all. ``kinds(index)``: that parameter's
    ``state_kinds``, where the caller knows them (else probed here, on the CPU: where the keys depend on the
    parameter's dimensions, as Adafactor's do, an entry may hold those of any of them)."""
    saved = {int(index): entry for index, entry in state["state"].items()}
    for group in state["param_groups"]:
        candidates = None if kinds is not None else [
            state_kinds(optimizer_class, group, dim=dim) for dim in PROBE_DIMS.get(optimizer_class, (1,))]
        for index in group["params"]:
            if index not in saved and not every_parameter:
                continue
            entry = saved.get(index, {})
            lacking = min(([key for key in keys if key not in entry]
                           for keys in ([kinds(index)] if kinds is not None else candidates)), key=len)
            if lacking:
                return (f"parameter {index} has no {lacking[0]!r}, which torch.optim.{optimizer_class.__name__} "
                        f"keeps for every parameter it has stepped")
    return None


def as_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """One optimizer, a list or tuple of them, an object that holds several as ``.optimizers`` (the trainer's
    --optimizer muon: AdamW and Muon stepped as one), or None: as a list (zero.checkpoint, zero.state_bytes)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, (list, tuple)):
        return list(optimizer)
    return list(getattr(optimizer, "optimizers", [optimizer]))


def optimizer_parts(optimizer: Any, state: Any) -> list[tuple[torch.optim.Optimizer, dict[str, Any]]]:
    """Each optimizer of ``optimizer`` (as_optimizers) with its part of ``state``, which is ``optimizer``'s
    state_dict(): the whole of it for one optimizer; for several as one object, that object's own form, {name:
    each one's state_dict} under the names of its ``named`` (the trainer's --optimizer muon)."""
    optimizers = as_optimizers(optimizer)
    if len(optimizers) == 1 and optimizers[0] is optimizer:
        return [(optimizer, state)]
    names = list(getattr(optimizer, "named", {}))
    if len(names) != len(optimizers) or not isinstance(state, dict) or sorted(state) != sorted(names):
        raise ValueError(f"the optimizer state holds {sorted(state) if isinstance(state, dict) else state!r}, not "
                         f"the state dicts of {names or len(optimizers)} optimizers")
    return [(part, state[name]) for name, part in zip(names, optimizers)]
