"""What users of the trainer depend on, pinned: a checkpoint written before the trainer was split into rooms still
resumes (and ends where an uninterrupted run ends), the metrics JSON's keys, every flag of --help and its value
after parsing, the one-line errors and their exit codes, the profiler ranges the benchmarks read, and the order of
the collectives (the same on every rank; the run's closing ones pinned one by one).

The fixture testdata/trainer-checkpoint/last.pt was written by the trainer of commit e2ccd49 (one file of 1,460
lines) with FIXTURE_FLAGS on the session's image folder (conftest.py); ``python -m tests.test_trainer_pins DIR``
(from the repository's root) writes the same run's checkpoint to DIR/last.pt (with the trainer of the day: only for
a deliberate change of format)."""
import io
import json
import os
import re
import sys
from contextlib import redirect_stdout

import pytest
import torch
import torch.distributed as dist

import data
import ddp_cifar100 as trainer
from benchmarks.trainer_traces import named_ranges

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "testdata", "trainer-checkpoint", "last.pt")

# 40 images, micro-batches of 4, 2 per step: 5 steps an epoch; the fixture stopped at step 7 (epoch 2, micro-batch 4)
FIXTURE_FLAGS = ["--device", "cpu", "--dataset", "imagefolder", "--image-size", "10", "--batch-size", "4",
                 "--grad-accum", "2", "--epochs", "2", "--momentum", "0", "--seed", "0"]


def fixture_argv(folder, checkpoint_dir, *extra):
    return FIXTURE_FLAGS + ["--data-dir", str(folder), "--checkpoint-dir", str(checkpoint_dir), *extra]


# ----------------------------------------------------------------------------------------------------------
# A checkpoint of the trainer before the rooms resumes after them
# ----------------------------------------------------------------------------------------------------------
CHECKPOINT_KEYS = ["config", "epoch", "epoch_sums", "fingerprint", "history", "micro_batch", "micro_batches_total",
                   "model", "optimizer", "optimizer_steps", "rng_seed", "scaler", "scheduler", "world_size"]


# The fixture's floats were computed on another machine, whose kernels may sum in another order (oneDNN's and ATen's
# vectorized paths differ by CPU and by ATEN_CPU_CAPABILITY), and training is chaotic: after 7 steps its weights are
# 1.4e-6 from this machine's under AVX2 or AVX-512, and 0.02 under the default kernels, where one step moves them
# by 0.07. So the fixture's floats are not compared (no tolerance tells "another CPU" from "another step" there);
# everything else of it is, exactly, and the resume is checked bit for bit from this machine's step-7 weights.
# what the other machine measured of its run: its clock, and its answers (losses, counts of right answers)
MEASUREMENTS = {"epoch_time_s", "samples_per_s", "train_loss", "train_acc", "val_loss", "val_acc", "val_acc5",
                "val_correct", "val_correct5"}


def assert_same_but_floats(ours, theirs, path="checkpoint"):
    """Equal containers, tensor shapes and dtypes, and equal values except floating ones (tensors and numbers)."""
    if isinstance(ours, dict):
        assert sorted(ours) == sorted(theirs), path
        for key in set(ours) - MEASUREMENTS:
            assert_same_but_floats(ours[key], theirs[key], f"{path}[{key!r}]")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_but_floats(a, b, f"{path}[{i}]")
    elif torch.is_tensor(ours):
        assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype), path
        assert ours.is_floating_point() or torch.equal(ours, theirs), path
    else:
        assert type(ours) is type(theirs), path
        assert isinstance(ours, float) or ours == theirs, path


def test_a_checkpoint_written_before_the_rooms_resumes_exactly(image_folder, tmp_path, capsys):
    """The old checkpoint is today's run stopped at step 7 (its structure, counters, record, fingerprint and RNG seed
    exactly; its floats are another CPU's); with this machine's step-7 weights put in it, the run it resumes ends bit
    for bit where an uninterrupted run ends (the CPU's kernels, a world of one)."""
    old = torch.load(FIXTURE, map_location="cpu", weights_only=True)
    assert sorted(old) == CHECKPOINT_KEYS
    assert (old["epoch"], old["micro_batch"], old["optimizer_steps"]) == (1, 4, 7)
    stopped, resumed, fresh = tmp_path / "stopped", tmp_path / "resumed", tmp_path / "fresh"
    assert trainer.main(fixture_argv(image_folder, stopped, "--max-steps", "7")) == 0
    here = torch.load(stopped / "last.pt", map_location="cpu", weights_only=True)
    assert_same_but_floats(old, here)
    resumed.mkdir()
    torch.save({**old, "model": here["model"]}, resumed / "last.pt")  # the old format, this machine's weights
    capsys.readouterr()
    assert trainer.main(fixture_argv(image_folder, resumed, "--metrics-out", str(tmp_path / "m.json"))) == 0
    assert "resuming from" in capsys.readouterr().out
    assert trainer.main(fixture_argv(image_folder, fresh)) == 0
    after = torch.load(resumed / "last.pt", map_location="cpu", weights_only=True)
    reference = torch.load(fresh / "last.pt", map_location="cpu", weights_only=True)
    assert sorted(after) == CHECKPOINT_KEYS
    assert after["optimizer_steps"] == reference["optimizer_steps"] == 10
    assert after["config"] == old["config"] == reference["config"]  # the record is the same ...
    assert after["fingerprint"] == old["fingerprint"] == reference["fingerprint"]  # ... and so is its hash
    for key, value in reference["model"].items():
        assert torch.equal(after["model"][key], value), key
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["fingerprint"] == old["fingerprint"]
    assert [entry["epoch"] for entry in metrics["epochs"]] == [1, 2]


# ----------------------------------------------------------------------------------------------------------
# Every flag of --help, and what parsing makes of it
# ----------------------------------------------------------------------------------------------------------
FLAGS = ["--activation-checkpointing", "--allreduce", "--amp", "--async-checkpoint", "--augment", "--backend",
         "--batch-size", "--betas",
         "--bucket-mb", "--channels-last", "--checkpoint-dir", "--checkpoint-every", "--clip-grad-norm", "--commit-log",
         "--compile", "--compile-backend", "--context", "--coordinator", "--data-dir", "--dataset", "--decay-steps",
         "--deterministic", "--device", "--dropout", "--epochs", "--eval-batch-size", "--eval-every", "--eval-only",
         "--fault-timeout",
         "--fragments", "--generate", "--grad-accum", "--grad-sync", "--help", "--image-size", "--init-from",
         "--keep-checkpoints",
         "--local-steps",
         "--log-dir", "--log-every", "--lr", "--malloc-mmap-threshold", "--max-steps", "--metrics-out", "--min-lr",
         "--min-replica-groups", "--model", "--momentum", "--muon-lr",
         "--muon-momentum", "--muon-weight-decay", "--norm", "--norm-weight-decay", "--offload", "--offload-dir",
         "--optimizer", "--outer-compress",
         "--outer-delay", "--outer-lr", "--outer-momentum", "--outer-optimizer", "--param-dtype", "--profile",
         "--profile-steps", "--prompt", "--reduce-dtype", "--replica-group", "--replica-groups", "--replicas",
         "--scheduler", "--seed", "--sync-mode",
         "--temperature", "--timeout", "--top-k",
         "--train-size", "--val-fraction", "--val-size", "--warm-restarts", "--warmup-steps", "--weight-decay",
         "--workers", "--zero", "--zero3-accumulate"]

DEFAULTS = {  # vars(parse_args([])): also the metrics JSON's "config"
    "dataset": "cifar100", "data_dir": "data", "train_size": 10000, "val_size": 2000, "image_size": 32,
    "augment": "cifar", "workers": 0, "context": None, "val_fraction": 0.1, "model": "net", "channels_last": False,
    "activation_checkpointing": False, "compile": None, "compile_backend": "inductor", "dropout": 0.5,
    "grad_sync": "custom", "replicas": None,
    "local_steps": None, "outer_optimizer": None, "outer_lr": None, "outer_momentum": None, "outer_compress": None,
    "fragments": None, "outer_delay": None, "zero": 0, "zero3_accumulate": "sharded", "offload": None,
    "offload_dir": None, "param_dtype": None,
    "reduce_dtype": None, "optimizer": "sgd",
    "allreduce": "torch", "sync_mode": "overlap", "bucket_mb": 25.0, "norm": "custom", "grad_accum": 1,
    "batch_size": 128, "epochs": 10, "max_steps": 0, "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0005,
    "betas": None, "muon_lr": None, "muon_momentum": None, "muon_weight_decay": None,
    "norm_weight_decay": None, "clip_grad_norm": None, "scheduler": "none", "warmup_steps": None,
    "min_lr": None, "decay_steps": None, "amp": "off", "device": "auto", "backend": "auto", "seed": 0,
    "deterministic": False, "checkpoint_dir": None, "init_from": None, "checkpoint_every": 0, "keep_checkpoints": 1,
    "async_checkpoint": False,
    "replica_group": None,
    "replica_groups": None, "coordinator": None, "min_replica_groups": 1, "fault_timeout": 60.0, "commit_log": None,
    "warm_restarts": False, "eval_only": False, "generate": None,
    "prompt": "", "temperature": 0.8, "top_k": None, "log_dir": None, "log_every": 10, "profile": None,
    "profile_steps": (3, 6), "metrics_out": None, "eval_every": 0, "eval_batch_size": 128, "timeout": 1800.0,
    "malloc_mmap_threshold": 128}
DILOCO_DEFAULTS = {"local_steps": 50, "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9,
                   "outer_compress": "none", "fragments": 1, "outer_delay": 0}
PARSED = [  # argv, what differs from DEFAULTS after parsing
    ([], {}),
    (["--batch-size", "4"], dict(batch_size=4, eval_batch_size=4)),  # evaluation's default: the micro-batch
    (["--batch-size", "4", "--eval-batch-size", "32"], dict(batch_size=4, eval_batch_size=32)),
    (["--dataset", "text", "--model", "gpt", "--replica-group", "1", "--replica-groups", "3", "--coordinator",
      "host:29400", "--min-replica-groups", "2", "--fault-timeout", "5", "--commit-log", "log"],
     dict(dataset="text", model="gpt", data_dir="TEXT", image_size=None, augment="none", context=128,
          replica_group=1, replica_groups=3, coordinator="host:29400", min_replica_groups=2, fault_timeout=5.0,
          commit_log="log")),
    (["--dataset", "text", "--model", "gpt"], dict(dataset="text", model="gpt", data_dir="TEXT", image_size=None,
                                                   augment="none", context=128)),
    (["--dataset", "imagefolder"], dict(dataset="imagefolder", image_size=224, augment="imagenet")),
    (["--dataset", "synthetic"], dict(dataset="synthetic", augment="none")),
    (["--dataset", "synthetic", "--grad-sync", "diloco"], dict(dataset="synthetic", augment="none",
                                                               grad_sync="diloco", **DILOCO_DEFAULTS)),
    (["--grad-sync", "localsgd"], dict(grad_sync="localsgd", **dict(DILOCO_DEFAULTS, outer_optimizer="sgd",
                                                                     outer_lr=1.0, outer_momentum=0.0))),
    (["--zero", "3", "--profile", "p", "--profile-steps", "0:2", "--betas", "0.9", "0.95", "--optimizer", "adamw"],
     dict(zero=3, profile="p", profile_steps=(0, 2), betas=[0.9, 0.95], optimizer="adamw")),
    (["--grad-sync", "custom", "--zero", "3", "--zero3-accumulate", "unsharded"],
     dict(zero=3, zero3_accumulate="unsharded")),
    (["--zero", "2", "--replicas", "2", "--param-dtype", "bf16", "--reduce-dtype", "fp32"],
     dict(zero=2, replicas=2, param_dtype="bf16", reduce_dtype="fp32")),
    (["--grad-sync", "fsdp", "--zero", "3", "--replicas", "2", "--param-dtype", "bf16"],
     dict(grad_sync="fsdp", zero=3, replicas=2, param_dtype="bf16")),
    (["--dataset", "text", "--model", "gpt", "--optimizer", "muon", "--betas", "0.9", "0.95"],  # Muon's defaults
     dict(dataset="text", model="gpt", data_dir="TEXT", image_size=None, augment="none", context=128,
          optimizer="muon", betas=[0.9, 0.95], muon_lr=0.02, muon_momentum=0.95, muon_weight_decay=0.01)),
    (["--model", "vit", "--optimizer", "muon", "--muon-lr", "0.05", "--muon-momentum", "0.9", "--muon-weight-decay",
      "0"], dict(model="vit", optimizer="muon", muon_lr=0.05, muon_momentum=0.9, muon_weight_decay=0.0)),
]


def test_help_lists_every_flag(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no flag cut by a line's end
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        trainer.parse_args(["--help"])
    assert sorted(set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", out.getvalue()))) == FLAGS


@pytest.mark.parametrize("argv,changed", PARSED, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_every_flag_parses_to_its_pinned_value(argv, changed):
    expected = dict(DEFAULTS, **changed)
    if expected["data_dir"] == "TEXT":
        expected["data_dir"] = data.default_text_dir()
    parsed = vars(trainer.parse_args(argv))
    assert parsed == expected
    assert list(parsed) == list(DEFAULTS)  # the metrics JSON's "config" keeps its order too


# ----------------------------------------------------------------------------------------------------------
# One-line errors and exit codes
# ----------------------------------------------------------------------------------------------------------
REPLICA_GROUP_0 = ["--dataset", "text", "--model", "gpt", "--replica-group", "0", "--replica-groups", "2",
                   "--coordinator", "h:29400"]  # group 0 of 2: the replica groups' refusals below
ERRORS = [
    (["--grad-accum", "0"], "--grad-accum must be positive, got 0"),
    (["--batch-size", "0"], "--batch-size must be positive, got 0"),
    (["--epochs", "0"], "--epochs must be positive, got 0"),
    (["--train-size", "0"], "--train-size must be positive, got 0"),
    (["--val-size", "0"], "--val-size must be positive, got 0"),
    (["--lr", "0"], "--lr must be positive, got 0.0"),
    (["--bucket-mb", "0"], "--bucket-mb must be positive, got 0.0"),
    (["--timeout", "0"], "--timeout must be positive, got 0.0"),
    (["--log-every", "0"], "--log-every must be positive, got 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be positive, got 0"),
    (["--keep-checkpoints", "2"], "--keep-checkpoints 2 is for the syncs that write folders DIR/step-N (--grad-sync "
                                  "custom --zero 1-3, fsdp); --grad-sync custom --zero 0 writes one DIR/last.pt, "
                                  "replaced at every save"),  # (was silently ignored)
    (["--async-checkpoint"], "--async-checkpoint saves into --checkpoint-dir: give one"),
    (["--eval-batch-size", "0"], "--eval-batch-size must be positive, got 0"),
    (["--max-steps", "-1"], "--max-steps must not be negative, got -1"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must not be negative, got -1"),
    (["--momentum", "-1"], "--momentum must not be negative, got -1.0"),
    (["--eval-every", "-1"], "--eval-every must not be negative, got -1"),
    (["--weight-decay", "-1"], "--weight-decay must not be negative, got -1.0"),
    (["--norm-weight-decay", "-1"], "--norm-weight-decay must not be negative, got -1.0"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be positive, got 0.0"),
    (["--betas", "0.9", "0.95"],
     "--betas is AdamW's (--optimizer adamw, or muon's AdamW), two numbers in [0, 1), got [0.9, 0.95]"),
    (["--optimizer", "adamw", "--betas", "1", "0.9"],
     "--betas is AdamW's (--optimizer adamw, or muon's AdamW), two numbers in [0, 1), got [1.0, 0.9]"),
    (["--muon-lr", "0.02"], "--muon-lr is for --optimizer muon"),
    (["--optimizer", "adamw", "--muon-weight-decay", "0"], "--muon-weight-decay is for --optimizer muon"),
    (["--optimizer", "muon"], "--optimizer muon is for the transformers (--model gpt..., vit...): Muon takes the 2-D "
                              "matrices inside their blocks, and --model net has none (its blocks are convolutions, "
                              "4-D, or it has no blocks)"),
    (["--model", "vit", "--optimizer", "muon", "--scheduler", "onecycle"],
     "--scheduler onecycle takes one maximal rate and cycles one kind of momentum; --optimizer muon's Muon and AdamW "
     "take --scheduler cosine or none (the same factor on both rates)"),
    (["--model", "vit", "--optimizer", "muon", "--muon-momentum", "1"],
     "--muon-lr must be positive, --muon-momentum in [0, 1) and --muon-weight-decay not negative, got 0.02, 1.0 and "
     "0.01"),
    (["--warmup-steps", "3"], "--warmup-steps is for --scheduler cosine"),
    (["--min-lr", "0.1"], "--min-lr is for --scheduler cosine"),
    (["--decay-steps", "5"], "--decay-steps is for --scheduler cosine"),
    (["--scheduler", "cosine", "--warmup-steps", "-1"], "--warmup-steps must not be negative, got -1"),
    (["--scheduler", "cosine", "--decay-steps", "3", "--warmup-steps", "3"],
     "--decay-steps 3 must be above --warmup-steps 3"),
    (["--scheduler", "cosine", "--min-lr", "1"], "--min-lr 1.0 is above --lr 0.05"),
    (["--generate", "0"], "--generate N takes N >= 1 and --checkpoint-dir (the run whose checkpoint to sample)"),
    (["--generate", "5"], "--generate N takes N >= 1 and --checkpoint-dir (the run whose checkpoint to sample)"),
    (["--generate", "5", "--checkpoint-dir", "d", "--temperature", "0"],
     "--temperature must be positive and --top-k at least 1, got 0.0 and None"),
    (["--generate", "5", "--checkpoint-dir", "d", "--top-k", "0"],
     "--temperature must be positive and --top-k at least 1, got 0.8 and 0"),
    (["--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
    (["--local-steps", "5"], "--local-steps is for --grad-sync diloco or localsgd"),
    (["--grad-sync", "localsgd", "--outer-lr", "0.5"],
     "--outer-lr is diloco's: localsgd averages the weights (outer SGD, lr 1, no momentum)"),
    (["--grad-sync", "diloco", "--replicas", "0"], "--replicas must be positive, got 0"),
    (["--grad-sync", "diloco", "--local-steps", "4", "--fragments", "5"],
     "--fragments 5 must be between 1 and --local-steps 4"),
    (["--grad-sync", "diloco", "--local-steps", "4", "--fragments", "2", "--outer-delay", "3"],
     "--outer-delay 3 must be between 0 and --local-steps / --fragments = 2 (one fragment in flight at a time)"),
    (["--grad-sync", "diloco", "--outer-lr", "0"],
     "--outer-lr must be positive and --outer-momentum not negative, got 0.0 and 0.9"),
    (["--grad-sync", "ddp", "--allreduce", "ring"],
     "--allreduce ring is for --grad-sync custom (ddp uses its own collectives)"),
    (["--grad-sync", "fsdp"],
     "--grad-sync fsdp takes --zero 2 (no reshard after forward) or 3 (reshard after forward), got --zero 0"),
    (["--grad-sync", "ddp", "--zero", "2"],
     "--grad-sync ddp takes --zero 0 or 1 (ZeroRedundancyOptimizer); --zero 2 is --grad-sync custom"),
    (["--zero", "1", "--allreduce", "butterfly"],
     "--zero 1 runs on reduce-scatter and all-gather: --allreduce torch or ring (the butterfly has no halves here)"),
    (["--zero", "2", "--sync-mode", "after"],
     "--zero 2 reduce-scatters gradients as backward completes them; --sync-mode after would keep every full "
     "gradient (use --zero 1)"),
    (["--compile", "forward", "--zero", "3"],
     "--compile forward does not take --zero 3 (--grad-sync custom): its parameters are gathered in the blocks' "
     "module hooks, which compiling the model's forward would trace; --compile blocks leaves them outside the "
     "graphs"),
    (["--compile", "--grad-sync", "ddp", "--bucket-mb", "0.5"],
     "--compile with --grad-sync ddp takes --bucket-mb 1 or more, not 0.5: torch's DDPOptimizer splits the "
     "compiled graph at DDP's buckets and requires the first (1 MB) to be no larger than the others"),
    (["--zero3-accumulate", "unsharded"],
     "--zero3-accumulate is for --grad-sync custom --zero 3, not --grad-sync custom --zero 0"),
    (["--offload", "disk"], "--offload is for --grad-sync custom --zero 1-3 (the sharded stages' state), not "
                            "--grad-sync custom --zero 0"),
    (["--zero", "3", "--offload", "disk"], "--offload disk needs --offload-dir PATH, a folder on a disk for the "
                                           "offload files"),
    (["--offload-dir", "x"], "--offload-dir is where --offload disk keeps the state: give --offload disk"),
    (["--zero", "2", "--offload", "cpu", "--offload-dir", "x"],
     "--offload cpu keeps the state in host memory; --offload-dir is for --offload disk"),
    (["--zero", "3", "--offload", "disk", "--offload-dir", "x", "--checkpoint-dir", "c", "--async-checkpoint"],
     "--offload does not take --async-checkpoint: it stages the whole state in memory to write it"),
    (["--zero", "3", "--offload", "disk", "--offload-dir", "x", "--amp", "fp16"],
     "--offload does not take --amp fp16: its scaler unscales the gradients in memory, where --zero 3 with offload "
     "keeps them on the disk"),
    (["--zero", "3", "--offload", "disk", "--offload-dir", "x", "--zero3-accumulate", "unsharded"],
     "--offload does not take --zero3-accumulate unsharded: it keeps every unit's full gradient in memory over the "
     "window"),
    (["--profile-steps", "1:3"], "--profile-steps is for --profile DIR"),
    (["--profile", "p", "--profile-steps", "3"], "--profile-steps takes A:B, optimizer steps with 0 <= A < B, got '3'"),
    (["--profile", "p", "--profile-steps", "4:4"],
     "--profile-steps takes A:B, optimizer steps with 0 <= A < B, got '4:4'"),
    (["--profile", "p", "--profile-steps", "a:b"],
     "--profile-steps takes A:B, optimizer steps with 0 <= A < B, got 'a:b'"),
    (["--workers", "-1"], "--workers must not be negative, got -1"),
    (["--dataset", "text"], "--model net does not take --dataset text: the GPTs (gpt, gpt-tiny, gpt2, gpt2-medium, "
                            "gpt2-large, gpt2-xl) train on --dataset text, the image models on images"),
    (["--model", "gpt"], "--model gpt does not take --dataset cifar100: the GPTs (gpt, gpt-tiny, gpt2, gpt2-medium, "
                         "gpt2-large, gpt2-xl) train on --dataset text, the image models on images"),
    (["--context", "5"], "--context and --val-fraction are for --dataset text"),
    (["--val-fraction", "0.2"], "--context and --val-fraction are for --dataset text"),
    (["--dataset", "text", "--model", "gpt", "--augment", "none"], "--augment is for image sets, not --dataset text"),
    (["--dataset", "text", "--model", "gpt", "--image-size", "8"],
     "--image-size is for image sets, not --dataset text"),
    (["--dataset", "text", "--model", "gpt", "--workers", "2"], "--workers is for image sets, not --dataset text"),
    (["--dataset", "text", "--model", "gpt", "--val-fraction", "1"],
     "--context must be positive and --val-fraction in (0, 1), got 128 and 1.0"),
    (["--dataset", "imagefolder", "--image-size", "9"], "--image-size must be at least 10 for --model net, got 9"),
    (["--dataset", "imagefolder", "--model", "resnet", "--image-size", "0"],
     "--image-size must be at least 1 for --model resnet, got 0"),
    (["--augment", "imagenet"], "--augment imagenet is for --dataset imagefolder; in-memory sets take cifar or none"),
    (["--image-size", "16"], "--image-size is for --dataset imagefolder (cifar100 images are 32 pixels)"),
    (["--workers", "2"], "--workers is for --dataset imagefolder (cifar100 sits in memory)"),
    (["--init-from", "no-such-file"], "--init-from no-such-file: no such file or folder"),
    # the replica groups' flags: each bad value in one line at parse time, not a traceback minutes later
    (["--dataset", "text", "--model", "gpt", "--replica-group", "0", "--replica-groups", "0", "--coordinator",
      "h:29400"], "--replica-groups must be positive, got 0"),
    ([*REPLICA_GROUP_0, "--fault-timeout", "inf"],
     "--fault-timeout must be positive and at most 86400 s, got inf"),
    ([*REPLICA_GROUP_0, "--fault-timeout", "nan"],
     "--fault-timeout must be positive and at most 86400 s, got nan"),
    ([*REPLICA_GROUP_0, "--fault-timeout", "0"],
     "--fault-timeout must be positive and at most 86400 s, got 0.0"),
    (["--dataset", "text", "--model", "gpt", "--replica-group", "0", "--replica-groups", "2", "--coordinator",
      "h:99999"], "--coordinator's port must be between 1 and 65535, got 99999"),
    (["--dataset", "text", "--model", "gpt", "--replica-group", "0", "--replica-groups", "2", "--coordinator",
      "h:0"], "--coordinator's port must be between 1 and 65535, got 0"),
    ([*REPLICA_GROUP_0, "--commit-log", "/no/such/dir/x.jsonl"],
     "--commit-log /no/such/dir/x.jsonl: no such folder /no/such/dir"),
    ([*REPLICA_GROUP_0, "--commit-log", "/tmp"],
     "--commit-log /tmp is a folder: give the path of a file (this group's log)"),
    (["--dataset", "text", "--model", "gpt-tiny", "--context", "0"],  # not the model's context, in silence
     "--context must be positive and --val-fraction in (0, 1), got 0 and 0.1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--zero", "4"], "argument --zero: invalid choice: 4 (choose from 0, 1, 2, 3)"),
    # after parsing: before the process group, at set-up, before the first step
    (["--norm", "torch", "--device", "cpu"],
     "--norm torch (nn.SyncBatchNorm) needs CUDA: use --device cuda (with a GPU), or --norm custom or --norm local "
     "on the CPU"),
    (["--generate", "5", "--checkpoint-dir", "no-such-dir"],
     "--generate: no checkpoint in no-such-dir (neither last.pt nor latest)"),
    (["--device", "cpu", "--dataset", "synthetic", "--train-size", "16", "--val-size", "8", "--batch-size", "8",
      "--grad-sync", "diloco", "--replicas", "2"], "--replicas 2 does not divide the 1 processes into equal replicas"),
    (["--device", "cpu", "--dataset", "synthetic", "--train-size", "16", "--val-size", "8", "--batch-size", "8",
      "--epochs", "1", "--profile", "PROFILE", "--profile-steps", "2:3"],
     "--profile-steps 2:3 starts past this run's 2 optimizer steps"),
    (["--device", "cpu", "--dataset", "synthetic", "--train-size", "5", "--val-size", "4", "--batch-size", "4"],
     "5 training samples over 1 process(es) give each 5 an epoch, which --batch-size 4 cuts into a last micro-batch "
     "of one sample: --model net's BatchNorm cannot take its statistics over one sample (--norm custom); choose a "
     "--batch-size (or a training set) that leaves 2 or more"),
]


@pytest.mark.parametrize("argv,message", ERRORS, ids=[" ".join(argv) for argv, _ in ERRORS])
def test_each_error_is_one_pinned_line_and_exit_code_2(argv, message, capsys, tmp_path):
    argv = [str(tmp_path / "p") if value == "PROFILE" else value for value in argv]
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"ddp_cifar100.py: error: {message}\n"


# ----------------------------------------------------------------------------------------------------------
# Two ranks: the metrics JSON's keys, the profiler's ranges and the collectives' order
# ----------------------------------------------------------------------------------------------------------
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "scatter", "gather", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor", "broadcast_object_list", "gather_object", "all_gather_object", "barrier",
               "send", "recv", "isend", "irecv")


def recording_collectives(rank, world_size, argv):
    """train() with every torch.distributed collective the trainer and the library call recorded by name, in
    order (all_reduce with its op), on this rank; the metrics without the model."""
    from trainer_testing import train_in_group

    calls, real = [], {name: getattr(dist, name) for name in COLLECTIVES}

    def recorder(name):
        def call(*args, **kwargs):
            op = kwargs.get("op", args[1] if name == "all_reduce" and len(args) > 1 else None)
            calls.append(f"{name} {str(op).split('.')[-1]}" if name == "all_reduce" else name)
            return real[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, recorder(name))
    try:
        metrics = train_in_group(rank, world_size, argv)["metrics"]
    finally:
        for name, function in real.items():
            setattr(dist, name, function)
    return {"calls": calls, "metrics": metrics}


TWO_RANKS = ["--device", "cpu", "--dataset", "synthetic", "--train-size", "32", "--val-size", "12", "--batch-size",
             "4", "--grad-accum", "2", "--epochs", "2", "--checkpoint-every", "1", "--timeout", "60"]
RUNS = {"custom": ["--max-steps", "3"],
        "localsgd": ["--grad-sync", "localsgd", "--local-steps", "2", "--max-steps", "3", "--eval-every", "2"],
        "text": ["--dataset", "text", "--model", "gpt-tiny", "--context", "16", "--val-fraction", "0.3", "--data-dir",
                 "CORPUS", "--max-steps", "3"]}

MAX, SUM = "all_reduce MAX", "all_reduce SUM"
CLOSING = {  # from the last validation's scatter to the end of train(): validation, then the summary's figures
    # (the peak memory, each rank's peaks per phase, the state's bytes, ..., each step's loss)
    "custom": ["scatter", "reduce", "reduce", MAX, "all_gather_object", MAX, MAX, MAX, MAX, MAX, "all_gather_object"],
    "localsgd": ["scatter", "reduce", "reduce", MAX, "all_gather_object", MAX, MAX, MAX, MAX, MAX, MAX,
                 "all_gather_object"],
    "text": ["scatter", "reduce", "reduce", MAX, "all_gather_object", MAX, MAX, MAX, MAX, MAX, "all_gather_object"],
}
METRICS_KEYS = [
    "backend", "checkpoint_final_wait_s", "checkpoint_stalls_s", "compile", "config", "data_parallel_bytes_per_step", "data_parallel_sent_bytes",
    "data_wait_ms_median", "device", "epochs", "evals", "fingerprint", "first_step", "gathered_peak", "grad_norms",
    "machine", "memory_by_phase_mb", "micro_batches", "num_classes", "offload", "optimizer_steps", "peak_memory_mb",
    "samples_per_s", "sent_bytes", "sent_bytes_per_step", "state_bytes", "step_losses", "step_time_ms_mean",
    "step_time_ms_median",
    "step_time_ms_p10",
    "step_time_ms_p90", "step_time_warmup_steps", "step_times_ms", "train_loss", "train_time_s",
    "trainable_parameters", "val_acc", "val_acc5", "val_correct", "val_correct5", "val_loss", "val_total",
    "wall_time_s", "world_size"]
EXTRA_KEYS = {"custom": [], "localsgd": ["model_bytes", "outer_all_reduces", "peak_in_flight_bytes"],
              "text": ["tokens_per_s", "val_bits_per_byte", "val_gzip_bits_per_byte", "val_unigram_bits_per_byte"]}
EPOCH_KEYS = ["epoch", "epoch_time_s", "lr", "optimizer_steps", "samples_per_s", "train_acc",
              "train_loss", "val_acc", "val_acc5", "val_correct", "val_correct5", "val_loss", "val_total"]


@pytest.fixture(scope="module")
def two_rank_runs(local_group, tmp_path_factory):
    out = tmp_path_factory.mktemp("pins")
    for i in range(6):  # the text run's corpus: whole words, 2 kB a file
        words = " ".join(f"word{(i * 7 + j * j) % 50}" for j in range(400))
        (out / "corpus").mkdir(exist_ok=True)
        (out / "corpus" / f"doc{i}.txt").write_text(words[:2000])
    runs = {}
    for name, flags in RUNS.items():
        flags = [str(out / "corpus") if flag == "CORPUS" else flag for flag in flags]
        argv = TWO_RANKS + flags + ["--checkpoint-dir", str(out / name), "--profile", str(out / f"{name}-trace"),
                                    "--profile-steps", "0:2"]
        runs[name] = local_group(2).run(recording_collectives, argv)
        runs[name + "-trace"] = json.loads((out / f"{name}-trace" / "rank0.pt.trace.json").read_text())
    return runs


@pytest.mark.parametrize("name", RUNS)
def test_collectives_come_in_one_order_on_every_rank(two_rank_runs, name):
    first, second = (result["calls"] for result in two_rank_runs[name])
    assert first == second
    closing = first[len(first) - 1 - first[::-1].index("scatter"):]
    assert closing == CLOSING[name]


@pytest.mark.parametrize("name", RUNS)
def test_metrics_json_keys(two_rank_runs, name):
    metrics = two_rank_runs[name][0]["metrics"]
    assert sorted(metrics) == sorted(METRICS_KEYS + EXTRA_KEYS[name])
    assert list(metrics["config"]) == list(DEFAULTS)
    assert sorted(metrics["state_bytes"]) == ["grads", "optimizer", "params"]
    phases = metrics["memory_by_phase_mb"]  # every rank's peak per phase, the phases this run went through
    assert {"build", "steps", "evaluation"} <= set(phases)
    assert all(len(peaks) == metrics["world_size"] for peaks in phases.values())
    assert all(peak >= 0 for peaks in phases.values() for peak in peaks)
    epoch_keys = sorted(EPOCH_KEYS + (["tokens_per_s", "val_bits_per_byte"] if name == "text" else []))
    completed = [] if name == "text" else [epoch_keys]  # text: 32 steps an epoch; the images: 2
    assert [sorted(entry) for entry in metrics["epochs"]] == completed + [sorted(epoch_keys + ["complete"])]
    if name == "localsgd":
        assert [sorted(entry) for entry in metrics["evals"]] == [
            ["sent_bytes", "step", "time_s", "val_acc", "val_acc5", "val_correct", "val_correct5", "val_loss",
             "val_total"]]
        assert sorted(metrics["outer_all_reduces"][0]) == ["bytes", "delay_steps", "elements", "fragment", "step",
                                                            "wait_ms"]


@pytest.mark.parametrize("name", RUNS)
def test_profiler_ranges_the_benchmarks_read(two_rank_runs, name):
    names = [r["name"] for r in named_ranges(two_rank_runs[name + "-trace"])]
    for expected in ("ProfilerStep#0", "ProfilerStep#1", "micro-batch 1/2 (no sync)", "micro-batch 2/2 (sync)",
                     "forward", "backward", "optimizer step"):
        assert expected in names
    assert names.count("optimizer step") == 2 and names.count("forward") == names.count("backward") == 4
    assert ("outer step" in names) == (name == "localsgd")


if __name__ == "__main__":  # write the fixture's run to DIR/last.pt (see the module docstring)
    import tempfile

    from benchmarks import make_image_folder

    with tempfile.TemporaryDirectory() as folder:  # conftest.py's image folder
        make_image_folder.write_image_folder(folder, classes=8, train_size=40, val_size=23, size=20, seed=3)
        with open(os.path.join(folder, "train", "class000", "notes.txt"), "w") as f:
            f.write("not an image: skipped, as ImageFolder does")
        sys.exit(trainer.main(fixture_argv(folder, sys.argv[1], "--max-steps", "7")))
