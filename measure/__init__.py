"""What the trainer and the benchmarks measure with, a module per quantity (import them by name: this file holds
nothing else).

- ``timing``: profiler ranges (``profiled``), wall times of intervals and of whole calls, CUDA events on a GPU.
- ``summary``: many figures as one (median, percentile) and one per rank as the job's (max_across_ranks).
- ``memory``: a process's memory from /proc (resident, peak, private), the peak of each phase of a run (PhasePeaks).
- ``malloc``: glibc's allocator settings that decide what a memory figure says (its mmap threshold, its heap's top).
- ``machine``: where a figure came from (CPU, GPU, versions) and what the machine did meanwhile (/proc's ticks, a
  process's children).
"""
