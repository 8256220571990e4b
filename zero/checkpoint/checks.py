"""The checks of zero.checkpoint: one line each, naming the folder, the same verdict on every rank ([Note: the same
verdict]). A folder that is not a checkpoint or is torn (``read_folder``), another model (``model_problem``), an
optimizer state of another kind or other parameter groups (``optimizer_problem``, ``groups_problem``,
``scalars_problem``): each returns the problem in words, or None, and the API (zero/checkpoint/api.py) raises
CheckpointError with it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from utils import one_line
from zero.matrix import PROBE_DIMS
from zero.optimizer_kinds import state_kinds


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked, in one line naming its folder."""


@dataclass
class Slot:
    """One parameter's place in one optimizer: its name (the first), the optimizer, its group there, the parameter,
    and the torch.optim class whose state the optimizer keeps (the sync's OptimizerView)."""
    name: str
    optimizer: torch.optim.Optimizer
    group: int
    param: torch.Tensor
    torch_class: type[torch.optim.Optimizer]


def agree(problem: str | None, group: dist.ProcessGroup | None, split: bool = False) -> str | None:
    """[Note: the same verdict] Every rank's verdict, one all_gather_object, and the lowest rank's problem for all
    (naming that rank where the others saw none): a folder one rank cannot read (another node's file system)
    stops every rank before any collective of DCP's, where a rank that went on would wait for the one that
    raised. The checks after DCP's first read need no such round: every rank read the same things. ``split``: each
    rank checked a share of its own (checksums.py), so a problem seen by one rank alone is said as it is."""
    verdicts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, problem, group=group)
    first = next((rank for rank, verdict in enumerate(verdicts) if verdict), None)
    if first is None:
        return None
    alone = not split and any(verdict is None for verdict in verdicts)
    return verdicts[first] + (f" (seen by rank {first} of the group, not by every rank)" if alone else "")


def read_folder(path: str) -> tuple[Metadata | None, str | None]:
    """The checkpoint's metadata, or what makes the folder not one: no folder, no .metadata (torn if data files
    are there), a .metadata that does not unpickle, a data file it names missing or shorter than it says."""
    if not os.path.isdir(path):
        return None, "no such folder" if not os.path.exists(path) else "not a folder"
    if not os.path.isfile(os.path.join(path, ".metadata")):
        if any(name.endswith(".distcp") for name in os.listdir(path)):
            return None, "torn: its .metadata is missing (a save that did not finish?)"
        return None, "not a torch.distributed.checkpoint folder (no .metadata)"
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:  # noqa: BLE001 - any unpickling failure is a torn file
        return None, f"torn: its .metadata cannot be read ({one_line(error)})"
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        return None, "torn: its .metadata is not DCP's Metadata"
    if not isinstance(metadata.planner_data, dict):
        return None, "not a checkpoint of nested state dicts (DCP's flattening left no planner_data)"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return None, f"torn: data file {name} named by its .metadata is missing"
        if os.path.getsize(file) < size:
            return None, f"torn: data file {name} is {os.path.getsize(file)} bytes, its .metadata needs {size}"
    return metadata, None


def listed(names: Iterable[str], most: int = 3) -> str:
    names = sorted(names)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def model_problem(metadata: Metadata, model: nn.Module) -> str | None:
    """Another model: missing or unexpected keys, or another shape."""
    paths = {key: metadata.planner_data.get(key, (key,)) for key in metadata.state_dict_metadata}
    saved = {".".join(map(str, path[1:])): metadata.state_dict_metadata[key]
             for key, path in paths.items() if path[0] == "model"}
    ours = {name: tuple(value.shape) for name, value in model.state_dict(keep_vars=True).items()}
    missing, unexpected = set(ours) - set(saved), set(saved) - set(ours)
    if missing or unexpected:
        return ("another model: " + "; ".join(
            ([f"it lacks {listed(missing)} ({len(missing)} of this model's keys)"] if missing else []) +
            ([f"it holds {listed(unexpected)}, which this model has not"] if unexpected else [])))
    for name, shape in ours.items():
        md = saved[name]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != shape:
            theirs = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
            return f"another model: {name} is {theirs} there, {shape} here"
    return None


def saved_optimizer(metadata: Metadata) -> tuple[dict[str, dict[str, Any]], int, list[str]]:
    """The optimizer part's layout from the metadata alone: {name: {key: storage metadata}}, the number of
    parameter groups, and the paths that fit neither."""
    state: dict[str, dict[str, Any]] = {}
    groups, odd = 0, []
    for key, md in metadata.state_dict_metadata.items():
        path = metadata.planner_data.get(key, (key,))
        if path[0] != "optimizer":
            continue
        if len(path) == 4 and path[1] == "state":
            state.setdefault(path[2], {})[path[3]] = md
        elif len(path) >= 4 and path[1] == "param_groups" and isinstance(path[2], int):
            groups = max(groups, path[2] + 1)
        else:
            odd.append(key)
    return state, groups, odd


def parameter_kinds(slots_: list[Slot]) -> dict[str, dict[str, bool]]:
    """Each parameter's state_kinds by name (the keys its optimizer keeps with its group's settings, and which are
    element-wise), probed once per group and, for Muon and Adafactor, per number of dimensions (Adafactor keeps a
    vector's variance and a matrix's row_var and col_var). A sharded Muon or Adafactor is asked as torch's class."""
    probed: dict[tuple[int, int, int], dict[str, bool]] = {}
    kinds = {}
    for slot in slots_:
        dim = max(slot.param.dim(), 1) if slot.torch_class in PROBE_DIMS else 1
        where = (id(slot.optimizer), slot.group, dim)
        if where not in probed:
            settings = {k: v for k, v in slot.optimizer.param_groups[slot.group].items() if k != "params"}
            probed[where] = state_kinds(slot.torch_class, settings, slot.param.device, dim)
        kinds[slot.name] = probed[where]
    return kinds


def optimizer_problem(metadata: Metadata, slots_: list[Slot], kinds: dict[str, dict[str, bool]],
                      group_count: int, sharded_optimizer: bool, stepped: bool = False) -> str | None:
    """An optimizer state of another kind, from the metadata: keys not the ones the optimizer keeps, element-wise
    state of another shape, state of parameters it does not step, another number of parameter groups; at stages
    1-3 also a group with state for some parameters and not others (a run steps a group's parameters together);
    with ``stepped``, a parameter without state."""
    state, groups, odd = saved_optimizer(metadata)
    if not state and not groups:
        return "it holds no optimizer state (saved without an optimizer)"
    if odd:
        return f"its optimizer part holds {listed(odd)}, which is not torch.optim's state layout"
    ours = {slot.name: slot for slot in slots_}
    strangers = set(state) - set(ours)
    if strangers:
        return f"its optimizer state holds {listed(strangers)}, which these optimizers do not step"
    stateless = [slot.name for slot in slots_ if slot.name not in state and kinds[slot.name]]  # (SGD without
    # momentum keeps nothing)
    if stepped and stateless:
        return (f"its optimizer state is incomplete: {listed(stateless)} ({len(stateless)} of {len(slots_)} "
                f"parameters) have none, and the run that saved it had stepped every parameter")
    for slot in slots_:
        saved = state.get(slot.name)
        if saved is None:
            continue
        keeps = kinds[slot.name]
        if set(saved) != set(keeps):
            return (f"an optimizer state of another kind: {slot.name} holds {sorted(saved)}, and "
                    f"torch.optim.{slot.torch_class.__name__} with "
                    f"these settings keeps {sorted(keeps)}")
        for key, elementwise in keeps.items():
            md = saved[key]
            if elementwise and (not isinstance(md, TensorStorageMetadata)
                                or tuple(md.size) != tuple(slot.param.shape)):
                theirs = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
                return (f"the optimizer state's {key!r} of {slot.name} is {theirs}, the parameter "
                        f"{tuple(slot.param.shape)}")
    if groups != group_count:
        return f"its optimizer state has {groups} parameter groups, these optimizers {group_count}"
    if sharded_optimizer:
        members_of: dict[tuple[int, int], list[str]] = {}
        for slot in slots_:
            members_of.setdefault((id(slot.optimizer), slot.group), []).append(slot.name)
        for members in members_of.values():
            having = [name for name in members if name in state]
            if having and len(having) != len(members):
                lacking = next(name for name in members if name not in state)
                return (f"{having[0]} has optimizer state and {lacking}, in the same parameter group, has none; a "
                        f"sharded optimizer steps a group's parameters together")
    return None


def groups_problem(saved_groups: list[dict[str, Any]], slots_: list[Slot],
                   optimizers: list[torch.optim.Optimizer]) -> tuple[list[int], str | None]:
    """Which saved group each of ours is (by the names of its parameters, as set_state_dict matches them), or the
    group that has none."""
    matched = []
    for optimizer in optimizers:
        for g in range(len(optimizer.param_groups)):
            names = {slot.name for slot in slots_ if slot.optimizer is optimizer and slot.group == g}
            same = [j for j, group in enumerate(saved_groups) if set(group.get("params", [])) == names]
            if not same:
                first = next(iter(sorted(names)), "none")
                return [], (f"another parameter grouping: this optimizer's group {g} ({len(names)} parameters, "
                            f"{first} among them) is none of the checkpoint's groups")
            matched.append(same[0])
    return matched, None


def scalars_problem(small: dict[str, Any], slots_: list[Slot], kinds: dict[str, dict[str, bool]]) -> str | None:
    """At stages 1-3 a run steps a group's parameters together, with one step count: the saved scalars of a
    group's parameters must agree."""
    state = small.get("optimizer", {}).get("state", {})
    first: dict[tuple[int, int], str] = {}
    for slot in slots_:
        entry = state.get(slot.name)
        if not entry:
            continue
        where = (id(slot.optimizer), slot.group)
        if where not in first:
            first[where] = slot.name
            continue
        other = state[first[where]]
        for key, value in entry.items():
            theirs = other.get(key)
            if kinds[slot.name].get(key, True):  # element-wise (a 0-dim parameter's is 0-dim too): not a scalar
                continue
            same = torch.equal(value, theirs) if torch.is_tensor(value) and torch.is_tensor(theirs) else value == theirs
            if not same:
                return (f"in one parameter group, {slot.name}'s {key!r} is {value}, {first[where]}'s {theirs}: a "
                        f"sharded optimizer steps a group's parameters together, with one {key!r}")
    return None
