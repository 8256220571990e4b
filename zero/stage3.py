"""ZeRO stage 3 (zero.shard(model, 3)): the parameters sharded too, each unit (a module: the model's blocks, and the
root for what no block owns) gathered whole only around its forward and its backward, the next one prefetched.

A unit's life is an enum (zero/units.py's UnitState: what each state means for memory is said where it is
declared); the hooks that move a unit through it are ZeroStage3's, in the order a micro-batch meets them ([Note:
stage 3's micro-batch]): the forward's module hooks, then a hook on each unit's output for its backward, then the
gradients' hooks (zero/stages.py's stage 2: each gradient copied into a buffer and reduce-scattered into the shard).
Frozen parameters are sharded too ([Note: frozen parameters]).
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from collectives import Collectives
from measure.timing import profiled
from zero.broadcast import broadcast_state, check_keys_on_rank0
from zero.buckets import Bucket
from zero.hybrid import Replicas
from zero.offload.store import Store
from zero.pieces import Piece, flat_pieces
from zero.precision import (Precision, gather_full, gathered_state_dict, load_masters, scatter_masters,
                            shard_weights)
from zero.stages import ZeroStage2
from zero.units import FrozenPart, InputsGradient, Unit, UnitState, in_backward, refuse_detached_state_dict


class ZeroStage3(ZeroStage2):
    """Stage 3, the parameters sharded too. What it adds to stage 2: the buckets are units (a module each: the
    model's blocks, and the root for the parameters no block owns), and a unit's flat keeps its storage only
    while the unit is gathered. Freeing resizes the storage to 0 bytes, so the parameters stay views of it (their
    identity, autograd's saved references and the hooks intact) with no memory behind them; each rank keeps its
    shard in a tensor of its own, which the optimizer steps. A unit is SHARDED, GATHERING or GATHERED (UnitState;
    its flat has storage exactly when it is not SHARDED).

    [Note: stage 3's micro-batch]
    - forward: a hook before each unit's forward gathers it (or waits for its prefetch) and launches the
      all-gather of the next unit in the order the last forward started them; after the unit's forward it is
      freed (reshard after forward), so it computes while the next is gathered;
    - backward: a hook on the unit's output fires when its gradient is ready, just before the unit's backward:
      the unit is gathered again and the one before it prefetched, along the reverse of the order the forward
      finished units in (so the root, whose head ends the forward, comes first and prefetches the last block).
      As in stage 2 each gradient is copied into the unit's buffer as autograd makes it; when the unit's last one
      is in, the buffer is reduce-scattered into the gradient shard and the unit freed. Every rank runs the same
      graph, so the collectives come in the same order everywhere;
    - the root is used at both ends (stem first, head last), so like FSDP2's root it stays gathered from its
      forward to the end of its backward. Besides it at most ``max_gathered`` units are gathered (the one
      computing and the one prefetched; a prefetch that would make a third waits until a unit is freed);
    - the step's edges: the optimizer's step hook launches the root's and the first unit's all-gathers, so the
      next forward does not start by waiting; the first forward of all prefetches along module order.
    ``accumulate`` "unsharded" keeps instead each unit's full gradient over the window and reduce-scatters it on
    the last micro-batch only (FSDP2's set_requires_gradient_sync): 4 Psi more during the window, K-1 fewer
    reduce-scatters, and stage 0's summation order. Parameters are gathered in their own dtype: under autocast
    each op casts its weight as it would at stage 0. Evaluation runs the same hooks under no_grad (each unit
    freed after its forward), so every rank must run as many forwards.

    [Note: frozen parameters] Frozen parameters (requires_grad False: a fine-tuned model's base) are sharded too,
    as FSDP2 shards them: each unit keeps them in parts of their own (a part per dtype, FrozenPart), gathered and
    freed with the unit and never reduced, so a rank holds 1/W of them. Freeing after backward needs care: a unit's
    last trainable gradient can arrive before autograd has used its frozen weights (a frozen LayerNorm before a
    trainable adapter: the adapter's gradient is in, and the LayerNorm's backward, which reads its weight to pass
    the gradient on, is still to run). So a unit with frozen parts is freed once both its gradients are in and its
    inputs' gradient is computed (InputsGradient on its inputs reports it; FSDP2's RegisterPostBackwardFunction);
    where no input needs a gradient, or for the root, whose modules sit at both ends of the graph, at the end of
    backward. A recomputation inside backward (activation checkpointing) neither records nor frees a unit: it runs
    while the unit is gathered for its backward."""

    stage = 3
    word = "unit"
    bucket_class = Unit
    max_gathered = 2  # units whose full parameters may be in place at once, besides the root

    own_shards = True  # a tensor of its own: the full flat is freed between uses

    def __init__(self, model: nn.Module, units: list[nn.Module], owner: dict[int, nn.Module], comm: Collectives,
                 accumulate: str, precision: Precision, replicas: Replicas | None = None, deferred: bool = False,
                 store: Store | None = None):
        self.unsharded = accumulate == "unsharded"
        owned = [[p for p in unit.parameters() if owner[id(p)] is unit] for unit in units]
        super().__init__(model, [[p for p in params if p.requires_grad] for params in owned], comm, precision,
                         replicas, deferred, store)
        self.units: list[Unit] = self.buckets  # type: ignore[assignment]
        for unit, module, params in zip(self.units, units, owned):
            unit.module, unit.flat = module, self.param_flats[unit.index]
            unit.frozen = self._frozen_parts(unit.index, [p for p in params if not p.requires_grad], deferred)
        self.root = self.units[0] if units[0] is model else None
        self.wanted: Unit | None = None  # a prefetch held back by max_gathered, launched when a unit is freed
        # the units in the order the last forward started them, and in the reverse of the order it finished them
        self.order: list[Unit] = list(self.units)  # before the first forward: module order
        self.backward_order: list[Unit] = []
        self.recording: tuple[list[Unit], list[Unit]] = ([], [])
        self.peak = {"units": 0, "bytes": 0}  # most units gathered at once besides the root; most full bytes
        # hooks run in the order they were registered: the pass starts before the root's forward begins, and ends
        # after the root's forward has finished (so the recorded orders include it)
        self.hooks.append(model.register_forward_pre_hook(self._pass_starts))
        for unit in self.units:
            self.hooks += [unit.module.register_forward_pre_hook(partial(self._unit_forward_starts, unit)),
                           unit.module.register_forward_hook(partial(self._unit_forward_ends, unit))]
        self.hooks.append(model.register_forward_hook(self._pass_ends))
        self.hooks += [module.register_state_dict_pre_hook(refuse_detached_state_dict) for module in model.modules()]

    def _frozen_parts(self, index: int, params: list[nn.Parameter], deferred: bool) -> list[FrozenPart]:
        """The unit's frozen parameters, a part per dtype ([Note: frozen parameters]), each moved into a flat of its
        own (freed at once) with this rank's shard kept; gathered in param_dtype where one is set (floating ones)."""
        parts = []
        for dtype in dict.fromkeys(p.dtype for p in params):  # each dtype, in the order met
            part = FrozenPart(index, [p for p in params if p.dtype == dtype], self.world_size)
            gathered = self.precision.param if self.precision.separate_masters and dtype.is_floating_point else dtype
            (part.flat,), (part.shard,) = shard_weights([part], self.comm, Precision(dtype, gathered, gathered),
                                                        own_shards=True, deferred=deferred)
            parts.append(part)
        return parts

    def shard_of(self, part: Bucket) -> torch.Tensor:
        """This rank's shard of a unit's trainable bucket (``weights``: the optimizer's) or of a frozen part; with
        offload a trainable bucket's is a placeholder (its dtype and length): read it with ``shard_values``."""
        return part.shard if isinstance(part, FrozenPart) else self.weights[part.index]

    def offloaded(self, part: Bucket) -> bool:
        """Whether the part's shard is in the offload store (a trainable bucket's, with offload)."""
        return self.gradients is not None and not isinstance(part, FrozenPart) and part.length > 0

    @contextlib.contextmanager
    def shard_values(self, part: Bucket) -> Iterator[torch.Tensor]:
        """This rank's shard of ``part``, to read: in memory, or (offload) read from the store (ahead, where
        ``_read_ahead`` asked) and given back after; a step still pending for it taken first, its weights read from
        there and then written ([Note: the step just in time] in zero/offload/shards.py)."""
        if not self.offloaded(part):
            yield self.shard_of(part)
            return
        stepped = self.shards.streamed.settle(part.index)  # a pending step first: the weights it makes are these
        values = stepped if stepped is not None else self.store.take(("weights", part.index))
        try:
            yield values
        finally:
            if stepped is not None:
                self.store.put(("weights", part.index), stepped)
            else:
                self.store.discard(values)

    def write_shard(self, part: Bucket, values: torch.Tensor) -> None:
        """This rank's shard of ``part`` set to ``values`` (an initialization, a load): in place, or (offload) into
        the store."""
        if not self.offloaded(part):
            self.shard_of(part).copy_(values)
            return
        kept = self.store.fresh(("weights", part.index))
        kept.copy_(values)
        self.store.put(("weights", part.index), kept)

    def _read_ahead(self, order: list[Unit], unit: Unit) -> None:
        """Offload: the weight shards of the two units after ``unit`` in ``order`` asked of the store now, so that
        their gathers find them read ([Note: the order of the reads] in zero/offload/shards.py)."""
        if self.gradients is None:
            return
        for _ in range(2):
            unit = self._after(order, unit)
            if unit is None:
                return
            if unit.length and unit.state is UnitState.SHARDED:
                self.store.prefetch(("weights", unit.index))
                self.shards.streamed.read_pending_ahead(unit.index)

    # ------------------------------------------------------------------------------------------------------
    # A unit's life: SHARDED -> GATHERING -> GATHERED -> SHARDED
    # ------------------------------------------------------------------------------------------------------
    def _gather(self, unit: Unit) -> None:
        """Give the unit's flats their storage back, put this rank's shards in place (cast to param_dtype: the
        gather moves the low-precision bytes) and launch the all-gathers of the others' (asynchronously, like the
        reduce-scatters)."""
        assert unit.state is UnitState.SHARDED, unit.state
        self._allocate(unit)
        for part, flat in unit.flats():
            with self.shard_values(part) as shard:
                self.comm.chunk(flat).copy_(shard)
            unit.gather.append(self.comm.all_gather(flat, part.name("all_gather")))
        unit.state = UnitState.GATHERING
        held = self._held()
        self.peak["units"] = max(self.peak["units"], len([u for u in held if u is not self.root]))
        self.peak["bytes"] = max(self.peak["bytes"], sum(u.full_bytes() for u in held))

    def _allocate(self, unit: Unit) -> None:
        for _, flat in unit.flats():
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())

    def _held(self) -> list[Unit]:
        """The units whose flat has storage: gathered, or being gathered."""
        return [unit for unit in self.units if unit.state is not UnitState.SHARDED]

    def _materialize(self, unit: Unit) -> None:
        """The unit's full parameters in place: wait for its prefetch, or gather it now."""
        if unit.state is UnitState.GATHERED:
            return
        if unit.state is UnitState.SHARDED:
            self._gather(unit)
        with profiled("all_gather wait"):
            for pending in unit.gather:
                pending.wait()
        unit.gather, unit.state = [], UnitState.GATHERED

    def _free(self, unit: Unit) -> None:
        """Drop the unit's full parameters (the views stay, on a storage of 0 bytes), and launch a prefetch that
        max_gathered held back."""
        assert unit.state is UnitState.GATHERED, unit.state
        for _, flat in unit.flats():
            flat.untyped_storage().resize_(0)
        unit.state = UnitState.SHARDED
        if self.wanted is not None:
            wanted, self.wanted = self.wanted, None
            self._prefetch(wanted)

    def _prefetch(self, unit: Unit | None) -> None:
        """Launch the unit's all-gather ahead of its use, unless max_gathered units are already held."""
        if unit is None or unit.state is not UnitState.SHARDED:
            return
        if unit is not self.root and len([u for u in self._held() if u is not self.root]) >= self.max_gathered:
            self.wanted = unit
            return
        self._gather(unit)

    @staticmethod
    def _after(order: list[Unit], unit: Unit) -> Unit | None:
        position = next((i for i, u in enumerate(order) if u is unit), -1)
        return order[position + 1] if 0 <= position < len(order) - 1 else None

    def _after_step(self, buckets: list[Bucket]) -> None:
        """The step's edge: the next forward's first units launched now (the optimizer updated the shards they
        are gathered from); nothing else, since the next forward gathers every unit. [Note: a profiler's window]
        Under a recording torch.profiler they land here, inside the step: the profiler.step() that closes a
        window comes next, and a gloo collective launched under a profiler and still in flight when that profiler
        stops kills the process with a segfault when it is waited for (PyTorch's: a bare all_gather_into_tensor
        launched, the profiler stopped, then waited crashed within 200 rounds in 2 tries of 2; the trainer's
        profiled stage-3 runs crashed 3 times in 17 before this). Only units among ``buckets`` (those every
        optimizer over them has stepped: [Note: several optimizers]) or that no optimizer steps, so no prefetch
        carries old weights."""
        if self.order:
            units = [unit for unit in (self.order[0], self._after(self.order, self.order[0]))
                     if unit in buckets or (unit is not None and not self.shards.stepped_by_any(unit))]
            for unit in units:
                self._prefetch(unit)
            if torch.autograd._profiler_enabled():
                for unit in units:
                    if unit is not None and unit.state is UnitState.GATHERING:
                        self._materialize(unit)

    # ------------------------------------------------------------------------------------------------------
    # Hooks: forward (module hooks), backward (a hook on each unit's output; the gradients' hooks)
    # ------------------------------------------------------------------------------------------------------
    def _open(self, unit: Unit, name: str) -> None:
        unit.span = profiled(name)
        unit.span.__enter__()

    def _close(self, unit: Unit) -> None:
        if unit.span is not None:
            unit.span.__exit__(None, None, None)
            unit.span = None

    def _pass_starts(self, model: nn.Module, args: Any) -> None:
        self.recording = ([], [])
        if torch.is_grad_enabled():
            for unit in self.units:
                unit.backward_begun = False

    def _pass_ends(self, model: nn.Module, args: Any, output: Any) -> None:
        started, finished = self.recording
        self.order, self.backward_order = started, finished[::-1]

    def _unit_forward_starts(self, unit: Unit, module: nn.Module, args: Any) -> Any:
        recomputing = in_backward()  # activation checkpointing's recomputation, inside the unit's backward
        if not recomputing:
            self.recording[0].append(unit)
            self._open(unit, f"unit {unit.index} forward")
        self._materialize(unit)
        if not recomputing:
            self._prefetch(self._after(self.order, unit))
            self._read_ahead(self.order, unit)
        if unit.frozen and torch.is_grad_enabled() and not recomputing:
            return self._watch_inputs(unit, args)
        return None

    def _unit_forward_ends(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward():  # a recomputation (without early stop): the unit's backward comes next, gathered
            return
        self.recording[1].append(unit)
        self._close(unit)
        if not torch.is_grad_enabled():
            self._free(unit)  # evaluation: no backward will come
            return
        for tensor in (output if isinstance(output, (tuple, list)) else [output]):
            if torch.is_tensor(tensor) and tensor.requires_grad:
                tensor.register_hook(partial(self._unit_backward_starts, unit))
        if unit is not self.root:  # the root (stem and head) is used at both ends of forward and backward: kept
            self._free(unit)

    def _watch_inputs(self, unit: Unit, args: Any) -> Any:
        """[Note: frozen parameters] A unit with frozen parameters is freed after its backward only once the
        gradient of its inputs is computed, which the identity InputsGradient on them reports; where no input
        needs one (or for the root, whose modules sit at both ends of the graph) at the end of backward."""
        leaves, spec = tree_flatten(args)
        watched = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf) and leaf.requires_grad]
        unit.held_to_end = unit is self.root or not watched
        unit.inputs_pending = not unit.held_to_end
        if not unit.inputs_pending:
            return None
        outputs = InputsGradient.apply(partial(self._unit_inputs_done, unit), *(leaves[i] for i in watched))
        for i, tensor in zip(watched, outputs):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    def _unit_inputs_done(self, unit: Unit) -> None:
        unit.inputs_pending = False
        self._free_if_done(unit)

    def _free_if_done(self, unit: Unit) -> None:
        """Free the unit after its backward: once its trainable gradients are all in, and its frozen parameters'
        use is over too ([Note: frozen parameters])."""
        if unit.pending == 0 and not unit.inputs_pending and not unit.held_to_end \
                and unit.state is UnitState.GATHERED:
            self._free(unit)
            self._close(unit)

    def _unit_backward_starts(self, unit: Unit, grad: torch.Tensor) -> None:
        """The gradient of the unit's output is ready: its backward is about to run."""
        if not unit.backward_begun:
            unit.backward_begun = True
            self._open(unit, f"unit {unit.index} backward")
            self._materialize(unit)
            self._prefetch(self._after(self.backward_order, unit))
            self._read_ahead(self.backward_order, unit)
            if self.gradients is not None and self.grads[unit.index] is not None:  # accumulated into: read ahead
                self.store.prefetch(("grads", unit.index))

    def _grad_ready(self, unit: Unit, param: nn.Parameter) -> None:  # type: ignore[override]
        self._copy_out(unit, param)
        if unit.pending == 0:  # the unit's gradients are all in: average them, free its parameters
            if self.requires_sync or not self.unsharded:
                self._launch(unit)
            self._free_if_done(unit)

    def _backward_done(self) -> None:
        """Stage 2's, then the units held to the end of backward freed ([Note: frozen parameters])."""
        super()._backward_done()
        for unit in self.units:
            if (unit.held_to_end or unit.inputs_pending) and unit.state is UnitState.GATHERED:
                self._free(unit)
                self._close(unit)
            unit.held_to_end = unit.inputs_pending = False

    def _copy_out(self, unit: Unit, param: nn.Parameter) -> None:  # type: ignore[override]
        """Sharded accumulation: stage 2's. Unsharded: add the gradient into the unit's own full buffer, kept
        over the window (0 + g is g exactly, so the sums are stage 0's: each rank's micro-batches in turn)."""
        if not self.unsharded:
            return super()._copy_out(unit, param)
        buffer = self.filling.get(unit.index)
        if buffer is None:  # in reduce_dtype, as FSDP2 accumulates its unsharded gradients
            buffer = self.filling[unit.index] = torch.zeros(unit.length, dtype=self.precision.reduce,
                                                            device=self.device)
        unit.view(buffer, param).add_(param.grad)
        param.grad = None

    def _release(self, buffer: torch.Tensor) -> None:
        if not self.unsharded:  # unsharded buffers are each unit's own length, not the pool's
            super()._release(buffer)

    def gathered_peak(self) -> dict[str, int]:
        return dict(self.peak)

    # ------------------------------------------------------------------------------------------------------
    # The whole model: state dicts, and the model handed back
    # ------------------------------------------------------------------------------------------------------
    def parts(self) -> list[Bucket]:
        """Every unit's trainable bucket and frozen parts, in unit order: what this rank holds a shard of
        (``shard_of``)."""
        return [part for unit in self.units for part in [unit, *unit.frozen] if part.length]

    def held_shards(self) -> list[torch.Tensor]:
        """The frozen parts' shards (beside the shards of the trainable buckets, which the optimizer holds)."""
        return [part.shard for unit in self.units for part in unit.frozen]

    def model_state_dict(self) -> dict[str, Any]:
        """The whole state_dict on rank 0's CPU, gathered from the shards one part at a time ({} on the other
        ranks), so in the masters' dtype (the model's own) whatever param_dtype is."""
        def wholes() -> Iterator[tuple[Bucket, torch.Tensor]]:
            for part in self.parts():
                with self.shard_values(part) as shard:
                    full = gather_full(self.comm, part, shard)
                yield part, full
        return gathered_state_dict(self.model, wholes(), self.rank)

    def drop_gathered(self) -> None:
        """Every unit gathered or gathering freed (its gather waited for), and no prefetch held back: call it after
        writing the shards (``weights``) other than through the optimizer, since a prefetch launched at the step's
        edge would bring back the old weights. Every rank of the group calls it (the gathers in flight are
        collectives)."""
        self.wanted = None
        for unit in self._held():
            self._materialize(unit)
            self._free(unit)

    def held_pieces(self) -> dict[str, list[Piece]]:
        """ShardedStage's, of every part this rank holds a shard of: the units' trainable buckets and their frozen
        parts (another (buckets, shards) pair of flat_pieces)."""
        parts = self.parts()
        sources = [("weights", part.index) if self.offloaded(part) else None for part in parts]
        return flat_pieces(self.model, parts, [self.shard_of(part) for part in parts], self.rank, sources)

    def shards_loading(self) -> None:
        """Before a checkpoint's load writes the shards: a step still pending taken (offload), what is gathered freed
        (the shards change under it)."""
        self.shards.settle()
        self.drop_gathered()

    def shards_loaded(self) -> None:
        """After the master shards were written other than by a step: no unit gathered before stays (their next
        gathers read the new shards)."""
        self.drop_gathered()

    def _load_whole(self, state: dict[str, Any] | None, from_rank0: bool) -> None:
        """A whole state_dict into the shards, part by part through a full flat of the shard's dtype: on every
        rank, which keeps its chunk (no collective), or on rank 0 only, which scatters the chunks (no other rank
        ever holds more than its chunk of it). Buffers as they are (broadcast from rank 0)."""
        if from_rank0:
            check_keys_on_rank0(self.model, state, self.comm.group)
        else:
            expected = self.model.state_dict(keep_vars=True).keys()  # names alone ([Note: no state_dict at stage 3])
            if set(state) != set(expected):
                raise RuntimeError(f"Error(s) in loading state_dict: missing keys "
                                   f"{sorted(set(expected) - set(state))}, unexpected keys "
                                   f"{sorted(set(state) - set(expected))}")
        self.drop_gathered()
        load = scatter_masters if from_rank0 else load_masters
        for part in self.parts():  # one part at a time, through a shard of its own where the store keeps it
            shard = self.shard_of(part)
            into = torch.empty(shard.shape, dtype=shard.dtype, device=self.device) if self.offloaded(part) else shard
            load([part], self.comm, [into], self.names, state)
            if into is not shard:
                self.write_shard(part, into)
        with torch.no_grad():
            if not from_rank0 or self.rank == 0:
                for name, buffer in self.model.named_buffers():
                    buffer.copy_(state[name])
        if from_rank0:
            broadcast_state(self.model, buffers_only=True, group=self.comm.group)

    def close(self, whole: bool | None = None) -> None:
        """Gather every unit for good (under a lower param_dtype: the masters, ShardedStage's), then remove the hooks:
        the model is whole and ordinary again, in its own dtype. ``whole=False`` (the default with offload, whose
        model may be larger than the memory: ``whole=True`` asks for it all the same): the hooks removed and nothing
        gathered, so the model's parameters have no values left."""
        whole = self.store is None if whole is None else whole
        if not whole:
            self.drop_gathered()
        for unit in self.units if whole else []:
            self._materialize(unit)
            for part in unit.frozen:  # in their own dtype, from the shards
                full = gather_full(self.comm, part, part.shard)
                for p in part.params:
                    p.data = part.view(full, p)
        super().close(whole)
