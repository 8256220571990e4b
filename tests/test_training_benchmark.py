"""training_benchmark.py --imagenet: the decomposition runs end to end (tiny, on the CPU) and refuses bad lists."""
import json

import pytest

import training_benchmark

TINY_IMAGENET = ["--imagenet", "--device", "cpu", "--image-size", "32", "--model", "resnet18", "--batch-size", "4",
                 "--steps", "2", "--classes", "4", "--norms", "local", "--grad-syncs", "custom"]


def test_imagenet_decomposition_runs_tiny_on_the_cpu(tmp_path):
    out = tmp_path / "imagenet.json"
    training_benchmark.main(TINY_IMAGENET + ["--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "imagenet-throughput" and payload["nproc"] == 1
    rows = {row["name"]: row for row in payload["rows"]}
    assert list(rows) == ["plain", "custom/local"]
    assert len(rows["plain"]["step_times_ms"]) == 2 and rows["plain"]["data_wait_ms_median"] is None
    trainer_row = rows["custom/local"]
    assert trainer_row["metrics"]["optimizer_steps"] == 2 + training_benchmark.WARMUP_STEPS
    assert trainer_row["metrics"]["config"]["channels_last"] and trainer_row["metrics"]["config"]["amp"] == "bf16"
    assert all(row["step_time_ms_median"] > 0 and row["peak_memory_mb"] > 0 for row in rows.values())
    assert trainer_row["data_wait_ms_median"] >= 0


@pytest.mark.parametrize("flags,phrase", [
    (["--norms", "torch"], "--norms torch (nn.SyncBatchNorm) needs --device cuda"),
    (["--grad-syncs", "custom,fsdp"], "--grad-syncs takes a comma-separated list of custom, ddp"),
    (["--steps", "0"], "--steps must be at least 1"),
])
def test_imagenet_flags_are_checked_in_one_line(capsys, flags, phrase):
    with pytest.raises(SystemExit):
        training_benchmark.parse_args(["--imagenet", "--device", "cpu", *flags])
    assert phrase in capsys.readouterr().err
