"""harness.py: what a LocalGroup reports when a worker dies."""
import os
import signal
import time

import pytest

import harness


def die_or_answer(rank: int, world_size: int, peer_raises: bool) -> str:
    """Rank 0 is killed by a signal, as a crash or the OOM killer would; rank 1 then fails as its peers would, or
    answers."""
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)
    if peer_raises:
        raise RuntimeError("Connection reset by peer (the echo of rank 0's death)")
    return "done"


@pytest.mark.parametrize("peer_raises", [True, False], ids=["peer-raises", "peer-answers"])
def test_a_worker_that_dies_is_named_with_its_exit_code(peer_raises):
    """A worker killed by a signal reports nothing; the WorkerError names it and its exit code beside its peer's
    traceback, rather than leaving only the peer's "Connection reset by peer" to guess from; and when nothing else
    fails, its death is the failure, not a TimeoutError at the end of the group's timeout."""
    with pytest.raises(harness.WorkerError) as failure, harness.LocalGroup(2, timeout_s=60) as group:
        group.run(die_or_answer, peer_raises)
    message = str(failure.value)
    assert ("Connection reset by peer (the echo" in message) == peer_raises
    assert f"--- rank 0 --- died, exit code {-signal.SIGKILL}" in message
