"""Tests for syncbn.py against nn.BatchNorm*d over the concatenated global batch (and float64 references).

Multi-process cases run in the session's reusable gloo groups (conftest.local_group), world sizes 1 and 4 only,
and in one more group of 4 whose Triton kernels run interpreted on CPU tensors (TRITON_INTERPRET=1): the fused
CUDA kernels' own code, checked against the same references on a machine without a GPU.
Each worker rebuilds the same global batch from a seed and takes its own rank-major slice; the reference is
computed here, in the test process, from the same global batch. The worst error of every comparison is
printed (pytest -s shows it), and merged into the file SYNCBN_ERRORS_JSON names when it is set:
``SYNCBN_ERRORS_JSON=results/syncbn-test-errors.json python3 -m pytest test_syncbn.py`` refreshes the committed
figures. Unset, as in the suite, nothing is written: a test run leaves the work tree as it found it.
"""
import json
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import syncbn
from files import write_json
from harness import LocalGroup

# SYNCBN_ERRORS_JSON (a path from the repository's root): the file a run's worst errors are merged into, only when
# set; the GPU checks (benchmarks/gpu_checks.py) name one of the GPU's own, apart from the CPU's.
ERRORS_JSON = os.environ.get("SYNCBN_ERRORS_JSON")
WORST_ERRORS: dict[str, dict[str, float]] = {}
BATCHNORM_BY_NDIM = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce", "broadcast",
               "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "gather", "scatter", "barrier", "send", "recv", "isend", "irecv")


@pytest.fixture(scope="module", autouse=True)
def write_worst_errors():
    """After the module, when SYNCBN_ERRORS_JSON names a file: merge this run's worst errors into it (a partial run
    keeps the rest)."""
    yield
    if not WORST_ERRORS or ERRORS_JSON is None:
        return
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), ERRORS_JSON)
    try:
        with open(path) as f:
            merged = json.load(f)["worst_abs_errors"]
    except (OSError, ValueError, KeyError, TypeError):
        merged = {}
    merged.update(WORST_ERRORS)
    write_json(path, {"torch": torch.__version__, "worst_abs_errors": dict(sorted(merged.items()))})


def record(case: str, **errors: float) -> None:
    WORST_ERRORS[case] = {name: float(value) for name, value in errors.items()}
    print(f"\n{case}: " + ", ".join(f"worst {name} error {value:.3g}" for name, value in errors.items()))


def max_error(results: list[torch.Tensor], reference: torch.Tensor) -> float:
    """Largest |ours - reference| over the ranks' slices (results in rank order, rank-major reference)."""
    ours = torch.cat([r.double() for r in results])
    assert ours.shape == reference.shape
    return (ours - reference.double()).abs().max().item() if ours.numel() else 0.0


def global_batch(sizes, tail_shape, seed, offset=0.0, dtype=torch.float32):
    """The concatenation of every rank's batch: rank r holds rows sum(sizes[:r]) ... sum(sizes[:r+1])-1."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(sum(sizes), *tail_shape, generator=generator, dtype=torch.float64) + offset).to(dtype)


def rank_slice(tensor, sizes, rank):
    start = sum(sizes[:rank])
    return tensor[start:start + sizes[rank]]


def random_affine(module, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
        module.bias.copy_(torch.randn(module.num_features, generator=generator))


class OpLog(TorchDispatchMode):
    """Every ATen (and syncbn::) operation called below the autograd layer, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.views = set()  # operations that return a view of their input: they move no data

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func), args))
        if func.is_view:
            self.views.add(str(func))
        return func(*args, **(kwargs or {}))


_INTERPRETED: dict[str, LocalGroup] = {}


@pytest.fixture(params=["ops", "kernels"])
def groups(request, local_group):
    """world_size -> a live group running syncbn on CPU tensors: through its PyTorch-operations path ("ops"), or
    through its fused Triton kernels, interpreted (TRITON_INTERPRET=1, read when syncbn is imported, so these 4
    workers have it set before their first task imports syncbn; the group is kept for the session and rebuilt if a
    case broke it)."""
    if request.param == "ops":
        return local_group
    if syncbn.triton is None:
        pytest.skip("Triton is not installed")
    group = _INTERPRETED.get("group")
    if group is None or group.closed:
        group = _INTERPRETED["group"] = LocalGroup(4, env={"TRITON_INTERPRET": "1"})

    def get(world_size):
        assert world_size == 4, "the interpreted group has 4 workers"
        return group
    get.kernels = True
    return get


@pytest.fixture(scope="module", autouse=True)
def close_interpreted_group():
    yield
    if "group" in _INTERPRETED:
        _INTERPRETED.pop("group").close()


def uses_kernels(groups) -> bool:
    return getattr(groups, "kernels", False)


def path(groups) -> str:
    return "kernels" if uses_kernels(groups) else "ops"


# ----------------------------------------------------------------------------------------------------------
# Worker functions: fn(rank, world_size, *args), run in every process of a LocalGroup
# ----------------------------------------------------------------------------------------------------------
def rows_in_loss(rank, world_size, batch_size):
    """The assignment's loss is the sum of the outputs of the first half of the global batch: this rank's share."""
    return min(max(world_size * batch_size // 2 - rank * batch_size, 0), batch_size)


def assignment_reference(num_workers, hid_dim, batch_size, seed):
    """nn.BatchNorm1d over the concatenated batch, the same loss: its output and input gradient."""
    x = global_batch([batch_size] * num_workers, (hid_dim,), seed).requires_grad_()
    y = nn.BatchNorm1d(hid_dim, affine=False)(x)
    y[: num_workers * batch_size // 2].sum().backward()
    return y.detach(), x.grad


def assignment_worker(rank, world_size, hid_dim, batch_size, seed):
    sizes = [batch_size] * world_size
    x = rank_slice(global_batch(sizes, (hid_dim,), seed), sizes, rank).clone().requires_grad_()
    y = syncbn.SyncBatchNorm(hid_dim)(x)
    y[:rows_in_loss(rank, world_size, batch_size)].sum().backward()
    return y.detach(), x.grad


def general_worker(rank, world_size, sizes, tail_shape, seed, offset, dtype, affine, momentum, channels_last=False):
    """Forward + backward with a random cotangent; returns outputs, grads and the state after the step."""
    x = rank_slice(global_batch(sizes, tail_shape, seed, offset, dtype), sizes, rank).clone()
    if channels_last == "strided":  # neither contiguous nor channels-last: dim 0 varies fastest
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    elif channels_last:
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    x.requires_grad_()
    cotangent = rank_slice(global_batch(sizes, tail_shape, seed + 1, 0.0, dtype), sizes, rank)
    bn = syncbn.SyncBatchNorm(tail_shape[0], affine=affine, momentum=momentum)
    if affine:
        random_affine(bn, seed + 2)
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = bn(x)
    y.backward(cotangent)
    return {"y": y.detach(), "grad": x.grad, "state": bn.state_dict(), "strides": (y.stride(), x.grad.stride()),
            "saved_bytes": sum(saved.values()),
            "input_strides": x.stride(), "kernels": syncbn._uses_kernels(x, bn.weight, bn.running_mean),
            "weight_grad": bn.weight.grad if affine else None, "bias_grad": bn.bias.grad if affine else None}


def running_stats_worker(rank, world_size, sizes_per_step, num_features, seed, momentum):
    """Several training steps, then eval on the last batch; returns the buffers after every step."""
    bn = syncbn.SyncBatchNorm(num_features, momentum=momentum)
    states = []
    for step, sizes in enumerate(sizes_per_step):
        x = rank_slice(global_batch(sizes, (num_features,), seed + step, 3.0), sizes, rank)
        bn(x)
        states.append({k: v.clone() for k, v in bn.state_dict().items()})
    bn.eval()
    return states, bn(x)


def collective_count_worker(rank, world_size):
    calls = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    counts = {}
    try:
        for name, fn in originals.items():
            setattr(dist, name, counting(name, fn))
        bn = syncbn.SyncBatchNorm(8, affine=True, momentum=None)
        x = torch.randn(5 + rank, 8, 3, requires_grad=True)
        y = bn(x)
        counts["forward"], calls[:] = list(calls), []
        y.backward(torch.randn_like(y))
        counts["backward"], calls[:] = list(calls), []
        bn.eval()
        bn(x)
        counts["eval"], calls[:] = list(calls), []
        unsynced_eval = syncbn.SyncBatchNorm(8, track_running_stats=False).eval()
        eval_batch_stats = unsynced_eval(x.detach())
        counts["eval_without_running_stats"] = list(calls)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counts, x.detach(), eval_batch_stats, syncbn._uses_kernels(x, bn.weight, bn.running_mean)


def too_few_values_worker(rank, world_size, sizes):
    x = rank_slice(global_batch(sizes, (3,), seed=5), sizes, rank)
    try:
        return syncbn.SyncBatchNorm(3)(x)
    except ValueError as error:
        return f"ValueError: {error}"


# ----------------------------------------------------------------------------------------------------------
# The assignment's test
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [32, 64])
@pytest.mark.parametrize("hid_dim", [128, 256, 512, 1024])
@pytest.mark.parametrize("num_workers", [1, 4])
def test_batchnorm(local_group, num_workers, hid_dim, batch_size):
    seed = 1000 * num_workers + hid_dim + batch_size
    results = local_group(num_workers).run(assignment_worker, hid_dim, batch_size, seed)
    y, grad = assignment_reference(num_workers, hid_dim, batch_size, seed)
    output_error = max_error([r[0] for r in results], y)
    grad_error = max_error([r[1] for r in results], grad)
    record(f"test_batchnorm[{num_workers}-{hid_dim}-{batch_size}]", output=output_error, input_grad=grad_error)
    assert output_error <= 1e-3 and grad_error <= 1e-3


# ----------------------------------------------------------------------------------------------------------
# Properties of syncbn.py
# ----------------------------------------------------------------------------------------------------------
def test_one_all_reduce_forward_one_backward_none_in_eval(groups):
    results = groups(4).run(collective_count_worker)
    for counts, x, eval_output, kernels in results:
        assert kernels == uses_kernels(groups)
        assert counts == {"forward": ["all_reduce"], "backward": ["all_reduce"], "eval": [],
                          "eval_without_running_stats": []}
        # Without running statistics, eval normalizes with this rank's own batch, as nn.SyncBatchNorm does.
        reference = nn.BatchNorm1d(8, affine=False, track_running_stats=False).eval()(x)
        assert torch.allclose(eval_output, reference, rtol=0, atol=1e-5)
    if uses_kernels(groups):
        return
    # A world of one runs no collective at all.
    (counts, _, _, _), = groups(1).run(collective_count_worker)
    assert all(calls == [] for calls in counts.values())


@pytest.mark.parametrize("ndim,channels_last", [(2, False), (3, False), (4, False), (5, False), (4, True), (5, True),
                                                (2, "strided")])
def test_uneven_batches_zero_size_rank_and_affine_grads_are_local(groups, ndim, channels_last):
    sizes = [3, 0, 7, 1]
    tail_shape = {2: (6,), 3: (6, 4), 4: (6, 2, 3), 5: (6, 2, 2, 2)}[ndim]
    seed = 50 + ndim
    results = groups(4).run(general_worker, sizes, tail_shape, seed, 0.0, torch.float32, True, 0.1, channels_last)
    # The path asked for ran, and the output and input gradient keep the input's memory format.
    assert all(r["kernels"] == uses_kernels(groups) for r in results)
    if channels_last != "strided":  # (other strides go through a contiguous copy)
        assert all(r["strides"] == (r["input_strides"],) * 2 for r in results if r["y"].numel())
    # Kept for backward: the input, and per-channel vectors (statistics, weight, the 2C + 1 sums).
    assert all(r["saved_bytes"] <= r["y"].numel() * 4 + 64 * 6 for r in results)

    x = global_batch(sizes, tail_shape, seed).requires_grad_()
    cotangent = global_batch(sizes, tail_shape, seed + 1)
    reference = BATCHNORM_BY_NDIM[ndim](6)
    random_affine(reference, seed + 2)
    y = reference(x)
    y.backward(cotangent)
    stats_error = max((results[0]["state"][k] - reference.state_dict()[k]).abs().max().item()
                      for k in ("running_mean", "running_var"))

    assert results[1]["y"].shape == (0, *tail_shape) and results[1]["grad"].shape == (0, *tail_shape)
    output_error = max_error([r["y"] for r in results], y.detach())
    grad_error = max_error([r["grad"] for r in results], x.grad)
    # Affine gradients are each rank's own share: BatchNorm's gradient with the cotangent of that rank's rows.
    param_error = 0.0
    for rank, result in enumerate(results):
        mask = torch.zeros(sum(sizes), *[1] * (ndim - 1))
        rank_slice(mask, sizes, rank).fill_(1)
        y_again = F.batch_norm(x, None, None, reference.weight, reference.bias, training=True)
        local_weight, local_bias = torch.autograd.grad(y_again, [reference.weight, reference.bias], cotangent * mask)
        param_error = max(param_error, (result["weight_grad"] - local_weight).abs().max().item(),
                          (result["bias_grad"] - local_bias).abs().max().item())
    summed_weight_grad = sum(r["weight_grad"] for r in results)
    param_error = max(param_error, (summed_weight_grad - reference.weight.grad).abs().max().item())
    layout = {False: "contiguous", True: "channels_last"}.get(channels_last, channels_last)
    record(f"test_uneven_batches[{path(groups)}-{ndim}d-{layout}]", output=output_error, input_grad=grad_error,
           affine_grad=param_error,
           running_stats=stats_error)
    assert output_error <= 1e-5 and grad_error <= 1e-5 and param_error <= 1e-4 and stats_error <= 1e-6
    assert all(torch.equal(r["state"]["running_var"], results[0]["state"]["running_var"]) for r in results)


def test_large_offset_matches_float64_reference(groups):
    """1000 + N(0, 1) in float32: E[x^2] - E[x]^2 in float32 is off by more than 1e-3; ours must not be."""
    sizes, tail_shape, seed, offset = [40, 24, 0, 33], (16, 5), 7, 1000.0  # naive formula: 2.4 off at 16 channels
    results = groups(4).run(general_worker, sizes, tail_shape, seed, offset, torch.float32, False, 0.1)

    x64 = global_batch(sizes, tail_shape, seed, offset, torch.float32).double().requires_grad_()
    y64 = F.batch_norm(x64, None, None, training=True)
    y64.backward(global_batch(sizes, tail_shape, seed + 1).double())
    output_error = max_error([r["y"] for r in results], y64.detach())
    grad_error = max_error([r["grad"] for r in results], x64.grad)
    var64 = x64.detach().transpose(0, 1).reshape(tail_shape[0], -1).var(dim=1)
    var_rel_error = ((results[2]["state"]["running_var"].double() - (0.9 + 0.1 * var64)) / var64).abs().max().item()

    # The naive one-pass formula, on the same float32 data, to show this test tells the two apart.
    x32 = x64.detach().float()
    mean_x, mean_x2 = x32.mean((0, 2)), (x32 * x32).mean((0, 2))
    naive = (x32 - mean_x[:, None]) * torch.rsqrt((mean_x2 - mean_x * mean_x).clamp_min(0)[:, None] + 1e-5)
    naive_error = (naive.double() - y64.detach()).abs().max().item()

    # The same data in a world of one, without any process group.
    x_local = x64.detach().float().requires_grad_()
    y_local = syncbn.SyncBatchNorm(tail_shape[0])(x_local)
    y_local.backward(global_batch(sizes, tail_shape, seed + 1))
    local_error = max((y_local.double() - y64).abs().max().item(), (x_local.grad.double() - x64.grad).abs().max().item())
    record(f"test_large_offset[{path(groups)}]", output=output_error, input_grad=grad_error,
           running_var_relative=var_rel_error,
           world_of_one=local_error, naive_fp32_formula=naive_error)
    assert naive_error > 1e-3
    assert output_error <= 1e-3 and grad_error <= 1e-3 and local_error <= 1e-3 and var_rel_error <= 1e-4


@pytest.mark.parametrize("dtype,offset,tolerance", [(torch.float16, 100.0, 3e-3), (torch.bfloat16, 10.0, 2e-2)])
def test_half_precision_inputs(groups, dtype, offset, tolerance):
    """Statistics in float32 (statistics in the input dtype would be off by far more than an output ulp)."""
    sizes, tail_shape, seed = [5, 0, 9, 4], (16, 3), 21
    results = groups(4).run(general_worker, sizes, tail_shape, seed, offset, dtype, True, 0.1)

    x = global_batch(sizes, tail_shape, seed, offset, dtype).double().requires_grad_()
    reference = nn.BatchNorm1d(16).double()
    random_affine(reference, seed + 2)
    y = reference(x)
    y.backward(global_batch(sizes, tail_shape, seed + 1, 0.0, dtype).double())
    for r in results:
        assert r["y"].dtype == dtype and r["grad"].dtype == dtype
        assert r["state"]["running_mean"].dtype == torch.float32 and r["weight_grad"].dtype == torch.float32
    output_error = max_error([r["y"] for r in results], y.detach())
    grad_error = max_error([r["grad"] for r in results], x.grad)
    mean_error = (results[0]["state"]["running_mean"].double() - reference.running_mean).abs().max().item()
    record(f"test_half_precision[{path(groups)}-{dtype}]", output=output_error, input_grad=grad_error,
           running_mean=mean_error)
    if uses_kernels(groups) and dtype == torch.bfloat16:
        # Triton's interpreter converts float32 to bfloat16 by truncation (its cast passes no rounding mode): up to
        # a whole ulp (2^-5 at |y| in [4, 8)), where the GPU's conversion (cvt.rn) rounds to nearest (half of it).
        tolerance *= 2
    assert output_error <= tolerance and grad_error <= tolerance and mean_error <= 1e-5 * offset


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_state_dict_and_eval_match_batchnorm(groups, momentum):
    sizes_per_step = [[2, 5, 0, 3], [4, 4, 4, 4], [1, 0, 0, 6], [3, 1, 2, 1]]
    seed, num_features = 31, 10
    results = groups(4).run(running_stats_worker, sizes_per_step, num_features, seed, momentum)

    reference = nn.BatchNorm1d(num_features, affine=False, momentum=momentum)
    worst = 0.0
    for step, sizes in enumerate(sizes_per_step):
        reference(global_batch(sizes, (num_features,), seed + step, 3.0))
        for states, _ in results:
            assert states[step]["num_batches_tracked"].item() == step + 1
            for key in ("running_mean", "running_var"):
                worst = max(worst, (states[step][key] - reference.state_dict()[key]).abs().max().item())
    # Eval uses the running statistics: compare with nn.BatchNorm1d in eval mode on each rank's last batch.
    reference.eval()
    sizes = sizes_per_step[-1]
    last = global_batch(sizes, (num_features,), seed + len(sizes_per_step) - 1, 3.0)
    eval_error = max_error([eval_output for _, eval_output in results], reference(last))
    # state_dicts move both ways.
    into_torch = nn.BatchNorm1d(num_features, affine=False, momentum=momentum)
    into_torch.load_state_dict(results[0][0][-1])
    into_ours = syncbn.SyncBatchNorm(num_features, momentum=momentum)
    into_ours.load_state_dict(reference.state_dict())
    into_ours.eval()
    into_torch.eval()
    round_trip_error = max((into_torch(last) - reference(last)).abs().max().item(),
                           (into_ours(last) - reference(last)).abs().max().item())
    record(f"test_running_stats[{path(groups)}-momentum={momentum}]", running_stats=worst, eval_output=eval_error,
           state_dict_round_trip=round_trip_error)
    assert worst <= 1e-6 and eval_error <= 1e-5 and round_trip_error <= 1e-5
    assert into_ours.num_batches_tracked.item() == len(sizes_per_step)


def test_fewer_than_two_values_per_channel_raises(groups):
    results = groups(4).run(too_few_values_worker, [0, 1, 0, 0])
    assert all(isinstance(r, str) and r.startswith("ValueError: Expected more than 1 value") for r in results)
    # Two values in all, on two ranks, is enough, and the group is still usable after the error above.
    results = groups(4).run(too_few_values_worker, [1, 0, 1, 0])
    assert all(isinstance(r, torch.Tensor) for r in results)
    reference = nn.BatchNorm1d(3, affine=False)(global_batch([1, 0, 1, 0], (3,), seed=5))
    assert max_error(results, reference) <= 1e-5
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        syncbn.SyncBatchNorm(3)(torch.randn(1, 3))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        syncbn.SyncBatchNorm(3)(torch.randn(1, 3, 1, 1))
    syncbn.SyncBatchNorm(3).eval()(torch.randn(1, 3))  # eval with running statistics needs no batch


def test_bad_input_shapes_give_clear_errors():
    bn = syncbn.SyncBatchNorm(4)
    for bad in (torch.randn(4), torch.randn(2, 4, 1, 1, 1, 1)):
        with pytest.raises(ValueError, match=r"expects a 2D, 3D, 4D or 5D input") as error:
            bn(bad)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"expects 4 channels in dimension 1, got an input of shape \(2, 5\)"):
        bn(torch.randn(2, 5))


@pytest.mark.parametrize("ndim", [2, 3, 4, 5])
def test_world_of_one_without_process_group(ndim):
    assert not dist.is_initialized()
    shape = (4, 3, 2, 3, 2)[:ndim]
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    cotangent = torch.randn(*shape, dtype=torch.float64)
    ours, reference = syncbn.SyncBatchNorm(3, affine=True).double(), BATCHNORM_BY_NDIM[ndim](3).double()
    random_affine(reference, 3)
    ours.load_state_dict(reference.state_dict())
    ours(x).backward(cotangent)
    reference(x_ref).backward(cotangent)
    assert torch.allclose(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    assert torch.allclose(ours.weight.grad, reference.weight.grad, rtol=0, atol=1e-12)
    assert torch.allclose(ours.running_var, reference.running_var, rtol=0, atol=1e-12)


def test_hand_derived_backward_passes_gradcheck_and_allows_inplace_relu():
    x = torch.randn(5, 3, 2, dtype=torch.float64, requires_grad=True)
    weight = torch.rand(3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def function(x, weight, bias):
        return syncbn.sync_batch_norm.apply(x, weight, bias, None, None, 0.1, 1e-5, None)

    assert torch.autograd.gradcheck(function, (x, weight, bias))
    # syncbn saves a tensor of its own (xhat), not the output: an in-place op on the output stays legal and
    # leaves the gradient right.
    bn = syncbn.SyncBatchNorm(3)
    nn.ReLU(inplace=True)(bn(x)).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    nn.ReLU(inplace=True)(nn.BatchNorm1d(3).double()(x_ref)).sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_saved_for_backward_bytes_at_most_batchnorm(dtype):
    """What the layer keeps between forward and backward costs no more than what nn.BatchNorm1d keeps."""
    def saved_bytes(module, x):
        storages = {}

        def pack(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            module(x)
        return sum(storages.values())

    x = torch.randn(64, 8).to(dtype).requires_grad_()
    ours, theirs = saved_bytes(syncbn.SyncBatchNorm(8), x), saved_bytes(nn.BatchNorm1d(8, affine=False), x)
    # The input itself on both sides, plus a few per-channel vectors.
    assert x.numel() * x.element_size() <= ours <= theirs


class ActivationWrites(TorchDispatchMode):
    """The dtype of every activation-sized tensor an operation writes: new outputs (views excluded: they move no
    data) and tensors it modifies in place."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.dtypes = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        written = [] if func.is_view else [t for t in (out if isinstance(out, (tuple, list)) else [out])]
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written.append(kwargs.get(argument.name, args[index] if index < len(args) else None))
        written = {id(t): t for t in written if isinstance(t, torch.Tensor)}  # an in-place op returns its input
        self.dtypes += [t.dtype for t in written.values() if t.numel() >= self.numel]
        return out


def activation_traffic(module, x, cotangent):
    """One forward + backward: activation-sized writes seen at the dispatcher (dtypes), activation-sized
    allocations seen by the profiler (bytes: this also catches temporaries made inside an operation, such as
    the float32 copy a CPU reduction makes of a bf16 input), and the bytes kept for backward (saved tensors,
    once per storage)."""
    from torch.profiler import ProfilerActivity, profile

    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    x = x.detach().requires_grad_()
    writes = ActivationWrites(x.numel())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        with writes, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            y = module(x)
        with writes:
            y.backward(cotangent)
    # Activation-sized: at least half the activation's bytes (a float32 copy of a bf16 input is twice them).
    allocations = [event.self_cpu_memory_usage for event in profiler.events()
                   if event.self_cpu_memory_usage >= x.numel() * x.element_size() // 2]
    return {"writes": writes.dtypes, "allocations": allocations, "saved_bytes": sum(saved.values())}


@pytest.mark.parametrize("shape,channels_last", [((8192, 128), False), ((8, 32, 64, 64), False),
                                                 ((8, 32, 64, 64), True), ((8, 32, 4096), False), ((64, 16), False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_activation_writes_and_saved_bytes_against_batchnorm(shape, channels_last, dtype):
    """The CPU path's traffic, counted: at most 2 activation-sized writes (and allocations) more than
    nn.BatchNorm's per forward + backward, none wider than the input, and no more bytes kept for backward.
    nn.BatchNorm writes the output and the input gradient; ours adds x - k and a second pass over dx; its
    per-channel dot products take blocks of at most syncbn.CACHED_VALUES values (1/8 of these activations),
    except that an activation of at most that many is one block: a temporary per dot product (the last case)."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=generator, dtype=dtype)
    cotangent = torch.randn(*shape, generator=generator, dtype=dtype)
    if channels_last:
        x, cotangent = (t.contiguous(memory_format=torch.channels_last) for t in (x, cotangent))
    reference = BATCHNORM_BY_NDIM[len(shape)](shape[1], affine=True).to(dtype)
    ours = syncbn.SyncBatchNorm(reference.num_features, affine=True).to(dtype)
    theirs_traffic, ours_traffic = activation_traffic(reference, x, cotangent), activation_traffic(ours, x, cotangent)
    activation_bytes = x.numel() * x.element_size()
    print(f"\n{dtype} {shape} {'channels-last' if channels_last else 'contiguous'}: activation-sized writes ours "
          f"{len(ours_traffic['writes'])} / nn.BatchNorm {len(theirs_traffic['writes'])}, allocations "
          f"{len(ours_traffic['allocations'])} / {len(theirs_traffic['allocations'])}, bytes kept for backward "
          f"{ours_traffic['saved_bytes']} / {theirs_traffic['saved_bytes']} (activation {activation_bytes})")
    cached = 2 if x.numel() <= syncbn.CACHED_VALUES else 0
    assert len(theirs_traffic["writes"]) == 2  # the output and the input gradient
    assert len(ours_traffic["writes"]) <= len(theirs_traffic["writes"]) + 2 + cached
    assert all(written == dtype for written in ours_traffic["writes"])
    assert len(ours_traffic["allocations"]) <= len(theirs_traffic["allocations"]) + 2 + cached
    assert all(nbytes <= activation_bytes for nbytes in ours_traffic["allocations"])
    assert activation_bytes <= ours_traffic["saved_bytes"] <= theirs_traffic["saved_bytes"]


def test_no_pytorch_batch_norm_statistics_or_backward(monkeypatch):
    """The statistics and the backward are ours. The one batch-norm kernel used is an eval-mode batch_norm with OUR
    statistics: a fused per-channel affine pass (y = (x - mean) / sqrt(var + eps) * w + b) that computes nothing."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a PyTorch batch-norm statistics or backward internal was called")

    for module, name in [(torch, "batch_norm_stats"), (torch, "batch_norm_elemt"),
                         (torch, "batch_norm_gather_stats_with_counts"), (torch, "batch_norm_backward_reduce"),
                         (torch, "batch_norm_backward_elemt"), (torch, "native_batch_norm_backward")]:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, forbidden)
    with OpLog() as log:
        x = torch.randn(6, 3, 2, requires_grad=True)
        bn = syncbn.SyncBatchNorm(3, affine=True)
        bn(x).backward(torch.randn(6, 3, 2))
        bn.eval()
        bn(x)
    assert x.grad is not None and bn.weight.grad is not None
    batch_norms = [args for name, args in log.calls if "batch_norm" in name]
    assert batch_norms and all(name == "aten.native_batch_norm.default" for name, _ in log.calls
                               if "batch_norm" in name)
    assert all(args[5] is False for args in batch_norms)  # training=False: running_mean/var are ours, used as is


def test_convert_sync_batchnorm_keeps_parameters_buffers_and_modes():
    model = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6),
        nn.Sequential(nn.Conv2d(6, 5, 1), nn.BatchNorm2d(5, momentum=None, eps=1e-3)),
        nn.BatchNorm3d(5, affine=False), nn.SyncBatchNorm(5, track_running_stats=False), nn.ReLU())
    model[2][1].weight.requires_grad_(False)
    model[3].eval()
    model[1].running_mean.fill_(0.25)
    model[1].num_batches_tracked.fill_(7)
    originals = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    state_before = {k: v.clone() for k, v in model.state_dict().items()}

    converted = syncbn.SyncBatchNorm.convert_sync_batchnorm(model)
    converted_modules = dict(converted.named_modules())
    for name, original in originals.items():
        new = converted_modules[name]
        assert type(new) is syncbn.SyncBatchNorm
        assert (new.num_features, new.eps, new.momentum, new.affine, new.track_running_stats, new.training) == (
            original.num_features, original.eps, original.momentum, original.affine,
            original.track_running_stats, original.training)
        assert new.weight is original.weight and new.bias is original.bias
        assert new.running_mean is original.running_mean and new.num_batches_tracked is original.num_batches_tracked
    assert converted_modules["2.1"].weight.requires_grad is False and converted_modules["3"].training is False
    assert type(converted_modules["5"]) is nn.ReLU and type(converted_modules["0"]) is nn.Linear
    assert all(torch.equal(state_before[k], v) for k, v in converted.state_dict().items())
    assert state_before.keys() == converted.state_dict().keys()
    single = syncbn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3))
    assert type(single) is syncbn.SyncBatchNorm


class _StandInGroup:
    """What sync_batch_norm asks of a process group, for tracing without peers."""

    def size(self) -> int:
        return 2


@pytest.mark.parametrize("dtype,channels_last", [(torch.float32, False), (torch.float16, False),
                                                 (torch.bfloat16, True)])
def test_cuda_path_traced_with_fake_tensors_has_no_host_sync(monkeypatch, dtype, channels_last):
    """The CUDA code path on a CPU-only machine: FakeTensorMode tensors claim device "cuda" and raise on any
    read of a value on the host (.item(), int(), a branch on a tensor), which on a GPU would be a sync.

    Forward and backward (node.apply: the autograd engine itself would need a real GPU) run the synchronized
    path with a stand-in all_reduce: exactly one per pass, on CUDA tensors, nothing read on the host, and the
    work done by the fused kernels' four custom ops (their fake implementations stand in for the launches).
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    if syncbn.triton is None:
        pytest.skip("Triton is not installed: CUDA tensors take the PyTorch-ops path")
    collectives = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: collectives.append(tensor.device.type))
    with FakeTensorMode(), torch.device("cuda"):
        bn = syncbn.SyncBatchNorm(8, affine=True, momentum=None)
        x = torch.empty(16, 8, 4, 3, dtype=dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        with OpLog() as log:
            y = syncbn.sync_batch_norm.apply(x, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                             1.0 / bn.num_batches_tracked.add_(1), bn.eps, _StandInGroup())
            forward_collectives = list(collectives)
            grad_input, grad_weight, grad_bias, *_ = y.grad_fn.apply(torch.ones_like(y))
        assert (y.device.type, y.dtype, grad_input.device.type, grad_input.dtype) == ("cuda", dtype, "cuda", dtype)
        assert y.stride() == x.stride() and grad_input.stride() == x.stride()
        assert grad_weight.dtype == torch.float32 and bn.running_var.device.type == "cuda"
        # A world of one takes its count from the shape; eval uses the running statistics.
        assert bn(x).device.type == "cuda" and bn.eval()(x).dtype == dtype
        with pytest.raises(DataDependentOutputException):
            int(y.sum())  # the guard works: a host read fails loudly here
    assert forward_collectives == ["cuda"] and collectives == ["cuda", "cuda"]
    kernel_ops = Counter(name for name, _ in log.calls if name.startswith("syncbn."))
    assert kernel_ops == {"syncbn.local_sums.default": 1, "syncbn.normalize.default": 1,
                          "syncbn.grad_sums.default": 1, "syncbn.grad_input.default": 1}
    # Around them only C-sized work: no other operation makes or fills a tensor of the activation's size.
    big = [name for name, args in log.calls if not name.startswith(("syncbn.", "prim.")) and name not in log.views
           and any(isinstance(a, torch.Tensor) and a.numel() >= x.numel() for a in args)]
    assert big == ["aten.ones_like.default"], big  # the stand-in cotangent


@pytest.mark.skipif(syncbn.triton is None, reason="Triton is not installed")
def test_kernels_compile_for_hopper(tmp_path, monkeypatch):
    """Every fused kernel, for every dtype and flag it is launched with, compiles to a Hopper (sm_90) binary here,
    without a GPU: Triton's compiler and ptxas run on the CPU. The interpreter (above) checks what the kernels
    compute; this checks that the GPU compiler accepts them, in a fresh cache so nothing is taken on trust."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    tiles = {"C": "i32", "rows": "i32", "row_blocks": "i32", "units": "i32", "units_per_split": "i32",
             "plane_stride": "i32", "row_stride": "i32", "channel_stride": "i32", "splits": "i32",
             "momentum": "fp32", "eps": "fp32", "count": "i32", "sums_ptr": "*fp64", "stat_sums_ptr": "*fp64"}

    def compile_kernel(kernel, activation_dtype, **constexprs):
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in ("x_ptr", "y_ptr", "dy_ptr", "dx_ptr"):
                signature[name] = activation_dtype
            else:
                signature[name] = tiles.get(name, "*fp32")
        if kernel is syncbn._grad_sums_total_kernel:
            signature["sums_ptr"] = "*fp32"
        # Triton's JIT turns an integer argument equal to 1 into a constant (C = 1, a split of one unit, ...):
        # compile each kernel that way too, every such argument at once, but those it keeps from that.
        if constexprs.pop("ones", False):
            keep = {param.name for param in kernel.params if param.do_not_specialize}
            for name, kind in signature.items():
                if kind == "i32" and name not in keep:
                    signature[name], constexprs[name] = "constexpr", 1
        warps = 8 if "BLOCK_R" in constexprs else 4  # as syncbn launches them
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert compiled.asm["cubin"], kernel

    import triton
    blocks = {"BLOCK_R": 64, "BLOCK_C": 64}
    for ones in (False, True):
        compile_kernel(syncbn._shifted_sums_kernel, "*bf16", ones=ones, **blocks)
        compile_kernel(syncbn._grad_sums_kernel, "*bf16", ones=ones, **blocks)
        compile_kernel(syncbn._grad_input_kernel, "*bf16", HAS_WEIGHT=True, ones=ones, **blocks)
        compile_kernel(syncbn._normalize_kernel, "*bf16", HAS_WEIGHT=True, HAS_RUNNING=True, MOMENTUM_TENSOR=True,
                       ones=ones, **blocks)
        compile_kernel(syncbn._local_sums_kernel, "*fp32", BLOCK_C=64, BLOCK_S=16, ones=ones)
        compile_kernel(syncbn._grad_sums_total_kernel, None, BLOCK_C=64, BLOCK_S=16, ones=ones)
    for activation_dtype in ("*fp32", "*fp16"):
        compile_kernel(syncbn._shifted_sums_kernel, activation_dtype, **blocks)
        compile_kernel(syncbn._grad_sums_kernel, activation_dtype, **blocks)
        for affine in (True, False):
            compile_kernel(syncbn._grad_input_kernel, activation_dtype, HAS_WEIGHT=affine, **blocks)
            compile_kernel(syncbn._normalize_kernel, activation_dtype, HAS_WEIGHT=affine, HAS_RUNNING=True,
                           MOMENTUM_TENSOR=affine, **blocks)
    compile_kernel(syncbn._normalize_kernel, "*bf16", HAS_WEIGHT=False, HAS_RUNNING=False, MOMENTUM_TENSOR=False,
                   BLOCK_R=1024, BLOCK_C=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_host_device_sync_on_cuda():
    """A world of one on CUDA; the synchronized path runs the same kernels around its all_reduce."""
    bn = syncbn.SyncBatchNorm(8, affine=True, momentum=None).cuda()
    x = torch.randn(16, 8, 4, device="cuda", dtype=torch.float16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = bn(x)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert y.dtype == torch.float16 and x.grad.dtype == torch.float16


@pytest.mark.skipif(not torch.cuda.is_available() or syncbn.triton is None, reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("shape,channels_last", [((8, 64, 14, 14), True), ((8, 64, 14, 14), False),
                                                 ((16, 2048, 7, 7), True), ((33, 100), False)])
def test_fused_kernels_on_cuda_match_float64_batchnorm(dtype, tolerance, shape, channels_last):
    """The Triton kernels on a GPU, world of one: output, input and affine gradients and running statistics
    against nn.BatchNorm in float64 on the same values (fp16/bf16: within about an output ulp)."""
    generator = torch.Generator().manual_seed(11)
    x = (torch.randn(*shape, generator=generator, dtype=torch.float64) * 2 + 5).to(dtype)
    cotangent = torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)
    if channels_last:
        x, cotangent = (t.contiguous(memory_format=torch.channels_last) for t in (x, cotangent))
    reference = BATCHNORM_BY_NDIM[len(shape)](shape[1]).double()
    random_affine(reference, 12)
    ours = syncbn.SyncBatchNorm(shape[1], affine=True).cuda()
    ours.load_state_dict(reference.state_dict())
    x_ours = x.cuda().requires_grad_()
    y = ours(x_ours)
    y.backward(cotangent.cuda())
    assert syncbn._uses_kernels(x_ours, ours.weight, ours.running_mean)
    assert y.dtype == dtype and y.stride() == x_ours.stride() and x_ours.grad.stride() == x_ours.stride()
    x_ref = x.double().requires_grad_()
    y_ref = reference(x_ref)
    y_ref.backward(cotangent.double())
    errors = {"output": (y.double().cpu() - y_ref).abs().max().item(),
              "input_grad": (x_ours.grad.double().cpu() - x_ref.grad).abs().max().item(),
              "weight_grad": ((ours.weight.grad.double().cpu() - reference.weight.grad).abs().max()
                              / reference.weight.grad.abs().max()).item(),
              "running_var": (ours.running_var.double().cpu() - reference.running_var).abs().max().item()}
    record(f"test_fused_kernels_on_cuda[{dtype}-{shape}-{channels_last}]", **errors)
    assert errors["output"] <= tolerance and errors["input_grad"] <= tolerance
    assert errors["weight_grad"] <= max(tolerance, 1e-4) and errors["running_var"] <= 1e-5


def cuda_worker(rank, world_size, sizes, tail_shape, seed):
    """Ours and nn.SyncBatchNorm on this rank's slice, on the GPU (several ranks share it over gloo)."""
    torch.cuda.set_device(0)
    x = rank_slice(global_batch(sizes, tail_shape, seed), sizes, rank).cuda()
    cotangent = rank_slice(global_batch(sizes, tail_shape, seed + 1), sizes, rank).cuda()
    out = {}
    for name, layer in (("ours", syncbn.SyncBatchNorm(tail_shape[0], affine=True)),
                        ("torch", nn.SyncBatchNorm(tail_shape[0], affine=True))):
        random_affine(layer, seed + 2)
        x_in = x.clone().requires_grad_()
        y = layer.cuda()(x_in)
        y.backward(cotangent)
        out[name] = {"y": y.detach().cpu(), "grad": x_in.grad.cpu(), "running_var": layer.running_var.cpu()}
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_synchronized_cuda_path_matches_batchnorm_and_nn_syncbatchnorm(local_group):
    """Two ranks on one GPU over gloo (NCCL refuses two ranks on one GPU): the synchronized CUDA path against
    nn.BatchNorm2d on the concatenated batch (float64) and against nn.SyncBatchNorm on the same ranks."""
    sizes, tail_shape, seed = [6, 3], (5, 4, 3), 77
    results = local_group(2).run(cuda_worker, sizes, tail_shape, seed)
    x = global_batch(sizes, tail_shape, seed).double().requires_grad_()
    reference = nn.BatchNorm2d(5).double()
    random_affine(reference, seed + 2)
    y = reference(x)
    y.backward(global_batch(sizes, tail_shape, seed + 1).double())
    for name in ("ours", "torch"):
        output_error = max_error([r[name]["y"] for r in results], y.detach())
        grad_error = max_error([r[name]["grad"] for r in results], x.grad)
        stats_error = (results[0][name]["running_var"].double() - reference.running_var).abs().max().item()
        record(f"test_synchronized_cuda_path[{name}]", output=output_error, input_grad=grad_error,
               running_var=stats_error)
        # float32 against float64: values of size ~3, a few float32 roundings (ulp 2.4e-7) per element
        assert output_error <= 1e-5 and grad_error <= 1e-5 and stats_error <= 1e-6
