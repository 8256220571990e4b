"""Tests for allreduce.py: ring and butterfly all-reduce against the float64 mean, on local gloo groups.

Each world size is one LocalGroup (the session-wide ``local_group`` fixture); every length, dtype and algorithm
for that world size runs inside a single ``group.run`` call, and the results come back to be checked here.
"""
import json

import pytest
import torch
import torch.distributed as dist

import allreduce

WORLD_SIZES = [1, 2, 3, 5, 8]
LENGTHS = [1, 3, 1000, 1001, 4097]
DTYPES = [torch.float32, torch.float64]
ALGOS = ["ring", "butterfly"]
SHAPES = {1001: (7, 11, 13)}  # one length also as a 3-d tensor: "any shape"

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
    counts = {}

    def banned(name):
        def call(*args, **kwargs):
            raise AssertionError(f"collective dist.{name} called inside the all-reduce")
        return call

    def counted(name):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            if name in ("send", "isend"):
                counts["elements_sent"] = counts.get("elements_sent", 0) + args[0].numel()
            return originals[name](*args, **kwargs)
        return call

    out = {}
    try:
        for algo in ALGOS:
            fn = getattr(allreduce, f"{algo}_allreduce")
            for dtype in DTYPES:
                for length in LENGTHS:
                    send = make_input(rank, length, dtype).reshape(SHAPES.get(length, (length,)))
                    pointer, shape = send.data_ptr(), send.shape
                    counts.clear()
                    for name in COLLECTIVES:
                        setattr(dist, name, banned(name))
                    for name in POINT_TO_POINT:
                        setattr(dist, name, counted(name))
                    try:
                        returned = fn(send, rank, world_size)
                    finally:
                        for name, original in originals.items():
                            setattr(dist, name, original)
                    out[(algo, str(dtype), length)] = {
                        "result": send.clone(), "in_place": send.data_ptr() == pointer and send.shape == shape
                        and returned is send, "counts": dict(counts),
                        "allocated": allreduce.tracked_allocation_bytes(lambda: fn(send.clone(), rank, world_size))
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


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_average_matches_float64_mean(local_group, world_size):
    per_rank = local_group(world_size).run(average_all_cases)
    worst = {}
    for (algo, dtype_name, length), first in per_rank[0].items():
        dtype = getattr(torch, dtype_name.split(".")[1])
        reference = float64_mean(world_size, length, dtype).reshape(SHAPES.get(length, (length,)))
        tol = tolerance(world_size, length, dtype)
        for rank, results in enumerate(per_rank):
            case = results[(algo, dtype_name, length)]
            where = f"{algo} {dtype_name} p={world_size} n={length} rank {rank}"
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
        if algo == "ring" and world_size > 1:
            # Rank r sends every chunk but r + 1 in the reduce-scatter and every chunk but r + 2 in the
            # all-gather: 2n - |chunk r+1| - |chunk r+2| elements, i.e. 2(p-1)/p of the data.
            base, extra = divmod(length, world_size)
            chunk = [base + (i < extra) for i in range(world_size)]
            for rank, results in enumerate(per_rank):
                counts = results[(algo, dtype_name, length)]["counts"]
                expected = 2 * length - chunk[(rank + 1) % world_size] - chunk[(rank + 2) % world_size]
                assert counts.get("elements_sent", 0) == expected, (rank, counts)
                assert set(counts) <= {"isend", "irecv", "elements_sent"}, counts
        # Extra memory: the ring allocates two chunks, the butterfly half the vector, nothing else.
        itemsize = torch.finfo(dtype).bits // 8
        if world_size > 1:
            core = 1 << (world_size.bit_length() - 1)
            for rank, results in enumerate(per_rank):
                if algo == "ring":
                    expected_bytes = 2 * -(-length // world_size) * itemsize
                else:  # ranks folded into the power-of-two core allocate nothing
                    expected_bytes = (length + 1) // 2 * itemsize if rank < core else 0
                assert results[(algo, dtype_name, length)]["allocated"] == expected_bytes, (rank, algo)
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
    payload = allreduce.main(["--workers", "2", "--sizes", "100", "--algos", "ring,butterfly,torch",
                              "--budget-s", "0.01", "--min-iters", "2", "--max-iters", "3", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["results"] == payload["results"] and len(written["results"]) == 3
    for row in written["results"]:
        assert row["identical_across_ranks"] and row["max_abs_error"] < 1e-6 and row["median_ms"] > 0
    assert {"cpu_model", "torch"} <= set(written["machine"]) and written["ratios"][0]["ring_over_torch"] > 0
    assert "ring" in capsys.readouterr().out


def test_bad_cli_arguments_exit_with_one_line(capsys):
    for argv in (["--workers", "0"], ["--algos", "ring,tree"], ["--sizes", "ten"]):
        with pytest.raises(SystemExit) as exit_info:
            allreduce.parse_args(argv)
        assert exit_info.value.code == 2
        assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]
