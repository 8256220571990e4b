"""The optimizer side of ZeRO stages 1-3 (each stage of zero/stages.py and zero/stage3.py holds a ShardedOptimizer):
this rank's runs of the flat buckets as the tensors of any element-wise torch.optim optimizer (and, for Muon and
Adafactor, its pieces of each parameter, stepped by zero/matrix.py), their parameter groups, several optimizers
over one model ([Note: several optimizers]), the whole model's clipping norm, and the optimizer's state in
torch.optim's ordinary, unsharded form and back. Which optimizers the runs can carry ([Note: which optimizers]) and
the probe of what state an optimizer keeps, and the forms an optimizer argument takes (one or several),
are zero/optimizer_kinds.py's.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from collectives import Collectives
from zero.buckets import Bucket
from zero.matrix import WHOLE_MATRIX, PieceOptimizer, whole_parameters
from zero.offload.gradients import Gradients
from zero.offload.shards import StoredState, Streamed, offloaded_class
from zero.offload.store import Store
from zero.optimizer_kinds import check_optimizer_class
from zero.optimizer_state import Layout, ShardRun, StateDicts
from zero.pieces import OptimizerView, covers


def as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """torch.optim's two ways of giving parameters: an iterable of tensors, or of dicts (parameter groups)."""
    params = list(params)
    if not params:
        raise ValueError("sharded.optimizer got an empty parameter list")
    if not isinstance(params[0], dict):
        params = [{"params": params}]
    return [{**group, "params": list(group["params"]) if not torch.is_tensor(group["params"])
             else [group["params"]]} for group in params]


def total_norm(norms: list[torch.Tensor], norm_type: float, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The ``norm_type``-norm of a vector cut into parts over the group's ranks, given each of this rank's parts'
    ``norm_type``-norms: each rank's sum of |g|^p (its max |g| for the inf-norm), one all-reduce of that one
    number, then the p-th root."""
    norms = torch.stack(norms)
    if math.isinf(norm_type):
        total = norms.max()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    total = norms.pow(norm_type).sum()
    dist.all_reduce(total, group=group)
    return total.pow(1.0 / norm_type)


class ShardedOptimizer(StateDicts):
    """The optimizer side of stages 1-3, a part each stage holds (``stage.shards``) and hands its buckets, its
    weights' and gradients' shards, and what to do after a step. Rank r owns chunk r of every bucket's flat (the
    r-th of W equal slices): ``weights[b]`` is this rank's chunk of bucket b's weights, ``grads[b]`` its averaged,
    accumulated gradient. The stage calls ``before_forward()`` before each forward; ``optimizer()`` and
    ``clip_grad_norm_()`` are the stage's own, as zero.shard's contract has them.

    [Note: parameter groups] ``optimizer(cls, params_or_groups)`` takes the model's own parameters, grouped as for
    any torch.optim optimizer, and builds ``cls`` over this rank's pieces of them: each bucket's chunk is cut into
    runs at every change of group (a run is one tensor of the inner optimizer, a view of ``weights[b]``, its .grad
    a view of ``grads[b]``), so each group's hyperparameters apply to exactly its parameters' elements. Buckets
    are not formed per group because a group's parameters are spread over the model (decay on matrices, none on
    the biases and norms beside them): per-group buckets would fill and launch out of backward's order. This is
    exact for any elementwise optimizer (SGD with momentum and weight decay, Adam, AdamW: each element's update
    reads only that element's weight, gradient and state), and wrong for one that takes a norm over a whole
    tensor (LAMB, LARS, Muon): those would see a run. Padding stays zero, and is in no run.

    [Note: which optimizers] Known element-wise, so exact on runs (``ELEMENTWISE``): SGD (momentum, Nesterov),
    Adam (amsgrad), AdamW, Adamax, NAdam, RAdam, Adagrad, Adadelta, RMSprop (centered, momentum), Rprop, ASGD; a
    user's own element-wise class is added with ``zero.ELEMENTWISE.add(cls)``. Whole-matrix, exact on pieces
    (``WHOLE_MATRIX``, zero/matrix.py): Muon (the element-wise parts on the pieces, each matrix's Newton-Schulz once,
    on its owner, by torch's own function, the pieces brought there and back by all-to-alls in bf16: to the last bit
    of torch's) and Adafactor (the row and column statistics and the norms summed over the ranks in two small
    all-reduces a bucket: torch's arithmetic, its sums in another order). Their runs are cut at every parameter's
    boundary (pieces), the buckets and chunks stay what they are: the stages' memory and traffic are unchanged, and
    what a matrix needs whole travels on its own. Refused in one line at ``sharded.optimizer`` (``WHOLE_PARAMETER``):
    LBFGS (dot products over the whole gradient, and a closure), SparseAdam (sparse gradients); so is any class not
    declared, since a run would silently give it another algorithm. For those, torch's ZeroRedundancyOptimizer
    (whole parameters placed on ranks; references.py, the trainer's ``--grad-sync ddp --zero 1``) and stage 0
    (whole parameters on every rank) remain: the refusal names both.

    [Note: several optimizers] ``optimizer()`` may be called once per disjoint set of parameters (Muon's recipe:
    Muon on the hidden matrices, AdamW on embeddings, head, norms and biases), and the loop steps each:
    ``opt_a.step(); opt_b.step()``. Their parameters share buckets (a block's matrices and its biases), and a
    bucket's weights may be gathered (stages 1-2), or its unit prefetched (stage 3), only once every optimizer with a
    parameter in it has stepped: gathered after the first, it would be gathered again after the second (twice the
    bytes), and a stage-3 prefetch launched after the first would carry the second's old weights into the next
    forward. So a step marks its buckets stepped by it, and the stage's after-step runs for the buckets every
    owner has now stepped, once each (``_stepped``). A bucket some owner did not step (a scaler that skipped one
    optimizer) is finished before the next forward, the model's state dict and close() (``finish_steps``): the
    model is whole after both steps, and always before it is used.
    """

    def __init__(self, stage: int, buckets: list[Bucket], names: dict[int, str], comm: Collectives,
                 weights: list[torch.Tensor], grads: list[torch.Tensor | None],
                 after_step: Callable[[list[Bucket]], None], lazy_gradients: bool = False, *,
                 device: torch.device, store: Store | None = None, gradients: Gradients | None = None):
        self.stage, self.buckets, self.names, self.comm = stage, buckets, names, comm
        self.device = device  # the masters' (where the weights, gradients and state live while used)
        self.rank, self.world_size = comm.rank, comm.size
        self.bucket_of = {id(p): bucket for bucket in buckets for p in bucket.params}
        self.weights, self.grads = weights, grads  # grads: the stage's list; None where a shard is dropped
        self.lazy_gradients = lazy_gradients  # stages 2-3 ([Note: gradient shards]); stage 1's are the flats
        self.after_step = after_step  # given the buckets a step updated ([Note: after the step])
        self.layouts: weakref.WeakKeyDictionary[torch.optim.Optimizer, Layout] = weakref.WeakKeyDictionary()
        self.loading_runs: set[int] = set()  # id() of an optimizer loading its runs' own state (load_run_state)
        self.stepped: dict[int, set[int]] = {}  # bucket index -> id of each layout that stepped it since its gather
        self.hook = register_optimizer_step_pre_hook(self._refuse_outside_optimizer)  # the stage's close() removes it
        # offload (zero/offload/shards.py): the state in the store, the step streamed bucket by bucket; with
        # ``gradients`` (stage 3) the weights' and gradients' shards too, placeholders in ``weights`` and ``grads``
        self.streamed = Streamed(store, self, gradients) if store is not None else None
        self.offloaded_gradients = gradients is not None

    def chunk_bounds(self, bucket: Bucket) -> tuple[int, int]:
        width = bucket.length // self.world_size
        return self.rank * width, (self.rank + 1) * width

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any],
                  **settings: Any) -> torch.optim.Optimizer:
        """``optimizer_class`` over this rank's runs of ``params`` (the model's parameters, or groups of them:
        [Note: parameter groups]); step() updates the model ([Note: after the step], [Note: several optimizers]).
        Muon and Adafactor get this rank's pieces of each parameter, stepped by zero/matrix.py; LBFGS, SparseAdam
        and undeclared classes are refused here ([Note: which optimizers])."""
        check_optimizer_class(optimizer_class, self.stage)
        self.settle()
        groups = as_groups(params)
        layout = Layout({}, [], optimizer_class, per_parameter=optimizer_class in WHOLE_MATRIX)
        for g, group in enumerate(groups):
            layout.groups.append([])
            for p in group["params"]:
                if id(p) not in self.bucket_of:
                    raise ValueError(f"sharded.optimizer: a {tuple(p.shape)} tensor in parameter group {g} is not a "
                                     f"trainable parameter of the sharded model")
                if id(p) in layout.index:
                    raise ValueError(f"sharded.optimizer: parameter {self.names[id(p)]} is in more than one "
                                     f"parameter group")
                layout.index[id(p)] = (g, len(layout.index))
                layout.groups[-1].append(len(layout.index) - 1)
        runs = self._runs(layout)
        layout.runs = [run for g in range(len(groups)) for run in runs if run.group == g]  # inner numbering
        for run in layout.runs:
            if self.offloaded_gradients:  # the weights in the store: a placeholder, until a step binds them
                run.param = self.streamed.run_parameter(run, self.weights[0].dtype, self.device)
                continue
            run.param = nn.Parameter(self._piece(self.weights, run))
            if self.grads[run.bucket.index] is not None:  # (else made by the first backward: attach_gradients)
                run.param.grad = self._piece(self.grads, run)
        inner = [{**{k: v for k, v in group.items() if k != "params"},
                  "params": [run.param for run in layout.runs if run.group == g]} for g, group in enumerate(groups)]
        if layout.per_parameter:
            ordered = sorted(((p, *layout.index[id(p)]) for group in groups for p in group["params"]),
                             key=lambda entry: entry[2])
            pieces = {id(run.covers[0].param): run.param for run in layout.runs}
            parameters = whole_parameters([(p, g, self.names[id(p)]) for p, g, _ in ordered], self.bucket_of,
                                          self.world_size, pieces)
            piece_class = WHOLE_MATRIX[optimizer_class]
            optimizer = (piece_class if self.streamed is None else offloaded_class(piece_class))(
                inner, whole_groups=groups, parameters=parameters, comm=self.comm,
                master=torch.empty(0, dtype=self.weights[0].dtype, device=self.device), **settings)  # (stage 3's
            # offloaded weights are placeholders: their dtype, the masters' device)
        else:
            optimizer = (optimizer_class if self.streamed is None else offloaded_class(optimizer_class))(inner,
                                                                                                    **settings)
        layout.buckets = sorted({self.bucket_of[pid].index for pid in layout.index})
        self.layouts[optimizer] = layout
        if self.streamed is not None:
            self.streamed.adopt(optimizer, layout)
        optimizer.register_step_post_hook(lambda *_: self._stepped(layout))
        optimizer.register_state_dict_pre_hook(lambda _: self.settle())
        optimizer.register_state_dict_post_hook(self._full_optimizer_state)
        optimizer.register_load_state_dict_pre_hook(self._sharded_optimizer_state)
        return optimizer

    def view(self, optimizer: torch.optim.Optimizer) -> OptimizerView:
        """What this rank holds of ``optimizer``, for its checkpoints (zero/pieces.py's OptimizerView): the class
        asked for, the model's parameters in torch.optim's numbering with their groups, and the runs. One not built
        by ``optimizer()`` is refused in one line."""
        layout = self.layouts.get(optimizer)
        if layout is None:
            raise ValueError(f"zero.checkpoint: this {type(optimizer).__name__} was not built by this sharded "
                             f"model's sharded.optimizer")
        by_id = {id(p): p for bucket in self.buckets for p in bucket.params}
        number = {index: pid for pid, (_, index) in layout.index.items()}
        stored = StoredState(self.streamed, optimizer) if self.streamed is not None else None
        return OptimizerView(layout.torch_class, [(g, by_id[number[index]]) for g, indices in enumerate(layout.groups)
                                                  for index in indices], layout.runs, stored=stored)

    def _piece(self, chunks: list[torch.Tensor], run: ShardRun) -> torch.Tensor:
        """The run's stretch of its bucket's chunk in ``chunks`` (``weights`` or ``grads``): a view."""
        lo, _ = self.chunk_bounds(run.bucket)
        return chunks[run.bucket.index][run.start - lo:run.end - lo]

    def _runs(self, layout: Layout) -> list[ShardRun]:
        """This rank's chunk of every bucket, cut at every change of parameter group (and around parameters in
        no group, which no optimizer steps); for a whole-matrix optimizer at every parameter's boundary."""
        runs: list[ShardRun] = []
        for bucket in self.buckets:
            lo, hi = self.chunk_bounds(bucket)
            for p, start in zip(bucket.params, bucket.offsets):
                first, last = max(lo, start), min(hi, start + p.numel())
                if first >= last or id(p) not in layout.index:
                    continue
                g = layout.index[id(p)][0]
                if (runs and runs[-1].bucket is bucket and runs[-1].group == g and runs[-1].end == first
                        and not layout.per_parameter):
                    runs[-1].end = last
                else:
                    runs.append(ShardRun(bucket, first, last, g))
        for run in runs:
            run.covers = covers(run.bucket, run.start, run.end)
        return runs

    def settle(self) -> None:
        """Offload at stage 3: every step still pending taken (zero/offload/shards.py's [Note: the step just in
        time]), before the state, the weights or the gradients are read other than by the next forward."""
        if self.streamed is not None:
            self.streamed.settle_all()

    def before_forward(self) -> None:
        """Before each forward: the buckets still waiting for an optimizer's step finished ([Note: several
        optimizers]); with ``lazy_gradients``, each gradient shard whose runs all had their .grad set to None by
        zero_grad() dropped (the next backward makes it anew: [Note: gradient shards]); and each run's .grad its
        view of the gradient shard, put back, zeroed, where zero_grad() set it to None and the shard stays. (Offloaded
        gradients are bound by the step alone, and let go of by zero_grad(): zero/offload/shards.py.)"""
        self.finish_steps()
        for optimizer in self.layouts:
            if isinstance(optimizer, PieceOptimizer):
                optimizer.gradients_attached = True
        if self.offloaded_gradients:
            return
        self.drop_released_gradients()
        for layout in self.layouts.values():
            for run in layout.runs:
                if run.param.grad is None and self.grads[run.bucket.index] is not None:
                    view = self._piece(self.grads, run)
                    view.zero_()
                    run.param.grad = view

    def drop_released_gradients(self) -> None:
        """With ``lazy_gradients``: each gradient shard whose runs all had their .grad set to None by zero_grad()
        dropped (before a forward, and before a save reads what the rank holds)."""
        if self.lazy_gradients and not self.offloaded_gradients:
            for bucket in self.buckets:
                runs = [run for layout in self.layouts.values() for run in layout.runs if run.bucket is bucket]
                if runs and self.grads[bucket.index] is not None and all(run.param.grad is None for run in runs):
                    self.grads[bucket.index] = None

    def attach_gradients(self, bucket: Bucket) -> None:
        """A gradient shard just made (lazy_gradients): the .grad of each run in it that has none, its view."""
        if self.offloaded_gradients:
            return
        for layout in self.layouts.values():
            for run in layout.runs:
                if run.bucket is bucket and run.param.grad is None:
                    run.param.grad = self._piece(self.grads, run)

    def _stepped(self, layout: Layout) -> None:
        """After an optimizer's step ([Note: several optimizers]): its buckets marked stepped by it, and the
        stage's after-step run for those that every optimizer with a parameter in them has now stepped. Every rank
        runs the same steps over the same layouts, so every rank finds the same buckets."""
        owners = {b: {id(other) for other in self.layouts.values() if b in other.buckets} for b in layout.buckets}
        ready = []
        for b in layout.buckets:
            self.stepped.setdefault(b, set()).add(id(layout))
            if owners[b] <= self.stepped[b]:
                ready.append(b)
                del self.stepped[b]
        if ready:
            self.after_step([self.buckets[b] for b in ready])

    def stepped_by_any(self, bucket: Bucket) -> bool:
        """Whether any optimizer holds a parameter of ``bucket`` (else no step changes its shards)."""
        return any(bucket.index in layout.buckets for layout in self.layouts.values())

    def finish_steps(self) -> None:
        """The stage's after-step for every bucket that some, not all, of its optimizers have stepped since its
        last one (an optimizer whose step was skipped): before anything reads the model."""
        if self.stepped:
            waiting, self.stepped = sorted(self.stepped), {}
            self.after_step([self.buckets[b] for b in waiting])

    def _refuse_outside_optimizer(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before any optimizer's step: one built over the model's own parameters, not by ``optimizer()``, would
        step gradients that are not the averaged ones (stage 1) or none at all (stages 2, 3)."""
        if optimizer in self.layouts:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in self.bucket_of:
                    kind = type(optimizer).__name__
                    raise RuntimeError(f"zero.shard(stage {self.stage}): this {kind} steps the model's own parameters,"
                                       f" which stage {self.stage} keeps no averaged gradient for; build it with "
                                       f"sharded.optimizer(torch.optim.{kind}, params, ...) instead")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for the whole model, whose gradient is spread over the ranks' chunks:
        each rank's share of the norm, one all-reduce of one number, then every chunk scaled by the same
        max_norm / (norm + 1e-6), clamped to 1 (torch's formula). After the last backward of a window; under fp16
        after the scaler's unscale_(optimizer). Returns the total norm."""
        norm_type = float(norm_type)
        self.settle()
        present = [b for b, g in enumerate(self.grads) if g is not None]  # (lazy: a bucket no backward reached)
        if self.offloaded_gradients:  # each shard's norm, taken when complete; the factor applied when read
            norms = self.streamed.gradients.norms_of(present, norm_type)
        else:
            norms = [torch.linalg.vector_norm(self.grads[b], norm_type) for b in present]
        total = total_norm(norms, norm_type, self.comm.group)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
                               f"clipped (error_if_nonfinite=True)")
        clip = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if self.offloaded_gradients:
            self.streamed.gradients.scale(present, clip)
        else:
            torch._foreach_mul_([self.grads[b] for b in present], clip)
        return total
