"""PyTorch's own data parallelism behind the interface of zero.shard (zero.stage0.DataParallel), side by side: the
references every hand-written stage is measured against.

    DDPSync(model, device, bucket_mb)                       stage 0: DistributedDataParallel
    DDPSync(model, device, bucket_mb, zero_redundancy=True) stage 1: DDP, then ZeroRedundancyOptimizer's step
    FSDPSync(model, units, reshard_after_forward=True)      stage 3 (False: a stage 2 sharding the weights between
                                                            steps): FSDP2's fully_shard on the same units
    FSDPSync(..., mesh=, param_dtype=, reduce_dtype=)       HSDP on a 2-D mesh (replicate, shard), and FSDP2's
                                                            MixedPrecisionPolicy

Each leaves the user's optimizer code as it is and PyTorch's own clipping (torch.nn.utils.clip_grad_norm_, which
FSDP2's DTensors make global) in place. Their optimizers' state_dict() gives torch.optim's ordinary, unsharded
form on the group's rank 0 ({} on the others, which must call it too), as zero.shard's do, so a checkpoint of any
of them loads into any stage. Each offers every sync's checkpoints (zero.checkpoint.Checkpoints: save_checkpoint,
load_checkpoint): DDP's are zero.checkpoint's of whole tensors (zero.checkpoint.WholeCheckpoints), FSDP2's are
folders written and read FSDP2's way (get_state_dict, torch.distributed.checkpoint, set_state_dict) in
zero.checkpoint's format; either also as one file.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from zero.broadcast import broadcast_state, check_keys_on_rank0, only_rank0_holds
from zero.checkpoint import WholeCheckpoints
from zero.pieces import OptimizerView, whole_optimizer_view


def make_ddp(model: nn.Module, device: torch.device, bucket_mb: float) -> DistributedDataParallel:
    """DistributedDataParallel set up as GradientSync works: gradients as views of its buckets, buckets of at
    most ``bucket_mb``, and no broadcast of rank 0's buffers before every forward (SyncBatchNorm's running
    statistics agree on every rank anyway; local BatchNorm keeps each rank's own, as ours does).

    That last keyword changed name: newer torch calls it forward_sync_buffers, older torch (2.11 among them)
    has only broadcast_buffers, with the same meaning. The installed DDP's signature says which it takes.
    """
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    no_buffer_sync = "forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                   bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
                                   **{no_buffer_sync: False})


def shard_as_initialized(model: nn.Module, units: list[nn.Module], init: Any, shard: Any) -> None:
    """A model on the meta device made real one module at a time on the CPU, in ``model.modules()`` order, with
    ``init(module)`` (zero.shard's init= contract), each unit handed to ``shard`` (fully_shard) once its last module
    is initialized, the root last: no rank holds more than the root and one unit whole, and the weights are those of
    one process at any world size. (FSDP2's own recipe, fully_shard on the meta model, then to_empty and init on the
    DTensors, draws each shard from DTensor's random generator, which gives other values at another world size:
    pytorch issue 168058.)"""
    from zero.init import whole

    unit_of = {id(module): unit for unit in units for module in unit.modules()}
    left = {id(unit): len(list(unit.modules())) for unit in units}
    made: dict[int, nn.Parameter] = {}  # each meta parameter's real one (tied ones stay tied)
    cpu = torch.device("cpu")
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                module._parameters[name] = made.setdefault(id(p), whole(p, cpu))
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=cpu)
        with torch.no_grad():
            init(module)
        unit = unit_of.get(id(module))
        if unit is not None:
            left[id(unit)] -= 1
            if left[id(unit)] == 0:
                whole_ones = {id(p) for p in unit.parameters()}
                shard(unit)  # the unit's parameters are now its DTensor shards: forget the whole ones, or they stay
                made = {key: p for key, p in made.items() if id(p) not in whole_ones}
    shard(model)


def consolidating_zero_redundancy_optimizer(params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                                            **settings: Any) -> torch.optim.Optimizer:
    """ZeroRedundancyOptimizer whose state_dict() consolidates first (every rank calls it; rank 0 gets the whole,
    the others {}), so it is saved as any optimizer is. torch.distributed.optim is imported here, at first use:
    it brings FSDP and DTensor with it, about a second of every process's start-up otherwise."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class ConsolidatingZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
        def state_dict(self) -> dict[str, Any]:
            self.consolidate_state_dict(to=0)
            return super().state_dict() if dist.get_rank() == 0 else {}

    return ConsolidatingZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **settings)


class DDPSync(WholeCheckpoints):
    """DistributedDataParallel (and with ``zero_redundancy`` ZeroRedundancyOptimizer) behind zero.shard's
    interface. ``module`` is DDP's wrapper: the forward that arms its reducer. Its checkpoints are stage 0's: every
    tensor whole (ZeroRedundancyOptimizer's state: each rank offers its own parameters', the whole state dict is
    loaded on every rank, which keeps its part)."""

    def __init__(self, model: nn.Module, device: torch.device, bucket_mb: float, zero_redundancy: bool = False):
        self.model, self.zero_redundancy = model, zero_redundancy
        self.module = make_ddp(model, device, bucket_mb)
        self.classes: weakref.WeakKeyDictionary[torch.optim.Optimizer, type] = weakref.WeakKeyDictionary()

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any],
                  **settings: Any) -> torch.optim.Optimizer:
        if self.zero_redundancy:
            optimizer = consolidating_zero_redundancy_optimizer(params, optimizer_class, **settings)
        else:
            optimizer = optimizer_class(params, **settings)
        self.classes[optimizer] = optimizer_class  # ZeroRedundancyOptimizer keeps optimizer_class's state
        return optimizer

    def optimizer_view(self, optimizer: torch.optim.Optimizer) -> OptimizerView:
        """ZeroRedundancyOptimizer: its parameters' state is in its local optimizer's, on the rank that owns each."""
        local = optimizer.optim.state if self.zero_redundancy else None
        return whole_optimizer_view(self.model, optimizer, self.classes.get(optimizer), local)

    def set_requires_gradient_sync(self, requires: bool) -> None:
        # What no_sync() does, as a setting: DDP reads it in forward and keeps it for that backward.
        self.module.require_backward_grad_sync = requires

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type, error_if_nonfinite)

    def model_state_dict(self) -> dict[str, Any]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()} if dist.get_rank() == 0 else {}

    def load_model_state_dict(self, state: dict[str, Any] | None) -> None:
        """Given on every rank alike, or on rank 0 alone (then broadcast, one tensor at a time)."""
        if not only_rank0_holds(state, None):
            self.model.load_state_dict(state)
            return
        check_keys_on_rank0(self.model, state, None)
        if dist.get_rank() == 0:
            self.model.load_state_dict(state)
        broadcast_state(self.model)

    def held_shards(self) -> list[torch.Tensor]:
        return []

    def held_gradient_buffers(self) -> list[torch.Tensor]:
        return []  # the .grad views of DDP's buckets are counted through the parameters

    def gathered_peak(self) -> None:
        return None

    def sent_bytes(self) -> None:
        return None  # inside DDP's reducer and gloo: not counted

    def close(self) -> None:
        pass


class FSDPSync:
    """PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard) on ``units`` and the root, behind zero.shard's
    interface: the anchor for stage 3 (``reshard_after_forward`` True) and, with it False, for a stage 2 whose
    weights are sharded between steps. Accumulation is FSDP2's own: set_requires_gradient_sync(False) keeps the
    unsharded gradients until the window's last micro-batch reduce-scatters them. The parameters become DTensors:
    build the optimizer after this, from model.parameters(). Its state dicts go through DTensor's full_tensor()
    and distribute_tensor(), so they are torch.optim's ordinary form (every rank calls state_dict())."""

    def __init__(self, model: nn.Module, units: list[nn.Module], reshard_after_forward: bool, mesh: Any = None,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 init: Any = None):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        # mesh: a 2-D DeviceMesh (replicate, shard) makes it HSDP (None: the world, 1-D); the dtypes are
        # MixedPrecisionPolicy's (None: the model's own), the sharded parameters and the state dicts stay in it
        options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
                   "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
        if init is not None:
            shard_as_initialized(model, units, init, lambda module: fully_shard(module, **options))
        else:
            for unit in units:
                fully_shard(unit, **options)
            fully_shard(model, **options)
        self.module = self.model = model
        self.whole_state_dicts = True  # the optimizers' state dicts in torch.optim's whole form (False: FSDP2's own)

    holds_shards = True

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any],
                  **settings: Any) -> torch.optim.Optimizer:
        optimizer = optimizer_class(params, **settings)
        optimizer.register_state_dict_post_hook(self._full_optimizer_state)
        optimizer.register_load_state_dict_pre_hook(self._sharded_optimizer_state)
        return optimizer

    def _full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """Every DTensor in the state made whole (a collective: every rank calls it), kept on rank 0's CPU."""
        if not self.whole_state_dicts:
            return state
        full = {index: {key: value.full_tensor().cpu() if hasattr(value, "full_tensor") else value
                        for key, value in values.items()} for index, values in state["state"].items()}
        return {"state": full, "param_groups": state["param_groups"]} if dist.get_rank() == 0 else {}

    def _sharded_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """Each whole state tensor cut like its parameter (every rank passes the same dict)."""
        from torch.distributed.tensor import DTensor, distribute_tensor
        if not self.whole_state_dicts:
            return state
        params = [p for group in optimizer.param_groups for p in group["params"]]
        sharded = {}
        for index, values in state["state"].items():
            p = params[int(index)]
            sharded[index] = {key: distribute_tensor(value.to(p.device), p.device_mesh, p.placements)
                              if isinstance(p, DTensor) and torch.is_tensor(value) and value.dim() > 0 else value
                              for key, value in values.items()}
        return {"state": sharded, "param_groups": state["param_groups"]}

    def set_requires_gradient_sync(self, requires: bool) -> None:
        self.model.set_requires_gradient_sync(requires)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type, error_if_nonfinite)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _reshard(self) -> None:
        """Every unit sharded, before a state dict: an evaluation's forward with reshard_after_forward=False
        leaves its units gathered (no backward comes to reshard them), and the state dict would then miss the
        parameters the optimizer holds."""
        from torch.distributed.fsdp import FSDPModule
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def model_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        self._reshard()
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if dist.get_rank() == 0 else {}

    def load_model_state_dict(self, state: dict[str, Any] | None) -> None:
        """Given on every rank alike, or on rank 0 alone (FSDP2's broadcast_from_rank0)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from_rank0 = only_rank0_holds(state, None)
        set_model_state_dict(self.model, state if state else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0))

    @contextlib.contextmanager
    def _fsdp2_state_dicts(self) -> Iterator[None]:
        """The optimizers' state dicts in FSDP2's own form (DTensor shards) meanwhile, as get_state_dict and
        set_state_dict take them, not the whole one the hooks make; every unit sharded first (_reshard)."""
        self._reshard()
        self.whole_state_dicts = False
        try:
            yield
        finally:
            self.whole_state_dicts = True

    def save_checkpoint(self, path: str, optimizer: Any = None, extra: Any = None, *, one_file: bool = False,
                        writer: Any = None) -> Any:
        """A torch.distributed.checkpoint folder, FSDP2's way: get_state_dict, then dcp.save, every rank its own
        shards; ``extra`` as rank 0 has it (zero.checkpoint's encoding). The format zero.checkpoint writes and
        reads (zero/checkpoint/), so either resumes the other. With ``one_file``: one file of the whole state dicts
        on rank 0 (zero.checkpoint.save_file). With ``writer`` (zero.checkpoint.AsyncWriter): DCP's own
        ``async_save`` (its staging, its thread) over the writer's gloo group, once the save in flight is done;
        returns its future. Every rank calls it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from zero import checkpoint
        from zero.optimizer_kinds import as_optimizers

        if one_file:
            return checkpoint.save_file(path, self, optimizer, extra, writer=writer)
        optimizers = as_optimizers(optimizer)
        with self._fsdp2_state_dicts():
            model_state, optimizer_state = get_state_dict(self.model, optimizers)
        if dist.get_rank() != 0:  # rank 0's buffers alone: zero/checkpoint/state_dict.py's [Note: one definition of a
            for name, _ in self.model.named_buffers():  # buffer]
                model_state.pop(name, None)
        state = {"model": model_state, "optimizer": optimizer_state}
        if extra is not None and dist.get_rank() == 0:  # DCP's coordinator: one copy, as zero.checkpoint writes it
            state["extra"] = checkpoint.encode_extra(extra)
        if writer is None:
            dcp.save(state, storage_writer=checkpoint.Writer(path))  # DCP's FileSystemWriter, the disk's errors kept
            return None
        writer.wait()  # one save in flight
        return writer.adopt(dcp.async_save(state, storage_writer=checkpoint.Writer(path),
                                           process_group=writer.writer_group(None)))

    def load_checkpoint(self, path: str, optimizer: Any = None, *, stepped: bool = False) -> Any:
        """Such a folder (FSDP2's, or zero.checkpoint's from any stage and world size) read into the model's shards
        and the optimizers' (none: the model alone), every rank only what its shards overlap: get_state_dict,
        dcp.load, set_state_dict; its extra is read apart (zero.checkpoint.read_extra). get_state_dict steps an
        optimizer without state once at lr 0 to make its state, which the load then replaces, so a checkpoint
        lacking any of it is refused (DCP's CheckpointException), ``stepped`` or not. A file: load_file."""
        import os

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from zero import checkpoint
        from zero.optimizer_kinds import as_optimizers

        if os.path.isfile(path):
            return checkpoint.load_file(path, self, optimizer, stepped)
        optimizers = as_optimizers(optimizer)
        problem = checkpoint.verify(path, ("model", "extra", *(("optimizer",) if optimizers else ())))
        if problem:  # flipped bytes, refused before anything is read (zero/checkpoint/checksums.py)
            raise checkpoint.CheckpointError(f"zero.checkpoint.load: checkpoint {path}: {problem}")
        with self._fsdp2_state_dicts():
            model_state, optimizer_state = get_state_dict(self.model, optimizers)
            state = {"model": model_state, **({"optimizer": optimizer_state} if optimizers else {})}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(self.model, optimizers, model_state_dict=state["model"],
                           optim_state_dict=state.get("optimizer", {}))
        return checkpoint.read_extra(path)

    def checkpoint_group(self) -> None:
        return None  # the world: its whole state dicts are on rank 0 (HSDP's too)

    def optimizer_view(self, optimizer: torch.optim.Optimizer) -> OptimizerView:
        return whole_optimizer_view(self.model, optimizer)  # over the DTensor parameters

    def held_shards(self) -> list[torch.Tensor]:
        return []

    def held_gradient_buffers(self) -> list[torch.Tensor]:
        return []

    def gathered_peak(self) -> None:
        return None

    def sent_bytes(self) -> None:
        return None  # inside FSDP2 and gloo: not counted

    def close(self) -> None:
        pass  # the parameters stay DTensors: full_tensor() gathers one
