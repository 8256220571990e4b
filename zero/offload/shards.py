"""What a sharded stage keeps in its offload store (``zero.shard(..., offload="disk", offload_dir=PATH)``), and the
optimizer's step streamed through it one bucket at a time.

What moves (Psi parameters, W ranks, AdamW; zero/api.py's table): at stages 1 and 2 the optimizer's state (8 Psi / W
bytes), which only the step reads; at stage 3 the master weights' and the gradients' shards too (4 Psi / W each),
which the forward, the backward and the step read unit by unit. The weights kept whole at stages 1-2, and stage 3's
gathered units, stay in memory: they are what the compute reads, and the forward and backward read them whole.

[Note: only the storage moves] Every tensor the arithmetic touches is the in-memory run's, element for element: the
same runs (zero/optimizer_state.py's ShardRun: a bucket's chunk cut at its parameter groups), stepped by torch.optim's
own step over the same tensors' values, in the same order of operations, so the weights are bit for bit the in-memory
run's. What changes is where each tensor lives between its uses, and when the step runs over which runs: the step is
run one bucket at a time (``Streamed.step``), with each parameter group's ``params`` narrowed to that bucket's runs,
and every torch.optim step treats its parameters one by one on the CPU (its for-loop implementation) or elementwise in
a multi-tensor kernel on a GPU: either way an element's update reads only that element's weight, gradient and state,
and the scalars of its parameter (its step count), which stay in memory. So stepping bucket by bucket steps each
element exactly as stepping all at once does. The gradient clipping's norm is each bucket's norm, the same tensors'
``vector_norm``, taken when a bucket's gradient of the window is complete (``Gradients.add``), and its scale is
multiplied into each gradient shard when the step reads it, as ``torch._foreach_mul_`` would have multiplied it in
place: one rounding, the same one. A whole-matrix optimizer (Muon, Adafactor: zero/matrix.py) is stepped a bucket's
parameters at a time with that bucket's own collectives (``step_bucket``), on every rank for every bucket of its
parameters, piece or none; its step in memory goes bucket by bucket too, so it sums in the same pieces.

[Note: placeholders] Between its uses an offloaded tensor is a placeholder, never a tensor whose memory is gone: the
stage's own lists (``weights[b]``, ``grads[b]``) hold meta tensors (a read raises "meta tensor" rather than reading
freed memory), and each run's parameter, which torch.optim holds and whose ``.data`` can only be swapped for a tensor
of its own device, is a NaN of the right length (one element, expanded: a read gives NaN, an in-place write is
refused, and it costs one element). The step puts the real tensors in place for a bucket and the placeholders back
after it (``Streamed._bind``, ``_unbind``). The optimizer's element-wise state (AdamW's moments) is not in
``optimizer.state`` between steps at all: its scalars (the step count) are, and ``Streamed.keys`` says which
element-wise keys each run has in the store; ``optimizer.state_dict()`` reads them from there (zero/optimizer_state.py).

[Note: the order of the reads] The step reads each bucket's tensors ahead of their use: while bucket i is stepped,
bucket i+1's are being read; the writes of bucket i go behind while bucket i+1 steps. The forward and backward of
stage 3 read a unit's weight shard two units ahead of its gather (zero/stage3.py's ``_read_ahead``).

[Note: the step just in time] At stages 1-2 a step is streamed at once, bucket after bucket: its reads and writes are
the disk's alone (the state, 16 Psi / W bytes a rank for AdamW), with only the step's own arithmetic to hide behind.
At stage 3 that is the whole state (the weights and gradients too: 28 Psi / W), and nothing computes meanwhile: at
GPT-2 large's shape the step waited 11 s of its 42 on the disk. So at stage 3 ``step()`` records the step, with each
parameter group's hyperparameters as they are then (a scheduler's next rate must not reach it), and each unit's part
of it is taken just before the unit's next gather (``settle``, from zero/stage3.py's ``shard_values``): its reads
are asked two units ahead, with the gather's, so they overlap the next forward's compute; the weights it steps are
the ones that unit's gather sends, so they are not read back; and zero_grad() lets a gradient go only once the step
has read it. The arithmetic is the same, on the same values, only later; whatever reads the state, the weights or
the gradients other than the next forward (the state dicts, a checkpoint, clipping, close(), another step() first)
takes every pending step first (``settle_all``). A unit no forward uses waits for that.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
import torch.nn as nn

from zero.matrix import PieceOptimizer
from zero.offload.folder import reserve
from zero.offload.gradients import Gradients
from zero.offload.store import Store
from zero.optimizer_kinds import state_kinds


def meta_like(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The stage's placeholder for an offloaded shard: its length and dtype, no memory ([Note: placeholders])."""
    return torch.empty(numel, dtype=dtype, device="meta")


def nan_like(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A run parameter's placeholder: one NaN seen ``numel`` times ([Note: placeholders])."""
    return torch.full((1,), float("nan"), dtype=dtype, device=device).expand(numel)


def unhooked_step(optimizer_class: type[torch.optim.Optimizer]) -> Callable[..., Any]:
    """The class's own step, without torch.optim's hooks (``Optimizer.profile_hook_step`` wraps it once an instance
    of the class exists, and records the wrapped function as ``__wrapped__``): the streamed step runs it once per
    bucket, inside the one hooked step() the caller made, so the hooks run once per step, as ever."""
    step = optimizer_class.step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def offloaded_class(optimizer_class: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``optimizer_class`` whose step() streams its state through the store one bucket at a time, and whose
    zero_grad() tells the store that the gradients are let go of (zero/stage3.py's gradient shards). An instance
    is an ``optimizer_class`` (isinstance, its name, its hyperparameters, LR schedulers, state dicts: all its own)."""
    cached = OFFLOADED.get(optimizer_class)
    if cached is not None:
        return cached

    def step(self: Any, closure: Any = None) -> Any:
        return self.streamed.step(self, closure, unhooked_step(optimizer_class))

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        optimizer_class.zero_grad(self, set_to_none)
        self.streamed.gradients_let_go(self, set_to_none)

    cls = types.new_class(optimizer_class.__name__, (optimizer_class,),
                          exec_body=lambda ns: ns.update(step=step, zero_grad=zero_grad, __module__=__name__))
    cls.__qualname__ = f"offloaded {optimizer_class.__qualname__}"
    OFFLOADED[optimizer_class] = cls
    return cls


OFFLOADED: dict[type[torch.optim.Optimizer], type[torch.optim.Optimizer]] = {}


@dataclass
class Pending:
    """A step() of ``optimizer`` not yet taken on some bucket: its parameter groups' hyperparameters when step() was
    called (``settings``; None: now), and the class's own step."""
    optimizer: torch.optim.Optimizer
    settings: list[dict[str, Any]] | None
    own_step: Callable[..., Any]


class StoredState:
    """What zero.checkpoint reads of an offloaded optimizer's element-wise state (its OptimizerView's ``stored``):
    where each run's keys are in the store, to save them, and where a load is to put them."""

    def __init__(self, streamed: Streamed, optimizer: torch.optim.Optimizer):
        self.streamed, self.optimizer = streamed, optimizer

    def held(self, number: int) -> dict[str, tuple[torch.Tensor, Hashable]]:
        """Run ``number``'s element-wise keys in the store: {key: (meta tensor over the run, slot)}."""
        keys = self.streamed.keys.get((self.streamed.numbers[id(self.optimizer)], number), {})
        return {key: self.streamed.run_range(self.optimizer, number, key, dtype) for key, dtype in keys.items()}

    def destination(self, number: int, key: str) -> tuple[torch.Tensor, Hashable]:
        """Where a load puts run ``number``'s ``key``: its stretch of a slot in the run's dtype (torch.optim's load
        casts a floating state to its parameter's), made if it is not there."""
        run = self.streamed.shards.layouts[self.optimizer].runs[number]
        lo, hi = self.streamed.shards.chunk_bounds(run.bucket)
        meta, name = self.streamed.run_range(self.optimizer, number, key, run.param.dtype)
        self.streamed.store.ensure(name, hi - lo, run.param.dtype)
        return meta, name


class Streamed:
    """The optimizer side of offload: each optimizer's element-wise state in the store, bucket by bucket (one slot
    ("state", optimizer number, bucket, key) per bucket chunk and key, each run's state a view of its stretch, the
    stretches no run of that optimizer covers zeros), and the step streamed over the buckets ([Note: only the
    storage moves]). ``stage`` is the stage's ShardedOptimizer (zero/optimizer.py): its buckets, chunk bounds,
    layouts, weights and gradients; at stage 3 the weights and gradients come from the store too."""

    def __init__(self, store: Store, shards: Any, gradients: Gradients | None):
        self.store, self.shards = store, shards
        self.weights_offloaded = gradients is not None  # stage 3: the weights' and gradients' shards in the store
        self.gradients = gradients
        self.numbers: dict[int, int] = {}  # id(optimizer) -> its number, in the order sharded.optimizer built them
        self.keys: dict[tuple[int, int], dict[str, torch.dtype]] = {}  # (optimizer number, run number) -> keys
        self.let_go: dict[int, set[int]] = {}  # bucket -> numbers of the optimizers whose zero_grad let it go
        self.pending: dict[int, list[Pending]] = {}  # stage 3: bucket -> the steps it is still to take, in order
        self.let_go_later: dict[int, bool] = {}  # bucket -> its gradient to let go of (as zeros?) once stepped

    # ------------------------------------------------------------------------------------------------------
    # An optimizer joins
    # ------------------------------------------------------------------------------------------------------
    def run_parameter(self, run: Any, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
        """A run's parameter for the inner optimizer: at stage 3 a placeholder ([Note: placeholders])."""
        return nn.Parameter(nan_like(run.end - run.start, dtype, device))

    def adopt(self, optimizer: torch.optim.Optimizer, layout: Any) -> None:
        """A new optimizer of the stage's: numbered; the slots of the state its first step will make reserved now
        (the keys each parameter group's settings make it keep: ``state_kinds``' probe), the disk's room checked
        over the group first (zero/offload/folder.py); whatever element-wise state its constructor made (Adagrad's
        sums) moved into the store at once."""
        optimizer.streamed = self
        number = self.numbers[id(optimizer)] = len(self.numbers)
        probed: dict[tuple[int, int], list[str]] = {}

        def keys(run: Any) -> list[str]:  # a whole-matrix optimizer's keys follow its parameter's dimensions
            dim = max(run.covers[0].param.dim(), 1) if layout.per_parameter else 1
            if (run.group, dim) not in probed:
                probed[run.group, dim] = [key for key, elementwise in state_kinds(
                    layout.torch_class, optimizer.param_groups[run.group], self.shards.device, dim).items()
                    if elementwise]
            return probed[run.group, dim]

        slots = {}
        for b, runs in self._by_bucket(layout).items():
            lo, hi = self.shards.chunk_bounds(self.shards.buckets[b])
            for _, run in runs:
                slots.update((("state", number, b, key), (hi - lo, run.param.dtype)) for key in keys(run))
        need = sum(numel * dtype.itemsize for numel, dtype in slots.values())
        reserve(self.store, self.shards.comm.group, need, f"{layout.torch_class.__name__}'s state",
                lambda: [self.store.ensure(name, numel, dtype) for name, (numel, dtype) in slots.items()])
        for b, runs in self._by_bucket(layout).items():
            self._keep_state(optimizer, number, b, runs, {})

    # ------------------------------------------------------------------------------------------------------
    # The step, one bucket at a time
    # ------------------------------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, closure: Any, own_step: Callable[..., Any]) -> Any:
        """torch.optim's step of ``optimizer``, one bucket's runs at a time: now, each bucket's tensors read ahead and
        written behind (stages 1-2), or at stage 3 each bucket's just before its next use ([Note: the step just in
        time]). A closure is evaluated first, as torch.optim's optimizers do (it computes the gradients the step
        then reads); a step still pending from before goes first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.settle_all()
        layout = self.shards.layouts[optimizer]
        by_bucket = self._by_bucket(layout)
        pieces = isinstance(optimizer, PieceOptimizer)
        if pieces and not optimizer.gradients_attached:  # a step between zero_grad() and a forward: none
            return loss
        # a whole-matrix optimizer's step has collectives: every rank steps every bucket of its parameters
        order = [b for b in layout.buckets if pieces or b in by_bucket]
        if self.weights_offloaded:  # stage 3: recorded, with the hyperparameters as they are now
            settings = [{key: value.clone() if torch.is_tensor(value) else value for key, value in group.items()
                         if key != "params"} for group in optimizer.param_groups]
            for b in order:
                self.pending.setdefault(b, []).append(Pending(optimizer, settings, own_step))
            return loss
        number = self.numbers[id(optimizer)]
        if order:
            self._read_ahead(number, order[0], by_bucket.get(order[0], []))
        for i, b in enumerate(order):
            if i + 1 < len(order):
                self._read_ahead(number, order[i + 1], by_bucket.get(order[i + 1], []))
            self._step_bucket(Pending(optimizer, None, own_step), b, by_bucket.get(b, []))
        return loss

    def _step_bucket(self, pending: Pending, b: int, runs: list[tuple[int, Any]],
                     weights: torch.Tensor | None = None) -> torch.Tensor | None:
        """torch.optim's own step of ``pending.optimizer`` over bucket ``b``'s runs alone (each parameter group's
        ``params`` narrowed to them, its hyperparameters those of ``pending``'s step() where recorded): the
        tensors bound, stepped, and written behind. At stage 3 the weights are given (``weights``: the shard, from
        another optimizer's step of the same bucket) or read, and returned unwritten: the caller puts them."""
        optimizer = pending.optimizer
        number = self.numbers[id(optimizer)]
        held = self._bind(optimizer, number, b, runs, weights)
        everything = [group["params"] for group in optimizer.param_groups]
        now = [{key: group[key] for key in settings} for group, settings in
               zip(optimizer.param_groups, pending.settings or [{}] * len(everything))]
        try:
            for g, group in enumerate(optimizer.param_groups):
                group["params"] = [run.param for _, run in runs if run.group == g]
                group.update(pending.settings[g] if pending.settings else {})
            if isinstance(optimizer, PieceOptimizer):
                optimizer.step_bucket(b)  # (it steps its pieces in the bucket, whatever the groups' params)
            else:
                pending.own_step(optimizer)
        finally:
            for group, params, values in zip(optimizer.param_groups, everything, now):
                group.update(values, params=params)
        return self._unbind(optimizer, number, b, runs, held)

    # ------------------------------------------------------------------------------------------------------
    # [Note: the step just in time]
    # ------------------------------------------------------------------------------------------------------
    def settle(self, b: int) -> torch.Tensor | None:
        """Bucket ``b``'s pending steps taken now, in the order of their step() calls (stage 3, before its weights
        are read); its gradient let go of after them where zero_grad() asked meanwhile. Returns its weight shard,
        stepped and not yet written (the caller reads it, then puts it), or None where nothing was pending."""
        entries = self.pending.pop(b, None)
        if not entries:
            return None
        weights = None
        for pending in entries:
            runs = self._by_bucket(self.shards.layouts[pending.optimizer]).get(b, [])
            weights = self._step_bucket(pending, b, runs, weights)
        if b in self.let_go_later:
            self._let_go(b, zeros=self.let_go_later.pop(b))
        return weights

    def settle_all(self) -> None:
        """Every pending step taken (before anything reads the optimizer's state, the weights, or steps again)."""
        for b in sorted(self.pending):
            weights = self.settle(b)
            if weights is not None:
                self.store.put(("weights", b), weights)

    def read_pending_ahead(self, b: int) -> None:
        """The slots bucket ``b``'s pending steps read, asked of the store ahead of them."""
        for pending in self.pending.get(b, []):
            layout = self.shards.layouts[pending.optimizer]
            self._read_ahead(self.numbers[id(pending.optimizer)], b, self._by_bucket(layout).get(b, []))

    def _by_bucket(self, layout: Any) -> dict[int, list[tuple[int, Any]]]:
        """The optimizer's runs (with their numbers) by bucket."""
        found: dict[int, list[tuple[int, Any]]] = {}
        for number, run in enumerate(layout.runs):
            found.setdefault(run.bucket.index, []).append((number, run))
        return found

    def _state_names(self, number: int, b: int, runs: list[tuple[int, Any]]) -> dict[str, torch.dtype]:
        """The element-wise keys some run of bucket ``b`` has in the store (each a slot over the bucket's chunk)."""
        keys: dict[str, torch.dtype] = {}
        for n, _ in runs:
            keys.update(self.keys.get((number, n), {}))
        return keys

    def _read_ahead(self, number: int, b: int, runs: list[tuple[int, Any]]) -> None:
        if self.weights_offloaded:
            self.store.prefetch(("weights", b))
            if self.shards.grads[b] is not None:
                self.store.prefetch(("grads", b))
        for key in self._state_names(number, b, runs):
            self.store.prefetch(("state", number, b, key))

    def _bind(self, optimizer: torch.optim.Optimizer, number: int, b: int, runs: list[tuple[int, Any]],
              weights: torch.Tensor | None = None) -> dict[Hashable, torch.Tensor]:
        """Bucket ``b``'s tensors in place for the step: the runs' state (views of each key's chunk), and at stage 3
        their weights (``weights``, or read) and gradients (views of the shards). Returns what was taken, by
        name."""
        lo, _ = self.shards.chunk_bounds(self.shards.buckets[b])
        held = {("state", number, b, key): self.store.take(("state", number, b, key))
                for key in self._state_names(number, b, runs)}
        for n, run in runs:
            state = optimizer.state[run.param]
            for key in self.keys.get((number, n), {}):
                state[key] = held["state", number, b, key][run.start - lo:run.end - lo]
        if self.weights_offloaded:
            weights = held["weights", b] = weights if weights is not None else self.store.take(("weights", b))
            grad = None
            if self.shards.grads[b] is not None:
                grad = held["grads", b] = self.gradients.take(b)
            for _, run in runs:
                run.param.data = weights[run.start - lo:run.end - lo]
                run.param.grad = None if grad is None else grad[run.start - lo:run.end - lo]
        return held

    def _unbind(self, optimizer: torch.optim.Optimizer, number: int, b: int, runs: list[tuple[int, Any]],
                held: dict[Hashable, torch.Tensor]) -> torch.Tensor | None:
        """After bucket ``b``'s step: the state (new keys too: the first step makes them) written behind from its
        chunks; the gradient given back unwritten (the store keeps it unscaled, with its scales: zero_grad() lets
        it go); the placeholders back ([Note: placeholders]). Returns stage 3's weights, not yet written."""
        self._keep_state(optimizer, number, b, runs, held)
        if not self.weights_offloaded:
            return None
        grad = held.pop(("grads", b), None)
        if grad is not None:
            self.store.discard(grad)
        for _, run in runs:
            run.param.grad = None
            run.param.data = nan_like(run.end - run.start, run.param.dtype, run.param.device)
        return held.pop(("weights", b))

    def _keep_state(self, optimizer: torch.optim.Optimizer, number: int, b: int, runs: list[tuple[int, Any]],
                    held: dict[Hashable, torch.Tensor]) -> None:
        """The runs' element-wise state of bucket ``b`` (1-D tensors of a run's length: a run's scalars, its step
        count, stay in ``optimizer.state``) out of ``optimizer.state`` into their keys' chunks, which are written
        behind; a key no run had before gets a slot, zeros where no run of this optimizer has it."""
        lo, hi = self.shards.chunk_bounds(self.shards.buckets[b])
        for n, run in runs:
            state = optimizer.state.get(run.param, {})
            for key, value in list(state.items()):
                if not (torch.is_tensor(value) and value.dim() == 1 and value.numel() == run.end - run.start):
                    continue
                name = ("state", number, b, key)
                if name not in held:
                    self.store.ensure(name, hi - lo, value.dtype)
                    held[name] = self.store.fresh(name).zero_()
                chunk = held[name][run.start - lo:run.end - lo]
                if chunk.data_ptr() != value.data_ptr():
                    chunk.copy_(value)
                self.keys.setdefault((number, n), {})[key] = value.dtype
                del state[key]
        for name in [name for name in held if name[0] == "state"]:
            self.store.put(name, held.pop(name))

    # ------------------------------------------------------------------------------------------------------
    # The state dicts (zero/optimizer_state.py's [Note: the whole model's state]; zero/checkpoint/)
    # ------------------------------------------------------------------------------------------------------
    def state_chunk(self, optimizer: torch.optim.Optimizer, b: int, key: str, length: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
        """Bucket ``b``'s chunk of ``key`` as the store keeps it (zeros where no run has it), on ``device``: give it
        back with ``store.discard`` once read."""
        name = ("state", self.numbers[id(optimizer)], b, key)
        if not self.store.written(name):
            return torch.zeros(length, dtype=dtype, device=device)
        chunk = self.store.take(name)
        if chunk.device != device:
            moved = chunk.to(device)
            self.store.discard(chunk)
            return moved
        return chunk

    def load_runs(self, optimizer: torch.optim.Optimizer, inner: dict[str, Any]) -> dict[str, Any]:
        """A state in the runs' own form (state by run number), its element-wise tensors moved into the store
        bucket by bucket, cast to the runs' dtype as torch.optim's load_state_dict casts a floating state to its
        parameter's; returns it with the rest (the scalars), for torch.optim's load. This optimizer's earlier
        state in the store is forgotten."""
        number = self.numbers[id(optimizer)]
        for known in [known for known in self.keys if known[0] == number]:
            del self.keys[known]
        state = {n: dict(values) for n, values in inner["state"].items()}
        for b, runs in self._by_bucket(self.shards.layouts[optimizer]).items():
            lo, hi = self.shards.chunk_bounds(self.shards.buckets[b])
            held: dict[Hashable, torch.Tensor] = {}
            for n, run in runs:
                values = state.get(n, {})
                for key, value in list(values.items()):
                    if not (torch.is_tensor(value) and value.dim() == 1 and value.numel() == run.end - run.start):
                        continue
                    if value.is_meta:  # read into the store by zero.checkpoint already ([Note: stored pieces])
                        self.keys.setdefault((number, n), {})[key] = value.dtype
                        del values[key]
                        continue
                    dtype = run.param.dtype if value.is_floating_point() else value.dtype
                    name = ("state", number, b, key)
                    if name not in held:
                        self.store.ensure(name, hi - lo, dtype)
                        held[name] = self.store.fresh(name).zero_()
                    held[name][run.start - lo:run.end - lo].copy_(value)
                    self.keys.setdefault((number, n), {})[key] = dtype
                    del values[key]
            for name, chunk in held.items():
                self.store.put(name, chunk)
        return {**inner, "state": state}

    def run_range(self, optimizer: torch.optim.Optimizer, number: int, key: str,
                  dtype: torch.dtype) -> tuple[torch.Tensor, Hashable]:
        """Run ``number``'s stretch of its bucket's ``key`` slot: a meta tensor over it (its storage offset the
        stretch's place in the slot) and the slot's name ([Note: stored pieces] in zero/pieces.py)."""
        run = self.shards.layouts[optimizer].runs[number]
        lo, hi = self.shards.chunk_bounds(run.bucket)
        meta = meta_like(hi - lo, dtype)[run.start - lo:run.end - lo]
        return meta, ("state", self.numbers[id(optimizer)], run.bucket.index, key)

    # ------------------------------------------------------------------------------------------------------
    # zero_grad(): stage 3's gradient shards let go of
    # ------------------------------------------------------------------------------------------------------
    def gradients_let_go(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        """Each bucket whose every optimizer has now let go of its gradient: dropped (set_to_none) or made zeros,
        as the in-memory shards are ([Note: gradient shards] in zero/stages.py)."""
        if self.gradients is None:
            return
        number = self.numbers[id(optimizer)]
        layouts = self.shards.layouts
        for b in self.shards.layouts[optimizer].buckets:
            self.let_go.setdefault(b, set()).add(number)
            owners = {self.numbers[id(o)] for o, layout in layouts.items() if b in layout.buckets}
            if owners <= self.let_go[b]:
                del self.let_go[b]
                if b in self.pending:  # the pending step reads it first ([Note: the step just in time])
                    self.let_go_later[b] = not set_to_none
                else:
                    self._let_go(b, zeros=not set_to_none)

    def _let_go(self, b: int, zeros: bool) -> None:
        if self.shards.grads[b] is not None:
            self.gradients.drop(b, zeros=zeros)
            if not zeros:
                self.shards.grads[b] = None
