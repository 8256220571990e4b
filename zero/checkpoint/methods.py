"""The checkpoint methods every sync offers the training loop (``Checkpoints``: zero.shard's stages, references.py's
DDP and FSDP2, diloco.py's replicas), and those of a sync whose ranks hold every tensor whole (``WholeCheckpoints``:
zero.shard's stage 0, DDP). The training interface is zero/stage0.py's ``DataParallel``; what a zero.shard stage
tells its checkpoint about what it holds is zero/checkpoint/state_dict.py's ``Checkpointable``.

Nothing here imports a stage, and torch.distributed.checkpoint is imported at the first save or load, not with the
stages that inherit ``WholeCheckpoints``.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from zero.pieces import OptimizerView, Piece, whole_optimizer_view


class Checkpoints(Protocol):
    """A sync's checkpoints. Rank 0 of the group holds the whole state dicts. ``save_checkpoint`` writes the sync's
    own form (``holds_shards``: a folder of torch.distributed.checkpoint where every rank writes its shards; else,
    or with ``one_file``, one file of the whole state dicts written by rank 0: zero/checkpoint/),
    ``load_checkpoint`` reads either form, from any sync."""

    holds_shards: bool  # whether a rank holds only shards of the state (its checkpoint a folder of them)

    def save_checkpoint(self, path: str, optimizer: Any = None, extra: Any = None, *,
                        one_file: bool = False, writer: Any = None) -> Any: ...

    def load_checkpoint(self, path: str, optimizer: Any = None, *, stepped: bool = False) -> Any: ...


class WholeCheckpoints:
    """Checkpoints of a sync whose ranks hold every tensor whole (stage 0, DDP): what it tells zero.checkpoint
    (``Checkpointable``: nothing in pieces, optimizers over whole parameters), and the two calls every sync offers
    (``Checkpoints``). The sharded stages (zero/stages.py) say what they hold in pieces instead."""

    model: nn.Module
    holds_shards = False

    def save_checkpoint(self, path: str, optimizer: Any = None, extra: Any = None, *, one_file: bool = False,
                        writer: Any = None) -> Any:
        """Every rank of the group: the model, ``optimizer`` (one, several, None) and ``extra`` to ``path``, a folder
        of torch.distributed.checkpoint where every rank writes what it holds (zero.checkpoint.save), or with
        ``one_file`` one file of the whole state dicts written by the group's rank 0 (zero.checkpoint.save_file).
        With ``writer`` (zero.checkpoint.AsyncWriter): staged, written in the background; returns its future."""
        from zero.checkpoint.api import save  # torch.distributed.checkpoint's half a second, at the first save
        from zero.checkpoint.whole import save_file
        return (save_file if one_file else save)(path, self, optimizer, extra, writer=writer)

    def load_checkpoint(self, path: str, optimizer: Any = None, *, stepped: bool = False) -> Any:
        """Every rank of the group: a checkpoint of either form, of any sync at any world size, into the model and
        ``optimizer`` (None: the weights alone); returns its extra (zero.checkpoint.load_any). ``stepped``: the
        saved optimizers had stepped every parameter, so one without state is refused."""
        from zero.checkpoint.whole import load_any
        return load_any(path, self, optimizer, stepped)

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        return None

    def held_pieces(self) -> dict[str, list[Piece]]:
        return {}  # everything whole

    def optimizer_view(self, optimizer: torch.optim.Optimizer) -> OptimizerView:
        return whole_optimizer_view(self.model, optimizer)

    def load_run_state(self, optimizer: torch.optim.Optimizer, inner: dict[str, Any]) -> None:
        raise TypeError("an optimizer of whole parameters has no runs")

    def shards_saving(self) -> None:
        """Before a checkpoint's save reads what this rank holds (stages 2-3 drop the gradient shards zero_grad()
        let go of)."""

    def shards_loading(self) -> None:
        """Before a checkpoint's load (stage 3 frees what is gathered)."""

    def shards_loaded(self) -> None:
        """After a checkpoint's load (stages 1-2 gather the loaded shards, stage 3 drops what was gathered)."""
