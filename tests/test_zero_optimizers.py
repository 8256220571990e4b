"""zero.shard's optimizer state over the whole torch.optim family: every element-wise optimizer, at stages 1-3,
with both collectives, at 2 and 3 processes (3: uneven shards), in the session's reusable gloo workers.

A user's model (two parameter groups: decay on matrices, none and another learning rate on vectors and on a 0-dim
parameter; buckets and stage-3 units small enough that the groups' runs are cut across ranks), trained with
gradient accumulation and clipping on a global batch that 2 and 3 processes split alike. For each optimizer and
configuration:
- ``optimizer.state_dict()`` before any step and after steps equals the unsharded optimizer's (one process, the
  global batch): the same parameter indices, keys, dtypes and groups, and values within 1e-12 (3 processes: after
  STEPS from scratch; 2: after MORE steps from 3's state, against one process that saved and loaded its own);
- that state, saved on 3 processes at one stage, is loaded on 2 at another stage, and MORE steps end within
  1e-10 of one process's STEPS + MORE steps.
And the optimizers that neither runs nor pieces can carry (LBFGS, SparseAdam; Muon and Adafactor are
test_zero_matrix's), or that zero cannot know to be element-wise, are refused in one line at ``sharded.optimizer``; a state dict that lacks what the optimizer
keeps, or whose parameters stepped together disagree, is refused in one line on load.

Why the tolerances hold: float64 throughout; the shards sum the same terms as one process in another order
(micro-batches, ranks, the ring), a few units of 2^-53 per gradient; a handful of steps of these optimizers
amplify that to 1e-14 or so on states and weights of order 1 (Rprop and Adam divide by state of order |g|, so
relative errors stay relative). One thing is torch's own: its load_state_dict casts NAdam's float32 mu_product
to the parameters' float64, so NAdam resumed differs from its uninterrupted run by about 5e-12, sharded or not
(checked on one process). A lost state is first order: SGD's momentum missing after STEPS steps moves the
next step by lr * momentum * |buffer| ~ 1e-3, and a state loaded into the wrong elements or group by its size.
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero
from zero_testing import (OPTIMIZERS, GlobalBatches, attempt, cloned, max_difference, seeded_model,
                          state_difference)

FEATURES, HIDDEN, CLASSES = 6, 10, 5
GLOBAL_BATCH, K = 12, 2       # samples per optimizer step over all ranks (2 and 3 divide it); micro-batches per step
STEPS, MORE = 3, 2            # steps before the state dict is taken; steps after it is loaded elsewhere
MAX_NORM, SEED = 0.5, 7
BUCKET_MB = 400 / 2**20       # 50 float64 elements: several buckets, runs cut at the group boundaries
STATE_TOL, WEIGHT_TOL = 1e-12, 1e-10
BATCHES = GlobalBatches(steps=STEPS + MORE, size=GLOBAL_BATCH, features=FEATURES, classes=CLASSES, micro_batches=K,
                        seed=SEED)

STAGES, COLLECTIVES = (1, 2, 3), ("torch", "ring")
CONFIGS = [(name, stage, collectives) for name in OPTIMIZERS for stage in STAGES for collectives in COLLECTIVES]


class Net(nn.Module):
    """A user's small classifier: a 0-dim learnable temperature among ordinary layers."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.LayerNorm(HIDDEN), nn.GELU(),
                                  nn.Linear(HIDDEN, CLASSES))
        self.temperature = nn.Parameter(torch.tensor(0.8))

    def forward(self, x):
        return self.body(x) / self.temperature


def make_model() -> Net:
    return seeded_model(Net, SEED)


def parameter_groups(model: nn.Module) -> list[dict]:
    """As nanoGPT's configure_optimizers and torchvision's recipes: decay on matrices; vectors and scalars apart,
    here with their own learning-rate factor too (each group's hyperparameters must reach its elements)."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr_factor": 0.5}]


def build_optimizer(factory, name: str, model: nn.Module) -> torch.optim.Optimizer:
    cls, settings = OPTIMIZERS[name]
    groups = parameter_groups(model)
    groups[1]["lr"] = settings["lr"] * groups[1]["lr_factor"]
    return factory(cls, groups, **settings)


def reference(name: str) -> dict:
    """One process, the global batch, the unsharded optimizer: its state dicts and weights, uninterrupted; and the
    state after MORE steps of an optimizer that loaded the STEPS-step state, as a resume does (torch.optim's own
    load casts some scalars, NAdam's mu_product, to the parameters' dtype: the sharded resume must equal that)."""
    unsharded = lambda cls, groups, **s: cls(groups, **s)  # noqa: E731
    model = make_model()
    optimizer = build_optimizer(unsharded, name, model)
    x, y = BATCHES.tensors()
    out = {"state at 0": cloned(optimizer.state_dict())}
    for step in range(STEPS + MORE):
        F.cross_entropy(model(x[step]), y[step]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        if step == STEPS - 1:
            out["state"] = cloned(optimizer.state_dict())
            resumed_model = make_model()  # a fresh process's model, loaded from the checkpoint's weights
            resumed_model.load_state_dict(model.state_dict())
    out["weights"] = cloned(model.state_dict())
    resumed = build_optimizer(unsharded, name, resumed_model)
    resumed.load_state_dict(cloned(out["state"]))  # torch keeps the step tensors it is given, and adds to them
    for step in range(STEPS, STEPS + MORE):
        F.cross_entropy(resumed_model(x[step]), y[step]).backward()
        torch.nn.utils.clip_grad_norm_(resumed_model.parameters(), MAX_NORM)
        resumed.step()
        resumed.zero_grad()
    out["resumed state"] = cloned(resumed.state_dict())
    return out


# ----------------------------------------------------------------------------------------------------------
# In the workers
# ----------------------------------------------------------------------------------------------------------
def sharded_run(name: str, stage: int, collectives: str, steps: range, load: dict | None = None) -> dict:
    """A fresh model, shard and optimizer (loaded from ``load`` if given), ``steps`` steps; rank 0 gets the full
    state dicts, every rank checks it got {} elsewhere."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    units = [model.body[0], model.body[3]] if stage == 3 else None
    kwargs = {"bucket_mb": BUCKET_MB} if stage < 3 else {"units": units}
    sharded = zero.shard(model, stage, collectives=collectives, **kwargs)
    optimizer = build_optimizer(sharded.optimizer, name, model)
    out = {"state at 0": optimizer.state_dict()}
    if load is not None:
        sharded.load_model_state_dict(load["weights"])
        optimizer.load_state_dict(load["state"])
    for step in steps:
        for k in range(K):
            sharded.set_requires_gradient_sync(k == K - 1)
            x, y = BATCHES.micro_batch(step, rank, world_size, k)
            (F.cross_entropy(model(x), y, reduction="sum") / (GLOBAL_BATCH / world_size)).backward()
        sharded.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    out["state"] = optimizer.state_dict()
    out["weights"] = sharded.model_state_dict()
    sharded.close()
    if rank != 0:
        return {"empty elsewhere": out["state"] == {} and out["state at 0"] == {}}
    return cloned(out)


def train_configs(rank, world_size, configs):
    """Every config from scratch for STEPS steps."""
    return {config: sharded_run(*config, range(STEPS)) for config in configs}


def resume_configs(rank, world_size, configs, saved):
    """Each config loaded from the state ``saved`` at the NEXT stage (3 -> 1), then MORE steps."""
    return {("resumed", name, stage, collectives):
            sharded_run(name, stage, collectives, range(STEPS, STEPS + MORE), saved[name, stage % 3 + 1, collectives])
            for name, stage, collectives in configs}


class NotDeclared(torch.optim.SGD):
    """A user's own optimizer that zero cannot know to be element-wise."""


class Declared(torch.optim.SGD):
    """The same, declared element-wise by its user."""


def refusals(rank, world_size):
    """Each case raises the same way on every rank, before any collective."""
    out = {}
    for cls in zero.WHOLE_PARAMETER:
        for stage in STAGES:
            model = make_model()
            sharded = zero.shard(model, stage)
            out[cls.__name__, stage] = attempt(lambda: sharded.optimizer(cls, [model.body[0].weight], lr=0.1))
            sharded.close()
    model = make_model()
    sharded = zero.shard(model, 1)
    out["not declared"] = attempt(lambda: sharded.optimizer(NotDeclared, model.parameters(), lr=0.1))
    zero.ELEMENTWISE.add(Declared)
    try:
        out["declared"] = attempt(lambda: sharded.optimizer(Declared, model.parameters(), lr=0.1))
    finally:
        zero.ELEMENTWISE.discard(Declared)
    sharded.close()

    # Loads that cannot be honoured: one parameter's momentum missing (the others have it), an AdamW entry
    # without its second moment, two parameters stepped together with different step counts, and a momentum
    # buffer of another shape than its parameter
    x, y = BATCHES.micro_batch(0, rank, world_size, 0)
    for case, (cls, settings) in {"momentum": OPTIMIZERS["SGD momentum"], "moment": OPTIMIZERS["AdamW"],
                                  "steps": OPTIMIZERS["AdamW"], "shape": OPTIMIZERS["SGD momentum"]}.items():
        model = make_model()
        sharded = zero.shard(model, 2, bucket_mb=BUCKET_MB)
        optimizer = sharded.optimizer(cls, model.parameters(), **settings)
        sharded.set_requires_gradient_sync(True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        full = [optimizer.state_dict()]
        dist.broadcast_object_list(full, group_src=0)
        state = full[0]
        if case == "momentum":
            del state["state"][2]
        elif case == "moment":
            del state["state"][4]["exp_avg_sq"]
        elif case == "shape":
            state["state"][1]["momentum_buffer"] = state["state"][1]["momentum_buffer"][:1]
        else:
            state["state"][1]["step"] = state["state"][1]["step"] + 1
        out[f"load without {case}"] = attempt(lambda: optimizer.load_state_dict(state))
        sharded.close()
    dist.barrier()
    return out


# ----------------------------------------------------------------------------------------------------------
# The runs: three calls of the groups in all
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def three_started(local_group):
    """3 processes from scratch (uneven shards), started: calling it waits for the results (once)."""
    results = functools.cache(local_group(3).submit(train_configs, CONFIGS, timeout_s=280))
    yield results
    results()  # if no test of the module did, so that the group takes calls again


@pytest.fixture(scope="module")
def references(three_started):
    return {name: reference(name) for name in OPTIMIZERS}  # here, while the 3 processes train


@pytest.fixture(scope="module")
def runs(local_group, three_started, references):
    """{world size: every rank's runs}: 3 processes from scratch (uneven shards), then 2 resumed from 3's state at
    the next stage (their state dicts, before the load and after MORE steps, are the 2-process column)."""
    three = three_started()
    two = local_group(2).run(resume_configs, CONFIGS, three[0], timeout_s=280)
    return {2: two, 3: three}


@pytest.fixture(scope="module")
def refused(local_group):
    return local_group(2).run(refusals, timeout_s=120)


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------
def test_the_family_is_every_element_wise_optimizer_of_torch_optim():
    """Every optimizer class torch.optim exports is tested here as element-wise, stepped on pieces of whole
    matrices (test_zero_matrix), or refused: a new one in a later torch fails this until it is placed."""
    family = {getattr(torch.optim, name) for name in torch.optim.__all__
              if isinstance(getattr(torch.optim, name), type) and issubclass(getattr(torch.optim, name),
                                                                           torch.optim.Optimizer)}
    family.discard(torch.optim.Optimizer)
    tested = {cls for cls, _ in OPTIMIZERS.values()}
    assert tested == zero.ELEMENTWISE
    placed = tested | set(zero.WHOLE_PARAMETER) | set(zero.matrix.WHOLE_MATRIX)
    assert family == placed, family ^ placed
    assert set(zero.matrix.WHOLE_MATRIX) == {torch.optim.Muon, torch.optim.Adafactor}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_reference_has_the_state_under_test(references, name):
    """The harness: after STEPS steps the unsharded optimizer holds state for every parameter (none for plain
    SGD), and the weights moved."""
    state = references[name]["state"]["state"]
    assert sorted(state) == ([] if name == "SGD" else list(range(7)))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dict_is_the_unsharded_optimizers(runs, references, world_size, name):
    """Before any step, and after steps (3 processes: STEPS from scratch; 2: MORE after loading 3's state, against
    one process that loaded its own): torch.optim's own state_dict, at every stage with both collectives."""
    ref = references[name]
    worst = 0.0
    for stage in STAGES:
        for collectives in COLLECTIVES:
            key, expected = (((name, stage, collectives), ref["state"]) if world_size == 3 else
                             (("resumed", name, stage, collectives), ref["resumed state"]))
            ours = runs[world_size][0][key]
            assert state_difference(ours["state at 0"], ref["state at 0"]) == 0.0, (stage, collectives)
            worst = max(worst, state_difference(ours["state"], expected))
            assert worst < STATE_TOL, (stage, collectives, worst)
    print(f"\n{name}, {world_size} processes, stages 1-3 x torch, ring: state max |d| = {worst:.1e}")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_state_saved_elsewhere_resumes_as_one_process(runs, references, name):
    """Saved on 3 processes (uneven shards) at the next stage, loaded on 2: MORE steps end where one process's
    STEPS + MORE do."""
    world_size = 2
    ref = references[name]
    worst = 0.0
    for stage in STAGES:
        for collectives in COLLECTIVES:
            ours = runs[world_size][0]["resumed", name, stage, collectives]
            worst = max(worst, max_difference(ours["weights"], ref["weights"]))
            assert worst < WEIGHT_TOL, (stage, collectives, worst)
    print(f"\n{name}, saved on 3 processes, resumed on 2 at another stage: weights max |d| = {worst:.1e}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_only_the_groups_rank_0_gets_the_state(runs, world_size):
    for rank_runs in runs[world_size][1:]:
        assert rank_runs and all(run["empty elsewhere"] for run in rank_runs.values())


@pytest.mark.parametrize("name", ["LBFGS", "SparseAdam"])
def test_an_optimizer_that_needs_whole_parameters_is_refused_in_one_line(refused, name):
    for stage in STAGES:
        kind, message = refused[0][name, stage]
        assert kind == "ValueError" and "\n" not in message
        assert f"stage {stage} cuts every parameter into flat runs" in message and f"torch.optim.{name}" in message
        assert "ZeroRedundancyOptimizer" in message and "stage 0" in message
        assert refused[1][name, stage] == (kind, message)


def test_an_optimizer_zero_cannot_know_is_refused_until_declared(refused):
    kind, message = refused[0]["not declared"]
    assert kind == "ValueError" and "\n" not in message
    assert "zero.ELEMENTWISE.add(NotDeclared)" in message
    assert refused[0]["declared"] == (None, None)


@pytest.mark.parametrize("case, phrase", [("momentum", "parameter 2 has no state, unlike parameter 0"),
                                          ("moment", "parameter 4 has no 'exp_avg_sq'"),
                                          ("steps", "parameter 1 has other scalars (step counts), unlike parameter 0"),
                                          ("shape", "'momentum_buffer' of parameter 1 is (1, 6), the parameter (10, 6)")])
def test_a_state_that_cannot_be_loaded_is_refused_in_one_line(refused, case, phrase):
    for rank in (0, 1):
        kind, message = refused[rank][f"load without {case}"]
        assert kind == "ValueError" and "\n" not in message and phrase in message, message
