"""benchmarks/fault_benchmark.py's kill schedule: it stops once the run's last step is committed (a kill after it
costs a restart that trains nothing, counted in the faulty run's wall time), read from a commit log's tail while the
run writes it."""
import json
import time

from benchmarks import fault_benchmark


def test_the_last_step_is_read_from_a_commit_logs_tail_being_written(tmp_path):
    path = tmp_path / "commits.jsonl"
    assert fault_benchmark.last_step(str(path)) == -1  # not written yet
    path.write_text(json.dumps({"run": "r"}) + "\n")
    assert fault_benchmark.last_step(str(path)) == -1  # no step yet
    lines = [json.dumps({"step": step, "participants": [0, 1, 2], "samples": "x" * 300}) for step in range(40)]
    path.write_text("\n".join(lines) + "\n" + lines[40 - 1][:50])  # (a line being written, cut)
    assert fault_benchmark.last_step(str(path)) == 39  # the tail's last whole entry, past 4 KB of others


def test_the_kills_stop_once_the_run_is_done():
    killed = []
    record = fault_benchmark.killing([(0.0, 0), (0.05, 1), (0.1, 2), (0.15, 0)], lambda g: killed.append(g) or [g],
                                     lambda: len(killed) == 2, time.time())  # done once the second kill is issued
    assert killed == [0, 1] and [entry["replica"] for entry in record] == [0, 1]
    late = fault_benchmark.killing([(0.0, 2)], lambda g: killed.append(g), lambda: True, time.time() - 1.0)
    assert late == [] and killed == [0, 1]  # a kill already due, the run done: not issued
