"""The trainer's hybrid sharding and mixed precision (issue 37): --replicas R with --grad-sync custom --zero 1-3
(zero.shard's group and replicate_group) and with --grad-sync fsdp (FSDP2's HSDP on a 2-D DeviceMesh), and
--param-dtype / --reduce-dtype, at 4 processes in the session's workers, one call of the group for every run.

Why hybrid equals plain data parallelism to 1e-10 in float64: on the grid of 2 replicas x 2 shards each gradient
element is reduce-scattered inside a replica (the sum of 2 ranks' gradients) and then all-reduced across the 2
replicas (the sum of those 2 sums), divided by 4 either way; stage 0 sums the same 4 per-rank gradients in one
all-reduce. The same four addends, another association: float64's rounding (2^-53 relative per addition) is all
that differs, about 1e-16 a step, which 3 steps of SGD with momentum cannot raise anywhere near 1e-10. The clipping
norm sums the squares over a replica's 2 shards (the replicas hold equal shards), the whole model's norm as at
stage 0. A lost replica all-reduce would leave each replica on the mean of its own 2 ranks: a first-order
difference (lr x gradient, ~1e-3), so 1e-10 tells them apart by seven orders of magnitude.
"""
import pytest
import torch

import ddp_cifar100 as trainer
from trainer.checkpoint import read_alone
from trainer_testing import TINY
from utils import UsageError
from zero_testing import max_difference

WORLD = 4
BASE = TINY + ["--epochs", "1", "--max-steps", "2", "--dropout", "0", "--grad-accum", "2", "--batch-size", "4",
               "--clip-grad-norm", "0.5", "--seed", "5"]
HYBRID = ["--replicas", "2"]
# DiLoCo with H = 1, plain SGD inside and outer SGD with lr 1 is data parallelism's step (test_diloco_training's
# argument): here over 2 replicas of 2 processes at stage 3, the outer step on the master shards
# (--norm local: diloco's SyncBatchNorm normalizes over the replica, data parallelism's over the world)
PLAIN = [*BASE[:BASE.index("--clip-grad-norm")], "--momentum", "0", "--weight-decay", "0", "--seed", "5", "--norm",
         "local"]
DILOCO_DP = ["--grad-sync", "diloco", "--zero", "3", *HYBRID, "--local-steps", "1", "--outer-optimizer", "sgd",
             "--outer-lr", "1", "--outer-momentum", "0"]
# bf16 weights, gathers and compute over float32 masters and state, 3 steps: the weights move by lr x gradient
# ~ 1e-3 a step, computed from weights rounded to 8 bits (2^-9 relative): a few 1e-4 apart from the float32
# run at most, and more than float32's own rounding (1e-6): the bf16 run did compute in bf16
BF16_MAX, BF16_MIN = 1e-2, 1e-5
BF16 = ["--param-dtype", "bf16", "--reduce-dtype", "fp32"]
BATCHNORM = ["--model", "resnet"]  # affine BatchNorm: bf16 weights beside float32 running statistics in evaluation


def runs_in_group(rank, world_size, variants, checkpoint_root):
    """Every variant (name, extra flags, default dtype) trained in turn: its whole weights, grad norms, the largest
    rank's optimizer-state bytes, the FSDP2 mesh's dimensions (0: no DTensor) and its checkpoint's dtypes."""
    out = {}
    for name, extra, dtype in variants:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, dtype))
        directory = f"{checkpoint_root}/{name.replace(' ', '-')}"
        try:
            trained = trainer.train(trainer.parse_args(extra + ["--checkpoint-dir", directory]))
        finally:
            torch.set_default_dtype(previous)
        metrics, model = trained.metrics, trained.model
        first = next(model.parameters())
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                 for k, v in model.state_dict().items()}
        saved = read_alone(directory)[1] if rank == 0 else None  # last.pt, or a sharded sync's folder read whole
        out[name] = {"state": state, "grad_norms": metrics["grad_norms"],
                     "optimizer_bytes": metrics["state_bytes"]["optimizer"],
                     "sent_by_group": metrics.get("sent_bytes_by_group_per_step"),
                     "mesh_dims": first.device_mesh.ndim if hasattr(first, "device_mesh") else 0,
                     "saved_dtypes": {v.dtype for v in saved["model"].values() if v.is_floating_point()}
                     if saved else None}
    return out


@pytest.fixture(scope="module")
def runs(local_group, tmp_path_factory):
    variants = [("stage 0", BASE + ["--zero", "0"], "float64")]
    variants += [(f"hybrid {stage}", BASE + ["--zero", str(stage), *HYBRID], "float64") for stage in (1, 2, 3)]
    variants += [("hsdp", BASE + ["--grad-sync", "fsdp", "--zero", "3", *HYBRID], "float64"),
                 ("hybrid 3 float32", BASE + ["--zero", "3", *HYBRID, *BATCHNORM], "float32"),
                 ("hybrid 3 bf16", BASE + ["--zero", "3", *HYBRID, *BATCHNORM, *BF16], "float32"),
                 ("hsdp bf16", BASE + ["--grad-sync", "fsdp", "--zero", "3", *HYBRID, *BATCHNORM, *BF16], "float32"),
                 ("plain stage 0", PLAIN + ["--zero", "0"], "float64"),
                 ("diloco over zero 3", PLAIN + DILOCO_DP, "float64")]
    # resume: 2 outer steps of Nesterov (its momentum and shared point per shard in the checkpoint), then a third
    diloco = PLAIN + ["--grad-sync", "diloco", "--zero", "3", *HYBRID, "--local-steps", "1"]
    variants += [("diloco 3 steps", diloco + ["--max-steps", "3"], "float64"),
                 ("diloco resumed", diloco + ["--max-steps", "2"], "float64"),
                 ("diloco resumed", diloco + ["--max-steps", "3"], "float64")]
    return local_group(WORLD).run(runs_in_group, variants, str(tmp_path_factory.mktemp("hybrid")))


@pytest.mark.parametrize("name", ["hybrid 1", "hybrid 2", "hybrid 3", "hsdp"])
def test_hybrid_sharding_takes_data_parallelisms_steps(runs, name):
    """2 replicas x 2 shards within 1e-10 of stage 0 over the 4 processes (module docstring), on every rank, with
    the same clipping norms; the shards are over 2 processes, not 4 (the optimizer's state is half the model's
    momentum, not a quarter), and FSDP2's parameters live on a 2-D mesh."""
    reference = runs[0]["stage 0"]
    for rank in runs:
        assert max_difference(rank[name]["state"], reference["state"]) < 1e-10
        assert max(abs(a - b) for a, b in zip(rank[name]["grad_norms"], reference["grad_norms"])) < 1e-10
        assert rank[name]["saved_dtypes"] in (None, {torch.float64})
    if name == "hsdp":
        assert [rank[name]["mesh_dims"] for rank in runs] == [2] * WORLD
    else:  # SGD's momentum: 8 bytes a parameter, over 2 shards
        parameters = sum(v.numel() for k, v in reference["state"].items() if "running" not in k and "num" not in k)
        assert runs[0][name]["optimizer_bytes"] >= 8 * parameters / 2


@pytest.mark.parametrize("name", ["hybrid 1", "hybrid 2", "hybrid 3"])
def test_the_metrics_carry_the_bytes_sent_across_replicas(runs, name):
    """The metrics JSON's sent_bytes_by_group_per_step, in units of one (padded) float64 shard, which is exactly
    the bytes of SGD's momentum over it: across 2 replicas each rank all-reduces its shard once per step, 2 (R-1)/R
    = 1 shard; inside its shard group of S = 2, a one-way is (S-1)/S of a bucket = 1 shard, and a step of K = 2
    micro-batches sends 2 at stage 1 (a reduce-scatter, an all-gather), K + 1 = 3 at stage 2, and at stage 3 at
    least 3 K = 6 (and the evaluation's and the checkpoint's gathers). Stage 0 (no groups) carries no entry."""
    sent, shard = runs[0][name]["sent_by_group"], runs[0][name]["optimizer_bytes"]
    assert sent["replicas"] == shard
    if name == "hybrid 3":
        assert sent["shard_group"] >= 6 * shard
    else:
        assert sent["shard_group"] == {"hybrid 1": 2, "hybrid 2": 3}[name] * shard
    assert runs[0]["stage 0"]["sent_by_group"] is None


def test_diloco_over_zero_3_with_one_local_step_is_data_parallelism(runs):
    """--grad-sync diloco --replicas 2 --zero 3, H = 1, plain SGD inside, outer SGD lr 1: within 1e-10 of stage 0
    on every rank (the mean of the replicas' steps taken on the shards). An outer step on anything but the shards
    the optimizer steps would leave each replica on its own half of the batch: a first-order difference."""
    for rank in runs:
        assert max_difference(rank["diloco over zero 3"]["state"], rank["plain stage 0"]["state"]) < 1e-10
    assert runs[0]["diloco over zero 3"]["saved_dtypes"] == {torch.float64}


def test_diloco_over_zero_3_resumes_exactly(runs):
    """Stopped after 2 outer steps (Nesterov, lr 0.7, momentum 0.9) and resumed for a third: bit for bit the
    uninterrupted run, on every rank: each rank's outer state (its shard's shared point and momentum) came back to
    it. A rank given another's, or none, steps from another point at first order."""
    for rank in runs:
        assert max_difference(rank["diloco resumed"]["state"], rank["diloco 3 steps"]["state"]) == 0


@pytest.mark.parametrize("name", ["hybrid 3 bf16", "hsdp bf16"])
def test_bf16_parameters_train_over_float32_masters(runs, name):
    """--param-dtype bf16 --reduce-dtype fp32, ours and FSDP2's (its MixedPrecisionPolicy on HSDP's mesh): the
    weights handed back and the checkpoint are float32 (the masters'), and they are bf16's rounding away from the
    same run in float32 (BF16_MAX, BF16_MIN)."""
    reference = runs[0]["hybrid 3 float32"]["state"]
    ours = runs[0][name]
    assert {v.dtype for v in ours["state"].values() if v.is_floating_point()} == {torch.float32}
    assert ours["saved_dtypes"] == {torch.float32}
    difference = max_difference(ours["state"], reference)
    print(f"\n{name} vs the float32 run: max |dw| = {difference:.2e}")
    assert BF16_MIN < difference < BF16_MAX, difference


def test_bf16_hybrid_stage_3_takes_fsdp2_hsdps_steps_with_the_same_policy(runs):
    """Ours and FSDP2's HSDP with MixedPrecisionPolicy(bf16, fp32): the same bf16 casts of the same float32 masters,
    the gradients reduced in float32, so they part only by float32 sums in another order (the reduce-scatter's and
    the replicas' all-reduce against FSDP2's), ~1e-7 relative a step; two steps stay within 1e-6 (7e-9 here), while
    computing in another dtype than FSDP2's moves the weights by bf16's rounding of a step, ~4e-4 (the float32 run)."""
    difference = max_difference(runs[0]["hybrid 3 bf16"]["state"], runs[0]["hsdp bf16"]["state"])
    print(f"\nbf16 hybrid stage 3, ours vs FSDP2's HSDP: max |dw| = {difference:.2e}")
    assert difference < 1e-6


REFUSED = [
    (["--grad-sync", "ddp", "--param-dtype", "bf16"],
     "--param-dtype is for --grad-sync custom --zero 1-3 and fsdp (master shards in the model's dtype); --grad-sync "
     "ddp --zero 0 keeps the model whole in its own dtype (use --amp there)"),
    (["--zero", "0", "--reduce-dtype", "bf16"],
     "--reduce-dtype is for --grad-sync custom --zero 1-3 and fsdp (master shards in the model's dtype); --grad-sync "
     "custom --zero 0 keeps the model whole in its own dtype (use --amp there)"),
    (["--grad-sync", "localsgd", "--param-dtype", "bf16"],
     "--param-dtype is for --grad-sync custom --zero 1-3 and fsdp (master shards in the model's dtype); --grad-sync "
     "localsgd --zero 0 hands the model's weights to the outer step in its own dtype (use --amp there)"),
    (["--zero", "3", "--param-dtype", "bf16", "--amp", "bf16"],
     "--param-dtype and --reduce-dtype are mixed precision of their own; --amp bf16 would autocast on top of them: "
     "use one or the other"),
    (["--replicas", "2"],
     "--replicas is for --grad-sync custom --zero 1-3 and fsdp (hybrid sharding), diloco and localsgd; "
     "not --grad-sync custom --zero 0"),
    (["--grad-sync", "ddp", "--zero", "1", "--replicas", "2"],
     "--replicas is for --grad-sync custom --zero 1-3 and fsdp (hybrid sharding), diloco and localsgd; "
     "not --grad-sync ddp --zero 1"),
    (["--zero", "2", "--replicas", "0"], "--replicas must be positive, got 0"),
    (["--zero", "1", "--param-dtype", "bf16", "--norm", "local"],
     "--param-dtype with --norm local: torch's BatchNorm takes its weights and running statistics in one dtype; "
     "--norm custom (syncbn.py) takes bf16 weights over float32 statistics"),
]


@pytest.mark.parametrize("argv,message", REFUSED, ids=[" ".join(argv) for argv, _ in REFUSED])
def test_each_sync_without_the_notion_refuses_it_in_one_line(argv, message):
    with pytest.raises(UsageError) as caught:
        trainer.parse_args(argv)
    assert str(caught.value) == message
