"""zero_benchmark.py: the formulas it prints beside the measurements, its configurations, and its flags. (A run
starts a torchrun job per configuration, about 10 s each here: too slow for the suite; test_zero.py checks the
trainer's state_bytes and bytes sent against the same formulas.)"""
import pytest

import zero_benchmark


def test_expected_bytes_are_zero_py_s_formulas():
    psi, w = 1000, 4
    assert zero_benchmark.expected_bytes("stage 0 torch", psi, w, 2) == {
        "params": 4000, "grads": 4000, "optimizer": 8000, "sent_bytes_per_step": 2 * 3 / 4 * 4000}
    assert zero_benchmark.expected_bytes("stage 1 ring", psi, w, 2) == {
        "params": 4000, "grads": 4000, "optimizer": 2000, "sent_bytes_per_step": 2 * 3 / 4 * 4000}
    assert zero_benchmark.expected_bytes("stage 2 torch", psi, w, 3) == {
        "params": 4000, "grads": 1000, "optimizer": 2000, "sent_bytes_per_step": 4 * 3 / 4 * 4000}
    assert zero_benchmark.expected_bytes("ddp", psi, w, 1)["optimizer"] == 8000
    assert zero_benchmark.expected_bytes("zero-redundancy", psi, w, 1)["optimizer"] == 2000
    assert zero_benchmark.expected_bytes("zero-redundancy", psi, w, 1)["sent_bytes_per_step"] is None


def test_configurations_cover_the_anchors_and_every_stage_on_each_collective():
    labels = [c["label"] for c in zero_benchmark.configurations("vit", 2, 1, ["torch", "ring"])]
    assert labels == ["ddp", "zero-redundancy", "stage 0 torch", "stage 0 ring", "stage 1 torch", "stage 1 ring",
                      "stage 2 torch", "stage 2 ring"]


@pytest.mark.parametrize("argv,phrase", [
    (["--models", "vgg"], "--models from"),
    (["--nprocs", "1"], "--nprocs at least 2"),
    (["--allreduces", "butterfly"], "--allreduces from torch,ring"),
    (["--grad-accums", "x"], "comma-separated integers"),
])
def test_bad_flags_are_one_line(capsys, argv, phrase):
    with pytest.raises(SystemExit):
        zero_benchmark.parse_args(argv)
    assert phrase in capsys.readouterr().err
