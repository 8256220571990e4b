"""zero.shard's hybrid sharding (``replicate_group``): a world of 4 as 2 replicas x 2 shards, shard groups {0, 1}
and {2, 3}, replicate groups {0, 2} and {1, 3}, in the session's 4-process gloo group, one call.

- stages 1-3, both collectives, test_zero_contract's LLM recipe (decay groups, a clip that bites, 2 micro-batches
  per step), float64: the weights (on the shard group's rank 0 of each replica), every step's clip norm (the
  whole model's) and the optimizer's full state within test_zero_contract's tolerances (1e-10; 1e-9 relative,
  argued there) of ONE process on the global batch of all 4 ranks. Every rank starts from other weights but rank
  0's: only the broadcast over the shard group AND over the replicas makes the grid start as one model.
- the bytes each rank sends across replicas per optimizer step: one all-reduce of its 1/S shard, 2 (R-1)/R of
  the shard's bytes, measured (the ring's isend payloads; torch's nominal ring figure), exactly.
- stage 3, float32 weights over float64 masters, against FSDP2's HSDP (fully_shard on a 2-D (replicate, shard)
  mesh with the same MixedPrecisionPolicy): within 1e-9, by test_zero_precision's argument.
- groups that do not tile the world as a grid, and replicate_group at stage 0, are refused in one line, the same
  on every rank.
"""
import pytest
import torch
import torch.distributed as dist

import zero
from test_zero_contract import (MAX_NORM, NORM_RTOL, SEED, WEIGHT_TOL, compare_optimizer_states, configure_optimizers,
                                make_data, make_model, reference, train_steps, warmup)
from test_zero_precision import fsdp2, ours
from zero_testing import attempt, cloned, max_difference

REPLICAS, SHARDS = 2, 2
STEPS = 2
CONFIGS = [(f"stage {stage} {collectives}", stage, collectives) for stage in (1, 2, 3) for collectives in
           ("torch", "ring")]


def hybrid(stage, collectives, group, replicate_group):
    rank = dist.get_rank()
    data = make_data(SEED, REPLICAS * SHARDS)
    model = make_model(SEED if rank == 0 else SEED + 100 + rank)  # only the broadcasts make them one model
    sharded = zero.shard(model, stage, group=group, collectives=collectives, replicate_group=replicate_group)
    optimizer = configure_optimizers(model, sharded.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    before = sharded.sent_bytes_by_group()
    norms = train_steps(model, sharded, optimizer, scheduler, data, range(STEPS), rank)
    after = sharded.sent_bytes_by_group()
    out = {"norms": norms, "weights": cloned(sharded.model_state_dict()), "optimizer": cloned(optimizer.state_dict()),
           "replica bytes per step": (after["replicas"] - before["replicas"]) / STEPS,
           "shard bytes": sum(g.numel() * g.element_size() for g in sharded.shards.grads)}
    sharded.close()
    out["closed"] = cloned(model.state_dict())
    return out


def hybrid_runs(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    assert world_size == REPLICAS * SHARDS
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]  # 2 x 2, but shard indices 0 and 1 together
    group, replicate_group = shard_groups[rank // SHARDS], replicate_groups[rank % SHARDS]
    out = {name: hybrid(stage, collectives, group, replicate_group) for name, stage, collectives in CONFIGS}
    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    assert dist.get_process_group_ranks(mesh.get_group("shard")) == dist.get_process_group_ranks(group)
    out["float32 over float64"] = {
        "ours": ours(3, torch.float64, torch.float32, torch.float64, 1, MAX_NORM, "ring", group=group,
                     replicate_group=replicate_group),
        "fsdp2": fsdp2(3, torch.float64, torch.float32, torch.float64, 1, MAX_NORM, mesh=mesh)}
    out["crossed"] = attempt(lambda: zero.shard(make_model(SEED), 2, group=group,
                                                replicate_group=crossed[0 if rank in (0, 3) else 1]))
    out["itself"] = attempt(lambda: zero.shard(make_model(SEED), 1, group=group, replicate_group=group))
    out["stage 0"] = attempt(lambda: zero.shard(make_model(SEED), 0, group=group, replicate_group=replicate_group))
    return out


@pytest.fixture(scope="module")
def runs(local_group):
    return local_group(REPLICAS * SHARDS).run(hybrid_runs, timeout_s=240)


@pytest.fixture(scope="module")
def ref():
    """One process, the global batch of all 4 ranks, STEPS steps."""
    return reference(make_data(SEED, REPLICAS * SHARDS)[:STEPS], SEED, STEPS)


@pytest.mark.parametrize("name", [name for name, _, _ in CONFIGS])
def test_two_replicas_of_two_shards_train_as_one_process_on_the_global_batch(runs, ref, name):
    assert all(n > MAX_NORM for n in ref["norms"])  # the clip bites
    for first in (0, SHARDS):  # the shard group's rank 0 of each replica holds the whole state dicts
        run = runs[first][name]
        error = max_difference(ref["weights"], run["weights"])
        norm_error = max(abs(n - r) / r for n, r in zip(run["norms"], ref["norms"]))
        print(f"\nhybrid {REPLICAS} x {SHARDS}, {name}, replica {first // SHARDS}: max |dw| = {error:.1e}, clip "
              f"norms {norm_error:.1e}")
        assert error < WEIGHT_TOL
        assert norm_error < NORM_RTOL
        compare_optimizer_states(run["optimizer"], ref["optimizer"])
    for rank, r in enumerate(runs):
        if rank % SHARDS:
            assert r[name]["weights"] == {} and r[name]["optimizer"] == {}
        assert max_difference(runs[0][name]["weights"], r[name]["closed"]) == 0  # every rank, the same model


@pytest.mark.parametrize("name", [name for name, _, _ in CONFIGS])
def test_each_rank_sends_one_all_reduce_of_its_shard_across_replicas_per_step(runs, name):
    """2 (R-1)/R of the shard's bytes per rank: exact per rank for torch's (nominal) figure; the ring splits an odd
    shard into unequal pieces, so per replicate group (the pieces add up to R times the figure)."""
    per_rank = [r[name]["replica bytes per step"] for r in runs]
    expected = 2 * (REPLICAS - 1) / REPLICAS * runs[0][name]["shard bytes"]
    print(f"\n{name}: bytes across replicas per step and rank {per_rank}, formula {expected:.0f}")
    assert expected > 0
    for column in range(SHARDS):
        assert sum(per_rank[column::SHARDS]) == REPLICAS * expected
    if name.endswith("torch"):
        assert per_rank == [expected] * len(runs)


def test_hybrid_float32_over_float64_masters_matches_fsdp2_hsdp(runs):
    run = runs[0]["float32 over float64"]
    error = max((run["ours"]["weights"][k].double() - v.double()).abs().max().item()
                for k, v in run["fsdp2"]["weights"].items())
    print(f"\nhybrid {REPLICAS} x {SHARDS}, stage 3 ring, float32 over float64 masters: max |dw| against FSDP2's "
          f"HSDP {error:.1e}")
    assert run["ours"]["model dict dtypes"] == run["ours"]["state dtypes"] == {torch.float64}
    assert error < 1e-9


@pytest.mark.parametrize("key", ["crossed", "itself", "stage 0"])
def test_groups_that_are_not_a_grid_are_refused_in_one_line_on_every_rank(runs, key):
    messages = {r[key] for r in runs}
    print(f"\n{key}: {messages}")
    assert len(messages) == 1
    kind, message = messages.pop()
    assert kind == "ValueError" and "\n" not in message
