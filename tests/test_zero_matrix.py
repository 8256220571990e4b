"""zero's whole-matrix optimizers (zero/matrix.py): torch.optim.Muon beside AdamW (Muon's recipe: two optimizers over
one sharded model) and torch.optim.Adafactor, at stages 1-3, with both collectives, at 2 and 3 processes, float64,
against ONE process running torch's own optimizers on the global batch; in the session's reusable gloo workers, one
call per world size for the whole table.

The model is a user's small residual MLP built to give the placement its cases: in each block a matrix with more rows
than columns (``up``, 24 x 16), one stored transposed (``down``, 16 x 24 with strides (1, 16)), a small one that lies
inside one rank's chunk (``gate``, 4 x 4), a 3-D parameter (``mix``, 2 x 8 x 8: Adafactor factors each 8 x 8
matrix), biases and norms, and a 0-dim temperature; buckets (stages 1-2) and units (stage 3, the blocks) cut so that
at 3 processes some matrix spans three ranks (the harness checks each case is there). Muon takes the blocks' 2-D
matrices in two groups (one with ``adjust_lr_fn="match_rms_adamw"``), AdamW the rest in two (decay on matrices).
Gradient accumulation (2 micro-batches) and a clip that bites on every step.

For each configuration: 3 processes train STEPS steps from scratch, then 2 processes load their state at the NEXT
stage (3 -> 1) and train MORE steps: from the whole state dicts, and the ring's at stage 3 from a sharded checkpoint
of stage 1's (zero.checkpoint, whose single-file form is checked against the state dicts too). Checked: the
weights, and each optimizer's ``state_dict()`` (torch.optim's own form: Muon's momentum_buffer, Adafactor's step,
row_var / col_var in torch's shapes, and variance), against the reference; a plain torch.optim optimizer loads the
sharded one's state dict; the bytes a step sends with Muon against AdamW's at the same stage; the Newton-Schulz work
per rank.

Tolerances. Muon + AdamW: 1e-12, as for any element-wise optimizer (test_zero_optimizers' argument: float64, the
same terms summed in another order, ~1e-14 after a few steps). Muon adds one thing an error could hide in: its
Newton-Schulz runs in bf16, so an update that is not bit for bit torch's (another matrix, another layout, a slice)
is off by bf16's rounding at least, 2^-9 relative of an update of lr ~ 1e-2: ~1e-5 on the weights, seven orders
above the tolerance. A Newton-Schulz run on each rank's slice instead of the whole matrix is off by far more (its
norm and Gram matrix are the slice's). Adafactor: ADAFACTOR_TOL, argued at ``test_adafactor_is_torchs_own``.
"""
import functools
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero
from zero_testing import (GlobalBatches, attempt, cloned, identical, max_difference, seeded_model,
                          state_difference)

FEATURES, HIDDEN, WIDE, CLASSES, DEPTH = 6, 16, 24, 5, 2
GLOBAL_BATCH, K = 12, 2        # samples per step over all ranks (2 and 3 divide it); micro-batches per step
STEPS, MORE = 2, 2             # steps from scratch on 3 processes; steps after the load on 2
MAX_NORM, SEED = 0.5, 3
BUCKET_MB = 800 * 8 / 2**20    # buckets of at most 800 float64 elements: every block's matrices cut across ranks
MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95)}
ADAFACTOR = {"lr": 1e-2, "weight_decay": 0.01}
TOL = 1e-12
STAGES, COLLECTIVES = (1, 2, 3), ("torch", "ring")
RECIPES = ("muon", "adafactor")
CONFIGS = [(recipe, stage, collectives) for recipe in RECIPES for stage in STAGES for collectives in COLLECTIVES]
BATCHES = GlobalBatches(steps=STEPS + MORE, size=GLOBAL_BATCH, features=FEATURES, classes=CLASSES, micro_batches=K,
                        seed=SEED)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, WIDE)  # 24 x 16: more rows than columns
        self.down = nn.Parameter(torch.randn(WIDE, HIDDEN).t() / math.sqrt(WIDE))  # 16 x 24, stored transposed
        self.gate = nn.Parameter(torch.eye(4) + 0.1 * torch.randn(4, 4))  # small: inside one rank's chunk
        self.mix = nn.Parameter(0.2 * torch.randn(2, 8, 8))  # 3-D: Adafactor factors each 8 x 8

    def forward(self, x):
        h = F.linear(F.gelu(self.up(self.norm(x))), self.down)
        h = torch.einsum("bgi,ij->bgj", h.view(-1, 4, 4), self.gate).reshape(-1, HIDDEN)
        h = torch.einsum("bhi,hij->bhj", h.view(-1, 2, 8), self.mix).reshape(-1, HIDDEN)
        return x + h


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.temperature = nn.Parameter(torch.tensor(0.8))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) / self.temperature


def make_model() -> Net:
    return seeded_model(Net, SEED)


def build_optimizers(factory, recipe: str, model: Net) -> list[torch.optim.Optimizer]:
    """``factory(cls, groups, **settings)``: torch.optim's own, or ``sharded.optimizer``. Muon's recipe: Muon on the
    blocks' 2-D matrices (the ``up`` ones with Moonlight's learning-rate match), AdamW on the rest."""
    if recipe == "adafactor":
        return [factory(torch.optim.Adafactor, model.parameters(), **ADAFACTOR)]
    if recipe == "adamw":  # alone, over everything: the bytes Muon's recipe is measured against
        return [factory(torch.optim.AdamW, model.parameters(), **ADAMW)]
    matrices = [p for block in model.blocks for p in block.parameters() if p.dim() == 2]
    ups = [block.up.weight for block in model.blocks]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    muon = factory(torch.optim.Muon, [{"params": ups, "adjust_lr_fn": "match_rms_adamw"},
                                      {"params": [p for p in matrices if all(p is not u for u in ups)]}], **MUON)
    adamw = factory(torch.optim.AdamW, [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
                                        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}], **ADAMW)
    return [muon, adamw]


def reference(recipe: str, skip: int | None = None, summed_over: int | None = None, device: str = "cpu") -> dict:
    """One process, torch's optimizers: the state dicts and weights after STEPS steps, and after STEPS + MORE. The
    gradient is the global batch's mean; with ``summed_over`` W, the same gradient summed as W ranks' micro-batches
    are (each micro-batch's loss backward in turn, accumulating): another order of the same float64 sums. ``skip``:
    the last optimizer's step is skipped at that step, as sharded_run does."""
    unsharded = lambda cls, groups, **s: cls(groups, **s)  # noqa: E731
    model = make_model().to(device)
    optimizers = build_optimizers(unsharded, recipe, model)
    x, y = (t.to(device) for t in BATCHES.tensors())
    out = {}
    for step in range(STEPS + MORE):
        if summed_over is None:
            F.cross_entropy(model(x[step]), y[step]).backward()
        else:
            for rank in range(summed_over):
                for k in range(K):
                    xs, ys = (t.to(device) for t in BATCHES.micro_batch(step, rank, summed_over, k))
                    (F.cross_entropy(model(xs), ys, reduction="sum") / GLOBAL_BATCH).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for i, optimizer in enumerate(optimizers):
            if not (step == skip and i == len(optimizers) - 1):
                optimizer.step()
            optimizer.zero_grad()
        if step == STEPS - 1:
            out["states"] = [cloned(optimizer.state_dict()) for optimizer in optimizers]
            out["weights at STEPS"] = cloned(model.state_dict())
    out["weights"] = cloned(model.state_dict())
    out["resumed states"] = [cloned(optimizer.state_dict()) for optimizer in optimizers]
    return out


# ----------------------------------------------------------------------------------------------------------
# In the workers
# ----------------------------------------------------------------------------------------------------------
def sharded_run(recipe: str, stage: int, collectives: str, steps: range, load: dict | str | None = None,
                skip: int | None = None, device: str = "cpu", save: str | None = None) -> dict:
    """A fresh model, shard and optimizers, loaded from ``load`` if given (the whole state dicts, or the folder of a
    sharded checkpoint: zero.checkpoint), ``steps`` steps (at step ``skip`` the last optimizer's step is skipped,
    as a gradient scaler skips one whose gradients overflowed), saved to the folder ``save`` if given; rank 0 gets
    the state dicts, the others check they got {}."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model().to(device)
    kwargs = {"bucket_mb": BUCKET_MB} if stage < 3 else {}
    sharded = zero.shard(model, stage, collectives=collectives, **kwargs)
    optimizers = build_optimizers(sharded.optimizer, recipe, model)
    if isinstance(load, str):  # each rank reads what its shards hold, the factored statistics whole
        zero.checkpoint.load(load, sharded, optimizers)
    elif load is not None:
        sharded.load_model_state_dict(load["weights"])
        for optimizer, state in zip(optimizers, load["states"]):
            optimizer.load_state_dict(state)
    sent = sharded.sent_bytes()
    for step in steps:
        for k in range(K):
            sharded.set_requires_gradient_sync(k == K - 1)
            x, y = (t.to(device) for t in BATCHES.micro_batch(step, rank, world_size, k))
            (F.cross_entropy(model(x), y, reduction="sum") / (GLOBAL_BATCH / world_size)).backward()
        sharded.clip_grad_norm_(MAX_NORM)
        for i, optimizer in enumerate(optimizers):
            if not (step == skip and i == len(optimizers) - 1):
                optimizer.step()
            optimizer.zero_grad()
    if save is not None:
        zero.checkpoint.save(save, sharded, optimizers)
    if stage == 3:  # the step edge's prefetch lands (on the ring's thread it may still be sending)
        sharded.drop_gathered()
    out = {"sent": sharded.sent_bytes() - sent,
           "exchange": sum(o.exchange_bytes() for o in optimizers if hasattr(o, "exchange_bytes")),
           "placement": [placement(o) for o in optimizers if hasattr(o, "whole_parameters")],
           "states": [optimizer.state_dict() for optimizer in optimizers],
           "weights": sharded.model_state_dict()}
    sharded.close()
    if rank != 0:
        return {"empty elsewhere": out["weights"] == {} and all(state == {} for state in out["states"]),
                "sent": out["sent"], "exchange": out["exchange"]}
    return cloned(out)


def placement(optimizer) -> dict:
    """Where a whole-matrix optimizer's parameters lie: each one's holders, owner and shape, and the Newton-Schulz
    load per rank (Muon)."""
    return {"holders": {p.name: [r for r, _, _ in p.pieces] for p in optimizer.whole_parameters},
            "owners": {p.name: p.owner for p in optimizer.whole_parameters},
            "shapes": {p.name: tuple(p.shape) for p in optimizer.whole_parameters},
            "strides": {p.name: p.strides for p in optimizer.whole_parameters},
            "load": getattr(optimizer, "newton_schulz_load", None)}


BYTE_RUNS = [("adamw", stage, "torch") for stage in STAGES]  # AdamW alone over the same model: the bytes to beat
SKIP_RUNS = [("muon", stage, "torch") for stage in (1, 3)]  # AdamW's step skipped once: a gather, a prefetch


SAVED_STAGE = 1  # the ring's runs of this stage are saved as sharded checkpoints; the ring's at stage 3 load them


def folder_of(root: str, recipe: str) -> str:
    return os.path.join(root, recipe)


def train_configs(rank, world_size, configs, root):
    """Every config from scratch for STEPS steps (the ring's at SAVED_STAGE saved by zero.checkpoint under
    ``root``); AdamW alone at each stage (bytes); Muon + AdamW with a skip."""
    out = {(recipe, stage, collectives): sharded_run(
        recipe, stage, collectives, range(STEPS),
        save=folder_of(root, recipe) if (stage, collectives) == (SAVED_STAGE, "ring") else None)
        for recipe, stage, collectives in configs}
    out.update({config: sharded_run(*config, range(STEPS)) for config in BYTE_RUNS})
    out.update({("skip",) + config: sharded_run(*config, range(STEPS), skip=0) for config in SKIP_RUNS})
    return out


def resume_configs(rank, world_size, configs, saved, torch_states, root):
    """Each config loaded from the 3 processes' state at the NEXT stage (3 -> 1), then MORE steps: from the state
    dicts ``saved``, and the ring's at stage 3 from the sharded checkpoint (zero.checkpoint) of SAVED_STAGE under
    ``root``; and at stage 3 from torch's own state dicts (``torch_states``: recipe -> weights and states of one
    process); AdamW alone (bytes); the refusals."""
    out = {("resumed", recipe, stage, collectives):
           sharded_run(recipe, stage, collectives, range(STEPS, STEPS + MORE),
                       folder_of(root, recipe) if stage % 3 + 1 == SAVED_STAGE and collectives == "ring"
                       else saved[recipe, stage % 3 + 1, collectives])
           for recipe, stage, collectives in configs}
    out.update({("from torch", recipe): sharded_run(recipe, 3, "torch", range(STEPS, STEPS + MORE), load)
                for recipe, load in torch_states.items()})
    out.update({config: sharded_run(*config, range(STEPS, STEPS + MORE)) for config in BYTE_RUNS})
    out["refusals"] = refusals()
    return out


# ----------------------------------------------------------------------------------------------------------
# The runs: one call of the group per world size
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The sharded checkpoints' folders."""
    return str(tmp_path_factory.mktemp("matrix checkpoints"))


@pytest.fixture(scope="module")
def three_started(local_group, root):
    """3 processes from scratch, started: calling it waits for the results (once)."""
    results = functools.cache(local_group(3).submit(train_configs, CONFIGS, root, timeout_s=240))
    yield results
    results()  # if no test of the module did, so that the group takes calls again


@pytest.fixture(scope="module")
def references(three_started):
    """Here, while the 3 processes train: each recipe on one process; with AdamW's step skipped once; and torch's
    Adafactor on the same gradient summed in the micro-batches' and ranks' order (test_adafactor_is_torchs_own)."""
    out = {recipe: reference(recipe) for recipe in RECIPES}
    out["skip"] = reference("muon", skip=0)
    for world_size in (2, 3):
        out["adafactor summed", world_size] = reference("adafactor", summed_over=world_size)
    return out


@pytest.fixture(scope="module")
def runs(local_group, three_started, references, root):
    """{world size: every rank's runs}: 3 processes from scratch, then 2 resumed from 3's state at the next stage,
    and from torch's own."""
    three = three_started()
    torch_states = {recipe: {"weights": references[recipe]["weights at STEPS"], "states": references[recipe]["states"]}
                    for recipe in RECIPES}
    two = local_group(2).run(resume_configs, CONFIGS, three[0], torch_states, root, timeout_s=240)
    return {2: two, 3: three}


def key_of(world_size: int, recipe: str, stage: int, collectives: str) -> tuple:
    """3 processes: the run from scratch (STEPS steps); 2: the run resumed from 3's state at the next stage."""
    return (recipe, stage, collectives) if world_size == 3 else ("resumed", recipe, stage, collectives)


def expected_of(reference: dict, world_size: int) -> tuple[dict, list[dict]]:
    """The reference's weights and state dicts where the runs of ``world_size`` end."""
    return ((reference["weights at STEPS"], reference["states"]) if world_size == 3 else
            (reference["weights"], reference["resumed states"]))


def worst_against(runs: dict, reference: dict, world_size: int, recipe: str) -> tuple[float, float]:
    """The worst weight and state difference over stages x collectives."""
    weights, states = expected_of(reference, world_size)
    worst_weight = worst_state = 0.0
    for stage in STAGES:
        for collectives in COLLECTIVES:
            run = runs[world_size][0][key_of(world_size, recipe, stage, collectives)]
            worst_weight = max(worst_weight, max_difference(run["weights"], weights))
            worst_state = max(worst_state, max(state_difference(ours, theirs)
                                               for ours, theirs in zip(run["states"], states)))
    return worst_weight, worst_state


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_placement_has_its_cases_and_balances_newton_schulz(runs, world_size):
    """Every stage: each Muon matrix owned by one rank, the Newton-Schulz work per rank at most 1/W of all of it
    plus the largest matrix's, a matrix that lies inside one rank's chunk owned by that rank (it never travels); at 3
    processes, stages 1-2, a matrix spans three ranks (stage 3's units, a block each, cut every matrix in at most
    two). Among the matrices: more rows than columns, one stored transposed; and Adafactor factors a 3-D parameter
    and a 0-dim one."""
    for stage in STAGES:
        muon = runs[world_size][0][key_of(world_size, "muon", stage, "torch")]["placement"][0]
        costs = [zero.matrix.newton_schulz_cost(shape) for shape in muon["shapes"].values()]
        assert len(muon["load"]) == world_size and sum(muon["load"]) == sum(costs)
        assert max(muon["load"]) <= sum(costs) / world_size + max(costs), muon["load"]
        assert all(0 <= owner < world_size for owner in muon["owners"].values())
        inside = [name for name, holders in muon["holders"].items() if len(holders) == 1]
        assert inside and all(muon["owners"][name] == muon["holders"][name][0] for name in inside)
        if world_size == 3 and stage < 3:
            assert any(len(holders) == 3 for holders in muon["holders"].values()), (stage, muon["holders"])
        assert any(rows > columns for rows, columns in muon["shapes"].values())
        assert any(strides[0] < strides[1] for strides in muon["strides"].values())
        print(f"\n{world_size} processes, stage {stage}: Muon's holders {muon['holders']}, owners {muon['owners']}, "
              f"Newton-Schulz load {muon['load']} (bound {sum(costs) / world_size + max(costs):.0f})")
        adafactor = runs[world_size][0][key_of(world_size, "adafactor", stage, "torch")]["placement"][0]
        assert {len(shape) for shape in adafactor["shapes"].values()} == {0, 1, 2, 3}


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_and_adamw_are_one_process_torch_optim(runs, references, world_size):
    """Muon on the blocks' matrices and AdamW on the rest, every stage with both collectives: the weights and both
    optimizers' state dicts (torch.optim's own: Muon's momentum_buffer in each matrix's shape) within 1e-12 of one
    process running torch.optim.Muon and torch.optim.AdamW on the global batch. At 2 processes the runs resumed from
    3 processes' state dicts at another stage."""
    worst_weight, worst_state = worst_against(runs, references["muon"], world_size, "muon")
    print(f"\nMuon + AdamW, {world_size} processes, stages 1-3 x torch, ring: weights max |d| = {worst_weight:.1e}, "
          f"states {worst_state:.1e}")
    assert worst_weight < TOL and worst_state < TOL


@pytest.mark.parametrize("world_size", [2, 3])
def test_adafactor_is_torchs_own(runs, references, world_size):
    """Adafactor, every stage with both collectives: weights and state dict (step, row_var / col_var in torch's
    shapes, a vector's variance) against one process's torch.optim.Adafactor, within TOL of it, as torch's own
    Adafactor is of itself on the same gradient summed in the W ranks' micro-batch order (printed beside it).

    Why the tolerance holds. The sharded step sums what torch sums whole in another order: a row's squares piece by
    piece and then over the ranks (torch squares the row's norm), the weights' and the update's norms likewise: a
    few units of 2^-53 relative. Adafactor's update g / sqrt(row_var col_var / mean) and its step size
    RMS(P) rho_t are scale-free in those sums, so the relative error stays ~1e-16 and the weights (order 1) move by
    ~1e-16 a step: 1e-12 keeps four orders. Where it would not hold: a parameter whose true gradient is 0, whose
    computed gradient is rounding noise. A vector's update is g / sqrt(variance) = sign(g) on the first step
    (variance = g^2), so such noise becomes a full step of either sign, lr ~ 1e-2 apart between two orders of the
    same sum, torch against itself as much as sharded against torch. This model has no such parameter: torch's own
    spread, measured here, is ~1e-16 too. A real error (a rank's rows not summed, a statistic lerped twice, a norm
    of a piece instead of the parameter) moves a weight by ~lr * RMS(P) ~ 1e-3."""
    worst_weight, worst_state = worst_against(runs, references["adafactor"], world_size, "adafactor")
    own_spread = max_difference(expected_of(references["adafactor summed", world_size], world_size)[0],
                                expected_of(references["adafactor"], world_size)[0])
    print(f"\nAdafactor, {world_size} processes, stages 1-3 x torch, ring: weights max |d| = {worst_weight:.1e}, "
          f"states {worst_state:.1e}; torch's own on the gradient summed in another order: {own_spread:.1e}")
    assert own_spread < TOL
    assert worst_weight < TOL and worst_state < TOL


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_sharded_state_loads_into_plain_torch_optimizers(runs, references, recipe):
    """The state dicts saved on 3 processes at every stage, loaded by torch.optim's own optimizers over an ordinary
    model (with the saved weights), MORE steps on one process: where the reference's STEPS + MORE end."""
    x, y = BATCHES.tensors()
    worst = 0.0
    for stage in STAGES:
        for collectives in COLLECTIVES:
            saved = runs[3][0][recipe, stage, collectives]
            worst = max(worst, resumed_by_torch(saved, recipe, references[recipe]["weights"], x, y))
    print(f"\n{recipe}: saved sharded, resumed by torch.optim on one process: weights max |d| = {worst:.1e}")
    assert worst < TOL


def resumed_by_torch(saved: dict, recipe: str, expected: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    """MORE steps of torch.optim's optimizers loaded from ``saved``, on one process: how far from ``expected``."""
    model = make_model()
    model.load_state_dict(saved["weights"])
    optimizers = build_optimizers(lambda cls, groups, **s: cls(groups, **s), recipe, model)
    for optimizer, state in zip(optimizers, saved["states"]):
        optimizer.load_state_dict(cloned(state))
    for step in range(STEPS, STEPS + MORE):
        F.cross_entropy(model(x[step]), y[step]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return max_difference(model.state_dict(), expected)


@pytest.mark.parametrize("recipe", RECIPES)
def test_torchs_own_state_loads_into_the_sharded_optimizers(runs, references, recipe):
    """The other way: torch.optim's state dicts of one process, loaded on 2 processes at stage 3."""
    run = runs[2][0]["from torch", recipe]
    worst = max_difference(run["weights"], references[recipe]["weights"])
    print(f"\n{recipe}: saved by torch.optim, resumed on 2 processes at stage 3: weights max |d| = {worst:.1e}")
    assert worst < TOL
    assert max(state_difference(ours, theirs)
               for ours, theirs in zip(run["states"], references[recipe]["resumed states"])) < TOL


@pytest.mark.parametrize("world_size", [2, 3])
def test_only_the_groups_rank_0_gets_the_state(runs, world_size):
    for rank_runs in runs[world_size][1:]:
        assert rank_runs and all(run["empty elsewhere"] for key, run in rank_runs.items() if key != "refusals")


@pytest.mark.parametrize("world_size", [2, 3])
def test_muons_bytes_are_adamws_and_its_two_all_to_alls(runs, world_size):
    """Bytes each rank sent per step with Muon + AdamW, every stage, both collectives: exactly AdamW's alone over the
    same model (each bucket reduced and gathered once although two optimizers step it: [Note: several
    optimizers]) plus the two all-to-alls of the pieces their owners lack, in bf16 (``exchange_bytes``); at most
    (1 + 1/W) x AdamW's."""
    steps = STEPS if world_size == 3 else MORE
    for stage in STAGES:
        ratios = []
        for collectives in COLLECTIVES:
            for rank in range(world_size):
                adamw = runs[world_size][rank]["adamw", stage, "torch"]["sent"]
                muon = runs[world_size][rank][key_of(world_size, "muon", stage, collectives)]
                assert muon["sent"] == adamw + steps * muon["exchange"], (stage, collectives, rank)
                ratios.append(muon["sent"] / adamw)
        print(f"\n{world_size} processes, stage {stage}: Muon + AdamW / AdamW bytes per step, worst rank "
              f"{max(ratios):.3f} (goal <= {1 + 1 / world_size:.3f})")
        assert max(ratios) <= 1 + 1 / world_size


def test_a_skipped_step_is_finished_before_the_next_forward(runs, references):
    """AdamW's step skipped once (as a gradient scaler skips an optimizer whose gradients overflowed) while Muon
    steps: the buckets both share wait for AdamW, and are gathered before the next forward (stages 1-2) or
    gathered from up-to-date shards (stage 3): stages 1 and 3 end where one process skipping the same step does."""
    reference = references["skip"]
    worst = 0.0
    for config in SKIP_RUNS:
        run = runs[3][0][("skip",) + config]
        worst = max(worst, max_difference(run["weights"], reference["weights at STEPS"]))
    assert max_difference(reference["weights at STEPS"], references["muon"]["weights at STEPS"]) > 1e-4
    print(f"\nAdamW's step skipped once, 3 processes, stages 1 and 3: weights max |d| = {worst:.1e}")
    assert worst < TOL


def refusals():
    """One line each, the same on every rank, before any collective: Muon over a vector (torch's own check, run over
    the whole parameters), LBFGS."""
    out = {}
    model = make_model()
    sharded = zero.shard(model, 2, bucket_mb=BUCKET_MB)
    out["muon vector"] = attempt(lambda: sharded.optimizer(torch.optim.Muon, [model.head.bias], lr=0.1))
    out["lbfgs"] = attempt(lambda: sharded.optimizer(torch.optim.LBFGS, model.parameters()))
    sharded.close()
    return out


def test_what_torch_refuses_is_refused_as_torch_does(runs):
    for rank_refusals in (rank_runs["refusals"] for rank_runs in runs[2]):
        kind, message = rank_refusals["muon vector"]
        assert kind == "ValueError" and "Muon only supports 2D parameters" in message and "\n" not in message
        kind, message = rank_refusals["lbfgs"]
        assert kind == "ValueError" and "torch.optim.LBFGS" in message and "\n" not in message


def test_a_sharded_checkpoint_is_the_state_dicts_by_name(runs, root):
    """The ring's runs at stage 1 on 3 processes (a matrix across three ranks), saved by zero.checkpoint and made
    one file by torch.distributed.checkpoint's dcp_to_torch_save: exactly the model's and the optimizers' state
    dicts (rank 0's, gathered), under the parameters' names and merged as get_state_dict merges several
    optimizers: Muon's momentum_buffer in each matrix's shape (the transposed one too), Adafactor's row_var and
    col_var whole in torch's shapes (the 3-D parameter's per matrix), a 0-dim parameter's variance 0-dim. (Loading
    them at stage 3 on 2 processes is what the ring's resumed runs at stage 3 do.)"""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    for recipe in RECIPES:
        model = make_model()
        names = {id(p): name for name, p in model.named_parameters()}
        optimizers = build_optimizers(lambda cls, groups, **s: cls(groups, **s), recipe, model)
        numbered = [[names[id(p)] for group in o.param_groups for p in group["params"]] for o in optimizers]
        run = runs[3][0][recipe, SAVED_STAGE, "ring"]
        folder = folder_of(root, recipe)
        dcp_to_torch_save(folder, folder + ".pt")
        whole = torch.load(folder + ".pt", weights_only=True)
        merged = {"state": {}, "param_groups": []}
        for state, order in zip(run["states"], numbered):
            merged["state"].update({order[int(i)]: entry for i, entry in state["state"].items()})
            merged["param_groups"] += [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]
        assert identical(whole["model"], run["weights"]), recipe
        assert identical(whole["optimizer"], merged), recipe
        assert any(len(holders) == 3 for holders in run["placement"][0]["holders"].values())
        if recipe == "adafactor":
            assert whole["optimizer"]["state"]["blocks.0.mix"]["row_var"].shape == (2, 8, 1)
            assert whole["optimizer"]["state"]["temperature"]["variance"].shape == ()


def cuda_configs(rank, world_size):
    """Both recipes at stages 1-3 with both collectives on the GPU (every rank on cuda:0, over gloo)."""
    return {config: sharded_run(*config, range(STEPS), device="cuda") for config in CONFIGS}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_muon_and_adafactor_match_one_process(local_group):
    """The same table on CUDA tensors, 2 ranks sharing one GPU over gloo (NCCL refuses two ranks on one GPU):
    torch's Newton-Schulz in bf16 on cuBLAS, the all-to-alls through gloo (the ring's through pinned host
    buffers), Adafactor's sums by index_add_ (atomic on CUDA: another order again). Against one process on the same
    GPU, within TOL."""
    ranks = local_group(2).run(cuda_configs, timeout_s=300)
    references = {recipe: cloned_to_cpu(reference(recipe, device="cuda")) for recipe in RECIPES}
    for recipe in RECIPES:
        worst_weight = worst_state = 0.0
        for stage in STAGES:
            for collectives in COLLECTIVES:
                run = ranks[0][recipe, stage, collectives]
                worst_weight = max(worst_weight, max_difference(run["weights"],
                                                                references[recipe]["weights at STEPS"]))
                worst_state = max(worst_state, *(state_difference(ours, theirs) for ours, theirs
                                                 in zip(run["states"], references[recipe]["states"])))
        print(f"\nCUDA, {recipe}, 2 ranks over gloo, stages 1-3 x torch, ring: weights max |d| = {worst_weight:.1e}, "
              f"states {worst_state:.1e}")
        assert worst_weight < TOL and worst_state < TOL


def cloned_to_cpu(tree):
    if torch.is_tensor(tree):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: cloned_to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(cloned_to_cpu(v) for v in tree)
    return tree
