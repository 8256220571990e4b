"""zero.shard's offload (zero/offload/): the optimizer's state, and at stage 3 the weights' and gradients' shards, kept
in a file per rank and streamed through a few buffers, with only the storage moving.

A user's model as users write them (a token embedding tied to the head, a frozen positional table, blocks in a
ModuleList, the second under activation checkpointing) and a training recipe (decay and no-decay parameter groups,
clipping that bites, gradient accumulation), trained with offload and without it, at stages 1-3, 1-3 processes,
every element-wise torch.optim optimizer and the two whole-matrix ones (Muon beside AdamW, as Muon's recipe has it,
and Adafactor, at every stage on 3 processes: their matrices cut across ranks), float32 and bf16 weights over float32
masters; to a disk, and (AdamW on 2
processes, every stage) to host memory, offload="cpu", whose slots on a CPU device are copies. The claims:
- bit for bit: the weights, the optimizer's state dict and every step's clipping norm of the run with offload are
  the run's without it (torch.equal, no tolerance: [Note: only the storage moves] in zero/offload/shards.py);
- the state left memory: between steps the optimizer holds no element-wise state (its step counts only), and at
  stage 3 the rank holds no weight or gradient shard; the bytes went through the file (its traffic);
- a checkpoint of an offloaded run streams out of the store and back in: resumed with and without offload, at
  another stage and world size, it goes on as the uninterrupted run (bit for bit where the summation order is the
  same; float64 within 1e-12 where it is not), and dcp_to_torch_save reads it as it reads the in-memory run's;
- what cannot work is refused in one line on every rank: a folder missing, not a folder, on tmpfs, in use by a live
  run, too small for the state (naming both sizes); a file flipped or cut short between steps stops the next step;
- with the trainer (torchrun, --offload disk at --zero 3): the same losses and weights as without offload, and a rank
  SIGKILLed inside the streamed step of step 4, restarted by torchrun, ends with the uninterrupted run's weights.

Why no tolerance for the first claim: every element's update reads the same values in the same order (the same runs,
stepped by torch's own step over the same tensors' values), so any difference at all is a bug, not rounding.
"""
import fcntl
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import processes
import zero
from zero_testing import OPTIMIZERS, attempt, identical

VOCAB, WIDTH, CONTEXT, BATCH, K, STEPS, MAX_NORM = 24, 12, 8, 4, 2, 3, 0.05
BUCKET_MB = 600 / 2**20  # a few buckets at stages 1-2, runs cut across ranks and groups
# (stage, world size, optimizer, param_dtype): every optimizer at stage 3 on 2 (weights, gradients and state all
# offloaded), AdamW at every stage on 1-3 and SGD with momentum on 2, Muon + AdamW and Adafactor at every stage on 3
# (zero/matrix.py's step a bucket at a time, its collectives included), bf16 weights over fp32 masters at every stage
WHOLE_MATRIX = {"Muon": (torch.optim.Muon, {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}),
                "Adafactor": (torch.optim.Adafactor, {"lr": 1e-2, "weight_decay": 0.01})}
CONFIGS = ([(3, 2, name, None) for name in OPTIMIZERS]
           + [(stage, 3, name, None) for stage in (1, 2, 3) for name in WHOLE_MATRIX]
           + [(stage, world, name, None) for stage in (1, 2, 3) for world in (1, 2, 3)
              for name in ("AdamW", "SGD momentum") if (stage, world) != (3, 2) and (world == 2 or name == "AdamW")]
           + [(stage, 2, "AdamW", "bf16") for stage in (1, 2, 3)])
HOST_CONFIGS = [config for config in CONFIGS if config[1] == 2 and config[2] == "AdamW"]  # also offload="cpu"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """A user's language model: a tied head, a frozen positional table, blocks (stage 3's units), the second block's
    forward recomputed in its backward (activation checkpointing, as torchtitan and FSDP users wrap blocks)."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.1, requires_grad=False)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight
        self.blocks[1].forward = functools.partial(checkpoint, self.blocks[1].forward, use_reentrant=False)

    def forward(self, tokens):
        x = self.tokens(tokens)
        x = x + self.positions.to(x.dtype)  # (frozen: in its own dtype at stages 1-2, under bf16 weights)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(dtype=torch.float32):
    torch.manual_seed(5)
    return TinyLM().to(dtype)


def parameter_groups(model):
    """nanoGPT's: decay on matrices, none on vectors, the vectors at half the rate."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr_factor": 0.5}]


def build(stage, name, folder, offload, param_dtype=None, dtype=torch.float32, device="cpu"):
    """The model sharded at ``stage`` (``offload``: None, "disk" into ``folder``, or "cpu") and ``name``'s optimizer
    over its groups, on ``device``; "Muon": Muon on the blocks' matrices, AdamW on the rest (a list of the two)."""
    model = make_model(dtype).to(device)
    where = {"offload": offload, "offload_dir": folder if offload == "disk" else None} if offload else {}
    sharded = zero.shard(model, stage, bucket_mb=BUCKET_MB, param_dtype=param_dtype, **where)
    cls, settings = {**OPTIMIZERS, **WHOLE_MATRIX}[name]
    groups = parameter_groups(model)
    if name == "Muon":
        matrices = [p for block in model.blocks for p in block.parameters() if p.dim() == 2]
        rest = [[p for p in group["params"] if all(p is not m for m in matrices)] for group in groups]
        adamw_settings = OPTIMIZERS["AdamW"][1]
        return model, sharded, [sharded.optimizer(cls, matrices, **settings),
                                sharded.optimizer(torch.optim.AdamW, [{**groups[0], "params": rest[0]},
                                                                      {"params": rest[1], "weight_decay": 0.0}],
                                                  **adamw_settings)]
    groups[1]["lr"] = settings["lr"] * groups[1].pop("lr_factor")
    return model, sharded, sharded.optimizer(cls, groups, **settings)


def each(optimizer):
    """The optimizers ``build`` made, as a list."""
    return optimizer if isinstance(optimizer, list) else [optimizer]


def micro_batch(step, k, rank, world_size):
    """Micro-batch ``k`` of ``rank``'s share of step ``step``'s global batch: every split over ranks alike."""
    generator = torch.Generator().manual_seed(1000 * step)
    tokens = torch.randint(0, VOCAB, (BATCH * K * 6, CONTEXT + 1), generator=generator)
    per = tokens.shape[0] // (world_size * K)
    part = tokens[(rank * K + k) * per:(rank * K + k + 1) * per]
    return part[:, :-1], part[:, 1:]


def steps(model, sharded, optimizer, first, count, measure=None):
    """``count`` optimizer steps from step ``first``: K micro-batches, clipping, the update; the norms. ``measure``:
    called before the last step's clipping."""
    norms, device = [], model.norm.weight.device  # (the root stays on the device at every stage)
    for step in range(first, first + count):
        for k in range(K):
            inputs, targets = (t.to(device) for t in micro_batch(step, k, dist.get_rank(), dist.get_world_size()))
            sharded.set_requires_gradient_sync(k == K - 1)
            logits = model(inputs)
            logits = logits.float() if logits.dtype == torch.bfloat16 else logits  # (the loss in fp32 under bf16)
            (F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / K).backward()
        if step == first + count - 1 and measure is not None:  # what the rank holds between steps, as the trainer
            measure()                                         # measures it: before the step's own prefetch
        norms.append(sharded.clip_grad_norm_(MAX_NORM))
        for one in each(optimizer):
            one.step()
        for one in each(optimizer):
            one.zero_grad()
    return norms


def run_config(stage, name, param_dtype, folder, offload, device="cpu"):
    """STEPS steps; what the rank ends with, and what it held between steps and moved through the file."""
    dtype = {"bf16": torch.bfloat16}.get(param_dtype)
    model, sharded, optimizer = build(stage, name, folder, offload, param_dtype=dtype, device=device)
    held = {}

    def measure():
        held.update(zero.state_bytes(model, optimizer, sharded), frozen=sum(
            t.untyped_storage().nbytes() for t in sharded.held_shards()), runs=sum(
            len(group["params"]) for one in each(optimizer) for group in one.param_groups), element_wise=sum(
            torch.is_tensor(v) and v.dim() == 1 for one in each(optimizer) for state in one.state.values()
            for v in state.values()))  # (Adafactor's row_var and col_var, kept whole, are 2-D and more)
    norms = steps(model, sharded, optimizer, 0, STEPS, measure)
    traffic = sharded.store.traffic if offload else None
    out = {"norms": torch.stack(norms), "weights": sharded.model_state_dict(),
           "state": [one.state_dict() for one in each(optimizer)],
           "held": held, "read": traffic.read_bytes if traffic else 0, "written": traffic.written_bytes if traffic
           else 0, "files": sorted(os.listdir(folder)) if offload else None,
           "host": sharded.store.file.tier == "cpu" if offload else None}
    sharded.close()
    out["files after close"] = sorted(os.listdir(folder))
    return out


def configs_in_group(rank, world_size, configs, root):
    """Each config of this world size, without offload and with it (to a folder of the rank's own, and where
    HOST_CONFIGS has it to host memory)."""
    folder = os.path.join(root, f"rank{rank}")
    os.makedirs(folder, exist_ok=True)
    return {config: tuple(run_config(config[0], config[2], config[3], folder, offload)
                          for offload in (None, "disk", "cpu") if offload != "cpu" or config in HOST_CONFIGS)
            for config in configs}


@pytest.fixture(scope="module")
def config_runs(local_group, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("offload"))
    pending = {world: local_group(world).submit(configs_in_group, [c for c in CONFIGS if c[1] == world],
                                                os.path.join(root, str(world)), timeout_s=240)
               for world in (2, 3)}
    alone = local_group(1).run(configs_in_group, [c for c in CONFIGS if c[1] == 1], os.path.join(root, "1"),
                               timeout_s=240)
    return {1: alone, **{world: wait() for world, wait in pending.items()}}


def config_id(config):
    stage, world, name, param_dtype = config
    return f"stage{stage}-W{world}-{name.replace(' ', '_')}{'-' + param_dtype if param_dtype else ''}"


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_offload_is_the_in_memory_run_bit_for_bit(config_runs, config):
    for rank, results in enumerate(config_runs[config[1]]):
        memory, *offloaded_runs = results[config]
        assert len(offloaded_runs) == (2 if config in HOST_CONFIGS else 1)
        for offloaded in offloaded_runs:  # to the disk, and to host memory
            assert torch.equal(offloaded["norms"], memory["norms"]), (rank, offloaded["norms"], memory["norms"])
            assert memory["norms"].min() > MAX_NORM  # the clipping bites at every step
            assert identical(offloaded["weights"], memory["weights"]), rank
            assert identical(offloaded["state"], memory["state"]), rank
            assert rank > 0 or config[2] == "SGD" or all(state["state"] for state in offloaded["state"])  # rank
            # 0 gathered it (the others {})


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_the_state_lives_in_the_file_between_steps(config_runs, config):
    """Held at a step, before it (zero.state_bytes, as the trainer measures it): no element-wise state in memory (the
    step counts only), and at stage 3 no weight or gradient shard either (a run's parameter is one NaN: 4 bytes,
    beside the frozen table's shard); the file carried them, and is gone at close."""
    stage, world, name, _ = config
    for results in config_runs[world]:
        memory, *offloaded_runs = results[config]
        for offloaded, host in zip(offloaded_runs, (False, True)):
            assert offloaded["host"] == host
            assert offloaded["held"]["element_wise"] == 0, offloaded["held"]
            assert memory["held"]["element_wise"] > 0 or name == "SGD", memory["held"]  # (plain SGD keeps no state)
            if stage == 3:
                assert offloaded["held"]["grads"] == 0, offloaded["held"]
                assert offloaded["held"]["params"] == 4 * offloaded["held"]["runs"] + offloaded["held"]["frozen"]
                assert memory["held"]["grads"] > 0 and memory["held"]["params"] > offloaded["held"]["params"]
            assert offloaded["read"] > 0 and offloaded["written"] > 0
            if host:  # nothing in the folder: the slots are host memory
                assert offloaded["files"] == []
            else:
                assert offloaded["files"] and all(f.endswith(".offload") for f in offloaded["files"])
            assert offloaded["files after close"] == []


def on_cuda(rank, world_size, root):
    """AdamW at stages 1 and 3 on the GPU (two ranks on one, over gloo), without offload and with it: the store
    stages its reads and writes through pinned host buffers, and the step runs on the device."""
    torch.cuda.set_device(0)
    folder = os.path.join(root, f"rank{rank}")
    os.makedirs(folder, exist_ok=True)
    return {(stage, offload): (run_config(stage, "AdamW", None, folder, None, "cuda"),
                               run_config(stage, "AdamW", None, folder, offload, "cuda"))
            for stage in (1, 3) for offload in ("disk", "cpu")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_offload_on_cuda_is_the_in_memory_run_bit_for_bit(local_group, tmp_path):
    for results in local_group(2).run(on_cuda, str(tmp_path), timeout_s=240):
        for case, (memory, offloaded) in results.items():  # (stage, "disk" | "cpu")
            assert torch.equal(offloaded["norms"], memory["norms"]), case
            assert identical(offloaded["weights"], memory["weights"]) and identical(offloaded["state"],
                                                                                    memory["state"]), case
            assert offloaded["read"] > 0 and offloaded["held"]["element_wise"] == 0


# ----------------------------------------------------------------------------------------------------------
# The store alone: its two threads keep each slot's reads after its writes
# ----------------------------------------------------------------------------------------------------------
def test_a_read_asked_while_its_write_is_in_flight_reads_what_was_written(tmp_path, monkeypatch):
    """The reading thread never queues behind the writing one, so a read of a slot whose write is still in flight
    (a write held until the read is asked, here) waits for that write; a read-ahead asked before a write is dropped
    by it."""
    import threading

    from zero.offload.files import OffloadFile
    from zero.offload.store import Store

    held, released = threading.Event(), threading.Event()
    write = OffloadFile.write

    def held_back(self, slot, buffer):
        if held.is_set():
            assert released.wait(30)
        write(self, slot, buffer)
    monkeypatch.setattr(OffloadFile, "write", held_back)
    store = Store(OffloadFile(str(tmp_path), "one.offload"))
    try:
        store.create("x", 1000, torch.float32)
        first = store.fresh("x")
        first.fill_(1.0)
        store.put("x", first)
        store.prefetch("x")  # asked before the next write: its bytes would be the old ones
        held.set()
        second = store.fresh("x")
        second.fill_(2.0)
        store.put("x", second)  # in flight until released, after the read below is asked
        threading.Timer(0.3, released.set).start()
        read = store.take("x")
        assert torch.equal(read, torch.full((1000,), 2.0))
        store.discard(read)
    finally:
        store.close()
    assert not (tmp_path / "one.offload").exists()


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: streamed out of the store and back in
# ----------------------------------------------------------------------------------------------------------
MORE = 2


def save_and_go_on(rank, world_size, root, stage, offload, dtype_name, name="AdamW"):
    """STEPS steps, a checkpoint (from the store, with offload), MORE steps: the weights and state at the end."""
    folder = os.path.join(root, f"offload-{rank}")
    os.makedirs(folder, exist_ok=True)
    model, sharded, optimizer = build(stage, name, folder, offload, dtype=getattr(torch, dtype_name))
    steps(model, sharded, optimizer, 0, STEPS)
    zero.checkpoint.save(os.path.join(root, "checkpoint"), sharded, optimizer, extra={"step": STEPS})
    steps(model, sharded, optimizer, STEPS, MORE)
    out = {"weights": sharded.model_state_dict(), "state": [one.state_dict() for one in each(optimizer)]}
    sharded.close()
    return out


def load_and_go_on(rank, world_size, root, stage, offload, dtype_name, name="AdamW"):
    """The checkpoint loaded (into the store, with offload), then MORE steps."""
    folder = os.path.join(root, f"offload-{world_size}-{stage}-{offload}-{rank}")
    os.makedirs(folder, exist_ok=True)
    model, sharded, optimizer = build(stage, name, folder, offload, dtype=getattr(torch, dtype_name))
    extra = zero.checkpoint.load(os.path.join(root, "checkpoint"), sharded, optimizer)
    steps(model, sharded, optimizer, STEPS, MORE)
    out = {"weights": sharded.model_state_dict(), "state": [one.state_dict() for one in each(optimizer)],
           "extra": extra}
    sharded.close()
    return out


RESUMES = {  # name -> (world size, stage, offload): where the checkpoint saved at stage 3 on 2 with offload goes on
    "same, offloaded": (2, 3, "disk"), "same, in memory": (2, 3, None), "same, in host memory": (2, 3, "cpu"),
    "stage 1 on 3, offloaded": (3, 1, "disk"), "stage 2 on 1, offloaded": (1, 2, "disk")}


@pytest.fixture(scope="module")
def checkpoint_runs(local_group, tmp_path_factory):
    """float64, so that the resumes at another stage and world size compare within rounding; a second save of the
    same run in memory, for dcp_to_torch_save."""
    out = {}
    for dtype in ("float32", "float64"):
        root = str(tmp_path_factory.mktemp(f"offload-checkpoint-{dtype}"))
        memory_root = str(tmp_path_factory.mktemp(f"memory-checkpoint-{dtype}"))
        saved = local_group(2).run(save_and_go_on, root, 3, "disk", dtype, timeout_s=120)[0]
        in_memory = local_group(2).run(save_and_go_on, memory_root, 3, None, dtype, timeout_s=120)[0]
        resumed = {name: local_group(world).run(load_and_go_on, root, stage, offload, dtype, timeout_s=120)[0]
                   for name, (world, stage, offload) in RESUMES.items()
                   if dtype == "float64" or (world, stage) == (2, 3)}
        out[dtype] = {"saved": saved, "in memory": in_memory, "resumed": resumed, "root": root,
                      "memory root": memory_root}
    return out


@pytest.mark.parametrize("name", list(RESUMES))
def test_a_checkpoint_of_the_store_resumes_anywhere(checkpoint_runs, name):
    """Bit for bit at the saver's stage and world size (float32); float64 within 1e-12 elsewhere (another
    summation order: a few ulps, over MORE steps of AdamW)."""
    for dtype, runs in checkpoint_runs.items():
        if name not in runs["resumed"]:
            continue
        resumed, uninterrupted = runs["resumed"][name], runs["saved"]
        assert resumed["extra"] == {"step": STEPS}
        if RESUMES[name][:2] == (2, 3):
            assert identical(resumed["weights"], uninterrupted["weights"]), (dtype, name)
            assert identical(resumed["state"], uninterrupted["state"]), (dtype, name)
        else:
            assert max((resumed["weights"][k] - v).abs().max().item()
                       for k, v in uninterrupted["weights"].items()) < 1e-12
        assert identical(runs["in memory"]["weights"], uninterrupted["weights"])


def whole_matrix_checkpoints(rank, world_size, root):
    """Muon + AdamW and Adafactor at stage 3 on 3 processes, offloaded: a checkpoint streamed out of the store, and
    the run resumed from it into the store and into memory."""
    out = {}
    for name in WHOLE_MATRIX:
        folder = os.path.join(root, name)
        out[name] = {"saved": save_and_go_on(rank, world_size, folder, 3, "disk", "float32", name),
                     **{f"resumed {offload}": load_and_go_on(rank, world_size, folder, 3, offload, "float32", name)
                        for offload in ("disk", None)}}
    return out


def test_a_whole_matrix_optimizers_checkpoint_streams_out_and_back_in(local_group, tmp_path):
    """Muon's momentum, Adafactor's vectors' variance (in the store) and its row_var, col_var and step counts (kept
    whole in memory) go through the checkpoint: the resumed runs, offloaded or in memory, end bit for bit as the
    uninterrupted one."""
    for rank, results in enumerate(local_group(3).run(whole_matrix_checkpoints, str(tmp_path), timeout_s=180)):
        for name, runs in results.items():
            for resumed in ("resumed disk", "resumed None"):
                assert runs[resumed]["extra"] == {"step": STEPS}
                assert identical(runs[resumed]["weights"], runs["saved"]["weights"]), (rank, name, resumed)
                assert identical(runs[resumed]["state"], runs["saved"]["state"]), (rank, name, resumed)
            assert rank > 0 or all(state["state"] for state in runs["saved"]["state"])


def test_dcp_to_torch_save_reads_the_stores_checkpoint_as_the_in_memory_ones(checkpoint_runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    runs = checkpoint_runs["float32"]
    ours, theirs = tmp_path / "offloaded.pt", tmp_path / "in-memory.pt"
    dcp_to_torch_save(os.path.join(runs["root"], "checkpoint"), ours)
    dcp_to_torch_save(os.path.join(runs["memory root"], "checkpoint"), theirs)
    offloaded, in_memory = torch.load(ours, weights_only=True), torch.load(theirs, weights_only=True)
    assert identical(offloaded, in_memory)
    assert offloaded["optimizer"]["state"]["blocks.0.up.weight"]["exp_avg"].shape == (2 * WIDTH, WIDTH)


# ----------------------------------------------------------------------------------------------------------
# Bad input: one line on every rank, before anything is written; a file changed under the run stops it
# ----------------------------------------------------------------------------------------------------------
def refusal_in_group(rank, world_size, folder, case):
    if case == "too small":  # 2 x 10^12 parameters on the meta device: terabytes a rank, refused before any write
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(10**6, 10**6, bias=False), nn.Linear(10**6, 10**6, bias=False))
        return attempt(lambda: zero.shard(model, 3, units=list(model), init=lambda m: None, offload="disk",
                                          offload_dir=folder))
    return attempt(lambda: build(3, "AdamW", folder, "disk"))


def changed_in_group(rank, world_size, folder, change):
    """A step, then this rank's file flipped or cut short, then the next step: what it raises."""
    os.makedirs(folder, exist_ok=True)
    model, sharded, optimizer = build(3, "AdamW", folder, "disk")
    steps(model, sharded, optimizer, 0, 1)
    sharded.store.flush()
    path = sharded.store.file.path
    if change == "flipped":
        with open(path, "r+b") as file:
            first = file.read(1)
            file.seek(0)
            file.write(bytes([first[0] ^ 0x10]))
    else:
        os.truncate(path, os.path.getsize(path) // 2)
    error = attempt(lambda: steps(model, sharded, optimizer, 1, 1))
    sharded.store.close()
    return error


@pytest.mark.parametrize("case", ["missing", "a file", "tmpfs", "in use", "too small"])
def test_a_folder_that_cannot_hold_the_state_is_refused_in_one_line_on_every_rank(local_group, tmp_path, case):
    folder = tmp_path / "offload"
    lock = None
    if case == "a file":
        folder.write_text("not a folder")
    elif case == "tmpfs":
        if not os.path.isdir("/dev/shm") or zero.offload.files.file_system("/dev/shm") != "tmpfs":
            pytest.skip("no tmpfs at /dev/shm")
        folder = pathlib.Path("/dev/shm")
    elif case in ("in use", "too small"):
        folder.mkdir()
        if case == "in use":  # a live run's rank 1 holds its file
            lock = open(folder / f"rank1.offload", "wb")
            fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        results = local_group(2).run(refusal_in_group, str(folder), case, timeout_s=60)
    finally:
        if lock is not None:
            lock.close()
    expected = {"missing": "does not exist", "a file": "is not a folder", "tmpfs": "is on tmpfs, which is memory",
                "in use": "is in use by another live run", "too small": "whose file system has"}[case]
    for kind, message in results:
        assert kind == "OffloadRefused" and expected in message and "\n" not in message, message
    assert results[0] == results[1]
    if case == "too small":
        assert "TB needed in offload folder" in results[0][1] or "GB needed in offload folder" in results[0][1]
    if case == "in use":
        assert "rank 1" in results[0][1] and not (folder / "rank0.offload").exists()


READ_ONLY_RUN = """
import os, sys, torch.distributed as dist, torch.nn as nn
sys.path[:0] = [{root!r}, {tests!r}]
import zero
from zero_testing import attempt
dist.init_process_group("gloo", store=dist.FileStore({store!r}, 1), rank=0, world_size=1)
shard = lambda folder: zero.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 3, offload="disk",
                                  offload_dir=folder)
shard({warm!r}).close()  # every module the refusal needs imported while root can read them (/root is 0o700)
if {drop!r}:  # not root: root writes anywhere its mode bits say not to
    os.setgid(65534)
    os.setuid(65534)
print(attempt(lambda: shard({folder!r})))
"""


@pytest.mark.parametrize("case", ["read-only file system", "permission denied"])
def test_a_folder_it_cannot_write_is_refused_in_one_line(case):
    """A folder on a file system mounted read-only (a bind mount made read-only, in a mount namespace of the run's
    own: `unshare -m`), and one whose mode bars this user (the run as nobody, 0o555): refused at zero.shard in one
    line saying which, before any file is made. Root alone can make either here; elsewhere the test is skipped."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root (a mount namespace, or another user)")
    base = pathlib.Path(tempfile.mkdtemp(prefix="offload-read-only-"))  # (nobody must reach it: not under pytest's
    try:                                                                 # 0o700 tmp_path)
        source, folder = base / "source", base / "offload"
        source.mkdir()
        folder.mkdir()
        os.chmod(source, 0o555)
        os.chmod(folder, 0o755 if case == "read-only file system" else 0o555)
        os.chmod(base, 0o755)  # (mkdtemp's is 0o700)
        (base / "warm").mkdir()
        code = READ_ONLY_RUN.format(root=processes.ROOT, tests=os.path.dirname(__file__), store=str(base / "store"),
                                    warm=str(base / "warm"), folder=str(folder), drop=case == "permission denied")
        command = [sys.executable, "-c", code]
        if case == "read-only file system":
            command = ["unshare", "-m", "sh", "-c", f'mount --bind "{source}" "{folder}" && mount -o remount,bind,ro '
                       f'"{folder}" && exec "{sys.executable}" -c "$0"', code]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if case == "read-only file system" and "mount" in done.stderr and done.returncode != 0:
            pytest.skip(f"no mount namespace here: {done.stderr.strip()}")
        assert done.returncode == 0, done.stderr[-2000:]
        kind, message = eval(done.stdout.strip().splitlines()[-1])
        assert kind == "OffloadRefused" and f"is not writable ({case})" in message and "\n" not in message, message
        assert os.listdir(folder) == [] and os.listdir(source) == []
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("change", ["flipped", "truncated"])
def test_a_file_changed_under_the_run_stops_the_next_step_in_one_line(local_group, tmp_path, change):
    results = local_group(2).run(changed_in_group, str(tmp_path / "offload"), change, timeout_s=60)
    expected = {"flipped": "fails its checksum", "truncated": "was cut short under the run"}[change]
    for rank, (kind, message) in enumerate(results):
        assert kind == "OffloadError" and expected in message and f"rank{rank}.offload" in message, message
        assert "\n" not in message


# ----------------------------------------------------------------------------------------------------------
# The trainer: --offload disk at --zero 3, under torchrun; a rank killed inside the streamed step
# ----------------------------------------------------------------------------------------------------------
SCRIPT = os.path.join(processes.ROOT, "ddp_cifar100.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def out_dir() -> pathlib.Path:
    return pathlib.Path(processes.folder(__name__))


def trainer_argv(name, *flags):
    out = out_dir()
    corpus = out / "corpus"
    if not corpus.exists():  # a few kilobytes of text: the trainer's --dataset text reads every file in a folder
        corpus.mkdir()
        for i in range(6):
            (corpus / f"part{i}.txt").write_text("".join(f"line {i} {j}: the quick brown fox {j * i % 7}\n"
                                                         for j in range(60)))
    return [SCRIPT, "--model", "gpt-tiny", "--dataset", "text", "--data-dir", str(corpus), "--context", "16",
            "--val-fraction", "0.3", "--batch-size", "4", "--grad-accum", "2", "--zero", "3", "--optimizer", "adamw",
            "--lr", "3e-3", "--clip-grad-norm", "0.5", "--max-steps", "6", "--checkpoint-every", "2", "--seed", "3",
            "--timeout", "60", "--checkpoint-dir", str(out / name), "--metrics-out", str(out / f"{name}.json"),
            *flags]


def test_the_trainer_says_a_refused_folder_once_and_exits_2(local_group, tmp_path):
    """ddp_cifar100.main on 2 ranks with --offload-dir a folder that does not exist: the same verdict on both, said
    by rank 0 alone in one line, exit 2 (bad input), before any training."""
    from trainer_testing import TINY, main_in_group
    argv = [*TINY, "--model", "resnet", "--zero", "3", "--max-steps", "1", "--offload", "disk", "--offload-dir",
            str(tmp_path / "nowhere")]
    rank0, rank1 = local_group(2).run(main_in_group, argv, timeout_s=120)
    assert (rank0["code"], rank1["code"]) == (2, 2)
    lines = [line for line in rank0["stderr"].splitlines() if line.startswith("ddp_cifar100.py: error:")]
    assert len(lines) == 1 and "nowhere does not exist" in lines[0] and "Traceback" not in rank0["stderr"], rank0
    assert "error" not in rank1["stderr"], rank1


EARLY_PROCESSES_FIXTURE = "trainer_runs"


def early_processes():
    """The trainer with offload and rank 0 SIGKILLed inside step 4's streamed step (after its first bucket's state was
    written behind), restarted by torchrun from the step-2 checkpoint."""
    (out_dir() / "files-killed").mkdir(exist_ok=True)
    return {"killed": (TORCHRUN[:-2] + ["--nproc_per_node", "2", "--max-restarts", "1"]
                       + trainer_argv("killed", "--offload", "disk", "--offload-dir", str(out_dir() / "files-killed")),
                       dict(ENV, DDP_CIFAR100_FAULT="0:3:offload"))}


@pytest.fixture(scope="module")
def trainer_runs(local_group):
    """The trainer on 2 ranks in memory and with offload (to a disk, and to host memory), in the suite's workers (as
    a torchrun's would run it: ddp_cifar100.main), beside the killed run under torchrun."""
    from trainer_testing import main_in_group
    (out_dir() / "files").mkdir(exist_ok=True)
    (out_dir() / "files-muon").mkdir(exist_ok=True)
    flags = {"memory": [], "offload": ["--offload", "disk", "--offload-dir", str(out_dir() / "files")],
             "host": ["--offload", "cpu"], "muon memory": ["--optimizer", "muon"],
             "muon": ["--optimizer", "muon", "--offload", "disk", "--offload-dir", str(out_dir() / "files-muon")]}

    def in_process():
        return {name: local_group(2).run(main_in_group, trainer_argv(name, *extra)[1:], timeout_s=240)[0]
                for name, extra in flags.items()}
    ran, processes_ran = processes.beside(sys.modules[__name__], in_process)
    for name, run in ran.items():
        assert run["code"] == 0, (name, run["stderr"][-3000:])
    for name, run in processes_ran.items():
        assert run.returncode == 0, (name, run.stderr[-3000:])
    return {**ran, **processes_ran}


def final_state(name):
    return zero.checkpoint.read_whole(out_dir() / name / "step-6", ("model", "optimizer"), alone=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["offload", "host", "muon", "killed"])
def test_the_trainer_with_offload_ends_as_without_it(trainer_runs, name):
    """(--optimizer muon: Muon and AdamW, each offloaded, against the same recipe in memory.)"""
    memory = json.loads((out_dir() / ("muon memory.json" if name == "muon" else "memory.json")).read_text())
    ours = None
    if name in ("offload", "host", "muon"):
        ours = json.loads((out_dir() / f"{name}.json").read_text())
        assert (ours["train_loss"], ours["val_loss"]) == (memory["train_loss"], memory["val_loss"])
        assert ours["state_bytes"]["optimizer"] < memory["state_bytes"]["optimizer"] / 100
        tiers = {rank["tier"] for rank in ours["offload"]["ranks"]}
        assert tiers == {"cpu" if name == "host" else "disk"}, tiers
    else:
        assert "resuming from" in trainer_runs["killed"].stdout and "optimizer step 2" in trainer_runs["killed"].stdout
    assert identical(final_state(name), final_state("muon memory" if name == "muon" else "memory"))
    if name != "host":
        assert os.listdir(out_dir() / {"offload": "files", "muon": "files-muon"}.get(name, "files-killed")) == []
