"""The GPT on text through the trainer: with the recipe language models are trained with (AdamW with betas
(0.9, 0.95), weight decay on matrices only, clipping that bites, linear warm-up then cosine, gradient accumulation),
every sync takes stage 0's steps in float64, the tied head stays tied, a short run learns, and a trained
checkpoint samples. The text set and the GPT themselves are test_text.py's.

Why 1e-10 in float64: the syncs differ from stage 0 only in the order of the sums (stages 2 and 3 average each
micro-batch before adding the micro-batches, the ring adds the ranks in its own order); each differs by a few
units of 2^-53 (1e-16) relative per step, and AdamW divides the gradient by its own running size, so a rounding
difference is carried at the same relative size into an update of about lr = 1e-2: after 4 steps some 1e-15 to
1e-13 (test_zero.py's argument, whose ResNet measures a few 1e-13). A real error (a group's decay applied to the
other group, a norm taken over one rank's shards, a micro-batch lost, a step at the wrong learning rate, the
tied weight updated twice) moves the weights at first order, lr x O(0.1) = 1e-3.
"""
import math

import pytest
import torch

import ddp_cifar100 as trainer
import models
import zero
from trainer.build import make_optimizer, make_scheduler
from zero_testing import max_difference

TINY_GPT = dict(layers=2, width=32, heads=2, context=16)  # float64 runs: small enough for many syncs
RECIPE = ["--device", "cpu", "--dataset", "text", "--model", "gpt", "--context", "16", "--val-fraction", "0.3",
          "--batch-size", "3", "--grad-accum", "2", "--epochs", "1", "--max-steps", "4", "--seed", "2",
          "--optimizer", "adamw", "--lr", "0.01", "--betas", "0.9", "0.95", "--weight-decay", "0.1",
          "--norm-weight-decay", "0", "--clip-grad-norm", "0.3", "--scheduler", "cosine", "--warmup-steps", "2",
          "--min-lr", "0.001", "--decay-steps", "4", "--bucket-mb", "0.01"]
SYNCS = {2: [("stage 0", ["--zero", "0"]), ("stage 1 torch", ["--zero", "1"]),
             ("stage 2 ring", ["--zero", "2", "--allreduce", "ring"]), ("stage 3 torch", ["--zero", "3"]),
             ("stage 3 ring, activation checkpointing", ["--zero", "3", "--allreduce", "ring",
                                                         "--activation-checkpointing"]),
             ("ddp", ["--grad-sync", "ddp"]),
             ("zero redundancy", ["--grad-sync", "ddp", "--zero", "1"]),
             ("fsdp 2", ["--grad-sync", "fsdp", "--zero", "2"]), ("fsdp 3", ["--grad-sync", "fsdp", "--zero", "3"])],
         3: [("stage 0", ["--zero", "0"]), ("stage 1 ring", ["--zero", "1", "--allreduce", "ring"]),
             ("stage 2 torch", ["--zero", "2"]), ("stage 3 torch", ["--zero", "3"]),
             ("fsdp 3, activation checkpointing", ["--grad-sync", "fsdp", "--zero", "3",
                                                   "--activation-checkpointing"])]}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Twelve real text files (the first 3 kB of standard library modules), so both splits hold several."""
    import data

    root = tmp_path_factory.mktemp("corpus")
    source = data.default_text_dir()
    for name in ("abc", "ast", "bisect", "calendar", "colorsys", "copy", "enum", "functools", "heapq", "os",
                 "random", "string"):
        with open(f"{source}/{name}.py", "rb") as f:
            (root / f"{name}.py").write_bytes(f.read()[:3000])
    return root


def train_gpt(rank, world_size, argv, variants, size, dtype):
    """Trainer runs of a GPT of ``size`` (patched into models.GPT_SIZES for the call): per variant the final
    weights, the metrics and whether the returned model's head is still its token embedding."""
    saved = dict(models.GPT_SIZES["gpt"])
    models.GPT_SIZES["gpt"].update(size)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        runs = {}
        for name, extra in variants:
            trained = trainer.train(trainer.parse_args(argv + extra))
            metrics, model = trained.metrics, trained.model
            state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
            runs[name] = {"state": {k: v.detach().clone() for k, v in state.items()},  # FSDP2: DTensors
                          "tied": model.head.weight is model.token_embedding.weight, "metrics": metrics}
        return runs
    finally:
        models.GPT_SIZES["gpt"].clear()
        models.GPT_SIZES["gpt"].update(saved)
        torch.set_default_dtype(previous)


@pytest.fixture(scope="module", params=[2, 3])
def recipe_runs(request, local_group, corpus):
    world_size = request.param
    argv = RECIPE + ["--data-dir", str(corpus)]
    return world_size, local_group(world_size).run(train_gpt, argv, SYNCS[world_size], TINY_GPT, torch.float64)


def test_every_sync_takes_stage_0s_steps_with_the_language_model_recipe(recipe_runs):
    world_size, ranks = recipe_runs
    reference = ranks[0]["stage 0"]
    norms = reference["metrics"]["grad_norms"]
    assert reference["metrics"]["optimizer_steps"] == 4
    assert min(norms) > 0.3, norms  # the clipping bites at every step
    for name, run in ranks[0].items():
        assert all(max_difference(run["state"], r[name]["state"]) == 0 for r in ranks), name  # whole everywhere
        worst = max_difference(reference["state"], run["state"])
        norm_error = max(abs(a - b) / b for a, b in zip(run["metrics"]["grad_norms"], norms, strict=True))
        print(f"\n{world_size} processes, GPT with the recipe: {name} vs stage 0 (float64): max |dw| = {worst:.1e}, "
              f"norms {norm_error:.1e} relative")
        assert worst <= 1e-10, name
        assert norm_error < 1e-9, name


def test_the_tied_head_stays_the_token_embedding_under_every_sync(recipe_runs):
    _, ranks = recipe_runs
    for name, run in ranks[0].items():
        assert run["tied"], name
        assert torch.equal(run["state"]["head.weight"], run["state"]["token_embedding.weight"]), name


def test_the_recipe_moves_the_weights_by_its_own_settings(recipe_runs):
    """The warm-up and the cosine are applied (the last step's rate is --min-lr's neighbourhood, not --lr), so
    a schedule left out would show; the figures per byte are consistent."""
    _, ranks = recipe_runs
    metrics = ranks[0]["stage 0"]["metrics"]
    assert metrics["val_bits_per_byte"] == pytest.approx(metrics["val_loss"] / math.log(2), rel=1e-12)
    assert metrics["val_total"] % 16 == 0 and metrics["tokens_per_s"] > 0
    assert metrics["epochs"][-1]["lr"] == pytest.approx(0.001, rel=1e-9)  # after 4 of 4 steps: the floor


def test_the_cosine_schedule_warms_up_then_falls_to_min_lr():
    args = trainer.parse_args(["--lr", "1.0", "--scheduler", "cosine", "--warmup-steps", "3", "--min-lr", "0.1"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler(args, optimizer, total_steps=9)
    rates = []
    for _ in range(9):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / 5)) for i in range(6)]
    assert rates == pytest.approx([1 / 4, 2 / 4, 3 / 4] + cosine, rel=1e-12)
    assert rates[3] == pytest.approx(1.0) and rates[-1] == pytest.approx(0.1)


@pytest.fixture(scope="module")
def learned(local_group, corpus, tmp_path_factory):
    """A short float32 run of a small GPT at 2 processes with ZeRO-3, checkpointed."""
    directory = tmp_path_factory.mktemp("learned")
    argv = ["--device", "cpu", "--dataset", "text", "--model", "gpt", "--data-dir", str(corpus), "--context", "32",
            "--val-fraction", "0.3", "--batch-size", "8", "--epochs", "3", "--seed", "1", "--optimizer", "adamw",
            "--lr", "3e-3", "--betas", "0.9", "0.95", "--weight-decay", "0.1", "--norm-weight-decay", "0",
            "--clip-grad-norm", "1.0", "--scheduler", "cosine", "--warmup-steps", "5", "--zero", "3",
            "--checkpoint-dir", str(directory)]
    size = dict(layers=2, width=64, heads=4, context=32)
    ranks = local_group(2).run(train_gpt, argv, [("learned", [])], size, torch.float32)
    return ranks[0]["learned"], directory, size


def test_a_short_run_learns_below_the_unigram_entropy(learned):
    """Bits per byte under the entropy of the validation bytes' histogram: the model uses context."""
    run, _, _ = learned
    metrics = run["metrics"]
    print(f"\nshort run: {metrics['val_bits_per_byte']:.3f} bits/byte, unigram {metrics['val_unigram_bits_per_byte']:.3f}, "
          f"gzip -9 {metrics['val_gzip_bits_per_byte']:.3f}, {metrics['optimizer_steps']} steps")
    assert metrics["val_bits_per_byte"] < metrics["val_unigram_bits_per_byte"]
    assert metrics["epochs"][-1]["val_bits_per_byte"] < metrics["epochs"][0]["val_bits_per_byte"]


def test_generate_continues_the_prompt_from_the_checkpoint(learned, capsysbinary):
    """--generate N prints the prompt and N sampled bytes (the GPT rebuilt at the checkpoint's own shape, not
    models.GPT_SIZES's); the same seed gives the same bytes."""
    _, directory, _ = learned
    argv = ["--checkpoint-dir", str(directory), "--generate", "60", "--prompt", "def ", "--seed", "4"]
    assert trainer.main(argv) == 0
    first = capsysbinary.readouterr().out
    assert first.startswith(b"def ") and len(first) == 4 + 60 + 1  # the prompt, the bytes, a new line
    assert trainer.main(argv) == 0
    assert capsysbinary.readouterr().out == first
    assert trainer.main(argv[:-1] + ["5"]) == 0
    assert capsysbinary.readouterr().out != first


@pytest.mark.parametrize("argv, phrase", [
    (["--generate", "5"], "--checkpoint-dir"),
    (["--generate", "5", "--checkpoint-dir", "/nonexistent"], "no checkpoint in /nonexistent"),
    (["--betas", "0.9", "0.95"], "--optimizer adamw"),
    (["--warmup-steps", "5"], "--scheduler cosine"),
    (["--optimizer", "adamw", "--scheduler", "cosine", "--min-lr", "1", "--lr", "0.1"], "above --lr"),
])
def test_recipe_and_generate_flags_are_checked_in_one_line(argv, phrase, capsys):
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert phrase in err and len(err.splitlines()) == 1, err


def test_betas_and_decay_groups_reach_the_optimizer():
    """--betas is AdamW's, and --norm-weight-decay puts the GPT's vectors (biases, LayerNorm weights) in a group
    of their own: the embeddings and the tied head are one matrix, in the decayed group once."""
    args = trainer.parse_args(["--dataset", "text", "--model", "gpt", "--optimizer", "adamw", "--betas", "0.8", "0.95",
                               "--weight-decay", "0.1", "--norm-weight-decay", "0"])
    model = models.build_model("gpt", 0.0, "local", 256)

    class Replicated:  # the sync's optimizer builder at stage 0: the optimizer class over the groups, as given
        @staticmethod
        def optimizer(kind, params, **settings):
            return kind(params, **settings)

    optimizer = make_optimizer(args, model, Replicated())
    decayed, plain = optimizer.param_groups
    assert optimizer.defaults["betas"] == (0.8, 0.95) and (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0)
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in plain["params"])
    assert sum(p is model.token_embedding.weight for p in decayed["params"]) == 1
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_activation_checkpointing_keeps_only_the_blocks_inputs_for_backward():
    """--activation-checkpointing (trainer.build.checkpoint_blocks): a forward saves for backward only what each
    block is given (its recomputation rebuilds the rest), a fraction of what the plain forward saves; the outputs
    and gradients are the same."""
    from trainer.build import checkpoint_blocks

    def saved_bytes_and_gradients(checkpointed):
        torch.manual_seed(0)
        model = models.GPT(vocab_size=256, **TINY_GPT)
        if checkpointed:
            checkpoint_blocks(model)
        saved = []
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
        return sum(saved), [p.grad.clone() for p in model.parameters()]

    plain, plain_gradients = saved_bytes_and_gradients(False)
    checkpointed, gradients = saved_bytes_and_gradients(True)
    assert checkpointed < plain / 2, (checkpointed, plain)
    assert all(torch.equal(a, b) for a, b in zip(gradients, plain_gradients))


# ----------------------------------------------------------------------------------------------------------
# --optimizer muon: Muon on the blocks' matrices, AdamW on the rest, through every sync
# ----------------------------------------------------------------------------------------------------------
MUON = ["--optimizer", "muon", "--muon-lr", "0.02", "--muon-weight-decay", "0.1"]  # AdamW's flags: RECIPE's


@pytest.fixture(scope="module")
def muon_runs(local_group, corpus, tmp_path_factory):
    """2 processes, the recipe with --optimizer muon, float64: stage 0, stage 3, ddp, fsdp 3, and stage 3 stopped
    after 2 of the 4 steps and resumed from its checkpoint, in one call."""
    directory = str(tmp_path_factory.mktemp("muon"))
    variants = [("stage 0", ["--zero", "0"]), ("stage 3", ["--zero", "3"]), ("ddp", ["--grad-sync", "ddp"]),
                ("fsdp 3", ["--grad-sync", "fsdp", "--zero", "3"]),
                ("stage 3 stopped", ["--zero", "3", "--max-steps", "2", "--checkpoint-dir", directory]),
                ("stage 3 resumed", ["--zero", "3", "--checkpoint-dir", directory])]
    argv = RECIPE + MUON + ["--data-dir", str(corpus)]
    return local_group(2).run(train_gpt, argv, variants, TINY_GPT, torch.float64)


def test_muon_takes_stage_0s_steps_at_stage_3_and_with_ddp(muon_runs):
    """--optimizer muon at --zero 3 (sharded.optimizer once per optimizer: Newton-Schulz on whole matrices, moved
    by two all-to-alls) and with DDP (torch.optim.Muon on whole parameters) ends within 1e-10 of stage 0 in
    float64: the module docstring's argument for AdamW, which steps the embeddings, head, norms and biases here.
    Muon adds no error of its own: it casts its momentum update to bf16 before Newton-Schulz, and a difference of
    1e-16 relative changes that cast only for a value within 1e-16 of a bf16 rounding boundary (~1e-14 of the
    elements: none of these 25k), so the orthogonalized updates are bit for bit stage 0's. Newton-Schulz on a
    rank's slice instead, or a schedule not applied to Muon's rate, is off by ~lr = 1e-2."""
    reference = muon_runs[0]["stage 0"]
    assert reference["metrics"]["optimizer_steps"] == 4
    for name in ("stage 3", "ddp"):
        run = muon_runs[0][name]
        assert all(max_difference(run["state"], r[name]["state"]) == 0 for r in muon_runs), name
        worst = max_difference(reference["state"], run["state"])
        print(f"\n2 processes, GPT, --optimizer muon: {name} vs stage 0 (float64): max |dw| = {worst:.1e}")
        assert worst <= 1e-10, name


def test_muon_under_fsdp_is_muon_to_bf16s_rounding(muon_runs):
    """--grad-sync fsdp: torch.optim.Muon over FSDP2's DTensors. It runs, and its Newton-Schulz is torch's over the
    DTensors: their matmuls run on the shards and their partial products are summed in bf16, another rounding of
    the same bf16 iteration (3e-2 of the largest entry of one orthogonalized 12 x 6 matrix, where bf16 against fp32
    is 1.5e-2), not stage 0's bits. So its weights part from stage 0's at bf16's rounding of the updates: well
    under what the matrices move, where Newton-Schulz on a shard's slice would be off by as much as they move."""
    reference, run = muon_runs[0]["stage 0"]["state"], muon_runs[0]["fsdp 3"]["state"]
    torch.manual_seed(2)  # the trainer's first weights (--seed 2, stage 0's eager build)
    start = models.GPT(vocab_size=256, **TINY_GPT).double().state_dict()
    matrices = [name for name, value in start.items() if name.startswith("blocks.") and value.dim() == 2]
    moved = max((reference[n] - start[n]).abs().max().item() for n in matrices)
    worst = max((reference[n] - run[n]).abs().max().item() for n in matrices)
    print(f"\n2 processes, GPT, --optimizer muon, fsdp 3 vs stage 0: matrices max |dw| = {worst:.1e}, they moved "
          f"{moved:.1e}")
    assert worst < 0.1 * moved


def test_muon_resumes_exactly(muon_runs):
    """Stopped after 2 steps at --zero 3 (its checkpoint a folder: AdamW's and Muon's state, each rank its shards)
    and resumed: the weights bit for bit those of the run that was not stopped."""
    resumed, uninterrupted = muon_runs[0]["stage 3 resumed"], muon_runs[0]["stage 3"]
    assert muon_runs[0]["stage 3 stopped"]["metrics"]["optimizer_steps"] == 2
    assert resumed["metrics"]["optimizer_steps"] == 4
    assert max_difference(resumed["state"], uninterrupted["state"]) == 0


def test_muon_steps_the_blocks_matrices_and_adamw_the_rest_as_one_optimizer():
    """--optimizer muon (trainer.build.make_optimizer): the loop gets one optimizer, AdamW's groups first (the
    loop's lr is --lr's): AdamW over the embeddings (the tied head once), norms and biases, split by
    --norm-weight-decay as AdamW alone is, with --betas; Muon over exactly the blocks' 2-D matrices with its flags
    and Nesterov. The cosine schedule gives both rates the same factor; a gradient scaler that finds an inf in
    one Muon gradient skips both steps, and steps both otherwise; state_dict() holds both, and zero.checkpoint
    takes the two."""
    from trainer.build import Optimizers

    args = trainer.parse_args(["--dataset", "text", "--model", "gpt", "--optimizer", "muon", "--lr", "0.01",
                               "--betas", "0.8", "0.95", "--weight-decay", "0.1", "--norm-weight-decay", "0",
                               "--muon-momentum", "0.9", "--scheduler", "cosine", "--warmup-steps", "1",
                               "--min-lr", "0.001", "--decay-steps", "4"])
    model = models.GPT(vocab_size=256, **TINY_GPT)  # small: Newton-Schulz in bf16 is slow on a CPU

    class Replicated:  # the sync's optimizer builder at stage 0: the optimizer class over the groups, as given
        @staticmethod
        def optimizer(kind, params, **settings):
            return kind(params, **settings)

    optimizer = make_optimizer(args, model, Replicated())
    assert isinstance(optimizer, Optimizers) and list(optimizer.named) == ["adamw", "muon"]
    adamw, muon = optimizer.optimizers
    assert type(adamw) is torch.optim.AdamW and type(muon) is torch.optim.Muon
    matrices = [p for block in model.blocks for p in block.parameters() if p.dim() == 2]
    assert [id(p) for p in muon.param_groups[0]["params"]] == [id(p) for p in matrices]
    assert {k: muon.param_groups[0][k] for k in ("lr", "momentum", "weight_decay", "nesterov")} == {
        "lr": 0.02, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True}
    decayed, plain = adamw.param_groups
    assert [p is model.token_embedding.weight for p in decayed["params"]].count(True) == 1
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {id(p) for p in model.parameters()}
    assert adamw.defaults["betas"] == (0.8, 0.95) and (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0)
    assert optimizer.param_groups[0] is decayed  # the very dicts: what a scheduler writes reaches the optimizers

    scheduler = make_scheduler(args, optimizer, total_steps=4)
    for _ in range(4):
        assert muon.param_groups[0]["lr"] / 0.02 == pytest.approx(adamw.param_groups[0]["lr"] / 0.01, rel=1e-12)
        optimizer.step()
        scheduler.step()
    assert adamw.param_groups[0]["lr"] == pytest.approx(0.001) and muon.param_groups[0]["lr"] == pytest.approx(0.002)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    before = [p.detach().clone() for p in model.parameters()]
    for overflow in (True, False):
        scaler.scale(model(torch.randint(0, 256, (2, 8))).logsumexp(-1).mean()).backward()
        if overflow:
            matrices[0].grad[0, 0] = float("inf")
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        moved = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
        assert not any(moved) if overflow else all(moved)
        optimizer.zero_grad()
    state = optimizer.state_dict()
    assert sorted(state) == ["adamw", "muon"] and "momentum_buffer" in state["muon"]["state"][0]
    assert zero.optimizer_kinds.as_optimizers(optimizer) == [adamw, muon]  # what zero.checkpoint saves and loads
