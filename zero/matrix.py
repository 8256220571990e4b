"""Whole-matrix optimizers at ZeRO stages 1-3: torch.optim.Muon and torch.optim.Adafactor, exact, over the pieces
that the flat shards cut out of each parameter.

What it adds to zero/optimizer.py's runs. An element-wise optimizer steps runs of a bucket's chunk that cross
parameters' boundaries; these two read a whole matrix in one step (Muon orthogonalizes it, Adafactor takes its row
and column statistics and its norms), so here a rank's tensors are its PIECES: the stretch of one parameter that
lies in this rank's chunk of the bucket (``WholeParameter.pieces`` says every rank's, in the parameter's layout
order). What is element-wise stays on the pieces; what needs the whole matrix travels, and only that:

- Muon ([Note: Muon's placement]): the momentum's lerp, Nesterov's mix, the weight decay and the update's add run on
  the pieces; each matrix's Newton-Schulz runs once, by torch's own ``_zeropower_via_newtonschulz``, on its owner,
  which gets the pieces of the momentum update by an all-to-all in bf16 and sends the orthogonalized pieces back by
  another. bf16 loses nothing: torch's Newton-Schulz casts its input to bf16 first and returns bf16, so the owner
  computes on the very bf16 matrix an unsharded Muon computes on, and returns the very bf16 update it applies.
- Adafactor ([Note: Adafactor's statistics]): each matrix's row and column sums of the squared gradient and each
  parameter's sums of squares (of the weights before the step, for the step size; of the update, for its clipping) are
  summed over the ranks in two all-reduces (a bucket's parameters each) of a few numbers per parameter; the factored
  statistics (``row_var``, ``col_var``, a few hundred numbers per matrix) are kept whole on every rank holding a
  piece, each of which updates them identically, and the second moment of a vector stays on its pieces, element-wise.

Stage 3 never gathers a parameter for either: only gradients-sized pieces (Muon) or their sums (Adafactor) move.
The optimizers are torch's own classes underneath (``isinstance(opt, torch.optim.Muon)``; LR schedulers and
hyperparameters per group work as ever), validated by torch's own constructor over the whole parameters, with their
state dicts in torch.optim's own form (zero/optimizer_state.py gathers and cuts them: Muon's ``momentum_buffer`` and
Adafactor's ``variance`` element-wise like any moment, ``row_var`` / ``col_var`` whole, in torch's shapes).

Anchors it answers (issue 44): Moonlight's distributed Muon gathers every matrix's update on every rank and
repeats Newton-Schulz there; DeepSpeed all-reduces a matrix crossing a partition to every rank it touches (its first
version orthogonalized a partition's slice: 0.6 relative error); torchtitan's DistributedMuon needs CUDA and DTensor
and does not promise torch's result; Dion moves momentum to whole matrices by all-to-all, as here. This one is
torch.optim.Muon's result to the last bit, on CPU and GPU, over any process group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.optimizer import _get_scalar_dtype, _to_scalar

from collectives import Collectives


@dataclass
class WholeParameter:
    """A parameter of a whole-matrix optimizer, and where its elements lie. ``pieces``: every holder's (rank, start,
    end), the stretch of the parameter's elements in its chunk, numbered in the parameter's layout order in the flat
    (its memory order: Bucket.view), ascending ranks. ``piece``: this rank's own, the inner optimizer's tensor (a
    view of the weights' shard, its .grad a view of the gradient shard), or None. ``owner``: Muon's, the rank that
    orthogonalizes it ([Note: Muon's placement]). ``bucket``: the index of the bucket it lies in (the whole of it:
    a parameter is in one bucket)."""
    index: int  # in torch.optim's numbering of this optimizer
    group: int
    name: str
    shape: torch.Size
    strides: tuple[int, ...]  # its layout in the flat
    pieces: list[tuple[int, int, int]]
    bucket: int
    piece: nn.Parameter | None = None
    owner: int = -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def span(self, rank: int) -> tuple[int, int]:
        """``rank``'s stretch of the elements, or (0, 0)."""
        return next(((start, end) for r, start, end in self.pieces if r == rank), (0, 0))


def whole_parameters(params: list[tuple[nn.Parameter, int, str]], bucket_of: dict[int, Any], world_size: int,
                     pieces: dict[int, nn.Parameter]) -> list[WholeParameter]:
    """Each of ``params`` (parameter, group, name: in torch.optim's numbering) as a WholeParameter: its holders'
    stretches from its place in its bucket (rank r holds flat elements [r w, (r + 1) w), w = length / W), and
    ``pieces[id(parameter)]``, this rank's piece, if it holds one."""
    out = []
    for index, (p, group, name) in enumerate(params):
        bucket = bucket_of[id(p)]
        offset, strides = bucket.place[id(p)]
        width = bucket.length // world_size
        holders = range(offset // width, (offset + p.numel() - 1) // width + 1)
        stretches = [(r, max(offset, r * width) - offset, min(offset + p.numel(), (r + 1) * width) - offset)
                     for r in holders]
        out.append(WholeParameter(index, group, name, p.shape, tuple(strides), stretches, bucket.index,
                                  pieces.get(id(p))))
    return out


class PieceOptimizer:
    """What both optimizers share: built over this rank's pieces with torch's own hyperparameters and checks, their
    WholeParameters and the group's collectives. ``gradients_attached`` is False from a zero_grad(set_to_none) until
    the stage gives the pieces their gradient views back (before the next forward): a step in between steps nothing,
    as torch.optim skips a parameter without .grad, and every rank decides alike (a rank may hold no piece at all
    and still takes part in the step's collectives).

    ``step_bucket(b)``: the step of bucket ``b``'s parameters alone, collectives included (a parameter lies in one
    bucket, and neither optimizer reads across parameters): what offload's streamed step runs, one bucket at a time,
    with that bucket's tensors read in (zero/offload/shards.py). Every rank runs it for every bucket the optimizer
    has a parameter in, in the same order, piece or none."""

    torch_class: type[torch.optim.Optimizer]

    def _build(self, params: list[dict[str, Any]], whole_groups: list[dict[str, Any]], settings: dict[str, Any],
               parameters: list[WholeParameter], comm: Collectives, master: torch.Tensor) -> None:
        # torch's constructor over the whole parameters: its checks (Muon's "only supports 2D parameters", the
        # hyperparameters' ranges) and its defaults; then the same groups over the pieces
        defaults = self.torch_class(whole_groups, **settings).defaults
        torch.optim.Optimizer.__init__(self, params, defaults)  # type: ignore[arg-type]
        self.whole_parameters, self.comm = parameters, comm
        self.in_bucket: dict[int, list[WholeParameter]] = {}
        for p in parameters:
            self.in_bucket.setdefault(p.bucket, []).append(p)
        # the masters' dtype and device: what every rank's messages are made of, pieces or none
        self.dtype, self.device = master.dtype, master.device
        self.gradients_attached = False  # until the first forward (the stage's before_forward)

    def zero_grad(self, set_to_none: bool = True) -> None:
        torch.optim.Optimizer.zero_grad(self, set_to_none)  # type: ignore[arg-type]
        if set_to_none:
            self.gradients_attached = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        if self.gradients_attached:
            self._step_all()
        return loss

    def _step_all(self) -> None:
        for b in sorted(self.in_bucket):
            self.step_bucket(b)

    def step_bucket(self, b: int) -> None:
        raise NotImplementedError


def closure_loss(closure: Any) -> Any:
    """The loss a step's closure re-evaluates, with gradients on (torch.optim's convention), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def newton_schulz_cost(shape: torch.Size) -> int:
    """Multiply-adds of one Newton-Schulz iteration on an m x n matrix (m <= n after torch's transpose): X X^T
    (m m n), the Gram matrix squared (m^3), its product with X (m m n)."""
    m, n = sorted(shape)
    return m * m * (2 * n + m)


def assign_owners(parameters: list[WholeParameter], world_size: int) -> list[int]:
    """[Note: Muon's placement] Each matrix's owner, the one rank that runs its Newton-Schulz (the same answer on
    every rank: it reads only shapes and layouts). Largest first, each goes to the holder of its largest piece if
    that rank's load so far is at most the fair share (total / W), else to the least-loaded rank whose load is: the
    matrices a rank owns then cost at most total / W + the largest (when a matrix is placed the loads sum to less
    than the total, so some rank is at most the fair share, and it gets at most this matrix more), while the
    holder is kept wherever the balance allows, so its own piece never travels. Returns each rank's load."""
    costs = {p.index: newton_schulz_cost(p.shape) for p in parameters}
    total = sum(costs.values())
    load = [0] * world_size
    for p in sorted(parameters, key=lambda p: (-costs[p.index], p.index)):
        fair = [r for r in range(world_size) if load[r] * world_size <= total]  # integers: the same on every rank
        holders = [r for r, start, end in sorted(p.pieces, key=lambda piece: (piece[1] - piece[2], piece[0]))]
        p.owner = next((r for r in holders if r in fair), min(fair, key=lambda r: (load[r], r)))
        load[p.owner] += costs[p.index]
    return load


@dataclass
class ExchangePlan:
    """Who sends what to whom in Muon's two all-to-alls, worked out once. Outward, rank r sends to each owner d the
    pieces r holds of d's matrices (``to_owner[d]``, in index order), and receives from each holder s the stretches
    s holds of r's own matrices (``from_holder[s]``: parameter, start, end). Back, the same segments the other way."""
    to_owner: list[list[WholeParameter]] = field(default_factory=list)
    from_holder: list[list[tuple[WholeParameter, int, int]]] = field(default_factory=list)

    @classmethod
    def of(cls, parameters: list[WholeParameter], rank: int, world_size: int) -> ExchangePlan:
        plan = cls([[] for _ in range(world_size)], [[] for _ in range(world_size)])
        for p in parameters:
            if p.piece is not None:
                plan.to_owner[p.owner].append(p)
            if p.owner == rank:
                for r, start, end in p.pieces:
                    plan.from_holder[r].append((p, start, end))
        return plan

    def send_counts(self) -> list[int]:
        return [sum(p.piece.numel() for p in owned) for owned in self.to_owner]

    def recv_counts(self) -> list[int]:
        return [sum(end - start for _, start, end in held) for held in self.from_holder]


class ShardedMuon(PieceOptimizer, torch.optim.Muon):
    """torch.optim.Muon over this rank's pieces of its matrices, exact ([Note: Muon's placement]).

    [Note: Muon's placement]
    - Who owns a matrix: ``assign_owners``, once, from the shapes: the holder of its largest piece where the balance
      allows, so a matrix inside one rank's chunk never moves; Newton-Schulz work per rank is at most 1/W of all the
      matrices' plus the largest one (the issue's bound), and each matrix is orthogonalized exactly once.
    - What a rank computes, per step: on its pieces, the momentum's lerp and Nesterov's mix (torch's own lines, in
      the master dtype), the bf16 cast Newton-Schulz would make first; one all-to-all brings every matrix's bf16
      pieces to its owner, which runs torch's ``_zeropower_via_newtonschulz`` on the whole matrix laid out as the
      parameter is (same shape and strides, so the same kernels on the same bf16 values), and a second all-to-all
      returns the bf16 result's pieces to their holders, which decay their weights and add the update scaled by the
      learning rate adjusted for the WHOLE matrix's shape (``adjust_lr_fn``): torch's arithmetic, element by element.
    - Bytes: per step each element that its matrix's owner does not hold travels twice in bf16, 4 T bytes for T
      such elements (``exchange_bytes``). AdamW sends 2 (W-1)/W Psi elements a step at stages 1-2 (a reduce-scatter
      and an all-gather; about 3K (W-1)/W Psi at stage 3), 8 (W-1)/W Psi bytes in fp32, so Muon's recipe sends
      1 + T W / (2 (W-1) Psi) times AdamW's bytes at stages 1-2: at most 1.5x, when every matrix is spread evenly
      over every rank (T = (W-1)/W Psi, each owner holding 1/W), and within the goal 1 + 1/W when
      T <= 2 (W-1) Psi / W^2. Keeping each matrix with the holder of its largest piece makes T small where matrices
      are small beside a chunk: a chunk's boundary cuts at most one parameter, so only the W-1 matrices a bucket's
      boundaries cut move at all, and of those only what lies beyond the owner's piece. The tests count it exactly
      (AdamW's bytes plus ``exchange_bytes``): 1.01-1.05x at W = 3. The anchors: Moonlight gathers every matrix's
      update on every rank in bf16 (1.25x AdamW's bytes) and repeats Newton-Schulz on every rank; DeepSpeed
      all-reduces a crossing matrix to every rank it touches (ZeRO-1/2) or gathers gradients and fp32 momentum
      (ZeRO-3); Dion makes the same two all-to-alls (about 1/(2W) of ZeRO-1's bytes more); here a matrix inside one
      chunk moves nothing, and the result is torch's to the last bit.
    - Stage 3 never gathers a weight for it: the weight decay and the add are element-wise on the shards.
    Newton-Schulz on a rank's slice instead would be another algorithm (its norm and its Gram matrix are the
    slice's: DeepSpeed's first version, 0.6 relative error); the tests fail it."""

    torch_class = torch.optim.Muon

    def __init__(self, params: list[dict[str, Any]], *, whole_groups: list[dict[str, Any]],
                 parameters: list[WholeParameter], comm: Collectives, master: torch.Tensor, **settings: Any):
        self._build(params, whole_groups, settings, parameters, comm, master)
        self.newton_schulz_load = assign_owners(parameters, comm.size)
        self.plan = ExchangePlan.of(parameters, comm.rank, comm.size)
        self.bucket_plans = {b: ExchangePlan.of(ps, comm.rank, comm.size) for b, ps in self.in_bucket.items()}

    def exchange_bytes(self) -> int:
        """Bytes this rank sends per step in the two all-to-alls (bf16, what leaves it)."""
        out, back = self.plan.send_counts(), self.plan.recv_counts()
        return 2 * (sum(out) - out[self.comm.rank] + sum(back) - back[self.comm.rank])

    def _step_all(self) -> None:
        self._exchange_step(self.whole_parameters, self.plan)  # one exchange there and back for every matrix

    @torch.no_grad()
    def step_bucket(self, b: int) -> None:
        self._exchange_step(self.in_bucket[b], self.bucket_plans[b])  # the same bytes, moved per bucket

    def _exchange_step(self, parameters: list[WholeParameter], plan: ExchangePlan) -> None:
        """``parameters`` stepped, their matrices sent by ``plan`` (theirs): each matrix's Newton-Schulz the same on
        the same bf16 values however many travel together, so a bucket at a time is the step at once, bit for
        bit."""
        # the momentum and Nesterov's mix on this rank's pieces (torch's _single_tensor_muon, line for line)
        updates: dict[int, torch.Tensor] = {}
        for p in parameters:
            if p.piece is None:
                continue
            group, grad = self.param_groups[p.group], p.piece.grad
            state = self.state[p.piece]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - group["momentum"])
            update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            updates[p.index] = update.to(torch.bfloat16)  # Newton-Schulz's own first step
        device = self.device
        out_counts, back_counts = plan.send_counts(), plan.recv_counts()

        # to the owners: each owned matrix whole, in bf16, laid out as the parameter
        outgoing = torch.cat([updates[p.index] for owned in plan.to_owner for p in owned] or
                             [torch.empty(0, dtype=torch.bfloat16, device=device)])
        pending, incoming = self.comm.all_to_all(outgoing, out_counts, back_counts, "all_to_all to the owners")
        pending.wait()
        wholes: dict[int, torch.Tensor] = {}
        at = 0
        for held in plan.from_holder:
            for p, start, end in held:
                whole = wholes.setdefault(p.index, torch.empty(p.numel, dtype=torch.bfloat16, device=device))
                whole[start:end] = incoming[at:at + end - start]
                at += end - start
        for index, whole in wholes.items():
            p = self.whole_parameters[index]
            group = self.param_groups[p.group]
            orthogonal = _zeropower_via_newtonschulz(whole.as_strided(p.shape, p.strides), group["ns_coefficients"],
                                                     group["ns_steps"], group["eps"])
            whole.as_strided(p.shape, p.strides).copy_(orthogonal)  # back into the layout order, in place

        # back to the holders, who apply it as torch does
        returning = torch.cat([wholes[p.index][start:end] for held in plan.from_holder for p, start, end in held]
                              or [torch.empty(0, dtype=torch.bfloat16, device=device)])
        pending, orthogonal_pieces = self.comm.all_to_all(returning, back_counts, out_counts, "all_to_all back")
        pending.wait()
        at = 0
        for owned in plan.to_owner:
            for p in owned:
                group = self.param_groups[p.group]
                lr = _to_scalar(group["lr"])
                adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)  # the whole matrix's shape
                p.piece.mul_(1 - lr * group["weight_decay"])
                p.piece.add_(orthogonal_pieces[at:at + p.piece.numel()], alpha=-adjusted_lr)
                at += p.piece.numel()


def factor_indices(p: WholeParameter, start: int, end: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For elements [start, end) of ``p`` in its layout order: each one's row (in ``row_var`` flattened), column (in
    ``col_var`` flattened) and batch (the leading dimensions, flattened). A dense layout's index along dimension k
    is (position // stride_k) % size_k, whatever the order of the strides."""
    position = torch.arange(start, end, device=device)
    index = [torch.zeros_like(position) if size == 1 else position.div(stride, rounding_mode="floor") % size
             for size, stride in zip(p.shape, p.strides)]
    batch = torch.zeros_like(position)
    for k in range(len(p.shape) - 2):
        batch = batch * p.shape[k] + index[k]
    rows, columns = p.shape[-2], p.shape[-1]
    return batch * rows + index[-2], batch * columns + index[-1], batch


class ShardedAdafactor(PieceOptimizer, torch.optim.Adafactor):
    """torch.optim.Adafactor over this rank's pieces of its parameters ([Note: Adafactor's statistics]).

    [Note: Adafactor's statistics] torch's step for a parameter P (``_single_tensor_adafactor``) reads, besides its
    own elements: ||P|| (the step size alpha = max(eps2, RMS(P)) rho_t, before the weight decay); for a matrix (and
    each matrix of a >2-D tensor, over its last two dimensions) the mean of g^2 along each row and each column, which
    move ``row_var`` and ``col_var``, and the mean of ``row_var`` (the estimate row_var col_var / mean); and ||update||
    (update / max(1, RMS(update) / d)). A vector's (and a 0-dim parameter's) second moment is element-wise. So a step
    is: on the pieces, the sums of squares of the weights, and per matrix the row and column sums of g^2 (each element
    into its row and column, ``factor_indices``); ONE all-reduce of all of them for a bucket's parameters (per
    parameter 1 + rows + columns numbers: small); then on every rank holding a piece the same lerp of the whole
    ``row_var`` and ``col_var`` (kept whole there, so they stay equal), the piece's estimate row_var[i] col_var[j] /
    mean and its update, and its sum of squares; a SECOND all-reduce of those (one number per parameter); then the
    add. A bucket at a time, in every mode (``step_bucket``): offload steps one bucket's tensors at a time, and an
    all-reduce's order of summation may follow the tensor's length, so the step in memory sums in the same pieces. The
    step count, eps1 (None: the dtype's eps), rho_t, the beta2 schedule step^beta2_decay and maximize are torch's.
    What differs from one process is the order of the sums: torch squares a row's norm where this adds the squares of
    a row's pieces and then the ranks', a rounding apart (test_zero_matrix argues what that amounts to). The small
    sums go through torch.distributed's all-reduce on the group under either collectives, as the clipping norm does. A
    rank keeps its pieces' updates between the two all-reduces (its shard's size, transiently)."""

    torch_class = torch.optim.Adafactor

    def __init__(self, params: list[dict[str, Any]], *, whole_groups: list[dict[str, Any]],
                 parameters: list[WholeParameter], comm: Collectives, master: torch.Tensor, **settings: Any):
        self._build(params, whole_groups, settings, parameters, comm, master)
        # where each parameter's sums sit in its bucket's first all-reduce: its weights' sum of squares, then
        # (matrices) its rows' and its columns' sums of g^2; and its place in the second
        self.sums_at: dict[int, tuple[int, slice, slice, int]] = {}
        self.sums_length: dict[int, int] = {}
        for b, in_bucket in self.in_bucket.items():
            length = 0
            for place, p in enumerate(in_bucket):
                rows, columns = (p.numel // p.shape[-1], p.numel // p.shape[-2]) if len(p.shape) >= 2 else (0, 0)
                self.sums_at[p.index] = (length, slice(length + 1, length + 1 + rows),
                                         slice(length + 1 + rows, length + 1 + rows + columns), place)
                length += 1 + rows + columns
            self.sums_length[b] = length

    @torch.no_grad()
    def step_bucket(self, b: int) -> None:
        """Bucket ``b``'s parameters stepped, with its own two all-reduces (a bucket at a time in every mode, so that
        offload's streamed step sums in the very order of the step in memory)."""
        held = [p for p in self.in_bucket[b] if p.piece is not None]

        # the first all-reduce: each parameter's sum of squares of its weights (before the decay, as torch reads
        # them), and a matrix's sums of g^2 by row and by column
        sums = torch.zeros(self.sums_length[b], dtype=self.dtype, device=self.device)
        grads: dict[int, torch.Tensor] = {}
        factors: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for p in held:
            grads[p.index] = grad = -p.piece.grad if self.param_groups[p.group]["maximize"] else p.piece.grad
            weights_at, rows_at, columns_at, _ = self.sums_at[p.index]
            sums[weights_at] = p.piece.square().sum()
            if len(p.shape) >= 2:
                factors[p.index] = rows, columns, _ = factor_indices(p, *p.span(self.comm.rank), self.device)
                squared = grad * grad
                sums[rows_at].index_add_(0, rows, squared)
                sums[columns_at].index_add_(0, columns, squared)
        dist.all_reduce(sums, group=self.comm.group)

        # each piece's update, as torch makes it, from the whole statistics
        update_sums = torch.zeros(len(self.in_bucket[b]), dtype=self.dtype, device=self.device)
        updates: dict[int, tuple[torch.Tensor, float, int]] = {}  # index -> (update, alpha, its place)
        for p in held:
            group, grad = self.param_groups[p.group], grads[p.index]
            weights_at, rows_at, columns_at, place = self.sums_at[p.index]
            lr = _to_scalar(group["lr"])
            eps1, eps2 = group["eps"]
            if eps1 is None:
                eps1 = torch.finfo(p.piece.dtype).eps
            state = self._state_of(p)
            state["step"] += 1
            step_float = state["step"].item()
            one_minus_beta2_t = step_float ** group["beta2_decay"]
            rho_t = min(lr, 1 / (step_float ** 0.5))
            alpha = max(eps2, sums[weights_at].sqrt().item() / (p.numel ** 0.5)) * rho_t
            if group["weight_decay"] != 0:
                p.piece.mul_(1 - lr * group["weight_decay"])
            if len(p.shape) >= 2:
                row_var, col_var = state["row_var"], state["col_var"]
                row_var.lerp_(sums[rows_at].view(row_var.shape).div(p.shape[-1]), one_minus_beta2_t)
                col_var.lerp_(sums[columns_at].view(col_var.shape).div(p.shape[-2]), one_minus_beta2_t)
                rows, columns, batch = factors[p.index]
                var_estimate = row_var.reshape(-1)[rows] * col_var.reshape(-1)[columns]  # row_var @ col_var's
                var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1).reshape(-1)[batch])
            else:
                variance = state["variance"]
                variance.lerp_(grad * grad, one_minus_beta2_t)
                var_estimate = variance.clone()
            update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
            update.mul_(grad)
            update_sums[place] = update.square().sum()
            updates[p.index] = (update, alpha, place)

        # the second all-reduce: the updates' norms, for their clipping
        dist.all_reduce(update_sums, group=self.comm.group)
        for p in held:
            update, alpha, place = updates[p.index]
            norm = update_sums[place].sqrt().item()
            denom = max(1.0, norm / ((p.numel ** 0.5) * self.param_groups[p.group]["d"]))
            p.piece.add_(update, alpha=-alpha / denom)

    def _state_of(self, p: WholeParameter) -> dict[str, Any]:
        """The piece's state, made as torch's _init_group makes a parameter's (the factored statistics in the whole
        parameter's shapes)."""
        state = self.state[p.piece]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            grad = p.piece.grad
            if len(p.shape) > 1:
                state["row_var"] = grad.new_zeros([*p.shape[:-1], 1])
                state["col_var"] = grad.new_zeros([*p.shape[:-2], 1, p.shape[-1]])
            else:
                state["variance"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        return state


# The whole-matrix optimizers zero steps exactly at stages 1-3: torch's class -> the class over pieces
WHOLE_MATRIX: dict[type[torch.optim.Optimizer], type[PieceOptimizer]] = {
    torch.optim.Muon: ShardedMuon, torch.optim.Adafactor: ShardedAdafactor}
# The parameter dimensions a probe of the state (zero.optimizer_kinds.state_kinds) must try: Muon steps matrices only;
# Adafactor keeps a vector's variance, and a matrix's row_var and col_var
PROBE_DIMS: dict[type[torch.optim.Optimizer], tuple[int, ...]] = {torch.optim.Muon: (2,), torch.optim.Adafactor: (1, 2)}
