"""compile_benchmark.py's cheapest path end to end (the bn part, one tiny shape, a few calls, aot_eager: no code
generation, no trainer runs): the JSON's structure and positive ratios; and bad flags in one line. No timed asserts."""
import json
import math

import pytest

from benchmarks import compile_benchmark


def positive(value):
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_bn_part_writes_rows_graph_facts_and_verdicts(tmp_path, capsys):
    path = tmp_path / "compile.json"
    argv = ["--parts", "bn", "--shapes", "4x8", "--iters", "4", "--backend", "aot_eager", "--json", str(path)]
    compile_benchmark.main(argv)
    printed = capsys.readouterr().out
    assert "goals:" in printed and "nn.SyncBatchNorm cannot run on CPU tensors" in printed

    payload = json.loads(path.read_text())
    assert payload["command"] == "python -m benchmarks.compile_benchmark " + " ".join(argv)
    assert payload["machine"]["cpu_count"] >= 1 and payload["machine"]["torch"]
    assert payload["trainer"] is None and payload["overlap"] is None
    bn = payload["bn"]
    assert bn["processes"] == 2 and bn["compile_backend"] == "aot_eager" and positive(bn["first_compile_s"])
    (row,) = bn["rows"]
    assert (row["batch_size"], row["hid_dim"], row["global_batch"]) == (4, 8, 8) and row["timed_calls_each"] == 4
    for key in ("eager_ms", "compiled_ms", "ratio", "collectives_ms", "best_ratio", "compile_s"):
        assert positive(row[key]), key
    assert row["ratio"] == row["compiled_ms"] / row["eager_ms"]
    assert row["max_abs_diff_output"] < 1e-4 and row["max_abs_diff_grad_input"] < 1e-4  # the same layer, compiled
    assert bn["median_ratio"] == row["ratio"]

    ours = bn["graphs"]["ours"]
    assert (ours["graph_count"], ours["graph_break_count"], ours["break_reasons"]) == (1, 0, [])
    assert ours["all_reduce_per_graph"] == {"forward": [1], "backward": [1]}
    theirs = bn["graphs"]["nn.SyncBatchNorm"]
    assert theirs["runs_on_cpu"] is False and theirs["error"]

    goals = payload["goals"]
    verdict = goals["bn_compiled_at_most_0.8x_eager"]
    assert verdict["met"] == (verdict["median_ratio"] <= 0.8) and positive(verdict["median_ratio"])
    assert verdict["per_shape"] == {"4x8": {"ratio": row["ratio"], "met": row["goal_met"]}}
    assert goals["trainer_resnet_compiled_at_most_0.9x_eager"] is None


@pytest.mark.parametrize("argv, message", [
    (["--parts", "bn,gpu"], "--parts takes a comma-separated list of bn, trainer, overlap, got bn,gpu"),
    (["--overlap-bucket-mb", "0.5"], "--overlap-bucket-mb must be at least 1 (DDPOptimizer's smallest), got 0.5"),
    (["--shapes", "32x"], "--shapes takes 'grid' or a comma-separated list of BATCHxHID"),
    (["--models", "resnet50"], "--models takes a comma-separated list of net, resnet, vit, got resnet50"),
    (["--iters", "0"], "--iters must be at least 1, got 0"),
    (["--backend", "nonesuch"], "--backend 'nonesuch' is not a torch.compile backend here"),
])
def test_bad_flags_are_one_line(argv, message):
    with pytest.raises(SystemExit) as raised:
        compile_benchmark.main(argv)
    text = str(raised.value)
    assert text.startswith("compile_benchmark.py: error: " + message) and "\n" not in text


def test_overlap_is_read_from_the_backward_ranges_and_their_all_reduce_launches(tmp_path):
    """overlap_in_trace on a made-up trace of two steps (microseconds): the launches inside each "backward" range
    count, those outside (the forward's, another step's) do not; medians over the steps."""
    def event(name, ts, dur):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur}

    events = [event("backward", 1000, 500), event("c10d::allreduce_", 900, 5),  # before backward: not a bucket
              event("c10d::allreduce_", 1100, 5), event("c10d::allreduce_", 1300, 5),
              event("backward", 3000, 400), event("c10d::allreduce_", 3350, 5), event("c10d::allreduce_", 3360, 5),
              event("c10d::allreduce_", 3370, 5), {"ph": "i", "name": "c10d::allreduce_", "ts": 3100}]
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    row = compile_benchmark.overlap_in_trace(str(path))
    # step 1: 2 buckets, compute 300, overlapped 200, tail 200; step 2: 3 buckets, compute 370, overlapped 20, tail 30
    assert row["buckets"] == 2.5 and row["profiled_steps"] == 2
    assert math.isclose(row["compute_ms"], 0.335) and math.isclose(row["overlapped_ms"], 0.110)
    assert math.isclose(row["tail_ms"], 0.115) and math.isclose(row["backward_ms"], 0.450)
    assert math.isclose(row["overlapped_share"], 0.110 / 0.335)
    path.write_text(json.dumps({"traceEvents": events[:2]}))
    with pytest.raises(compile_benchmark.BenchmarkError, match="no gradient all_reduce inside a backward range"):
        compile_benchmark.overlap_in_trace(str(path))
