"""sequential_print.py under torchrun: the exact bytes, the same on every run.

Every launch is started at once, in the background (early_processes, tests/processes.py: they are mostly
interpreter start-up and waiting on each other), and each test reads the runs it checks."""
import os
import sys

import pytest

import processes
import sequential_print

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root (this file: tests/)
SCRIPT = os.path.join(HERE, "sequential_print.py")

# a world of 1 is test_default_is_ten_iterations_in_a_world_of_one's; repeatability is shown at 2 processes;
# 4 is a ring whose ranks' two neighbours differ, and on 2 cores already queues every rank behind others (8 showed
# nothing 4 does not, for 4 interpreters more; 16 took 30 s of the suite's 5 minutes)
TORCHRUN_CASES = [(2, 10, 2), (4, 2, 1)]  # world size, iterations, runs


def expected_output(world_size: int, num_iter: int) -> str:
    iterations = ["".join(f"Process {rank}\n" for rank in range(world_size)) for _ in range(num_iter)]
    return "---\n".join(iterations)


def torchrun_command(world_size: int, num_iter: int) -> list[str]:
    # --standalone: torchrun's rendezvous binds a port the OS hands out, so concurrent runs never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}", SCRIPT,
            "--num-iter", str(num_iter), "--timeout", "60"]


EARLY_PROCESSES_FIXTURE = "runs"  # the fixture that collects them (conftest.py queues them for its tests)


def early_processes():
    """Every launch, by name: the torchrun cases' runs and the default run (run in the background:
    tests/processes.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    commands = {f"torchrun {w} {n} #{i}": (torchrun_command(w, n), env) for w, n, count in TORCHRUN_CASES
                for i in range(count)}
    commands["default"] = ([sys.executable, SCRIPT], env)
    return commands


@pytest.fixture(scope="module")
def runs():
    """Every launch's CompletedProcess, by name."""
    return processes.results_of(sys.modules[__name__], timeout=180)


def test_expected_output_shape():
    assert expected_output(2, 2) == "Process 0\nProcess 1\n---\nProcess 0\nProcess 1\n"
    assert expected_output(1, 1) == "Process 0\n"


@pytest.mark.slow
@pytest.mark.parametrize("world_size,num_iter,count", TORCHRUN_CASES)
def test_rank_ordered_output_is_exact_and_repeatable(runs, world_size, num_iter, count):
    for i in range(count):
        proc = runs[f"torchrun {world_size} {num_iter} #{i}"]
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout == expected_output(world_size, num_iter)


@pytest.mark.slow
def test_default_is_ten_iterations_in_a_world_of_one(runs):
    proc = runs["default"]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected_output(1, 10)


def test_negative_iterations_is_a_one_line_error(capsys):
    """Refused by argparse before any process group exists: the exit code 2 and the usage line, not a traceback (in
    this process: a launch of its own would add only an interpreter start)."""
    with pytest.raises(SystemExit) as exited:
        sequential_print.main(["--num-iter", "-1"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("error: --num-iter must be >= 0")
