"""benchmarks/gpu_checks.py without a GPU: its plan against docs/gpu.md and the scripts' own parsers, the budget,
stopping a check with everything it started, and one whole run of stand-in checks (small Python processes that do
not import torch) down to the summary, the table and --out's three files."""
import json
import os
import re
import sys
import tarfile

import pytest
import torch
from torch.distributed.run import get_args_parser

import bn_benchmark
import training_benchmark
from benchmarks import allreduce_benchmark, gpu_checks, zero_benchmark
from benchmarks.gpu_checks import Check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root (this file: tests/)
ORDER = ["pytest-fused", "pytest-cuda", "bn-grid-2xgloo", "bn-grid-1xnccl", "bn-resnet50-1xnccl", "bn-resnet50-2xgloo",
         "training-quick", "zero-vit", "zero-gpt2", "zero-precision-gpt2", "zero-hybrid-gpt2", "zero-resnet50",
         "imagenet", "allreduce-cpu"]


def documented_commands() -> list[str]:
    """The command lines of docs/gpu.md's code blocks, less the one command that runs them all."""
    commands, fenced = [], False
    for line in open(os.path.join(ROOT, "docs", "gpu.md")).read().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and line.strip() and not line.startswith("#") and "benchmarks.gpu_checks" not in line:
            commands.append(line.strip())
    return commands


def test_docs_gpu_md_lists_exactly_the_plans_commands_and_names_every_check():
    page = open(os.path.join(ROOT, "docs", "gpu.md")).read()
    commands = [check.command for check in gpu_checks.plan()]
    assert documented_commands() == commands  # the same commands, in the same order
    assert "python3 -m benchmarks.gpu_checks" in page
    assert all(f"| `{check.name}` |" in page for check in gpu_checks.plan())


def test_the_plan_runs_the_fused_kernels_first_and_the_cpu_all_reduce_last():
    checks = gpu_checks.plan("gpu-h100-80gb-hbm3", "16")
    assert [check.name for check in checks] == ORDER
    assert checks[0].argv[-3] == gpu_checks.FUSED_TEST and "--deselect" in checks[1].argv
    test_file = open(os.path.join(ROOT, "test_syncbn.py")).read()
    assert "def test_fused_kernels_on_cuda_match_float64_batchnorm(" in test_file
    for check in checks:
        assert 0 < check.estimate_s < check.timeout_s and not any(" " in arg for arg in check.argv), check.name
        for path in check.writes + check.may_write:  # under results/, named by the GPU (the CPU's: by its cores)
            assert re.fullmatch(r"results/[\w.-]+-(gpu-h100-80gb-hbm3|cpu-16core)(-\dx(gloo|nccl))?\.json", path), path
        if check.argv[2] == "pytest":
            assert check.junit.startswith("results/gpu-checks-h100-80gb-hbm3/") and check.junit in check.argv
        else:
            assert check.writes and check.writes[0] in check.argv


def test_every_check_is_accepted_by_its_scripts_own_parser(monkeypatch):
    """The plan cannot be run here: each command is parsed instead, as on a machine with one GPU, by torchrun's
    parser and the script's, so a flag the script lacks or refuses fails now, not in the lent minutes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(zero_benchmark, "machine_tag", lambda device: "gpu-test")  # it names its file before --json
    parsers = {"training_benchmark.py": training_benchmark.parse_args,
               "benchmarks.zero_benchmark": zero_benchmark.parse_args,
               "benchmarks.allreduce_benchmark": allreduce_benchmark.parse_args}
    parsed = 0
    for check in gpu_checks.plan():
        argv = list(check.argv)
        if argv[0] == "torchrun":
            launch = get_args_parser().parse_args(argv[1:])
            assert launch.standalone and launch.training_script == "bn_benchmark.py"
            script, args = launch.training_script, launch.training_script_args
        elif argv[1] == "-m":
            script, args = argv[2], argv[3:]
        else:
            script, args = argv[1], argv[2:]
        if script == "pytest":
            continue
        if script == "bn_benchmark.py":  # it reads sys.argv
            monkeypatch.setattr(sys, "argv", [script, *args])
            bn_benchmark.parse_args()
        else:
            parsers[script](args)
        parsed += 1
    assert parsed == len(ORDER) - 2


def stand_in(name: str, estimate_s: float, timeout_s: float | None = None, code: str = "pass",
             needs_gpu: bool = False, **fields) -> Check:
    """A check that runs ``code`` in a Python process of its own (torch is not imported: a few tens of ms)."""
    return Check(name, f"the {name} check", ("python3", "-c", code), estimate_s, timeout_s or 2 * estimate_s,
                 needs_gpu=needs_gpu, **fields)


def test_the_budget_runs_what_fits_in_order_and_records_every_other_check_with_its_reason():
    """Budget 100 s: a (60 expected) runs for 50; b (90) no longer fits; c (30) does and runs for 30; d (60) does not;
    e (10, its own timeout 60) runs with the 20 s left and is stopped by the budget's end; f finds nothing left.
    The --only and no-GPU skips are recorded too: every check has a record, in the plan's order."""
    now = [0.0]
    takes = {"a": 50, "c": 30, "e": 20}
    given = {}

    def run_one(check, timeout_s):
        given[check.name] = timeout_s
        now[0] += takes[check.name]
        status = "timeout" if check.name == "e" else "passed"
        return {"name": check.name, "status": status, "reason": status, "wall_s": takes[check.name], "json": []}

    checks = [stand_in("a", 60), stand_in("b", 90), stand_in("not-named", 1), stand_in("c", 30),
              stand_in("gpu", 1, needs_gpu=True), stand_in("d", 60), stand_in("e", 10, 60), stand_in("f", 1)]
    seen = []
    records = gpu_checks.run_plan(checks, 100.0, run_one, only={"a", "b", "c", "d", "e", "f", "gpu"},
                                  have_gpu=False, clock=lambda: now[0], done=lambda r: seen.append(len(r)))
    by_name = {r["name"]: r for r in records}
    assert [r["name"] for r in records] == [c.name for c in checks] and seen == list(range(1, len(checks) + 1))
    assert [by_name[n]["status"] for n in "abcdef"] == ["passed", "skipped", "passed", "skipped", "timeout", "skipped"]
    assert by_name["b"]["reason"] == by_name["d"]["reason"] == by_name["f"]["reason"] == "budget"
    assert by_name["b"]["detail"] == "50 s of the budget left, 90 s expected"
    assert by_name["e"]["reason"] == "budget"  # cut by the budget's end, not by its own timeout
    assert given == {"a": 100, "c": 50, "e": 20}  # each its own timeout or what was left, the smaller
    assert by_name["not-named"]["reason"] == "--only" and by_name["gpu"]["reason"] == "no GPU"


def test_after_an_interrupted_check_nothing_more_runs():
    def run_one(check, timeout_s):
        return {"name": check.name, "status": "timeout", "reason": "interrupted", "wall_s": 1.0, "json": []}

    checks = [stand_in("a", 1), stand_in("b", 1), stand_in("c", 1)]
    records = gpu_checks.run_plan(checks, 100.0, run_one, only={"a", "c"})
    assert [(r["status"], r["reason"]) for r in records] == [("timeout", "interrupted"), ("skipped", "--only"),
                                                            ("skipped", "interrupted")]
    assert gpu_checks.exit_status(records) == 1 and gpu_checks.exit_status(records[1:]) == 0


def test_a_check_past_its_timeout_is_stopped_with_every_process_it_started(tmp_path):
    """Its child in a session of its own (as torchrun starts its workers) is stopped too. The timeout leaves the
    check time to start Python and its child and print the child's pid on a loaded machine (0.5 s did not: the
    check was stopped before it printed)."""
    code = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)'], start_new_session=True); print(child.pid, flush=True); time.sleep(60)")
    record = gpu_checks.run_check(stand_in("sleeper", 1, code=code), 3.0, str(tmp_path / "sleeper.log"))
    assert record["status"] == "timeout" and record["reason"] == "timeout" and record["wall_s"] < 10
    assert record["rc"] == -15  # SIGTERM was enough
    assert not gpu_checks.alive(int(record["output_tail"].split()[-1]))


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" errors="0"
failures="1" skipped="1" tests="3" time="1.0"><testcase classname="test_syncbn" name="test_kernels[shape0-True]"
time="0.25" /><testcase classname="tests.test_gradsync" name="test_ring_on_cuda" time="0.5"><failure
message="assert 1.0 &lt;= 1e-05">long traceback</failure></testcase><testcase classname="test_syncbn"
name="test_on_gpu" time="0.000"><skipped type="pytest.skip" message="needs a CUDA GPU">test_syncbn.py:744: needs a
CUDA GPU</skipped></testcase></testsuite></testsuites>"""


def test_a_whole_run_writes_the_summary_the_table_and_three_files_for_out(tmp_path, monkeypatch, capsys):
    """Stand-in checks, run as a GPU machine would run the plan: one passes and writes its JSON and JUnit XML, one
    fails, one exits 0 without its JSON, one does not fit in the budget."""
    (tmp_path / "results").mkdir()
    json_written = "results/bn-gpu-test-1xnccl.json"
    checks = [
        stand_in("writes", 1, code=f"import json; json.dump({{'rows': []}}, open({json_written!r}, 'w')); "
                                   f"open('results/gpu-checks-test/x.xml', 'w').write({JUNIT!r})",
                 writes=(json_written,), junit="results/gpu-checks-test/x.xml"),
        stand_in("fails", 1, code="print('a line of output'); raise SystemExit(3)"),
        stand_in("no-json", 1, writes=("results/never.json",)),
        stand_in("too-long", 1000),
    ]
    monkeypatch.setattr(gpu_checks, "ROOT", str(tmp_path))
    monkeypatch.setattr(gpu_checks, "plan", lambda tag="gpu-<name>", cores="<cores>": checks)
    monkeypatch.setattr(gpu_checks, "probe_machine", lambda: {
        "device": "cuda", "tag": "gpu-test", "machine": {"gpu": "Test GPU"}, "nvidia_smi": None,
        "versions": {"torch": "2.11.0", "triton": "3.6.0"}})
    out = tmp_path / "out"
    records = gpu_checks.main(["--budget-s", "60", "--out", str(out), "--commit", "abc123"])

    assert [(r["name"], r["status"], r.get("reason")) for r in records] == [
        ("writes", "passed", None), ("fails", "failed", "exit 3"),
        ("no-json", "failed", "exit 0 but wrote no results/never.json"), ("too-long", "skipped", "budget")]
    summary = json.loads((tmp_path / "results" / "gpu-checks-test.json").read_text())
    assert (summary["commit"], summary["versions"]["triton"], summary["budget_s"]) == ("abc123", "3.6.0", 60)
    written, failed = summary["checks"][0], summary["checks"][1]
    assert written["json"] == [json_written] and written["rc"] == 0 and written["timeout_s"] == 2
    assert written["tests"] == [
        {"test": "test_syncbn.py::test_kernels[shape0-True]", "outcome": "passed", "seconds": 0.25},
        {"test": "tests/test_gradsync.py::test_ring_on_cuda", "outcome": "failed", "seconds": 0.5,
         "message": "assert 1.0 <= 1e-05"},
        {"test": "test_syncbn.py::test_on_gpu", "outcome": "skipped", "seconds": 0.0, "message": "needs a CUDA GPU"}]
    assert failed["output_tail"].endswith("a line of output\n") and failed["rc"] == 3
    assert sorted(os.listdir(out)) == ["gpu-checks-test.json", "gpu-checks-test.log", "gpu-checks-test.tar.gz"]
    with tarfile.open(out / "gpu-checks-test.tar.gz") as tar:
        members = set(tar.getnames())
    assert {"results/gpu-checks-test.json", json_written, "results/gpu-checks-test/x.xml",
            "results/gpu-checks-test/writes.log", "results/gpu-checks-test/fails.log"} <= members
    log = (out / "gpu-checks-test.log").read_text()
    assert "===== fails: failed, exit 3" in log and "a line of output" in log
    printed = capsys.readouterr().out
    assert re.search(r"writes +passed +[\d.]+  1 passed, 1 failed, 1 skipped; results/bn-gpu-test-1xnccl.json", printed)
    assert "to run them: python3 -m benchmarks.gpu_checks --only too-long" in printed and "--only too-long" in log


def test_bad_flags_are_refused_in_one_line(capsys):
    for flags, message in ((["--only", "pytest-fused,nope"], "--only takes names from pytest-fused,"),
                           (["--budget-s", "0"], "--budget-s must be positive")):
        with pytest.raises(SystemExit):
            gpu_checks.parse_args(flags)
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in error
