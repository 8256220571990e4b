"""Tests for allreduce.py: ring and butterfly all-reduce against the float64 mean, the ring's halves
(reduce-scatter, all-gather) against the float64 sum and the ranks' own chunks, on local gloo groups, the trainer
averaging its gradients with them, and allreduce_benchmark.py's command line.

Each world size is one LocalGroup (the session-wide ``local_group`` fixture); every length, dtype, segment size
and algorithm for that world size runs inside a single ``group.run`` call, and the results come back to be
checked here. Small segment sizes exercise the pipeline (many segments per chunk) on moderate lengths.
"""
import contextlib
import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

import allreduce
from benchmarks import allreduce_benchmark

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


@contextlib.contextmanager
def point_to_point_only(inside: str):
    """During the block every torch.distributed collective raises, and the point-to-point calls are recorded:
    yields {"counts": calls per name, "elements_sent": elements posted by send/isend, "posts": (call, tag) in the
    order this rank made them}. torch.distributed is restored afterwards, whatever happens."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES + POINT_TO_POINT}
    calls = {"counts": {}, "elements_sent": 0, "posts": []}

    def banned(name):
        def call(*args, **kwargs):
            raise AssertionError(f"collective dist.{name} called inside {inside}")
        return call

    def counted(name):
        def call(*args, **kwargs):
            calls["counts"][name] = calls["counts"].get(name, 0) + 1
            calls["posts"].append((name, kwargs.get("tag", 0)))
            if name in ("send", "isend"):
                calls["elements_sent"] += args[0].numel()
            return originals[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, banned(name))
    for name in POINT_TO_POINT:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def average_all_cases(rank: int, world_size: int) -> dict:
    """Every (algorithm, dtype, length) case on this rank, with collectives banned and p2p calls counted."""
    cases = [(length, segment, dtype) for dtype in DTYPES for length in LENGTHS
             for segment in [allreduce.SEGMENT_ELEMENTS] + ([SMALL_SEGMENT] if length > SMALL_SEGMENT else [])]
    out = {}
    for algo in ALGOS:
        fn = getattr(allreduce, f"{algo}_allreduce")
        for length, segment, dtype in cases + [LONG]:
            send = make_input(rank, length, dtype).reshape(SHAPES.get(length, (length,)))
            pointer, shape = send.data_ptr(), send.shape
            with point_to_point_only("the all-reduce") as calls:
                returned = fn(send, rank, world_size, segment_elements=segment)
            sent = {"elements_sent": calls["elements_sent"]} if calls["elements_sent"] else {}
            out[(algo, str(dtype), length, segment)] = {
                "result": send.clone(), "in_place": send.data_ptr() == pointer and send.shape == shape
                and returned is send, "counts": {**calls["counts"], **sent}, "posts": calls["posts"],
                "allocated": allreduce_benchmark.tracked_allocation_bytes(
                    lambda: fn(send.clone(), rank, world_size, segment_elements=segment))
                - send.numel() * send.element_size(),  # minus the clone's own storage
            }
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
                                        "--collectives", "allreduce,reduce_scatter,all_gather",
                                        "--budget-s", "0.01", "--min-iters", "2", "--max-iters", "3", "--rounds", "2",
                                        "--segment", "16", "--segment-sweep", "8,50", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["results"] == payload["results"] and len(written["results"]) == 3 + 2 + 2
    for row in written["results"]:
        assert row["max_abs_error"] < 1e-5 and row["median_ms"] > 0
        assert row["identical_across_ranks"] is (None if row.get("collective") == "reduce_scatter" else True), row
        assert row["predicted_ms"] > 0 and row["iters"] in (2, 4)  # 2 rounds of 1 or 2 calls
        assert row["caller_cpu_us"] >= 0 and row["caller_runqueue_us"] >= 0 and row["other_threads_cpu_us"] >= 0
    halves = [(r.get("collective"), r["algo"]) for r in written["results"] if "collective" in r]
    assert halves == [("reduce_scatter", "ring"), ("reduce_scatter", "torch"), ("all_gather", "ring"),
                      ("all_gather", "torch")]
    ring_all_gather = next(r for r in written["results"] if r.get("collective") == "all_gather" and r["algo"] == "ring")
    assert ring_all_gather["max_abs_error"] == 0.0 and ring_all_gather["extra_peak_bytes"] == 0
    model = written["alpha_beta"]["2"]
    assert model["alpha_ms"] > 0 and model["beta_ms_per_element"] >= 0 and len(model["points"]) == 2
    assert [r["segment_elements"] for r in written["segment_sweep"]] == [8, 50]
    assert {"cpu_model", "torch"} <= set(written["machine"]) and written["ratios"][0]["ring_over_torch"] > 0
    assert {r.get("collective") for r in written["ratios"]} == {None, "reduce_scatter", "all_gather"}
    assert written["command"].startswith("python -m benchmarks.allreduce_benchmark ")
    printed = capsys.readouterr().out
    assert "ring" in printed and "rs-ring" in printed and "ag-torch" in printed


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
    after = allreduce_benchmark.thread_schedstat_ns()
    caller_us, _, _ = allreduce_benchmark._thread_deltas_us(before, after, threading.get_native_id())
    assert caller_us >= 19_000, caller_us


def test_bad_cli_arguments_exit_with_one_line(capsys):
    for argv in (["--workers", "0"], ["--algos", "ring,tree"], ["--sizes", "ten"], ["--collectives", "gather"]):
        with pytest.raises(SystemExit) as exit_info:
            allreduce_benchmark.parse_args(argv)
        assert exit_info.value.code == 2
        assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------------------------------------
# The ring's halves: reduce-scatter and all-gather
# ----------------------------------------------------------------------------------------------------------
HALF_CHUNKS = [1, 3, 7, 600]  # chunk lengths; 600 > SMALL_SEGMENT: 3 segments per chunk, pipelined
HALF_WORLD_SIZES = [1, 2, 3, 4, 5]


def half_input(rank: int, chunk: int, world_size: int, dtype: torch.dtype, integers: bool) -> torch.Tensor:
    """Rank ``rank``'s vector of ``world_size`` chunks: integers in [-1000, 1000] (every sum of them is exact in
    float32 and float64, in any order) or N(0, 1) values."""
    generator = torch.Generator().manual_seed(7919 * chunk + 31 * world_size + rank)
    n = chunk * world_size
    if integers:
        return torch.randint(-1000, 1001, (n,), generator=generator).to(dtype)
    return torch.randn(n, generator=generator, dtype=torch.float64).to(dtype)


def half_cases() -> list[tuple[int, int, torch.dtype, bool]]:
    """(chunk, segment, dtype, integers): each chunk with the default segment, and the long one also with
    SMALL_SEGMENT and the 7 with segments of 2 (4 per chunk), so the pipeline runs with several segments."""
    cases = []
    for dtype in DTYPES:
        for chunk in HALF_CHUNKS:
            segments = [allreduce.SEGMENT_ELEMENTS] + ([SMALL_SEGMENT] if chunk > SMALL_SEGMENT else []) \
                + ([2] if chunk == 7 else [])
            cases += [(chunk, segment, dtype, integers) for segment in segments for integers in (True, False)]
    return cases


def run_halves(rank: int, world_size: int) -> dict:
    """Every half_cases case on this rank through ring_reduce_scatter and ring_all_gather, with every collective
    banned and the point-to-point calls counted; sent_bytes() read around each call."""
    out = {}
    for chunk, segment, dtype, integers in half_cases():
        flat = half_input(rank, chunk, world_size, dtype, integers)
        mine = slice(rank * chunk, (rank + 1) * chunk)
        gather_in = torch.full_like(flat, float("nan"))  # every place but this rank's chunk must be written
        gather_in[mine] = flat[mine]
        for name, fn, tensor in (("reduce_scatter", allreduce.ring_reduce_scatter, flat),
                                 ("all_gather", allreduce.ring_all_gather, gather_in)):
            before = allreduce.sent_bytes()
            with point_to_point_only("a ring half") as calls:
                returned = fn(tensor, rank, world_size, segment_elements=segment)
            out[(name, chunk, segment, str(dtype), integers)] = {
                "result": returned.clone(), "view": returned.data_ptr() == tensor[mine].data_ptr()
                if name == "reduce_scatter" else returned is tensor,
                "sent_bytes": allreduce.sent_bytes() - before, "counts": calls["counts"]}
    return out


@pytest.mark.parametrize("world_size", HALF_WORLD_SIZES)
def test_ring_halves_exact(local_group, world_size):
    """Reduce-scatter: chunk r on rank r is the sum over ranks, bit for bit against the float64 sum for integer
    inputs (exact in any order), and within (p - 1) eps sum_r |x_r| for N(0, 1) inputs: each of the p - 1 additions
    of a partial sum rounds by at most eps/2 of its magnitude, which is at most sum_r |x_r| (a bound doubled).
    All-gather: every rank's vector is every rank's own chunk, bit for bit. Point-to-point calls only, and each
    half sends exactly p - 1 chunks per rank."""
    per_rank = local_group(world_size).run(run_halves)
    worst = 0.0
    for chunk, segment, dtype, integers in half_cases():
        inputs = [half_input(r, chunk, world_size, dtype, integers) for r in range(world_size)]
        total = sum(x.double() for x in inputs)
        gathered = torch.cat([inputs[r][r * chunk:(r + 1) * chunk] for r in range(world_size)])
        bound = (world_size - 1) * torch.finfo(dtype).eps * sum(x.double().abs() for x in inputs)
        itemsize = torch.finfo(dtype).bits // 8
        for rank, results in enumerate(per_rank):
            mine = slice(rank * chunk, (rank + 1) * chunk)
            for name in ("reduce_scatter", "all_gather"):
                case = results[(name, chunk, segment, str(dtype), integers)]
                where = f"{name} p={world_size} chunk {chunk} segment {segment} {dtype} integers={integers} rank {rank}"
                assert case["view"], f"{where}: not the input's chunk / the input itself"
                assert case["sent_bytes"] == (world_size - 1) * chunk * itemsize, (where, case["sent_bytes"])
                assert set(case["counts"]) <= {"isend", "irecv"}, (where, case["counts"])
                if world_size > 1:
                    messages = (world_size - 1) * -(-chunk // segment)
                    assert case["counts"] == {"isend": messages, "irecv": messages}, (where, case["counts"])
                result = case["result"]
                if name == "all_gather":
                    assert torch.equal(result, gathered), f"{where}: differs from the ranks' own chunks"
                elif integers:
                    assert torch.equal(result, total[mine].to(dtype)), f"{where}: not the exact sum"
                else:
                    error = (result.double() - total[mine]).abs()
                    assert bool((error <= bound[mine]).all()), f"{where}: error {float(error.max()):.2e}"
                    worst = max(worst, float((error / bound[mine].clamp_min(1e-300)).max()))
    print(f"\np={world_size}: reduce-scatter's worst error / bound {worst:.3f} (random inputs)")


def reject_bad_halves(rank: int, world_size: int) -> list[tuple[str, str]]:
    """Every bad input to each half, with the point-to-point calls made to raise: (error type, message) each."""
    originals = {name: getattr(dist, name) for name in POINT_TO_POINT}

    def sent(*args, **kwargs):
        raise AssertionError("a message was sent before the input was checked")

    bad = [(torch.arange(4), rank, world_size), (torch.zeros(2, 2), rank, world_size),
           (torch.zeros(8)[::2], rank, world_size), (torch.zeros(5), rank, world_size),
           (torch.zeros(4), rank, world_size + 1), (torch.zeros(4), (rank + 1) % world_size, world_size),
           ([0.0] * 4, rank, world_size)]
    out = []
    for name in POINT_TO_POINT:
        setattr(dist, name, sent)
    try:
        for fn in (allreduce.ring_reduce_scatter, allreduce.ring_all_gather):
            for tensor, r, p in bad:
                try:
                    fn(tensor, r, p)
                    out.append(("none", fn.__name__))
                except (TypeError, ValueError) as error:
                    out.append((type(error).__name__, str(error)))
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return out


def test_ring_halves_reject_bad_input_before_sending(local_group):
    per_rank = local_group(2).run(reject_bad_halves)
    for messages in per_rank:
        assert len(messages) == 14
        for (kind, message), name in zip(messages, ["ring_reduce_scatter"] * 7 + ["ring_all_gather"] * 7):
            assert kind in ("TypeError", "ValueError") and message.startswith(f"{name}: "), (kind, message)
            assert "\n" not in message, message
        expected = ["floating-point", "1-D", "contiguous", "equal chunks", "do not match", "do not match",
                    "torch.Tensor"] * 2
        assert all(word in message for word, (_, message) in zip(expected, messages)), messages


def halves_on_a_thread(rank: int, world_size: int) -> dict:
    """An AllreduceThread's group running ring_reduce_scatter then ring_all_gather (the sum of every chunk on
    every rank), while the main thread runs collectives on the default group; close() twice."""
    averager = allreduce.AllreduceThread("ring", timeout_s=60, segment_elements=4)
    flat = half_input(rank, 7, world_size, torch.float64, integers=True)
    scattered = averager.submit(flat, operation=allreduce.ring_reduce_scatter)
    default_group_sums = []
    for _ in range(10):  # interleaves with the thread's messages on its own group
        value = torch.tensor([float(rank)], dtype=torch.float64)
        dist.all_reduce(value)
        default_group_sums.append(float(value))
    chunk = scattered.result(timeout=60).clone()
    gathered = averager.submit(flat, operation=allreduce.ring_all_gather).result(timeout=60)
    averaged = averager.submit(half_input(rank, 7, world_size, torch.float64, integers=True)).result(timeout=60)
    averager.close()
    averager.close()  # a second close does nothing: above all, it must not destroy the default group (None)
    value = torch.tensor([1.0], dtype=torch.float64)
    dist.all_reduce(value)
    return {"chunk": chunk, "gathered": gathered is flat and flat.clone(), "averaged": averaged,
            "default group": default_group_sums + [float(value)], "closed": averager.group is None}


def test_halves_on_the_communication_thread(local_group):
    world_size = 3
    per_rank = local_group(world_size).run(halves_on_a_thread)
    total = sum(half_input(r, 7, world_size, torch.float64, integers=True) for r in range(world_size))
    for rank, out in enumerate(per_rank):
        assert torch.equal(out["chunk"], total[rank * 7:(rank + 1) * 7]), rank
        assert torch.equal(out["gathered"], total), rank  # each rank's summed chunk, gathered
        torch.testing.assert_close(out["averaged"], total / world_size, rtol=0, atol=1e-12)
        assert out["default group"] == [3.0] * 10 + [3.0] and out["closed"]


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


def torch_collectives_on_gloo(rank: int, world_size: int) -> dict:
    """Collectives("torch").reduce_scatter and .all_gather on gloo against torch's reduce_scatter_tensor and
    all_gather_into_tensor on the same input, and the largest allocation torch.profiler sees while each runs and is
    waited for."""
    from collectives import Collectives  # noqa: PLC0415 (only the workers need it)

    comm, out = Collectives(kind="torch"), {}
    flat = make_input(rank, world_size * 250_000, torch.float32)  # a 1 MB chunk a rank
    mine = slice(rank * 250_000, (rank + 1) * 250_000)
    reduced, gathered = flat / world_size, flat.clone()
    dist.reduce_scatter_tensor(reduced[mine], reduced)
    dist.all_gather_into_tensor(gathered, flat[mine].clone())
    for name, expected in (("reduce_scatter", reduced[mine]), ("all_gather", gathered)):
        bucket = flat.clone()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
            getattr(comm, name)(bucket, name).wait()
        got = comm.chunk(bucket) if name == "reduce_scatter" else bucket
        out[name] = {"equal": torch.equal(got, expected),
                     "largest": max((e.cpu_memory_usage for e in profile.events()), default=0)}
    out["flat"] = flat.numel() * flat.element_size()
    return out


def test_torch_collectives_on_gloo_are_gloo_s_own_without_its_copies(local_group):
    """On gloo, Collectives' reduce-scatter all-reduces the bucket in place and its all-gather broadcasts each chunk
    in place: bit for bit what gloo's reduce_scatter_tensor and all_gather_into_tensor give, without the whole
    bucket each of them makes (the copies that lifted stage 3's peak by two units)."""
    for out in local_group(3).run(torch_collectives_on_gloo):
        for name in ("reduce_scatter", "all_gather"):
            assert out[name]["equal"], name
            assert out[name]["largest"] < out["flat"] / 2, (name, out)


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
            model = trainer.train(trainer.parse_args(TRAIN + ["--allreduce", name])).model
            states[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
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
