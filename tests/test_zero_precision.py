"""zero.shard's mixed precision (param_dtype, reduce_dtype) against FSDP2's MixedPrecisionPolicy on the same units
(the GPT's blocks and the root) and data: test_zero_contract's GPT, data and nanoGPT optimizer set-up, in the
session's gloo workers, one call per world size.

- float64 masters, float32 parameters, float64 reduction, stages 2 and 3, 2 and 3 processes, decay groups and a
  clip that bites: within 1e-9 of FSDP2 after STEPS steps. One micro-batch per step: FSDP2 (torch 2.15) leaves a
  window's micro-batches to autograd, summed in param_dtype on the unsharded parameter, where stages 2-3 sum the
  reduced shards in the master dtype (float64 here), a float32 rounding apart (accumulation is checked against
  one float64 process in test_zero_hybrid.py). Why 1e-9 holds: both cast the same float64 masters to the same
  float32 weights (round to nearest), so each rank's forward and backward are the same float32 kernels on the
  same operands; everything after is float64 (the reduction, the clip, AdamW), where the two differ only in
  summation order, ~1e-16 relative. A master difference that small changes a float32 cast with a chance of
  about 1e-16 / 6e-8 per element and step, and then moves one weight by one float32 unit (6e-8 relative): the
  gradients move by as little, the AdamW update by at most lr x 6e-8 = 6e-10. A real error is first-order:
  a float32 reduction moves the gradients by 6e-8 relative and AdamW's later updates by ~lr x 6e-8 and more
  (1e-9 and up); masters kept in float32 round every weight by up to 6e-8 |w| per step; a wrong decay or clip
  moves weights by ~1e-3.
- bf16 parameters over float32 masters and float32 reduction, stages 2 and 3, 2 processes, one micro-batch and a
  clip that never bites: within BF16_TOL of FSDP2 (argued at BF16_TOL). Inside forward the weights are bf16; the
  optimizer state, the state dicts and the model handed back by close() are float32; a gather moves exactly
  half the bytes of the same gather in float32.
- a run saved after STEPS steps and loaded into a fresh shard (other initial weights) takes its next step bit
  for bit as the run that went on (stages 1 and 3, float32 over float64): the masters are what is saved and loaded.
- one-line refusals: float16, param_dtype at stage 0.
"""
import math

import pytest
import torch
import torch.distributed as dist

import zero
from test_zero_contract import (B, CONTEXT, K, MAX_NORM, SEED, configure_optimizers, loss_sum, make_data, make_model,
                                micro_batch, plain_optimizer, warmup)
from zero_testing import attempt, cloned

STEPS = 2
FP64_TOL = 1e-9
# bf16 against FSDP2 with the same policy: both round the same float32 masters to the same bf16 weights, so
# forward and backward are the same kernels on the same operands on each rank, bit for bit. The reduction of two
# ranks is one float32 addition (commutative) and a halving (exact), the same in both. What may differ is AdamW's
# element-wise float32 arithmetic: our runs and FSDP2's per-parameter shards cut the flat elements at other
# places, so an element may go through a vectorized loop (with fused multiply-adds) in one and a scalar loop in
# the other, one float32 rounding (2^-24 relative) apart in a moment, so the update lr * m / sqrt(v) moves by at
# most ~2 lr 2^-24 per step: over STEPS = 2 steps, 2 lr 2^-23 ~ 2.4e-9. Such a difference changes a bf16 rounding of a
# weight only if it lands within 4e-9 of a rounding boundary (bf16's unit at |w| ~ 0.02 is 1.2e-4: a chance of
# ~3e-5 per element and step, never seen in these runs). BF16_TOL = 1e-8 keeps a factor of ~4 over the bound; a
# real error is orders above it: reducing in bf16 (2^-9 relative in every gradient) moves the second step's
# update by ~lr 2^-9 = 2e-5, masters kept in bf16 round every weight to 2^-9 of itself (~4e-5 at |w| 0.02).
BF16_TOL = 1e-8
NEVER_CLIPS = 1e9


def train(model, sharded, optimizer, scheduler, data, steps, rank, micro_batches, max_norm):
    """The contract's loop with ``micro_batches`` per step; ``sharded`` None: FSDP2's model (its own sync switch
    and torch's clipping). Returns the norms."""
    norms = []
    for step in steps:
        for k in range(micro_batches):
            last = k == micro_batches - 1
            (model if sharded is None else sharded).set_requires_gradient_sync(last)
            (loss_sum(model, micro_batch(data, step, rank, k)) / (B * micro_batches * CONTEXT)).backward()
        if sharded is None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
        else:
            norms.append(sharded.clip_grad_norm_(max_norm).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return norms


def fsdp2(stage, dtype, param_dtype, reduce_dtype, micro_batches, max_norm, mesh=None):
    """FSDP2's fully_shard with MixedPrecisionPolicy on the blocks and the root (stage 2: kept gathered from
    forward to backward; ``mesh``: a 2-D (replicate, shard) one for HSDP); the whole float weights (each
    parameter's full_tensor, in its master dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    rank, size = dist.get_rank(), dist.get_world_size()
    model = make_model(SEED).to(dtype)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=stage == 3)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=stage == 3)
    optimizer = configure_optimizers(model, plain_optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    norms = train(model, None, optimizer, scheduler, make_data(SEED, size), range(STEPS), rank, micro_batches,
                  max_norm)
    weights = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    return {"norms": norms, "weights": weights}


def ours(stage, dtype, param_dtype, reduce_dtype, micro_batches, max_norm, collectives="torch", **groups):
    """zero.shard with the same policy; the whole weights (model_state_dict, broadcast from rank 0), the dtypes
    seen inside forward, of the optimizer state, of the state dicts and of the model after close(), and the
    bytes of one gather of the whole model (stage 2: the step's all-gather; stage 3: an evaluation forward).
    ``groups``: zero.shard's group and replicate_group."""
    rank, size = dist.get_rank(), dist.get_world_size()
    data = make_data(SEED, size)
    model = make_model(SEED).to(dtype)
    sharded = zero.shard(model, stage, collectives=collectives, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                         **groups)
    seen = []
    model.blocks[0].mlp[0].register_forward_hook(lambda module, args, out: seen.append(module.weight.dtype))
    optimizer = configure_optimizers(model, sharded.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    norms = train(model, sharded, optimizer, scheduler, data, range(STEPS - 1), rank, micro_batches, max_norm)
    if stage == 2:  # the last step's all-gather alone
        for k in range(micro_batches):
            sharded.set_requires_gradient_sync(k == micro_batches - 1)
            (loss_sum(model, micro_batch(data, STEPS - 1, rank, k)) / (B * micro_batches * CONTEXT)).backward()
        norms.append(sharded.clip_grad_norm_(max_norm).item())
        before = sharded.sent_bytes()
        optimizer.step()
        gather_bytes = sharded.sent_bytes() - before
        scheduler.step()
        optimizer.zero_grad()
    else:
        norms += train(model, sharded, optimizer, scheduler, data, [STEPS - 1], rank, micro_batches, max_norm)
        before = sharded.sent_bytes()
        with torch.no_grad():  # every unit gathered once, nothing reduced
            model(micro_batch(data, 0, rank, 0)[:, :-1])
        gather_bytes = sharded.sent_bytes() - before
    full = [sharded.model_state_dict()]
    dist.broadcast_object_list(full, group_src=0)
    state = optimizer.state_dict()
    inner_state = {v.dtype for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()}
    sharded.close()
    return {"norms": norms, "weights": cloned(full[0]), "gather bytes": gather_bytes,
            "forward dtypes": set(seen), "state dtypes": inner_state,
            "state dict dtypes": {v.dtype for s in state.get("state", {}).values() for v in s.values()
                                  if torch.is_tensor(v) and v.dim()},
            "model dict dtypes": {v.dtype for v in full[0].values()},
            "closed": {name: (p.dtype, torch.equal(p.detach(), full[0][name])) for name, p in model.named_parameters()}}


def resumes_exactly(stage):
    """STEPS steps at float32 over float64; the state dicts; one more step, against a fresh shard of other
    weights that loads them and takes the same step: bit for bit."""
    rank, size = dist.get_rank(), dist.get_world_size()
    data = make_data(SEED, size)
    results = []
    for seed, load in ((SEED, False), (SEED + 1000, True)):
        model = make_model(seed)
        sharded = zero.shard(model, stage, param_dtype=torch.float32, reduce_dtype=torch.float64)
        optimizer = configure_optimizers(model, sharded.optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
        if not load:
            train(model, sharded, optimizer, scheduler, data, range(STEPS), rank, K, MAX_NORM)
            saved = [cloned(sharded.model_state_dict()), cloned(optimizer.state_dict()), scheduler.state_dict()]
            dist.broadcast_object_list(saved, group_src=0)
        else:
            sharded.load_model_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            scheduler.load_state_dict(saved[2])
        train(model, sharded, optimizer, scheduler, data, [STEPS], rank, K, MAX_NORM)
        results.append(cloned(sharded.model_state_dict()))
        sharded.close()
    return rank != 0 or all(torch.equal(results[0][k], results[1][k]) for k in results[0])


FP64_CASES = [(f"stage {stage}", stage) for stage in (2, 3)]
BF16_CASES = [(f"bf16 stage {stage}", stage) for stage in (2, 3)]


def precision_runs(rank, world_size):
    out = {}
    for name, stage in FP64_CASES:
        out[name] = {"ours": ours(stage, torch.float64, torch.float32, torch.float64, 1, MAX_NORM),
                     "fsdp2": fsdp2(stage, torch.float64, torch.float32, torch.float64, 1, MAX_NORM)}
    if world_size != 2:
        return out
    for name, stage in BF16_CASES:
        out[name] = {"ours": ours(stage, torch.float32, torch.bfloat16, torch.float32, 1, NEVER_CLIPS),
                     "fsdp2": fsdp2(stage, torch.float32, torch.bfloat16, torch.float32, 1, NEVER_CLIPS),
                     "float32": ours(stage, torch.float32, None, None, 1, NEVER_CLIPS)}
    for stage in (1, 3):
        out[f"resume stage {stage}"] = resumes_exactly(stage)
    out["float16"] = attempt(lambda: zero.shard(make_model(SEED), 2, param_dtype=torch.float16))
    out["reduce float16"] = attempt(lambda: zero.shard(make_model(SEED), 3, reduce_dtype=torch.float16))
    out["stage 0"] = attempt(lambda: zero.shard(make_model(SEED), 0, param_dtype=torch.bfloat16))
    return out


@pytest.fixture(scope="module")
def runs(local_group):
    """{world size: every rank's results}: the float64 masters at 2 and 3 processes, the rest at 2."""
    return {world_size: local_group(world_size).run(precision_runs, timeout_s=240) for world_size in (2, 3)}


def worst(ours_weights, theirs_weights):
    return max((ours_weights[name].double() - value.double()).abs().max().item()
               for name, value in theirs_weights.items())


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", [name for name, _ in FP64_CASES])
def test_float32_over_float64_masters_matches_fsdp2_mixed_precision(runs, name, world_size):
    ranks = runs[world_size]
    run = ranks[0][name]
    error = worst(run["ours"]["weights"], run["fsdp2"]["weights"])
    norm_error = max(abs(a - b) / b for a, b in zip(run["ours"]["norms"], run["fsdp2"]["norms"]))
    print(f"\n{world_size} processes, {name}, float32 over float64 masters, float64 reduction: max |dw| against "
          f"FSDP2 {error:.1e}, clip norms {norm_error:.1e}")
    assert all(n > MAX_NORM for n in run["fsdp2"]["norms"])  # the clip bites
    assert run["ours"]["forward dtypes"] == {torch.float32}
    assert run["ours"]["state dtypes"] == run["ours"]["state dict dtypes"] == {torch.float64}
    assert run["ours"]["model dict dtypes"] == {torch.float64}
    assert norm_error < FP64_TOL
    assert error < FP64_TOL


@pytest.mark.parametrize("name", [name for name, _ in BF16_CASES])
def test_bf16_over_float32_masters_matches_fsdp2_mixed_precision(runs, name):
    world_size, ranks = 2, runs[2]  # bf16 (BF16_TOL's argument), the resume and the refusals: at 2 processes
    run = ranks[0][name]
    error = worst(run["ours"]["weights"], run["fsdp2"]["weights"])
    print(f"\n{world_size} processes, {name}, float32 reduction: max |dw| against FSDP2 {error:.1e}")
    assert error < BF16_TOL
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(run["ours"]["norms"], run["fsdp2"]["norms"]))
    # against the same run in float32 (the default): the bf16 run really is another computation
    assert worst(run["ours"]["weights"], run["float32"]["weights"]) > 1e-6


@pytest.mark.parametrize("name", [name for name, _ in BF16_CASES])
def test_bf16_weights_inside_forward_float32_everywhere_else_and_half_the_gather_bytes(runs, name):
    ranks = runs[2]  # bf16 (BF16_TOL's argument), the resume and the refusals: at 2 processes
    for r in ranks:
        run = r[name]["ours"]
        assert run["forward dtypes"] == {torch.bfloat16}
        assert run["state dtypes"] == {torch.float32}
        assert r[name]["float32"]["forward dtypes"] == {torch.float32}
        assert all(dtype == torch.float32 and equal for dtype, equal in run["closed"].values()), run["closed"]
        assert run["gather bytes"] > 0 and 2 * run["gather bytes"] == r[name]["float32"]["gather bytes"], (
            run["gather bytes"], r[name]["float32"]["gather bytes"])
    assert ranks[0][name]["ours"]["state dict dtypes"] == ranks[0][name]["ours"]["model dict dtypes"] == \
        {torch.float32}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_fresh_shard_loaded_from_the_masters_steps_as_the_run_that_went_on(runs, stage):
    ranks = runs[2]  # bf16 (BF16_TOL's argument), the resume and the refusals: at 2 processes
    assert all(r[f"resume stage {stage}"] for r in ranks)


@pytest.mark.parametrize("key", ["float16", "reduce float16", "stage 0"])
def test_refusals_in_one_line(runs, key):
    ranks = runs[2]  # bf16 (BF16_TOL's argument), the resume and the refusals: at 2 processes
    for r in ranks:
        kind, message = r[key]
        print(f"\n{key}: {kind}: {message}")
        assert kind == "ValueError" and "\n" not in message
    assert "loss scaling" in ranks[0]["float16"][1] and "stages 1-3" in ranks[0]["stage 0"][1]
