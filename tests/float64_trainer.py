"""The trainer in float64, for tests whose runs are processes of their own (torchrun's workers) and are held to
one-process references at float64's precision: ``torchrun ... tests/float64_trainer.py FLAGS``; SIGUSR1 prints every
thread's stack (ReplicaRun.close, for a run past its deadline). Not a test file."""
import faulthandler
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_default_dtype(torch.float64)

import ddp_cifar100  # noqa: E402  (after the default dtype: the model and the data are made in it)

if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a run that does not end shows where it waits
    sys.exit(ddp_cifar100.main())
