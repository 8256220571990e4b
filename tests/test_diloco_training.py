"""DiLoCo and local SGD through the trainer (--grad-sync diloco|localsgd): the invariants in float64 against the
ordinary data-parallel trainer, replicas of two processes on any --zero through zero.shard's group=, the bytes in
the metrics against the ring's formula, exact resume from a checkpoint taken mid-window with a fragment in flight,
and the flags' one-line refusals. diloco.py's own algebra (the compressed ring, error feedback, the outer step's
direction, the streaming schedule) is test_diloco.py's.

Why 1e-12 in float64: with H = 1, plain SGD inside and outer SGD with lr 1 and no momentum, the outer step sets the
weights to theta - (theta - mean_r theta_r) = mean_r (theta - lr g_r) = theta - lr mean_r g_r, data parallelism's
step, except for the rounding of the subtraction and of the sum over replicas in another order: a few units of
2^-53 relative per step. Four steps of lr 0.05 on a net whose weights are O(0.1) stay near 1e-16; a missing or
doubled average, a flipped sign or a replica left out moves them at first order, lr x O(0.1) = 5e-3.
"""
import pytest
import torch

import diloco
from trainer_testing import TINY, train_in_group, try_train_in_group
from zero_testing import max_difference

PLAIN = TINY + ["--model", "net", "--dropout", "0", "--norm", "local", "--momentum", "0", "--weight-decay", "0",
                "--epochs", "1", "--bucket-mb", "0.01"]
FOUR = ["--max-steps", "4"]


def test_local_sgd_every_step_is_data_parallel_step(local_group):
    """localsgd with H = 1: each process a replica; two replicas of two processes (the inner sync over the
    replica's group, at --zero 0 and 2); the same weights as the trainer's data parallelism over all processes."""
    group = local_group(4)
    reference = group.run(train_in_group, PLAIN + FOUR + ["--batch-size", "4"], "float64")[0]["state"]
    variants = {"4 replicas": ["--grad-sync", "localsgd", "--local-steps", "1"],
                "2 replicas of 2, zero 0": ["--grad-sync", "localsgd", "--local-steps", "1", "--replicas", "2"],
                "2 replicas of 2, zero 2": ["--grad-sync", "localsgd", "--local-steps", "1", "--replicas", "2",
                                            "--zero", "2"]}
    errors = {}
    for name, flags in variants.items():
        results = group.run(train_in_group, PLAIN + FOUR + ["--batch-size", "4"] + flags, "float64")
        errors[name] = max(max_difference(r["state"], reference) for r in results)
    print("worst |localsgd H=1 - data parallel|:", errors)
    assert max(errors.values()) <= 1e-12, errors


def test_replicas_drift_inside_a_window_and_meet_at_its_end(local_group):
    """H = 3 over 4 steps: after step 4 the replicas differ (a window is under way), and the evaluated model is
    the shared point; after 3 steps they are equal (they met)."""
    group = local_group(2)
    flags = PLAIN + ["--grad-sync", "localsgd", "--local-steps", "3"]
    at_4 = group.run(train_in_group, flags + FOUR)
    at_3 = group.run(train_in_group, flags + ["--max-steps", "3"])
    assert max_difference(at_4[0]["state"], at_4[1]["state"]) > 1e-4
    assert max_difference(at_3[0]["state"], at_3[1]["state"]) == 0


def test_bytes_in_the_metrics_follow_the_ring(local_group):
    """Every outer all-reduce's bytes are the ring's count for its fragment under the codec (busiest rank), and
    sent_bytes is the most any rank sent in all of them, as --eval-every's evaluations count it so far; data
    parallelism's figure is 2 (W-1)/W of the model per step."""
    group = local_group(2)
    for codec in diloco.CODECS:
        flags = PLAIN + FOUR + ["--grad-sync", "diloco", "--local-steps", "2", "--fragments", "2", "--outer-compress",
                                codec, "--eval-every", "2"]
        metrics = group.run(train_in_group, flags)[0]["metrics"]
        reduces = metrics["outer_all_reduces"]
        assert [(r["step"], r["fragment"]) for r in reduces] == [(1, 0), (2, 1), (3, 0), (4, 1)]
        assert [r["bytes"] for r in reduces] == [diloco.outer_step_bytes(r["elements"], 2, codec) for r in reduces]
        per_rank = [sum(diloco.ring_bytes(r["elements"], rank, 2, codec) for r in reduces) for rank in range(2)]
        assert metrics["sent_bytes"] == max(per_rank)
        # --eval-every 2: the bytes sent by each evaluation's step, and the seconds of training growing
        evals = metrics["evals"]
        assert [e["step"] for e in evals] == [2, 4] and 0 < evals[0]["time_s"] < evals[1]["time_s"]
        assert evals[0]["sent_bytes"] == max(sum(diloco.ring_bytes(r["elements"], rank, 2, codec)
                                                 for r in reduces[:2]) for rank in range(2))
        assert evals[1]["sent_bytes"] == metrics["sent_bytes"]
        params = metrics["trainable_parameters"]
        assert sum(r["elements"] for r in reduces[:2]) == params
        assert metrics["data_parallel_bytes_per_step"] == diloco.data_parallel_bytes(params, 2) == 4 * params
        assert metrics["data_parallel_sent_bytes"] == 4 * metrics["data_parallel_bytes_per_step"]


def test_resume_mid_window_with_a_fragment_in_flight_is_exact(local_group, tmp_path):
    """DiLoCo (Nesterov outer steps, int4 with error feedback, 2 fragments applied a step after launch, AdamW
    inside): stopped after step 4 (fragment 1 in flight, launched at 4 and due at 5) and resumed to step 9, it
    ends bit for bit where the uninterrupted run does. The validation of the stopped run (mid-window, the replicas
    apart) is the shared point's: --eval-only of its checkpoint gives the same loss."""
    group = local_group(2)
    flags = TINY + ["--model", "net", "--epochs", "1", "--optimizer", "adamw", "--lr", "0.003", "--grad-sync",
                    "diloco", "--local-steps", "4", "--fragments", "2", "--outer-delay", "1", "--outer-compress",
                    "int4", "--checkpoint-dir"]
    straight = group.run(train_in_group, flags + [str(tmp_path / "straight"), "--max-steps", "9"])
    stopped = group.run(train_in_group, flags + [str(tmp_path / "resumed"), "--max-steps", "4"])
    # validation evaluated the shared point: the checkpoint's "model", which --eval-only evaluates
    evaluated = group.run(train_in_group, flags + [str(tmp_path / "resumed"), "--eval-only"])
    assert evaluated[0]["metrics"]["val_loss"] == stopped[0]["metrics"]["val_loss"]
    state = torch.load(tmp_path / "resumed" / "last.pt", weights_only=True)
    assert [item["fragment"] for item in state["replicas"][0]["outer"]["in_flight"]] == [1]
    assert max_difference(state["replicas"][0]["model"], state["replicas"][1]["model"]) > 0  # mid-window
    resumed = group.run(train_in_group, flags + [str(tmp_path / "resumed"), "--max-steps", "9"])
    for rank in range(2):
        assert max_difference(straight[rank]["state"], resumed[rank]["state"]) == 0
    assert straight[0]["metrics"]["val_loss"] == resumed[0]["metrics"]["val_loss"]


@pytest.mark.parametrize("flags, message", [
    (["--local-steps", "5"], "--local-steps is for --grad-sync diloco or localsgd"),
    (["--grad-sync", "localsgd", "--outer-lr", "0.5"], "--outer-lr is diloco's"),
    (["--grad-sync", "diloco", "--zero", "1", "--param-dtype", "bf16"],
     "--param-dtype is for --grad-sync custom --zero 1-3 and fsdp"),  # --zero 3 is taken now (issue 37)
    (["--grad-sync", "diloco", "--replicas", "3"], "--replicas 3 does not divide the 2 processes"),
    (["--grad-sync", "diloco", "--local-steps", "8", "--fragments", "4", "--outer-delay", "3"],
     "--outer-delay 3 must be between 0 and"),
    (["--grad-sync", "diloco", "--local-steps", "2", "--fragments", "3"], "--fragments 3 must be between 1"),
    (["--grad-sync", "diloco", "--local-steps", "20", "--fragments", "20"], "fragments must be between 1 and the"),
])
def test_refusals_are_one_line(local_group, flags, message):
    result = local_group(2).run(try_train_in_group, PLAIN + flags)
    assert all(r.startswith("UsageError:") and message in r and "\n" not in r for r in result), result
