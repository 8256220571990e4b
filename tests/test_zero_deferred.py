"""ZeRO at the scale stage 3 exists for, through zero.shard's public contract: a model built on the meta device and
materialized shard by shard (``init=``), frozen weights sharded too, and a whole state_dict loaded from rank 0 alone.

What is checked, in the session's reusable gloo workers (``local_group``), one call per world size (1 to 4):
- deferred initialization: a small GPT-like model (tied head written by two modules, so the last write must win; a
  buffer filled by ``fn``; frozen parts) built on the meta device and sharded with ``init=fn`` at every stage 0-3
  gives bit for bit what ONE process gets from ``to_empty`` + ``fn`` over ``model.modules()``; and models.py's GPT
  built on meta with ``models.initializer`` equals its eager build at stage 3;
- frozen parameters (LoRA-style: a frozen base Linear beside a trainable low-rank update, a frozen LayerNorm before
  them, a frozen embedding tied to the head) at every stage, 2 optimizer steps of 2 micro-batches each, AdamW, and
  at stage 3 also with activation checkpointing around each block: the weights equal one process training on the
  global batch. The frozen LayerNorm's backward comes after the block's last trainable gradient, so a unit freed
  when its gradients are in (not when its inputs' gradient is) would be read after it is gone. At stage 3 each rank
  holds 1/W of the frozen weights, and none of them between steps;
- ``load_model_state_dict`` given the state on rank 0 only (the others None) at every stage (and under a lower
  param_dtype, stage 2): the model then holds exactly that state, and at stage 3 no other rank receives more than
  one part's chunk of it;
- refusals in one line: a meta model without ``init``, ``init`` for a model that is not on meta, a model partly on
  meta, ranks whose generators differ, an ``fn`` that touches another module's parameters at stage 3.

Why the tolerances hold: initialization and loading are bit for bit (the same operations on the same values: ==).
Training runs in float64, the sharded stages summing the same terms in another order (a few units of 2^-53 per
gradient), which 2 AdamW steps carry to ~1e-15 on weights of order 1: 1e-10 keeps a wide margin, and a real error
(a frozen weight stepped, a gradient lost, a unit read after it was freed) moves weights by ~lr = 1e-2.

models.py's meta build against its eager build (in this process, one model per family: the net, the small ResNet,
torchvision's ResNet (resnet18: a downsample made before its block), torchvision's VisionTransformer (the small
ViT), the GPT; the other members of each family are the same code at other sizes, Bottlenecks too, and
gpt-tiny's stage-3 build is checked above): the state dicts and the generator's state after the build are equal.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import models
import zero
import zero.init

VOCAB, WIDTH, DEPTH, CONTEXT, RANK = 13, 8, 3, 6, 2
B, K, STEPS, LR = 2, 2, 2, 1e-2
SEED, DATA_SEED = 3, 7
TOL = 1e-10


# ----------------------------------------------------------------------------------------------------------
# The model: LoRA-style blocks, a tied head, a buffer
# ----------------------------------------------------------------------------------------------------------
class Adapted(nn.Module):
    """A base Linear (frozen in the fine-tuning variant) plus a trainable low-rank update."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, RANK, bias=False)
        self.up = nn.Linear(RANK, WIDTH, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.mix = Adapted()
        self.out = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("gain", torch.empty(WIDTH))
        self.checkpointed = False

    def forward(self, x):
        return x + self.out(torch.tanh(self.mix(self.ln(x)))) * self.gain


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if block.checkpointed else block(x)
        return self.head(self.ln_f(x))


def init_fn(module):
    """Initializes a module's own tensors only; the head writes the tied weight after the embedding did."""
    if isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.5)
    elif isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.3 if module.out_features == VOCAB else 0.2)
        if module.bias is not None:
            nn.init.uniform_(module.bias, -0.1, 0.1)
    elif isinstance(module, nn.LayerNorm):
        nn.init.normal_(module.weight, 1.0, 0.1)
        nn.init.uniform_(module.bias, -0.1, 0.1)
    elif isinstance(module, Block):
        module.gain.uniform_(0.5, 1.5)


def meta_model(frozen: bool = False) -> Tiny:
    with torch.device("meta"):
        model = Tiny().double()
    if frozen:
        freeze(model)
    return model


def freeze(model: Tiny) -> None:
    """Fine-tuning: the embedding (and so the tied head), each block's LayerNorm and base Linear are frozen."""
    model.tok.weight.requires_grad_(False)
    for block in model.blocks:
        for p in list(block.ln.parameters()) + list(block.mix.base.parameters()):
            p.requires_grad_(False)


def one_process_init(frozen: bool = False) -> Tiny:
    """The contract's reference: to_empty (the tie made again: to_empty unties it), fn over model.modules()."""
    torch.manual_seed(SEED)
    model = meta_model(frozen)
    model.to_empty(device="cpu")
    model.head.weight = model.tok.weight
    with torch.no_grad():
        for module in model.modules():
            init_fn(module)
    return model


def batches(world_size: int) -> torch.Tensor:
    """(steps, world_size * K * B sequences, CONTEXT + 1 tokens)."""
    return torch.randint(0, VOCAB, (STEPS, world_size * K * B, CONTEXT + 1),
                         generator=torch.Generator().manual_seed(DATA_SEED))


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="sum")


def trained_reference(world_size: int) -> dict:
    """One process, the global batch of each step, AdamW over the trainable parameters."""
    model = one_process_init(frozen=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    data = batches(world_size)
    for step in range(STEPS):
        (loss_of(model, data[step]) / data[step].shape[0]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------------------
# In the workers
# ----------------------------------------------------------------------------------------------------------
def state_of(sharded) -> dict:
    """The whole state_dict (a collective: every rank calls it; rank 0 gets it, the others {})."""
    return {k: v.clone() for k, v in sharded.model_state_dict().items()}


def received_numels(monkeypatch_target):
    """Wraps dist.scatter and dist.broadcast to record the element counts this rank receives."""
    seen = []
    originals = {name: getattr(dist, name) for name in ("scatter", "broadcast")}

    def recording(name):
        def call(tensor, *args, **kwargs):
            seen.append(tensor.numel())
            return originals[name](tensor, *args, **kwargs)
        return call

    for name in originals:
        setattr(monkeypatch_target, name, recording(name))
    return seen, lambda: [setattr(monkeypatch_target, name, fn) for name, fn in originals.items()]


def deferred_cases(rank: int, world_size: int, reference_state: dict) -> dict:
    out: dict = {}
    # deferred initialization at every stage, frozen parts or not
    for stage in range(4):
        for frozen in (False, True):
            torch.manual_seed(SEED)
            model = meta_model(frozen)
            sharded = zero.shard(model, stage, init=init_fn)
            out[f"init stage {stage}{' frozen' if frozen else ''}"] = state_of(sharded)
            sharded.close()
    # models.py's GPT on meta at stage 3 against its eager build
    torch.manual_seed(SEED)
    with torch.device("meta"):
        gpt = models.build_model("gpt-tiny", 0.0, "local", 256)
    sharded = zero.shard(gpt, 3, models.blocks(gpt), init=models.initializer(gpt))
    out["models.gpt-tiny stage 3"] = state_of(sharded)
    sharded.close()
    # frozen parameters trained, at every stage (stage 3 with activation checkpointing too)
    data = batches(world_size)
    for stage, checkpointed in [(0, False), (1, False), (2, False), (3, False), (3, True)]:
        torch.manual_seed(SEED)
        model = meta_model(frozen=True)
        for block in model.blocks:
            block.checkpointed = checkpointed
        sharded = zero.shard(model, stage, init=init_fn)
        optimizer = sharded.optimizer(torch.optim.AdamW, [p for p in model.parameters() if p.requires_grad], lr=LR)
        frozen = [p for p in model.parameters() if not p.requires_grad]
        for step in range(STEPS):
            for k in range(K):
                sharded.set_requires_gradient_sync(k == K - 1)
                first = (rank * K + k) * B
                (loss_of(model, data[step, first:first + B]) / (K * B)).backward()
            if stage == 3:  # after the window's backward, before the step's prefetch: nothing gathered
                held = (sum(p.untyped_storage().nbytes() for p in frozen),
                        sum(s.numel() for s in sharded.held_shards()),
                        sum(part.length for u in sharded.units for part in u.frozen))
            optimizer.step()
            optimizer.zero_grad()
        name = f"train stage {stage}{' checkpointed' if checkpointed else ''}"
        out[name] = state_of(sharded)
        if stage == 3:
            out[name + " frozen held"] = held
        sharded.close()
    # a whole state_dict given on rank 0 only
    for stage, param_dtype in [(0, None), (1, None), (2, None), (2, torch.float32), (3, None)]:
        torch.manual_seed(SEED + 1)  # other weights than the state's
        model = meta_model(frozen=stage == 3)
        sharded = zero.shard(model, stage, init=init_fn, param_dtype=param_dtype)
        seen, restore = received_numels(dist)
        try:
            sharded.load_model_state_dict(reference_state if rank == 0 else None)
        finally:
            restore()
        name = f"rank-0 load stage {stage}{' ' + str(param_dtype) if param_dtype else ''}"
        out[name] = state_of(sharded)
        if stage == 3:  # what this rank received, and one part's chunk
            out["rank-0 load received"] = (max(seen, default=0), max(part.length for part in sharded.parts()) // world_size)
        sharded.close()
    return out


def refusal_cases(rank: int, world_size: int) -> dict:
    out = {}

    def refused(call):
        try:
            call()
        except ValueError as exc:
            return str(exc)
        return None

    torch.manual_seed(rank)  # the ranks' generators differ
    out["generators differ"] = refused(lambda: zero.shard(meta_model(), 3, init=init_fn))
    torch.manual_seed(SEED)

    def recursing(module):  # initializes the children's tensors too
        for p in module.parameters():
            nn.init.zeros_(p)
    out["fn touches another module"] = refused(lambda: zero.shard(meta_model(), 3, init=recursing))
    return out


@pytest.fixture(scope="module")
def every_rank(local_group):
    """{world size: every rank's results}."""
    reference_state = {k: v.clone() for k, v in one_process_init(frozen=True).state_dict().items()}
    pending = {w: local_group(w).submit(deferred_cases, reference_state, timeout_s=240) for w in WORLDS}
    return {w: results() for w, results in pending.items()}


@pytest.fixture(scope="module")
def deferred_runs(every_rank):
    """{world size: rank 0's results}."""
    return {w: results[0] for w, results in every_rank.items()}


# ----------------------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------------------
WORLDS = (1, 2, 3, 4)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen parts"])
def test_meta_init_equals_one_process_bit_for_bit(deferred_runs, world_size, stage, frozen):
    expected = one_process_init(frozen).state_dict()
    got = deferred_runs[world_size][f"init stage {stage}{' frozen' if frozen else ''}"]
    assert got.keys() == expected.keys()
    unequal = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not unequal, unequal
    assert torch.equal(got["head.weight"], got["tok.weight"])  # the head's write (the last) is the tied tensor's


@pytest.mark.parametrize("world_size", WORLDS)
def test_models_gpt_on_meta_equals_its_eager_build_at_stage_3(deferred_runs, world_size):
    torch.manual_seed(SEED)
    eager = models.build_model("gpt-tiny", 0.0, "local", 256).state_dict()
    got = deferred_runs[world_size]["models.gpt-tiny stage 3"]
    assert [k for k in eager if not torch.equal(got[k], eager[k])] == []


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("case", ["stage 0", "stage 1", "stage 2", "stage 3", "stage 3 checkpointed"])
def test_frozen_parameters_train_as_one_process(deferred_runs, world_size, case):
    expected = trained_reference(world_size)
    got = deferred_runs[world_size][f"train {case}"]
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    print(f"\n{case}, {world_size} processes: worst |w - one process| = {worst:.1e}")
    assert worst < TOL, worst
    frozen_names = ["tok.weight"] + [f"blocks.{i}.{n}" for i in range(DEPTH) for n in
                                     ("ln.weight", "ln.bias", "mix.base.weight", "mix.base.bias")]
    initial = one_process_init(frozen=True).state_dict()
    assert all(torch.equal(got[k], initial[k]) for k in frozen_names)  # never stepped
    assert any(not torch.equal(got[k], initial[k]) for k in got if k not in frozen_names)


@pytest.mark.parametrize("world_size", WORLDS)
def test_stage_3_holds_a_1_over_w_shard_of_the_frozen_weights(deferred_runs, world_size):
    views_bytes, shard_numel, padded_numel = deferred_runs[world_size]["train stage 3 frozen held"]
    assert views_bytes == 0  # the model's frozen parameters have no memory between steps
    assert shard_numel * world_size == padded_numel


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("case", ["stage 0", "stage 1", "stage 2", "stage 2 torch.float32", "stage 3"])
def test_a_state_dict_on_rank_0_alone_loads(deferred_runs, world_size, case):
    expected = one_process_init(frozen=True).state_dict()
    got = deferred_runs[world_size][f"rank-0 load {case}"]
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_rank_0_sends_each_other_rank_its_chunks_only(every_rank, world_size):
    """The other ranks' side of the stage-3 load: the largest tensor each received is one part's chunk."""
    for rank, results in enumerate(every_rank[world_size][1:], 1):
        largest, chunk = results["rank-0 load received"]
        assert largest <= chunk, (rank, largest, chunk)


def test_refusals_in_one_line(local_group):
    results = local_group(2).run(refusal_cases)
    for result in results:
        assert "seed every rank alike" in result["generators differ"] and "\n" not in result["generators differ"]
        message = result["fn touches another module"]
        assert "touched" in message and "of another module" in message and "\n" not in message, message


@pytest.mark.parametrize("case", ["meta without init", "init without meta", "partly meta"])
def test_misuse_of_init_is_refused_before_any_collective(case):
    """No process group exists here: each refusal comes before shard() communicates."""
    if case == "meta without init":
        model, init, phrase = meta_model(), None, "pass init=fn"
    elif case == "init without meta":
        model, init, phrase = Tiny(), init_fn, "init= is for a model built on the meta device"
    else:
        model, init, phrase = meta_model(), init_fn, "partly on the meta device"
        model.blocks[0].out = nn.Linear(WIDTH, WIDTH)
    with pytest.raises(ValueError, match=phrase) as refused:
        zero.shard(model, 3, init=init)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name", ["net", "resnet", "resnet18", "vit", "gpt"])
def test_models_built_on_meta_equal_their_eager_build(name):
    classes = 256 if name.startswith("gpt") else 10
    torch.manual_seed(SEED)
    eager = models.build_model(name, 0.5, "custom", classes, 32)
    after_eager = torch.get_rng_state()
    torch.manual_seed(SEED)
    with torch.device("meta"):
        meta = models.build_model(name, 0.5, "custom", classes, 32)
    zero.init.initialize_whole(meta, models.initializer(meta), torch.device("cpu"), torch.device("cpu"))
    expected, got = eager.state_dict(), meta.state_dict()
    assert got.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    assert torch.equal(torch.get_rng_state(), after_eager)  # the generator left where the eager build leaves it



def test_the_fsdp2_reference_build_lets_each_unit_go_once_it_is_sharded():
    """references.shard_as_initialized (the trainer's and the benchmarks' FSDP2 build): once a unit is handed to
    fully_shard, its whole parameters are gone before the next unit is made, so no rank holds more than one unit
    whole (here `shard` replaces a unit's parameters by new tensors, as fully_shard does with its DTensor
    shards). Holding them to the end cost FSDP2 a whole model in the trainer's GPT-2 large build."""
    import weakref

    import references

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    whole_ones, freed_before_each_unit = [], []

    def init(module):
        if isinstance(module, nn.Linear):
            freed_before_each_unit.append([ref() is None for ref in whole_ones])
            module.reset_parameters()

    def shard(module):
        for name, p in list(module._parameters.items()):
            whole_ones.append(weakref.ref(p))
            module._parameters[name] = nn.Parameter(p.detach()[:1].clone())

    references.shard_as_initialized(model, list(model), init, shard)
    assert freed_before_each_unit == [[], [True, True], [True, True, True, True]]

def cuda_deferred_case(rank: int, world_size: int) -> dict:
    """Stage 3 on the GPU from the meta device, initialized on the CPU (the trainer's init_device), frozen parts,
    2 steps with activation checkpointing; then the whole state loaded from rank 0."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(SEED)
    model = meta_model(frozen=True)
    for block in model.blocks:
        block.checkpointed = True
    sharded = zero.shard(model, 3, init=init_fn, device=device, init_device="cpu")
    out = {"init": {k: v.cpu() for k, v in state_of(sharded).items()}}
    optimizer = sharded.optimizer(torch.optim.AdamW, [p for p in model.parameters() if p.requires_grad], lr=LR)
    data = batches(world_size).to(device)
    for step in range(STEPS):
        for k in range(K):
            sharded.set_requires_gradient_sync(k == K - 1)
            first = (rank * K + k) * B
            (loss_of(model, data[step, first:first + B]) / (K * B)).backward()
        optimizer.step()
        optimizer.zero_grad()
    out["trained"] = {k: v.cpu() for k, v in state_of(sharded).items()}
    sharded.load_model_state_dict(out["init"] if rank == 0 else None)
    out["reloaded"] = {k: v.cpu() for k, v in state_of(sharded).items()}
    sharded.close()
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_deferred_stage_3_on_cuda_matches_the_cpu_reference():
    """One rank over NCCL (NCCL refuses two ranks on one GPU): the CUDA paths of the placeholders, the CPU-side
    initialization, frozen parts, the inputs' gradient hook, activation checkpointing and the rank-0 load."""
    from harness import LocalGroup

    with LocalGroup(1, backend="nccl") as group:
        out = group.run(cuda_deferred_case, timeout_s=240)[0]
    expected = one_process_init(frozen=True).state_dict()
    assert [k for k in expected if not torch.equal(out["init"][k], expected[k])] == []
    trained = trained_reference(1)
    worst = max((out["trained"][k] - trained[k]).abs().max().item() for k in trained)
    assert worst < TOL, worst
    assert [k for k in expected if not torch.equal(out["reloaded"][k], expected[k])] == []
