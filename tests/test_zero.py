"""zero: ZeRO stages 1 to 3 inside the trainer, against the replicated run (stage 0), DDP, PyTorch's
ZeroRedundancyOptimizer and FSDP2, in the session's reusable gloo workers (``local_group``). The contract in a loop
of a user's own is test_zero_contract.py's.

The exactness claims are carried in float64 (as test_ddp_cifar100.py's): stage 1 computes exactly what stage 0
computes, in the same order (each rank's window of micro-batches summed locally, then averaged over ranks), so
with the same collective the weights are bit-identical (the ring adds three ranks in another order than gloo:
1e-16 apart); so does FSDP2, which accumulates unsharded gradients over the window too. Stages 2 and 3 average
every micro-batch over ranks before adding the micro-batches, so their sums are ordered otherwise; over an epoch
the trajectory amplifies that rounding (AdamW most, since its first steps are close to lr * sign(g), and a
gradient element that cancels to near zero flips with rounding), which leaves up to some thousands of float64
units of 2^-53 (the README gives what was measured, under each ATEN_CPU_CAPABILITY: at most a few 1e-13).
1e-11 keeps a factor 30; a real error (a shard averaged over the wrong ranks, a micro-batch lost or counted
twice, a step on stale weights, a unit gathered from stale shards) moves the weights at first order, by about
the learning rate (1e-2), nine orders above it.
"""
import copy
import math
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ddp_cifar100 as trainer
import zero
from collectives import Collectives
from data import MemoryData
from models import blocks, build_model
from trainer import build as trainer_build
from trainer import checkpoint as trainer_checkpoint
from trainer.build import make_optimizer, make_scaler
from trainer.evaluation import validate
from trainer_testing import (TINY, collect_all, model_and_labelled_set, normalized_batch, train_in_group,
                             try_train_in_group)
from zero.buckets import assign_buckets
from zero_testing import max_difference

# 1 epoch: 64 samples per rank at 2 processes (43 at 3: uneven shards of the data too) in micro-batches of 8,
# grad-accum 3, so the last window is short; buckets of at most 20 kB, so the small ResNet's 83,892 parameters
# fall into 13 buckets in float64 (17 in float32), several of them not divisible by 3.
BASE = TINY + ["--model", "resnet", "--epochs", "1", "--norm", "custom", "--bucket-mb", "0.02", "--seed", "3",
               "--grad-accum", "3", "--dropout", "0"]
# The stage runs and the recipe's (27 runs) on half of TINY's samples: 32 per rank at 2 processes, 4 micro-batches,
# 2 steps of grad-accum 3 (the second a window of 1: short); 22 per rank at 3 processes (uneven shards: the last
# micro-batch 6 samples), 2 steps of grad-accum 2 (the second short). Two steps are what the claims need: the second
# starts from weights the first moved, so a step on stale weights shows; a third added cost, not a case.
HALF = ["--train-size", "64"]
# 3 processes: the ZeRO issue's exactness case (AdamW, grad-accum 2, SyncBatchNorm, uneven shards)
OPTIMIZERS = {2: ["--optimizer", "adamw", "--lr", "0.01"], 3: ["--optimizer", "adamw", "--lr", "0.01", "--grad-accum", "2"]}
ITEM = 8  # bytes per element: the stage runs are made in float64 (AdamW's step counts too)


def bucket_count(dtype: torch.dtype) -> int:
    """The small ResNet's buckets at --bucket-mb 0.02, for parameters of ``dtype``."""
    return len(assign_buckets([p.to(dtype) for p in build_model("resnet", 0.0, "local").parameters()],
                              0.02))


def train_variants(rank, world_size, argv, variants, dtype="float64"):
    """Several trainer runs in one call of the group: {name: {"state", "metrics"}} for each (name, extra flags),
    and under "threads left" the names of the ring's averaging threads still alive after them."""
    runs = {name: train_in_group(rank, world_size, argv + extra, dtype) for name, extra in variants}
    runs["threads left"] = [t.name for t in threading.enumerate() if t.name.startswith("allreduce")]
    return runs


def stage_variants(world_size):
    """Stage 0 and stages 1 and 2 with both collectives; at 2 processes also DDP and ZeroRedundancyOptimizer."""
    variants = [("stage 0", ["--zero", "0"])]
    for allreduce in ("torch", "ring"):
        variants += [(f"stage {stage} {allreduce}", ["--zero", str(stage), "--allreduce", allreduce])
                     for stage in (1, 2, 3)]
    # stage 3 accumulating full gradients over the window: stage 0's sums on each rank (bit-identical at 2
    # processes; at 3 the ranks' sum associates as the collective chunks each unit's flat, not stage 0's buckets)
    variants += [("stage 3 torch unsharded", ["--zero", "3", "--zero3-accumulate", "unsharded"])]
    if world_size == 2:
        variants += [("ddp", ["--grad-sync", "ddp"]), ("zero redundancy", ["--grad-sync", "ddp", "--zero", "1"])]
        variants += [(f"fsdp {stage}", ["--grad-sync", "fsdp", "--zero", str(stage)]) for stage in (2, 3)]
        # channels-last weights: the flat weight and the flat gradient must still match element by element
        variants += [("stage 0 channels-last", ["--zero", "0", "--channels-last"]),
                     ("stage 2 torch channels-last", ["--zero", "2", "--channels-last"])]
    return variants


@pytest.fixture(scope="module")
def all_stage_runs(local_group):
    """{world size: every rank's runs}, the 2- and 3-process groups working at once (5 processes on the cores), with
    240 s of time (at 3 steps a run, LocalGroup's default 120 s ran out while other work shared the cores)."""
    pending = {n: local_group(n).submit(train_variants, BASE + HALF + OPTIMIZERS[n], stage_variants(n),
                                        timeout_s=240) for n in (2, 3)}
    return collect_all(pending)


@pytest.fixture(scope="module", params=[2, 3])
def stage_runs(request, all_stage_runs):
    return request.param, all_stage_runs[request.param]


def test_the_rings_thread_is_closed_when_training_ends(stage_runs):
    world_size, ranks = stage_runs
    assert all(r["threads left"] == [] for r in ranks)


def test_sharded_stages_match_stage_0(stage_runs):
    world_size, ranks = stage_runs
    references = {"": ranks[0]["stage 0"]["state"], " channels-last": ranks[0]["stage 0 channels-last"]["state"]
                  if world_size == 2 else None}
    # 32 samples per rank: 4 micro-batches, 2 steps of grad-accum 3 (the last window short); 22: 3 micro-batches
    # (the last of 6 samples), 2 steps of grad-accum 2
    assert ranks[0]["stage 0"]["metrics"]["optimizer_steps"] == 2
    for name in (name for name in ranks[0] if name != "threads left"):
        # every rank ends with the same weights: the all-gather made the model whole everywhere
        assert all(max_difference(ranks[0][name]["state"], r[name]["state"]) == 0 for r in ranks), name
        reference = references[" channels-last" if name.endswith(" channels-last") else ""]
        if reference is ranks[0][name]["state"]:
            # a reference itself: stage 0, and stage 0 channels-last (whose convolutions sum in another order than
            # stage 0's, 4e-12 apart here: the channels-last runs' own reference)
            continue
        worst = max_difference(reference, ranks[0][name]["state"])
        print(f"\n{world_size} processes, {OPTIMIZERS[world_size][1]}, {name} vs stage 0 (float64): max |dw| = "
              f"{worst:.1e}")
        if name == "stage 1 torch" or (world_size == 2 and (
                name == "stage 3 torch unsharded" or not name.startswith(("stage 2", "stage 3", "fsdp")))):
            # the same sums in the same order as stage 0: gloo's reduce-scatter adds the ranks as its all-reduce
            # does; and a sum of two ranks is the same in any order (the ring's, DDP's)
            assert worst == 0, name
        else:
            assert worst < 1e-11, name


# --clip-grad-norm and --norm-weight-decay (AdamW, no decay on biases and normalization weights) at every
# --grad-sync and --zero: our stages clip by the whole model's norm from their shards, the references by PyTorch's
# own clip_grad_norm_ (FSDP2's over DTensors); every one must take stage 0's steps. A norm taken over one rank's
# shards, or a group's weight decay applied to the other group, moves the weights by about lr * 1e-1 = 1e-3.
RECIPE = BASE + HALF + ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1", "--norm-weight-decay", "0",
                        "--clip-grad-norm", "0.5"]


@pytest.fixture(scope="module")
def recipe_runs(local_group):
    """The recipe on the ResNet (BatchNorm weights in the undecayed group, SyncBatchNorm, grad-accum 3) through
    one sync of each kind: a norm from our shards (stage 3 on the ring), from ZeroRedundancyOptimizer's replicated
    gradients and from FSDP2's DTensors. Every other sync takes the same recipe on the GPT in
    test_language_model.py (stages 1-3 on both collectives, DDP, FSDP2 at stages 2 and 3)."""
    variants = [("stage 0", ["--zero", "0"]), ("stage 3 ring", ["--zero", "3", "--allreduce", "ring"]),
                ("zero redundancy", ["--grad-sync", "ddp", "--zero", "1"]),
                ("fsdp 3", ["--grad-sync", "fsdp", "--zero", "3"])]
    runs = local_group(2).run(train_variants, RECIPE, variants)
    unclipped = local_group(2).run(train_variants, BASE + RECIPE[len(BASE):-2], [("stage 0", ["--zero", "0"])])
    return runs, unclipped[0]["stage 0"]


def test_the_clipping_changes_the_steps(recipe_runs):
    """Without --clip-grad-norm stage 0 ends elsewhere: the flag is applied, not only measured."""
    runs, unclipped = recipe_runs
    assert max_difference(runs[0]["stage 0"]["state"], unclipped["state"]) > 1e-4
    assert unclipped["metrics"]["grad_norms"] == []


def test_clipping_and_decay_groups_take_stage_0s_steps_at_every_sync(recipe_runs):
    recipe_runs, _ = recipe_runs
    reference = recipe_runs[0]["stage 0"]["metrics"]
    norms = reference["grad_norms"]
    assert len(norms) == reference["optimizer_steps"] == 2
    assert min(norms) > 0.5, norms  # the clipping bites on every step
    for name in (name for name in recipe_runs[0] if name != "threads left"):
        run = recipe_runs[0][name]
        assert all(max_difference(run["state"], r[name]["state"]) == 0 for r in recipe_runs), name
        worst = max_difference(recipe_runs[0]["stage 0"]["state"], run["state"])
        norm_error = max(abs(a - b) / b for a, b in zip(run["metrics"]["grad_norms"], norms, strict=True))
        print(f"\n2 processes, AdamW with decay groups, clipped at 0.5: {name} vs stage 0 (float64): max |dw| = "
              f"{worst:.1e}, norms {norm_error:.1e} relative")
        assert worst < 1e-11, name
        assert norm_error < 1e-9, name


def test_norm_weight_decay_puts_biases_and_normalization_weights_in_a_group_of_their_own():
    """The grouping alone (no process group: a sync that builds the optimizer as it is given)."""
    class Plain:
        @staticmethod
        def optimizer(kind, params, **settings):
            return kind(params, **settings)

    model = build_model("resnet", 0.0, "local")
    for flags, decays in (([], [5e-4]), (["--norm-weight-decay", "0"], [5e-4, 0.0])):
        optimizer = make_optimizer(trainer.parse_args(TINY + flags), model, Plain())
        assert [group["weight_decay"] for group in optimizer.param_groups] == decays
    matrices, vectors = ({id(p) for p in group["params"]} for group in optimizer.param_groups)
    norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)
             for p in m.parameters()}
    for name, p in model.named_parameters():
        assert id(p) in (vectors if name.endswith("bias") or id(p) in norms else matrices), name


def units_padded(world_size: int) -> tuple[list[int], int]:
    """The small ResNet's units for stage 3 (the root, then its blocks): each one's padded flat length."""
    model = build_model("resnet", 0.0, "custom")
    sync_units = [model] + blocks(model)
    owned = [sum(p.numel() for p in unit.parameters()) for unit in sync_units]
    owned[0] -= sum(owned[1:])  # the root owns what no block does
    return [-(-n // world_size) * world_size for n in owned], len(sync_units)


def test_state_bytes_follow_the_formula(stage_runs):
    """Between steps: weights Psi, gradients Psi (stage 0, 1) or Psi/W (stage 2), state 2 Psi/W (AdamW) or Psi/W
    (SGD's momentum), each within the padding: less than one element per bucket and rank. Stage 3: 4 Psi/W
    bytes of weights, gradients and each state tensor, exactly the padded units' shards; FSDP2 the same within
    its own padding (each parameter's rows to a multiple of W)."""
    world_size, ranks = stage_runs
    psi = ranks[0]["stage 0"]["metrics"]["trainable_parameters"]
    tensors = len([p for p in build_model("resnet", 0.0, "local").parameters()])
    buckets = bucket_count(torch.float64)
    per_element = 2 if OPTIMIZERS[world_size][1] == "adamw" else 1  # exp_avg and exp_avg_sq, or momentum
    step_counts = tensors if per_element == 2 else 0  # AdamW's step: a scalar per parameter tensor
    stage0 = ranks[0]["stage 0"]["metrics"]["state_bytes"]
    assert stage0 == {"params": ITEM * psi, "grads": ITEM * psi,
                      "optimizer": ITEM * (per_element * psi + step_counts)}
    for allreduce in ("torch", "ring"):
        for stage in (1, 2):
            held = ranks[0][f"stage {stage} {allreduce}"]["metrics"]["state_bytes"]
            grads = psi if stage == 1 else psi / world_size
            assert ITEM * psi <= held["params"] < ITEM * (psi + buckets * world_size)
            assert ITEM * grads <= held["grads"] < ITEM * (grads + buckets * (world_size if stage == 1 else 1))
            # a step count per bucket with AdamW; each bucket's shard rounds up by less than one element
            state = held["optimizer"] / ITEM - (buckets if per_element == 2 else 0)
            assert per_element * psi / world_size <= state < per_element * (psi / world_size + buckets)
            print(f"\n{world_size} processes, stage {stage} {allreduce}: {held} (Psi = {psi})")
        padded, units = units_padded(world_size)
        shard = ITEM * sum(padded) // world_size
        held = ranks[0][f"stage 3 {allreduce}"]["metrics"]["state_bytes"]
        assert held == {"params": shard, "grads": shard,
                        "optimizer": per_element * shard + (ITEM * units if per_element == 2 else 0)}, held
        print(f"\n{world_size} processes, stage 3 {allreduce}: {held} (Psi = {psi})")
    for stage in (2, 3) if world_size == 2 else ():
        held = ranks[0][f"fsdp {stage}"]["metrics"]["state_bytes"]
        print(f"\n{world_size} processes, fsdp {stage}: {held} (Psi = {psi})")
        for key, per_param in (("params", 1), ("grads", 1), ("optimizer", per_element)):
            assert ITEM * per_param * psi / world_size <= held[key] < 1.01 * ITEM * per_param * psi / world_size + \
                ITEM * tensors, key


def test_bytes_sent_per_step(stage_runs):
    """A reduce-scatter and an all-gather send (W-1)/W of the padded buffers each: 2 (W-1)/W Psi elements per
    step, as stage 0's all-reduce; stage 2 reduce-scatters every micro-batch: (K+1)(W-1)/W Psi. The ring's are
    counted at its isend calls, torch's are what a ring would send."""
    world_size, ranks = stage_runs
    psi = ranks[0]["stage 0"]["metrics"]["trainable_parameters"]
    padded = psi + bucket_count(torch.float64) * (world_size - 1)  # at most: every bucket padded
    one_way = (world_size - 1) / world_size * ITEM
    metrics = ranks[0]["stage 0"]["metrics"]
    micro_batches = metrics["micro_batches"] / metrics["optimizer_steps"]  # per step, on average
    for allreduce in ("torch", "ring"):
        for stage, collectives in ((1, 2), (2, micro_batches + 1)):
            sent = ranks[0][f"stage {stage} {allreduce}"]["metrics"]["sent_bytes_per_step"]
            assert collectives * one_way * psi <= sent <= collectives * one_way * padded, (stage, allreduce)
    # stage 0: all_reduce, 2 (W-1)/W per bucket, counted in whole bytes (under a byte per bucket off)
    buckets = bucket_count(torch.float64)
    assert abs(metrics["sent_bytes_per_step"] - 2 * one_way * psi) < buckets
    # stage 3, per micro-batch: every unit all-gathered before its forward, every unit but the root (kept
    # gathered from its forward to its backward's end) again before its backward, every unit reduce-scattered;
    # and the evaluation at the epoch's end gathers every unit once per forward: the busiest rank's shard of the
    # validation set (ceil(val_size / W) samples) in batches of --eval-batch-size, every rank as many forwards
    padded, _ = units_padded(world_size)
    gathers = 2 * sum(padded) - padded[0]
    steps, micro_batches = metrics["optimizer_steps"], metrics["micro_batches"]
    config = metrics["config"]
    forwards = math.ceil(math.ceil(config["val_size"] / world_size) / config["eval_batch_size"])
    for name, scatters in (("stage 3 torch", micro_batches), ("stage 3 ring", micro_batches),
                           ("stage 3 torch unsharded", steps)):  # the last micro-batch of each window only
        sent = ranks[0][name]["metrics"]["sent_bytes_per_step"]
        expected = one_way * (gathers * micro_batches + sum(padded) * (scatters + forwards)) / steps
        assert sent == pytest.approx(expected, rel=1e-12), name


def test_stage_3_gathers_at_most_two_units_besides_the_root(stage_runs):
    """The most full parameter buffers alive at once: the root and two blocks (the one computing and the one
    prefetched), never three of the small ResNet's three blocks; in bytes, at most the root and the two largest."""
    world_size, ranks = stage_runs
    padded, _ = units_padded(world_size)
    for allreduce in ("torch", "ring"):
        peak = ranks[0][f"stage 3 {allreduce}"]["metrics"]["gathered_peak"]
        print(f"\n{world_size} processes, stage 3 {allreduce}: {peak} (units {padded} elements)")
        assert peak["units"] == 2  # 1 would mean no prefetch; 3, no reshard after forward
        assert padded[0] + max(padded[1:]) < peak["bytes"] / ITEM <= padded[0] + sum(sorted(padded[1:])[-2:])


def count_collectives(rank, world_size, argv):
    """train() with the sync's reduce-scatters and all-gathers (Collectives') counted per training micro-batch, and
    stage 2's high-water mark of full gradient buffers."""
    calls = []
    micro_batch = [-1]
    real = {name: getattr(Collectives, name) for name in ("reduce_scatter", "all_gather")}
    real_build_model, real_shard = trainer_build.build_model, zero.shard
    syncs = []

    def counting(name):
        def call(self, *args, **kwargs):
            calls.append((micro_batch[0], name))
            return real[name](self, *args, **kwargs)
        return call

    def instrumented_build_model(*args, **kwargs):
        model = real_build_model(*args, **kwargs)
        model.register_forward_pre_hook(lambda m, _: micro_batch.__setitem__(0, micro_batch[0] + m.training))
        return model

    def kept_shard(*args, **kwargs):
        syncs.append(real_shard(*args, **kwargs))
        return syncs[-1]

    for name in real:
        setattr(Collectives, name, counting(name))
    trainer_build.build_model, zero.shard = instrumented_build_model, kept_shard
    try:
        trained = trainer.train(trainer.parse_args(argv))
    finally:
        for name, fn in real.items():
            setattr(Collectives, name, fn)
        trainer_build.build_model, zero.shard = real_build_model, real_shard
    model = trained.model
    return {"calls": calls, "micro_batches": micro_batch[0] + 1, "steps": trained.metrics["optimizer_steps"],
            "buffers_made": getattr(syncs[0], "buffers_made", None),
            "grads_left": [p.grad is None for p in model.parameters()]}


@pytest.mark.parametrize("stage", [1, 2])
def test_which_micro_batches_communicate(local_group, stage):
    """Stage 1 sends nothing on the K-1 accumulation micro-batches and reduce-scatters every bucket on the
    last; stage 2 reduce-scatters every bucket on every micro-batch; both all-gather every bucket once per step."""
    argv = BASE + ["--optimizer", "sgd", "--zero", str(stage), "--dataset", "synthetic", "--epochs", "2"]
    result = local_group(2).run(count_collectives, argv)[0]
    buckets, per_epoch = bucket_count(torch.float32), 8
    assert result["micro_batches"] == 2 * per_epoch
    last_of_window = {e * per_epoch + j for e in range(2) for j in range(per_epoch) if (j + 1) % 3 == 0 or
                      j == per_epoch - 1}
    scatters = {}
    for micro_batch, name in result["calls"]:
        if name == "reduce_scatter":
            scatters[micro_batch] = scatters.get(micro_batch, 0) + 1
    expected = last_of_window if stage == 1 else set(range(2 * per_epoch))
    assert scatters == {m: buckets for m in expected}
    gathers = [c for c in result["calls"] if c[1] == "all_gather"]
    assert len(gathers) == buckets * result["steps"]
    if stage == 2:
        # full gradients are freed as they are copied out, and the buffers reused: far fewer than the buckets
        assert all(result["grads_left"])
        assert result["buffers_made"] <= 3


def overflow_in_one_shard(rank, world_size, zero_stage):
    """One fp16-scaled step of a ZeRO sync whose gradient overflows in rank 1's shard only, with the trainer's
    scaler: (the scale after the step, whether the weights stayed as they were)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    sharded = zero.shard(model, zero_stage)
    optimizer = sharded.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    scaler = make_scaler(trainer.parse_args(TINY + ["--amp", "fp16", "--zero", str(zero_stage)]),
                                 torch.device("cpu"), init_scale=4.0)
    shards = optimizer.param_groups[0]["params"]  # this rank's: stage 3's model is not whole between steps
    before = [p.detach().clone() for p in shards]
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    if rank == 1:
        shards[0].grad[0] = float("inf")  # an overflow that only this rank's shard shows
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    sharded.close()
    return scaler.get_scale(), all(torch.equal(b, p) for b, p in zip(before, shards))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_overflow_in_one_shard_skips_the_step_on_every_rank(local_group, stage):
    assert local_group(2).run(overflow_in_one_shard, stage) == [(2.0, True), (2.0, True)]


def clipped_by_the_inf_norm(rank, world_size, stage):
    """One SGD step of a sharded model clipped by the inf-norm (the largest |g| over every rank's shards: an
    all-reduce MAX), beside an unsharded copy whose averaged gradient torch.nn.utils.clip_grad_norm_ clips:
    (our norm, torch's, the largest weight difference after the step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    reference = copy.deepcopy(model)
    sharded = zero.shard(model, stage, bucket_mb=1e-4)  # buckets of a tensor or two: a norm over several
    optimizer = sharded.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).sum().backward()
    norm = sharded.clip_grad_norm_(0.01, norm_type=float("inf"))
    optimizer.step()
    reference(x).pow(2).sum().backward()
    for p in reference.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01, norm_type=float("inf"))
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    sharded.close()
    return float(norm), float(expected), max_difference(model.state_dict(), reference.state_dict())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_by_the_inf_norm_takes_the_largest_element_of_every_shard(local_group, stage):
    for norm, expected, worst in local_group(2).run(clipped_by_the_inf_norm, stage):
        assert norm == expected > 0.01  # a max is exact; and it bites
        assert worst < 1e-15


def profiled_ranges(rank, world_size, argv, directory):
    """A profiled trainer run; the names of the ranges in this rank's trace."""
    import json
    train_in_group(rank, world_size, argv + ["--profile", directory])
    with open(f"{directory}/rank{rank}.pt.trace.json") as f:
        return [e["name"] for e in json.load(f)["traceEvents"] if e.get("cat") == "user_annotation"]


@pytest.mark.parametrize("stage", [1, 2])
def test_profile_shows_each_buckets_reduce_scatter_and_all_gather(local_group, tmp_path, stage):
    """--profile on the sharded stages: a range for each bucket's reduce-scatter and all-gather, closed when it lands."""
    argv = BASE + ["--optimizer", "sgd", "--zero", str(stage), "--max-steps", "2", "--profile-steps", "1:2"]
    names = local_group(2).run(profiled_ranges, argv, str(tmp_path))[0]
    buckets = bucket_count(torch.float32)
    scatters = [n for n in names if n.startswith("reduce_scatter bucket ")]
    gathers = [n for n in names if n.startswith("all_gather bucket ")]
    assert len(gathers) == buckets  # one step profiled
    assert len(scatters) == buckets * (3 if stage == 2 else 1)  # a window of 3 micro-batches
    assert "reduce_scatter wait" in names and "all_gather wait" in names


def profiled_events(rank, world_size, argv, directory):
    """A profiled trainer run; this rank's named ranges as (name, start, end) in microseconds."""
    import json
    train_in_group(rank, world_size, argv + ["--profile", directory])
    with open(f"{directory}/rank{rank}.pt.trace.json") as f:
        return [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in json.load(f)["traceEvents"]
                if e.get("cat") == "user_annotation"]


def test_stage_3_prefetches_the_next_unit_while_the_current_one_computes(local_group, tmp_path):
    """In the first two steps, profiled (3 micro-batches each; the first forward of all prefetches along module
    order), unit I+1's all-gather is launched inside unit I's forward
    range and before unit I+1's begins, and in backward unit I-1's inside unit I's and before unit I-1's begins
    (the root's backward, which comes first, launches the last block's): the orders the forward recorded, 0 1 2 3
    started and 1 2 3 0 finished, whose reverse the backward runs. At the step's edge the optimizer's step
    launches the root's and unit 1's all-gathers, so the next step's first forward starts with both gathered: its
    unit 0 forward launches no gather of unit 1; under a profiler the step waits for both (a gloo collective still
    in flight when the profiler stops is a segfault). Every unit is reduce-scattered per micro-batch."""
    argv = BASE + ["--optimizer", "sgd", "--zero", "3", "--max-steps", "2", "--profile-steps", "0:2"]
    for events in local_group(2).run(profiled_events, argv, str(tmp_path)):
        def ranges(prefix):
            return sorted((start, end, name) for name, start, end in events if name.startswith(prefix))

        def gathers(unit):
            return [start for start, _, _ in ranges(f"all_gather unit {unit} (")]

        steps = ranges("optimizer step")
        assert len(steps) == 2
        first_forwards = {min(start for start, _, _ in ranges("unit 0 forward") if start > steps[0][1])}
        for phase, pairs in (("forward", [(0, 1), (1, 2), (2, 3)]), ("backward", [(0, 3), (3, 2), (2, 1)])):
            for unit, following in pairs:
                spans = ranges(f"unit {unit} {phase}")
                nexts = [start for start, _, _ in ranges(f"unit {following} {phase}")]
                assert len(spans) == len(nexts) == 6, (phase, unit)
                for (start, end, _), next_start in zip(spans, nexts):
                    inside = any(start <= g <= end and g < next_start for g in gathers(following))
                    # the second step's first forward: unit 1 was launched at the first step's edge instead
                    assert inside != (phase == "forward" and unit == 0 and start in first_forwards), \
                        (phase, unit, following)
        for unit in (0, 1):  # the step's edge
            assert any(steps[0][0] <= g <= steps[0][1] for g in gathers(unit)), unit
        for start, end, _ in steps:  # under the profiler both land inside the step, before the window may close
            assert len([s for s, e, _ in ranges("all_gather wait") if start <= s and e <= end]) == 2
        for unit in range(4):
            assert len(ranges(f"reduce_scatter unit {unit} (")) == 6


def evaluate_sharded_in_group(rank, world_size, val_size, seed):
    """The trainer's scattered evaluation (trainer.evaluation.validate) of a stage 3 model, whose forwards every
    rank must join, at --eval-batch-size 16 and at its default (--batch-size 7): the figures, and the size of each
    forward's batch."""
    model, data = model_and_labelled_set(val_size, seed)
    zero.shard(model, 3, blocks(model))
    memory = MemoryData(data, data, 100, seed, 16)
    sizes = []
    model.register_forward_pre_hook(lambda module, inputs: sizes.append(len(inputs[0])))
    results = []
    for argv in (["--eval-batch-size", "16"], []):
        config = trainer.parse_args(["--dataset", "synthetic", "--zero", "3", "--batch-size", "7", *argv])
        parts = SimpleNamespace(config=config, model=model, data=memory, device=torch.device("cpu"),
                                comm_device=torch.device("cpu"), amp_dtype=None, outer=None,
                                phases=SimpleNamespace(end=lambda phase: None))
        sizes.clear()
        results.append((validate(parts), list(sizes)))
    return results


def test_evaluation_of_a_stage_3_model_keeps_every_rank_in_step(local_group):
    """50 samples on 3 processes: shards of 17, 17 and 16. In batches of 16: 2, 2 and 1 batches, so the third rank
    runs an empty batch, for the units' all-gathers of the second forward; in batches of 7 (--eval-batch-size's
    default, the micro-batch): 3 each. Every sample counts once, and the figures are the same at both sizes."""
    val_size, seed = 50, 4
    ranks = local_group(3).run(evaluate_sharded_in_group, val_size, seed, timeout_s=60)
    (by_16, sizes_16), (by_7, sizes_7) = ranks[0]
    assert [sizes for (_, sizes), _ in ranks] == [[16, 1], [16, 1], [16, 0]]
    assert [sizes for _, (_, sizes) in ranks] == [[7, 7, 3], [7, 7, 3], [7, 7, 2]]
    model, data = model_and_labelled_set(val_size, seed)
    with torch.no_grad():
        images, labels = normalized_batch(data, torch.arange(val_size))
        logits = model(images)
    for result in (by_16, by_7):
        assert (result["val_correct"], result["val_total"]) == (int((logits.argmax(1) == labels).sum()), val_size)
        assert result["val_loss"] == pytest.approx(F.cross_entropy(logits.double(), labels).item(), rel=1e-6)
    assert (by_7["val_correct"], by_7["val_correct5"]) == (by_16["val_correct"], by_16["val_correct5"])
    assert by_7["val_loss"] == pytest.approx(by_16["val_loss"], rel=1e-12)


# ----------------------------------------------------------------------------------------------------------
# Checkpoints at another number of processes
# ----------------------------------------------------------------------------------------------------------
# 2 epochs of 2 steps: 64 samples, each step 2 micro-batches of 8 on 2 processes (of 4 on 4 processes)
RESUME = TINY + ["--model", "resnet", "--epochs", "2", "--norm", "custom", "--bucket-mb", "0.02", "--seed", "3",
                 "--grad-accum", "2", "--optimizer", "adamw", "--lr", "0.01", "--train-size", "64"]


def saved_as_file(directory):
    """The run's current checkpoint as last.pt holds it, whichever format it is in: a folder (the sharded stages
    write them) read whole, its optimizer state numbered as torch.optim numbers the model's parameters (one group)."""
    found = trainer_checkpoint.current(directory)
    if not found.folder:
        return torch.load(found.path, map_location="cpu", weights_only=True)
    whole = zero.checkpoint.read_whole(found.path, alone=True)
    model = build_model("resnet", 0.0, "custom")
    number = {name: index for index, (name, _) in enumerate(model.named_parameters())}  # one group
    saved = whole["optimizer"]
    numbered = {"state": {number[name]: entry for name, entry in saved["state"].items()},
                "param_groups": [{**group, "params": [number[name] for name in group["params"]]}
                                 for group in saved["param_groups"]]}
    return {**whole["extra"], "model": whole["model"], "optimizer": numbered}


def with_batch_size(argv, batch_size):
    argv = list(argv)
    argv[argv.index("--batch-size") + 1] = str(batch_size)
    return argv


@pytest.fixture(scope="module")
def resumed_on_4(local_group, tmp_path_factory):
    """Uninterrupted on 2 processes x 8 (stage 0). Interrupted: 1 step on 2 x 8 (stage 2, a folder of bucket
    shards, inside the first epoch), then on 4 x 4 to step 2 with FSDP2 without resharding after forward (which
    loads our folder through torch.distributed.checkpoint, and saves at the first epoch's end, after its
    evaluation, whose forwards leave its units gathered), to step 3 with ZeroRedundancyOptimizer (which loads
    FSDP2's folder and writes last.pt, its state consolidated on rank 0), then to the end with stage 1 (which loads
    that last.pt); and the resume on 4 x 8, which changes the global batch.

    Stage 3 is no leg here: its last.pt load is test_trainer_checkpoint's (from --zero 0's last.pt), and its
    folder of this ResNet saved on 4 processes (units gathered at the step's edge) and loaded by stage 1 is
    sgd_resumed's."""
    directory = str(tmp_path_factory.mktemp("resume-on-4"))
    resumed = ["--checkpoint-dir", directory]
    whole = local_group(2).run(train_in_group, RESUME + ["--zero", "0"], "float64")
    first = local_group(2).run(train_in_group, RESUME + ["--zero", "2", "--max-steps", "1"] + resumed, "float64")
    refused = local_group(4).run(try_train_in_group, RESUME + ["--zero", "1"] + resumed)
    legs = {}
    for name, flags, steps in (("fsdp", ["--grad-sync", "fsdp", "--zero", "2"], ["--max-steps", "2"]),
                               ("middle", ["--grad-sync", "ddp", "--zero", "1"], ["--max-steps", "3"]),
                               ("second", ["--zero", "1"], [])):
        legs[name] = local_group(4).run(train_in_group, with_batch_size(RESUME, 4) + flags + steps + resumed,
                                        "float64")
    return {"whole": whole, "first": first, **legs, "refused": refused, "dir": directory}


def test_stopped_on_2_processes_resumed_on_4_ends_where_the_uninterrupted_run_ends(resumed_on_4):
    whole, first, second = resumed_on_4["whole"], resumed_on_4["first"], resumed_on_4["second"]
    assert first[0]["metrics"]["optimizer_steps"] == 1  # 2 steps per epoch: stopped inside the first
    fsdp = resumed_on_4["fsdp"][0]["metrics"]  # stopped at the first epoch's end: saved after its evaluation
    assert fsdp["optimizer_steps"] == 2 and [epoch.get("complete", True) for epoch in fsdp["epochs"]] == [True]
    assert resumed_on_4["middle"][0]["metrics"]["optimizer_steps"] == 3  # inside the second
    assert second[0]["metrics"]["optimizer_steps"] == whole[0]["metrics"]["optimizer_steps"] == 4
    assert second[0]["metrics"]["world_size"] == 4
    worst = max_difference(whole[0]["state"], second[0]["state"])
    print(f"\nstopped at step 1 on 2 processes (stage 2), resumed on 4 (FSDP2 to step 2, ZeroRedundancyOptimizer to 3, "
          f"then stage 1) vs uninterrupted on 2 (stage 0), float64: max |dw| = {worst:.1e}")
    assert worst < 1e-11  # stage 2's summation order (module docstring)
    for ours, theirs in zip(second[0]["metrics"]["epochs"], whole[0]["metrics"]["epochs"], strict=True):
        assert ours["val_correct"] == theirs["val_correct"]
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-12)  # the epoch's sums carried on
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-10)


def test_checkpoint_holds_the_whole_model_and_a_replicated_optimizers_state(resumed_on_4):
    assert trainer_checkpoint.current(resumed_on_4["dir"]).folder  # stage 1 wrote the last: a folder
    state = saved_as_file(resumed_on_4["dir"])
    model = build_model("resnet", 0.0, "custom")
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in state["model"].items()} == shapes
    params = [p for p in model.parameters()]
    assert sorted(state["optimizer"]["state"]) == list(range(len(params)))
    for index, p in enumerate(params):
        entry = state["optimizer"]["state"][index]
        assert entry["exp_avg"].shape == entry["exp_avg_sq"].shape == p.shape
    assert state["optimizer"]["param_groups"][0]["params"] == list(range(len(params)))
    assert state["world_size"] == 4


def test_a_resume_that_changes_the_global_batch_names_the_batch_size_that_keeps_it(resumed_on_4):
    messages = resumed_on_4["refused"]
    assert all(isinstance(m, str) for m in messages)
    assert "global batch of 32 (batch size x grad-accum x processes = 8 x 2 x 2), not 64" in messages[0]
    assert "--batch-size 4 keeps it on 4 processes" in messages[0]


# 4 steps of 32 samples (TINY's 128); TINY's momentum 0.9 and weight decay 5e-4. Nesterov's: its update reads the
# momentum buffer as plain SGD's does, and its param group's nesterov must come back with it (--optimizer sgd is the
# same torch.optim.SGD with nesterov False, whose loss no resume would show)
SGD_RESUME = RESUME + ["--epochs", "1", "--lr", "0.05", "--train-size", "128", "--optimizer", "sgd_nesterov"]
# (world size, --zero, stop after step), a step each: every stage saves and loads SGD's momentum; 2 -> 4 processes
# on the way
SGD_LEGS = [(2, "1", "1"), (2, "2", "2"), (4, "3", "3"), (4, "1", None)]


@pytest.fixture(scope="module")
def sgd_resumed(local_group, tmp_path_factory):
    """--optimizer sgd_nesterov, float64: uninterrupted on 2 processes at --zero 0, and the same run stopped and
    resumed through SGD_LEGS (the per-process batch halved on 4 processes, keeping the global batch)."""
    directory = str(tmp_path_factory.mktemp("resume-sgd"))
    whole = local_group(2).run(train_in_group, SGD_RESUME + ["--zero", "0"], "float64")
    for world_size, stage, stop in SGD_LEGS:
        flags = ["--zero", stage, "--checkpoint-dir", directory] + (["--max-steps", stop] if stop else [])
        last = local_group(world_size).run(train_in_group, with_batch_size(SGD_RESUME, 16 // world_size) + flags,
                                           "float64")
    return {"whole": whole[0], "resumed": last[0], "dir": directory}


def test_sgd_stopped_and_resumed_through_every_stage_ends_where_the_uninterrupted_run_ends(sgd_resumed):
    """The momentum buffers travel through every stage's checkpoint: without them the resumed run's first step
    is a plain gradient step, and the weights end about 0.5 away (the issue's measurement, --zero 1); and the
    param group's nesterov with them, whose loss would step on as plain SGD."""
    whole, resumed = sgd_resumed["whole"], sgd_resumed["resumed"]
    assert resumed["metrics"]["optimizer_steps"] == whole["metrics"]["optimizer_steps"] == 4
    worst = max_difference(whole["state"], resumed["state"])
    legs = " -> ".join(f"--zero {stage} on {w}" for w, stage, _ in SGD_LEGS)
    print(f"\n--optimizer sgd_nesterov, stopped and resumed ({legs}) vs uninterrupted (--zero 0 on 2), float64: "
          f"max |dw| = {worst:.1e}")
    assert worst < 1e-11  # stage 2's and 3's summation order (module docstring)
    state = saved_as_file(sgd_resumed["dir"])["optimizer"]
    params = list(build_model("resnet", 0.0, "custom").parameters())
    assert sorted(state["state"]) == list(range(len(params)))
    assert all(entry.keys() == {"momentum_buffer"} and entry["momentum_buffer"].shape == p.shape
               for entry, p in zip((state["state"][i] for i in range(len(params))), params))
    assert state["param_groups"][0]["nesterov"] is True


@pytest.mark.parametrize("loss", ["every entry", "one buffer"])
def test_a_checkpoint_without_sgds_momentum_is_refused_in_one_line(sgd_resumed, local_group, tmp_path, loss):
    """What the sharded stages once wrote (no entry at all), or one parameter's buffer gone: refused on load,
    naming the key, at every stage, instead of training on from another state."""
    state = saved_as_file(sgd_resumed["dir"])  # last.pt's form, of the folder the last leg (stage 1) wrote
    if loss == "every entry":
        state["optimizer"]["state"] = {}
    else:
        del state["optimizer"]["state"][5]["momentum_buffer"]
    torch.save(state, tmp_path / "last.pt")
    for stage in ("0", "3"):
        argv = SGD_RESUME + ["--zero", stage, "--checkpoint-dir", str(tmp_path)]
        messages = local_group(2).run(try_train_in_group, with_batch_size(argv, 8))
        expected = "has no 'momentum_buffer', which torch.optim.SGD keeps for every parameter it has stepped"
        assert all(isinstance(m, str) and "\n" not in m and expected in m for m in messages), messages
        assert f"parameter {0 if loss == 'every entry' else 5} has no" in messages[0]


def misfits():
    """zero.shard's arguments that do not fit a small ResNet, each with the phrase its one line must hold."""
    model = build_model("resnet", 0.0, "local")
    relu = next(m for m in model.modules() if isinstance(m, torch.nn.ReLU))
    return model, [
        (dict(stage=5), "stage is 0, 1, 2 or 3, not 5"),
        (dict(stage=2, collectives="butterfly"), "stage 2 runs on torch or ring collectives, not 'butterfly'"),
        (dict(stage=2, overlap=False), "overlap=False would keep every full gradient"),
        (dict(stage=2, accumulate="unsharded"), "accumulate is 'sharded', or 'unsharded' at stage 3"),
        (dict(stage=2, units=blocks(model)), "units are stage 3's"),
        (dict(stage=3, units=[relu]), f"unit {[n for n, m in model.named_modules() if m is relu][0]!r} (ReLU) owns "
                                      f"no parameter"),
        (dict(stage=3, units=[torch.nn.Linear(2, 2)]), "a unit (Linear) is not a submodule of the model"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_arguments_that_do_not_fit_are_refused_in_one_line_before_any_collective(case):
    """No process group exists here: each refusal comes before shard() broadcasts or builds anything."""
    model, cases = misfits()
    arguments, phrase = cases[case]
    with pytest.raises(ValueError) as refused:
        zero.shard(model, **arguments)
    assert phrase in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize("flags,phrase", [
    (["--grad-sync", "ddp", "--zero", "2"], "--grad-sync ddp takes --zero 0 or 1"),
    (["--zero", "1", "--allreduce", "butterfly"], "--allreduce torch or ring"),
    (["--zero", "2", "--sync-mode", "after"], "--zero 2 reduce-scatters gradients as backward"),
    (["--zero", "3", "--sync-mode", "after"], "--zero 3 reduce-scatters gradients as backward"),
    (["--zero", "4"], "invalid choice: 4"),
    (["--grad-sync", "fsdp"], "--grad-sync fsdp takes --zero 2"),
    (["--zero", "2", "--zero3-accumulate", "unsharded"], "--zero3-accumulate is for --grad-sync custom --zero 3"),
    (["--grad-sync", "fsdp", "--zero", "3", "--allreduce", "ring"], "--allreduce ring is for --grad-sync custom"),
])
def test_zero_flags_are_checked_in_one_line(flags, phrase):
    with pytest.raises(trainer.UsageError, match=phrase):
        trainer.parse_args(TINY + flags)
