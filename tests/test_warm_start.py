"""trainer/warm_start.py (--warm-restarts) driven as torchrun drives it, without torch: a small agent process starts
a worker script once per attempt with torchrun's per-attempt variables, and the worker's first start keeps a zygote
(nothing preloaded: the mechanism, not torch's import, is under test here; tests/test_ddp_cifar100.py runs the
trainer's own warm restart under torchrun against an uninterrupted run, and the replica groups' fault scenarios run
warm)."""
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the worker: what it does at each attempt is read from a plan file (its command line and environment must be the
# same at every attempt, as torchrun's are); it tells where it runs, then exits with a code, is signalled, or waits
WORKER = f"""
import json, os, signal, sys, threading, time
sys.path.insert(0, {ROOT!r})
import trainer
from trainer import warm_start
LOADED = time.time()  # module state: a restart forked by the zygote has the first start's
if __name__ == "__main__":
    warm_start.serve_restart(sys.argv, time.time())
    if os.environ.get("WARM_TEST_THREAD"):  # a second thread before the fork: warm restarts off
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    warm_start.keep_zygote(sys.argv, preload=())
    action = json.load(open(sys.argv[1]))[int(os.environ["TORCHELASTIC_RESTART_COUNT"])]["action"]
    if action == "wait":  # (before it says where it runs: the agent's signal may follow at once)
        signal.signal(signal.SIGTERM, lambda *_: (os.write(1, b"terminated\\n"), os._exit(5)))
    print(json.dumps({{"pid": os.getpid(), "ppid": os.getppid(), "loaded": LOADED, "forked": trainer.FORKED,
                      "argv": sys.argv[1:], "cwd": os.getcwd()}}), flush=True)
    if action == "wait":
        time.sleep(60)
    elif action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(int(action))
"""

# the agent: torchrun's part, one attempt after the other; with "signal", it sends that signal to the process it
# started (or to the child a zygote forked for it, or to that zygote) once the worker runs, and notes whether the
# child outlives it
AGENT = f"""
import json, os, subprocess, sys, time
sys.path.insert(0, {ROOT!r})
from trainer import warm_start
worker, plan_file = sys.argv[1], sys.argv[2]
results = []
for attempt, step in enumerate(json.load(open(plan_file))):
    env = dict(os.environ, TORCHELASTIC_MAX_RESTARTS="9", TORCHELASTIC_RESTART_COUNT=str(attempt),
               TORCHELASTIC_ERROR_FILE=f"/tmp/error-{{attempt}}", RANK="0", LOCAL_RANK="0", **step.get("env", {{}}))
    command = [sys.executable, worker, plan_file, "--warm-restarts"]
    if step.get("shell"):  # not the agent's own child
        command = ["sh", "-c", " ".join(command) + "; exit $?"]
    process = subprocess.Popen(command, env=env, cwd=step.get("cwd"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    served, outlived, zygote = None, None, None
    if "signal" in step:
        first = process.stdout.readline()
        served = warm_start.served(os.getpid(), 0, process.pid)
        zygote = warm_start.zygote(os.getpid(), 0)
        target = {{"child": served, "zygote": zygote}}
        os.kill(target.get(step.get("to"), process.pid), step["signal"])
    out, err = process.communicate(timeout=60)
    if "signal" in step:
        out = first + out
        deadline = time.monotonic() + 10
        while served is not None and os.path.exists(f"/proc/{{served}}") and time.monotonic() < deadline:
            time.sleep(0.02)
        outlived = served is not None and os.path.exists(f"/proc/{{served}}")
    lines = out.splitlines()
    results.append({{"code": process.returncode, "where": json.loads(lines[0]) if lines else None,
                    "out": lines[1:], "err": err, "served": served, "outlived": outlived,
                    "zygote": zygote}})
print(json.dumps({{"agent": os.getpid(), "attempts": results}}))
"""


def run_agent(tmp_path, plan, **env):
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    done = subprocess.run([sys.executable, str(tmp_path / "agent.py"), str(tmp_path / "worker.py"),
                           str(tmp_path / "plan.json")], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH="", **env))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    return report["agent"], report["attempts"]


def gone_within(pid, seconds=10.0):
    deadline = time.monotonic() + seconds
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    return not os.path.exists(f"/proc/{pid}")


def test_a_restart_is_forked_by_the_zygote_and_its_thin_process_ends_as_it_does(tmp_path):
    """Each restart is the zygote's child, with the first start's module state but the restart's own command line,
    folder, streams and environment; the process the agent started ends as the child did (its exit code; killed by
    the same signal); the agent's SIGTERM reaches the child; a SIGKILLed thin process takes its child with it; a
    restart from another environment, or not the agent's own child, starts cold and says why in one line; the zygote
    ends with its agent."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    agent, attempts = run_agent(tmp_path, [
        {"action": "1"},  # the first start: keeps the zygote, then fails
        {"action": "3", "cwd": str(elsewhere)},  # a restart, served in another folder
        {"action": "term"},  # a restart killed by SIGTERM
        {"action": "wait", "signal": 15},  # the agent stops it: SIGTERM, passed on
        {"action": "wait", "signal": 9},  # the thin process SIGKILLed
        {"action": "wait", "signal": 9, "to": "child"},  # the child SIGKILLed (a fault injector's kill)
        {"action": "0", "env": {"WARM_TEST_OTHER": "1"}},  # another environment: cold
        {"action": "0", "shell": True},  # not the agent's child: cold
        {"action": "0"},  # served again
    ])
    first, served, cold = attempts[0], [attempts[i] for i in (1, 2, 3, 4, 5, 8)], attempts[6:8]
    assert first["code"] == 1 and first["where"]["ppid"] == agent and first["where"]["forked"] is None
    zygote = served[0]["where"]["ppid"]
    for attempt in served:
        where = attempt["where"]
        assert where["ppid"] == zygote != agent and where["loaded"] == first["where"]["loaded"]
        assert where["forked"] is not None and where["argv"] == first["where"]["argv"]
        assert "is warm: forked by the zygote" in attempt["err"] and attempt["err"].count("\n") == 1, attempt["err"]
    assert served[0]["code"] == 3 and served[0]["where"]["cwd"] == str(elsewhere)
    assert served[1]["code"] == -15  # killed by SIGTERM, as its thin process then is
    assert served[2]["code"] == 5 and served[2]["out"] == ["terminated"]  # SIGTERM passed on, the child's exit
    assert served[3]["code"] == -9 and served[3]["served"] == served[3]["where"]["pid"] and not served[3]["outlived"]
    assert served[3]["zygote"] == zygote  # the zygote found by its socket (warm_start.zygote)
    assert served[4]["code"] == -9  # the child SIGKILLed: its thin process ends by SIGKILL too
    assert served[5]["code"] == 0
    for attempt, said in zip(cold, ("worker.py: note: --warm-restarts: this restart starts cold: another "
                                    "environment", "")):  # (a process whose parent is not the agent asks none)
        assert attempt["code"] == 0 and attempt["where"]["forked"] is None
        assert attempt["where"]["loaded"] != first["where"]["loaded"]
        assert attempt["err"].strip() == said
    assert gone_within(zygote)  # its agent has ended, and so has every child of its own


def test_a_worker_of_more_than_one_thread_keeps_no_zygote_and_says_so(tmp_path):
    """A fork copies only the calling thread: a first start that runs two keeps no zygote (one line), and its
    restarts start cold."""
    agent, (first, restart) = run_agent(tmp_path, [{"action": "1"}, {"action": "0"}], WARM_TEST_THREAD="1")
    assert first["err"].strip().startswith("worker.py: note: --warm-restarts is off: this process runs 2 threads")
    assert restart["code"] == 0 and restart["where"]["ppid"] == agent and restart["where"]["forked"] is None



def test_a_restart_whose_zygote_is_killed_ends_and_takes_its_child_with_it(tmp_path):
    """The zygote SIGKILLed while it serves a restart: the thin process cannot learn how its child ends, so it says
    so in one line, kills the child (none may outlive it: torchrun's next restart would meet it as a second claimant
    of its replica group) and fails."""
    _, (first, restart) = run_agent(tmp_path, [{"action": "1"}, {"action": "wait", "signal": 9, "to": "zygote"}])
    assert restart["code"] == 1 and restart["served"] == restart["where"]["pid"] and not restart["outlived"]
    assert restart["err"].splitlines()[-1] == ("worker.py: error: --warm-restarts: the zygote that forked this worker "
                                               "is gone")
