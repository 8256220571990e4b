"""utils.py: device and backend resolution on machines this one is not (GPUs faked with monkeypatch); any exception in
one line."""
import pytest
import torch

import utils


@pytest.fixture
def gpus(monkeypatch):
    """fake(n): make torch report n CUDA GPUs; set_device becomes a no-op."""
    def fake(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    return fake


@pytest.mark.parametrize("local_rank,local_world_size,gpu_count,device,backend,expected", [
    (0, 1, 0, "auto", "auto", ("cpu", "gloo")),
    (1, 2, 2, "auto", "auto", ("cuda:1", "nccl")),
    (1, 2, 1, "auto", "auto", ("cpu", "gloo")),       # fewer GPUs than processes: auto stays on the CPU
    (1, 2, 1, "cuda", "auto", ("cuda:0", "gloo")),    # asked for: gloo over CUDA tensors on the one GPU
    (0, 1, 1, "cuda", "nccl", ("cuda:0", "nccl")),
])
def test_device_and_backend_resolution(gpus, local_rank, local_world_size, gpu_count, device, backend, expected):
    gpus(gpu_count)
    torch_device, chosen = utils.resolve_device_backend(device, backend, local_rank, local_world_size)
    assert (str(torch_device), chosen) == expected


@pytest.mark.parametrize("gpu_count,device,backend,message", [
    (1, "cuda", "nccl", "--backend nccl needs a GPU per process: 2 processes on this node, 1 GPU"),
    (0, "cuda", "auto", "--device cuda: no CUDA GPU is visible"),
    (2, "cpu", "nccl", "--backend nccl needs --device cuda"),
])
def test_impossible_placements_are_refused_in_one_line(gpus, gpu_count, device, backend, message):
    gpus(gpu_count)
    with pytest.raises(ValueError, match=message) as error:
        utils.resolve_device_backend(device, backend, 0, 2)
    assert "\n" not in str(error.value)


def test_an_exception_is_one_line_of_its_type_and_message():
    """Line breaks and runs of spaces one space, the type named, a long message cut; DCP's exception (every failed
    rank's traceback) said as its first failure."""
    from torch.distributed.checkpoint.api import CheckpointException
    assert utils.one_line(ValueError("no\n  such\tfile ")) == "ValueError: no such file"
    assert utils.one_line(KeyError()) == "KeyError"
    long = utils.one_line(RuntimeError("x" * 1000))
    assert len(long) == utils.LINE and long.endswith(" ...")
    failed = CheckpointException("rank 1 failed", {1: (OSError(28, "No space left on device"), None)})
    assert utils.one_line(failed) == "OSError: [Errno 28] No space left on device"
