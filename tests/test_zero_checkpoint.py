"""zero.checkpoint: sharded checkpoints in torch.distributed.checkpoint's (DCP's) format, checked against one process
on the global batch and against FSDP2, in the session's reusable gloo workers (one call per world size).

- The chunk arithmetic alone (no processes): every range of every small shape, row-major and permuted layouts
  (channels-last), is cut into boxes that tile it exactly in memory order, none empty, at most 2(n-1)+1; DCP's
  planners with those boxes round-trip tensors cut into pieces, in one process.
- test_zero_contract's GPT (tied head), its nanoGPT optimizer set-up (AdamW, decay groups, warm-up schedule, a clip
  that bites) and 2 micro-batches per step, float64, on a global batch of GLOBAL sequences that 2, 3 and 4
  processes split alike: STEPS steps at stage 3 on 3 processes, saved (the schedule and more in ``extra``) with
  every tensor collective made to raise; loaded at stages 0-3 on 2 processes (stage 2 on the ring), each going on
  MORE steps: within 1e-10 of one process's STEPS + MORE steps; loaded at stage 2 on 4 processes and hybrid 2 x 2
  at stage 3: the state dicts as saved, bit for bit. The same both ways with FSDP2: fully_shard + get_state_dict +
  dcp.load + set_state_dict goes on from ours, and ours from what that FSDP2 program saved by dcp.save. float32
  weights over float64 masters: loaded at stage 3 and at stage 1, the next step as the run that went on. A frozen
  parameter (sharded at stage 3: written as each rank's boxes) and a buffer (written once, whole), loaded. Muon +
  AdamW (saved at stage 3) and Adafactor + AdamW (stage 1, ring) on 3 processes, loaded on 2 at two other stages each
  (0 among them: torch's own optimizers), the state as saved and MORE steps within 1e-12 of one process; FSDP2 with
  torch's Muon and AdamW reads the Muon checkpoint. On a GPU (skipped without one), two ranks share it over gloo:
  saved at stage 3, loaded at stage 1, bit for bit.
- The format: ``dcp_to_torch_save`` of ours is exactly the gathered state dicts (sharded.model_state_dict(),
  optimizer.state_dict() by parameter name) at stage 3 on 3 processes, stage 0 on 2, hybrid, and under
  param_dtype (the masters); two optimizers are merged as get_state_dict merges them; each rank's file holds
  exactly its own boxes, the replicas of hybrid sharding one copy; a load reads exactly the elements the rank's
  shards hold.
- Bad input is refused in one line naming the folder, the same on every rank, before anything is changed.

Why the tolerance holds (test_zero_contract's argument): everything is float64, the sharded runs sum the same terms
as one process in another order (ranks, micro-batches, reduce-scatter or the ring), ~1e-16 relative per gradient,
which a handful of AdamW steps amplify to ~1e-13 at most. A checkpoint that lost or misplaced anything is first
order: a box written to the wrong offset or a run's state cut at the wrong element moves weights by ~lr = 1e-2; a
lost step count or learning rate (the schedule) moves every update by a factor; a lost moment by ~lr.
"""
import contextlib
import math
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero
from test_zero_contract import (CONTEXT, K, SEED, VOCAB, WEIGHT_TOL, configure_optimizers, loss_sum, make_model,
                                plain_optimizer, reference, warmup)
from zero_testing import attempt, cloned, identical, max_difference

GLOBAL = 24  # sequences per optimizer step over all ranks: 2, 3 and 4 processes each take K micro-batches of it
STEPS, MORE = 3, 2  # steps before the checkpoint; steps after it is loaded
MAX_NORM = 0.02  # below every step's gradient norm (checked on the reference): the clip scales every step
EXTRA = {"position": {"step": STEPS, "epoch": 0}, "history": [{"loss": 3.25}, {"loss": 3.0}], "by_epoch": {1: 0.5},
         "scaler": {}, "rng": torch.arange(5), "pair": (torch.ones(2), "a"), "note": None}


# ----------------------------------------------------------------------------------------------------------
# The chunk arithmetic, alone
# ----------------------------------------------------------------------------------------------------------
def memory_positions(shape, strides, box):
    """The memory positions (offsets into a dense storage laid out by ``strides``) of a box's elements."""
    (offsets, sizes) = box
    index = torch.zeros(sizes if sizes else (), dtype=torch.long)
    for d, (offset, size, stride) in enumerate(zip(offsets, sizes, strides)):
        along = (torch.arange(size) + offset) * stride
        index = index + along.view([size if e == d else 1 for e in range(len(sizes))])
    return index.flatten().tolist() if sizes else [0]


LAYOUTS = [((5,), None), ((3, 4), None), ((2, 3, 4), None), ((2, 1, 3, 2), None), ((1, 4, 1), None),
           ((2, 3, 2, 2), torch.channels_last), ((3, 1, 2, 2), torch.channels_last), ((4, 3), "transposed")]


def layout_of(shape, kind):
    t = torch.empty(shape)
    if kind == "transposed":
        t = torch.empty(tuple(reversed(shape))).t()
    elif kind is not None:
        t = t.contiguous(memory_format=kind)
    return t.stride()


@pytest.mark.parametrize("shape, kind", LAYOUTS)
def test_boxes_tile_every_range_in_memory_order_within_the_bound(shape, kind):
    """Every range [start, end) of the tensor's memory order: the boxes cover exactly those memory positions, in
    order (so each is contiguous, and a view of the range), none empty, at most 2(n-1)+1 of them."""
    strides = layout_of(shape, kind)
    order = zero.checkpoint.memory_order(shape, strides)
    numel = math.prod(shape)
    bound = 2 * (len(shape) - 1) + 1
    most = 0
    for start in range(numel):
        for end in range(start + 1, numel + 1):
            boxes = zero.checkpoint.layout_boxes(shape, order, start, end)
            covered = []
            for box in boxes:
                assert all(size > 0 for size in box[1]), box
                positions = sorted(memory_positions(shape, strides, box))
                assert positions == list(range(positions[0], positions[0] + len(positions))), box  # contiguous
                covered += positions
            assert covered == list(range(start, end)), (start, end, boxes)
            assert len(boxes) <= bound
            most = max(most, len(boxes))
    assert most <= bound


def test_the_bound_is_reached():
    """A range from inside the first row of a 3-D tensor to inside its last: 2 boxes, the middle, 2 boxes."""
    boxes = zero.checkpoint.range_boxes((3, 4, 5), 1, 59)
    assert boxes == [((0, 0, 1), (1, 1, 4)), ((0, 1, 0), (1, 3, 5)), ((1, 0, 0), (1, 4, 5)), ((2, 0, 0), (1, 3, 5)),
                     ((2, 3, 0), (1, 1, 4))]


def test_the_memory_order_of_a_layout():
    assert zero.checkpoint.memory_order((2, 3, 4, 5), torch.empty(2, 3, 4, 5).stride()) == (0, 1, 2, 3)
    channels_last = torch.empty(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    assert zero.checkpoint.memory_order(channels_last.shape, channels_last.stride()) == (0, 2, 3, 1)
    assert zero.checkpoint.range_boxes((), 0, 1) == [((), ())]
    assert zero.checkpoint.range_boxes((3, 4), 5, 5) == []
    assert zero.checkpoint.range_boxes((3, 4), 0, 12) == [((0, 0), (3, 4))]


def test_the_planners_round_trip_pieces_in_one_process(tmp_path):
    """DCP's own machinery in one process (no_dist): tensors of several layouts (channels-last, transposed, 0-dim)
    cut into pieces, saved as boxes; dcp_to_torch_save gives them whole; loaded into pieces cut elsewhere."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    generator = torch.Generator().manual_seed(0)
    tensors = {"cube": torch.randn(5, 4, 3, generator=generator, dtype=torch.float64),
               "conv": torch.randn(3, 4, 5, 2, generator=generator).contiguous(memory_format=torch.channels_last),
               "transposed": torch.randn(6, 7, generator=generator).t(), "scalar": torch.tensor(2.5)}

    def shards(tensor, cuts):
        order = zero.checkpoint.memory_order(tensor.shape, tensor.stride())
        memory = tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())
        bounds = [0, *[c for c in cuts if c < tensor.numel()], tensor.numel()]
        return zero.checkpoint.Shards(tuple(tensor.shape), tensor.dtype, order,
                                      [(a, b, memory[a:b]) for a, b in zip(bounds, bounds[1:])])

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp.save({"model": {k: shards(t, [7, 23, 41]) for k, t in tensors.items()}}, checkpoint_id=tmp_path / "c",
                 planner=zero.checkpoint.ShardSavePlanner(), no_dist=True)
        dcp_to_torch_save(tmp_path / "c", tmp_path / "c.pt")
        fresh = {k: torch.zeros_like(t) for k, t in tensors.items()}
        dcp.load({"model": {k: shards(t, [11, 12, 30]) for k, t in fresh.items()}}, checkpoint_id=tmp_path / "c",
                 planner=zero.checkpoint.ShardLoadPlanner(), no_dist=True)
    whole = torch.load(tmp_path / "c.pt", weights_only=True)["model"]
    for name, tensor in tensors.items():
        assert torch.equal(whole[name], tensor) and torch.equal(fresh[name], tensor), name
    # no copy: every box written is the piece's own memory, on a storage of exactly its bytes (DCP's writer copies
    # any other, and keeps what it wrote until the file is closed)
    for tensor in tensors.values():
        for _, _, view in shards(tensor, [7, 23, 41]).boxes():
            assert view.untyped_storage().nbytes() == view.nbytes
            assert tensor.data_ptr() <= view.data_ptr() < tensor.data_ptr() + tensor.untyped_storage().nbytes()


# ----------------------------------------------------------------------------------------------------------
# Training: the contract's recipe on a global batch that 2, 3 and 4 processes split alike
# ----------------------------------------------------------------------------------------------------------
def make_data() -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(0, VOCAB, (STEPS + MORE, GLOBAL, CONTEXT + 1), generator=generator)


def micro_batch(data, step, rank, world_size, k, micro_batches=K):
    per = GLOBAL // world_size // micro_batches
    first = (rank * micro_batches + k) * per
    return data[step, first:first + per]


def train(model, sync, optimizer, scheduler, data, steps, rank, world_size, micro_batches=K):
    """``micro_batches`` per step, the whole model's clip, the step. ``sync`` None: an FSDP2 model (its own switch,
    torch's clipping)."""
    for step in steps:
        for k in range(micro_batches):
            (model if sync is None else sync).set_requires_gradient_sync(k == micro_batches - 1)
            tokens = micro_batch(data, step, rank, world_size, k, micro_batches)
            (loss_sum(model, tokens) / (GLOBAL // world_size * CONTEXT)).backward()
        if sync is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        else:
            sync.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def parameter_names(model: nn.Module) -> list[str]:
    """The trainable parameters' names in configure_optimizers' numbering (decay group, then the rest)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]


def by_name(optimizer_state: dict, names: list[str]) -> dict:
    """torch.optim's state dict with its parameter numbers made names (get_state_dict's form)."""
    return {"state": {names[int(i)]: entry for i, entry in optimizer_state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]}


def gathered(sharded, optimizers, model) -> dict:
    """The whole state dicts (every rank calls them; the group's rank 0 keeps them), by name."""
    names = parameter_names(model)
    state = {"model": cloned(sharded.model_state_dict()),
             "optimizer": [cloned(o.state_dict()) for o in optimizers]}
    if state["model"]:
        state["optimizer"] = [by_name(s, names) if len(optimizers) == 1 else s for s in state["optimizer"]]
    return state


def own_boxes(sharded, optimizers) -> set:
    """(flat key, offsets) of every box this rank offers: its shards' boxes, as the save planner makes them."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    state = {"model": zero.checkpoint.model_entries(sharded),
             "optimizer": zero.checkpoint.optimizer_entries(sharded, optimizers)}
    flat, _ = flatten_state_dict(state)
    return {(key, offsets) for key, value in flat.items() if isinstance(value, zero.checkpoint.Shards)
            for offsets, _, _ in value.boxes()}


TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
                      "broadcast", "gather", "scatter", "reduce", "all_to_all", "all_to_all_single", "send", "recv",
                      "isend", "irecv", "batch_isend_irecv")
OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")


@contextlib.contextmanager
def tensor_collectives_refused():
    """Every tensor collective raises, but inside an object collective (which torch builds from them): what DCP's
    planning uses, and nothing else, goes through."""
    from torch.distributed import distributed_c10d
    inside = [0]
    saved = {}

    def refusing(name, function):
        def call(*args, **kwargs):
            if not inside[0]:
                raise RuntimeError(f"tensor collective {name} called where none may be")
            return function(*args, **kwargs)
        return call

    def allowing(function):
        def call(*args, **kwargs):
            inside[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                inside[0] -= 1
        return call

    for module in (dist, distributed_c10d):
        for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
            if hasattr(module, name):
                saved[module, name] = getattr(module, name)
                wrapped = refusing(name, saved[module, name]) if name in TENSOR_COLLECTIVES else allowing(
                    saved[module, name])
                setattr(module, name, wrapped)
    try:
        yield
    finally:
        for (module, name), function in saved.items():
            setattr(module, name, function)


def fsdp2_model(seed: int, optimizers: int = 1):
    from torch.distributed.fsdp import fully_shard
    model = make_model(seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if optimizers == 1:
        optimizer = configure_optimizers(model, plain_optimizer)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    return model, two_optimizers(model, plain_optimizer), None


def two_optimizers(model, factory):
    """Decay on the matrices by one AdamW, the rest by another with its own learning rate."""
    params = list(model.parameters())
    return [factory(torch.optim.AdamW, [p for p in params if p.dim() >= 2], lr=1e-2, weight_decay=0.1),
            factory(torch.optim.AdamW, [p for p in params if p.dim() < 2], lr=5e-3, weight_decay=0.0)]


# Muon and Adafactor beside AdamW (zero/matrix.py): saved at one stage on 3 processes, loaded at others on 2
MATRIX_SAVED = {"muon": (3, "torch"), "adafactor": (1, "ring")}  # recipe -> the stage and collectives it is saved at
MATRIX_LOADED = [("muon", 2, "ring"), ("muon", 0, "torch"), ("adafactor", 3, "torch"), ("adafactor", 0, "torch")]
MATRIX_TOL = 1e-12


def matrix_optimizers(model, factory, recipe: str) -> list:
    """``factory(cls, groups, **settings)``: sharded.optimizer, or torch.optim's own. "muon": Muon's recipe, Muon on
    the blocks' matrices, AdamW (decay on the matrices) on the rest: the embeddings, the tied head, biases and
    LayerNorms. "adafactor": Adafactor on every matrix (row_var and col_var), AdamW on the vectors. Not Adafactor
    on the vectors here: the key third of the qkv bias has a true gradient of 0 (a constant added to every key
    leaves the softmax as it is), and Adafactor's eps1 (float64's 2.2e-16) makes the rounding noise it gets into
    steps that depend on the order of the sums: torch's own Adafactor over every parameter, on the global batch
    against the same gradient summed as 2 ranks' micro-batches, ends 2.7e-11 apart there (measured), torch against
    itself as much as ours against torch (test_zero_matrix has Adafactor on vectors, on a model without such a
    parameter)."""
    params = list(model.parameters())
    if recipe == "muon":
        matrices = [p for block in model.blocks for p in block.parameters() if p.dim() == 2]
        rest = [p for p in params if all(p is not m for m in matrices)]
        return [factory(torch.optim.Muon, matrices, lr=0.02, momentum=0.95, weight_decay=0.1),
                factory(torch.optim.AdamW, [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
                                            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                        lr=1e-2, betas=(0.9, 0.95))]
    return [factory(torch.optim.Adafactor, [p for p in params if p.dim() >= 2], lr=1e-2, weight_decay=0.01),
            factory(torch.optim.AdamW, [p for p in params if p.dim() < 2], lr=1e-2, weight_decay=0.0)]


def train_matrix(model, sync, optimizers, data, steps, rank, world_size):
    """K micro-batches per step, the whole model's clip, every optimizer's step."""
    for step in steps:
        for k in range(K):
            sync.set_requires_gradient_sync(k == K - 1)
            tokens = micro_batch(data, step, rank, world_size, k)
            (loss_sum(model, tokens) / (GLOBAL // world_size * CONTEXT)).backward()
        sync.clip_grad_norm_(MAX_NORM)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def matrix_reference(recipe: str) -> dict:
    """One process, the global batch, torch's optimizers: the weights after STEPS + MORE steps."""
    data = make_data()
    model = make_model(SEED)
    optimizers = matrix_optimizers(model, plain_optimizer, recipe)
    for step in range(STEPS + MORE):
        tokens = data[step]
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return cloned(model.state_dict())


def matrix_recipes_on_three(rank, world_size, root, data) -> dict:
    """Each recipe STEPS steps at its MATRIX_SAVED stage, saved; the whole state dicts (rank 0's)."""
    out = {}
    for recipe, (stage, collectives) in MATRIX_SAVED.items():
        model = make_model(SEED)
        sharded = zero.shard(model, stage, collectives=collectives)
        optimizers = matrix_optimizers(model, sharded.optimizer, recipe)
        train_matrix(model, sharded, optimizers, data, range(STEPS), rank, world_size)
        zero.checkpoint.save(os.path.join(root, recipe), sharded, optimizers)
        out[recipe] = gathered(sharded, optimizers, model)
        sharded.close()
    return out


def matrix_recipes_on_two(rank, world_size, root, data) -> dict:
    """Each MATRIX_LOADED case: a model of other weights loads its recipe's checkpoint (stage 0: torch's own
    optimizers over whole parameters), its whole state dicts right after, then MORE steps; FSDP2 with torch's Muon
    and AdamW over DTensors loads the Muon recipe's (get_state_dict, dcp.load, set_state_dict): its state by name,
    whole, and the paths its get_state_dict gives."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    out = {}
    for recipe, stage, collectives in MATRIX_LOADED:
        model = make_model(SEED + 1000)
        sharded = zero.shard(model, stage, collectives=collectives)
        optimizers = matrix_optimizers(model, sharded.optimizer, recipe)
        zero.checkpoint.load(os.path.join(root, recipe), sharded, optimizers)
        loaded_state = gathered(sharded, optimizers, model)
        train_matrix(model, sharded, optimizers, data, range(STEPS, STEPS + MORE), rank, world_size)
        out[recipe, stage] = {"loaded": loaded_state, "weights": cloned(sharded.model_state_dict())}
        sharded.close()

    model = make_model(SEED + 1000)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizers = matrix_optimizers(model, plain_optimizer, "muon")
    model_state, optimizer_state = get_state_dict(model, optimizers)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=os.path.join(root, "muon"))
    set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optimizer_state)
    model_state, optimizer_state = get_state_dict(model, optimizers)
    whole = lambda tree: {k: whole(v) for k, v in tree.items()} if isinstance(tree, dict) else (  # noqa: E731
        tree.full_tensor() if hasattr(tree, "full_tensor") else tree)
    out["fsdp2 muon"] = {"state": cloned(whole(optimizer_state["state"])),
                         "param_groups": cloned(optimizer_state["param_groups"]),
                         "paths": set(flatten_state_dict({"model": model_state, "optimizer": optimizer_state})[1]
                                      .values())}
    return out


def fsdp2_weights(model) -> dict:
    """The whole weights, under every name (the tied head too)."""
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


# ----------------------------------------------------------------------------------------------------------
# In the workers
# ----------------------------------------------------------------------------------------------------------
def save_on_three(rank, world_size, root):
    """Stage 3 on 3 processes, STEPS steps, saved with every tensor collective refused."""
    out = {}
    data = make_data()
    model = make_model(SEED)
    sharded = zero.shard(model, 3)
    optimizer = configure_optimizers(model, sharded.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    train(model, sharded, optimizer, scheduler, data, range(STEPS), rank, world_size)
    extra = {**EXTRA, "scheduler": scheduler.state_dict()}
    gradient_bytes = lambda: sum(t.nbytes for t in sharded.held_gradient_buffers())  # noqa: E731
    out["gradient bytes"] = [gradient_bytes()]  # after zero_grad(): the shards wait for the next forward
    with tensor_collectives_refused():
        start = time.perf_counter()
        zero.checkpoint.save(os.path.join(root, "ours"), sharded, optimizer, extra)
        out["save s"] = time.perf_counter() - start
        out["guard"] = attempt(lambda: dist.all_reduce(torch.zeros(1)))
    out["gradient bytes"].append(gradient_bytes())
    out["boxes"] = own_boxes(sharded, [optimizer])
    out["gathered"] = gathered(sharded, [optimizer], model)
    out["scheduler"] = scheduler.state_dict()
    sharded.close()
    out["matrix"] = matrix_recipes_on_three(rank, world_size, root, data)
    return out


def resume(stage, collectives, path, data, rank, world_size, scheduler_state=None, **groups) -> dict:
    """A model of other weights, shard and optimizer loaded from ``path``, then MORE steps. At stage 3 they have
    taken a step of their own first: the optimizer has state to replace, and the step's edge has prefetched the
    first units, stale once the shards are loaded."""
    model = make_model(SEED + 1000)  # other initial weights: only the load can make it match
    sharded = zero.shard(model, stage, collectives=collectives, **groups)
    optimizer = configure_optimizers(model, sharded.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)  # lr = LR * warmup(0) until the load
    if stage == 3:
        train(model, sharded, optimizer, scheduler, data, range(1), rank, world_size)
    start = time.perf_counter()
    extra = zero.checkpoint.load(path, sharded, optimizer)
    seconds = time.perf_counter() - start
    scheduler.load_state_dict(scheduler_state or extra["scheduler"])
    train(model, sharded, optimizer, scheduler, data, range(STEPS, STEPS + MORE), rank, world_size)
    out = {"weights": cloned(sharded.model_state_dict()), "extra": extra, "load s": seconds,
           "sharded": sharded, "optimizer": optimizer, "model": model}
    return out


def recording_reads():
    """Patch the load planner to keep, per sharded key, (elements read, elements this rank's shards hold)."""
    planner = zero.checkpoint.ShardLoadPlanner
    original = planner.create_local_plan
    record = {}

    def create_local_plan(self):
        plan = original(self)
        for key, views in self.boxes.items():
            read = sum(math.prod(item.lengths) for item in plan.items if item.dest_index.fqn == key)
            record[key] = (read, sum(view.numel() for view in views))
        return plan
    planner.create_local_plan = create_local_plan
    return record, lambda: setattr(planner, "create_local_plan", original)


def resume_on_two(rank, world_size, root, saved):
    """Ours at stages 0-3 from ours; FSDP2 from ours; ours from FSDP2's; stage 0's own save; two optimizers;
    param_dtype; the refusals."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    out = {}
    data = make_data()
    ours = os.path.join(root, "ours")
    for stage, collectives in ((0, "torch"), (1, "torch"), (2, "ring"), (3, "torch")):
        record, restore = recording_reads() if stage == 3 else ({}, lambda: None)
        run = resume(stage, collectives, ours, data, rank, world_size)
        restore()
        out[f"stage {stage}"] = {"weights": run["weights"], "extra": run["extra"], "reads": record,
                                 "load s": run["load s"]}
        if stage == 0:  # stage 0 writes the format too
            zero.checkpoint.save(os.path.join(root, "stage 0"), run["sharded"], run["optimizer"])
            out["stage 0 gathered"] = gathered(run["sharded"], [run["optimizer"]], run["model"])
        run["sharded"].close()

    # FSDP2 goes on from ours, and saves what it loaded as FSDP2 saves (dcp.save of get_state_dict)
    model, optimizer, scheduler = fsdp2_model(SEED + 1000)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=ours)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    scheduler.load_state_dict(saved["scheduler"])
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=os.path.join(root, "fsdp2"))
    train(model, None, optimizer, scheduler, data, range(STEPS, STEPS + MORE), rank, world_size)
    out["fsdp2 from ours"] = fsdp2_weights(model)

    # ours goes on from FSDP2's
    run = resume(2, "torch", os.path.join(root, "fsdp2"), data, rank, world_size, saved["scheduler"])
    out["ours from fsdp2"] = {"weights": run["weights"], "extra": run["extra"]}
    run["sharded"].close()

    out.update(several_optimizers(rank, world_size, root, data))
    out.update(mixed_precision(rank, world_size, root, data))
    out.update(frozen_and_buffers(rank, world_size, root, data))
    out.update(refusals(rank, world_size, root))
    out["matrix"] = matrix_recipes_on_two(rank, world_size, root, data)
    return out


def several_optimizers(rank, world_size, root, data) -> dict:
    """Two optimizers over one model: ours (stage 2) saved after a step, against get_state_dict's merge of FSDP2's
    two; loaded into a fresh stage 3 with two optimizers, each state_dict() as saved."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out = {}
    path = os.path.join(root, "two optimizers")
    model = make_model(SEED)
    sharded = zero.shard(model, 2)
    optimizers = two_optimizers(model, sharded.optimizer)
    for k in range(K):
        sharded.set_requires_gradient_sync(k == K - 1)
        (loss_sum(model, micro_batch(data, 0, rank, world_size, k)) / (GLOBAL // world_size * CONTEXT)).backward()
    for optimizer in optimizers:
        optimizer.step()
    zero.checkpoint.save(path, sharded, optimizers)
    out["two saved"] = [cloned(o.state_dict()) for o in optimizers]
    sharded.close()

    model, optimizers, _ = fsdp2_model(SEED, optimizers=2)
    model_state, optimizer_state = get_state_dict(model, optimizers)
    flat, mappings = flatten_state_dict({"model": model_state, "optimizer": optimizer_state})
    out["fsdp2 two"] = {"paths": set(mappings.values()), "param_groups": cloned(optimizer_state["param_groups"])}

    model = make_model(SEED + 1000)
    sharded = zero.shard(model, 3)
    optimizers = two_optimizers(model, sharded.optimizer)
    zero.checkpoint.load(path, sharded, optimizers)
    out["two loaded"] = [cloned(o.state_dict()) for o in optimizers]
    sharded.close()
    return out


def mixed_precision(rank, world_size, root, data) -> dict:
    """Stage 3, float32 weights over float64 masters: saved after a step, then one more step; fresh shards (other
    weights) at stage 3 and at stage 1, under the same param_dtype, load it and take the same step. The checkpoint
    holds the masters. One micro-batch a step: stage 1 sums a window's micro-batches in param_dtype, as DDP does
    (zero/precision.py), where stage 3 sums them in the masters' dtype."""
    path = os.path.join(root, "param dtype")
    results = []
    for stage, seed in ((3, SEED), (3, SEED + 1000), (1, SEED + 1000)):
        model = make_model(seed)
        sharded = zero.shard(model, stage, param_dtype=torch.float32, reduce_dtype=torch.float64)
        optimizer = configure_optimizers(model, sharded.optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
        if seed == SEED:
            train(model, sharded, optimizer, scheduler, data, range(1), rank, world_size, micro_batches=1)
            zero.checkpoint.save(path, sharded, optimizer, {"scheduler": scheduler.state_dict()})
            masters = gathered(sharded, [optimizer], model)
        else:
            scheduler.load_state_dict(zero.checkpoint.load(path, sharded, optimizer)["scheduler"])
        train(model, sharded, optimizer, scheduler, data, range(1, 2), rank, world_size, micro_batches=1)
        results.append(cloned(sharded.model_state_dict()))
        sharded.close()
    return {"param dtype gathered": masters, "param dtype steps": results}


def frozen_and_buffers(rank, world_size, root, data) -> dict:
    """A frozen parameter (sharded at stage 3, as the trainable ones) and a buffer (whole on every rank, written
    once): stage 3 saves after a step, a stage 3 of other weights loads: the state dicts as saved, and the checkpoint
    holds the frozen parameter as each rank's chunk, the buffer as one whole chunk."""
    from torch.distributed.checkpoint import FileSystemReader
    path = os.path.join(root, "frozen")
    out = []
    for seed in (SEED, SEED + 1000):
        model = make_model(seed)
        model.pos_emb.weight.requires_grad_(False)
        model.register_buffer("scale", torch.rand(3, dtype=torch.float64))  # other values with the other seed
        sharded = zero.shard(model, 3)
        optimizer = configure_optimizers(model, sharded.optimizer)
        if seed == SEED:
            train(model, sharded, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup), data, range(1),
                  rank, world_size)
            zero.checkpoint.save(path, sharded, optimizer)
        else:
            zero.checkpoint.load(path, sharded, optimizer)
        out.append(gathered(sharded, [optimizer], model))
        sharded.close()
    chunks = {key: len(md.chunks) for key, md in FileSystemReader(path).read_metadata().state_dict_metadata.items()
              if key in ("model.pos_emb.weight", "model.scale")}
    return {"frozen saved": out[0], "frozen loaded": out[1], "frozen chunks": chunks}


def refusals(rank, world_size, root) -> dict:
    """Every bad input, on a stage-2 shard whose weights must not change; the folders made by rank 0."""
    ours = os.path.join(root, "ours")
    bad = {name: os.path.join(root, name) for name in ("empty", "no metadata", "short data", "short metadata")}
    if rank == 0:
        os.makedirs(bad["empty"], exist_ok=True)
        for name in ("no metadata", "short data", "short metadata"):
            shutil.copytree(ours, bad[name], dirs_exist_ok=True)
        os.remove(os.path.join(bad["no metadata"], ".metadata"))
        with open(os.path.join(bad["short data"], "__1_0.distcp"), "r+b") as file:
            file.truncate(os.path.getsize(file.name) // 2)
        with open(os.path.join(bad["short metadata"], ".metadata"), "r+b") as file:
            file.truncate(100)
    dist.barrier()
    out = {}
    model = make_model(SEED + 1000)
    sharded = zero.shard(model, 2)
    optimizer = configure_optimizers(model, sharded.optimizer)
    before = cloned(model.state_dict())

    def load(path, **changes):
        return attempt(lambda: zero.checkpoint.load(path, sharded, changes.get("optimizer", optimizer),
                                                    stepped=changes.get("stepped", False)))

    for name, path in bad.items():
        out[name] = load(path)
    unstepped = os.path.join(root, "unstepped")  # saved before any step: no state, which stepped=True refuses
    zero.checkpoint.save(unstepped, sharded, optimizer)
    out["stepped"] = load(unstepped, stepped=True)
    out["no folder"] = load(os.path.join(root, "nowhere"))
    out["a file"] = load(os.path.join(ours, ".metadata"))
    out["one rank's folder"] = load(bad["empty"] if rank == 0 else ours)  # only rank 0 sees a problem
    sgd = configure_optimizers(model, lambda cls, groups, **_: sharded.optimizer(torch.optim.SGD, groups, lr=0.1,
                                                                                  momentum=0.9))
    out["sgd"] = load(ours, optimizer=sgd)
    out["one group"] = load(ours, optimizer=sharded.optimizer(torch.optim.AdamW, model.parameters(), lr=0.1))
    out["unchanged"] = max_difference(before, cloned(model.state_dict()))
    sharded.close()

    spare = make_model(SEED, spare=True)  # another model: an extra layer
    sharded = zero.shard(spare, 2)
    out["missing keys"] = attempt(lambda: zero.checkpoint.load(ours, sharded, None))
    sharded.close()
    shallower = make_model(SEED)
    del shallower.blocks[1]  # another model: a block fewer
    sharded = zero.shard(shallower, 1)
    out["unexpected keys"] = attempt(lambda: zero.checkpoint.load(ours, sharded, None))
    sharded.close()
    wider = make_model(SEED)
    wider.pos_emb = nn.Embedding(CONTEXT + 1, wider.pos_emb.embedding_dim).double()  # another shape
    sharded = zero.shard(wider, 3)
    out["shape"] = attempt(lambda: zero.checkpoint.load(ours, sharded, None))
    sharded.close()
    return out


def resume_on_four(rank, world_size, root):
    """Loads of ours that change nothing: stage 2 on 4 processes, and hybrid 2 x 2 at stage 3, then saved (its
    dcp_to_torch_save is checked, and its boxes)."""
    out = {}
    ours = os.path.join(root, "ours")
    model = make_model(SEED + 1000)
    sharded = zero.shard(model, 2)
    optimizer = configure_optimizers(model, sharded.optimizer)
    zero.checkpoint.load(ours, sharded, optimizer)
    out["stage 2"] = gathered(sharded, [optimizer], model)
    sharded.close()
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = {"group": shard_groups[rank // 2], "replicate_group": replicate_groups[rank % 2]}
    path = os.path.join(root, "hybrid")
    model = make_model(SEED + 2000)
    sharded = zero.shard(model, 3, **groups)
    optimizer = configure_optimizers(model, sharded.optimizer)
    zero.checkpoint.load(ours, sharded, optimizer)
    out["hybrid 3"] = gathered(sharded, [optimizer], model)
    zero.checkpoint.save(path, sharded, optimizer)
    out["hybrid boxes"] = own_boxes(sharded, [optimizer])
    sharded.close()
    return out


def on_device(rank, world_size, root, device):
    """Stage 3 on ``device`` (two ranks on one GPU, over gloo), a step, saved; a stage 1 of other weights loads it:
    the whole state dicts as saved, and the loaded state on the device."""
    data = make_data().to(device)
    path = os.path.join(root, f"on {device}")
    out = []
    for stage, seed in ((3, SEED), (1, SEED + 1000)):
        model = make_model(seed).to(device)
        sharded = zero.shard(model, stage)
        optimizer = configure_optimizers(model, sharded.optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
        if stage == 3:
            train(model, sharded, optimizer, scheduler, data, range(1), rank, world_size)
            zero.checkpoint.save(path, sharded, optimizer)
        else:
            zero.checkpoint.load(path, sharded, optimizer)
        devices = {v.device.type for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()}
        out.append((gathered(sharded, [optimizer], model), devices))
        sharded.close()
    return out


# ----------------------------------------------------------------------------------------------------------
# The runs: one call of each group
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def saved(local_group, root):
    results = local_group(3).submit(save_on_three, root, timeout_s=120)
    references = {"adamw": reference(make_data(), SEED, STEPS + MORE),  # one process, the global batch
                  **{recipe: matrix_reference(recipe) for recipe in MATRIX_SAVED}}
    return results, references  # the references here, while the 3 processes train


@pytest.fixture(scope="module")
def three(saved):
    return saved[0]()


@pytest.fixture(scope="module")
def ref(saved):
    return saved[1]["adamw"]


@pytest.fixture(scope="module")
def matrix_refs(saved):
    return saved[1]


@pytest.fixture(scope="module")
def loaded(local_group, root, three):
    """The 4 processes and the 2 at once: both only read what the 3 saved."""
    four = local_group(4).submit(resume_on_four, root, timeout_s=180)
    return local_group(2).run(resume_on_two, root, three[0], timeout_s=180), four()


@pytest.fixture(scope="module")
def two(loaded):
    return loaded[0]


@pytest.fixture(scope="module")
def four(loaded):
    return loaded[1]


def converted(path: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(path, path + ".pt")
    return torch.load(path + ".pt", weights_only=True)  # tensors and Python's builtins alone


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------
def test_the_reference_clips_every_step(ref):
    assert all(n > MAX_NORM for n in ref["norms"]), ref["norms"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_saved_at_stage_3_on_3_processes_loaded_on_2_goes_on_as_one_process(two, ref, stage):
    error = max_difference(ref["weights"], two[0][f"stage {stage}"]["weights"])
    print(f"\nsaved at stage 3 on 3 processes, loaded at stage {stage} on 2, {MORE} more steps: max |dw| = {error:.1e}")
    assert error < WEIGHT_TOL


@pytest.mark.parametrize("name", ["stage 2", "hybrid 3"])
def test_loaded_on_4_and_hybrid_the_state_is_exactly_as_saved(three, four, name):
    """Stage 2 on 4 processes, and hybrid 2 x 2 at stage 3 (its shard group's rank 0 of each replica: ranks 0, 2):
    the whole state dicts after the load are the ones saved on 3 processes, bit for bit."""
    for rank in (0, 2) if name.startswith("hybrid") else (0,):
        assert identical(four[rank][name], three[0]["gathered"])


def test_fsdp2_goes_on_from_ours_and_ours_from_fsdp2s(two, ref):
    fsdp2 = two[0]["fsdp2 from ours"]
    from_fsdp2 = two[0]["ours from fsdp2"]
    errors = {"FSDP2 from ours": max_difference(ref["weights"], fsdp2),
              "ours from FSDP2's": max_difference(ref["weights"], from_fsdp2["weights"]),
              "FSDP2 from ours against ours": max_difference(two[0]["stage 3"]["weights"], fsdp2)}
    print("\n" + ", ".join(f"{k}: max |dw| = {v:.1e}" for k, v in errors.items()))
    assert all(error < WEIGHT_TOL for error in errors.values())
    assert all(r["ours from fsdp2"]["extra"] is None for r in two)  # FSDP2's checkpoint has no extra


def test_extra_comes_back_as_it_was_saved(three, two):
    expected = {**EXTRA, "scheduler": three[0]["scheduler"]}
    for r in two:
        assert identical(r["stage 1"]["extra"], expected), r["stage 1"]["extra"]


@pytest.mark.parametrize("case", ["stage 3 on 3", "stage 0 on 2", "hybrid 2 x 2", "param_dtype"])
def test_dcp_to_torch_save_gives_exactly_the_gathered_state_dicts(three, two, four, root, case):
    folder, state = {"stage 3 on 3": ("ours", three[0]["gathered"]),
                     "stage 0 on 2": ("stage 0", two[0]["stage 0 gathered"]),
                     "hybrid 2 x 2": ("hybrid", four[0]["hybrid 3"]),
                     "param_dtype": ("param dtype", two[0]["param dtype gathered"])}[case]
    whole = converted(os.path.join(root, folder))
    assert identical(whole["model"], state["model"])
    assert identical(whole["optimizer"], state["optimizer"][0])
    if case == "param_dtype":  # the masters: the model's own dtype
        assert {t.dtype for t in whole["model"].values()} == {torch.float64}
    assert "tok_emb.weight" in whole["optimizer"]["state"] and "head.weight" not in whole["optimizer"]["state"]
    assert "head.weight" in whole["model"]  # the tied weight: under both names in the model, its first in the state


def test_each_rank_writes_exactly_its_own_boxes_and_each_box_once(three, root):
    """Stage 3 on 3 processes: every sharded tensor's chunks on disk are the ranks' boxes, each in its own rank's
    file, none shared, at most 2(n-1)+1 per rank and tensor."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex
    metadata = FileSystemReader(os.path.join(root, "ours")).read_metadata()
    boxes = [r["boxes"] for r in three]
    assert all(a.isdisjoint(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    keys = {key for ranks in boxes for key, _ in ranks}
    assert any(k.startswith("model.") for k in keys) and any(k.endswith(".exp_avg_sq") for k in keys)
    for key in keys:
        chunks = metadata.state_dict_metadata[key].chunks
        assert sorted(tuple(c.offsets) for c in chunks) == sorted(o for ranks in boxes for k, o in ranks if k == key)
        assert all(all(size > 0 for size in c.sizes) for c in chunks)
        n = len(metadata.state_dict_metadata[key].size)
        assert all(sum(k == key for k, _ in ranks) <= 2 * (n - 1) + 1 for ranks in boxes)
    for rank, ranks in enumerate(boxes):
        for key, offsets in ranks:
            assert metadata.storage_data[MetadataIndex(key, offsets)].relative_path == f"__{rank}_0.distcp"


def test_no_tensor_collective_during_save(three):
    """The save above ran with every tensor collective raising (outside the object collectives DCP plans with),
    and the guard does bite."""
    for r in three:
        kind, message = r["guard"]
        assert kind == "RuntimeError" and "tensor collective all_reduce" in message
    print(f"\nsave at stage 3, 3 processes: {max(r['save s'] for r in three) * 1e3:.0f} ms")


def test_a_save_after_zero_grad_holds_no_gradient_shard(three):
    """zero_grad() let the gradient shards go; the save drops them before it reads the state, not the next forward
    (FSDP2's are freed by zero_grad itself): without it the 4 Psi / W bytes of dead gradients stay through the save
    (a background save's copy beside them) and into the phase after it."""
    for r in three:
        before, after = r["gradient bytes"]
        assert before > 0 and after == 0, (before, after)


def test_a_load_reads_exactly_what_the_ranks_shards_hold(two):
    """Stage 3 on 2 processes from 3's boxes: for every sharded tensor, the elements a rank reads are the ones its
    shards hold, each once (the boxes on disk do not overlap)."""
    for r in two:
        reads = r["stage 3"]["reads"]
        assert reads and any(k.startswith("optimizer.") for k in reads)
        assert all(read == held for read, held in reads.values()), reads
    print(f"\nload at stage 3, 2 processes: {max(r['stage 3']['load s'] for r in two) * 1e3:.0f} ms")


def test_replicas_write_one_copy(four, root):
    """Hybrid 2 x 2: the replicas offer equal boxes, and DCP keeps one copy of each (what the copy holds:
    test_dcp_to_torch_save_gives_exactly_the_gathered_state_dicts[hybrid 2 x 2])."""
    from torch.distributed.checkpoint import FileSystemReader
    metadata = FileSystemReader(os.path.join(root, "hybrid")).read_metadata()
    replica = [r["hybrid boxes"] for r in four]
    assert replica[0] == replica[2] and replica[1] == replica[3] and replica[0].isdisjoint(replica[1])
    for key in {key for key, _ in replica[0] | replica[1]}:
        offsets = [tuple(c.offsets) for c in metadata.state_dict_metadata[key].chunks]
        assert sorted(offsets) == sorted(o for k, o in replica[0] | replica[1] if k == key)



def test_several_optimizers_are_merged_as_get_state_dict_merges_them(two, root):
    from torch.distributed.checkpoint import FileSystemReader
    metadata = FileSystemReader(os.path.join(root, "two optimizers")).read_metadata()
    fsdp2 = two[0]["fsdp2 two"]
    assert set(metadata.planner_data.values()) == fsdp2["paths"]
    whole = converted(os.path.join(root, "two optimizers"))
    ours_groups = [{k: v for k, v in g.items()} for g in whole["optimizer"]["param_groups"]]
    assert ours_groups == fsdp2["param_groups"]
    assert identical(two[0]["two loaded"], two[0]["two saved"])


def merged_by_name(states: list[dict], model: nn.Module, recipe: str) -> dict:
    """Several optimizers' torch.optim state dicts as get_state_dict merges them: the state under the parameters'
    (first) names, the groups one optimizer after another, their parameters named."""
    names = {id(p): name for name, p in model.named_parameters()}
    optimizers = matrix_optimizers(model, plain_optimizer, recipe)
    merged = {"state": {}, "param_groups": []}
    for state, optimizer in zip(states, optimizers):
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        merged["state"].update({order[int(i)]: entry for i, entry in state["state"].items()})
        merged["param_groups"] += [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]
    return merged


@pytest.mark.parametrize("recipe, stage, collectives", MATRIX_LOADED)
def test_muon_and_adafactor_resume_at_another_stage_and_world_size(three, two, matrix_refs, recipe, stage,
                                                                   collectives):
    """Muon + AdamW saved at stage 3 on 3 processes, Adafactor + AdamW at stage 1 (ring), loaded on 2 at another
    stage (stage 0: torch.optim's own, over whole parameters): both optimizers' state dicts right after the load
    are the ones saved, bit for bit, and MORE steps later the weights are within MATRIX_TOL of one process's
    STEPS + MORE steps with torch's optimizers on the global batch.

    Why 1e-12 holds: everything is float64 and the sharded runs sum the same gradient terms in another order
    (~1e-16 relative), which the AdamW part carries into its steps as test_zero_contract argues (~1e-15 measured
    here). Muon casts its momentum update to bf16 before Newton-Schulz: a rounding-level difference changes that
    cast only where a value lies within 1e-16 relative of a bf16 rounding boundary (about 1e-13 of the elements, so
    in practice none): the bf16 matrices and so the orthogonalized updates are torch's bit for bit, and the
    weights differ by the float64 rounding of the momentum and the decay. Adafactor's update is scale-free in its
    sums (test_zero_matrix's argument). A checkpoint that lost or misplaced anything moves weights at first order:
    a momentum_buffer box at the wrong offset, a row_var read into the wrong matrix or not at all (Adafactor's
    first steps move by ~lr = 1e-2), a Muon matrix left without its momentum (its next update's direction)."""
    run = two[0]["matrix"][recipe, stage]
    saved = three[0]["matrix"][recipe]
    assert identical(run["loaded"], saved)
    error = max_difference(matrix_refs[recipe], run["weights"])
    print(f"\n{recipe} + AdamW saved at stage {MATRIX_SAVED[recipe][0]} on 3 processes, loaded at stage {stage} "
          f"({collectives}) on 2, {MORE} more steps: max |dw| = {error:.1e}")
    assert error < MATRIX_TOL


def test_muon_and_adafactor_are_written_as_get_state_dict_lays_them_out(three, two, root):
    """dcp_to_torch_save of each recipe's checkpoint: the gathered state dicts by name, merged as get_state_dict
    merges several optimizers (Muon's momentum_buffer in each matrix's shape; Adafactor's row_var and col_var whole,
    in torch's shapes, written once); FSDP2 with torch.optim.Muon and AdamW over its DTensors reads the Muon
    recipe's (get_state_dict, dcp.load, set_state_dict): its state is the saved one, by name, bit for bit, and its
    get_state_dict's paths are ours. (FSDP2 with Adafactor does not step in torch 2.15: DTensor refuses its in-place
    square of a norm's partial result; the row_var and col_var it makes are DTensors of Replicate placement in
    these shapes, which this layout matches.)"""
    from torch.distributed.checkpoint import FileSystemReader
    model = make_model(SEED)
    for recipe in MATRIX_SAVED:
        saved = three[0]["matrix"][recipe]
        whole = converted(os.path.join(root, recipe))
        assert identical(whole["model"], saved["model"])
        assert identical(whole["optimizer"], merged_by_name(saved["optimizer"], model, recipe))
        if recipe == "adafactor":
            assert whole["optimizer"]["state"]["blocks.0.mlp.0.weight"]["row_var"].shape == (4 * 16, 1)
            metadata = FileSystemReader(os.path.join(root, recipe)).read_metadata()
            assert len(metadata.state_dict_metadata["optimizer.state.blocks.0.mlp.0.weight.col_var"].chunks) == 1
    fsdp2 = two[0]["matrix"]["fsdp2 muon"]
    merged = merged_by_name(three[0]["matrix"]["muon"]["optimizer"], model, "muon")
    assert identical(fsdp2["state"], merged["state"])
    assert fsdp2["param_groups"] == merged["param_groups"]
    metadata = FileSystemReader(os.path.join(root, "muon")).read_metadata()
    assert set(metadata.planner_data.values()) == fsdp2["paths"]


def test_param_dtype_resumes_from_the_masters(two):
    """float32 weights over float64 masters: loaded at stage 3, the next step is bit for bit the run's that went on;
    loaded at stage 1 (its weights cast from the loaded masters and gathered), within 1e-9 of it, by
    test_zero_precision's argument: the two sum the same float32 gradients in float64 in another order (buckets,
    the clip's norm), ~1e-16 relative, which changes a float32 weight's rounding rarely and then by 6e-8 relative,
    one step's update by at most lr x 6e-8 = 6e-10; a stale or uncast weight moves it by ~lr."""
    went_on, at_3, at_1 = two[0]["param dtype steps"]
    assert identical(at_3, went_on)
    error = max_difference(went_on, at_1)
    print(f"\nfloat32 over float64 masters, saved at stage 3, loaded at stage 1, a step: max |dw| = {error:.1e}")
    assert error < 1e-9


def test_frozen_parameters_are_written_in_shards_and_buffers_once_whole_and_loaded(two):
    for r in two:
        assert r["frozen chunks"] == {"model.pos_emb.weight": len(two), "model.scale": 1}
    saved, loaded = two[0]["frozen saved"], two[0]["frozen loaded"]
    assert "pos_emb.weight" in saved["model"] and "scale" in saved["model"]
    assert "pos_emb.weight" not in saved["optimizer"][0]["state"]
    assert identical(loaded, saved)


REFUSALS = {"empty": "not a torch.distributed.checkpoint folder", "no metadata": "torn: its .metadata is missing",
            "short data": "torn: data file __1_0.distcp is", "short metadata": "torn: its .metadata cannot be read",
            "no folder": "no such folder", "a file": "not a folder",
            "sgd": "an optimizer state of another kind: tok_emb.weight holds ['exp_avg', 'exp_avg_sq', 'step'], and "
                   "torch.optim.SGD with these settings keeps ['momentum_buffer']",
            "one group": "its optimizer state has 2 parameter groups, these optimizers 1",
            "missing keys": "another model: it lacks blocks.1.spare.bias, blocks.1.spare.weight (2 of this model's "
                            "keys)",
            "unexpected keys": "another model: it holds blocks.1.attn.proj.bias, blocks.1.attn.proj.weight, "
                               "blocks.1.attn.qkv.bias and 9 more, which this model has not",
            "shape": "another model: pos_emb.weight is (8, 16) there, (9, 16) here",
            "one rank's folder": "not a torch.distributed.checkpoint folder",
            "stepped": "its optimizer state is incomplete: blocks.0.attn.proj.bias, blocks.0.attn.proj.weight, "
                       "blocks.0.attn.qkv.bias and"}


@pytest.mark.parametrize("case", REFUSALS)
def test_bad_input_is_refused_in_one_line_naming_the_folder_on_every_rank(two, root, case):
    messages = set()
    for r in two:
        kind, message = r[case]
        print(f"\n{case}: {kind}: {message}")
        assert kind == "CheckpointError" and "\n" not in message and REFUSALS[case] in message, message
        assert root in message
        messages.add(message)
    assert len(messages) == 1  # the same verdict on every rank
    assert all(r["unchanged"] == 0 for r in two)  # nothing was written before the refusals


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_shards_save_and_load_on_the_gpu(local_group, root):
    (saved, saved_devices), (loaded, loaded_devices) = local_group(2).run(on_device, root, "cuda", timeout_s=120)[0]
    assert saved_devices == loaded_devices == {"cuda"}
    assert identical(loaded, saved)


# ----------------------------------------------------------------------------------------------------------
# Stage 3's model.state_dict(), and checksums
# ----------------------------------------------------------------------------------------------------------
def stage_3_state_dicts(rank, world_size, path):
    """model.state_dict() at stage 3 (refused, and not a SIGSEGV nor a file without weights), what keeps working
    (keep_vars=True's names and shapes, zero.checkpoint.save, the gathered state dict), and state_dict() after
    close()."""
    model = make_model(SEED)
    sharded = zero.shard(model, 3)
    out = {"refused": attempt(lambda: model.state_dict()), "block refused": attempt(lambda: model.blocks[0].state_dict())}
    out["names"] = {name: tuple(value.shape) for name, value in model.state_dict(keep_vars=True).items()}
    zero.checkpoint.save(path, sharded, None)
    out["gathered"] = cloned(sharded.model_state_dict())
    sharded.close()
    out["closed"] = cloned(model.state_dict())
    return out


def test_stage_3_refuses_model_state_dict_in_one_line(local_group, tmp_path):
    """After zero.shard(model, 3) a rank holds only shards: model.state_dict() (and a block's) is refused in one
    line naming what gathers, on every rank, where its tensors had no storage (.clone() killed both ranks with
    SIGSEGV, torch.save wrote 1.8 kB in silence); keep_vars=True (names and shapes: zero.checkpoint's own use) and
    zero.checkpoint.save still work, and after close() the model is ordinary again, with the gathered weights."""
    results = local_group(2).run(stage_3_state_dicts, str(tmp_path / "ckpt"), timeout_s=120)
    for out in results:
        for key in ("refused", "block refused"):
            kind, message = out[key]
            assert kind == "RuntimeError" and message.startswith("zero: at stage 3 a rank holds only shards") and \
                "sync.model_state_dict()" in message and "\n" not in message, out[key]
        assert out["names"] == {name: tuple(value.shape) for name, value in out["closed"].items()}
    assert max_difference(results[0]["gathered"], results[0]["closed"]) == 0
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as asked
def test_a_folder_saved_without_torchs_checksums_still_loads_unchecked(tmp_path):
    """[Note: the checksums are torch's own] A folder whose archives carry no CRC32s (torch's crc32 option off when
    it was saved) loads with no error, unchecked; the same bytes with CRC32s are checked, and a flipped byte in the
    data refused in one line naming the file; the extra alone reads, its own item unharmed."""
    import torch.distributed.checkpoint as dcp
    weight = torch.arange(4096, dtype=torch.float64)
    state = {"model": {"w": weight}, "extra": zero.checkpoint.encode_extra({"step": 3})}
    before = torch.serialization.get_crc32_options()
    for crc in (False, True):
        torch.serialization.set_crc32_options(crc)
        try:
            dcp.save(state, checkpoint_id=str(tmp_path / str(crc)), no_dist=True)
        finally:
            torch.serialization.set_crc32_options(before)
        data = tmp_path / str(crc) / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[-len(raw) // 3] ^= 0xFF  # inside w's bytes (the extra is written first, w last)
        data.write_bytes(bytes(raw))
        assert zero.checkpoint.read_extra(str(tmp_path / str(crc))) == {"step": 3}
        if crc:
            kind, message = attempt(lambda: zero.checkpoint.read_whole(str(tmp_path / "True"), ("model",), alone=True))
            assert kind == "CheckpointError" and "\n" not in message, message
            assert f"checkpoint {tmp_path / 'True'}: file __0_0.distcp does not match its checksum (corrupt: " \
                   f"bytes " in message and "holding model.w" in message, message
        else:  # unchecked, as torch.load reads it
            read = zero.checkpoint.read_whole(str(tmp_path / "False"), ("model",), alone=True)
            assert not torch.equal(read["model"]["w"], weight)
