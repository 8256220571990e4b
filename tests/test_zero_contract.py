"""zero.shard's public contract, tested as a user would use it: a small GPT written here (tied output head, pre-
LayerNorm blocks in an nn.ModuleList, causal attention through scaled_dot_product_attention), trained with a
nanoGPT-style optimizer set-up (AdamW, weight decay on the matrices only, a warm-up schedule, a clip that bites on
every step) and gradient accumulation, against ONE process training on the global batch with no collectives.

What is checked, in the session's reusable gloo workers (``local_group``):
- every stage 0-3 with both collectives ("torch", "ring") at 2 and 3 processes (3: uneven shards): the final
  weights, the clipping norm of every step (the WHOLE model's norm), every rank's copy of the model, the tied
  head, and the optimizer's full state_dict (groups, hyperparameters, index lists, state) against the reference;
  then a fresh model, shard and optimizer loaded from those full state dicts, 2 more steps, against the
  reference's 2 more steps;
- two replicas of 2 ranks in a world of 4 (process sub-groups), each on its own data, each against its own
  reference;
- misuse is loud: a torch.optim optimizer built outside ``sharded.optimizer`` refuses to step and changes no
  weight; stage 4 is refused; a trainable parameter that gets no gradient is named at the end of backward;
- close(): the model is whole, ordinary and hook-free, and trains alone without collectives.

Why the tolerances hold. Everything runs in float64. The sharded stages sum the same terms as the reference in
another order (each rank's tokens, then the ranks, by reduce-scatter or the ring; the reference sums the global
batch in one cross-entropy), so each gradient differs from the reference's by a few float64 units of 2^-53
(~1e-16 relative); a handful of AdamW steps amplify that (an element whose gradient nearly cancels flips the
sign of its first update), to a few thousand ulps at most: ~1e-13 on weights of order 1. 1e-10 keeps a factor of
several hundred; norms are compared at 1e-9 relative. A real error moves weights at first order: a wrong group's
weight decay moves a LayerNorm weight (1.0) by lr * 0.1 = 1e-3 per step; a per-rank rather than global clipping
norm changes the returned norm by a factor ~sqrt(W) and every later Adam step's scale; a lost micro-batch or
rank, a schedule or a loaded learning rate not honoured, moves the weights by ~lr = 1e-2. All these are seven
orders of magnitude or more above 1e-10. One error only the norms show: the clip bites on every step, so AdamW
sees gradients of norm MAX_NORM whatever their scale, and a gradient summed over the ranks rather than averaged
leaves the weights as they are but returns a norm W times too large.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero
from zero_testing import attempt, cloned, max_difference

# The model: byte-level-ish vocabulary, width 16, 2 blocks of 2 heads, a context of 8 tokens (float64).
VOCAB, WIDTH, DEPTH, HEADS, CONTEXT = 32, 16, 2, 2, 8
B, K = 2, 2           # sequences per micro-batch and rank; micro-batches per optimizer step
STEPS, MORE = 4, 2    # optimizer steps before the state dicts are taken; steps after they are loaded
LR, WEIGHT_DECAY, BETAS, WARMUP = 1e-2, 0.1, (0.9, 0.95), 2
MAX_NORM = 0.02       # below every step's gradient norm: the clip scales every step (checked on the reference)
SEED = 5
REPLICA_SEEDS = (11, 12)  # the sub-group test: one data seed per replica
WEIGHT_TOL, NORM_RTOL = 1e-10, 1e-9


# ----------------------------------------------------------------------------------------------------------
# A small GPT, as a user writes it
# ----------------------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = CausalSelfAttention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, spare: bool = False):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, WIDTH)
        self.pos_emb = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        if spare:  # a trainable parameter that the forward never uses (the misuse test)
            self.blocks[-1].spare = nn.Linear(WIDTH, WIDTH)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_model(seed: int, spare: bool = False) -> GPT:
    torch.manual_seed(seed)
    return GPT(spare).double()


def plain_optimizer(cls, groups, **kwargs):
    return cls(groups, **kwargs)


def configure_optimizers(model: nn.Module, factory=plain_optimizer):
    """nanoGPT's: weight decay on every parameter of 2 or more dimensions, none on biases and LayerNorm weights.
    ``factory(cls, groups, **kwargs)`` builds it: ``sharded.optimizer``, or torch.optim's own."""
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return factory(torch.optim.AdamW, groups, lr=LR, betas=BETAS)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


def make_data(seed: int, world_size: int) -> torch.Tensor:
    """Every step's global batch: (steps, world_size * K * B sequences, CONTEXT + 1 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (STEPS + MORE, world_size * K * B, CONTEXT + 1), generator=generator)


def micro_batch(data: torch.Tensor, step: int, rank: int, k: int) -> torch.Tensor:
    """Rank ``rank``'s micro-batch ``k`` of ``step``: its own B sequences of that step's global batch."""
    first = (rank * K + k) * B
    return data[step, first:first + B]


def loss_sum(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="sum")


# ----------------------------------------------------------------------------------------------------------
# The reference: one process, the global batch, no collectives
# ----------------------------------------------------------------------------------------------------------
def reference(data: torch.Tensor, seed: int, steps: int) -> dict:
    """The workers' recipe (make_model(seed), configure_optimizers' AdamW, the warm-up, the clip) in one process on
    every step's global batch of ``data``: each step's clip norm; the weights and the optimizer's state after
    ``steps`` steps, and the weights after all of ``data``'s ("resumed": where a model loaded from the first goes)."""
    model = make_model(seed)
    optimizer = configure_optimizers(model, plain_optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    out = {"norms": []}
    for step, tokens in enumerate(data):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()  # the global mean
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step == steps - 1:
            out["weights"] = cloned(model.state_dict())
            out["optimizer"] = cloned(optimizer.state_dict())
    out["resumed"] = cloned(model.state_dict())
    return out


_references: dict = {}


def reference_of(world_size: int, seed: int) -> dict:
    """STEPS steps, then MORE, on ``world_size`` ranks' global batches (kept: several tests read one)."""
    if (world_size, seed) not in _references:
        _references[world_size, seed] = reference(make_data(seed, world_size), seed, STEPS)
    return _references[world_size, seed]


# ----------------------------------------------------------------------------------------------------------
# In the workers
# ----------------------------------------------------------------------------------------------------------
def train_steps(model, sharded, optimizer, scheduler, data, steps, rank) -> list[float]:
    """Gradient accumulation over K micro-batches, the global-norm clip, the step; the norms returned."""
    norms = []
    for step in steps:
        for k in range(K):
            sharded.set_requires_gradient_sync(k == K - 1)
            (loss_sum(model, micro_batch(data, step, rank, k)) / (B * K * CONTEXT)).backward()
        norms.append(sharded.clip_grad_norm_(MAX_NORM).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return norms


def train_and_resume(stage: int, collectives: str, seed: int, group=None) -> dict:
    """STEPS steps; the full state dicts (group rank 0); close(); then a fresh model loaded from them, MORE steps."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    data = make_data(seed, size)
    model = make_model(seed)
    sharded = zero.shard(model, stage, group=group, collectives=collectives)
    optimizer = configure_optimizers(model, sharded.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    out = {"norms": train_steps(model, sharded, optimizer, scheduler, data, range(STEPS), rank)}
    out["weights"] = cloned(sharded.model_state_dict())
    state = optimizer.state_dict()
    # every state tensor its own, as an unsharded optimizer's: a step count shared by several parameters would be
    # advanced once per parameter by a plain optimizer that loads it
    tensors = [value for entry in state.get("state", {}).values() for value in entry.values() if torch.is_tensor(value)]
    out["state storages"] = (len({t.untyped_storage().data_ptr() for t in tensors}), len(tensors))
    out["optimizer"] = cloned(state)
    out["tied"] = model.head.weight is model.tok_emb.weight
    if stage < 3:  # the live parameters are whole between steps
        out["live"] = cloned(model.state_dict())
    scheduler_state = scheduler.state_dict()
    sharded.close()
    out["closed"] = cloned(model.state_dict())
    out["tied after close"] = model.head.weight is model.tok_emb.weight

    # Resume: every rank loads the same full dicts, broadcast from the group's rank 0.
    full = [out["weights"], out["optimizer"]] if rank == 0 else [None, None]
    dist.broadcast_object_list(full, group=group, group_src=0)
    full = cloned(full)
    model = make_model(seed + 1000)  # other initial weights: only the load can make it match
    sharded = zero.shard(model, stage, group=group, collectives=collectives)
    optimizer = configure_optimizers(model, sharded.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)  # sets lr to LR * warmup(0): the load restores it
    sharded.load_model_state_dict(full[0])
    optimizer.load_state_dict(full[1])
    scheduler.load_state_dict(scheduler_state)
    out["resumed norms"] = train_steps(model, sharded, optimizer, scheduler, data, range(STEPS, STEPS + MORE), rank)
    out["resumed"] = cloned(sharded.model_state_dict())
    sharded.close()
    out["resumed closed"] = cloned(model.state_dict())
    return out


def train_configs(rank, world_size, configs, seed):
    return {name: train_and_resume(stage, collectives, seed) for name, stage, collectives in configs}


def train_replicas(rank, world_size, configs):
    """World of 4: two replicas of 2 ranks, each its own sub-group and data. Every rank creates both groups, in
    the same order; a config gives each replica its own collectives."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica = rank // 2
    try:
        return {name: train_and_resume(stage, collectives[replica], REPLICA_SEEDS[replica], groups[replica])
                for name, stage, collectives in configs}
    finally:
        for group in groups:
            dist.destroy_process_group(group)
        align_group_counters()


def align_group_counters():
    """torch names a new process group by a per-process counter, which every rank that creates a group advances.
    A replica on the ring made one group more on its 2 ranks (its thread's, local to them: it trains as if alone),
    so the counters now differ across the world, and the next group every rank creates (a later test's, on these
    session workers) would wait forever for peers looking for another name. Every rank takes the largest. The
    counter is torch's private ``_world.group_count``: a loop that makes groups on some ranks only, and then one on
    all of them, needs the same."""
    from torch.distributed import distributed_c10d
    counters = [None] * dist.get_world_size()
    dist.all_gather_object(counters, distributed_c10d._world.group_count)
    distributed_c10d._world.group_count = max(counters)


def hooks_left(model: nn.Module) -> list[str]:
    """Every module or parameter hook still registered on the model."""
    left = []
    for name, module in model.named_modules():
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks"):
            if getattr(module, kind, None):
                left.append(f"module {name or '<root>'}: {kind}")
    for name, param in model.named_parameters():
        for kind in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            if getattr(param, kind, None):
                left.append(f"parameter {name}: {kind}")
    return left


def misuse_and_close(rank, world_size):
    """Each case raises the same way on every rank (caught here, so no rank is left waiting in a collective)."""
    out = {}
    data = make_data(SEED, world_size)
    for stage in (1, 3):
        model = make_model(SEED)
        sharded = zero.shard(model, stage)
        outside = torch.optim.AdamW(model.parameters(), lr=LR)
        before = cloned(sharded.model_state_dict())
        sharded.set_requires_gradient_sync(True)
        (loss_sum(model, micro_batch(data, 0, rank, 0)) / (B * CONTEXT)).backward()
        out[f"outside optimizer, stage {stage}"] = attempt(outside.step)
        after = cloned(sharded.model_state_dict())
        out[f"outside optimizer, stage {stage}, weights unchanged"] = (
            rank != 0 or (before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)))
        sharded.close()

    out["stage 4"] = attempt(lambda: zero.shard(make_model(SEED), 4))

    for stage in (2, 3):
        model = make_model(SEED, spare=True)
        sharded = zero.shard(model, stage)
        sharded.set_requires_gradient_sync(True)
        out[f"unused parameter, stage {stage}"] = attempt(
            lambda: (loss_sum(model, micro_batch(data, 0, rank, 0)) / (B * CONTEXT)).backward())
        attempt(sharded.close)

    # close() at stage 3: whole, trained, hook-free parameters; a lone rank then trains with ordinary .grad
    model = make_model(SEED)
    sharded = zero.shard(model, 3)
    optimizer = configure_optimizers(model, sharded.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    train_steps(model, sharded, optimizer, scheduler, data, range(2), rank)
    trained = cloned(sharded.model_state_dict())
    shapes = {name: tuple(p.shape) for name, p in make_model(SEED).named_parameters()}
    sharded.close()
    out["closed shapes"] = {name: tuple(p.shape) for name, p in model.named_parameters()} == shapes
    out["closed hooks"] = hooks_left(model)
    out["closed weights"] = cloned(model.state_dict())
    out["trained weights"] = trained
    if rank == 0:  # one rank alone: a collective left behind would hang here (and the call time out)
        loss_sum(model, micro_batch(data, 0, rank, 0)).backward()
        plain = make_model(SEED)
        plain.load_state_dict(out["closed weights"])
        loss_sum(plain, micro_batch(data, 0, rank, 0)).backward()
        plain_params = dict(plain.named_parameters())
        out["lone grads"] = {name: None if p.grad is None else (type(p.grad).__name__, p.grad.layout,
                                                                 torch.equal(p.grad, plain_params[name].grad))
                             for name, p in model.named_parameters()}
        # and a torch.optim optimizer of its own now steps it (the refusal went with the hooks)
        out["lone step"] = attempt(torch.optim.SGD(model.parameters(), lr=0.1).step)
        torch.optim.SGD(plain.parameters(), lr=0.1).step()
        out["lone step equal"] = max_difference(plain.state_dict(), model.state_dict()) == 0
    dist.barrier()
    return out


# ----------------------------------------------------------------------------------------------------------
# The runs: one call of the group per world size
# ----------------------------------------------------------------------------------------------------------
CONFIGS = [(f"stage {stage} {collectives}", stage, collectives)
           for stage in (0, 1, 2, 3) for collectives in ("torch", "ring")]
NAMES = [name for name, _, _ in CONFIGS]
REPLICA_CONFIGS = [("stage 3 torch", 3, ("torch", "torch")), ("stage 2 ring|torch", 2, ("ring", "torch"))]


@pytest.fixture(scope="module", params=[2, 3])
def runs(request, local_group):
    world_size = request.param
    results = local_group(world_size).submit(train_configs, CONFIGS, SEED, timeout_s=240)
    reference = reference_of(world_size, SEED)  # here, while the group trains
    return world_size, results(), reference


@pytest.fixture(scope="module")
def replica_runs(local_group):
    return local_group(4).run(train_replicas, REPLICA_CONFIGS, timeout_s=240)


@pytest.fixture(scope="module")
def misuse(local_group):
    return local_group(2).run(misuse_and_close, timeout_s=90)


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_reference_clips_every_step(world_size):
    norms = reference_of(world_size, SEED)["norms"]
    assert all(n > MAX_NORM for n in norms), norms


def test_the_data_split_gives_the_global_mean_gradient():
    """The harness itself: W ranks' window losses (sum / (B K T) each), averaged, are the global batch's mean."""
    world_size = 3
    data = make_data(SEED, world_size)
    model = make_model(SEED)
    F.cross_entropy(model(data[0, :, :-1]).reshape(-1, VOCAB), data[0, :, 1:].reshape(-1)).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for rank in range(world_size):
        for k in range(K):
            (loss_sum(model, micro_batch(data, 0, rank, k)) / (B * K * CONTEXT) / world_size).backward()
    assert max((p.grad - e).abs().max().item() for p, e in zip(model.parameters(), expected)) < 1e-13


@pytest.mark.parametrize("name", NAMES)
def test_weights_and_clip_norms_match_the_single_process_reference(runs, name):
    world_size, ranks, ref = runs
    run = ranks[0][name]
    worst = max_difference(ref["weights"], run["weights"])
    norm_error = max(abs(n - r) / r for n, r in zip(run["norms"], ref["norms"][:STEPS]))
    print(f"\n{world_size} processes, {name}: max |dw| = {worst:.1e}, clip norms' max relative error "
          f"{norm_error:.1e}")
    assert len(run["norms"]) == STEPS
    assert norm_error < NORM_RTOL, (run["norms"], ref["norms"][:STEPS])
    assert worst < WEIGHT_TOL


@pytest.mark.parametrize("name", NAMES)
def test_every_rank_holds_the_same_whole_model_and_the_head_stays_tied(runs, name):
    world_size, ranks, _ = runs
    full = ranks[0][name]["weights"]
    assert all(r[name]["weights"] == {} for r in ranks[1:])  # the full dict on the group's rank 0 only
    assert all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in full.values())
    for r in ranks:
        assert r[name]["tied"] and r[name]["tied after close"]
        assert max_difference(full, r[name]["closed"]) == 0  # after close(): whole, identical on every rank
        if "live" in r[name]:
            assert max_difference(full, r[name]["live"]) == 0
        assert all(a == b for a, b in zip(r[name]["norms"], ranks[0][name]["norms"]))


def compare_optimizer_states(ours: dict, theirs: dict) -> float:
    """torch.optim's form: the same groups (hyperparameters and index lists), state keys, steps; the worst
    difference of the state tensors relative to each tensor's largest element."""
    assert ours.keys() == theirs.keys() == {"state", "param_groups"}
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    worst = 0.0
    for index, state in theirs["state"].items():
        assert ours["state"][index].keys() == state.keys(), index
        for key, value in state.items():
            mine = ours["state"][index][key]
            if key == "step":
                assert float(mine) == float(value), index
                continue
            assert mine.shape == value.shape, (index, key)
            assert (mine - value).abs().max().item() < WEIGHT_TOL, (index, key)
            worst = max(worst, ((mine - value).abs().max() / value.abs().max()).item())
    return worst


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_state_dict_is_torch_optims_own(runs, name):
    world_size, ranks, ref = runs
    worst = compare_optimizer_states(ranks[0][name]["optimizer"], ref["optimizer"])
    storages, tensors = ranks[0][name]["state storages"]
    assert storages == tensors > 0
    print(f"\n{world_size} processes, {name}: optimizer state, max relative difference {worst:.1e}")
    assert worst < NORM_RTOL
    if not name.startswith("stage 0"):
        assert all(r[name]["optimizer"] == {} for r in ranks[1:])


@pytest.mark.parametrize("name", NAMES)
def test_a_fresh_shard_loaded_from_the_full_state_dicts_continues_as_the_reference(runs, name):
    world_size, ranks, ref = runs
    run = ranks[0][name]
    worst = max_difference(ref["resumed"], run["resumed"])
    norm_error = max(abs(n - r) / r for n, r in zip(run["resumed norms"], ref["norms"][STEPS:]))
    print(f"\n{world_size} processes, {name}, resumed: max |dw| = {worst:.1e}, clip norms {norm_error:.1e}")
    assert norm_error < NORM_RTOL
    assert worst < WEIGHT_TOL
    assert all(max_difference(run["resumed"], r[name]["resumed closed"]) == 0 for r in ranks)


@pytest.mark.parametrize("name", [name for name, _, _ in REPLICA_CONFIGS])
def test_two_replicas_on_sub_groups_each_train_as_if_alone(replica_runs, name):
    for replica, seed in enumerate(REPLICA_SEEDS):
        ref = reference_of(2, seed)
        first, second = replica_runs[2 * replica][name], replica_runs[2 * replica + 1][name]
        worst = max(max_difference(ref["weights"], first["weights"]),
                    max_difference(ref["resumed"], first["resumed"]))
        norm_error = max(abs(n - r) / r for n, r in zip(first["norms"] + first["resumed norms"], ref["norms"]))
        print(f"\nreplica {replica} (ranks {2 * replica}, {2 * replica + 1}), {name}: max |dw| = {worst:.1e}, "
              f"clip norms {norm_error:.1e}")
        assert second["weights"] == {}  # the group's rank 0 holds the full dict: global rank 2 for replica 1
        assert max_difference(first["weights"], second["closed"]) == 0
        assert norm_error < NORM_RTOL
        assert worst < WEIGHT_TOL
        compare_optimizer_states(first["optimizer"], ref["optimizer"])
    # the two replicas really trained different models
    assert max_difference(replica_runs[0][name]["weights"], replica_runs[2][name]["weights"]) > 1e-3


def one_line_refusals(misuse: list[dict], key: str, kind: str) -> list[str]:
    """Every rank's refusal recorded under ``key``: an exception of ``kind`` with a one-line message; the messages."""
    messages = []
    for r in misuse:
        got, message = r[key]
        print(f"\n{key}: {got}: {message}")
        assert got == kind and "\n" not in message.strip(), message
        messages.append(message)
    return messages


@pytest.mark.parametrize("stage", [1, 3])
def test_an_optimizer_built_outside_sharded_optimizer_refuses_to_step(misuse, stage):
    for message in one_line_refusals(misuse, f"outside optimizer, stage {stage}", "RuntimeError"):
        assert "sharded.optimizer" in message
    assert all(r[f"outside optimizer, stage {stage}, weights unchanged"] for r in misuse)


def test_stage_4_is_refused_in_one_line(misuse):
    one_line_refusals(misuse, "stage 4", "ValueError")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_parameter_without_gradient_is_named_at_the_end_of_backward(misuse, stage):
    for message in one_line_refusals(misuse, f"unused parameter, stage {stage}", "RuntimeError"):
        assert "blocks.1.spare.weight" in message or "blocks.1.spare.bias" in message, message


def test_close_leaves_an_ordinary_whole_model(misuse):
    for r in misuse:
        assert r["closed shapes"]
        assert r["closed hooks"] == []
        assert max_difference(misuse[0]["trained weights"], r["closed weights"]) == 0
    # rank 0 alone: ordinary dense .grad tensors, exactly what an unsharded copy of the model computes
    grads = misuse[0]["lone grads"]
    assert grads and all(g == ("Tensor", torch.strided, True) for g in grads.values()), grads
    assert misuse[0]["lone step"] == (None, None) and misuse[0]["lone step equal"], misuse[0]["lone step"]
