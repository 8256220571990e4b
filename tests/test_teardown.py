"""utils.cleanup_distributed really ends the process group: no gloo thread is left to run into interpreter shutdown.

A gloo group that outlives destroy_process_group keeps its worker threads; one of them may still be freeing a
finished collective's tensors when Python finalizes, and a thread that asks for the GIL then is ended by
pthread_exit, whose unwinding through C++ destructors calls std::terminate ("terminate called without an active
exception", an abort after a finished run). utils imports torch.distributed.nn before any group exists so that
its default arguments cannot keep the group alive (see the comment there).
"""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root (this file: tests/)

# A world of one (no torchrun environment); the optimizer imports torch._dynamo, which imports torch.distributed.nn.
TEARDOWN = """
import os
import torch
import utils

def gloo_threads():
    names = [open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task")]
    return sorted(name for name in names if "gloo" in name)

utils.init_distributed(device="cpu")
torch.distributed.all_reduce(torch.ones(1))
torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
import torch.distributed.nn  # noqa: F401,E402  as later code may
print("while the group exists:", gloo_threads())
utils.cleanup_distributed()
print("after cleanup_distributed:", gloo_threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from Linux's /proc")
def test_no_gloo_thread_outlives_cleanup_distributed():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "TORCHELASTIC_RUN_ID")}
    proc = subprocess.run([sys.executable, "-c", TEARDOWN], capture_output=True, text=True, timeout=120,
                          cwd=HERE, env=dict(env, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    during, after = proc.stdout.splitlines()
    assert "pt_gloo_runloop" in during, proc.stdout  # the probe sees the group's threads while it lives
    assert after == "after cleanup_distributed: []", proc.stdout
