"""The trainer in float64, for tests whose runs are processes of their own (torchrun's workers) and are held to
one-process references at float64's precision: ``torchrun ... tests/float64_trainer.py FLAGS``; SIGUSR1 prints every
thread's stack (ReplicaRun.close, for a run past its deadline). With FLOAT64_TRAINER_PACE="SECONDS:FILE", each
optimizer step ends with SECONDS of sleep while FILE does not exist: a scenario whose events take a while on a slow
machine keeps the run from ending before they are over, and opens the gate (writes FILE) when they are. With
FLOAT64_TRAINER_RESTART_DELAY=SECONDS, a process torchrun restarted waits SECONDS before it starts: a restart slower
than the fault timeout (a machine that takes long to come back); with FLOAT64_TRAINER_RESTART_GATE=FILE, it waits until
FILE exists (a restart that comes back only once a scenario's events are over: a warm one is back in a fraction of a
second); with FLOAT64_TRAINER_JOIN_BARRIER=FOLDER, each group's first start, built and its checkpoint read, waits
there until every group of --replica-groups is (FOLDER/built-GROUP): its first quorum then finds them all, however
long a loaded machine takes to start one. Not a test file."""
import faulthandler
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer import warm_start  # noqa: E402  (imports no torch)

if __name__ == "__main__":  # as ddp_cifar100.py does, before torch is imported: a warm restart is served
    warm_start.serve_restart(sys.argv, time.time())
if "--coordinator" in sys.argv:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
import torch  # noqa: E402

torch.set_default_dtype(torch.float64)

import ddp_cifar100  # noqa: E402  (after the default dtype: the model and the data are made in it)
from trainer import faults  # noqa: E402

PACE = "FLOAT64_TRAINER_PACE"


def paced(at, seconds: float, gate: str):
    """trainer/faults.py's FaultPlan.at, then at the end of a step a sleep of ``seconds`` while ``gate`` does not
    exist."""
    def at_then_wait(plan: faults.FaultPlan, point: str, step: int) -> None:
        at(plan, point, step)
        if point == "after" and not os.path.exists(gate):
            time.sleep(seconds)
    return at_then_wait


def after_every_group(replica_groups, folder: str):
    """ddp_cifar100's ReplicaGroups, made once this group has said it is built (folder/built-GROUP) and every group
    of the run has (FLOAT64_TRAINER_JOIN_BARRIER): before it connects and asks its first quorum."""
    def made_after_every_group(parts, *args):
        config = parts.config
        if parts.ctx.rank == 0:
            open(os.path.join(folder, f"built-{config.replica_group}"), "w").close()
        while not all(os.path.exists(os.path.join(folder, f"built-{group}")) for group in range(config.replica_groups)):
            time.sleep(0.05)
        return replica_groups(parts, *args)
    return made_after_every_group


if __name__ == "__main__":
    warm_start.keep_zygote(sys.argv)  # after the default dtype: the zygote's children have it too
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a run that does not end shows where it waits
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        time.sleep(float(os.environ.get("FLOAT64_TRAINER_RESTART_DELAY", "0")))
        while not os.path.exists(os.environ.get("FLOAT64_TRAINER_RESTART_GATE", os.sep)):
            time.sleep(0.05)
    elif os.environ.get("FLOAT64_TRAINER_JOIN_BARRIER"):  # (the first start only)
        ddp_cifar100.ReplicaGroups = after_every_group(ddp_cifar100.ReplicaGroups,
                                                       os.environ["FLOAT64_TRAINER_JOIN_BARRIER"])
    if os.environ.get(PACE):
        seconds, gate = os.environ[PACE].split(":", 1)
        faults.FaultPlan.at = paced(faults.FaultPlan.at, float(seconds), gate)  # every plan's, this process's
    sys.exit(ddp_cifar100.main())
