"""The trainer's configuration: one frozen dataclass, ``Config``, whose fields are the command line's flags.

Each field holds its default and its flag's help beside it (``flag``); ``parse_args`` builds the parser from the
fields, so --help shows every flag with its default, then checks every flag against the others once, in one line
each (``UsageError``), and fills in the defaults that depend on other flags (the data's, diloco's) before the
Config is made. Nothing changes it afterwards: what the loop reads is what --help describes. ``vars(config)`` is
the metrics JSON's "config", with the names and values the flags have had since they were added.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from data import default_text_dir
from models import GPT_SIZES, LANGUAGE_MODELS, MODELS, TORCHVISION_VITS
from utils import UsageError

WARMUP_STEPS = 3  # optimizer steps left out of the step-time statistics (allocator and autograd warm-up)
PROFILE_STEPS = (WARMUP_STEPS, WARMUP_STEPS + 3)  # --profile's default window: 3 steps after the warm-up
OURS = ("custom", "diloco", "localsgd")  # the syncs built on zero.shard
OUTER_SYNCS = ("diloco", "localsgd")  # replicas meeting through an outer step (diloco.py)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --param-dtype, --reduce-dtype
COMPILE_SCOPES = ("forward", "blocks")  # what --compile compiles: the model's forward, or each block's
DATASET_DEFAULTS = {  # the flags whose default depends on --dataset (text: the standard library's source, and
    # --context the model's: models.GPT_SIZES)
    "cifar100": {"data_dir": "data", "augment": "cifar", "image_size": 32},
    "synthetic": {"data_dir": "data", "augment": "none", "image_size": 32},
    "imagefolder": {"data_dir": "data", "augment": "imagenet", "image_size": 224},
    "text": {"data_dir": None, "augment": "none", "image_size": None},
}
DILOCO_DEFAULTS = {"local_steps": 50, "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9,
                   "outer_compress": "none", "fragments": 1, "outer_delay": 0}
LOCALSGD = {"outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0}  # averaging the weights: outer SGD
DILOCO_FLAGS = ("grad_sync", "replicas", *DILOCO_DEFAULTS)  # what a diloco checkpoint records of the outer loop
# --optimizer muon's flags and their defaults ([Note: Muon's defaults]); the models whose blocks hold hidden 2-D
# matrices for it (the transformers: a ResNet's blocks are convolutions, 4-D, which torch.optim.Muon does not take)
MUON_DEFAULTS = {"muon_lr": 0.02, "muon_momentum": 0.95, "muon_weight_decay": 0.01}
MUON_MODELS = (*LANGUAGE_MODELS, "vit", *TORCHVISION_VITS)
NORM_TORCH_ON_CPU = ("--norm torch (nn.SyncBatchNorm) needs CUDA: use --device cuda (with a GPU), or --norm custom "
                     "or --norm local on the CPU")
DESCRIPTION = ("Data-parallel training of image classifiers and byte-level GPTs: hand-written gradient averaging and "
               "ZeRO sharding\nnext to PyTorch's DistributedDataParallel, ZeroRedundancyOptimizer and FSDP2, on "
               "CIFAR-100, a synthetic set, any\nimage folder up to ImageNet scale, or text.")


def flag(default: Any, help: str | None = None, **options: Any) -> Any:  # noqa: A002 (argparse's name)
    """A field of Config and its flag: the default, the help, argparse's other options. ``resolved=True``: the
    default depends on other flags (the field's default is the one of a bare command line), so the parser keeps
    None for "not given" and parse_args fills it in."""
    return field(default=default, metadata={"help": help, **options})


def diloco_help(text: str, key: str) -> str:
    return f"{text} (default {DILOCO_DEFAULTS[key]})"


@dataclass(frozen=True)
class Config:
    """Every flag of ddp_cifar100.py, in --help's order, with its value after parsing."""
    dataset: str = flag("cifar100", choices=("cifar100", "synthetic", "imagefolder", "text"),
                        help="imagefolder: DIR/train/<class>/* and DIR/val/<class>/* (torchvision's ImageFolder "
                             "layout); text: every text file under DIR as bytes, split by file into training and "
                             "validation (--model gpt)")
    data_dir: str = flag("data", resolved=True,
                         help="where CIFAR-100 is (or is downloaded to by local rank 0; default ./data), the image "
                              "folder, or the text folder (default: the Python standard library's source)")
    train_size: int = flag(10000, type=int, help="synthetic training set size")
    val_size: int = flag(2000, type=int, help="synthetic validation set size")
    image_size: int | None = flag(32, type=int, resolved=True,
                                  help=f"imagefolder: side of the crops (default "
                                       f"{DATASET_DEFAULTS['imagefolder']['image_size']}; in-memory sets: 32)")
    augment: str = flag("cifar", choices=("imagenet", "cifar", "none"), resolved=True,
                        help="training augmentation: imagenet = RandomResizedCrop + flip (validation: Resize + "
                             "CenterCrop), cifar = RandomCrop with padding S/8 + flip; default " + ", ".join(
                                 f"{chosen['augment']} for {dataset}" for dataset, chosen in DATASET_DEFAULTS.items()
                                 if dataset != "text"))
    workers: int = flag(0, type=int, help="imagefolder: DataLoader processes that decode and augment")
    context: int | None = flag(None, type=int, resolved=True,
                               help="text: bytes per window, the GPT's context (default: the model's, 128 for gpt, 64 "
                                    "for gpt-tiny, 1024 for gpt2)")
    val_fraction: float = flag(0.1, type=float,
                               help="text: the share of the bytes, in whole files chosen by a hash of their path, kept "
                                    "for validation")
    model: str = flag("net", choices=MODELS,
                      help="net, resnet and vit: small models for 32-pixel images; resnet18..., vit_b_16...: "
                           "torchvision's (weights=None; a ViT takes --image-size, which its patch size must divide); "
                           "gpt (1.3M parameters), gpt-tiny (0.12M), gpt2, gpt2-medium, gpt2-large and gpt2-xl "
                           "(GPT-2's shapes with 256 bytes for vocabulary: 86M, 303M, 709M, 1478M): byte-level GPTs "
                           "for --dataset text")
    channels_last: bool = flag(False, help="model and batches in channels-last memory format")
    activation_checkpointing: bool = flag(False, help="torch.utils.checkpoint (non-reentrant) around each block "
                                                      "(models.blocks: the units --zero 3 gathers): its activations "
                                                      "recomputed in its backward instead of kept")
    compile: str | None = flag(None, nargs="?", const="forward", choices=COMPILE_SCOPES,
                               help="torch.compile at the first call, hooks left eager: the model's forward as one "
                                    "graph (forward, the default; SyncBatchNorm compiles without a graph break; the "
                                    "hand-written sync's bucket all-reduces then wait for the whole backward), or each "
                                    "block's forward apart (blocks: a backward per block, so the buckets overlap the "
                                    "backward again; takes --zero 3)")
    compile_backend: str = flag("inductor", metavar="NAME",
                                help="--compile's backend: inductor (default), aot_eager (no code generation: the "
                                     "tests'), eager")
    dropout: float = flag(0.5, type=float, help="net: dropout2 rate, dropout1 gets half (0 disables both)")
    grad_sync: str = flag("custom", choices=("custom", "ddp", "fsdp", *OUTER_SYNCS),
                          help="custom: zero/, by hand; ddp: DistributedDataParallel; fsdp: FSDP2's "
                               "fully_shard on the model's blocks and the root (with --zero 2 or 3); diloco: "
                               "--replicas that train alone (custom inside each, --zero 0-3) and meet every "
                               "--local-steps through an outer optimizer (diloco.py); localsgd: the same, meeting by "
                               "averaging their weights")
    replicas: int | None = flag(None, type=int, metavar="R",
                                help="diloco, localsgd: the number of replicas, each of W/R processes (default: one "
                                     "process each); custom --zero 1-3 and fsdp: hybrid sharding on a 2-D mesh "
                                     "(replicate, shard), the state sharded over W/R consecutive processes and "
                                     "replicated over R, the replicas meeting every step (FSDP2's HSDP; default: "
                                     "one replica)")
    local_steps: int | None = flag(None, type=int, metavar="H", resolved=True, help=diloco_help(
        "diloco, localsgd: inner optimizer steps between two meetings of the replicas", "local_steps"))
    outer_optimizer: str | None = flag(None, choices=("sgd", "nesterov"), resolved=True,
                                       help="diloco: SGD on the averaged pseudo-gradient, with Nesterov momentum "
                                            "(default, the paper's) or heavy-ball momentum")
    outer_lr: float | None = flag(None, type=float, resolved=True,
                                  help=diloco_help("diloco: the outer learning rate", "outer_lr"))
    outer_momentum: float | None = flag(None, type=float, resolved=True,
                                        help=diloco_help("diloco: the outer momentum", "outer_momentum"))
    outer_compress: str | None = flag(None, choices=("none", "bf16", "int8", "int4"), resolved=True, help=diloco_help(
        "diloco, localsgd: how the outer all-reduce's messages travel on the ring: float32, bfloat16, or "
        "int8/int4 codes with a float32 scale per 256 values; with error feedback", "outer_compress"))
    fragments: int | None = flag(None, type=int, metavar="F", resolved=True, help=diloco_help(
        "diloco, localsgd: streaming: the parameters in F runs, meeting at staggered steps", "fragments"))
    outer_delay: int | None = flag(None, type=int, metavar="D", resolved=True,
                                   help="diloco, localsgd: inner steps an outer all-reduce runs on its thread "
                                        "before it is applied, the progress made meanwhile kept (default 0: at once; "
                                        "at most --local-steps / --fragments)")
    zero: int = flag(0, type=int, choices=(0, 1, 2, 3),
                     help="ZeRO stage (zero/): 0 replicated; 1 optimizer state sharded over the processes; 2 "
                          "gradients too; 3 parameters too, gathered one unit (block) at a time with prefetch "
                          "(--bucket-mb plays no part). With --grad-sync ddp, 1 is PyTorch's ZeroRedundancyOptimizer; "
                          "with fsdp, 3 reshards after forward and 2 does not")
    zero3_accumulate: str = flag("sharded", choices=("sharded", "unsharded"), resolved=True,
                                 help="--zero 3 with --grad-accum > 1: reduce-scatter every micro-batch into the shard "
                                      "accumulators (sharded, the default: gradients Psi/W), or keep each unit's full "
                                      "gradient over the window and reduce-scatter it once (unsharded: 4 Psi more "
                                      "during the window, K-1 fewer reduce-scatters, stage 0's summation order; what "
                                      "FSDP2 does)")
    offload: str | None = flag(None, choices=("disk", "cpu"),
                               help="custom --zero 1-3: keep each process's optimizer state, and at --zero 3 its "
                                    "weights' and gradients' shards too, in a file under --offload-dir, streamed "
                                    "through a few buffers by a background thread (zero/offload/); only the storage "
                                    "moves: the weights are bit for bit those of the run without it. cpu: in host "
                                    "memory instead (pinned under a GPU, whose memory it frees; on a CPU device it "
                                    "only copies)")
    offload_dir: str | None = flag(None, metavar="PATH",
                                   help="--offload disk: the folder of the offload files, one per process, on a disk "
                                        "(not tmpfs) with room for the state: 16 Psi / W bytes a process at --zero "
                                        "3 with AdamW; they are scratch, removed at the run's end (checkpoints are "
                                        "--checkpoint-dir's)")
    param_dtype: str | None = flag(None, choices=tuple(DTYPES),
                                   help="custom --zero 1-3, fsdp: the dtype the weights are kept (stages 1-2) or "
                                        "gathered (3) and computed in, over master shards and optimizer state in "
                                        "the model's own dtype (FSDP2's MixedPrecisionPolicy; default: the model's)")
    reduce_dtype: str | None = flag(None, choices=tuple(DTYPES),
                                    help="custom --zero 1-3, fsdp: the dtype gradients are reduced over the processes "
                                         "in (default: --param-dtype's)")
    optimizer: str = flag("sgd", choices=("sgd", "sgd_nesterov", "adamw", "muon"),
                          help="SGD with --momentum and --weight-decay (sgd_nesterov: Nesterov's momentum, as "
                               "torchvision's reference scripts name it), AdamW with --weight-decay (decoupled), or "
                               "muon: torch.optim.Muon (Nesterov) on the hidden 2-D matrices of the blocks "
                               "(transformers: --model gpt..., vit...) with --muon-lr, --muon-momentum and "
                               "--muon-weight-decay, and AdamW with --lr, --betas and --weight-decay on the rest "
                               "(embeddings, head, norms, biases), one schedule for both")
    allreduce: str = flag("torch", choices=("torch", "ring", "butterfly"),
                          help="custom: which collectives sync the buckets: torch.distributed's, or allreduce.py's own "
                               "(--zero 1/2: torch's reduce-scatter and all-gather, or the ring's)")
    sync_mode: str = flag("overlap", choices=("overlap", "after"),
                          help="custom: all_reduce buckets from gradient hooks during backward, or after it")
    bucket_mb: float = flag(25.0, type=float, help="gradient bucket size cap (DDP's bucket_cap_mb)")
    norm: str = flag("custom", choices=("custom", "torch", "local"),
                     help="BatchNorm: syncbn.py's SyncBatchNorm, PyTorch's nn.SyncBatchNorm (CUDA), or each "
                          "process's own")
    grad_accum: int = flag(1, type=int, help="micro-batches per optimizer step")
    batch_size: int = flag(128, type=int, help="per-process micro-batch")
    epochs: int = flag(10, type=int, help="passes over the training set")
    max_steps: int = flag(0, type=int, help="stop after this many optimizer steps in all (0: no limit)")
    lr: float = flag(0.05, type=float, help="the (peak) learning rate")
    momentum: float = flag(0.9, type=float, help="SGD's momentum")
    weight_decay: float = flag(5e-4, type=float, help="the weight decay (AdamW: decoupled)")
    betas: list[float] | None = flag(None, type=float, nargs=2, metavar=("B1", "B2"),
                                     help="AdamW's betas (default 0.9 0.999, PyTorch's; language models are trained "
                                          "with 0.9 0.95)")
    muon_lr: float | None = flag(None, type=float, resolved=True,
                                 help=f"--optimizer muon: Muon's (peak) learning rate, each matrix's scaled by "
                                      f"max(1, rows/columns)^0.5 as torch.optim.Muon does by default (default "
                                      f"{MUON_DEFAULTS['muon_lr']}: Keller Jordan's Muon recipe's for that update, "
                                      f"whose entries have RMS about 1/sqrt(columns); Moonlight rescales it to AdamW's "
                                      f"size to reuse AdamW's rate instead)")
    muon_momentum: float | None = flag(None, type=float, resolved=True,
                                       help=f"--optimizer muon: Muon's momentum (default "
                                            f"{MUON_DEFAULTS['muon_momentum']}: torch.optim.Muon's, modded-nanogpt's "
                                            f"and Moonlight's)")
    muon_weight_decay: float | None = flag(None, type=float, resolved=True,
                                           help=f"--optimizer muon: Muon's decoupled weight decay, w -= lr x decay x "
                                                f"w per step (default {MUON_DEFAULTS['muon_weight_decay']}: Keller "
                                                f"Jordan's Muon recipe's at lr 0.02, 2e-4 a step, the order of "
                                                f"torch.optim.Muon's defaults, 0.1 at lr 1e-3, and of Moonlight's, "
                                                f"0.1 at AdamW's rate)")
    norm_weight_decay: float | None = flag(None, type=float,
                                           help="the weight decay of biases and normalization weights (every parameter "
                                                "of fewer than 2 dimensions), in a parameter group of their own "
                                                "(default: --weight-decay, one group)")
    clip_grad_norm: float | None = flag(None, type=float, metavar="X",
                                        help="clip the gradient to global 2-norm X before each step (the whole model's "
                                             "norm at every --zero; after fp16's unscaling); default off")
    scheduler: str = flag("none", choices=("none", "onecycle", "cosine"),
                          help="onecycle: PyTorch's OneCycleLR to --lr; cosine: linear warm-up over --warmup-steps to "
                               "--lr, then a cosine down to --min-lr at the last step (the recipe of GPT trainers)")
    warmup_steps: int | None = flag(None, type=int, metavar="N", help="--scheduler cosine: warm-up steps (default 0)")
    min_lr: float | None = flag(None, type=float, help="--scheduler cosine: the learning rate at the end (default 0)")
    decay_steps: int | None = flag(None, type=int, metavar="N",
                                   help="--scheduler cosine: the step at which the cosine reaches --min-lr (default: "
                                        "the last step of --epochs). --max-steps only stops the run, so a run stopped "
                                        "by it resumes exactly with a larger one")
    amp: str = flag("off", choices=("off", "bf16", "fp16"), help="autocast's dtype (fp16 with a gradient scaler)")
    device: str = flag("auto", choices=("auto", "cpu", "cuda"), help="auto: CUDA when there is a GPU")
    backend: str = flag("auto", choices=("auto", "gloo", "nccl"), help="auto: nccl on CUDA, gloo on the CPU")
    seed: int = flag(0, type=int, help="every random draw derives from it (and the position in the run)")
    deterministic: bool = flag(False, help="deterministic CUDA kernels, so that bit-for-bit resume holds on a GPU "
                                           "too (slower)")
    checkpoint_dir: str | None = flag(None, metavar="DIR",
                                      help="checkpoints, resumed from when present (either format, at any --zero, "
                                           "--grad-sync and number of processes that keeps the global batch): at "
                                           "custom --zero 1-3 and fsdp, when every rank sees DIR, sharded "
                                           "torch.distributed.checkpoint folders DIR/step-N (each rank writes its "
                                           "own shards; DIR/latest names the current one); otherwise DIR/last.pt, "
                                           "written by rank 0 (the model and optimizer gathered to it)")
    init_from: str | None = flag(None, metavar="PATH",
                                 help="start from these weights (the optimizer and the position fresh): a "
                                      "safetensors file or a folder of python -m trainer.export (a transformers "
                                      "GPT-2 folder for the GPTs); every rank reads it. A checkpoint in "
                                      "--checkpoint-dir wins: a resume continues it")
    checkpoint_every: int = flag(0, type=int, help="also checkpoint every N optimizer steps (0: epoch ends)")
    keep_checkpoints: int = flag(1, type=int, metavar="K",
                                 help="folders DIR/step-N kept: the current one and the K-1 before it (default 1: "
                                      "a folder is a whole training state, 1.03 GB for GPT-2 small's shape with "
                                      "AdamW, and a run killed mid-save still resumes from the current one); an "
                                      "older one is removed only after a newer one is current")
    async_checkpoint: bool = flag(False, help="save in the background: the loop pauses only to copy this rank's "
                                              "state into staging buffers kept from save to save (pinned host "
                                              "memory on a GPU) and a writer thread writes and publishes it while "
                                              "training goes on (at most one save in flight; a save due while one "
                                              "writes waits for it). Off by default: it holds one more copy of the "
                                              "rank's state (12 Psi / W bytes for AdamW at --zero 3: the weights "
                                              "and two moments) for the run's life, and on a machine with few cores "
                                              "the writer takes them from the steps (docs/trainer.md has both "
                                              "figures)")
    replica_group: int | None = flag(None, type=int, metavar="I",
                                     help="fault tolerance: this torchrun is replica group I (0 .. R-1) of a run "
                                          "whose groups train together through --coordinator and carry on when "
                                          "one is lost, a group that comes back taking the live state from another "
                                          "(replicas/; custom --zero 0-3, each group sharding over its own "
                                          "processes and place j's shards averaged across the groups, or diloco and "
                                          "localsgd with each group a replica, --fragments, --outer-delay and "
                                          "--outer-compress too; each group its own --checkpoint-dir)")
    replica_groups: int | None = flag(None, type=int, metavar="R",
                                      help="fault tolerance: the replica groups the run is planned for; group I's "
                                           "processes take the data of ranks I*P .. I*P+P-1 of one R*P-process run, "
                                           "which R groups of P processes are without faults")
    coordinator: str | None = flag(None, metavar="HOST:PORT",
                                   help="fault tolerance: the coordinator's address (`python -m replicas serve` "
                                        "starts one, listening on PORT)")
    min_replica_groups: int = flag(1, type=int, metavar="N",
                                   help="fault tolerance: a step waits until N replica groups are alive")
    fault_timeout: float = flag(60.0, type=float, metavar="S",
                                help="fault tolerance: seconds before a replica group that stopped answering (hung) "
                                     "is left out of the step")
    commit_log: str | None = flag(None, metavar="PATH",
                                  help="fault tolerance: every committed step, its replica groups and the samples "
                                       "each used (JSON lines, this group's rank 0), from which one process can "
                                       "replay the run")
    warm_restarts: bool = flag(False, help="under a torchrun that restarts failed workers: a restarted worker is "
                                           "forked from a process that imported torch and the trainer at the first "
                                           "start (one per local rank, kept by it), not started afresh: with "
                                           "replica groups it asks to rejoin about 3 s sooner on 2 CPU cores "
                                           "(trainer/warm_start.py; needs OMP_NUM_THREADS=1)")
    eval_only: bool = flag(False, help="evaluate --checkpoint-dir's checkpoint (or the fresh model) and exit")
    generate: int | None = flag(None, type=int, metavar="N",
                                help="print N bytes sampled from the GPT of --checkpoint-dir's checkpoint after "
                                     "--prompt, and exit")
    prompt: str = flag("", help="--generate: the text to continue (default: the start of a file)")
    temperature: float = flag(0.8, type=float, help="--generate: logits are divided by it before sampling")
    top_k: int | None = flag(None, type=int, help="--generate: sample among the K likeliest bytes only")
    log_dir: str | None = flag(None, help="TensorBoard scalars from rank 0")
    log_every: int = flag(10, type=int, metavar="N",
                          help="every N optimizer steps rank 0 shows train/loss (over its samples), train/lr, "
                               "train/step_ms, train/data_wait_ms and train/samples_per_s, means over those steps: "
                               "TensorBoard and the bar")
    profile: str | None = flag(None, metavar="DIR",
                               help="torch.profiler on every rank over --profile-steps: DIR/rank<R>.pt.trace.json, a "
                                    "Chrome trace (ui.perfetto.dev, chrome://tracing) with named ranges for forward, "
                                    "backward, each bucket's all-reduce, SyncBatchNorm's collectives and the optimizer "
                                    "step")
    profile_steps: tuple[int, int] = flag(PROFILE_STEPS, metavar="A:B", resolved=True,
                                          help=f"with --profile: this run's optimizer steps A to B-1, counted from 0 "
                                               f"(default {PROFILE_STEPS[0]}:{PROFILE_STEPS[1]}: after the warm-up)")
    metrics_out: str | None = flag(None, help="JSON summary from rank 0")
    eval_every: int = flag(0, type=int, metavar="N",
                           help="also evaluate every N optimizer steps: the metrics' evals list each one's step, "
                                "seconds of training so far (evaluations left out), bytes sent so far by the busiest "
                                "rank and validation figures")
    eval_batch_size: int | None = flag(None, type=int, metavar="N", resolved=True,
                                       help="samples (images, or windows of --context bytes) per forward of the "
                                            "evaluation on each rank (default: --batch-size, the micro-batch: a "
                                            "forward without gradients holds less than a training forward and "
                                            "backward of as many samples, so evaluation stays inside the steps' "
                                            "memory); the figures are the same at any value. At --zero 3 and "
                                            "--grad-sync fsdp each forward gathers the whole model, so a small "
                                            "batch makes a slow evaluation: raise N where memory allows")
    timeout: float = flag(1800.0, type=float, help="seconds, for process-group set-up and collectives")
    malloc_mmap_threshold: int = flag(128, type=int, metavar="KB",
                                      help="glibc's malloc serves blocks of KB kB or more by mmap and gives them back "
                                           "when freed; pinning it stops glibc from raising it after a large block "
                                           "is freed, when freed blocks of up to 32 MB stay in the process and its "
                                           "resident memory reports the allocator's history (GPT-2 small at --zero "
                                           "3 on 4 processes: 1.1 GB against 0.59 GB above start); 0 leaves glibc's "
                                           "own, rising threshold")

    @property
    def outer_sync(self) -> bool:
        """--grad-sync diloco or localsgd: replicas with weights of their own, meeting through an outer step."""
        return self.grad_sync in OUTER_SYNCS


# ----------------------------------------------------------------------------------------------------------
# The parser, made from the fields
# ----------------------------------------------------------------------------------------------------------
class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line, from rank 0) instead of printing usage on every rank."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help names each flag's default where its help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = getattr(action, "shown_default", None)
        if default in (None, False, "") or "default" in text:
            return text
        return f"{text} (default {' '.join(map(str, default)) if isinstance(default, list) else default})".strip()


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(description=DESCRIPTION, formatter_class=HelpFormatter)
    for item in fields(Config):
        options = dict(item.metadata)
        resolved = options.pop("resolved", False)
        if isinstance(item.default, bool):
            options["action"] = "store_true"
        action = parser.add_argument(f"--{item.name.replace('_', '-')}", default=None if resolved else item.default,
                                     **options)
        action.shown_default = None if resolved else item.default  # type: ignore[attr-defined]
    return parser


def parse_args(argv: list[str] | None = None) -> Config:
    """The command line as a Config: every check between flags made here, once, in one line each."""
    given = make_parser().parse_args(argv)
    check_numbers(given)
    check_recipe_flags(given)
    muon = muon_flags(given)
    outer = outer_flags(given)
    check_syncs(given)
    check_offload(given)
    check_replica_groups(given)
    if given.log_dir and importlib.util.find_spec("tensorboard") is None:  # every rank, before any collective
        raise UsageError("--log-dir needs the tensorboard package (pip install tensorboard)")
    profile_steps = parse_profile_steps(given.profile_steps, given.profile)
    data = data_flags(given)
    if given.norm == "torch" and (given.device == "cpu" or not torch.cuda.is_available()):
        raise UsageError(NORM_TORCH_ON_CPU)  # before the process group: no rank waits for another
    return Config(**{**vars(given), **muon, **outer, **data, "profile_steps": profile_steps,
                     "zero3_accumulate": given.zero3_accumulate or "sharded",
                     "eval_batch_size": given.batch_size if given.eval_batch_size is None else given.eval_batch_size})


# ----------------------------------------------------------------------------------------------------------
# The checks, in the order they are made
# ----------------------------------------------------------------------------------------------------------
def check_numbers(given: argparse.Namespace) -> None:
    positive = {"--grad-accum": given.grad_accum, "--batch-size": given.batch_size, "--epochs": given.epochs,
                "--train-size": given.train_size, "--val-size": given.val_size, "--lr": given.lr,
                "--bucket-mb": given.bucket_mb, "--timeout": given.timeout, "--log-every": given.log_every,
                "--keep-checkpoints": given.keep_checkpoints,
                "--eval-batch-size": 1 if given.eval_batch_size is None else given.eval_batch_size}
    for name, value in positive.items():
        if not value > 0:
            raise UsageError(f"{name} must be positive, got {value}")
    for name, value in {"--max-steps": given.max_steps, "--checkpoint-every": given.checkpoint_every,
                        "--momentum": given.momentum, "--eval-every": given.eval_every,
                        "--weight-decay": given.weight_decay,
                        "--norm-weight-decay": given.norm_weight_decay or 0}.items():
        if value < 0:
            raise UsageError(f"{name} must not be negative, got {value}")
    if given.clip_grad_norm is not None and not given.clip_grad_norm > 0:
        raise UsageError(f"--clip-grad-norm must be positive, got {given.clip_grad_norm}")


def check_recipe_flags(given: argparse.Namespace) -> None:
    """--betas, the cosine schedule's flags, --generate's, --init-from, --dropout and --async-checkpoint, in one line
    each when they do not fit."""
    adamw = given.optimizer in ("adamw", "muon")
    if given.betas is not None and (not adamw or not all(0 <= b < 1 for b in given.betas)):
        raise UsageError(f"--betas is AdamW's (--optimizer adamw, or muon's AdamW), two numbers in [0, 1), got "
                         f"{given.betas}")
    for name, value in (("--warmup-steps", given.warmup_steps), ("--min-lr", given.min_lr),
                        ("--decay-steps", given.decay_steps)):
        if value is not None and given.scheduler != "cosine":
            raise UsageError(f"{name} is for --scheduler cosine")
        if value is not None and value < 0:
            raise UsageError(f"{name} must not be negative, got {value}")
    if given.decay_steps is not None and given.decay_steps <= (given.warmup_steps or 0):
        raise UsageError(f"--decay-steps {given.decay_steps} must be above --warmup-steps {given.warmup_steps or 0}")
    if given.min_lr is not None and given.min_lr > given.lr:
        raise UsageError(f"--min-lr {given.min_lr} is above --lr {given.lr}")
    if given.generate is not None:
        if given.generate < 1 or given.checkpoint_dir is None:
            raise UsageError("--generate N takes N >= 1 and --checkpoint-dir (the run whose checkpoint to sample)")
        if not given.temperature > 0 or (given.top_k is not None and given.top_k < 1):
            raise UsageError(f"--temperature must be positive and --top-k at least 1, got {given.temperature} and "
                             f"{given.top_k}")
    if given.init_from is not None:
        if given.generate is not None:
            raise UsageError("--init-from is for a run (and --eval-only); --generate samples --checkpoint-dir's "
                             "checkpoint")
        if not os.path.exists(given.init_from):
            raise UsageError(f"--init-from {given.init_from}: no such file or folder")
    if not 0 <= given.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {given.dropout}")
    if given.async_checkpoint and given.checkpoint_dir is None:
        raise UsageError("--async-checkpoint saves into --checkpoint-dir: give one")


def muon_flags(given: argparse.Namespace) -> dict[str, Any]:
    """--optimizer muon's flags with their defaults filled in (refused for the other optimizers, where they stay
    None), and the models and schedules it takes, in one line each.

    [Note: Muon's defaults] The anchors agree on the momentum, 0.95 with Nesterov's (torch.optim.Muon,
    modded-nanogpt, Moonlight), and part on the rate: torch.optim.Muon and Keller Jordan's Muon scale each matrix's
    orthogonalized update by max(1, rows/columns)^0.5 (its entries have RMS about 1/sqrt(columns)), and his
    recipe (Muon beside AdamW, the README of his Muon) steps it at lr 0.02, while Moonlight rescales it to AdamW's
    RMS (0.2 sqrt(max(rows, columns))) to reuse AdamW's rate. The trainer takes torch's default scaling, so 0.02.
    Weight decay is decoupled and multiplied by the rate: his recipe's 0.01 at 0.02 shrinks a weight by 2e-4 a
    step, the order of torch's defaults (0.1 at lr 1e-3: 1e-4) and of Moonlight's 0.1 at AdamW's rate; so 0.01."""
    named = [f"--{key.replace('_', '-')}" for key in MUON_DEFAULTS if getattr(given, key) is not None]
    if given.optimizer != "muon":
        if named:
            raise UsageError(f"{named[0]} is for --optimizer muon")
        return {}
    if given.model not in MUON_MODELS:
        raise UsageError(f"--optimizer muon is for the transformers (--model gpt..., vit...): Muon takes the 2-D "
                         f"matrices inside their blocks, and --model {given.model} has none (its blocks are "
                         f"convolutions, 4-D, or it has no blocks)")
    if given.scheduler == "onecycle":
        raise UsageError("--scheduler onecycle takes one maximal rate and cycles one kind of momentum; --optimizer "
                         "muon's Muon and AdamW take --scheduler cosine or none (the same factor on both rates)")
    muon = {key: default if getattr(given, key) is None else getattr(given, key)
            for key, default in MUON_DEFAULTS.items()}
    if not muon["muon_lr"] > 0 or not 0 <= muon["muon_momentum"] < 1 or muon["muon_weight_decay"] < 0:
        raise UsageError(f"--muon-lr must be positive, --muon-momentum in [0, 1) and --muon-weight-decay not "
                         f"negative, got {muon['muon_lr']}, {muon['muon_momentum']} and {muon['muon_weight_decay']}")
    return muon


def outer_flags(given: argparse.Namespace) -> dict[str, Any]:
    """diloco and localsgd's flags with their defaults filled in (refused for the other syncs, where they stay
    None), in one line when they do not fit."""
    named = [f"--{key.replace('_', '-')}" for key in DILOCO_DEFAULTS if getattr(given, key) is not None]
    if given.grad_sync not in OUTER_SYNCS:
        if named:
            raise UsageError(f"{named[0]} is for --grad-sync diloco or localsgd")
        return {}
    if given.grad_sync == "localsgd":
        diloco_only = [name for name in named if name in ("--outer-optimizer", "--outer-lr", "--outer-momentum")]
        if diloco_only:
            raise UsageError(f"{diloco_only[0]} is diloco's: localsgd averages the weights (outer SGD, lr 1, no "
                             f"momentum)")
    defaults = {**DILOCO_DEFAULTS, **(LOCALSGD if given.grad_sync == "localsgd" else {})}
    outer = {key: default if getattr(given, key) is None else getattr(given, key)
             for key, default in defaults.items()}
    if not 1 <= outer["fragments"] <= outer["local_steps"]:
        raise UsageError(f"--fragments {outer['fragments']} must be between 1 and --local-steps {outer['local_steps']}")
    if not 0 <= outer["outer_delay"] <= outer["local_steps"] // outer["fragments"]:
        raise UsageError(f"--outer-delay {outer['outer_delay']} must be between 0 and --local-steps / --fragments = "
                         f"{outer['local_steps'] // outer['fragments']} (one fragment in flight at a time)")
    if not outer["outer_lr"] > 0 or outer["outer_momentum"] < 0:
        raise UsageError(f"--outer-lr must be positive and --outer-momentum not negative, got {outer['outer_lr']} and "
                         f"{outer['outer_momentum']}")
    return outer


def check_syncs(given: argparse.Namespace) -> None:
    """--grad-sync against --zero, --replicas, --param-dtype, --reduce-dtype, --allreduce, --sync-mode, --compile and
    --zero3-accumulate."""
    sync, stage = given.grad_sync, given.zero
    if given.replicas is not None and given.replicas < 1:
        raise UsageError(f"--replicas must be positive, got {given.replicas}")
    sharded = (sync == "custom" and stage > 0) or sync == "fsdp"  # the syncs with master shards and a mesh
    if given.replicas is not None and sync not in OUTER_SYNCS and not sharded:
        raise UsageError(f"--replicas is for --grad-sync custom --zero 1-3 and fsdp (hybrid sharding), diloco and "
                         f"localsgd; not --grad-sync {sync} --zero {stage}")
    for name in ("param_dtype", "reduce_dtype"):
        if getattr(given, name) is not None and not sharded:
            why = ("hands the model's weights to the outer step" if sync in OUTER_SYNCS else
                   "keeps the model whole")
            raise UsageError(f"--{name.replace('_', '-')} is for --grad-sync custom --zero 1-3 and fsdp (master "
                             f"shards in the model's dtype); --grad-sync {sync} --zero {stage} {why} in its own "
                             f"dtype (use --amp there)")
    if given.param_dtype and given.norm == "local" and sync == "custom":
        raise UsageError("--param-dtype with --norm local: torch's BatchNorm takes its weights and running statistics "
                         "in one dtype; --norm custom (syncbn.py) takes bf16 weights over float32 statistics")
    if (given.param_dtype or given.reduce_dtype) and given.amp != "off":
        raise UsageError(f"--param-dtype and --reduce-dtype are mixed precision of their own; --amp {given.amp} "
                         f"would autocast on top of them: use one or the other")
    if given.allreduce != "torch" and sync not in OURS:
        raise UsageError(f"--allreduce {given.allreduce} is for --grad-sync custom ({sync} uses its own collectives)")
    if sync == "fsdp" and stage not in (2, 3):
        raise UsageError(f"--grad-sync fsdp takes --zero 2 (no reshard after forward) or 3 (reshard after "
                         f"forward), got --zero {stage}")
    if sync == "ddp" and stage > 1:
        raise UsageError(f"--grad-sync ddp takes --zero 0 or 1 (ZeroRedundancyOptimizer); --zero {stage} is "
                         f"--grad-sync custom")
    if stage and given.allreduce == "butterfly":
        raise UsageError(f"--zero {stage} runs on reduce-scatter and all-gather: --allreduce torch or ring "
                         f"(the butterfly has no halves here)")
    if stage >= 2 and given.sync_mode == "after" and sync in OURS:
        raise UsageError(f"--zero {stage} reduce-scatters gradients as backward completes them; --sync-mode "
                         f"after would keep every full gradient (use --zero 1)")
    if given.compile == "forward" and stage == 3:
        raise UsageError(f"--compile forward does not take --zero 3 (--grad-sync {sync}): its parameters are gathered "
                         f"in the blocks' module hooks, which compiling the model's forward would trace; --compile "
                         f"blocks leaves them outside the graphs")
    if given.compile and sync == "ddp" and given.bucket_mb < 1:  # an AssertionError deep in Dynamo else
        raise UsageError(f"--compile with --grad-sync ddp takes --bucket-mb 1 or more, not {given.bucket_mb:g}: "
                         f"torch's DDPOptimizer splits the compiled graph at DDP's buckets and requires the first "
                         f"(1 MB) to be no larger than the others")
    if given.keep_checkpoints > 1 and not sharded:  # (a sharded run on nodes that share no folder: said at start)
        raise UsageError(f"--keep-checkpoints {given.keep_checkpoints} is for the syncs that write folders "
                         f"DIR/step-N (--grad-sync custom --zero 1-3, fsdp); --grad-sync {sync} --zero {stage} writes "
                         f"one DIR/last.pt, replaced at every save")
    if given.zero3_accumulate is not None and (stage != 3 or sync != "custom"):
        raise UsageError(f"--zero3-accumulate is for --grad-sync custom --zero 3, not --grad-sync {sync} "
                         f"--zero {stage}")


def check_offload(given: argparse.Namespace) -> None:
    """--offload against --offload-dir and the flags it does not work with (yet)."""
    offload, stage = given.offload, given.zero
    if offload is None:
        if given.offload_dir is not None:
            raise UsageError("--offload-dir is where --offload disk keeps the state: give --offload disk")
        return
    if given.grad_sync != "custom" or stage == 0:
        raise UsageError(f"--offload is for --grad-sync custom --zero 1-3 (the sharded stages' state), not "
                         f"--grad-sync {given.grad_sync} --zero {stage}")
    if offload == "cpu" and given.offload_dir is not None:
        raise UsageError("--offload cpu keeps the state in host memory; --offload-dir is for --offload disk")
    if offload == "disk" and given.offload_dir is None:
        raise UsageError("--offload disk needs --offload-dir PATH, a folder on a disk for the offload files")
    refused = {  # the flag given: why not with --offload
        "--async-checkpoint": given.async_checkpoint and "it stages the whole state in memory to write it",
        "--replicas": given.replicas is not None and "hybrid sharding with offload is not built yet",
        "--replica-groups": given.replica_groups is not None and "replica groups with offload are not built yet",
        "--zero3-accumulate unsharded": given.zero3_accumulate == "unsharded" and
                                        "it keeps every unit's full gradient in memory over the window",
        "--amp fp16": given.amp == "fp16" and stage == 3 and "its scaler unscales the gradients in memory, where "
                                                            "--zero 3 with offload keeps them on the disk"}
    for name, why in refused.items():
        if why:
            raise UsageError(f"--offload does not take {name}: {why}")


FT_FLAGS = ("replica_group", "replica_groups", "coordinator")  # together or not at all
FT_OPTIONS = {"min_replica_groups": 1, "fault_timeout": 60.0, "commit_log": None}  # only with them
MAX_FAULT_TIMEOUT_S = 86400.0  # a day: longer is a typo, and a timedelta of inf overflows in the store's client


def check_replica_groups(given: argparse.Namespace) -> None:
    """The fault-tolerant replica groups' flags (trainer/replica_groups.py): together, in range, and with what
    they support (custom, diloco and localsgd, --zero 0-3 inside a group)."""
    named = [f"--{key.replace('_', '-')}" for key in FT_FLAGS if getattr(given, key) is not None]
    options = [f"--{key.replace('_', '-')}" for key, default in FT_OPTIONS.items() if getattr(given, key) != default]
    if not named:
        if options:
            raise UsageError(f"{options[0]} is for fault-tolerant replica groups (--replica-group, --replica-groups, "
                             f"--coordinator)")
        return
    if len(named) < len(FT_FLAGS):
        raise UsageError("--replica-group, --replica-groups and --coordinator go together (fault-tolerant replica "
                         "groups)")
    groups, group = given.replica_groups, given.replica_group
    if groups < 1:
        raise UsageError(f"--replica-groups must be positive, got {groups}")
    if not 0 <= group < groups:
        raise UsageError(f"--replica-group must be between 0 and --replica-groups - 1 = {groups - 1}, got {group}")
    if not 1 <= given.min_replica_groups <= groups:
        raise UsageError(f"--min-replica-groups must be between 1 and --replica-groups {groups}, got "
                         f"{given.min_replica_groups}")
    if not 0 < given.fault_timeout <= MAX_FAULT_TIMEOUT_S:  # nan and inf too: a timedelta of them overflows
        raise UsageError(f"--fault-timeout must be positive and at most {MAX_FAULT_TIMEOUT_S:.0f} s, got "
                         f"{given.fault_timeout}")
    host, _, port = given.coordinator.rpartition(":")
    if not port.isdigit():
        raise UsageError(f"--coordinator is HOST:PORT, got {given.coordinator!r}")
    if not 1 <= int(port) <= 65535:
        raise UsageError(f"--coordinator's port must be between 1 and 65535, got {port}")
    folder = os.path.dirname(given.commit_log or "") or "."
    if given.commit_log is not None and not os.path.isdir(folder):
        raise UsageError(f"--commit-log {given.commit_log}: no such folder {folder}")
    if given.commit_log is not None and os.path.isdir(given.commit_log):
        raise UsageError(f"--commit-log {given.commit_log} is a folder: give the path of a file (this group's log)")
    if given.grad_sync not in ("custom", *OUTER_SYNCS):
        raise UsageError(f"fault-tolerant replica groups train --grad-sync custom (--zero 0-3 inside each group), "
                         f"diloco or localsgd; --grad-sync {given.grad_sync} is not supported")
    if given.replicas is not None:
        raise UsageError("--replicas splits one torchrun into replicas; with --replica-groups each torchrun is one "
                         "group (one replica): leave --replicas out")
    if given.allreduce == "butterfly":
        raise UsageError("fault-tolerant replica groups average across groups with --allreduce torch or ring")
    if given.norm != "local" and given.model not in LANGUAGE_MODELS + ("vit", *TORCHVISION_VITS):
        raise UsageError(f"--model {given.model} with --norm {given.norm}: SyncBatchNorm would normalize over this "
                         f"group's processes only, not the run's; use --norm local (each process its own)")
    if given.eval_only or given.generate is not None:
        raise UsageError("--eval-only and --generate read one group's checkpoint: leave out --replica-group, "
                         "--replica-groups and --coordinator")


def parse_profile_steps(text: str | None, profile_dir: str | None) -> tuple[int, int]:
    """--profile-steps A:B -> (A, B), 0 <= A < B."""
    if text is None:
        return PROFILE_STEPS
    if profile_dir is None:
        raise UsageError("--profile-steps is for --profile DIR")
    first, colon, end = text.partition(":")
    try:
        steps = int(first), int(end)
    except ValueError:
        steps = (-1, -1)
    if not colon or not 0 <= steps[0] < steps[1]:
        raise UsageError(f"--profile-steps takes A:B, optimizer steps with 0 <= A < B, got {text!r}")
    return steps


def data_flags(given: argparse.Namespace) -> dict[str, Any]:
    """The dataset-dependent defaults (--data-dir, --augment, --image-size, --context), and the flags that only an
    image folder or text takes."""
    if given.workers < 0:
        raise UsageError(f"--workers must not be negative, got {given.workers}")
    text = given.dataset == "text"
    if text != (given.model in LANGUAGE_MODELS):
        raise UsageError(f"--model {given.model} does not take --dataset {given.dataset}: the GPTs "
                         f"({', '.join(LANGUAGE_MODELS)}) train on --dataset text, the image models on images")
    if not text and (given.context is not None or given.val_fraction != 0.1):
        raise UsageError("--context and --val-fraction are for --dataset text")
    if text:
        for name, value in (("--augment", given.augment), ("--image-size", given.image_size),
                            ("--workers", given.workers or None)):
            if value is not None:
                raise UsageError(f"{name} is for image sets, not --dataset text")
        context = GPT_SIZES[given.model]["context"] if given.context is None else given.context  # (0 is refused)
        if context < 1 or not 0 < given.val_fraction < 1:
            raise UsageError(f"--context must be positive and --val-fraction in (0, 1), got {context} and "
                             f"{given.val_fraction}")
        return {**DATASET_DEFAULTS["text"], "data_dir": given.data_dir or default_text_dir(), "context": context}
    chosen = {key: default if getattr(given, key) in (None, "") else getattr(given, key)
              for key, default in DATASET_DEFAULTS[given.dataset].items()}
    if given.dataset == "imagefolder":
        minimum = 10 if given.model == "net" else 1  # net: two 3x3 convolutions and a 2x2 pool before fc1
        if chosen["image_size"] < minimum:
            raise UsageError(f"--image-size must be at least {minimum} for --model {given.model}, "
                             f"got {chosen['image_size']}")
        return chosen
    if given.augment == "imagenet":
        raise UsageError("--augment imagenet is for --dataset imagefolder; in-memory sets take cifar or none")
    if given.image_size not in (None, 32):
        raise UsageError(f"--image-size is for --dataset imagefolder ({given.dataset} images are 32 pixels)")
    if given.workers:
        raise UsageError(f"--workers is for --dataset imagefolder ({given.dataset} sits in memory)")
    return chosen
