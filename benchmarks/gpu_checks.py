"""Every check docs/gpu.md lists, as one command for a GPU machine: run in order of value within a time budget.

    python3 -m benchmarks.gpu_checks [--budget-s 330] [--out DIR] [--only NAME,...] [--list] [--commit SHA]

A GPU machine is lent to this project now and then, for 15 minutes of device time in all: its start-up (1-2
minutes) and one rerun included, which leaves about 330 s of checks a call. So the checks run one at a time, most
valuable first: the CUDA tests (the fused SyncBatchNorm Triton kernels' test before anything else: they have never
run on a GPU), SyncBatchNorm's speed against PyTorch's, the trainer against DDP, ZeRO's stages against FSDP2,
ResNet-50 at ImageNet scale, and last the CPU all-reduce, which needs the machine's 16 cores and not its GPU.

Each check is a process of its own (torchrun where the script is a torchrun job), in a session of its own, started
from the repository's root with its output (stdout and stderr together) in a log; one that crashes the GPU or hangs
takes nothing after it down. Budget: a check runs only if its estimate (the time expected on one H100, its
start-up included) fits in what is left of --budget-s, and is stopped at its own timeout or at the budget's end,
whichever comes first (SIGTERM to its process group and to every process below it, torchrun's workers included,
which run in sessions of their own; SIGKILL 10 s later). A check that does not fit is recorded as skipped
("budget") and a later, shorter one may still use the time; the run prints the --only line that runs what was
skipped. Where a script's default size would take minutes on this machine, the check runs it smaller, and its
entry (--list) says how and why.

What it writes: each check's JSON under results/, named by the GPU (measure.machine.machine_tag:
results/bn-gpu-<name>-2xgloo.json on an "NVIDIA H100 80GB HBM3" has <name> = h100-80gb-hbm3); each check's log and
the pytest checks' JUnit XML under results/gpu-checks-<name>/; and results/gpu-checks-<name>.json: the machine, the
torch, CUDA, Triton, torchvision and numpy versions, nvidia-smi's line, the commit (git's HEAD, or --commit where the
copy has no git history), and per check its command, exit code, wall seconds, status (passed, failed, timeout, or
skipped and why), the JSON it wrote, the last 3000 characters of its output and, for pytest, each test's outcome.
``--out DIR`` also copies everything into DIR as three files (a lent machine gives back only a few): the summary
JSON, one .tar.gz of every JSON, log and XML (paths from the repository's root: unpack it there), and the full log,
all three rewritten after every check, so a run cut off from outside still leaves what it had done. SIGTERM stops
the running check as its timeout would and ends the run. A short table closes it; the exit status is 1 if a check
that ran failed or timed out, else 0.

On a machine without a GPU the checks that need one are skipped ("no GPU"): ``--only pytest-fused,pytest-cuda``
runs the plumbing for real on a CPU (the CUDA tests skip, those on fake CUDA tensors run).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root (this file: benchmarks/)
DEFAULT_BUDGET_S = 330.0  # 15 minutes of device time, less 1-2 minutes of start-up, halved to leave a rerun
TAIL_CHARS = 3000  # the end of each check's output kept in the summary
STOP_GRACE_S = 10.0  # between SIGTERM and SIGKILL: torchrun passes SIGTERM on to its workers and waits for them
FUSED_TEST = "test_syncbn.py::test_fused_kernels_on_cuda_match_float64_batchnorm"


@dataclass(frozen=True)
class Check:
    """One command of the plan. ``argv`` is as docs/gpu.md shows it (python3 and torchrun by name, the file names
    with the GPU's name in them); ``estimate_s`` the wall time expected on one H100, its start-up included;
    ``writes`` the JSON files it must write, ``may_write`` those it writes only on some machines."""
    name: str
    what: str
    argv: tuple[str, ...]
    estimate_s: float
    timeout_s: float
    writes: tuple[str, ...] = ()
    may_write: tuple[str, ...] = ()
    sizes: str = ""  # where the script's defaults were made smaller, how and why
    env: dict[str, str] = field(default_factory=dict)
    junit: str | None = None  # a pytest check's JUnit XML: each test's outcome
    needs_gpu: bool = True

    @property
    def command(self) -> str:
        """The command as a person types it (its environment first); no argument holds a space."""
        return " ".join([f"{key}={value}" for key, value in self.env.items()] + list(self.argv))


def plan(tag: str = "gpu-<name>", cores: str = "<cores>") -> list[Check]:
    """The checks in the order they run, on a machine whose measure.machine.machine_tag is ``tag``
    (gpu-h100-80gb-hbm3; on a CPU cpu-<cores>core) and which has ``cores`` CPU cores (the placeholders: as docs/gpu.md
    shows them)."""
    return [*test_checks(tag), *benchmark_checks(tag), *zero_checks(tag), *machine_checks(tag, cores)]


def test_checks(gpu: str) -> list[Check]:
    """The CUDA tests: the fused kernels alone first, then the others."""
    run_dir = f"results/{run_name(gpu)}"
    # The CUDA tests record their worst errors in a file of the GPU's own, beside the CPU's
    # results/syncbn-test-errors.json (test_syncbn.py writes the file SYNCBN_ERRORS_JSON names, and none without it).
    test_errors = {"SYNCBN_ERRORS_JSON": f"results/syncbn-test-errors-{gpu}.json"}
    pytest = ("python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs")
    return [
        Check("pytest-fused", "SyncBatchNorm's fused Triton kernels on the GPU, world of one, against nn.BatchNorm "
              "in float64 (output, gradients, running statistics; float32, float16, bfloat16; channels-last, "
              "contiguous and 2-D): the kernels' first run on a GPU, alone in its process so that a fault in them "
              "takes no other test down",
              (*pytest, FUSED_TEST, "--junitxml", f"{run_dir}/pytest-fused.xml"), 60, 180,
              may_write=(test_errors["SYNCBN_ERRORS_JSON"],), env=test_errors, junit=f"{run_dir}/pytest-fused.xml",
              sizes="Triton compiles each kernel for each dtype and layout on first use: most of the minute",
              needs_gpu=False),
        Check("pytest-cuda", "the other CUDA tests: two ranks over gloo on the GPU against nn.BatchNorm2d and "
              "nn.SyncBatchNorm, no host-device sync, the ring's CUDA buckets through host memory, and the "
              "fake-tensor traces of the CUDA paths (-k cuda)",
              (*pytest, "-k", "cuda", "--deselect", FUSED_TEST, "--junitxml", f"{run_dir}/pytest-cuda.xml"), 60,
              180, may_write=(test_errors["SYNCBN_ERRORS_JSON"],), env=test_errors,
              junit=f"{run_dir}/pytest-cuda.xml", needs_gpu=False),
    ]


def benchmark_checks(gpu: str) -> list[Check]:
    """SyncBatchNorm's benchmarks and the trainer's, on the GPU."""
    return [
        Check("bn-grid-2xgloo", "SyncBatchNorm forward + backward against nn.SyncBatchNorm, the (N, C) grid, two "
              "ranks sharing the GPU over gloo: time and extra memory",
              ("torchrun", "--standalone", "--nproc_per_node", "2", "bn_benchmark.py", "--device", "cuda",
               "--iters", "400", "--json", f"results/bn-{gpu}-2xgloo.json"), 40, 120,
              (f"results/bn-{gpu}-2xgloo.json",),
              sizes="--iters 400 (default 2000): a call is ~3 ms over gloo, so 2000 x 8 sizes x 2 would be ~1.5 "
                    "minutes; 400 calls in 10 alternating rounds still give a steady median"),
        Check("bn-grid-1xnccl", "the same grid, one rank over nccl: the per-call cost of ours against "
              "nn.SyncBatchNorm with nothing to communicate",
              ("torchrun", "--standalone", "--nproc_per_node", "1", "bn_benchmark.py", "--device", "cuda",
               "--iters", "1000", "--json", f"results/bn-{gpu}-1xnccl.json"), 25, 90,
              (f"results/bn-{gpu}-1xnccl.json",),
              sizes="--iters 1000 (default 2000): calls of 0.2-1 ms, 1000 of them per size and side"),
        Check("bn-resnet50-1xnccl", "SyncBatchNorm on ResNet-50's five activation shapes (batch 128, bf16, "
              "channels-last) against cuDNN's BatchNorm2d and nn.SyncBatchNorm, beside the memory-bandwidth floor",
              ("torchrun", "--standalone", "--nproc_per_node", "1", "bn_benchmark.py", "--shapes", "resnet50",
               "--device", "cuda", "--json", f"results/bn-resnet50-{gpu}-1xnccl.json"), 25, 90,
              (f"results/bn-resnet50-{gpu}-1xnccl.json",)),
        Check("bn-resnet50-2xgloo", "the same shapes, 2 ranks x 64 over gloo on the one GPU",
              ("torchrun", "--standalone", "--nproc_per_node", "2", "bn_benchmark.py", "--shapes", "resnet50",
               "--device", "cuda", "--iters", "100", "--json", f"results/bn-resnet50-{gpu}-2xgloo.json"), 35, 120,
              (f"results/bn-resnet50-{gpu}-2xgloo.json",),
              sizes="--iters 100 (default 200): calls of 4-10 ms over gloo, 3 layers x 5 shapes"),
        Check("training-quick", "the trainer, 2 ranks over gloo on the GPU, the assignment's net, grad-accum 2 and "
              "1: ours (custom sync, our SyncBatchNorm; overlapped and after backward) against DDP + "
              "nn.SyncBatchNorm, step time, memory, accuracy",
              ("python3", "training_benchmark.py", "--quick", "--device", "cuda", "--json",
               f"results/training-{gpu}.json"), 130, 240, (f"results/training-{gpu}.json",),
              sizes="--quick as it is: 6 trainer runs of ~20 s each, mostly start-up (121 s on the H100 in "
                    "November)"),
    ]


def zero_check(gpu: str, check_name: str, what: str, flags: str, json_name: str, estimate_s: float, timeout_s: float,
               sizes: str) -> Check:
    """A zero_benchmark run on the GPU, its JSON named by the GPU and the processes."""
    path = f"results/{json_name}-{gpu}-{'4' if '--nprocs 4' in flags else '2'}xgloo.json"
    return Check(check_name, what, ("python3", "-m", "benchmarks.zero_benchmark", "--device", "cuda",
                                    *flags.split(), "--json", path), estimate_s, timeout_s, (path,), sizes=sizes)


def zero_checks(gpu: str) -> list[Check]:
    """ZeRO against FSDP2 on the GPU: ViT, GPT-2 small's shape (fp32, bf16 over fp32, hybrid), ResNet-50."""
    gpt2 = "--models gpt2 --nprocs 2 --grad-accums 1 --allreduces torch --repeats 1"
    zero = partial(zero_check, gpu)
    return [
        zero("zero-vit", "ZeRO stages 0-3 against FSDP2 (fully_shard, stage 3) on ViT-B/16 (86M parameters, "
             "32-pixel images), 2 ranks over gloo on the GPU, bf16 autocast: per stage the peak of "
             "torch.cuda.max_memory_allocated beside state_bytes, and step time",
             "--models vit_b_16 --nprocs 2 --grad-accums 1 --amp bf16 --batch-size 32 --allreduces torch "
             "--rows stage0,stage1,stage2,stage3,fsdp3", "zero-vit-b-16", 130, 300,
             "torch's collectives only, no DDP, ZeroRedundancyOptimizer, unsharded or FSDP2-stage-2 rows: 5 "
             "trainer runs instead of 14 (~25 s each); ResNet-50's rows are a check of their own, zero-resnet50"),
        zero("zero-gpt2", "GPT-2 small's shape (86M parameters with bytes for vocabulary, context 1024) on text "
             "cut from the standard library, bf16 autocast, stage 3 against FSDP2 (goal: at most 1.10x its step, "
             "at most its peak memory)",
             f"{gpt2} --amp bf16 --batch-size 8 --rows stage0,stage3,fsdp3", "zero-gpt2", 90, 240,
             "--allreduces torch --repeats 1 (the doc's 3 repeats of torch and ring: 15 runs of ~25 s): 3 runs, "
             "each row's median over 12 steps on a GPU of its own"),
        zero("zero-precision-gpt2", "bf16 weights over fp32 masters (--param-dtype bf16 --reduce-dtype fp32), "
             "stage 3 against FSDP2's MixedPrecisionPolicy(bf16, fp32) on the same shape (goal: at most 1.0x its "
             "step)",
             f"{gpt2} --batch-size 8 --rows stage0,stage3-bf16,fsdp3-bf16", "zero-precision-gpt2", 90, 240,
             "--allreduces torch --repeats 1, and no fp32 stage 3 row (zero-gpt2 has it): 3 runs instead of 12"),
        zero("zero-hybrid-gpt2", "hybrid sharding, 4 ranks on the one GPU as 2 replicas x 2 shards, stage 3 "
             "against FSDP2's HSDP (goal: at most 1.0x its step), with the bytes each rank sends inside its "
             "shard group and across replicas beside the formula",
             "--models gpt2 --nprocs 4 --grad-accums 1 --batch-size 4 --allreduces torch --repeats 1 "
             "--rows stage0,hybrid3,hsdp", "zero-hybrid-gpt2", 110, 300,
             "--allreduces torch --repeats 1, stage 3 only (stages 1 and 2's bytes are counted exactly on the "
             "CPU): 3 runs of 4 processes instead of 27"),
        zero("zero-resnet50", "ZeRO stages 0-3 against FSDP2 on ResNet-50 (25M parameters, 32-pixel images, our "
             "SyncBatchNorm), 2 ranks over gloo on the GPU, bf16 autocast: peak memory per stage, step time",
             "--models resnet50 --nprocs 2 --grad-accums 1 --amp bf16 --batch-size 32 --allreduces torch "
             "--rows stage0,stage1,stage2,stage3,fsdp3", "zero-resnet50", 100, 240,
             "as zero-vit: 5 runs instead of 14"),
    ]


def machine_checks(gpu: str, cores: str) -> list[Check]:
    """What the machine's size makes worth measuring: ImageNet's step on the GPU, the all-reduces on its cores."""
    return [
        Check("imagenet", "where a ResNet-50 step goes at ImageNet scale (224-pixel JPEGs, batch 128, bf16, "
              "channels-last, one process): every --norm custom|torch|local x --grad-sync custom|ddp pair against "
              "a plain loop on tensors already on the GPU",
              ("python3", "training_benchmark.py", "--imagenet", "--device", "cuda", "--steps", "20", "--json",
               f"results/imagenet-{gpu}.json"), 150, 360, (f"results/imagenet-{gpu}.json",),
              sizes="--steps 20 (default 40): the synthetic folder (steps + 3 x 128 JPEGs) and each run half as "
                    "long; the median of 20 steps of ~40-115 ms is steady on a GPU"),
        Check("allreduce-cpu", "the ring and the butterfly against gloo's all-reduce on a CPU with more cores than "
              "workers (2, 4, 8), and the ring's segment size: the Python/gloo hand-offs apart from the CPU "
              "contention of 2-core machines",
              ("python3", "-m", "benchmarks.allreduce_benchmark", "--workers", "2,4,8", "--sizes",
               "1000,100000,1000000,10000000", "--segment-sweep", "262144,1048576,4194304", "--json",
               f"results/allreduce-cpu-{cores}core.json"), 60, 180, (f"results/allreduce-cpu-{cores}core.json",),
              sizes="--sizes up to 1e7 (default 2.5e7 too), as the 16-core run of November", needs_gpu=False),
    ]


def run_name(tag: str) -> str:
    """gpu-checks-<name>: the summary's stem and the run folder's name (tag gpu-<name>, or the CPU's tag)."""
    return "gpu-checks-" + tag.removeprefix("gpu-")


# ----------------------------------------------------------------------------------------------------------
# The budget
# ----------------------------------------------------------------------------------------------------------
def skipped(check: Check, reason: str, detail: str) -> dict[str, Any]:
    return {"name": check.name, "command": check.command, "status": "skipped", "reason": reason, "detail": detail,
            "rc": None, "wall_s": 0.0, "json": [], "output_tail": ""}


def run_plan(checks: list[Check], budget_s: float, run_one: Callable[[Check, float], dict[str, Any]],
             only: set[str] | None = None, have_gpu: bool = True, clock: Callable[[], float] = time.monotonic,
             done: Callable[[list[dict[str, Any]]], None] = lambda records: None) -> list[dict[str, Any]]:
    """Each check in order: run_one(check, its timeout) while its estimate fits in what is left of ``budget_s``,
    else a record of why it was skipped; none is dropped. After a check interrupted from outside (SIGTERM, Ctrl-C)
    nothing more runs. ``done`` sees the records after each check."""
    started = clock()
    records: list[dict[str, Any]] = []
    for check in checks:
        left = budget_s - (clock() - started)
        if only is not None and check.name not in only:
            records.append(skipped(check, "--only", "not named by --only"))
        elif any(r.get("reason") == "interrupted" for r in records):
            records.append(skipped(check, "interrupted", "the run was interrupted before it"))
        elif check.needs_gpu and not have_gpu:
            records.append(skipped(check, "no GPU", "no CUDA GPU is visible"))
        elif check.estimate_s > left:
            records.append(skipped(check, "budget", f"{max(left, 0):.0f} s of the budget left, "
                                                    f"{check.estimate_s:.0f} s expected"))
        else:
            record = run_one(check, min(check.timeout_s, left))
            if record.get("reason") == "timeout" and check.timeout_s > left:
                record["reason"] = "budget"  # stopped by the budget's end, not by its own timeout
            records.append(record)
        done(records)
    return records


# ----------------------------------------------------------------------------------------------------------
# One check
# ----------------------------------------------------------------------------------------------------------
def runnable(argv: tuple[str, ...]) -> list[str]:
    """The plan's argv for this interpreter: python3 is this one, torchrun its torch.distributed.run."""
    if argv[0] == "python3":
        return [sys.executable, *argv[1:]]
    if argv[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    return list(argv)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
                children.setdefault(parent, []).append(int(entry))
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue += children.get(child, [])
    return found


def stop_process_tree(proc: subprocess.Popen) -> None:
    """SIGTERM to the check's process group and to every process below it (torchrun starts its workers in
    sessions of their own, and passes SIGTERM on to them), SIGKILL to whatever is left STOP_GRACE_S later. The
    family is read before anything ends: an orphan's parent is no longer the check."""
    family = set(descendants(proc.pid))
    for sig, grace_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        if proc.poll() is None:
            family |= set(descendants(proc.pid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        for pid in family:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (proc.poll() is None or any(map(alive, family))):
            time.sleep(0.2)
        if proc.poll() is not None and not any(map(alive, family)):
            return


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def junit_outcomes(path: str) -> list[dict[str, Any]]:
    """Each test case of a JUnit XML file: its id, outcome (passed, failed, error, skipped), seconds and, unless it
    passed, the message."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "").strip()[:500]
                break
        cases.append({"test": f"{module}.py::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time", 0.0)), **({"message": message} if message else {})})
    return cases


def written_since(path: str, began: float) -> bool:
    """Whether ``path`` (from the repository's root) was written at or after time.time() ``began``."""
    full = os.path.join(ROOT, path)
    return os.path.exists(full) and os.path.getmtime(full) >= began


def run_check(check: Check, timeout_s: float, log_path: str) -> dict[str, Any]:
    """Run one check from the repository's root, its output in ``log_path``, stopped after ``timeout_s``; its
    JSON files are those written while it ran (a file left by an earlier run is not its result)."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **check.env)  # unbuffered: a stopped check's log ends where it did
    # A second of slack: the kernel stamps files from a coarse clock, a few ms behind time.time()
    began, started = time.time() - 1.0, time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {check.command}\n")
        log.flush()
        proc = subprocess.Popen(runnable(check.argv), cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        stopped = None
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_process_tree(proc)
            stopped = "timeout"
        except KeyboardInterrupt:  # SIGTERM or Ctrl-C to this run: nothing of the check outlives it
            stop_process_tree(proc)
            stopped = "interrupted"
    wall_s = time.monotonic() - started
    with open(log_path, errors="replace") as f:
        output = f.read()
    written = [path for path in check.writes + check.may_write if written_since(path, began)]
    missing = [path for path in check.writes if path not in written]
    record = {"name": check.name, "command": check.command, "rc": proc.returncode, "wall_s": round(wall_s, 1),
              "timeout_s": round(timeout_s, 1), "json": written, "log": os.path.relpath(log_path, ROOT),
              "output_tail": output[-TAIL_CHARS:]}
    if stopped == "timeout":
        record.update(status="timeout", reason="timeout", detail=f"stopped after {timeout_s:.0f} s")
    elif stopped == "interrupted":
        record.update(status="timeout", reason="interrupted", detail=f"stopped after {wall_s:.0f} s: the run was "
                                                                      "interrupted (SIGTERM or Ctrl-C)")
    elif proc.returncode != 0:
        record.update(status="failed", reason=f"exit {proc.returncode}")
    elif missing:
        record.update(status="failed", reason=f"exit 0 but wrote no {', '.join(missing)}")
    else:
        record.update(status="passed")
    if check.junit and written_since(check.junit, began):
        record["junit"] = check.junit
        with contextlib.suppress(ElementTree.ParseError):
            record["tests"] = junit_outcomes(os.path.join(ROOT, check.junit))
    return record


# ----------------------------------------------------------------------------------------------------------
# The machine, the summary and the bundle
# ----------------------------------------------------------------------------------------------------------
# Run in a process of its own, so that this one never holds a CUDA context (the GPU may be in an exclusive mode).
PROBE = """
import json, torch
from measure.machine import machine_info, machine_tag
device = "cuda" if torch.cuda.is_available() else "cpu"
versions = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if device == "cuda" else None}
for module in ("triton", "torchvision", "numpy"):
    try:
        versions[module] = __import__(module).__version__
    except ImportError:
        versions[module] = None
print(json.dumps({"device": device, "tag": machine_tag(device), "machine": machine_info(device),
                  "versions": versions}))
"""


def probe_machine() -> dict[str, Any]:
    """The machine (measure.machine.machine_info), its tag, the versions of torch, CUDA, Triton, torchvision and
    numpy, and nvidia-smi's line (driver, memory, clocks, power limit) where there is one."""
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"gpu_checks: the machine probe (import torch, measure) failed: {last}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["nvidia_smi"] = None
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                                  "power.limit", "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
            found["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    return found


def git_commit(given: str | None) -> dict[str, Any]:
    """The commit checked: --commit, else git's HEAD and whether tracked files differ from it (None where the copy
    has no git history, as a copy of the working tree on a lent machine may not)."""
    def git(*args: str) -> str | None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
            if done.returncode == 0:
                return done.stdout.strip()
        return None
    head = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if head else None
    return {"commit": given or head, "commit_from": "--commit" if given else "git" if head else None,
            "dirty": None if given or status is None else bool(status)}


def write_summary(path: str, summary: dict[str, Any]) -> None:
    """results/gpu-checks-<name>.json, replaced whole (written aside, then renamed)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def bundle(out_dir: str, stem: str, summary_path: str, full_log: str, records: list[dict[str, Any]],
           run_dir: str) -> list[str]:
    """--out: the summary JSON, a .tar.gz of it with every JSON written and every log and JUnit XML of the run
    folder (paths from the repository's root), and the full log: three files, each replaced whole."""
    os.makedirs(out_dir, exist_ok=True)
    members = [summary_path] + [os.path.join(ROOT, path) for r in records for path in r["json"]]
    members += sorted(os.path.join(run_dir, name) for name in os.listdir(run_dir))
    targets = [os.path.join(out_dir, f"{stem}{suffix}") for suffix in (".json", ".tar.gz", ".log")]
    writers = (lambda tmp: shutil.copyfile(summary_path, tmp), lambda tmp: write_tar(tmp, members),
               lambda tmp: shutil.copyfile(full_log, tmp))
    for target, write in zip(targets, writers):
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".partial-")
        os.close(fd)
        try:
            write(tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
    return targets


def write_tar(path: str, members: list[str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for member in dict.fromkeys(members):  # each once, in order
            if os.path.isfile(member):
                tar.add(member, arcname=os.path.relpath(member, ROOT))


def table(records: list[dict[str, Any]]) -> str:
    """check, status, seconds, and what it wrote or why not: a line each."""
    lines = [f"{'check':<22} {'status':<9} {'seconds':>8}  detail"]
    for r in records:
        detail = ", ".join(r["json"]) if r["status"] == "passed" else r.get("reason", "")
        if r.get("tests"):
            outcomes = [test["outcome"] for test in r["tests"]]
            counts = ", ".join(f"{outcomes.count(o)} {o}" for o in dict.fromkeys(outcomes))
            detail = f"{counts}; {detail}" if detail else counts
        lines.append(f"{r['name']:<22} {r['status']:<9} {r['wall_s']:>8.1f}  {detail}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
def listing(checks: list[Check]) -> str:
    """--list: per check a comment (its name, estimate, timeout, what it checks, the sizes chosen) and its command,
    the command as docs/gpu.md gives it."""
    lines = []
    for check in checks:
        lines.append(f"# {check.name} (~{check.estimate_s:.0f} s, at most {check.timeout_s:.0f} s): {check.what}")
        if check.sizes:
            lines.append(f"#   sizes: {check.sizes}")
        lines.append(check.command)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds of checks in all (default {DEFAULT_BUDGET_S:.0f}): a check starts only if its "
                             "estimate fits in what is left, and is stopped at the budget's end")
    parser.add_argument("--out", default=None, help="also copy the summary, a .tar.gz of every JSON and log, and the "
                                                    "full log into this folder (three files)")
    parser.add_argument("--only", default=None, help="comma-separated names of the checks to run (--list names them)")
    parser.add_argument("--list", action="store_true", help="print the checks, their commands and sizes, and exit")
    parser.add_argument("--commit", default=None,
                        help="the commit this copy is of, recorded where the copy has no git history")
    args = parser.parse_args(argv)
    names = [check.name for check in plan()]
    if args.only is not None:
        args.only = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = sorted(args.only - set(names))
        if unknown or not args.only:
            parser.error(f"--only takes names from {','.join(names)}; got {','.join(unknown) or 'none'}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s:g}")
    return args


def say(line: str) -> None:
    print(line, flush=True)


def interrupted(signum: int, frame: Any) -> None:
    """SIGTERM (a lent machine's time running out) as Ctrl-C: the running check is stopped, the summary kept."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.list:
        print(listing(plan()))
        return []
    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        return run_all(args, argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_all(args: argparse.Namespace, argv: list[str] | None) -> list[dict[str, Any]]:
    """The run: the machine probed, the plan run within the budget, the summary, the table, --out's files."""
    probe = probe_machine()
    checks = plan(probe["tag"], str(os.cpu_count()))
    stem = run_name(probe["tag"])
    summary_path = os.path.join(ROOT, "results", f"{stem}.json")
    run_dir = os.path.join(ROOT, "results", stem)  # each check's log, the JUnit XML, the full log
    os.makedirs(run_dir, exist_ok=True)
    full_log = os.path.join(run_dir, f"{stem}.log")
    summary = {"benchmark": "gpu-checks",
               "command": " ".join(["python3", "-m", "benchmarks.gpu_checks", *(sys.argv[1:] if argv is None
                                                                                 else argv)]),
               "machine": probe["machine"], "machine_tag": probe["tag"], "versions": probe["versions"],
               "nvidia_smi": probe["nvidia_smi"], **git_commit(args.commit), "budget_s": args.budget_s,
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wall_s": 0.0, "checks": []}
    with open(full_log, "w") as f:
        f.write(json.dumps({key: value for key, value in summary.items() if key != "checks"}, indent=1) + "\n")
    say(f"gpu_checks on {probe['machine']['gpu'] or 'no GPU'} ({probe['tag']}), torch {probe['versions']['torch']}, "
        f"Triton {probe['versions']['triton']}; budget {args.budget_s:.0f} s")
    started = time.monotonic()

    def run_one(check: Check, timeout_s: float) -> dict[str, Any]:
        say(f"[{check.name}] {check.command}  (timeout {timeout_s:.0f} s)")
        record = run_check(check, timeout_s, os.path.join(run_dir, f"{check.name}.log"))
        say(f"[{check.name}] {record['status']} in {record['wall_s']:.1f} s"
            + (f" ({record['reason']})" if record["status"] != "passed" else "")
            + (f" -> {', '.join(record['json'])}" if record["json"] else ""))
        with open(full_log, "a") as f, open(os.path.join(ROOT, record["log"]), errors="replace") as log:
            f.write(f"\n===== {check.name}: {record['status']}, exit {record['rc']}, {record['wall_s']:.1f} s\n")
            f.write(log.read())
        return record

    def done(records: list[dict[str, Any]]) -> None:
        summary.update(checks=records, wall_s=round(time.monotonic() - started, 1))
        write_summary(summary_path, summary)
        if args.out:
            bundle(args.out, stem, summary_path, full_log, records, run_dir)

    try:
        records = run_plan(checks, args.budget_s, run_one, args.only, probe["device"] == "cuda", done=done)
    except KeyboardInterrupt:  # between checks: those not reached are recorded as such
        records = summary["checks"] + [skipped(check, "interrupted", "the run was interrupted before it")
                                       for check in checks[len(summary["checks"]):]]
    closing = table(records)
    left_out = [r["name"] for r in records if r["status"] == "skipped" and r["reason"] == "budget"]
    if left_out:
        closing += ("\nleft out for the budget; to run them: python3 -m benchmarks.gpu_checks --only "
                    + ",".join(left_out))
    say("\n" + closing)
    with open(full_log, "a") as f:
        f.write(f"\n{closing}\n")
    done(records)  # the closing table into --out's full log too
    return records


def exit_status(records: list[dict[str, Any]]) -> int:
    """0 when every check that ran passed (skipped ones aside), else 1."""
    return int(any(r["status"] in ("failed", "timeout") for r in records))


if __name__ == "__main__":
    sys.exit(exit_status(main()))
