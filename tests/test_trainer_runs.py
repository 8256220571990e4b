"""benchmarks/trainer_runs.py: what run_trainer makes of a run, through a stand-in for torchrun (``wrap`` replaces the
command by a short program that writes the metrics where the command's --metrics-out says): the metrics and stderr
read back, the command as results show it, a failed attempt tried again and said on stderr, the last failure and a
timeout in one line; and the flags of training_benchmark.py's configurations. (The real launch runs in
test_training_benchmark.py.)"""
import sys

import pytest

import training_benchmark
from benchmarks.trainer_runs import TrainerRunFailed, configuration_flags, run_trainer

# argv: the trainer's command (its last argument the metrics path); the environment says how this attempt ends.
STAND_IN = """
import json, os, sys, time
tries = os.environ["TRIES_FILE"]
attempt = len(open(tries).read()) + 1 if os.path.exists(tries) else 1
open(tries, "a").write("x")
print("the trainer's log, attempt", attempt, file=sys.stderr)
if attempt <= int(os.environ["FAILURES"]):
    if os.environ.get("AGENT_REPORT"):  # torchrun's own report of a failed worker: 50 lines after the workers'
        print("E1128 16:44:23.708000 1051 torch/distributed/elastic/multiprocessing/api.py:986] failed "
              "(exitcode: 3) local_rank: 0", *["  ChildFailedError"] * 50, sep="\\n", file=sys.stderr)
    sys.exit(int(os.environ["EXIT"]))
time.sleep(float(os.environ.get("SLEEP", "0")))
json.dump({"attempt": attempt, "threads": os.environ["OMP_NUM_THREADS"]}, open(sys.argv[-1], "w"))
"""


def stand_in(command):
    return [sys.executable, "-c", STAND_IN, *command]


def env(tmp_path, failures=0, exit_code=1, **more):
    return {"TRIES_FILE": str(tmp_path / "tries"), "FAILURES": str(failures), "EXIT": str(exit_code),
            "OMP_NUM_THREADS": "1", **more}


def test_the_metrics_come_back_with_the_command_as_results_show_it(tmp_path):
    run = run_trainer(["--model", "net", "--data-dir", "a b"], 2, label="run", env=env(tmp_path), wrap=stand_in)
    assert run.metrics == {"attempt": 1, "threads": "1"} and run.attempts == 1 and run.wall_s > 0
    assert run.command == ("torchrun --standalone --nproc_per_node=2 ddp_cifar100.py --model net --data-dir 'a b' "
                           "--metrics-out METRICS.json")
    assert "the trainer's log, attempt 1" in run.stderr


def test_a_failed_attempt_is_tried_again_and_said_on_stderr(tmp_path, capsys):
    run = run_trainer([], 1, label="run x", env=env(tmp_path, failures=1, exit_code=3), wrap=stand_in, attempts=2)
    assert run.metrics["attempt"] == 2 and run.attempts == 2
    assert "run x failed (exit 3, attempt 1 of 2):\nthe trainer's log, attempt 1" in capsys.readouterr().err
    # torchrun's report of the failure is cut from the tail (its first line kept), so the workers' error shows
    (tmp_path / "tries").unlink()
    run_trainer([], 1, label="run x", env=env(tmp_path, failures=1, exit_code=3, AGENT_REPORT="1"), wrap=stand_in,
                attempts=2)
    err = capsys.readouterr().err
    assert "the trainer's log, attempt 1\nE1128" in err and "(exitcode: 3)" in err and "ChildFailedError" not in err


def test_the_last_failure_and_a_timeout_are_one_line(tmp_path, capsys):
    with pytest.raises(TrainerRunFailed) as failed:
        run_trainer([], 1, label="run x", env=env(tmp_path, failures=2, exit_code=0), wrap=stand_in, attempts=2)
    assert str(failed.value) == "run x failed 2 times; its output's tail is above"
    assert capsys.readouterr().err.count("exit 0 without its metrics") == 2
    (tmp_path / "tries").unlink()
    with pytest.raises(TrainerRunFailed, match=r"^run y took more than 1 s$"):
        run_trainer([], 1, label="run y", env=env(tmp_path, SLEEP="30"), wrap=stand_in, timeout_s=1, attempts=2)


def test_a_configuration_s_flags_are_the_settings_then_its_own():
    settings = training_benchmark.parse_args(["--quick", "--device", "cpu"])
    config = {"name": "ours/accum2", "grad_sync": "custom", "norm": "custom", "sync_mode": "overlap",
              "grad_accum": 2, "bucket_mb": 1.0, "flags": ["--zero", "1"]}
    assert configuration_flags(config, settings) == [
        "--dataset", "synthetic", "--model", "net", "--device", "cpu", "--grad-sync", "custom", "--norm", "custom",
        "--grad-accum", "2", "--batch-size", "32", "--epochs", "3", "--seed", "0", "--train-size", "2048",
        "--val-size", "512", "--sync-mode", "overlap", "--bucket-mb", "1.0", "--zero", "1"]
