"""benchmarks/suite_time.py's account of the machine's cores over a run, on readings of /proc/stat made up here."""
from benchmarks import suite_time


def test_core_use_adds_up_the_busy_and_idle_ticks_and_slices_them():
    """2 cores for 25 s: both busy for 10 s (the command's 18 core-s of them, 2 another's), then 1.5 busy for 10 s,
    then 0.5 for 5 s. A tick is 1/CLK_TCK s of one core; /proc/stat's first line sums them over the cores."""
    tick = 1 / suite_time.TICK_S
    meter = suite_time.CoreMeter()
    all_ticks = idle_ticks = 0
    meter.readings.append((0.0, (0, 0)))
    for second in range(1, 26):
        busy = 2.0 if second <= 10 else 1.5 if second <= 20 else 0.5
        all_ticks, idle_ticks = all_ticks + round(2 * tick), idle_ticks + round((2 - busy) * tick)
        meter.readings.append((float(second), (all_ticks, idle_ticks)))
    use = meter.report(command_cpu_s=18 + 15 + 2.5)
    assert (use["cores"] > 0, use["busy_core_s"], use["idle_core_s"]) == (True, 37.5, 12.5)
    assert use["others_cpu_s"] == 2.0 and use["floor_s"] == round(37.5 / use["cores"], 1)
    assert use["busy_cores_by_slice"] == [2.0, 1.5, 0.5]
