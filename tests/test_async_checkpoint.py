"""Saves in the background (zero/checkpoint/background.py, the trainer's --async-checkpoint): what is written is the
state of the step the save was asked at, though the loop goes on while it writes; a SIGKILL of a rank while its writer
writes leaves the previous checkpoint current, and the restarted run ends where the uninterrupted one ends; a write
that fails reaches the loop as one line; the staging buffers are kept from save to save.

- The library, at stage 3 on 2 processes (float64): a background save at step 1 while two more steps run holds
  exactly what a synchronous save at step 1 holds (model, optimizer, extra); a second save waits for the first (one
  in flight), reuses the same buffers (one copy of the rank's state: 3 x its shard of the weights for AdamW, and the
  step counts); a failing write raises, at wait, one line.
- The trainer (the tiny GPT, 2 processes, --checkpoint-every 1, 6 steps): under torchrun --max-restarts 1, rank 1
  SIGKILLed as its writer starts writing step 3's folder at --zero 3, and rank 0 (last.pt's writer) as it starts
  writing step 3's file at --zero 0: each restart resumes from step 2 and ends with the synchronous run's weights,
  bit for bit (the same kernels on the same split: nothing but the resume differs); an async run without a fault
  ends with them too and records its stalls; a failed write stops every rank with one line at the next step or
  save, the checkpoint before it still current.

The async save writes the same folder as a synchronous one (compared above, bit for bit), so what the sharded format
is tested for elsewhere (resume at other world sizes and stages: test_trainer_checkpoint.py, test_zero_checkpoint.py)
holds for it alike.
"""
import errno
import os
import sys
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import processes
import zero
from trainer_testing import main_in_group, train_in_group, word_corpus
from zero_testing import attempt, identical, seeded_model

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--max-restarts", "1"]
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ddp_cifar100.py")
STEPS = 6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 5))

    def forward(self, x):
        return self.layers(x)


def full_of_space(*args):
    raise OSError(errno.ENOSPC, "No space left on device")


def background_saves(rank, world_size, root):
    """Stage 3, AdamW, float64: a synchronous and a background save at step 1, two steps before its write starts, a
    second background save, and one whose write fails."""
    model = seeded_model(Net, 0)
    sharded = zero.shard(model, 3)
    optimizer = sharded.optimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(rank)

    def step():
        x, y = torch.randn(8, 12, generator=generator, dtype=torch.float64), torch.randint(0, 5, (8,))
        F.cross_entropy(sharded.module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    zero.checkpoint.save(os.path.join(root, "sync-1"), sharded, optimizer, {"step": 1})
    writer = zero.checkpoint.AsyncWriter()
    stepped = threading.Event()
    writer.before_write = stepped.wait  # the write starts only once the loop has changed every tensor it saves
    first = zero.checkpoint.save(os.path.join(root, "async-1"), sharded, optimizer, {"step": 1}, writer=writer)
    step()
    step()
    stepped.set()
    writer.before_write = None
    buffers = {key: buffer.data_ptr() for key, buffer in writer.staging.buffers.items()}
    zero.checkpoint.save(os.path.join(root, "async-3"), sharded, optimizer, {"step": 3}, writer=writer)
    first_done_before_second = first.done()
    writer.wait()
    reused = buffers == {key: buffer.data_ptr() for key, buffer in writer.staging.buffers.items()}
    shard_bytes = sum(piece.values.numel() * piece.values.element_size()
                      for pieces in sharded.held_pieces().values() for piece in pieces)
    writer.before_write = full_of_space
    zero.checkpoint.save(os.path.join(root, "async-fail"), sharded, optimizer, writer=writer)
    failure = attempt(writer.wait)
    writer.close()
    dist.barrier()
    return {"first_done_before_second": first_done_before_second, "reused": reused, "shard_bytes": shard_bytes,
            "staged_bytes": writer.staging.nbytes(), "parameters": len(list(model.parameters())), "failure": failure}


def test_a_background_save_holds_its_steps_state_and_reuses_its_buffers(local_group, tmp_path):
    results = local_group(2).submit(background_saves, str(tmp_path))()
    parts = ("model", "optimizer", "extra")
    written = zero.checkpoint.read_whole(tmp_path / "async-1", parts, alone=True)
    assert identical(written, zero.checkpoint.read_whole(tmp_path / "sync-1", parts, alone=True))
    assert written["extra"] == {"step": 1}
    assert zero.checkpoint.read_whole(tmp_path / "async-3", ("extra",), alone=True)["extra"] == {"step": 3}
    for result in results:
        assert result["first_done_before_second"] and result["reused"]
        # the weights' shard and AdamW's two moments, plus a few step counts (a 0-dim tensor per run of the shard)
        assert 0 < result["staged_bytes"] - 3 * result["shard_bytes"] <= 8 * result["parameters"], result
        kind, message = result["failure"]
        assert kind == "CheckpointError" and "No space left on device" in message and "\n" not in message


def argv_of(corpus, directory, zero_stage, *flags):
    return ["--device", "cpu", "--dataset", "text", "--model", "gpt-tiny", "--context", "16", "--val-fraction", "0.3",
            "--data-dir", str(corpus), "--batch-size", "4", "--grad-accum", "2", "--epochs", "1", "--seed", "5",
            "--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1", "--timeout", "60", "--zero",
            str(zero_stage), "--checkpoint-every", "1", "--max-steps", str(STEPS), "--checkpoint-dir",
            str(directory), *flags]


def runs_in_group(rank, world_size, corpus, root):
    """The synchronous references at --zero 3 and 0, an async run without a fault, and an async run whose writes
    fail from step 3 on (trainer.faults.FaultPlan.at patched in this worker: the disk full as the writer starts)."""
    out = {name: train_in_group(rank, world_size, argv_of(corpus, os.path.join(root, name), stage, *flags))
           for name, stage, flags in (("sync 3", 3, ()), ("sync 0", 0, ()), ("async 3", 3, ("--async-checkpoint",)))}
    for name in out:
        out[name]["metrics"] = {key: out[name]["metrics"][key] for key in ("checkpoint_stalls_s",
                                                                           "checkpoint_final_wait_s")}
    from trainer import faults
    at = faults.FaultPlan.at

    def disk_full_from_step_3(plan, point, step):
        if point == "write" and step >= 3:
            full_of_space()
        at(plan, point, step)
    faults.FaultPlan.at = disk_full_from_step_3
    try:
        out["full"] = main_in_group(rank, world_size, argv_of(corpus, os.path.join(root, "full"), 3,
                                                             "--async-checkpoint"))
    finally:
        faults.FaultPlan.at = at
    return out


EARLY_PROCESSES_FIXTURE = "runs"  # the fixture that collects them (conftest.py queues them for its tests)


def early_processes():
    """The runs killed mid-write, under torchrun (run in the background: tests/processes.py)."""
    root = processes.folder(__name__)
    corpus, env = word_corpus(os.path.join(root, "corpus")), dict(os.environ, OMP_NUM_THREADS="1")
    return {name: (TORCHRUN + [SCRIPT] + argv_of(corpus, os.path.join(root, name), stage, "--async-checkpoint"),
                   dict(env, DDP_CIFAR100_FAULT=fault))
            for name, stage, fault in (("killed 3", 3, "1:3:write"), ("killed 0", 0, "0:3:write"))}


@pytest.fixture(scope="module")
def runs(local_group):
    """{"in_group": runs_in_group's results by rank, "launched": the killed runs' CompletedProcess by name}."""
    root = processes.folder(__name__)
    in_group, launched = processes.beside(  # the synchronous runs while they run, on early_processes' corpus
        sys.modules[__name__], lambda: local_group(2).submit(runs_in_group, os.path.join(root, "corpus"), root)())
    return {"root": root, "in_group": in_group, "launched": launched}


def final_weights(root, name):
    if name.endswith("0"):
        return torch.load(os.path.join(root, name, "last.pt"), map_location="cpu", weights_only=True)["model"]
    return zero.checkpoint.read_whole(os.path.join(root, name, f"step-{STEPS}"), ("model",), alone=True)["model"]


@pytest.mark.parametrize("name", ["killed 3", "killed 0"])
def test_a_rank_killed_while_its_writer_writes_resumes_from_the_previous_checkpoint(runs, name):
    """Rank 1 (a folder's part) or rank 0 (last.pt's writer) SIGKILLed as its writer starts on step 3's save, the
    loop gone on: the restart resumes from step 2 and ends with the synchronous run's weights, bit for bit."""
    done = runs["launched"][name]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "optimizer step 2" in done.stdout and "resuming from" in done.stdout, done.stdout[-2000:]
    ours, reference = final_weights(runs["root"], name), runs["in_group"][0][f"sync {name[-1]}"]["state"]
    print(f"\n{name} under --async-checkpoint vs the synchronous run: max |dw| = "
          f"{max((ours[k] - reference[k]).abs().max().item() for k in reference):.1e}")
    assert identical(ours, reference)


def test_an_async_run_ends_with_the_synchronous_runs_weights_and_records_its_stalls(runs):
    for rank in runs["in_group"]:
        assert identical(rank["async 3"]["state"], rank["sync 3"]["state"])
        metrics = rank["async 3"]["metrics"]
        assert len(metrics["checkpoint_stalls_s"]) == STEPS and metrics["checkpoint_final_wait_s"] >= 0
        assert len(rank["sync 3"]["metrics"]["checkpoint_stalls_s"]) == STEPS


def test_a_failed_background_write_stops_every_rank_in_one_line(runs):
    """The disk full as the writer starts on step 3's save: every rank exits 2 at the next step or save, rank 0
    says why in one line, and step 2 stays current and whole."""
    root = runs["root"]
    for rank, result in enumerate(r["full"] for r in runs["in_group"]):
        assert result["code"] == 2, result
        if rank == 0:
            lines = [line for line in result["stderr"].splitlines() if line.strip()]
            assert len(lines) == 1 and "No space left on device" in lines[0], lines
            assert "the checkpoint before it is still current" in lines[0]
    with open(os.path.join(root, "full", "latest")) as f:
        assert f.read() == "step-2\n"
    assert zero.checkpoint.read_whole(os.path.join(root, "full", "step-2"), ("extra",),
                                      alone=True)["extra"]["optimizer_steps"] == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: staging from CUDA into pinned host memory")
def test_staging_a_cuda_state_copies_into_pinned_host_buffers_kept_from_save_to_save():
    """On a GPU (docs/gpu.md's pytest-cuda check runs it: -k cuda): a state on the device, a whole tensor and a
    Shards of two pieces, is staged into pinned host buffers equal to it; a second stage of the changed state reuses
    the same buffers and holds the new values (the non-blocking copies waited for)."""
    device = torch.device("cuda")
    weights = torch.randn(1000, device=device)
    state = {"step": torch.tensor(3.0, device=device), "extra": {"note": "a"},
             "w": zero.checkpoint.Shards((1000,), weights.dtype, (0,), [(0, 400, weights[:400]),
                                                                        (400, 1000, weights[400:])])}
    staging = zero.checkpoint.StagingBuffers()
    staged = staging.stage(state)
    assert all(buffer.is_pinned() and buffer.device.type == "cpu" for buffer in staging.buffers.values())
    assert torch.equal(torch.cat([values for _, _, values in staged["w"].pieces]), weights.cpu())
    assert staged["step"].item() == 3.0 and staged["extra"] == {"note": "a"}
    pointers = {key: buffer.data_ptr() for key, buffer in staging.buffers.items()}
    weights.mul_(2)
    state["step"].add_(1)
    again = staging.stage(state)
    assert pointers == {key: buffer.data_ptr() for key, buffer in staging.buffers.items()}
    assert torch.equal(torch.cat([values for _, _, values in again["w"].pieces]), weights.cpu())
    assert again["step"].item() == 4.0
