"""zero_benchmark.py: the formulas it prints beside the measurements, its configurations, its flags, its table, and
the reading of a stage 3 trace. (A run starts a torchrun job per configuration, about 10 s each here: too slow for
the suite; test_zero.py checks the trainer's state_bytes, bytes sent and gathered units against the same formulas
and the prefetch order in a profiled step.)"""
import pytest

from benchmarks import zero_benchmark


def test_expected_bytes_are_zero_py_s_formulas():
    psi, w = 1000, 4
    assert zero_benchmark.expected_bytes("stage 0 torch", psi, w, 2) == {
        "params": 4000, "grads": 4000, "optimizer": 8000, "sent_bytes_per_step": 2 * 3 / 4 * 4000}
    assert zero_benchmark.expected_bytes("stage 1 ring", psi, w, 2) == {
        "params": 4000, "grads": 4000, "optimizer": 2000, "sent_bytes_per_step": 2 * 3 / 4 * 4000}
    assert zero_benchmark.expected_bytes("stage 2 torch", psi, w, 3) == {
        "params": 4000, "grads": 1000, "optimizer": 2000, "sent_bytes_per_step": 4 * 3 / 4 * 4000}
    # stage 3: per micro-batch an all-gather in forward, one in backward and a reduce-scatter
    assert zero_benchmark.expected_bytes("stage 3 ring", psi, w, 2) == {
        "params": 1000, "grads": 1000, "optimizer": 2000, "sent_bytes_per_step": 2 * 3 * 3 / 4 * 4000}
    # stage 3 accumulating unsharded: the reduce-scatter once per window
    assert zero_benchmark.expected_bytes("stage 3 torch unsharded", psi, w, 2)["sent_bytes_per_step"] == \
        5 * 3 / 4 * 4000
    assert zero_benchmark.expected_bytes("ddp", psi, w, 1)["optimizer"] == 8000
    assert zero_benchmark.expected_bytes("zero-redundancy", psi, w, 1)["optimizer"] == 2000
    assert zero_benchmark.expected_bytes("zero-redundancy", psi, w, 1)["sent_bytes_per_step"] is None
    for label in ("fsdp 3", "fsdp 2"):  # FSDP2 shards all three between steps, reshard after forward or not
        assert zero_benchmark.expected_bytes(label, psi, w, 2) == {
            "params": 1000, "grads": 1000, "optimizer": 2000, "sent_bytes_per_step": None}


def test_configurations_cover_the_anchors_and_every_stage_on_each_collective():
    configs = zero_benchmark.configurations("vit", 2, 1, ["torch", "ring"])
    assert [c["label"] for c in configs] == [
        "ddp", "zero-redundancy", "stage 0 torch", "stage 0 ring", "stage 1 torch", "stage 1 ring", "stage 2 torch",
        "stage 2 ring", "stage 3 torch", "stage 3 ring", "stage 3 torch unsharded", "stage 3 ring unsharded",
        "fsdp 3", "fsdp 2"]
    by_label = {c["label"]: c for c in configs}
    assert (by_label["stage 3 ring"]["grad_sync"], by_label["stage 3 ring"]["flags"]) == (
        "custom", ["--zero", "3", "--allreduce", "ring"])
    assert (by_label["fsdp 2"]["grad_sync"], by_label["fsdp 2"]["flags"]) == ("fsdp", ["--zero", "2"])
    assert (by_label["zero-redundancy"]["grad_sync"], by_label["zero-redundancy"]["flags"]) == ("ddp", ["--zero", "1"])
    chosen = zero_benchmark.configurations("resnet", 4, 2, ["torch"], ["stage0", "stage3", "fsdp3"])
    assert [c["name"] for c in chosen] == ["resnet/w4/k2/stage 0 torch", "resnet/w4/k2/stage 3 torch",
                                           "resnet/w4/k2/fsdp 3"]


def test_the_table_shows_the_gathered_peak_where_the_metrics_give_it(capsys):
    def row(label, gathered_peak):
        return {"name": f"vit/w2/k1/{label}", "label": label, "model": "vit", "nproc": 2, "grad_accum": 1,
                "state_bytes": {"params": 2e6, "grads": 2e6, "optimizer": 4e6},
                "expected": zero_benchmark.expected_bytes(label, 10 ** 6, 2, 1), "sent_bytes_per_step": 6e6,
                "gathered_peak": gathered_peak, "step_time_ms_median": 50.0, "train_loss": 4.6,
                "max_weight_difference_vs_stage0": 0.0}
    zero_benchmark.print_rows([row("stage 0 torch", None), row("stage 3 torch", {"units": 2, "bytes": 1.7e6})],
                              "stage 0 torch")
    lines = capsys.readouterr().out.splitlines()
    assert "gathered u/MB" in lines[0]
    assert "2 / 1.70" in lines[3] and "6.00" in lines[3]  # stage 3's peak; its 3 one-ways of 2 MB formula
    assert "2 / 1.70" not in lines[2]


def ranges(rank, *spans):
    return [{"ph": "X", "pid": rank, "name": name, "ts": start * 1e3, "dur": (end - start) * 1e3}
            for name, start, end in spans]


def test_unit_pairs_read_the_prefetch_off_a_trace():
    """A made-up stage 3 step (ms): the root encloses the pass; unit 2's gather begins during unit 1's forward
    but lands 1 ms into unit 2's; in backward unit 2 (backward's first block) is gathered on demand, and unit 1's
    gather, prefetched during unit 2's backward, lands in time."""
    events = ranges(0, ("unit 0 forward", 0, 30), ("all_gather unit 0 (1 kB)", 0, 1),
                    ("all_gather unit 1 (8 kB)", 1, 2), ("unit 1 forward", 2, 10),
                    ("all_gather unit 2 (8 kB)", 3, 11), ("unit 2 forward", 10, 20),
                    ("unit 0 backward", 31, 80), ("unit 2 backward", 32, 50), ("all_gather unit 2 (8 kB)", 33, 36),
                    ("all_gather unit 1 (8 kB)", 37, 45), ("reduce_scatter unit 2 (8 kB)", 49, 55),
                    ("unit 1 backward", 50, 70), ("reduce_scatter unit 1 (8 kB)", 69, 75))
    pairs = zero_benchmark.unit_pairs(events)
    assert pairs == [
        {"rank": 0, "kind": "forward", "first": 1, "next": 2, "gather_began_before_first_ended": True,
         "gather_landed_before_next_began": False, "wait_ms": pytest.approx(1.0)},
        {"rank": 0, "kind": "backward", "first": 2, "next": 1, "gather_began_before_first_ended": True,
         "gather_landed_before_next_began": True, "wait_ms": 0.0, "scatter_landed_before_next_ended": True}]
    assert zero_benchmark.first_backward_gathers(events) == [
        {"rank": 0, "unit": 2, "began_inside": True, "ms_until_landed": pytest.approx(4.0)}]


@pytest.mark.parametrize("argv,phrase", [
    (["--models", "vgg"], "--models from"),
    (["--nprocs", "1"], "--nprocs at least 2"),
    (["--allreduces", "butterfly"], "--allreduces from torch,ring"),
    (["--grad-accums", "x"], "comma-separated integers"),
    (["--rows", "stage0,stage4"], "--rows from ddp,zero-redundancy,stage0"),
    (["--rows", "stage3,fsdp3"], "--rows must include stage0"),
])
def test_bad_flags_are_one_line(capsys, argv, phrase):
    with pytest.raises(SystemExit):
        zero_benchmark.parse_args(argv)
    assert phrase in capsys.readouterr().err


def test_trace_profiles_stage_3_on_the_first_of_each_list():
    args = zero_benchmark.parse_args(["--trace", "--models", "vit,resnet", "--nprocs", "2,4", "--grad-accums", "2,1"])
    assert args.json.endswith("trace-zero3-" + zero_benchmark.machine_tag("cpu") + ".json")
    config, settings = zero_benchmark.trace_settings(args)
    first, end = zero_benchmark.TRACE_STEPS
    assert (config["label"], config["model"], config["nproc"], config["grad_accum"]) == ("stage 3 torch", "vit", 2, 2)
    assert config["flags"][-2:] == ["--profile-steps", f"{first}:{end}"]
    assert config["flags"][config["flags"].index("--max-steps") + 1] == str(end)
    assert settings.train_size == end * settings.batch_size * 2 * 2  # the epoch ends with the profiled steps
