"""Tests for allreduce.py: ring and butterfly all-reduce against the float64 mean, on local gloo groups, and the
trainer averaging its gradients with them.

Each world size is one LocalGroup (the session-wide ``local_group`` fixture); every length, dtype, segment size
and algorithm for that world size runs inside a single ``group.run`` call, and the results come back to be
checked here. Small segment sizes exercise the pipeline (many segments per chunk) on moderate lengths.
"""
import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

import allreduce
import allreduce_benchmark

WORLD_SIZES = [1, 2, 3, 5, 8]
LENGTHS = [1, 3, 1000, 1001, 4097]
DTYPES = [torch.float32, torch.float64]
ALGOS = ["ring", "butterfly"]
SHAPES = {1001: (7, 11, 13)}  # one length also as a 3-d tensor: "any shape"
SMALL_SEGMENT = 256  # lengths above it also run with it: chunks cut into several segments, pipelined
LONG = (100_003, 8192, torch.float32)  # one longer vector, float32 only: 2-7 segments per chunk

# Collectives the ring must not call; inside the workers each is replaced by a function that raises.
COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather",
               "scatter", "barrier"]
POINT_TO_POINT = ["send", "recv", "isend", "irecv", "batch_isend_irecv"]


def make_input(rank: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * length + rank)
    return torch.randn(length, generator=generator, dtype=torch.float64).to(dtype)


def float64_mean(world_size: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    return sum(make_input(r, length, dtype).double() for r in range(world_size)) / world_size


def tolerance(world_size: int, length: int, dtype: torch.dtype) -> float:
    """Worst-case rounding of p - 1 additions and one division in ``dtype``: (p + 1) eps max|x|, doubled."""
    largest = max(float(make_input(r, length, dtype).abs().max()) for r in range(world_size))
    return 2 * (world_size + 1) * torch.finfo(dtype).eps * largest


def average_all_cases(rank: int, world_size: int) -> dict:
    """Every (algorithm, dtype, length) case on this rank, with collectives banned and p2p calls counted."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES + POINT_TO_POINT}
    counts, posts = {}, []  # posts: (call, tag) in the order this rank made them

    def banned(name):
        def call(*args, **kwargs):
            raise AssertionError(f"collective dist.{name} called inside the all-reduce")
        return call

    def counted(name):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            posts.append((name, kwargs.get("tag", 0)))
            if name in ("send", "isend"):
                counts["elements_sent"] = counts.get("elements_sent", 0) + args[0].numel()
            return originals[name](*args, **kwargs)
        return call

    cases = [(length, segment, dtype) for dtype in DTYPES for length in LENGTHS
             for segment in [allreduce.SEGMENT_ELEMENTS] + ([SMALL_SEGMENT] if length > SMALL_SEGMENT else [])]
    out = {}
    try:
        for algo in ALGOS:
            fn = getattr(allreduce, f"{algo}_allreduce")
            for length, segment, dtype in cases + [LONG]:
                send = make_input(rank, length, dtype).reshape(SHAPES.get(length, (length,)))
                pointer, shape = send.data_ptr(), send.shape
                counts.clear()
                posts.clear()
                for name in COLLECTIVES:
                    setattr(dist, name, banned(name))
                for name in POINT_TO_POINT:
                    setattr(dist, name, counted(name))
                try:
                    returned = fn(send, rank, world_size, segment_elements=segment)
                finally:
                    for name, original in originals.items():
                        setattr(dist, name, original)
                out[(algo, str(dtype), length, segment)] = {
                    "result": send.clone(), "in_place": send.data_ptr() == pointer and send.shape == shape
                    and returned is send, "counts": dict(counts), "posts": list(posts),
                    "allocated": allreduce_benchmark.tracked_allocation_bytes(
                        lambda: fn(send.clone(), rank, world_size, segment_elements=segment))
                    - send.numel() * send.element_size(),  # minus the clone's own storage
                }
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return out


def reject_integer_tensor(rank: int, world_size: int) -> list[str]:
    messages = []
    for fn in (allreduce.ring_allreduce, allreduce.butterfly_allreduce):
        try:
            fn(torch.arange(5), rank, world_size)
        except TypeError as error:
            messages.append(str(error))
    return messages


def average_non_contiguous(rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    results = []
    for fn in (allreduce.ring_allreduce, allreduce.butterfly_allreduce):
        full = make_input(rank, 60, torch.float64).reshape(6, 10)
        view = full[:, ::3]  # non-contiguous view: only these elements are averaged
        expected_rest = full[:, 1::3].clone()
        fn(view, rank, world_size)
        results.append((full.clone(), expected_rest))
    return results


def expected_extra_bytes(algo: str, rank: int, world_size: int, length: int, segment: int, itemsize: int) -> int:
    """What each algorithm allocates: receive slots of at most one segment (or the whole message when it is shorter)."""
    if world_size == 1:
        return 0
    if algo == "ring":  # two slots of one segment of a chunk, or one for a single message per phase
        largest = -(-length // world_size)
        pieces = -(-largest // segment)
        return min(allreduce.RECEIVE_SLOTS, (world_size - 1) * pieces) * -(-largest // pieces) * itemsize
    core = 1 << (world_size.bit_length() - 1)
    if rank >= core:  # ranks folded into the power-of-two core allocate nothing
        return 0
    half = (length + 1) // 2
    return (half if segment >= half else allreduce.RECEIVE_SLOTS * segment) * itemsize


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_average_matches_float64_mean(local_group, world_size):
    per_rank = local_group(world_size).run(average_all_cases)
    worst, ordered_pairs = {}, 0
    for (algo, dtype_name, length, segment), first in per_rank[0].items():
        dtype = getattr(torch, dtype_name.split(".")[1])
        reference = float64_mean(world_size, length, dtype).reshape(SHAPES.get(length, (length,)))
        tol = tolerance(world_size, length, dtype)
        itemsize = torch.finfo(dtype).bits // 8
        for rank, results in enumerate(per_rank):
            case = results[(algo, dtype_name, length, segment)]
            where = f"{algo} {dtype_name} p={world_size} n={length} segment {segment} rank {rank}"
            assert case["in_place"], f"{where}: not averaged in place"
            assert case["result"].dtype == dtype and case["result"].shape == reference.shape, where
            # Bit-identical on every rank, not merely close.
            assert torch.equal(case["result"], first["result"]), f"{where}: differs from rank 0"
            error = float((case["result"].double() - reference).abs().max())
            assert error <= tol, f"{where}: max error {error:.3e} > tolerance {tol:.3e}"
            ratio, largest = worst.get((algo, dtype_name), (0.0, 0.0))
            worst[(algo, dtype_name)] = (max(ratio, error / tol), max(largest, error))
            counts = case["counts"]
            if world_size == 1:
                assert not counts, f"{where}: a world of one communicated: {counts}"
            # Extra memory: receive slots only, bounded by RECEIVE_SLOTS segments whatever the length.
            expected = expected_extra_bytes(algo, rank, world_size, length, segment, itemsize)
            assert case["allocated"] == expected, (where, case["allocated"], expected)
            assert case["allocated"] <= allreduce.RECEIVE_SLOTS * segment * itemsize, where
            if algo == "ring" and world_size > 1:
                # Rank r sends every chunk but r + 1 in the reduce-scatter and every chunk but r + 2 in the
                # all-gather: 2n - |chunk r+1| - |chunk r+2| elements, i.e. 2(p-1)/p of the data.
                base, extra = divmod(length, world_size)
                chunk = [base + (i < extra) for i in range(world_size)]
                sent = 2 * length - chunk[(rank + 1) % world_size] - chunk[(rank + 2) % world_size]
                assert counts.get("elements_sent", 0) == sent, (where, counts)
                assert set(counts) <= {"isend", "irecv", "elements_sent"}, counts
                # Messages of at most one segment: at least ceil(sent / segment) of them.
                assert counts.get("isend", 0) >= -(-sent // segment), (where, counts)
                # Every all-gather receive is posted before this rank sends the message with the same tag (its
                # neighbours run the same schedule): gloo moves a payload only into a posted receive, so a late
                # one costs a round trip. At p = 2 the first all-gather receive once came after its send.
                # (All-gather tags follow the reduce-scatter's (p - 1) x segments-per-chunk ones.)
                gather_from = (world_size - 1) * -(-chunk[0] // segment)
                first_post = {}
                for position, post in enumerate(case["posts"]):
                    first_post.setdefault(post, position)
                for (call, tag), at in first_post.items():
                    if call == "isend" and tag >= gather_from and ("irecv", tag) in first_post:
                        assert first_post[("irecv", tag)] < at, (where, "all-gather receive posted late", tag)
                        ordered_pairs += 1
    assert world_size == 1 or ordered_pairs > 0  # the order check above did run
    print(f"\np={world_size}: worst |error| (and error / tolerance) "
          + ", ".join(f"{a} {d}: {e:.2e} ({r:.3f})" for (a, d), (r, e) in sorted(worst.items())))


@pytest.mark.parametrize("world_size", [1, 3])
def test_integer_tensor_rejected(local_group, world_size):
    for messages in local_group(world_size).run(reject_integer_tensor):
        assert len(messages) == 2 and all("floating-point" in m for m in messages), messages


def test_integer_tensor_rejected_before_any_communication():
    with pytest.raises(TypeError, match="floating-point tensor, got dtype torch.int64"):
        allreduce.ring_allreduce(torch.arange(3), 0, 1)
    with pytest.raises(TypeError, match="floating-point"):
        allreduce.butterfly_allreduce(torch.zeros(3, dtype=torch.int32), 0, 1)


def test_non_contiguous_view_is_averaged_in_place(local_group):
    world_size = 3
    per_rank = local_group(world_size).run(average_non_contiguous)
    reference = sum(make_input(r, 60, torch.float64).reshape(6, 10) for r in range(world_size)) / world_size
    for rank, results in enumerate(per_rank):
        for full, untouched in results:
            torch.testing.assert_close(full[:, ::3], reference[:, ::3], rtol=0, atol=1e-14)
            assert torch.equal(full[:, 1::3], untouched)


def test_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "allreduce.json"
    payload = allreduce_benchmark.main(["--workers", "2", "--sizes", "100", "--algos", "ring,butterfly,torch",
                              "--budget-s", "0.01", "--min-iters", "2", "--max-iters", "3", "--rounds", "2",
                              "--segment", "16", "--segment-sweep", "8,50", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["results"] == payload["results"] and len(written["results"]) == 3
    for row in written["results"]:
        assert row["identical_across_ranks"] and row["max_abs_error"] < 1e-6 and row["median_ms"] > 0
        assert row["predicted_ms"] > 0 and row["iters"] in (2, 4)  # 2 rounds of 1 or 2 calls
        assert row["caller_cpu_us"] >= 0 and row["caller_runqueue_us"] >= 0 and row["other_threads_cpu_us"] >= 0
    model = written["alpha_beta"]["2"]
    assert model["alpha_ms"] > 0 and model["beta_ms_per_element"] >= 0 and len(model["points"]) == 2
    assert [r["segment_elements"] for r in written["segment_sweep"]] == [8, 50]
    assert {"cpu_model", "torch"} <= set(written["machine"]) and written["ratios"][0]["ring_over_torch"] > 0
    assert "ring" in capsys.readouterr().out


def test_thread_accounting():
    # Synthetic: the caller's own CPU and run-queue wait; every other thread's CPU, a new thread counted from 0.
    before = {1: (0, 0), 2: (5_000, 7)}
    after = {1: (3_000, 1_000), 2: (8_000, 9), 3: (2_000, 4)}
    assert allreduce_benchmark._thread_deltas_us(before, after, 1) == (3.0, 1.0, 5.0)
    # Real: the calling thread's schedstat run time is the CPU time time.thread_time() reads (both the kernel's
    # sum of execution time), so 20 ms of computing here shows as at least 20 ms.
    before = allreduce_benchmark.thread_schedstat_ns()
    if not before:
        pytest.skip("no /proc/self/task/*/schedstat on this system")
    start = time.thread_time()
    while time.thread_time() - start < 0.02:
        pass
    caller_us, _, _ = allreduce_benchmark._thread_deltas_us(before, allreduce_benchmark.thread_schedstat_ns(), threading.get_native_id())
    assert caller_us >= 19_000, caller_us


def test_bad_cli_arguments_exit_with_one_line(capsys):
    for argv in (["--workers", "0"], ["--algos", "ring,tree"], ["--sizes", "ten"]):
        with pytest.raises(SystemExit) as exit_info:
            allreduce_benchmark.parse_args(argv)
        assert exit_info.value.code == 2
        assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------------------------------------
# Other process groups, the communication thread, and the trainer on our all-reduce
# ----------------------------------------------------------------------------------------------------------
def average_on_groups(rank: int, world_size: int) -> dict:
    """On 3 ranks: ring and butterfly over the subgroup of ranks 1 and 2 (group ranks 0 and 1), then over an
    AllreduceThread's group while the main thread runs collectives on the default group at the same time."""
    subgroup = dist.new_group([1, 2])  # every rank calls new_group, members or not
    out = {}
    if rank in (1, 2):
        for name in ALGOS:
            x = make_input(rank, 1000, torch.float64)
            getattr(allreduce, f"{name}_allreduce")(x, rank - 1, 2, group=subgroup, segment_elements=100)
            out[name] = x
    for name in ALGOS:
        averager = allreduce.AllreduceThread(name, timeout_s=60, segment_elements=50)
        tensors = [make_input(rank, length, torch.float64) for length in (999, 1000, 1001)]
        futures = [averager.submit(t) for t in tensors]
        default_group_sums = []
        for _ in range(20):  # interleaves with the thread's messages on the other group
            value = torch.tensor([float(rank)], dtype=torch.float64)
            dist.all_reduce(value)
            default_group_sums.append(float(value))
        out[f"thread {name}"] = [f.result(timeout=60) for f in futures]
        out[f"thread {name} default group"] = default_group_sums
        averager.close()
    return out


def test_other_groups_and_the_communication_thread(local_group):
    per_rank = local_group(3).run(average_on_groups)
    for name in ALGOS:
        reference = (make_input(1, 1000, torch.float64) + make_input(2, 1000, torch.float64)) / 2
        assert torch.equal(per_rank[1][name], per_rank[2][name]), name
        torch.testing.assert_close(per_rank[1][name], reference, rtol=0, atol=1e-14)
        assert name not in per_rank[0]
        for i, length in enumerate((999, 1000, 1001)):
            results = [out[f"thread {name}"][i] for out in per_rank]
            assert all(torch.equal(r, results[0]) for r in results), (name, length)
            torch.testing.assert_close(results[0], float64_mean(3, length, torch.float64), rtol=0, atol=1e-14)
        assert all(out[f"thread {name} default group"] == [3.0] * 20 for out in per_rank)


TRAIN = ["--device", "cpu", "--dataset", "synthetic", "--train-size", "64", "--val-size", "16", "--batch-size", "8",
         "--epochs", "1", "--grad-accum", "2", "--bucket-mb", "0.01", "--seed", "5", "--norm", "custom"]


def train_with_each_allreduce(rank: int, world_size: int) -> dict:
    """The trainer's final weights with --allreduce torch, ring and butterfly, small buckets (several in flight on
    the thread while SyncBatchNorm's all_reduce runs on the default group) and small segments (pipelined)."""
    import ddp_cifar100 as trainer  # noqa: PLC0415 (only the workers need it)

    previous = allreduce.SEGMENT_ELEMENTS
    allreduce.SEGMENT_ELEMENTS = 700  # the buckets (up to ~2600 floats) then travel in several segments
    try:
        states = {}
        for name in ("torch", "ring", "butterfly"):
            metrics = trainer.train(trainer.parse_args(TRAIN + ["--allreduce", name]))
            states[name] = {k: v.detach().clone() for k, v in metrics["model"].state_dict().items()}
    finally:
        allreduce.SEGMENT_ELEMENTS = previous
    return states


def test_trainer_on_ring_and_butterfly_matches_torch(local_group):
    """Two ranks: every bucket element is (a + b) / 2 on all three paths (torch: a/2 + b/2, exact for a power
    of two; one addition of two numbers is the same in either order), so the weights must agree to the bit, and
    so must the ranks."""
    per_rank = local_group(2).run(train_with_each_allreduce)
    for name in ("ring", "butterfly"):
        for rank, states in enumerate(per_rank):
            for key, value in states["torch"].items():
                assert torch.equal(states[name][key], value), f"{name} rank {rank} {key}"
                assert torch.equal(per_rank[0][name][key], states[name][key]), f"{name}: ranks differ at {key}"
