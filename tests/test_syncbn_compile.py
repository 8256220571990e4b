"""SyncBatchNorm under torch.compile(fullgraph=True): no graph break, forward and backward, with the one all_reduce
per pass kept in the compiled graphs and counted again as the compiled code runs; compiled equals eager; the
assignment's 16 cases compiled; the fused-kernel (CUDA) path traced by Dynamo on fake CUDA tensors; and the
trainer's --compile (the model's forward, or each block's).

fullgraph=True turns any graph break into an error, so each compiled call here is the proof that none is left: a
process-group query or a `.item()` in the traced path (what broke the graph before: `dist.is_initialized`,
`get_world_size`, and reading the global count on the host) makes it raise. The backend is aot_eager: Dynamo and
AOTAutograd trace exactly what inductor would receive, without generating code (inductor is the benchmark's,
compile_benchmark.py).

Why 1e-6 (relative to the values' scale): the compiled graphs run the same aten operations as eager; AOTAutograd
decomposes a few composite ones (the backward's sums), which may add in another order: a few float32 roundings,
1e-7 relative. The running statistics and the forward output come out bit for bit here, but are held to the same
bound. A real error (a missing all_reduce, statistics of one rank, a count taken locally) moves them at first
order, by the difference between the ranks' batches, O(0.1).
"""
import copy
import json

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import syncbn
from syncbn import SyncBatchNorm
from trainer_testing import TINY, train_in_group, try_train_in_group
from zero_testing import max_difference


def compiled_against_eager(rank, world_size, layout, dtype):
    """One training pass of a small model with a SyncBatchNorm, eager and compiled (fullgraph=True, aot_eager
    capturing the forward and backward graphs); the largest differences and the all_reduce count per graph."""
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    if layout == "2d":
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), SyncBatchNorm(6, affine=True), torch.nn.ReLU(),
                                    torch.nn.Linear(6, 3))
        x = torch.randn(5 + rank, 8)  # uneven batches: the global count is 5 + 6, not 2 x 5
    else:
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), SyncBatchNorm(6, affine=True), torch.nn.ReLU(),
                                    torch.nn.Flatten(), torch.nn.Linear(6 * 36, 3))
        x = torch.randn(3 + rank, 3, 8, 8)
        if layout == "channels_last":
            model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    x = x + rank  # the ranks' batches differ: a statistic of one rank alone is far from the global one
    eager = copy.deepcopy(model)
    graphs = []

    def capture(graph_module, _):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture), fullgraph=True)
    outputs, inputs = [], []
    for module in (eager, compiled):
        inp = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            out = module(inp)
        out.float().square().sum().backward()
        outputs.append(out.float())
        inputs.append(inp)
    norm_eager, norm_compiled = eager[1], model[1]
    scale = max(outputs[0].abs().max().item(), inputs[0].grad.abs().max().item(), 1.0)
    errors = {"output": (outputs[0] - outputs[1]).abs().max().item(),
              "grad_input": (inputs[0].grad - inputs[1].grad).abs().max().item(),
              "running_mean": (norm_eager.running_mean - norm_compiled.running_mean).abs().max().item(),
              "running_var": (norm_eager.running_var - norm_compiled.running_var).abs().max().item(),
              "grad_weight": (norm_eager.weight.grad - norm_compiled.weight.grad).abs().max().item()}
    counts = [sum("all_reduce" in str(node.target) for node in g.graph.nodes) for g in graphs]
    dynamo.reset()
    return {"errors": errors, "scale": scale, "all_reduces": counts}


CASES = {1: [("2d", "fp32")], 2: [("2d", "fp32"), ("channels_last", "bf16"), ("4d", "fp32")]}  # each compile ~1 s


@pytest.mark.parametrize("world_size", [1, 2])
def test_fullgraph_compiles_and_equals_eager(local_group, world_size):
    """No graph break (fullgraph), forward and backward; one all_reduce in each graph with 2 processes and none
    with 1 (nothing to synchronize); outputs, input gradients, running statistics and weight gradients of eager;
    contiguous and channels-last, float32 and bf16 autocast."""
    group = local_group(world_size)
    worst = 0.0
    for layout, dtype in CASES[world_size]:
        for result in group.run(compiled_against_eager, layout, dtype):
            assert result["all_reduces"] == ([1, 1] if world_size > 1 else [0, 0]), (layout, dtype, result)
            relative = max(result["errors"].values()) / result["scale"]
            assert relative <= 1e-6, (layout, dtype, result)
            worst = max(worst, relative)
    print(f"\nworst |compiled - eager| / scale at {world_size} process(es): {worst:.2e}")


# ----------------------------------------------------------------------------------------------------------
# The assignment's 16 cases, compiled, with the collectives counted as they run
# ----------------------------------------------------------------------------------------------------------
_COMPILED = {}  # per worker process: one compiled call, reused across the cases (one graph per hid_dim)


def all_reduces_run(fn) -> tuple[object, int]:
    """fn()'s result and how many all_reduce calls reached the process group while it ran: torch.profiler's
    "c10d::allreduce_" events, the op both eager (dist.all_reduce) and compiled code (the functional all_reduce
    Dynamo puts in the graph) go through. A TorchDispatchMode cannot count here: compiled code refuses to run
    under one."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = fn()
    return result, sum(event.name == "c10d::allreduce_" for event in profile.events())


def compiled_assignment_worker(rank, world_size, hid_dim, batch_size, seed):
    """test_syncbn's assignment case (nn.BatchNorm1d over the global batch, the loss on its first half), through
    torch.compile(fullgraph=True, dynamic=True): the batch size is symbolic, so the global count is a tensor
    computed in the graph (a count read on the host would break it). Eager runs the same case beside it."""
    import torch._dynamo.utils

    from test_syncbn import global_batch, rank_slice, rows_in_loss

    graphs = torch._dynamo.utils.counters["stats"]
    if "call" not in _COMPILED:
        _COMPILED["graphs_before"] = graphs["unique_graphs"]  # the counter is the process's: other tests add to it
        _COMPILED["call"] = torch.compile(lambda module, x: module(x), backend="aot_eager", fullgraph=True,
                                          dynamic=True)
    sizes = [batch_size] * world_size
    rows = rows_in_loss(rank, world_size, batch_size)
    results = {}
    for mode, call in (("eager", lambda module, x: module(x)), ("compiled", _COMPILED["call"])):
        x = rank_slice(global_batch(sizes, (hid_dim,), seed), sizes, rank).clone().requires_grad_()
        module = SyncBatchNorm(hid_dim)
        y, forward_all_reduces = all_reduces_run(lambda: call(module, x))
        _, backward_all_reduces = all_reduces_run(lambda: y[:rows].sum().backward())
        results[mode] = {"y": y.detach(), "grad": x.grad, "running_var": module.running_var,
                         "all_reduces": (forward_all_reduces, backward_all_reduces)}
    results["graphs"] = graphs["unique_graphs"] - _COMPILED["graphs_before"]
    return results


@pytest.mark.parametrize("batch_size", [32, 64])
@pytest.mark.parametrize("hid_dim", [128, 256, 512, 1024])
@pytest.mark.parametrize("num_workers", [1, 4])
def test_assignment_cases_compiled(local_group, num_workers, hid_dim, batch_size):
    """The 16 cases of test_syncbn.test_batchnorm compiled: nn.BatchNorm1d over the concatenated batch within the
    assignment's 1e-3 (output and input gradient), eager within the 1e-6 argued above, and, counted as the
    compiled code runs, one all_reduce in the forward and one in the backward (none with one process). At most
    one graph per hid_dim: the channel count is specialized, the batch size is not."""
    from test_syncbn import assignment_reference, max_error

    seed = 1000 * num_workers + hid_dim + batch_size
    results = local_group(num_workers).run(compiled_assignment_worker, hid_dim, batch_size, seed)
    y, grad = assignment_reference(num_workers, hid_dim, batch_size, seed)
    expected_all_reduces = (1, 1) if num_workers > 1 else (0, 0)
    errors = {}
    for mode in ("compiled", "eager"):
        errors[mode] = (max_error([r[mode]["y"] for r in results], y),
                        max_error([r[mode]["grad"] for r in results], grad))
        assert all(r[mode]["all_reduces"] == expected_all_reduces for r in results), (mode, results[0][mode])
    parity = max(max((r["compiled"][k] - r["eager"][k]).abs().max().item() for k in ("y", "grad", "running_var"))
                 for r in results)
    print(f"\n[{num_workers}-{hid_dim}-{batch_size}] compiled: worst output error {errors['compiled'][0]:.3g}, "
          f"input grad {errors['compiled'][1]:.3g}; |compiled - eager| {parity:.2e}; graphs {results[0]['graphs']}")
    assert max(errors["compiled"]) <= 1e-3
    assert parity <= 1e-6 * max(y.abs().max().item(), 1.0)  # y is normalized: O(1) values
    assert all(r["graphs"] <= 4 for r in results)


# ----------------------------------------------------------------------------------------------------------
# The CUDA kernel path, compiled without a GPU
# ----------------------------------------------------------------------------------------------------------
def cuda_path_dynamo_graph(rank, world_size, dtype, channels_last):
    """Dynamo's graph of SyncBatchNorm on the fused-kernel (CUDA) path, captured with fullgraph=True on
    FakeTensorMode tensors that claim device "cuda": no GPU is needed to trace. The graph holds sync_batch_norm as
    one autograd_function_apply whose forward and backward bodies are traced too (Dynamo speculates the backward
    when the input requires a gradient), so a break in either fails here. AOTAutograd's joint trace would run the
    autograd engine on "cuda", which needs a device: the backend takes Dynamo's graph and runs its forward on the
    fake tensors (the custom ops' fake implementations). Returns each body's collective and kernel ops."""
    import torch._dynamo as dynamo
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def capture(graph_module, _):
        graphs.append(graph_module)
        return graph_module.forward

    with FakeTensorMode(), torch.device("cuda"):
        module = SyncBatchNorm(8, affine=True)
        x = torch.empty(16, 8, 4, 3, dtype=getattr(torch, dtype))
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        kernels = syncbn._uses_kernels(x, module.weight, module.running_mean)
        y = torch.compile(module, backend=capture, fullgraph=True)(x)
        facts = {"kernels": kernels, "output": (y.device.type, y.dtype == x.dtype, y.stride() == x.stride())}
    dynamo.reset()
    (graph,) = graphs
    for name, body in graph.named_children():  # fwd_body_0, bwd_body_0
        facts[name] = [str(node.target) for node in body.graph.nodes if node.op == "call_function"
                       and ("all_reduce" in str(node.target) or str(node.target).startswith("syncbn."))]
    return facts


@pytest.mark.skipif(syncbn.triton is None,
                    reason="Triton is not installed: CUDA tensors take the PyTorch-ops path")
@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_kernel_path_compiles_fullgraph(local_group, world_size):
    """The fused kernels' path under torch.compile(fullgraph=True), traced on fake CUDA tensors: no graph break in
    the forward or the backward, the four kernel ops in place, one all_reduce in each body with 2 processes and
    none with 1; float32, float16 and channels-last bfloat16."""
    all_reduce = ["_c10d_functional.all_reduce"] if world_size > 1 else []
    for dtype, channels_last in (("float32", False), ("float16", False), ("bfloat16", True)):
        for facts in local_group(world_size).run(cuda_path_dynamo_graph, dtype, channels_last):
            assert facts["kernels"] and facts["output"] == ("cuda", True, True), facts
            assert facts["fwd_body_0"] == ["syncbn.local_sums.default"] + all_reduce + ["syncbn.normalize.default"]
            assert facts["bwd_body_0"] == ["syncbn.grad_sums.default"] + all_reduce + ["syncbn.grad_input.default"]


TRAIN = TINY + ["--model", "resnet", "--epochs", "1", "--max-steps", "3", "--bucket-mb", "0.01"]


def launches_before_a_compiled_backward(trace_path) -> int:
    """In a --profile trace: collectives launched inside a "backward" range, outside every compiled backward node
    (those are the syncs' hooks, not SyncBatchNorm's collective in the graph), while a compiled backward node of
    that same backward was still to start: communication that could overlap compiled computation. An order of
    events, not a timing: one graph's backward node starts before any hook fires, so with --compile forward there
    is none; with blocks, the later blocks' gradients are synchronized before the earlier blocks' backward runs."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    found = 0
    for backward in (e for e in events if e["name"] == "backward"):
        start, end = backward["ts"], backward["ts"] + backward["dur"]
        nodes = [(e["ts"], e["ts"] + e["dur"]) for e in events if start <= e["ts"] <= end
                 and e["name"] == "autograd::engine::evaluate_function: CompiledFunctionBackward"]
        launches = [e["ts"] for e in events if start <= e["ts"] <= end and e["name"].startswith("c10d::")
                    and not any(a <= e["ts"] <= b for a, b in nodes)]
        found += sum(any(a > launch for a, _ in nodes) for launch in launches)
    return found


# forward: the assignment's net (its SyncBatchNorm and layers in one graph; a ResNet in one graph costs a few more
# seconds of tracing per rank and adds only more of the same); blocks: the small ResNet, each block a graph
@pytest.mark.parametrize("scope,flags", [("forward", ["--model", "net"]), ("blocks", ["--zero", "3"])],
                         ids=["forward", "blocks-zero3"])
def test_trainer_compile_equals_eager(local_group, tmp_path, scope, flags):
    """--compile (aot_eager) through the trainer with SyncBatchNorm: 3 steps, the eager run's weights; the model's
    forward as one graph at stage 0, and each block's forward apart at stage 3 (its gathers stay in the blocks'
    hooks, outside the graphs). float32: the compiled backward adds a few sums in another order, and 3 SGD steps
    at lr 0.05 carry such roundings to a few 1e-8 (the drift the project measures: 4.5e-8 after 4 steps); a lost
    synchronization is O(1e-3). The compiled run's --profile trace (steps 1 and 2) shows what each scope does to
    the overlap of the syncs' collectives with the backward: none with one graph, some with blocks."""
    group = local_group(2)
    eager = group.run(train_in_group, TRAIN + flags)[0]
    compiled = group.run(train_in_group, TRAIN + flags + ["--compile", scope, "--compile-backend", "aot_eager",
                                                          "--profile", str(tmp_path), "--profile-steps", "1:3"])[0]
    difference = max_difference(eager["state"], compiled["state"])
    figures = compiled["metrics"]["compile"]
    overlapping = launches_before_a_compiled_backward(tmp_path / "rank0.pt.trace.json")
    print(f"\n--compile {scope} {' '.join(flags)}: max |dw| = {difference:.2e}; {figures}; {overlapping} "
          f"collectives launched before a compiled backward node of their backward")
    assert difference <= 1e-6
    assert eager["metrics"]["compile"] is None and figures["scope"] == scope and figures["graph_breaks"] == 0
    assert figures["graphs"] >= 1  # it did compile (in a reused worker, blocks may find graphs compiled before)
    assert (overlapping > 0) == (scope == "blocks")


@pytest.mark.parametrize("flags,message", [
    (["--zero", "3"], "--compile forward does not take --zero 3"),
    (["--grad-sync", "ddp", "--bucket-mb", "0.5"], "--compile with --grad-sync ddp takes --bucket-mb 1 or more")])
def test_trainer_compile_refuses_what_it_cannot_run_in_one_line(local_group, flags, message):
    result = local_group(2).run(try_train_in_group, TRAIN + flags + ["--compile"])
    assert all(r.startswith(f"UsageError: {message}") and "\n" not in r for r in result), result
