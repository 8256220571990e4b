"""zero_benchmark.py: the formulas it prints beside the measurements (fp32, bf16 weights over fp32 masters, hybrid
sharding), its configurations, its flags, its tables, and the reading of a stage 3 trace. (A run starts a torchrun
job per configuration, about 10 s each here: too slow for the suite; test_zero.py checks the trainer's state_bytes,
bytes sent and gathered units against the same formulas and the prefetch order in a profiled step, and
test_trainer_hybrid.py the bytes per group.)"""
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


def test_bf16_weights_over_fp32_masters_hold_and_send_what_the_formula_says():
    """p = 2 bytes a weight: stages 1-2 keep bf16 weights (and stage 1 bf16 .grad views) plus fp32 masters (and
    stage 1's fp32 gradient shards) of 4 Psi / W; stage 3 and FSDP2 hold fp32 shards only; the gathers send half
    of fp32's bytes, the (fp32) reductions the same."""
    psi, w = 1000, 4  # one-way: 750 elements
    assert zero_benchmark.expected_bytes("stage 1 torch bf16", psi, w, 2, param_bytes=2) == {
        "params": 2 * 1000 + 1000, "grads": 2 * 1000 + 1000, "optimizer": 2000, "sent_bytes_per_step": 6 * 750}
    assert zero_benchmark.expected_bytes("stage 2 torch bf16", psi, w, 3, param_bytes=2) == {
        "params": 2 * 1000 + 1000, "grads": 1000, "optimizer": 2000, "sent_bytes_per_step": (3 * 4 + 2) * 750}
    # per micro-batch two bf16 all-gathers and an fp32 reduce-scatter: 8 + 4 bytes a one-way element, not 12 + 4
    assert zero_benchmark.expected_bytes("stage 3 ring bf16", psi, w, 2, param_bytes=2) == {
        "params": 1000, "grads": 1000, "optimizer": 2000, "sent_bytes_per_step": 2 * 8 * 750}
    assert zero_benchmark.expected_bytes("fsdp 3 bf16", psi, w, 2, param_bytes=2) == {
        "params": 1000, "grads": 1000, "optimizer": 2000, "sent_bytes_per_step": None}


def test_hybrid_rows_shard_over_s_and_send_across_replicas_a_shard_s_all_reduce():
    """W = 4 as R = 2 replicas x S = 2 shards: the state over S (Psi / S = 500 elements), inside the shard group
    the stage's one-ways over S ((S-1)/S Psi = 500 elements), across replicas 2 (R-1)/R of the fp32 shard: 4 x 500
    bytes."""
    psi, w = 1000, 4
    assert zero_benchmark.expected_sent_by_group("stage 1 torch hybrid", psi, w, 2, replicas=2) == {
        "shard_group": 8 * 500, "replicas": 2000}
    assert zero_benchmark.expected_sent_by_group("stage 2 ring hybrid", psi, w, 2, replicas=2) == {
        "shard_group": (2 * 4 + 4) * 500, "replicas": 2000}
    assert zero_benchmark.expected_bytes("stage 3 torch hybrid", psi, w, 1, replicas=2) == {
        "params": 2000, "grads": 2000, "optimizer": 4000, "sent_bytes_per_step": 12 * 500 + 2000}
    assert zero_benchmark.expected_bytes("hsdp", psi, w, 1, replicas=2) == {
        "params": 2000, "grads": 2000, "optimizer": 4000, "sent_bytes_per_step": None}
    # without replicas nothing crosses them; 4 replicas of 2 (W = 8): 2 x 3/4 of the shard
    assert zero_benchmark.expected_sent_by_group("stage 2 torch", psi, w, 1)["replicas"] == 0
    assert zero_benchmark.expected_sent_by_group("stage 3 torch hybrid", psi, 8, 1, replicas=4)["replicas"] == \
        2 * 3 / 4 * 4 * 500


def test_the_memory_table_has_bf16_and_hybrid_rows_from_the_formula(capsys):
    """GPT-2 small per rank (its parameter count given: building it, even on the meta device, takes a second):
    bf16 over fp32 masters at 8 processes, stage 1 4 Psi + 16 Psi / 8 = 6 Psi, stage 2 4 Psi, stage 3 2 Psi;
    2 replicas x 4 shards hold what 4 processes do; stage 0 has no bf16 or hybrid row."""
    psi = 124_439_808
    rows = zero_benchmark.memory_rows("GPT-2 small", psi)
    small = {(r["precision"], r["nproc"], r["replicas"], r["stage"]): r for r in rows}
    assert [small["bf16", 8, 1, stage]["total"] for stage in (1, 2, 3)] == [6 * psi, 4 * psi, 2 * psi]
    assert [small["fp32", 8, 2, stage]["total"] for stage in (1, 2, 3)] == [10 * psi, 7 * psi, 4 * psi]
    assert ("bf16", 2, 1, 0) not in small and ("fp32", 8, 2, 0) not in small
    zero_benchmark.print_gpt2_memory(rows)
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["GPT-2", "small", f"{psi:,}", "bf16", "8", "-", "0.75", "0.50", "0.25"] in lines  # 124M: 6, 4, 2 Psi
    assert ["GPT-2", "small", f"{psi:,}", "fp32", "2x4", "-", "1.24", "0.87", "0.50"] in lines


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


def test_precision_and_hybrid_rows_are_opt_in_with_their_flags():
    """By default (no --rows) the table is the fp32 one it was; --rows names the bf16 and hybrid groups."""
    assert zero_benchmark.parse_args([]).rows == list(zero_benchmark.DEFAULT_ROWS)
    default = [c["label"] for c in zero_benchmark.configurations("gpt", 4, 1, ["torch", "ring"])]
    assert not [label for label in default if "bf16" in label or "hybrid" in label or label == "hsdp"]
    rows = ["stage0", "stage3-bf16", "fsdp3-bf16", "hybrid3", "hsdp"]
    by_label = {c["label"]: c for c in zero_benchmark.configurations("gpt", 4, 1, ["torch", "ring"], rows)}
    assert list(by_label) == ["stage 0 torch", "stage 0 ring", "stage 3 torch bf16", "stage 3 ring bf16",
                              "fsdp 3 bf16", "stage 3 torch hybrid", "stage 3 ring hybrid", "hsdp"]
    bf16 = ["--param-dtype", "bf16", "--reduce-dtype", "fp32"]
    assert (by_label["stage 3 ring bf16"]["grad_sync"], by_label["stage 3 ring bf16"]["flags"]) == (
        "custom", ["--zero", "3", "--allreduce", "ring", *bf16])
    assert (by_label["fsdp 3 bf16"]["grad_sync"], by_label["fsdp 3 bf16"]["flags"]) == ("fsdp", ["--zero", "3", *bf16])
    assert (by_label["stage 3 torch hybrid"]["flags"], by_label["hsdp"]["grad_sync"], by_label["hsdp"]["flags"]) == (
        ["--zero", "3", "--allreduce", "torch", "--replicas", "2"], "fsdp", ["--zero", "3", "--replicas", "2"])
    assert [(c["param_bytes"], c["replicas"]) for c in by_label.values()] == [(4, 1)] * 2 + [(2, 1)] * 3 + [(4, 2)] * 3


def test_the_table_shows_the_bytes_per_group_and_the_goals(capsys):
    """The per-group table: measured beside the formula and their difference in bytes (here 8 bytes of padding
    across replicas); the goals' ratios from the median steps."""
    def row(label, step_ms, by_group=None):
        return {"name": f"gpt/w4/k1/{label}", "label": label, "step_time_ms_median": step_ms,
                "sent_bytes_by_group_per_step": by_group,
                "expected_sent_by_group": zero_benchmark.expected_sent_by_group(label, 1000, 4, 1, replicas=2)}
    rows = [row("stage 3 torch hybrid", 90.0, {"shard_group": 6000.0, "replicas": 2008.0}), row("hsdp", 100.0),
            row("stage 3 torch bf16", 120.0), row("fsdp 3 bf16", 100.0)]
    zero_benchmark.print_sent_by_group(rows)
    lines = capsys.readouterr().out.splitlines()
    assert "shard group" in lines[1] and "replicas" in lines[1] and len(lines) == 4
    assert lines[3].split() == ["gpt/w4/k1/stage", "3", "torch", "hybrid", "6,000", "6,000", "0", "2,008", "2,000",
                                "8"]
    ratios = zero_benchmark.goal_ratios(rows, ["torch"])
    assert [(r["ours"], r["reference"], r["ratio"]) for r in ratios] == [
        ("gpt/w4/k1/stage 3 torch hybrid", "gpt/w4/k1/hsdp", 0.9),
        ("gpt/w4/k1/stage 3 torch bf16", "gpt/w4/k1/fsdp 3 bf16", 1.2)]
    zero_benchmark.print_goals(ratios)
    assert "gpt/w4/k1/stage 3 torch bf16 / fsdp 3 bf16: 1.20x median step" in capsys.readouterr().out


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
    (["--rows", "stage0,stage3-fp8"], "--rows from ddp,zero-redundancy,stage0"),
    (["--rows", "stage0,hybrid3,hsdp", "--nprocs", "2,4,6"],
     "--rows hybrid3,hsdp run 2 replicas of at least 2 shards: --nprocs must be multiples of 2 from 4, got 2"),
    (["--rows", "stage0,hybrid1", "--nprocs", "5"], "got 5"),
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
