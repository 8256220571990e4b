"""measure/: a process's children (measure.machine) and its memory (measure.memory) read from /proc."""
import os
import signal
import subprocess
import sys

from measure.machine import child_pids
from measure.memory import process_memory_mib


def test_a_process_s_children_and_its_memory_are_read_from_proc():
    """child_pids: the children running now; process_memory_mib: what a child wrote is its own (private), and
    private <= PSS <= RSS."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; block = bytearray(64 << 20); "
                              "print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # its 64 MiB written
        assert child.pid in child_pids(os.getpid())
        memory = process_memory_mib(child.pid)
        assert 64 <= memory["private"] <= memory["pss"] <= memory["rss"]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.pid not in child_pids(os.getpid())
