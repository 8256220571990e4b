"""Shared pytest fixtures: one intra-op thread for the session's own process, one LocalGroup per world size for the
whole session (rebuilt only if a case broke it), and a tiny image folder; and the processes test modules declare,
run in the background (tests/processes.py)."""
import gc
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
STARTUP = os.path.join(HERE, "tests", "startup")
# The interpreters the suite starts collect their young garbage as its workers do (tests/startup/sitecustomize.py
# says why); this process too, by the same file, from here on: the test modules' imports and its in-process tests.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [STARTUP, os.environ.get("PYTHONPATH")]))
runpy.run_path(os.path.join(STARTUP, "sitecustomize.py"))

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "tests"))

import processes  # noqa: E402
from harness import LocalGroup, stop_worker_server  # noqa: E402


# Modules that run after every other: their tests read what their processes (early_processes) left, so they only
# wait for those, which the background queue (tests/processes.py) runs beside the other tests, in this order, the
# longest first. A module with early processes not named here runs in its place, and its processes are queued first.
RUN_LAST = ("test_replica_faults", "test_async_checkpoint", "test_report", "test_sequential_print")


def pytest_collection_modifyitems(session, config, items):
    """RUN_LAST's modules after all others, in its order (a stable sort: each module's tests keep theirs)."""
    def place(item):
        name = getattr(getattr(item, "module", None), "__name__", "")
        return RUN_LAST.index(name) + 1 if name in RUN_LAST else 0
    items.sort(key=place)


def pytest_collection_finish(session):
    """The selected tests' modules that declare early_processes() have them queued now, in the order they run
    (tests/processes.py); not under --collect-only, which runs no test."""
    if session.config.option.collectonly:
        return
    modules = {item.module.__name__: item.module for item in session.items if reads_early_processes(item)}
    processes.queue(list(modules.values()))
    gc.freeze()  # what collection imported lives to the end: full collections of the session no longer walk it


def reads_early_processes(item) -> bool:
    """Whether the test reads its module's early processes: it uses the fixture that collects them, named in the
    module's EARLY_PROCESSES_FIXTURE (under -m "not slow", test_ddp_cifar100's in-process tests start no torchrun)."""
    module = getattr(item, "module", None)
    return hasattr(module, "early_processes") and module.EARLY_PROCESSES_FIXTURE in item.fixturenames


def pytest_sessionfinish(session):
    processes.stop_all()


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's shutdown frees what collection imported (frozen, extensions report it leaked)


# The trainer pins glibc's mmap threshold at 128 kB (--malloc-mmap-threshold: its resident set then reads what is
# alive), so in a worker whose heap is trimmed to the bone every block past it is a fresh mmap, faulted in page by
# page and unmapped when freed. The session's workers train hundreds of small runs and measure no resident set: a
# 128 MB pad at their heap's top serves those blocks from pages already mapped (most of a small run's page faults
# and much of its system time gone: tests/test_zero.py's system time 28 s at 64 MB, 16 s at 128, 256 and 512 MB;
# 16 MB left the stage-3 runs' faults as they were).
HEAP_TOP_PAD_MB = 128


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    """The session's own process computes on one intra-op thread, as each worker does: it works while the workers
    and the processes of their own use the 2 cores, and two threads there wait on each other (a reference computed
    beside 3 training processes took about 50x longer on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def local_group():
    """``local_group(n)`` gives a live N-process gloo group; the same one across tests and parametrized cases."""
    groups: dict[int, LocalGroup] = {}

    def get(world_size: int) -> LocalGroup:
        group = groups.get(world_size)
        if group is None or group.closed:
            group = groups[world_size] = LocalGroup(world_size, heap_top_pad_mb=HEAP_TOP_PAD_MB)
        return group

    yield get
    for group in groups.values():  # every worker of every group leaves at once, then each group is joined
        group.request_stop()
    for group in groups.values():
        group.close()


@pytest.fixture(scope="session", autouse=True)
def worker_server():
    """After the session's last group has closed (this fixture is set up first, so torn down last), the server the
    groups' workers are forked from stops too."""
    yield
    stop_worker_server()


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory):
    """40 training images (20 per rank: 5 micro-batches of 4, 3 steps an epoch with grad-accum 2) and 23 for
    validation (divisible by neither 2 nor 3), 8 classes, plus a text file that must be skipped."""
    from benchmarks import make_image_folder

    root = tmp_path_factory.mktemp("folder")
    make_image_folder.write_image_folder(str(root), classes=8, train_size=40, val_size=23, size=20, seed=3)
    (root / "train" / "class000" / "notes.txt").write_text("not an image: skipped, as ImageFolder does")
    return root
