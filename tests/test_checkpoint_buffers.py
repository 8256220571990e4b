"""One definition of a model's buffers in every checkpoint format (zero/checkpoint/state_dict.py's [Note: one
definition of a buffer]): with per-process BatchNorm (--norm local) every rank's running statistics differ, and
every sync, in either format, keeps rank 0's, as last.pt and DistributedDataParallel do. The assignment's net, one
step of plain SGD: the same run saved by --zero 0 (last.pt), --zero 1 and 3 (folders), ddp (last.pt), FSDP2
(a folder) and DiLoCo (last.pt) on 2 processes, and by --zero 0 and --zero 3 --replicas 2 on 4, holds the same
buffers bit for bit (rank 0's computation is the same in every sync); and a run resumed at another sync evaluates
as the uninterrupted run does (float64), since both evaluate with rank 0's statistics.
"""
import os

import pytest
import torch

import zero
from trainer_testing import TINY, collect_all, train_in_group

NET = TINY + ["--model", "net", "--norm", "local", "--momentum", "0", "--epochs", "1"]
SYNCS_ON_2 = {"zero 0": ["--zero", "0"], "zero 1": ["--zero", "1"], "zero 3": ["--zero", "3"],
              "ddp": ["--grad-sync", "ddp"], "fsdp": ["--grad-sync", "fsdp", "--zero", "3"],
              "diloco": ["--grad-sync", "diloco", "--replicas", "2", "--local-steps", "1"]}
SYNCS_ON_4 = {"zero 0": ["--zero", "0"], "zero 3 replicas": ["--zero", "3", "--replicas", "2"]}


def buffers_of(directory):
    """The buffers of the checkpoint a run left in ``directory``: last.pt's, or the current folder's."""
    if os.path.exists(os.path.join(directory, "last.pt")):
        model = torch.load(os.path.join(directory, "last.pt"), weights_only=True)["model"]
    else:
        with open(os.path.join(directory, "latest")) as f:
            model = zero.checkpoint.read_whole(os.path.join(directory, f.read().strip()), ("model",),
                                               alone=True)["model"]
    return {name: value for name, value in model.items() if "running" in name or "num_batches" in name}


def runs_in_group(rank, world_size, argvs):
    """Trainer runs in turn in one call of the group."""
    for argv in argvs:
        train_in_group(rank, world_size, argv)


@pytest.fixture(scope="module")
def saved(local_group, tmp_path_factory):
    """Each sync's one step, saved: the 2-process runs in turn on one group, beside the 4-process runs on another."""
    root = tmp_path_factory.mktemp("buffers")
    pending, keys = {}, []
    for world, syncs, batch in ((2, SYNCS_ON_2, "8"), (4, SYNCS_ON_4, "4")):
        argvs = [NET + ["--batch-size", batch, "--max-steps", "1", "--checkpoint-dir", str(root / f"{world} {name}"),
                        *flags] for name, flags in syncs.items()]
        keys += [(world, name) for name in syncs]
        pending[world] = local_group(world).submit(runs_in_group, argvs)
    collect_all(pending)
    return {key: buffers_of(root / f"{key[0]} {key[1]}") for key in keys}


@pytest.mark.parametrize("world,reference", [(2, "zero 0"), (4, "zero 0")])
def test_every_sync_and_format_keeps_rank_0s_buffers(saved, world, reference):
    expected = saved[world, reference]
    assert expected and any("running_var" in name for name in expected)
    for (w, name), buffers in saved.items():
        if w == world:
            assert buffers.keys() == expected.keys(), name
            worst = max((buffers[k].double() - expected[k].double()).abs().max().item() for k in expected)
            assert worst == 0, f"{name} on {world} processes: buffers {worst:.1e} from {reference}'s"


def test_a_run_resumed_at_another_sync_evaluates_as_the_uninterrupted_run(local_group, tmp_path):
    """Saved at --zero 3 (a folder) after 1 step, resumed at --zero 1 to step 2, in float64: the same validation as
    the uninterrupted --zero 0 run (the steps agree to float64's rounding; the statistics are rank 0's in both)."""
    argv = NET + ["--batch-size", "8"]
    folder = ["--checkpoint-dir", str(tmp_path / "run")]
    whole = local_group(2).run(train_in_group, argv + ["--max-steps", "2"], "float64")[0]["metrics"]
    local_group(2).run(train_in_group, argv + ["--zero", "3", "--max-steps", "1", *folder], "float64")
    resumed = local_group(2).run(train_in_group, argv + ["--zero", "1", "--max-steps", "2", *folder], "float64")
    resumed = resumed[0]["metrics"]
    assert resumed["optimizer_steps"] == whole["optimizer_steps"] == 2
    assert resumed["val_correct"] == whole["val_correct"]
    assert resumed["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-12)
