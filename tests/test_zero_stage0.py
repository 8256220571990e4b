"""zero/stage0.py: the hand-written gradient averaging against DistributedDataParallel, inside the trainer (the
session's reusable gloo workers, ``local_group``)."""
import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ddp_cifar100 as trainer
import references
from collectives import Collectives
from trainer import build as trainer_build
from models import build_model
from trainer_testing import TINY, train_in_group
from zero.stage0 import GradientSync
from zero_testing import max_difference


def count_all_reduces(rank, world_size, argv):
    """train() with dist.all_reduce counted per training micro-batch, and whether each call came while backward
    was still running (before the first layer's weight gradient, the last one backward produces, was ready)."""
    calls = []  # (micro-batch index, first layer's gradient ready yet, dtype)
    micro_batch = [-1]
    first_layer_done = [False]
    real_all_reduce, real_build_model = dist.all_reduce, trainer_build.build_model

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append((micro_batch[0], first_layer_done[0], tensor.dtype))
        return real_all_reduce(tensor, *args, **kwargs)

    def instrumented_build_model(*args, **kwargs):
        model = real_build_model(*args, **kwargs)

        def on_forward(module, _inputs):
            if module.training:  # evaluation forwards are not micro-batches
                micro_batch[0] += 1
                first_layer_done[0] = False

        model.register_forward_pre_hook(on_forward)
        # Registered before the trainer's own hooks, so it runs first when that gradient is accumulated.
        next(model.parameters()).register_post_accumulate_grad_hook(lambda p: first_layer_done.__setitem__(0, True))
        return model

    dist.all_reduce, trainer_build.build_model = counting_all_reduce, instrumented_build_model
    try:
        metrics = trainer.train(trainer.parse_args(argv)).metrics
    finally:
        dist.all_reduce, trainer_build.build_model = real_all_reduce, real_build_model
    return {"calls": calls, "micro_batches": micro_batch[0] + 1, "optimizer_steps": metrics["optimizer_steps"]}


@pytest.mark.parametrize("sync_mode", ["overlap", "after"])
def test_custom_gradient_sync_matches_ddp(local_group, sync_mode):
    argv = TINY + ["--grad-accum", "3", "--epochs", "2", "--norm", "custom", "--bucket-mb", "0.02", "--seed", "2"]
    ours = local_group(2).run(train_in_group, argv + ["--grad-sync", "custom", "--sync-mode", sync_mode])
    ddp = local_group(2).run(train_in_group, argv + ["--grad-sync", "ddp"])
    worst = max_difference(ours[0]["state"], ddp[0]["state"])
    print(f"\ncustom ({sync_mode}) vs DDP, dropout on, 8 steps: max |dw| = {worst:.2e}")
    assert worst < 1e-6
    assert ours[0]["metrics"]["val_correct"] == ddp[0]["metrics"]["val_correct"]


@pytest.mark.parametrize("sync_mode", ["overlap", "after"])
def test_no_all_reduce_on_accumulation_micro_batches(local_group, sync_mode):
    grad_accum, epochs = 3, 2
    argv = TINY + ["--grad-accum", str(grad_accum), "--epochs", str(epochs), "--norm", "local",
                   "--grad-sync", "custom", "--sync-mode", sync_mode, "--bucket-mb", "0.5"]
    result = local_group(2).run(count_all_reduces, argv)[0]
    per_epoch = 8  # 64 samples per rank / micro-batches of 8
    assert result["micro_batches"] == epochs * per_epoch
    stepping = {e * per_epoch + j for e in range(epochs) for j in range(per_epoch)
                if (j + 1) % grad_accum == 0 or j == per_epoch - 1}
    training_calls = [c for c in result["calls"] if c[2] == torch.float32]
    # the rest: the summary's float64 maxima over ranks (peak memory, state bytes, bytes sent), after training
    rest = [c for c in result["calls"] if c[2] != torch.float32]
    assert rest and all(c[2] == torch.float64 and c[0] == result["micro_batches"] - 1 for c in rest)
    by_micro_batch = {}
    for micro_batch, _, _ in training_calls:
        by_micro_batch[micro_batch] = by_micro_batch.get(micro_batch, 0) + 1
    assert set(by_micro_batch) == stepping  # nothing at all on the K-1 accumulation micro-batches
    buckets = set(by_micro_batch.values())
    assert len(buckets) == 1 and buckets.pop() >= 2  # one all_reduce per bucket per step, several buckets
    during_backward = sum(1 for _, first_layer_done, _ in training_calls if not first_layer_done)
    if sync_mode == "overlap":
        assert during_backward >= len(stepping)  # each step starts a bucket before backward is over
    else:
        assert during_backward == 0


class DDPWithoutForwardSyncBuffers(DistributedDataParallel):
    """DistributedDataParallel as torch 2.11 and older have it: broadcast_buffers, no forward_sync_buffers."""
    broadcast_buffers_given = []

    def __init__(self, module, device_ids=None, bucket_cap_mb=None, broadcast_buffers=True,
                 gradient_as_bucket_view=False):
        self.broadcast_buffers_given.append(broadcast_buffers)
        super().__init__(module, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb,
                         broadcast_buffers=broadcast_buffers, gradient_as_bucket_view=gradient_as_bucket_view)


def train_with_older_ddp(rank, world_size, argv):
    real = references.DistributedDataParallel
    references.DistributedDataParallel = DDPWithoutForwardSyncBuffers
    try:
        return dict(train_in_group(rank, world_size, argv),
                    broadcast_buffers=DDPWithoutForwardSyncBuffers.broadcast_buffers_given.pop())
    finally:
        references.DistributedDataParallel = real


def test_ddp_on_a_torch_without_forward_sync_buffers(local_group):
    """--grad-sync ddp starts on an older DDP, asks it not to broadcast buffers before each forward (as
    forward_sync_buffers=False does), and trains to the current DDP's weights on every rank."""
    argv = TINY + ["--model", "net", "--norm", "local", "--grad-sync", "ddp", "--dropout", "0", "--epochs", "1",
                   "--max-steps", "3"]
    older = local_group(2).run(train_with_older_ddp, argv)
    current = local_group(2).run(train_in_group, argv)
    for rank in (0, 1):
        state = current[rank]["state"]
        assert all(torch.equal(older[rank]["state"][k], state[k]) for k in state), rank
    assert [r["broadcast_buffers"] for r in older] == [False, False]


# ----------------------------------------------------------------------------------------------------------
# CUDA buckets on a machine without a GPU: tensors that claim the device, and stand-ins for what needs one
# ----------------------------------------------------------------------------------------------------------
class ClaimsCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA (``device``, ``is_cuda``), so code that branches on the device
    takes its CUDA path while the memory stays on the host."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func == torch.Tensor.device.__get__:
            return torch.device("cuda", 0)
        if func == torch.Tensor.is_cuda.__get__:
            return True
        return super().__torch_function__(func, types, args, kwargs or {})


class StandInEvent:
    def record(self, stream=None):
        pass


class StandInStream:
    def __init__(self, device=None):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


def host_only(point_to_point):
    """gloo's isend/irecv take host memory only; on a CUDA pointer its I/O thread aborts the process."""
    def call(tensor, *args, **kwargs):
        if tensor.device.type != "cpu":
            raise RuntimeError(f"gloo point-to-point got a tensor on {tensor.device}: host memory only")
        return point_to_point(tensor, *args, **kwargs)
    return call


@contextlib.contextmanager
def cuda_stand_ins():
    """Host-only point-to-point, and CUDA events, streams and pinning that do nothing (the memory is the host's)."""
    saved = (dist.isend, dist.irecv, torch.cuda.Event, torch.cuda.Stream, torch.cuda.stream, torch.Tensor.pin_memory)
    dist.isend, dist.irecv = host_only(dist.isend), host_only(dist.irecv)
    torch.cuda.Event, torch.cuda.Stream = StandInEvent, StandInStream
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.Tensor.pin_memory = lambda self: self
    try:
        yield
    finally:
        (dist.isend, dist.irecv, torch.cuda.Event, torch.cuda.Stream, torch.cuda.stream,
         torch.Tensor.pin_memory) = saved


def one_step_gradients(rank, world_size, allreduce, memory_format, claim_cuda=False):
    """Rank-specific data through a small ResNet, averaged by GradientSync (buckets claiming CUDA on request),
    beside the same model's plain gradients averaged with all_reduce. Returns both, and every warning raised."""
    torch.manual_seed(0)
    model = build_model("resnet", 0.0, "local").to(memory_format=memory_format)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught, cuda_stand_ins():
        warnings.simplefilter("always")
        sync = GradientSync(model, bucket_mb=0.02, overlap=True, comm=Collectives(kind=allreduce))
        if claim_cuda:
            sync.flats = [flat.as_subclass(ClaimsCuda) for flat in sync.flats]  # the .grad views share them
        try:
            generator = torch.Generator().manual_seed(1 + rank)
            images = torch.randn(4, 3, 32, 32, generator=generator).contiguous(memory_format=memory_format)
            labels = torch.randint(0, 100, (4,), generator=generator)
            F.cross_entropy(model(images), labels).backward()  # averaged when it returns
        finally:
            sync.close()
    F.cross_entropy(reference(images), labels).backward()
    expected = []
    for p in reference.parameters():
        dist.all_reduce(p.grad)
        expected.append(p.grad / world_size)
    return {"grads": [p.grad.clone() for p in model.parameters()], "expected": expected,
            "grad_strides": [p.grad.stride() for p in model.parameters()],
            "param_strides": [p.stride() for p in model.parameters()],
            "warnings": [str(w.message) for w in caught]}


@pytest.mark.parametrize("allreduce", ["ring", "butterfly"])
def test_ring_and_butterfly_on_cuda_buckets_send_host_memory_only(local_group, allreduce):
    """--allreduce ring|butterfly with CUDA gradients over gloo: what reaches isend/irecv is host memory (the
    buckets go through host buffers), and the average is the all_reduce's, to the bit (2 ranks: (a + b) / 2
    either way)."""
    for result in local_group(2).run(one_step_gradients, allreduce, torch.contiguous_format, True):
        assert all(torch.equal(g, e) for g, e in zip(result["grads"], result["expected"]))


def test_channels_last_gradients_have_their_parameters_strides(local_group):
    """--channels-last: each bucket view handed out as .grad has its parameter's strides, so autograd neither
    warns about the gradient layout contract nor copies, and the average is still the all_reduce's."""
    for result in local_group(2).run(one_step_gradients, "torch", torch.channels_last):
        assert result["grad_strides"] == result["param_strides"]
        assert not [w for w in result["warnings"] if "gradient layout contract" in w], result["warnings"]
        assert all(torch.equal(g, e) for g, e in zip(result["grads"], result["expected"]))
