"""bn_benchmark.py runs end to end (a world of one, tiny): the ResNet-50-shape mode's JSON, and bad flags in one line."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root (this file: tests/)


def run(*flags, tmp_path=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "bn_benchmark.py", *flags], cwd=HERE, env=env, capture_output=True,
                          text=True, timeout=240)


def test_resnet50_shapes_write_every_shape_with_the_floor_and_both_sides(tmp_path):
    path = tmp_path / "bn.json"
    proc = run("--shapes", "resnet50", "--batch", "1", "--iters", "2", "--rounds", "1", "--json", str(path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    payload = json.loads(path.read_text())
    assert payload["shapes"] == "resnet50" and payload["dtype"] == "bf16" and payload["theirs"] == ["BatchNorm2d"]
    assert [row["shape"] for row in payload["rows"]] == [[1, 64, 112, 112], [1, 256, 56, 56], [1, 512, 28, 28],
                                                         [1, 1024, 14, 14], [1, 2048, 7, 7]]
    for row in payload["rows"]:
        assert row["ours_ms"] > 0 and row["BatchNorm2d_ms"] > 0 and row["floor_ms"] > 0
        assert row["ours_over_BatchNorm2d"] == row["ours_ms"] / row["BatchNorm2d_ms"]
        # Kept for backward + output: one activation-sized tensor each (bf16, batch 1) and per-channel vectors.
        channels = row["shape"][1]
        activation_mib = 2 * 2 * channels * row["shape"][2] ** 2 / 2**20
        assert activation_mib <= row["ours_memory_mb"] <= activation_mib + 32 * channels / 2**20
        assert row["BatchNorm2d_memory_mb"] >= activation_mib


def test_flags_of_the_other_mode_are_refused_in_one_line():
    proc = run("--batch", "8")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == ("bn_benchmark.py: error: --batch and --dtype are for --shapes "
                                                    "resnet50 (the grid is float32, batches 32 and 64)")
