"""benchmarks/allocator_view.py, the memory benchmark's --view, on allocations whose sizes and names are known: the
tensors held as a phase begins, their peak in it, what the phase had allocated and not freed at that peak, named by
the range that made it, and glibc's own figures; and the activations the memory benchmark's --trainer bound counts
(saved_bytes)."""
import torch

from benchmarks.allocator_view import AllocatorView, glibc_heap, held_tensor_bytes

MB = 1_000_000


def test_a_phase_reads_as_held_peak_and_the_ranges_in_use_at_it():
    baseline = held_tensor_bytes()
    kept = torch.ones(2 * MB, dtype=torch.uint8)  # held as the phase begins
    with AllocatorView() as view:
        with torch.profiler.record_function("gone"):
            gone = torch.ones(MB // 2, dtype=torch.uint8)
        del gone  # made and freed before the peak: not in use at it
        with torch.profiler.record_function("first"):
            first = torch.ones(3 * MB, dtype=torch.uint8)
        with torch.profiler.record_function("second"):
            second = torch.ones(MB, dtype=torch.uint8)
        del first  # the peak (2 held + 3 + 1) is behind
        with torch.profiler.record_function("third"):
            third = torch.ones(MB // 2, dtype=torch.uint8)
        del kept  # a held one freed inside the phase
    figures = view.figures(baseline)
    assert figures["tensors_held_mb"] == 2.0
    assert figures["tensors_peak_mb"] == 6.0
    assert figures["in_use_at_peak_mb"] == 4.0
    named = figures["in_use_by_range_mb"]
    assert {name.split(" / ")[0]: mb for name, mb in named.items()} == {"first": 3.0, "second": 1.0}
    assert second.numel() and third.numel()


def test_glibc_says_its_heap_and_mmapped_blocks():
    # A block is counted once, in the heap's bytes in use or in the mmapped ones: glibc serves a request from a free
    # heap chunk, or the heap's untrimmed top, when one has room (the heap an earlier test left), and by mmap only
    # when it would otherwise grow the heap past the threshold; so the sum moves by the block, whichever served it
    def in_use(figures):
        return figures["heap_in_use"] + figures["mmapped"]

    before = glibc_heap()
    block = torch.ones(64 * MB, dtype=torch.uint8)
    during = glibc_heap()
    del block
    after = glibc_heap()
    assert 64 <= in_use(during) - in_use(before) < 65
    assert 64 <= in_use(during) - in_use(after) < 65
    assert during["heap"] >= during["heap_free"] >= 0


def test_the_activations_are_what_autograd_saves_once_each_without_the_parameters():
    from benchmarks.memory_benchmark import saved_bytes

    layer = torch.nn.Linear(256, 256)
    inputs = torch.ones(8, 256, requires_grad=True)
    # addmm keeps its input (8 x 256 floats) for the weight's gradient and the weight (a parameter: not counted);
    # the tanh keeps its output, and the second addmm that same output again (one storage, counted once)
    assert saved_bytes(lambda: layer(torch.tanh(layer(inputs))).sum(), layer.parameters()) == 2 * 8 * 256 * 4
