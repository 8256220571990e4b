"""A sharded optimizer's runs (ShardRun, Layout: how one optimizer maps onto the model's flat shards), and its state
in torch.optim's ordinary form and back: the hooks ``optimizer()`` registers (StateDicts, which zero/optimizer.py's
ShardedOptimizer is), and the checks a loaded state passes first.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from zero.buckets import Bucket
from zero.optimizer_kinds import missing_optimizer_state, state_kinds
from zero.pieces import Cover


@dataclass
class ShardRun:
    """A run: a stretch of one bucket's elements, inside this rank's chunk, whose parameters are all in one parameter
    group: one tensor of the optimizer (``param``, a view of the weights' shard, its .grad a view of the gradient's
    shard). Flat element indices [start, end); ``covers``: the parameters it covers (zero/pieces.py), the one
    translation from runs to parameters that the state dicts and the checkpoints use."""
    bucket: Bucket
    start: int
    end: int
    group: int
    param: nn.Parameter | None = None
    covers: list[Cover] = field(default_factory=list)


@dataclass
class Layout:
    """How one sharded optimizer maps onto the model: each model parameter's group and index in torch.optim's
    ordinary numbering (group by group), the full groups, this rank's runs in the inner optimizer's order (for a
    whole-matrix optimizer, ``per_parameter``: a run never crosses a parameter's boundary, it is a piece), and the
    buckets holding its parameters (on any rank's chunk)."""
    index: dict[int, tuple[int, int]]  # id(model parameter) -> (group, index)
    groups: list[list[int]]  # the indices in each group
    torch_class: type[torch.optim.Optimizer]  # the class asked for (Muon, Adafactor: stepped by zero/matrix.py)
    runs: list[ShardRun] = field(default_factory=list)
    per_parameter: bool = False
    buckets: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ElementWise:
    """Marks, while the state dict is gathered, a key whose value is one number per element (gathered by bucket)."""
    dtype: torch.dtype


def _own_copy(value: Any) -> Any:
    """A state value of its own: a plain optimizer adds to its step count in place, so none may be shared."""
    return value.clone() if torch.is_tensor(value) else copy.deepcopy(value)


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else a == b


def check_groups_agree(layout: Layout, saved: dict[int, dict[str, Any]], shapes: dict[int, torch.Size],
                       elementwise: Callable[[int, str], bool]) -> None:
    """A saved state's parameter groups, refused in one line unless a run can carry them: every parameter of a group
    with an entry or none, the same keys and scalars (a whole-matrix optimizer's entries stand alone), and each
    element-wise tensor in its parameter's shape. The same verdict on every rank, whichever runs it holds."""
    for g, indices in enumerate(layout.groups):
        with_state = [index for index in indices if index in saved]
        if not with_state:
            continue
        if layout.per_parameter:
            for index in with_state:
                check_shapes(saved[index], index, shapes[index], elementwise)
            continue
        first = saved[with_state[0]]
        for index in indices:
            other = saved.get(index)
            differs = ("has no state" if other is None else "holds other keys" if other.keys() != first.keys()
                       else "has other scalars (step counts)" if any(not _same(other[key], value)
                                                             for key, value in first.items()
                                                             if not elementwise(index, key)) else None)
            if differs:
                raise ValueError(f"the optimizer state cannot be loaded: in parameter group {g}, parameter "
                                 f"{index} {differs}, unlike parameter {with_state[0]}; a sharded optimizer "
                                 f"steps a group's parameters together (in runs across their boundaries)")
            check_shapes(other, index, shapes[index], elementwise)


def check_shapes(entry: dict[str, Any], index: int, shape: torch.Size,
                 elementwise: Callable[[int, str], bool]) -> None:
    """Parameter ``index``'s saved element-wise tensors each in its shape, or refused in one line."""
    for key, value in entry.items():
        if elementwise(index, key) and tuple(value.shape) != tuple(shape):
            raise ValueError(f"the optimizer state's {key!r} of parameter {index} is "
                             f"{tuple(value.shape)}, the parameter {tuple(shape)}")


class StateDicts:
    """The state-dict hooks of a sharded optimizer (zero/optimizer.py's ShardedOptimizer, whose attributes they
    read: ``layouts``, ``streamed``, ``buckets``, ``comm``, ``rank``, ``world_size``, ``device``, ``loading_runs``,
    ``chunk_bounds`` and ``settle``).

    [Note: the whole model's state] ``optimizer.state_dict()`` is torch.optim's ordinary form, over the model's
    parameters numbered group by group as an unsharded optimizer built with the same groups numbers them: a hook
    gathers each bucket's state to the group's rank 0 one bucket and key at a time (others get {}), and
    ``load_state_dict`` cuts this rank's runs out of such a dict. So any stage at any world size loads any other's.
    Whatever the optimizer keeps (element-wise tensors only, like SGD's momentum; scalars only; both; nothing yet),
    a parameter has an entry exactly when an unsharded optimizer would: when its runs have state.
    """

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend(self.comm.group) == "nccl" else torch.device("cpu")

    def _full_optimizer_state(self, optimizer: torch.optim.Optimizer, inner: dict[str, Any]) -> dict[str, Any]:
        """State-dict post-hook: the inner optimizer's state over runs, made torch.optim's ordinary state over the
        model's parameters, on the group's rank 0 (the others get {}). A parameter has an entry when the runs
        covering it have state (whatever that state holds: SGD's momentum alone, AdamW's step and moments, a
        scalar alone); its scalars, and the tensors it keeps whole (Adafactor's row_var and col_var, held whole by
        every rank with a piece of the matrix, alike), are the first such run's (every run of a parameter has the
        same), its element-wise tensors (a run's are 1-D) are gathered one bucket and key at a time."""
        layout = self.layouts[optimizer]
        entries: dict[int, dict[str, Any]] = {}  # parameter index -> {key: scalar value, or its dtype if element-wise}
        for number, run in enumerate(layout.runs):
            values = inner["state"].get(number, {})
            offloaded = self.streamed.keys.get((self.streamed.numbers[id(optimizer)], number), {}) \
                if self.streamed is not None else {}
            if not values and not offloaded:  # no state yet: created lazily, at the first step
                continue
            for p in (cover.param for cover in run.covers):
                entry = entries.setdefault(layout.index[id(p)][1], {})
                entry.update((key, ElementWise(dtype)) for key, dtype in offloaded.items())
                for key, value in values.items():
                    if torch.is_tensor(value) and value.dim() == 1:  # a run's element-wise state is 1-D
                        entry[key] = ElementWise(value.dtype)
                    elif key not in entry:  # a scalar; or a whole factored statistic (>= 2-D): to the CPU
                        entry[key] = value.detach().cpu().clone() if torch.is_tensor(value) and value.dim() > 1 \
                            else _own_copy(value)
        shared: list[Any] = [None] * self.world_size  # every rank's, so all know every entry and key
        dist.all_gather_object(shared, entries, group=self.comm.group)
        for theirs in shared:
            for index, values in theirs.items():
                entries.setdefault(index, {}).update({k: v for k, v in values.items() if k not in entries[index]})
        state = {index: {key: value for key, value in values.items() if not isinstance(value, ElementWise)}
                 for index, values in sorted(entries.items())}
        device = self._comm_device()
        for b in layout.buckets:
            bucket = self.buckets[b]
            lo, hi = self.chunk_bounds(bucket)
            runs = [(number, run) for number, run in enumerate(layout.runs) if run.bucket is bucket]
            indices = {id(p): layout.index[id(p)][1] for p in bucket.params if id(p) in layout.index}
            keys = {key: kind.dtype for index in indices.values() for key, kind in entries.get(index, {}).items()
                    if isinstance(kind, ElementWise)}
            for key, dtype in sorted(keys.items()):  # the same buckets and keys, in the same order, on every rank
                if self.streamed is not None:  # the chunk as the store keeps it (zeros where no run has the key)
                    chunk = self.streamed.state_chunk(optimizer, b, key, hi - lo, dtype, device)
                else:
                    chunk = torch.zeros(hi - lo, dtype=dtype, device=device)
                    for number, run in runs:
                        if key in inner["state"].get(number, {}):
                            chunk[run.start - lo:run.end - lo] = inner["state"][number][key]
                pieces = [torch.empty_like(chunk) for _ in range(self.world_size)] if self.rank == 0 else None
                dist.gather(chunk, pieces, group=self.comm.group, group_dst=0)
                if self.streamed is not None:
                    self.streamed.store.discard(chunk)
                if self.rank != 0:
                    continue
                flat = torch.cat(pieces).cpu()
                for p in bucket.params:
                    if key in entries.get(indices.get(id(p)), {}):
                        state[indices[id(p)]][key] = bucket.view(flat, p).clone()  # its own storage
        if self.rank != 0:
            return {}
        groups = [{**group, "params": list(layout.groups[g])} for g, group in enumerate(inner["param_groups"])]
        return {"state": state, "param_groups": groups}

    def load_run_state(self, optimizer: torch.optim.Optimizer, inner: dict[str, Any]) -> None:
        """torch.optim's own load_state_dict of the runs' state as it stands, past the pre-hook that would cut runs
        out of a whole state dict: ``inner`` is the inner optimizer's form (state by run number, the runs numbered
        group by group as ``layouts[optimizer].runs``), which zero/checkpoint/ reads straight from its shards."""
        if self.streamed is not None:  # the element-wise tensors into the store, bucket by bucket
            inner = self.streamed.load_runs(optimizer, inner)
        self.loading_runs.add(id(optimizer))
        try:
            optimizer.load_state_dict(inner)
        finally:
            self.loading_runs.discard(id(optimizer))

    def _sharded_optimizer_state(self, optimizer: torch.optim.Optimizer,
                                 full: dict[str, Any]) -> dict[str, Any] | None:
        """Load pre-hook: this rank's runs cut out of a state dict in torch.optim's ordinary form (every rank
        passes the same). Which keys are element-wise is asked of the optimizer itself (``state_kinds``, per
        group, and for a whole-matrix optimizer per parameter dimension), not guessed from shapes: a 0-dim
        parameter's moment and a step count look alike. A run steps its parameters together and may cross any
        boundary within a group, so a group's parameters must agree: all with an entry or none, the same keys and
        scalars (a whole-matrix optimizer's runs are pieces of one parameter: there each entry stands alone);
        anything else, or an entry without a key the optimizer keeps, is refused in one line (the same on every
        rank) rather than loaded as another state. Tensors kept whole (Adafactor's row_var, col_var) go whole to
        every piece of their parameter. The runs' own form (load_run_state) passes as it is."""
        if id(optimizer) in self.loading_runs:
            return None
        self.settle()
        layout = self.layouts[optimizer]
        sizes = [len(group["params"]) for group in full["param_groups"]]
        if sizes != [len(indices) for indices in layout.groups]:
            raise ValueError(f"the optimizer state has parameter groups of {sizes} parameters; this optimizer's "
                             f"are of {[len(indices) for indices in layout.groups]}")
        shapes = {layout.index[id(p)][1]: p.shape for b in self.buckets for p in b.params if id(p) in layout.index}
        kinds = self._probed_kinds(optimizer, full, shapes)
        problem = missing_optimizer_state(layout.torch_class, full, every_parameter=False, kinds=kinds)
        if problem:
            raise ValueError(f"the optimizer state cannot be loaded: {problem}")
        saved = {int(index): values for index, values in full["state"].items()}

        def elementwise(index: int, key: str) -> bool:
            known = kinds(index).get(key)
            if known is not None:
                return known
            value = saved[index][key]  # a key the probe did not show: by its shape
            return torch.is_tensor(value) and value.dim() > 0 and value.shape == shapes[index]

        check_groups_agree(layout, saved, shapes, elementwise)
        state = self._cut_into_runs(layout, saved, elementwise)
        if self.streamed is not None:  # the element-wise tensors into the store, bucket by bucket
            state = self.streamed.load_runs(optimizer, {"state": state})["state"]
        inner_index = {id(run): number for number, run in enumerate(layout.runs)}
        groups = [{**group, "params": [inner_index[id(run)] for run in layout.runs if run.group == g]}
                  for g, group in enumerate(full["param_groups"])]
        return {"state": state, "param_groups": groups}

    def _probed_kinds(self, optimizer: torch.optim.Optimizer, full: dict[str, Any],
                      shapes: dict[int, torch.Size]) -> Callable[[int], dict[str, bool]]:
        """Parameter index -> {key: whether it is element-wise}, as ``state_kinds`` probes the optimizer with the
        saved group's settings: once per group (and for a whole-matrix optimizer per parameter dimension)."""
        layout = self.layouts[optimizer]
        group_of = {index: g for g, index in layout.index.values()}
        probed: dict[tuple[int, int], dict[str, bool]] = {}

        def kinds(index: int) -> dict[str, bool]:
            g, dim = group_of[index], max(len(shapes[index]), 1) if layout.per_parameter else 1
            if (g, dim) not in probed:
                probed[g, dim] = state_kinds(layout.torch_class,
                                             {**optimizer.param_groups[g], **full["param_groups"][g]},
                                             self.device, dim)
            return probed[g, dim]

        return kinds

    def _cut_into_runs(self, layout: Layout, saved: dict[int, dict[str, Any]],
                       elementwise: Callable[[int, str], bool]) -> dict[int, dict[str, Any]]:
        """The inner optimizer's state, by run number: each element-wise key laid out in its bucket's flat (one
        bucket and key at a time) and cut at this rank's runs; the scalars and whole tensors, a run's first
        parameter's."""
        state: dict[int, dict[str, Any]] = {}
        for b in sorted({run.bucket.index for run in layout.runs}):
            bucket = self.buckets[b]
            runs = [(number, run) for number, run in enumerate(layout.runs) if run.bucket is bucket]
            indices = {id(p): layout.index[id(p)][1] for p in bucket.params if id(p) in layout.index}
            keys = {key: saved[index][key].dtype for index in indices.values() for key in saved.get(index, {})
                    if elementwise(index, key)}
            for key, dtype in sorted(keys.items()):
                flat = torch.zeros(bucket.length, dtype=dtype)
                for p in bucket.params:
                    entry = saved.get(indices.get(id(p)), {})
                    if key in entry:
                        bucket.view(flat, p).copy_(entry[key])
                for number, run in runs:  # (a group's parameters hold the same keys, but a piece is its own)
                    if key in saved.get(indices[id(run.covers[0].param)], {}):
                        state.setdefault(number, {})[key] = flat[run.start:run.end].clone()
            for number, run in runs:  # the scalars: the run's first parameter's (its group's agree)
                index = indices[id(run.covers[0].param)]
                for key, value in saved.get(index, {}).items():
                    if not elementwise(index, key):
                        state.setdefault(number, {})[key] = _own_copy(value)
        return state
